"""The one prepared check for a lent GPU (issue 16): CUDA tests, bf16 parity, teardown, throughput and load, as JSON.

    python -m bench.cuda_check --out DIR                      # on the GPU machine (DIR: the device tool's $OUT)
    python -m bench.cuda_check --out DIR --dry-run            # the same logic on CPU with tiny configs (CI)
    python -m bench.cuda_check --out DIR --only parity,load   # some sections (e.g. a rerun)

From the repository root (``bench`` is a package). With the device tool (its python3 has torch and transformers;
nothing is installed):

    run(command="PYTHONUNBUFFERED=1 python3 -m bench.cuda_check --out $OUT", timeout_s=570)

Every section runs in its own fresh process (``--section NAME``, started by this script) under its own time limit,
so a crash, a CUDA error that poisons the context, a hang or leftover GPU memory stays in that section: it is
recorded and the next section runs. A section writes ``DIR/<section>.json`` after every item it measures, so a
section stopped at its limit still leaves what it measured. At the end ``DIR/summary.json`` and ``DIR/summary.txt``
(also printed) say each section's status (ok / fail / skipped / error / timeout) and its key numbers. At most one
more file is written, a CUDA memory snapshot of a failed teardown: 8 files in all, what the device tool brings back.

Sections, their expected time on an H200 (16 CPU cores) and their limit, each including its process start (~5 s:
torch, transformers, the CUDA context). The times are estimates from the FLOP counts, the CPU runs and the
machine notes (an 8192^3 bf16 matmul at ~790 TFLOP/s there): no GPU has run this script yet. The whole run
stops at ``--budget`` (480 s, leaving ~7 minutes of the 15-minute device budget for the machine's start and a
rerun): a section's limit is cut so that every later section keeps its expected time, and a section left with
less than ``MIN_LIMIT_S`` is skipped with that reason.

1. ``tests`` (~150 s, limit 210 s): ``pytest tests/test_cuda.py tests/test_compile.py``: counts, every test's
   outcome and the output tail. On 2 CPU cores test_compile.py takes 150 s (its inductor C++ compiles); 16
   cores, and Triton compiles of test_cuda.py's two compiled tests, should land near 150 s in all.
2. ``parity`` (~20 s, limit 60 s): every family of ``bench.workloads.FAMILY_SMALL``: our tower in bf16 against
   transformers' tower of that family in fp32 (same weights, same device, TF32 off), on a packed mix with a
   2-frame video, a 2x2 grid, frames off the window grid and (GPU) a 64x80-patch frame: merged tokens and every
   DeepStack level of every item within 3e-2 relative error. Then the same tower with ``attn_impl="sdpa"`` against
   the fused varlen path that ``"auto"`` chose (flash or torch_varlen), within 1e-2: both are bf16 with fp32 softmax
   accumulation and the same weights, so they differ only where the attention output rounds differently, a
   part of the bf16-vs-fp32 error of these towers (7e-3 to 1.2e-2 on CPU; each entry also records the sdpa
   path's error against fp32, the noise floor of that run), while a wrong segment boundary gives errors near 1.
3. ``teardown`` (~45 s, limit 120 s): ``qwenvl_vision.teardown.cmd_teardown`` (with bench.teardown's
   transformers tower as comparison) for qwen2.5-vl-3b and qwen3-vl-8b, random weights at real size, bf16,
   5 cycles each of ``del`` and of ``close()``: ``memory_allocated`` against the baseline after each, and the
   reserved bytes after ``torch.cuda.empty_cache()``. Each cycle is ~1 s on a GPU (load 1.3 GB, encode 5 images,
   6 memory readings with a census of live tensors), 30 cycles in all.
4. ``throughput`` (~170 s, limit 240 s): ``bench.throughput``'s pieces, bf16, qwen2.5-vl-3b then qwen3-vl-8b,
   each on the mixed pack (29k / 22k patches) and on 16 images of 1024 patches: ours eager, ours compiled,
   transformers sdpa and flash_attention_2 where usable, 3 timed repeats after warm-up, with images/s,
   patches/s, TFLOP/s and the fraction of the dense bf16 peak. Per preset: ~45 s compiling, ~1 s per
   transformers forward on the mixed pack (a Python loop over ~450 windows in 28 blocks) and ~0.1 s per forward
   of ours, so ~80 s.
5. ``load`` (~45 s, limit 100 s): ``python -m bench.load --device cuda``: a real-layout bf16 qwen2.5-vl-3b checkpoint
   (1.3 GB of vision tensors, written once, ~10 s), then 1 warm-up and 3 measured fresh-process loads of ours and
   2 of transformers' tower: load time, peak host RSS against the tower bytes, peak GPU allocation.

Versions are probed, never assumed (the GPU machine had torch 2.11 and transformers 5.17): a transformers tower
class that does not exist, flash-attn (absent there), torch's ``varlen_attn`` (and its ``scale`` keyword), and
transformers' flash_attention_2 are probed once by the parent into summary.json's ``environment`` (each section
records its own versions and device); a comparison that needs a missing one is skipped with the reason, never a
crash.

``--dry-run`` runs the same sections and code on CPU, with ``"dry_run": true``, in ~45 s of CPU time on 2 cores
(60-70 s of wall time, measured while other work shared the cores): the tests section runs only
tests/test_cuda.py (it skips without CUDA; CI runs test_compile.py itself); parity runs the same small towers in
bf16 against fp32 on CPU, the fused comparison skipped ("no CUDA"); teardown and throughput stand each preset's
``FAMILY_SMALL`` tower in for it (1 teardown cycle; the "small" inputs, 1 warm-up and 1 timed repeat, compiled with
``backend="aot_eager"``: dynamo and AOT autograd without inductor's code generation, divided by a measured fp32
matmul rate); load writes and loads a one-block qwen2.5-vl-3b checkpoint. It cannot check anything CUDA-specific:
kernels, the fused varlen path, memory counters, inductor/Triton code generation, speed, real-size memory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

PRESETS = ("qwen2.5-vl-3b", "qwen3-vl-8b")
PARITY_TOL = 3e-2  # our bf16 against transformers fp32 (issue 16)
FUSED_TOL = 1e-2  # fused varlen against sdpa, both bf16: rounding only
MAX_FILES = 8  # what the device tool brings back from $OUT
SNAPSHOT_MAX_BYTES = 16 << 20  # its per-file limit
MIN_LIMIT_S = 20  # a section given less than this is skipped
LOG_TAIL = 4000


@dataclass(frozen=True)
class Section:
    expected_s: int  # on an H200, process start included
    max_s: int
    dry_expected_s: int  # on 2 shared CPU cores
    dry_max_s: int


SECTIONS: dict[str, Section] = {
    "tests": Section(150, 210, 8, 60),
    "parity": Section(20, 60, 15, 60),
    "teardown": Section(45, 120, 12, 60),
    "throughput": Section(170, 240, 15, 90),
    "load": Section(45, 100, 15, 90),
}


# ---------------------------------------------------------------------- shared by the sections


@dataclass
class Context:
    name: str
    out: Path
    dry_run: bool
    limit_s: float
    tmp: Path
    started: float

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    def time_left(self) -> float:
        return self.limit_s - (time.monotonic() - self.started)


class Record:
    """One section's JSON, rewritten (atomically) after every item, so a section stopped at its limit keeps what
    it measured."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    def save(self) -> None:
        write_json(self.path, self.data)


