"""Throughput of our tower against transformers' tower: same weights, same inputs, same device, interleaved.

    python bench/throughput.py --preset qwen2.5-vl-3b --device cpu --json bench/results/throughput-cpu.json
    python bench/throughput.py --preset qwen3-vl-8b --device cuda --dtype bf16

Inputs (default "mixed"): photos at 448x448, 1024x768 and 2048x1536 and a 16-frame 448x448 video,
preprocessed once with our (bit-exact) Qwen2VL preprocessing and packed into one batch, so both towers
see identical pixel_values and grid_thw. Weights are random with real spread at the preset's real
size (``--depth`` truncates the tower for slow CPUs; every 8th block stays full-attention for
Qwen2.5, DeepStack indexes below the depth are kept for Qwen3 — the per-layer mix is unchanged).

Each repeat times ours and theirs back to back (order alternating), after ``--warmup`` untimed runs;
the median is reported. Peak memory: on CUDA ``max_memory_allocated`` above the weights; on CPU the
resident-set high-water mark above the pre-run RSS, sampled by a thread every 5 ms. On CUDA it also
prints achieved TFLOP/s (analytic FLOP count of the linears and attention) and the fraction of the
bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwenvl_vision import preset  # noqa: E402
from qwenvl_vision.config import VisionConfig  # noqa: E402
from qwenvl_vision.init import random_tower  # noqa: E402
from qwenvl_vision.preprocess import PreprocessConfig, preprocess_image, preprocess_video  # noqa: E402
from tests.helpers import photo  # noqa: E402

INPUT_SETS = {
    # 4 photos as a user embeds them: ~3.9k patches (patch 14), each resized under max_pixels 448^2.
    "photos": {"images": [(600, 512), (480, 640), (640, 480), (560, 560)], "video": None, "max_pixels": 448 * 448},
    "mixed": {"images": [(448, 448), (768, 1024), (1536, 2048)], "video": (16, 448, 448)},
    "1024-patch": {"images": [(448, 448)] * 16, "video": None},  # 32x32 patches each (patch 14)
    "small": {"images": [(224, 224), (336, 448)], "video": (4, 224, 224)},
}


def truncated(cfg: VisionConfig, depth: int | None) -> VisionConfig:
    if not depth or depth >= cfg.depth:
        return cfg
    if cfg.spec.windows:
        return cfg.replace(depth=depth, fullatt_block_indexes=tuple(i for i in range(depth) if (i + 1) % 8 == 0))
    return cfg.replace(depth=depth, deepstack_visual_indexes=tuple(i for i in cfg.deepstack_visual_indexes
                                                                     if i < depth))


def build_inputs(name: str, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    spec = INPUT_SETS[name]
    pre = PreprocessConfig.for_family(cfg.family)
    if "max_pixels" in spec:
        pre = dataclasses.replace(pre, max_pixels=spec["max_pixels"])
    rows, grids = [], []
    for i, (h, w) in enumerate(spec["images"]):
        values, grid = preprocess_image(photo(h, w, i), pre)
        rows.append(values)
        grids.append(grid)
    if spec["video"]:
        frames, h, w = spec["video"]
        clip = np.stack([np.roll(photo(h, w), 7 * f, axis=1) for f in range(frames)])
        values, grid = preprocess_video(clip, pre)
        rows.append(values)
        grids.append(grid)
    items = len(spec["images"]) + (1 if spec["video"] else 0)
    return torch.cat(rows), torch.tensor(grids), items


def build_pair(cfg: VisionConfig, device: torch.device, dtype: torch.dtype, attn: str):
    """Ours and transformers' tower with the same spread random weights (theirs, under the checkpoint names)."""
    try:
        from tests.helpers import hf_tower, ours_from
    except ImportError as e:
        print(f"transformers not available ({e}); timing ours only", file=sys.stderr)
        return random_tower(cfg, device, dtype, seed=0), None
    theirs = hf_tower(cfg, attn, device=device, dtype=dtype, seed=0)
    return ours_from(theirs, cfg), theirs


def run_ours(model, pixel_values, grid_thw):
    return model(pixel_values, grid_thw)[0]


def run_theirs(model, pixel_values, grid_thw):
    return model(pixel_values, grid_thw=grid_thw).pooler_output


