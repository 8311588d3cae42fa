"""Which exact attention path is fastest at each real size: SDPA, two fp32 GEMMs per head, or a plain batched GEMM.

    python -m bench.attention_paths                # both dtypes, the towers' window and frame sizes
    python -m bench.attention_paths --repeats 5 --json attention.json

Sizes are the towers' own: Qwen2.5-VL's 8x8-patch windows (64 tokens, 16 heads of 80) as many as a few photos
make, its full-attention frames (1,024 and 3,740 tokens), Qwen3-VL's frames (784 and 1,024 tokens, 16 heads of 72)
and Qwen2-VL's (1,024 tokens, heads of 80), plus 256, 512 and 2,048 tokens around the ends of the range where the
tower takes the GEMM path. Each path runs on the same q/k/v batch (segments of one length, as our attention plan
batches them); the error of each is against float64 SDPA. "sdpa" is PyTorch's kernel; "gemm-heads" is the
tower's CPU path for ``attention.GEMM_ATTENTION_LENGTHS`` (``attention.gemm_batched``: per segment and head, fp32
scores by oneDNN's linear, softmax in place, fp32 probabilities times v); "plain" is matmul -> softmax in fp32 ->
matmul over the whole batch (scores in the input dtype, probabilities cast back); "plain-fp32" computes the scores
in fp32 too. The tower uses SDPA, or gemm-heads inside its length range, wherever that is the fastest of these
within the tolerances.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from einops import rearrange

from qwenvl_vision.attention import gemm_batched
from qwenvl_vision.cpu_linear import best_seconds

SIZES = (  # (name, segments, tokens per segment, heads, head dim)
    ("qwen2.5 windows", 64, 64, 16, 80),
    ("frames 256", 16, 256, 16, 80),
    ("frames 512", 8, 512, 16, 80),
    ("frame 2048", 1, 2048, 16, 80),
    ("qwen2.5 frame 1024", 4, 1024, 16, 80),
    ("qwen2.5 frame 3740", 1, 3740, 16, 80),
    ("qwen3 frame 784", 4, 784, 16, 72),
    ("qwen3 frame 1024", 4, 1024, 16, 72),
)



def plain(q, k, v, scale, scores_fp32: bool = False):
    if scores_fp32:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gemm_heads(q, k, v, scale):
    """``attention.gemm_batched`` (the tower's CPU path for GEMM_ATTENTION_LENGTHS) on (count, H, L, hd)."""
    count = q.shape[0]
    packed = [rearrange(x, "b h l d -> (b l) h d") for x in (q, k, v)]
    return rearrange(gemm_batched(*packed, count, scale), "(b l) h d -> b h l d", b=count)


PATHS = {
    "sdpa": lambda q, k, v, scale: F.scaled_dot_product_attention(q, k, v, scale=scale),
    "gemm-heads": gemm_heads,
    "plain": lambda q, k, v, scale: plain(q, k, v, scale),
    "plain-fp32": lambda q, k, v, scale: plain(q, k, v, scale, scores_fp32=True),
}


def measure(dtype: torch.dtype, repeats: int, sizes=SIZES) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, count, tokens, heads, head_dim in sizes:
        q, k, v = (torch.randn(count, heads, tokens, head_dim, generator=generator).to(dtype) for _ in range(3))
        scale = head_dim**-0.5
        reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
        gflop = 4 * count * heads * tokens * tokens * head_dim / 1e9
        row = {"size": name, "dtype": str(dtype).replace("torch.", ""), "gflop": round(gflop, 2)}
        for path, fn in PATHS.items():
            seconds = best_seconds(lambda fn=fn, q=q, k=k, v=v, scale=scale: fn(q, k, v, scale), repeats)
            out = fn(q, k, v, scale).double()
            row[path] = {"gflops_per_s": round(gflop / seconds, 1),
                         "rel_err": float((out - reference).norm() / reference.norm())}
        row["fastest"] = max(PATHS, key=lambda p: row[p]["gflops_per_s"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}[args.dtype]
    rows = [row for dtype in dtypes for row in measure(dtype, args.repeats)]
    print(f"{'size':20s} {'dtype':9s} " + "".join(f"{p + ' GF/s (err)':>24s}" for p in PATHS) + "  fastest")
    for row in rows:
        cells = "".join(f"{row[p]['gflops_per_s']:>12.1f} ({row[p]['rel_err']:.1e})" for p in PATHS)
        print(f"{row['size']:20s} {row['dtype']:9s} {cells}  {row['fastest']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