def write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
    partial.replace(path)


def combine(statuses: list[str]) -> str:
    """A section's status from its items': any error, else any fail, else any ok, else skipped."""
    for status in ("timeout", "error", "fail", "ok"):
        if status in statuses:
            return status
    return "skipped"


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-3000:]


def release_memory() -> None:
    """Between items on a GPU: collect cycles that may hold device memory and hand cached blocks back, so the next
    item starts from the same state. On CPU there is nothing to hand back (and a collection costs ~0.3 s)."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def environment() -> dict[str, Any]:
    """Versions and the device, as the section's process sees them (the parent probes the optional features)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "cpus": os.cpu_count(), "machine": platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
    try:  # the installed distribution's version, without importing it
        env["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        env["transformers"] = None
    return env


def feature_probes() -> dict[str, Any]:
    """Every optional feature a comparison depends on, probed once in the parent (no CUDA context needed):
    flash-attn, Triton, torch's varlen_attn and its scale keyword (importing it loads torch._dynamo: seconds),
    the backend "auto" picks on CUDA in bf16, and transformers' flash_attention_2."""
    import torch

    from qwenvl_vision.attention import resolve_attn_impl, torch_varlen_missing

    probes: dict[str, Any] = {"flash_attn": _module_version("flash_attn"), "triton": _module_version("triton")}
    reason = torch_varlen_missing()
    probes["torch_varlen"] = {"available": reason is None, "reason": reason}
    probes["attn_auto_cuda_bf16"] = resolve_attn_impl("auto", "cuda", torch.bfloat16)
    try:
        from transformers.utils import is_flash_attn_2_available

        probes["transformers_flash_attention_2"] = is_flash_attn_2_available()
    except ImportError as e:
        probes["transformers_flash_attention_2"] = f"not probed: {e}"
    return probes


def _module_version(name: str) -> dict[str, Any]:
    """{"version": ...} if the module imports, else {"version": None, "reason": why}."""
    if importlib.util.find_spec(name) is None:
        return {"version": None, "reason": f"{name} is not installed"}
    try:
        module = __import__(name)
    except Exception as e:  # noqa: BLE001 - a broken build (ABI mismatch) is as good as absent
        return {"version": None, "reason": f"import {name} failed: {type(e).__name__}: {e}"}
    return {"version": getattr(module, "__version__", "?")}


# ---------------------------------------------------------------------- 1. tests


def section_tests(ctx: Context, rec: Record) -> str:
    files = ["tests/test_cuda.py"] + ([] if ctx.dry_run else ["tests/test_compile.py"])
    junit = ctx.tmp / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={junit}", *files]
    rec.data.update(command=" ".join(command[1:]), files=files)
    if ctx.dry_run:
        rec.data["dry_run_excludes"] = ("tests/test_compile.py: its inductor compiles take minutes on 2 cores, "
                                        "and CI runs it anyway")
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(5, ctx.time_left() - 10))
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, returncode = _text(e.stdout) + _text(e.stderr), None
    rec.data.update(returncode=returncode, output_tail=output[-LOG_TAIL:])
    outcomes = junit_outcomes(junit) if junit.is_file() else []
    counts = collections.Counter(t["outcome"] for t in outcomes)
    rec.data["counts"] = {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")}
    rec.data["tests"] = outcomes
    rec.data["skip_reasons"] = sorted({t["message"] for t in outcomes if t["outcome"] == "skipped"})
    if returncode is None:
        rec.data["reason"] = "pytest ran past its limit"
        return "timeout"
    if returncode not in (0, 1):
        rec.data["reason"] = f"pytest exited {returncode} (interrupted, internal or usage error)"
        return "error"
    if counts["failed"] or counts["error"]:
        return "fail"
    if not counts["passed"]:
        rec.data["reason"] = "; ".join(rec.data["skip_reasons"])
        return "skipped"
    return "ok"


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def junit_outcomes(path: Path) -> list[dict[str, Any]]:
    """Every test case of a pytest junit XML: name, outcome, seconds and (not passed) the message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "")[:500]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return cases


# ---------------------------------------------------------------------- 2. parity


def section_parity(ctx: Context, rec: Record) -> str:
    import torch

    from bench.throughput import transformers_unavailable
    from bench.workloads import FAMILY_SMALL
    from qwenvl_vision.attention import resolve_attn_impl

    device, dtype = ctx.device, torch.bfloat16
    # The reference is fp32: no TF32 in its convolution (cuDNN allows it by default) or matmuls.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    fused = resolve_attn_impl("auto", device, dtype)
    fused_reason = None if fused != "sdpa" else fused_missing(device, dtype)
    rec.data.update(device=str(device), dtype="bfloat16", reference_dtype="float32", tf32=False,
                    tolerance={"bf16_vs_transformers_fp32": PARITY_TOL, "fused_vs_sdpa": FUSED_TOL},
                    fused_attention=fused if fused_reason is None else None, fused_reason=fused_reason, families={})
    statuses = []
    for family, cfg in FAMILY_SMALL.items():
        entry = rec.data["families"][family] = {}
        reason = transformers_unavailable(cfg, "sdpa")
        if reason is not None:
            entry.update(status="skipped", reason=reason)
        else:
            try:
                parity_one(cfg, device, dtype, fused_reason, entry, extra_grids=not ctx.dry_run)
            except Exception as e:  # noqa: BLE001 - recorded; the next family still runs
                entry.update(status="error", error=error_text(e))
            release_memory()
        statuses.append(entry["status"])
        print(f"parity {family}: {entry['status']} {entry.get('max_rel_err', '')} {entry.get('reason', '')}",
              flush=True)
        rec.save()
    return combine(statuses)


def fused_missing(device, dtype) -> str:
    if device.type != "cuda":
        return "no CUDA"
    from qwenvl_vision.attention import unavailable_reason

    return "; ".join(f"{name}: {unavailable_reason(name, device, dtype)}" for name in ("flash", "torch_varlen"))


def parity_one(cfg, device, dtype, fused_reason: str | None, entry: dict, extra_grids: bool) -> None:
    """Our bf16 tower against transformers' fp32 tower (same weights, same device); then sdpa against fused."""
    import torch

    from bench.reference import hf_forward, hf_tower, item_errors, ours_from
    from bench.workloads import grids_for, inputs

    grids = list(grids_for(cfg)) + ([(1, 64, 80)] if extra_grids else [])  # a long frame: 5120 patches
    pixel_values, grid_thw = inputs(cfg, grids)
    pixel_values = pixel_values.to(device)
    ref = hf_tower(cfg, "sdpa", device=device, dtype=torch.float32, seed=0)
    with torch.inference_mode():
        ref_merged, ref_levels = hf_forward(ref, pixel_values, grid_thw.to(device))
    ours = ours_from(ref, cfg).to(dtype)
    del ref
    with torch.inference_mode():
        merged, levels = ours(pixel_values, grid_thw)
    # Item by item: one norm over the pack would let a large error confined to the smallest image pass.
    merge = cfg.spatial_merge_size
    items = {"merged": item_errors(merged.float().cpu(), ref_merged.float().cpu(), grid_thw, merge),
             "deepstack": [item_errors(a.float().cpu(), b.float().cpu(), grid_thw, merge)
                           for a, b in zip(levels, ref_levels)]}
    errors = {"merged": max(items["merged"]), "deepstack": [max(level) for level in items["deepstack"]],
              "items": items}
    worst = max([errors["merged"], *errors["deepstack"]])
    ok = worst <= PARITY_TOL and len(levels) == len(ref_levels)
    entry.update(attention=ours.attention, grids=grids, patches=int(grid_thw.prod(1).sum()), rel_err=errors,
                 deepstack_levels=[len(levels), len(ref_levels)], max_rel_err=worst, status="ok" if ok else "fail")
    if fused_reason is not None:
        entry["fused_vs_sdpa"] = {"status": "skipped", "reason": fused_reason}
        return
    fused_name = ours.attention
    ours.set_attention("sdpa", device, dtype)
    with torch.inference_mode():
        sdpa_merged, sdpa_levels = ours(pixel_values, grid_thw)
    # Per output (merged, then each DeepStack level), the worst item.
    fused_errors = [max(item_errors(a.float().cpu(), b.float().cpu(), grid_thw, merge))
                    for a, b in zip([merged, *levels], [sdpa_merged, *sdpa_levels])]
    fused_ok = max(fused_errors) <= FUSED_TOL
    entry["fused_vs_sdpa"] = {"status": "ok" if fused_ok else "fail", "fused": fused_name,
                              "rel_err": fused_errors, "max_rel_err": max(fused_errors),
                              "sdpa_vs_transformers_fp32": max(item_errors(sdpa_merged.float().cpu(),
                                                                           ref_merged.float().cpu(), grid_thw, merge))}
    if not fused_ok:
        entry["status"] = "fail"


# ---------------------------------------------------------------------- 3. teardown


def section_teardown(ctx: Context, rec: Record) -> str:
    from bench.teardown import TRANSFORMERS, transformers_variant
    from qwenvl_vision.teardown import add_teardown_arguments, cmd_teardown
    from qwenvl_vision.teardown_cycles import PER_INSTANCE, run_ok

    rec.data["presets"] = {}
    statuses = []
    for name in PRESETS:
        source = ["--preset", name]
        if ctx.dry_run:  # the preset's family at FAMILY_SMALL size
            source = ["--config", str(small_config_file(ctx.tmp, name))]
        parser = argparse.ArgumentParser()
        add_teardown_arguments(parser, variants=(PER_INSTANCE, TRANSFORMERS))
        args = parser.parse_args([*source, "--cycles", "1" if ctx.dry_run else "5", "--device", ctx.device.type,
                                  "--dtype", "fp32" if ctx.dry_run else "bf16", "--snapshot-dir", str(ctx.tmp),
                                  "--quiet"])
        reports: list[dict] = []
        entry = rec.data["presets"][name] = {}
        try:
            cmd_teardown(args, extra_variants={TRANSFORMERS: transformers_variant}, after=reports.append)
            report = reports[0]
            entry.update(teardown_summary(report, run_ok), status="ok" if report["ok"] else "fail", report=report)
            entry["snapshot"] = keep_snapshot(report, ctx.out)
        except Exception as e:  # noqa: BLE001 - recorded; the next preset still runs
            entry.update(status="error", error=error_text(e))
        release_memory()
        statuses.append(entry["status"])
        rec.save()
    return combine(statuses)


def small_config(preset_name: str):
    """The dry run's stand-in for a preset: its family's FAMILY_SMALL tower, named after it."""
    from bench.workloads import FAMILY_SMALL
    from qwenvl_vision.config import preset

    return FAMILY_SMALL[preset(preset_name).family].replace(name=f"{preset_name} (dry run: FAMILY_SMALL size)")


def small_config_file(folder: Path, preset_name: str) -> Path:
    path = folder / f"{preset_name}.json"
    path.write_text(json.dumps(small_config(preset_name).to_config_json()))
    return path


def teardown_summary(report: dict, run_ok: Callable[[dict], bool]) -> dict:
    """Per run: retained allocated bytes per cycle (after del / after close and del), bytes still held after
    close() while the caller holds the encoder, and the reserved bytes after empty_cache() against the baseline."""
    runs = []
    for run in report["runs"]:
        base = run["baseline"]
        reserved = [c["phases"]["after_teardown"].get("cuda_reserved") for c in run["cycles"]]
        runs.append({
            "variant": run["variant"], "teardown": run["teardown"], "cycles": len(run["cycles"]),
            "weights_bytes": run["weights_bytes"], "retained_bytes": run["retained_bytes"],
            "retained_by_cycle": run["retained_by_cycle"], "retained_bytes_after_gc": run["retained_bytes_after_gc"],
            "held_after_close_bytes": run.get("held_after_close_bytes"), "freed_by_refcount": run["freed_by_refcount"],
            "baseline_allocated": base.get("cuda_allocated"), "baseline_reserved": base.get("cuda_reserved"),
            "reserved_after_empty_cache_by_cycle": reserved,
            "ok": run_ok(run) if run["variant"] == "per-instance" else None,
        })
    return {"model": report["model"], "device": report["device"], "dtype": report["dtype"],
            "metric": report["metric"], "runs": runs, "skipped": report["skipped"]}


def keep_snapshot(report: dict, out: Path) -> dict | None:
    """The first CUDA memory snapshot of a failed run, copied into out if it fits what comes back."""
    for path in map(Path, report.get("snapshots", ())):
        size = path.stat().st_size
        target = out / "teardown-snapshot.pickle"
        if size <= SNAPSHOT_MAX_BYTES and not target.exists():
            shutil.copyfile(path, target)
            return {"file": target.name, "bytes": size}
        return {"file": None, "bytes": size, "reason": "over the 16 MiB a returned file may have"}
    return None


# ---------------------------------------------------------------------- 4. throughput


def section_throughput(ctx: Context, rec: Record) -> str:
    import torch

    import bench.throughput as tp
    from bench.workloads import build_inputs
    from qwenvl_vision import preset

    device = ctx.device
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    peak = tp.peak_rate(device, dtype, matmul_n=256 if ctx.dry_run else 8192)
    input_sets = ("small",) if ctx.dry_run else ("mixed", "1024-patch")
    # Dry run: dynamo and AOT autograd without inductor's code generation (minutes on 2 cores). Not "eager":
    # dynamo's eager backend fails on these packs with a ConstraintViolationError that aot_eager and inductor
    # do not raise.
    compile_options = {"backend": "aot_eager"} if ctx.dry_run else {}
    repeats = 1 if ctx.dry_run else 3
    rec.data.update(device=str(device), dtype=str(dtype).replace("torch.", ""), peak=peak, inputs=input_sets,
                    compile_options=compile_options, repeats=repeats, results=[])
    statuses = []
    for name in PRESETS:
        cfg = small_config(name) if ctx.dry_run else preset(name)
        variants = None
        try:
            variants, skipped = tp.build_variants(cfg, device, dtype, ("sdpa", "flash_attention_2"), compile_options)
            for i, inputs in enumerate(input_sets):
                pixel_values, grid_thw, items = build_inputs(inputs, cfg)
                failed: dict[str, str] = {}
                # The first round of the first input set compiles; one more warm-up lets its autotuning settle.
                warmup = 2 if i == 0 and not ctx.dry_run else 1
                timings = tp.measure(variants, pixel_values, grid_thw, device, warmup=warmup,
                                     repeats=repeats, failed=failed)
                result = tp.summarize(cfg, name, inputs, grid_thw, items, device, dtype, timings, peak, skipped)
                result["failed"] = failed
                result["goals"] = throughput_goals(result)
                result["status"] = "fail" if any(not n.startswith(tp.REFERENCE) for n in failed) else "ok"
                tp.print_table(result)
                rec.data["results"].append(result)
                statuses.append(result["status"])
                rec.save()
        except Exception as e:  # noqa: BLE001 - recorded; the next preset still runs
            rec.data["results"].append({"preset": name, "status": "error", "error": error_text(e)})
            statuses.append("error")
            rec.save()
        del variants
        release_memory()
    return combine(statuses)


def throughput_goals(result: dict) -> dict:
    """Issue 16's goals, reported (not asserted): >= 2x transformers sdpa at >= 16k patches a pack, and >= 50% of
    the dense bf16 peak."""
    goals: dict[str, Any] = {"patches_at_least_16k": result["patches"] >= 16384}
    for name, v in result["variants"].items():
        if "speedup_vs" in v:
            goals[name] = {"speedup_vs_sdpa_at_least_2x": v["speedup_vs"].get("transformers", 0) >= 2,
                           "half_of_peak": v["fraction_of_peak"] >= 0.5}
    return goals


# ---------------------------------------------------------------------- 5. load


def section_load(ctx: Context, rec: Record) -> str:
    import bench.load as bl

    argv = ["--preset", PRESETS[0], "--device", ctx.device.type, "--dtypes", "bf16", "--workdir", str(ctx.tmp),
            "--timeout", str(int(max(10, ctx.time_left())))]
    argv += ["--depth", "1", "--repeats", "1", "--warmup", "0"] if ctx.dry_run else ["--repeats", "3", "--warmup", "1"]
    rec.data.update(argv=argv)
    try:
        report = bl.main([*argv, "--rows", "ours,hf-tower"])
    except Exception as e:  # noqa: BLE001 - transformers' row may fail on another version: measure ours alone
        rec.data["hf_tower_error"] = error_text(e)
        rec.save()
        report = bl.main([*argv, "--rows", "ours"])
    rec.data["report"] = report
    rec.data["rows"] = {f"{r['row']}-{r['dtype']}": {k: r.get(k) for k in (
        "seconds_median", "seconds_all", "peak_delta_median", "peak_over_tower", "tower_bytes", "tower_device",
        "cuda_peak_allocated", "time_vs_ours", "peak_vs_ours", "max_rel_err_vs_ours")} for r in report["rows"]}
    if "hf_tower_error" in rec.data:
        rec.data["skipped"] = {"hf-tower": "transformers' tower load failed (see hf_tower_error)"}
    return "ok"


SECTION_FUNCTIONS: dict[str, Callable[[Context, Record], str]] = {
    "tests": section_tests, "parity": section_parity, "teardown": section_teardown,
    "throughput": section_throughput, "load": section_load,
}


def run_section(name: str, out: Path, dry_run: bool, limit_s: float) -> int:
    """In the section's own process: run it, record its status; exit 0 unless the JSON could not be written."""
    started = time.monotonic()
    section = SECTIONS[name]
    rec = Record(out / f"{name}.json", {
        "section": name, "status": "running", "dry_run": dry_run, "limit_s": round(limit_s),
        "expected_s": section.dry_expected_s if dry_run else section.expected_s,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    rec.save()
    with tempfile.TemporaryDirectory(prefix=f"cuda_check-{name}-") as tmp:
        ctx = Context(name, out, dry_run, limit_s, Path(tmp), started)
        try:
            rec.data["environment"] = environment()
            status = SECTION_FUNCTIONS[name](ctx, rec)
        except Exception as e:  # noqa: BLE001 - the section's own failure, recorded
            rec.data["error"] = error_text(e)
            status = "error"
            traceback.print_exc()
    rec.data.update(status=status, seconds=round(time.monotonic() - started, 1))
    rec.save()
    return 0


# ---------------------------------------------------------------------- the parent: limits, processes, summary


def section_limit(name: str, selected: list[str], deadline: float, dry_run: bool, overrides: dict[str, float]
                  ) -> tuple[float, float]:
    """(the section's limit, the time the budget leaves it): its own limit (or the override), cut so that every
    later selected section keeps its expected time."""
    def spec(n: str) -> tuple[int, int]:
        s = SECTIONS[n]
        return (s.dry_expected_s, s.dry_max_s) if dry_run else (s.expected_s, s.max_s)

    later = selected[selected.index(name) + 1:]
    available = deadline - time.monotonic() - sum(spec(n)[0] for n in later)
    return min(overrides.get(name, spec(name)[1]), available), available


def run_child(name: str, out: Path, dry_run: bool, limit_s: float) -> tuple[int | None, str, float]:
    """The section in a fresh process (its own process group, so its children stop with it); its output streams
    through with a prefix. Returns (exit code or None on timeout, output tail, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "bench.cuda_check", "--section", name, "--out", str(out),
               "--limit", str(limit_s)] + (["--dry-run"] if dry_run else [])
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)

    def pump() -> None:
        for line in proc.stdout:
            tail.append(line)
            print(f"[{name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=10)
    return code, "".join(tail)[-LOG_TAIL:], time.monotonic() - start


def finish_record(name: str, out: Path, dry_run: bool, code: int | None, log: str, seconds: float, limit_s: float
                  ) -> dict[str, Any]:
    """The section's JSON as its process left it, with the parent's view added (timeout, crash, log tail)."""
    path = out / f"{name}.json"
    path.with_name(path.name + ".partial").unlink(missing_ok=True)  # a write cut short by the kill
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"section": name, "dry_run": dry_run, "limit_s": round(limit_s)}
    if code is None:
        data.update(status="timeout", reason=f"stopped at its limit of {limit_s:.0f} s; items measured so far kept")
    elif data.get("status") in (None, "running"):
        data.update(status="error", reason=f"the section's process exited {code} before finishing")
    data.update(wall_s=round(seconds, 1), log_tail=log)
    write_json(path, data)
    return data


def headline(data: dict[str, Any]) -> list[str]:
    """The few numbers of a section worth a line each in summary.txt."""
    name = data.get("section")
    lines: list[str] = []
    if name == "tests" and "counts" in data:
        lines.append(", ".join(f"{v} {k}" for k, v in data["counts"].items()))
        lines += [f"FAILED {t['test']}: {t['message'][:150]}" for t in data.get("tests", ())
                  if t["outcome"] in ("failed", "error")]
    elif name == "parity":
        for family, e in data.get("families", {}).items():
            fused = e.get("fused_vs_sdpa", {})
            fused_text = (f"fused {fused.get('fused')} vs sdpa {fused['max_rel_err']:.1e}" if "max_rel_err" in fused
                          else f"fused: {fused.get('reason', '-')}")
            lines.append(f"{family}: {e['status']}, " + (f"max rel err {e['max_rel_err']:.1e} ({e['attention']}), "
                                                         f"{fused_text}" if "max_rel_err" in e
                                                         else e.get("reason") or e.get("error", "")[-200:]))
    elif name == "teardown":
        for preset_name, e in data.get("presets", {}).items():
            for run in e.get("runs", ()):
                reserved = [r for r in run["reserved_after_empty_cache_by_cycle"] if r is not None]
                lines.append(f"{preset_name} {run['variant']}/{run['teardown']}: retained {run['retained_bytes']} B "
                             f"(worst of {run['cycles']} cycles)"
                             + (f", held after close {run['held_after_close_bytes']} B"
                                if run["held_after_close_bytes"] is not None else "")
                             + (f", reserved after empty_cache {max(reserved) - run['baseline_reserved']} B above "
                                "baseline" if reserved else ""))
            if "error" in e:
                lines.append(f"{preset_name}: error {e['error'][-200:]}")
    elif name == "throughput":
        for r in data.get("results", ()):
            if "variants" not in r:
                lines.append(f"{r['preset']}: {r['status']} {r.get('error', '')[-200:]}")
                continue
            parts = [f"{n} {v['median_s'] * 1e3:.0f} ms {v['items_per_s']:.1f} img/s {v['patches_per_s']:.0f} tok/s "
                     f"{v['fraction_of_peak']:.0%} of peak" for n, v in r["variants"].items()]
            speed = [f"{n} {v['speedup_vs']['transformers']:.2f}x" for n, v in r["variants"].items()
                     if "transformers" in v.get("speedup_vs", {})]
            lines.append(f"{r['preset']} {r['inputs']} ({r['patches']} patches): " + "; ".join(parts)
                         + (f"; vs transformers sdpa: {', '.join(speed)}" if speed else ""))
    elif name == "load":
        for row, r in data.get("rows", {}).items():
            lines.append(f"{row}: {r['seconds_median']:.2f} s, host peak {r['peak_over_tower']:.2f}x tower bytes"
                         + (f", {r['time_vs_ours']:.2f}x ours' time" if r.get("time_vs_ours") else ""))
    if data.get("status") in ("error", "timeout", "skipped", "fail") and data.get("reason"):
        lines.append(f"reason: {data['reason'][:300]}")
    if data.get("status") == "error" and data.get("error"):
        lines.append(f"error: {data['error'].strip().splitlines()[-1][:300]}")
    return lines


def summarize_run(out: Path, dry_run: bool, budget_s: float, results: dict[str, dict], started: float,
                  probes: dict[str, Any]) -> int:
    device_env = next((d["environment"] for d in results.values() if "environment" in d), {})
    summary = {
        "dry_run": dry_run, "budget_s": budget_s, "seconds": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:], "environment": {**device_env, **probes},
        "sections": {name: {"status": d.get("status"), "wall_s": d.get("wall_s"), "limit_s": d.get("limit_s"),
                            "expected_s": d.get("expected_s"), "file": f"{name}.json", "reason": d.get("reason"),
                            "headline": headline(d)}
                     for name, d in results.items()},
    }
    ok = all(d.get("status") in ("ok", "skipped") for d in results.values())
    summary["ok"] = ok
    text = summary_text(summary)
    files = {p.name for p in out.iterdir() if not p.name.endswith(".partial")} | {"summary.json", "summary.txt"}
    write_json(out / "summary.json", {**summary, "files": sorted(files)})
    (out / "summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)
    if len(files) > MAX_FILES:
        print(f"warning: {len(files)} files in {out}; the device tool brings back {MAX_FILES}", flush=True)
    return 0 if ok else 1


def summary_text(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    lines = [f"cuda_check{' (dry run, CPU)' if summary['dry_run'] else ''}: {env.get('device_name', 'no GPU')}, "
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, "
             f"flash-attn {env.get('flash_attn', {}).get('version')}, torch varlen "
             f"{'yes' if env.get('torch_varlen', {}).get('available') else 'no'}, auto attention on CUDA bf16: "
             f"{env.get('attn_auto_cuda_bf16')}; {summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget"]
    for name, s in summary["sections"].items():
        wall = f"{s['wall_s']:.0f} s" if s.get("wall_s") is not None else "-"
        lines.append(f"[{s['status']}] {name} ({wall}, limit {s.get('limit_s')} s, expected {s.get('expected_s')} s)")
        lines += [f"    {line}" for line in s["headline"]]
    lines.append("ALL OK" if summary["ok"] else "NOT ALL OK: see the sections above and their JSON files")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files (the device tool's $OUT)")
    p.add_argument("--dry-run", action="store_true", help="the same logic on CPU with tiny configs")
    p.add_argument("--only", help=f"comma-separated sections, in this order: {','.join(SECTIONS)}")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 480, dry run 300)")
    p.add_argument("--limits", default="", help="override section limits, e.g. tests=300,load=60")
    p.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)  # run one section, in this process
    p.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, args.out, args.dry_run, args.limit or SECTIONS[args.section].max_s)
    selected = list(SECTIONS) if not args.only else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in selected if s not in SECTIONS]
    try:
        overrides = {k: float(v) for k, _, v in (item.partition("=") for item in args.limits.split(",") if item)}
    except ValueError:
        overrides = {"": 0.0}
    if unknown or set(overrides) - set(SECTIONS):
        print(f"cuda_check: unknown sections {unknown or sorted(set(overrides) - set(SECTIONS))}; "
              f"known: {list(SECTIONS)}", file=sys.stderr)
        return 2
    selected = [s for s in SECTIONS if s in selected]
    started = time.monotonic()
    budget = args.budget or (300.0 if args.dry_run else 480.0)
    deadline = started + budget
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("cuda_check: no CUDA device here; use --dry-run for the CPU run of the same logic", file=sys.stderr)
            return 2
    try:
        probes = feature_probes()
    except Exception as e:  # noqa: BLE001 - the sections still run; they resolve what they need themselves
        probes = {"error": error_text(e)}
    print(f"features: {json.dumps(probes)}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in selected:
        limit, available = section_limit(name, selected, deadline, args.dry_run, overrides)
        if available < MIN_LIMIT_S:
            results[name] = {"section": name, "status": "skipped", "dry_run": args.dry_run,
                             "reason": f"budget spent: {available:.0f} s left for it after keeping the later "
                                       f"sections' expected time (budget {budget:.0f} s)"}
            write_json(args.out / f"{name}.json", results[name])
            continue
        print(f"== {name}: limit {limit:.0f} s", flush=True)
        code, log, seconds = run_child(name, args.out, args.dry_run, limit)
        results[name] = finish_record(name, args.out, args.dry_run, code, log, seconds, limit)
        print(f"== {name}: {results[name]['status']} in {seconds:.0f} s", flush=True)
    return summarize_run(args.out, args.dry_run, budget, results, started, probes)


if __name__ == "__main__":
    sys.exit(main())
