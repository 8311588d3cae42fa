"""Throughput of our tower against transformers' tower: same weights, same inputs, same device, interleaved.

    python -m bench.throughput --preset qwen2.5-vl-3b --device cpu --json bench/results/throughput-cpu.json
    python -m bench.throughput --preset qwen3-vl-8b --device cuda --dtype bf16 --attn sdpa,flash_attention_2

(from the repository root: ``bench`` is a package).
Inputs (default "mixed"): photos at 448x448, 1024x768 and 2048x1536 and a 16-frame 448x448 video,
preprocessed once with our (bit-exact) Qwen2VL preprocessing and packed into one batch, so both towers
see identical pixel_values and grid_thw. "16x1024" is 16 images of 32x32 patches (448 px at patch 14,
512 px at patch 16). Weights are random with real spread at the preset's real size (``--depth`` truncates
the tower for slow CPUs; every 8th block stays full-attention for Qwen2.5, DeepStack indexes below the
depth are kept for Qwen3 — the per-layer mix is unchanged).

Variants: ``ours`` (eager), ``ours-compiled`` (``--compile``: ``compile_blocks``, compiled during warm-up) and
transformers' tower once per ``--attn`` implementation: the first is the reference ``transformers``, the others
``transformers-<attn>`` (one that cannot run here, e.g. flash_attention_2 without flash-attn, is skipped with the
reason). Each repeat times every variant back to back (order alternating), after ``--warmup`` untimed runs; the
median is reported. "patches" are the tower's input tokens. Peak memory: on CUDA ``max_memory_allocated`` above the
weights; on CPU Linux's resident-set high-water mark (VmHWM, reset before each timed forward) above the RSS then;
unknown (null) where it cannot be reset. On CUDA it also prints achieved TFLOP/s (analytic FLOP count of the linears
and attention), its fraction of the GPU's dense bf16 peak (datasheet value for the GPUs in
``DENSE_BF16_PEAK_TFLOPS``, else the matmul rate measured in the same run, as ``peak_source`` says) and of the bf16
matmul rate measured in the same run.

``bench.cuda_check`` imports these pieces (``build_variants``, ``measure``, ``summarize``, ``peak_rate``; the
input sets are ``bench.workloads.INPUT_SETS``) to time several input sets on one set of models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gemm_bound import gemm_bound, print_rates
from bench.load import RESET_HIGH_WATER_MARK, proc_status_bytes, start_rss_window
from bench.workloads import add_workload_arguments, workload
from qwenvl_vision.backends.cpu.backend import CpuBackend
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.model.config import VisionConfig
from qwenvl_vision.model.execution import one_forward
from qwenvl_vision.model.random_init import random_tower
from qwenvl_vision.testing.reference import hf_classes, hf_tower, ours_from

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched as substrings of
# torch.cuda.get_device_name(); the first match wins, so the more specific names come first.
DENSE_BF16_PEAK_TFLOPS = (
    ("H200 NVL", 835.0),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
)
REFERENCE = "transformers"


class OneForwardCpuBackend(CpuBackend):
    """The CPU backend with the pack run as one forward, as on CUDA (the ``--one-forward`` variant)."""

    def forwards(self, tower):
        return one_forward


def run_ours(model, pixel_values, grid_thw):
    return model(pixel_values, grid_thw)[0]


def run_theirs(model, pixel_values, grid_thw):
    return model(pixel_values, grid_thw=grid_thw).pooler_output


@dataclass
class Variant:
    """One tower to time: ``run(model, pixel_values, grid_thw)`` returns the merged tokens."""

    run: Callable
    model: torch.nn.Module
    grid_on_device: bool = False  # transformers' towers take grid_thw on the device; ours reads it on the host


def transformers_unavailable(cfg: VisionConfig, attn: str) -> str | None:
    """Why transformers' tower of cfg's family cannot run with attention implementation `attn`, or None."""
    try:
        import transformers

        hf_classes(cfg)
    except (ImportError, AttributeError) as e:
        return f"transformers has no tower for {cfg.family.label}: {type(e).__name__}: {e}"
    if attn == "flash_attention_2":
        try:
            from transformers.utils import is_flash_attn_2_available
        except ImportError as e:
            return f"transformers {transformers.__version__} cannot tell whether flash-attn is usable: {e}"
        if not is_flash_attn_2_available():
            return (f"flash-attn is not installed or not usable here (transformers {transformers.__version__}: "
                    "is_flash_attn_2_available() is False)")
    return None


def build_variants(cfg: VisionConfig, device: torch.device, dtype: torch.dtype, attns: tuple[str, ...] = ("sdpa",),
                   compile_options: dict | None = None, seed: int = 0, addmm_variant: bool = False,
                   one_forward_variant: bool = False, default_sizes_variant: bool = False,
                   torch_elementwise_variant: bool = False) -> tuple[dict[str, Variant], dict[str, str]]:
    """Ours (eager), ours compiled (when compile_options is not None) and transformers' tower per attention
    implementation, all with the same spread random weights (ours read under the checkpoint names); returns the
    variants and, for those that cannot run here, the reason."""
    variants: dict[str, Variant] = {}
    skipped: dict[str, str] = {}
    weights = None
    for i, attn in enumerate(attns):
        name = REFERENCE if i == 0 else f"{REFERENCE}-{attn}"
        reason = transformers_unavailable(cfg, attn)
        if reason is not None:
            skipped[name] = reason
            continue
        # The same seed on the same device gives every transformers tower the same weights.
        theirs = hf_tower(cfg, attn, device=device, dtype=dtype, seed=seed)
        variants[name] = Variant(run_theirs, theirs, grid_on_device=True)
        if weights is None:
            weights = theirs

    def ours() -> torch.nn.Module:
        if weights is None:
            return random_tower(cfg, device, dtype, seed=seed)
        return ours_from(weights, cfg)

    # "ours" runs as load_encoder sets a tower up: on the CPU, the backend on this machine's measured plan (measured
    # here, before any timing, if the cache lacks it); "ours-reference" runs the modules' own ops (addmm, SDPA).
    built = {"ours": Variant(run_ours, ours())}
    if device.type == "cpu":
        plan = CpuBackend("auto").attach(built["ours"].model).plan(built["ours"].model)
        if addmm_variant:
            built["ours-reference"] = Variant(run_ours, ours())
            CpuBackend("reference").attach(built["ours-reference"].model)
        if one_forward_variant:  # the pack as one forward, as on CUDA: what running each item alone costs
            one = built["ours-one-forward"] = Variant(run_ours, ours())
            OneForwardCpuBackend(plan).attach(one.model)
        if default_sizes_variant:  # the plan's kernels with the default chunk size, not the measured
            sized = built["ours-default-sizes"] = Variant(run_ours, ours())
            CpuBackend(dataclasses.replace(plan, linear_chunk={})).attach(sized.model)
        if torch_elementwise_variant:  # the plan with the modules' elementwise ops where it chose the native kernels
            aten = built["ours-torch-elementwise"] = Variant(run_ours, ours())
            CpuBackend(dataclasses.replace(plan, elementwise={})).attach(aten.model)
    if compile_options is not None:
        compiled = ours()
        compiled.compile_blocks(**compile_options)
        built["ours-compiled"] = Variant(run_ours, compiled)
    return {**built, **variants}, skipped


class PeakRss:
    """The resident set's high-water mark over a block, above its start (CPU peak memory): Linux's ``VmHWM``, reset
    on entry to the current RSS (``bench.load.start_rss_window``). Nothing runs beside the timed forward: a thread
    sampling the RSS every few milliseconds took a core from a 2-core machine's workers often enough to slow our
    forward by ~12%. Off Linux the peak is not known (``peak`` None)."""

    def __enter__(self):
        self.base, method = start_rss_window()
        self.resets = method == RESET_HIGH_WATER_MARK
        self.peak = None
        return self

    def __exit__(self, *exc) -> None:
        high = proc_status_bytes("VmHWM") if self.resets else None
        self.peak = None if high is None else max(0, high - self.base)


@dataclass
class Timed:
    seconds: float  # host time, the device synchronized at both ends
    device_seconds: float | None  # CUDA-event time between the same ends (None off CUDA)
    peak: int | None  # bytes above what was allocated before the call (weights, inputs), None where unknown
    out: torch.Tensor


def timed(fn, model, pixel_values, grid_thw, device: torch.device) -> Timed:
    """One call. On CUDA the events' time beside the host's tells a launch-bound call (host time well above the
    device's) from a GPU-bound one."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        with torch.inference_mode():
            out = fn(model, pixel_values, grid_thw)
        end.record()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        return Timed(elapsed, begin.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated() - base, out)
    with PeakRss() as memory, torch.inference_mode():
        start = time.perf_counter()
        out = fn(model, pixel_values, grid_thw)
        elapsed = time.perf_counter() - start
    return Timed(elapsed, None, memory.peak, out)


@dataclass
class Timings:
    times: dict[str, list[float]]  # the timed repeats
    device_times: dict[str, list[float]]  # their CUDA-event times (empty lists off CUDA)
    peaks: dict[str, int | None]  # None where the machine cannot tell
    first: dict[str, float]  # the first call (a compiled variant compiles here)
    outputs: dict[str, torch.Tensor]  # the last output of each


def measure(variants: dict[str, Variant], pixel_values: torch.Tensor, grid_thw: torch.Tensor, device: torch.device,
            warmup: int, repeats: int, failed: dict[str, str] | None = None,
            each_round: Callable[[], None] | None = None) -> Timings:
    """warmup untimed rounds, then repeats timed rounds; every round runs every variant, order alternating.
    With ``failed`` (a dict), a variant that raises is dropped from the rest of the run and its error recorded
    there (name -> message), so one broken variant does not lose the others' numbers; without, it propagates.
    ``each_round`` runs after each timed round's variants (``--gemm-bound`` measures the bound there, so that a
    shared machine's drift between minutes moves the bound and the forwards it is compared with together)."""
    pixel_values = pixel_values.to(device)
    grid_dev = grid_thw.to(device)
    result = Timings({k: [] for k in variants}, {k: [] for k in variants}, dict.fromkeys(variants, 0), {}, {})
    for r in range(warmup + repeats):
        order = [n for n in (variants if r % 2 == 0 else reversed(variants)) if n in result.times]
        for name in order:
            variant = variants[name]
            try:
                call = timed(variant.run, variant.model, pixel_values,
                             grid_dev if variant.grid_on_device else grid_thw, device)
            except Exception as e:
                if failed is None:
                    raise
                failed[name] = f"{type(e).__name__}: {e}"[:2000]
                for table in (result.times, result.device_times, result.peaks, result.first, result.outputs):
                    table.pop(name, None)
                continue
            result.outputs[name] = call.out
            result.first.setdefault(name, call.seconds)
            if r >= warmup:
                result.times[name].append(call.seconds)
                if call.device_seconds is not None:
                    result.device_times[name].append(call.device_seconds)
                result.peaks[name] = None if call.peak is None or result.peaks[name] is None else max(
                    result.peaks[name], call.peak)
        if r >= warmup and each_round is not None:
            each_round()
    return result


def tower_flops(cfg: VisionConfig, grids: list[tuple[int, int, int]]) -> float:
    """Analytic forward FLOPs: every Linear (2 * in * out per token) plus attention (4 * L * D per token)."""
    d, inner = cfg.hidden_size, cfg.intermediate_size
    tokens = sum(t * h * w for t, h, w in grids)
    mlp = 3 * d * inner if cfg.family.mlp == "gated" else 2 * d * inner
    per_token_block = 2 * (3 * d * d + d * d + mlp)
    total = cfg.depth * per_token_block * tokens + 2 * cfg.patch_dim * d * tokens
    merged = tokens // cfg.merge_unit
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    total += mergers * 2 * merged * (4 * d * 4 * d + 4 * d * cfg.out_hidden_size)
    frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
    full = sum(n * n for n in frame_lengths)
    if cfg.family.windows:
        window = 4 * cfg.window_merged**2  # upper bound: every window full (64 patches)
        windowed = tokens * window
        n_full = len(cfg.fullatt_block_indexes)
        attn = 4 * d * (n_full * full + (cfg.depth - n_full) * windowed)
    else:
        attn = 4 * d * cfg.depth * full
    return float(total + attn)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul on device in dtype (mean of `repeats` after two warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def dense_bf16_peak(device_name: str) -> tuple[str, float] | None:
    """(table entry, dense bf16 TFLOP/s) for a known GPU name, else None."""
    return next(((key, peak) for key, peak in DENSE_BF16_PEAK_TFLOPS if key in device_name), None)


def peak_rate(device: torch.device, dtype: torch.dtype, matmul_n: int = 8192) -> dict:
    """The rate achieved TFLOP/s are divided by: the datasheet dense bf16 peak of a known GPU, else the matmul
    rate measured here (``peak_source`` says which). The measured rate is always included."""
    measured = matmul_rate(device, dtype, matmul_n) / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or device.type
    known = dense_bf16_peak(name) if device.type == "cuda" and dtype == torch.bfloat16 else None
    if known is not None:
        source = f"datasheet dense bf16 peak of {known[0]} ({name})"
        peak = known[1]
    else:
        source = (f"measured {matmul_n}^3 {str(dtype).replace('torch.', '')} matmul on {name} (not a known "
                  "GPU in bf16: no datasheet peak)")
        peak = measured
    return {"device_name": name, "peak_tflops": peak, "peak_source": source, "matmul_tflops": measured,
            "matmul_n": matmul_n}


def summarize(cfg: VisionConfig, label: str, inputs: str, grid_thw: torch.Tensor, items: int, device: torch.device,
              dtype: torch.dtype, timings: Timings, peak: dict | None = None, skipped: dict | None = None) -> dict:
    """The result of one input set: per variant median time, items/s, patches/s, peak memory, first-call time,
    and with ``peak`` TFLOP/s and fractions of the peak and of the measured matmul rate; speed-ups and output
    relative errors of ours against every transformers variant."""
    grids = [tuple(g) for g in grid_thw.tolist()]
    tokens = int(grid_thw.prod(1).sum())
    result = {
        "preset": label, "depth": cfg.depth, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "inputs": inputs, "grids": grids, "items": items, "patches": tokens, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "repeats": max(map(len, timings.times.values()), default=0), "variants": {}, "skipped": dict(skipped or {}),
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    flops = tower_flops(cfg, grids)
    result["tflop_per_forward"] = flops / 1e12
    if peak is not None:
        result.update(peak)
    for name, values in timings.times.items():
        median = statistics.median(values)
        device_times = timings.device_times.get(name) or None
        entry = {"median_s": median, "times_s": values, "first_s": timings.first[name], "items_per_s": items / median,
                 "patches_per_s": tokens / median, "peak_bytes": timings.peaks[name],
                 "device_median_s": device_times and statistics.median(device_times), "device_times_s": device_times}
        if peak is not None:
            entry["tflops"] = flops / median / 1e12
            entry["fraction_of_peak"] = entry["tflops"] / peak["peak_tflops"]
            entry["fraction_of_matmul"] = entry["tflops"] / peak["matmul_tflops"]
        result["variants"][name] = entry
    theirs_names = [n for n in timings.times if n.startswith(REFERENCE)]
    for name in [n for n in timings.times if not n.startswith(REFERENCE)]:
        entry = result["variants"][name]
        a = timings.outputs[name].double()
        for ref in theirs_names:
            b = timings.outputs[ref].double()
            entry.setdefault("speedup_vs", {})[ref] = result["variants"][ref]["median_s"] / entry["median_s"]
            entry.setdefault("rel_err_vs", {})[ref] = float((a - b).norm() / b.norm())
        if REFERENCE in theirs_names:  # the flat keys older readers of this JSON use
            suffix = "" if name == "ours" else f"_{name.split('-', 1)[1]}"
            result[f"speedup_vs_transformers{suffix}"] = entry["speedup_vs"][REFERENCE]
            result[f"rel_err_vs_transformers{suffix}"] = entry["rel_err_vs"][REFERENCE]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, dtypes=("bf16", "fp16", "fp32"))
    parser.set_defaults(inputs="mixed", dtype=None)  # dtype: bf16 on CUDA, fp32 on CPU
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=positive_option(int, "--repeats"), default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=positive_option(int, "--threads"), default=None)
    parser.add_argument("--attn", default="sdpa",
                        help="transformers attention implementations, comma-separated; the first is the reference "
                             "(e.g. sdpa,flash_attention_2)")
    parser.add_argument("--compile", action="store_true",
                        help="also time a torch.compile'd copy of ours (compile_blocks; compiled during warm-up)")
    parser.add_argument("--freezing", action="store_true",
                        help="with --compile: inductor's freezing pass (weights folded as constants, oneDNN's "
                             "prepacked linears: what the CPU backend writes by hand)")
    parser.add_argument("--gemm-bound", action="store_true",
                        help="also time the forward's GEMMs and attention alone (bench.gemm_bound) and report each "
                             "variant as a fraction of that bound")
    parser.add_argument("--addmm", action="store_true",
                        help="CPU: also time ours with cpu_kernels='reference' (the modules' own ops: addmm, SDPA)")
    parser.add_argument("--one-forward", action="store_true",
                        help="CPU: also time ours with the pack as one forward (as on CUDA) instead of one forward "
                             "per item (which makes an item's bits independent of its neighbours)")
    parser.add_argument("--default-sizes", action="store_true",
                        help="CPU: also time ours on this machine's plan with the default chunk size "
                             "instead of the measured ones (what measuring them gains)")
    parser.add_argument("--torch-elementwise", action="store_true",
                        help="CPU: also time ours on this machine's plan with the modules' elementwise ops instead "
                             "of the native kernels where it chose them (what the fused steps gain)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first forward compiles")
    if args.freezing:
        if not args.compile:
            parser.error("--freezing needs --compile")
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg, pixel_values, grid_thw, items, dtype = workload(args, device)
    attns = tuple(a.strip() for a in args.attn.split(",") if a.strip())
    variants, skipped = build_variants(cfg, device, dtype, attns, {} if args.compile else None,
                                       addmm_variant=args.addmm, one_forward_variant=args.one_forward,
                                       default_sizes_variant=args.default_sizes,
                                       torch_elementwise_variant=args.torch_elementwise)
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})", file=sys.stderr)
    bounds: list[dict] = []
    grids = [tuple(g) for g in grid_thw.tolist()]
    each_round = (lambda: bounds.append(gemm_bound(cfg, grids, dtype, device))) if args.gemm_bound else None
    timings = measure(variants, pixel_values, grid_thw, device, args.warmup, args.repeats, each_round=each_round)
    peak = peak_rate(device, dtype) if device.type == "cuda" else None
    result = summarize(cfg, args.preset, args.inputs, grid_thw, items, device, dtype, timings, peak, skipped)
    if bounds:
        add_bound(result, bounds, timings)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def add_bound(result: dict, bounds: list[dict], timings: Timings) -> None:
    """The median over rounds of the bound and of its two parts (the GEMMs' rate from their median), the per-shape
    rates of the round at the upper median, each round's bound, and each variant's fraction of the bound: the median
    over rounds of that round's bound over that round's forward (numbers measured minutes apart on a shared machine
    are not compared)."""
    by_time = sorted(bounds, key=lambda bound: bound["bound_s"])
    medians = {key: statistics.median(b[key] for b in bounds) for key in ("bound_s", "gemm_s", "attention_s")}
    result["gemm_bound"] = dict(by_time[len(by_time) // 2], **medians,
                                gemm_gflops_per_s=round(bounds[0]["gemm_gflop"] / medians["gemm_s"], 1),
                                rounds_s=[round(b["bound_s"], 3) for b in bounds])
    for name, entry in result["variants"].items():
        entry["fraction_of_bound"] = statistics.median(
            bound["bound_s"] / seconds for bound, seconds in zip(bounds, timings.times[name], strict=True))


def print_table(result: dict) -> None:
    print(f"\n{result['preset']} depth {result['depth']}  {result['device']} {result['dtype']}  "
          f"threads {result['threads']}  torch {result['torch']}  transformers {result.get('transformers', '-')}")
    print(f"inputs: {result['inputs']} -> {result['items']} items, {result['patches']} patches, "
          f"grids {result['grids']}")
    header = f"{'variant':30s} {'median s':>9s} {'items/s':>8s} {'patches/s':>10s} {'peak MiB':>9s}"
    rated = "peak_tflops" in result
    if rated:
        header += f" {'TFLOP/s':>8s} {'of peak':>8s} {'of matmul':>9s}"
    print(header)
    for name, v in result["variants"].items():
        line = (f"{name:30s} {v['median_s']:9.3f} {v['items_per_s']:8.2f} {v['patches_per_s']:10.0f} "
                + (f"{'n/a':>9s}" if v["peak_bytes"] is None else f"{v['peak_bytes'] / 2**20:9.0f}"))
        if rated:
            line += f" {v['tflops']:8.1f} {v['fraction_of_peak']:8.1%} {v['fraction_of_matmul']:9.1%}"
        print(line)
    if rated:
        print(f"peak {result['peak_tflops']:.1f} TFLOP/s ({result['peak_source']}); measured matmul rate "
              f"{result['matmul_tflops']:.1f} TFLOP/s")
    if "gemm_bound" in result:
        bound = result["gemm_bound"]
        print_rates(bound)
        rounds = ", ".join(f"{s:.2f}" for s in bound["rounds_s"])
        print(f"GEMM bound {bound['bound_s']:.2f} s (GEMMs {bound['gemm_s']:.2f} s at {bound['gemm_gflops_per_s']} "
              f"GFLOP/s, the best kernel per shape, alone; attention {bound['attention_s']:.2f} s by its paths alone; "
              f"measured after each round: {rounds} s). Bound / forward, median over rounds: "
              + ", ".join(f"{name} {v['fraction_of_bound']:.0%}" for name, v in result["variants"].items()))
    for name, v in result["variants"].items():
        for ref, speedup in v.get("speedup_vs", {}).items():
            print(f"speedup {name} vs {ref}: {speedup:.2f}x   (output rel err {v['rel_err_vs'][ref]:.1e})")
    for name, reason in result.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")


if __name__ == "__main__":
    main()
