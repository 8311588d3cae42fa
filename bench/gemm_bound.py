"""The time a forward cannot beat on this machine: its matrix products at the rate the hardware reaches alone.

    python -m bench.gemm_bound --preset qwen2.5-vl-3b --inputs photos --dtype bf16

For one packed forward of a tower, every GEMM (patch embedding, qkv, projection, MLP, mergers) is listed with its
shape and timed alone by each kernel this machine has: ``torch.mm`` (MKL for fp32 on x86, oneDNN for bf16) on a
weight laid out as a Linear holds it, output preallocated, and oneDNN's prepacked linear
(``qwenvl_vision.backends.cpu.kernels``) where this torch has it, on the row chunks of fresh outputs the forward
consumes as they come, at the best of the chunk sizes the machine's plan chooses from (the forward runs packed MLPs
in row blocks, most plain ones with the activation in the GEMM: timed here on the whole pack, without it); best of a few
runs, the same weight every run, so it may stay in cache: an optimistic rate. Each shape counts at the faster
kernel's time, so the bound is the machine's limit, not one library's.

Attention is timed alone as the calls our segment plan makes (``attention.sdpa_attention`` on random q/k/v with
the forward's segments, batched as we batch them), each segment group by every exact path this machine has:
PyTorch's SDPA kernel, and on the CPU two fp32 GEMMs per head (``cpu.kernels.gemm_attention``); each group counts
at the faster one. The bound is the sum; ``bench.throughput`` reports each forward as a fraction of it.
"""

from __future__ import annotations

import argparse
from collections import Counter, deque

import torch

from bench.workloads import add_workload_arguments, workload
from qwenvl_vision.backends.cpu.kernels import (
    best_seconds,
    gemm_attention,
    onednn_linear_available,
    pack_weight,
    packed_chunks,
)
from qwenvl_vision.backends.cpu.probes import CHUNK_CHOICES
from qwenvl_vision.model.attention import SegmentPlan, sdpa_attention, sdpa_batched
from qwenvl_vision.model.build import build_model
from qwenvl_vision.model.config import VisionConfig

Shape = tuple[int, int, int]  # (m, k, n): an (m, k) x (k, n) product


def device_seconds(fn, device: torch.device, repeats: int) -> float:
    """``best_seconds`` of ``fn``; on CUDA, where a call returns once its kernel is queued, the device's own time
    between two events around it (a synchronize per call would add its latency to every product)."""
    if device.type != "cuda":
        return best_seconds(fn, repeats)
    fn()
    start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def gemm_shapes(cfg: VisionConfig, grids: list[tuple[int, int, int]]) -> Counter[Shape]:
    """Every matrix product of one forward over the pack, by shape, with its count."""
    n = sum(t * h * w for t, h, w in grids)
    d, inner, merged = cfg.hidden_size, cfg.intermediate_size, n // cfg.merge_unit
    shapes: Counter[Shape] = Counter({(n, cfg.patch_dim, d): 1})
    block = [(n, d, 3 * d), (n, d, d)]
    block += [(n, d, 2 * inner), (n, inner, d)] if cfg.family.mlp == "gated" else [(n, d, inner), (n, inner, d)]
    for shape in block:
        shapes[shape] += cfg.depth
    for _ in range(1 + len(cfg.deepstack_visual_indexes)):  # the final merger and each DeepStack merger
        shapes[(merged, 4 * d, 4 * d)] += 1
        shapes[(merged, 4 * d, cfg.out_hidden_size)] += 1
    return shapes