class RssSampler:
    """Resident-set high-water mark during a block, sampled every 5 ms (CPU peak memory)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self.base = self.rss()
        self.peak = self.base
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def timed(fn, model, pixel_values, grid_thw, device: torch.device) -> tuple[float, int, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.inference_mode():
            out = fn(model, pixel_values, grid_thw)
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base, out
    with RssSampler() as sampler, torch.inference_mode():
        start = time.perf_counter()
        out = fn(model, pixel_values, grid_thw)
        elapsed = time.perf_counter() - start
    return elapsed, sampler.peak - sampler.base, out


def tower_flops(cfg: VisionConfig, grids: list[tuple[int, int, int]]) -> float:
    """Analytic forward FLOPs: every Linear (2 * in * out per token) plus attention (4 * L * D per token)."""
    d, inner = cfg.hidden_size, cfg.intermediate_size
    tokens = sum(t * h * w for t, h, w in grids)
    mlp = 3 * d * inner if cfg.spec.mlp == "gated" else 2 * d * inner
    per_token_block = 2 * (3 * d * d + d * d + mlp)
    total = cfg.depth * per_token_block * tokens + 2 * cfg.patch_dim * d * tokens
    merged = tokens // cfg.merge_unit
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    total += mergers * 2 * merged * (4 * d * 4 * d + 4 * d * cfg.out_hidden_size)
    frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
    full = sum(n * n for n in frame_lengths)
    if cfg.spec.windows:
        window = 4 * cfg.window_merged**2  # upper bound: every window full (64 patches)
        windowed = tokens * window
        n_full = len(cfg.fullatt_block_indexes)
        attn = 4 * d * (n_full * full + (cfg.depth - n_full) * windowed)
    else:
        attn = 4 * d * cfg.depth * full
    return float(total + attn)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    from tests.helpers import ours_from

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--inputs", default="mixed", choices=sorted(INPUT_SETS))
    parser.add_argument("--depth", type=int, default=None, help="truncate the tower (CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attn", default="sdpa", help="transformers attention implementation")
    parser.add_argument("--compile", action="store_true",
                        help="also time a torch.compile'd copy of ours (compile_blocks; compiled during warm-up)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first forward compiles")

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = truncated(preset(args.preset), args.depth)
    pixel_values, grid_thw, items = build_inputs(args.inputs, cfg)
    grids = [tuple(g) for g in grid_thw.tolist()]
    tokens = int(grid_thw.prod(1).sum())
    ours, theirs = build_pair(cfg, device, dtype, args.attn)
    pixel_values = pixel_values.to(device)
    grid_dev = grid_thw.to(device)

    variants = {"ours": (run_ours, ours)}
    if args.compile:
        compiled = ours_from(theirs, cfg) if theirs is not None else random_tower(cfg, device, dtype, seed=0)
        compiled.compile_blocks()
        variants["ours-compiled"] = (run_ours, compiled)
    if theirs is not None:
        variants["transformers"] = (run_theirs, theirs)
    times: dict[str, list[float]] = {k: [] for k in variants}
    peaks: dict[str, int] = dict.fromkeys(variants, 0)
    outputs = {}
    for r in range(args.warmup + args.repeats):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            fn, model = variants[name]
            elapsed, peak, out = timed(fn, model, pixel_values, grid_dev if name == "transformers" else grid_thw,
                                       device)
            outputs[name] = out
            if r >= args.warmup:
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], peak)

    result = {
        "preset": args.preset, "depth": cfg.depth, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "inputs": args.inputs, "grids": grids, "items": items, "patches": tokens, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "repeats": args.repeats, "variants": {},
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    flops = tower_flops(cfg, grids)
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
        result["matmul_tflops"] = matmul_rate(device, dtype) / 1e12
    for name, values in times.items():
        median = statistics.median(values)
        entry = {"median_s": median, "times_s": values, "items_per_s": items / median,
                 "patches_per_s": tokens / median, "peak_bytes": peaks[name]}
        if device.type == "cuda":
            entry["tflops"] = flops / median / 1e12
            entry["fraction_of_matmul"] = entry["tflops"] / result["matmul_tflops"]
        result["variants"][name] = entry
    if "transformers" in result["variants"]:
        theirs_t = result["variants"]["transformers"]["median_s"]
        b = outputs["transformers"].double()
        for name in [n for n in variants if n != "transformers"]:
            suffix = "" if name == "ours" else f"_{name.split('-', 1)[1]}"
            result[f"speedup_vs_transformers{suffix}"] = theirs_t / result["variants"][name]["median_s"]
            a = outputs[name].double()
            result[f"rel_err_vs_transformers{suffix}"] = float((a - b).norm() / b.norm())
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['preset']} depth {result['depth']}  {result['device']} {result['dtype']}  "
          f"threads {result['threads']}  torch {result['torch']}  transformers {result.get('transformers', '-')}")
    print(f"inputs: {result['inputs']} -> {result['items']} items, {result['patches']} patches, "
          f"grids {result['grids']}")
    header = f"{'variant':14s} {'median s':>9s} {'items/s':>8s} {'patches/s':>10s} {'peak MiB':>9s}"
    cuda = "tflops" in result["variants"]["ours"]
    if cuda:
        header += f" {'TFLOP/s':>8s} {'of matmul':>9s}"
    print(header)
    for name, v in result["variants"].items():
        line = (f"{name:14s} {v['median_s']:9.3f} {v['items_per_s']:8.2f} {v['patches_per_s']:10.0f} "
                f"{v['peak_bytes'] / 2**20:9.0f}")
        if cuda:
            line += f" {v['tflops']:8.1f} {v['fraction_of_matmul']:9.1%}"
        print(line)
    if cuda:
        print(f"measured bf16 matmul rate: {result['matmul_tflops']:.1f} TFLOP/s")
    for key in [k for k in result if k.startswith("speedup_vs_transformers")]:
        suffix = key[len("speedup_vs_transformers"):]
        name = "ours" + suffix.replace("_", "-")
        print(f"speedup {name} vs transformers: {result[key]:.2f}x   "
              f"(output rel err {result['rel_err_vs_transformers' + suffix]:.1e})")


if __name__ == "__main__":
    main()