def gemm_seconds(shapes: Counter[Shape], dtype: torch.dtype, device: torch.device, repeats: int = 3
                 ) -> tuple[float, dict[str, dict[str, float]]]:
    """Sum over shapes of count x the best kernel's time alone; and each kernel's rate (GFLOP/s) per shape."""
    total, rates = 0.0, {}
    packs = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_linear_available()
    for (m, k, n), count in shapes.items():
        # The weight as a Linear holds it, (n, k), used transposed: the layout the tower's products read.
        a, weight = torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        seconds = {"mm": device_seconds(lambda a=a, w=weight, out=out: torch.mm(a, w.t(), out=out), device, repeats)}
        if packs:
            packed, bias = pack_weight(weight, m), torch.zeros(n, dtype=dtype)
            # as the forward calls it: each fresh chunk is consumed as it comes, at the best of the chunk sizes the
            # machine's plan chooses from
            seconds["onednn"] = min(
                best_seconds(lambda a=a, p=packed, b=bias, c=chunk: deque(packed_chunks(a, p, b, c), maxlen=0), repeats)
                for chunk in CHUNK_CHOICES)
        rates[f"{m}x{k}x{n}"] = {kernel: round(2 * m * k * n / s / 1e9, 1) for kernel, s in seconds.items()}
        total += count * min(seconds.values())
    return total, rates


def attention_seconds(cfg: VisionConfig, grids: list[tuple[int, int, int]], dtype: torch.dtype,
                      device: torch.device, repeats: int = 3) -> float:
    """Every block's attention alone over the forward's windows or frames, batched as our segment plan batches
    them, each group of equal segments at the fastest exact path here."""
    model = build_model(cfg, device="meta")
    plan = model.prepare(grids, device)
    n, heads, hd = plan.frames.total, cfg.num_heads, cfg.head_dim
    q, k, v = (torch.randn(n, heads, hd, device=device).to(dtype) for _ in range(3))
    out = torch.empty_like(q)
    total = 0.0
    for segments in [s for s in (plan.frames, plan.windows) if s is not None]:
        blocks = sum(1 for i in range(cfg.depth) if (segments is plan.frames) == (i in cfg.full_attention_blocks))
        for group in segments.groups if blocks else []:
            alone = SegmentPlan.from_lengths([group.length] * group.count, device)
            paths = [sdpa_batched]
            if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_linear_available():
                paths.append(gemm_attention)
            rows = group.length * group.count
            total += blocks * min(
                device_seconds(lambda p=path, s=alone, r=rows: sdpa_attention(q[:r], k[:r], v[:r], s, hd**-0.5,
                                                                             out=out[:r], batched=p), device, repeats)
                for path in paths)
    return total


def gemm_bound(cfg: VisionConfig, grids: list[tuple[int, int, int]], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    shapes = gemm_shapes(cfg, grids)
    gemm, rates = gemm_seconds(shapes, dtype, device)
    attention = attention_seconds(cfg, grids, dtype, device)
    flops = sum(2 * m * k * n * count for (m, k, n), count in shapes.items())
    return {"bound_s": gemm + attention, "gemm_s": gemm, "attention_s": attention, "gemm_gflop": flops / 1e9,
            "gemm_gflops_per_s": round(flops / gemm / 1e9, 1), "rates_gflops_per_s": rates}


def print_rates(bound: dict) -> None:
    """Each shape's rate by each kernel, side by side (GFLOP/s)."""
    kernels = sorted({kernel for rates in bound["rates_gflops_per_s"].values() for kernel in rates})
    print(f"{'GEMM shape (m x k x n)':24s}" + "".join(f"{kernel:>10s}" for kernel in kernels) + "   GFLOP/s")
    for shape, rates in bound["rates_gflops_per_s"].items():
        print(f"{shape:24s}" + "".join(f"{rates.get(kernel, float('nan')):10.1f}" for kernel in kernels))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    cfg, _, grid_thw, _, dtype = workload(parser.parse_args(argv))
    result = gemm_bound(cfg, [tuple(g) for g in grid_thw.tolist()], dtype)
    print_rates(result)
    print(f"bound {result['bound_s']:.2f} s: GEMMs {result['gemm_s']:.2f} s ({result['gemm_gflops_per_s']} GFLOP/s "
          f"at the best kernel per shape), attention {result['attention_s']:.2f} s")
    return result


if __name__ == "__main__":
    main()
