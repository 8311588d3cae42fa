"""The five sections of ``bench.cuda_check`` (parity, throughput, tests, teardown, load), each run in its own
process by that script's ``--section NAME``, and what they share: the section's context and time left, its JSON
record rewritten after every measurement, statuses, errors, memory release between items. What each section
checks, in which order and how long it may take is ``bench.cuda_check``'s help.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
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
# On the GPU: the goal's batch (16 images of 1024 patches) and the mixed pack first; the batch sweep on the 3B.
GPU_INPUTS = {"qwen2.5-vl-3b": ("16x1024", "mixed", "1x1024", "4x1024", "64x1024"), "qwen3-vl-8b": ("16x1024", "mixed")}
PARITY_TOL = 3e-2  # our bf16 against transformers fp32 (test_towers' bf16 tolerance)
FUSED_TOL = 1e-2  # fused varlen against sdpa, both bf16: rounding only
SNAPSHOT_MAX_BYTES = 16 << 20  # the device tool's per-file limit
LOG_TAIL = 4000


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


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` by a rename: a run killed at its time limit leaves the previous file, never half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_whole(path, json.dumps(data, indent=1, default=str) + "\n")


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


# ---------------------------------------------------------------------- tests


GPU_TEST_FILES = ("tests/backends/test_cuda.py",)  # what needs the GPU; CI runs every other test file
VERBOSE_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def section_tests(ctx: Context, rec: Record) -> str:
    """The GPU test files under pytest. Each outcome is recorded as pytest prints it (``-v``), so a run stopped
    midway keeps the tests that finished; at the end pytest's junit XML replaces them with messages and times."""
    files = list(GPU_TEST_FILES)
    junit = ctx.tmp / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs", f"--junitxml={junit}", *files]
    rec.data.update(command=" ".join(command[1:]), files=files, tests=[], counts=outcome_counts([]))
    rec.save()
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=400)

    def follow() -> None:
        for line in proc.stdout:
            tail.append(line)
            match = VERBOSE_OUTCOME.match(line)
            if match:
                outcome = match.group(2).lower()
                rec.data["tests"].append({"test": match.group(1), "outcome": {"xpass": "passed"}.get(outcome, outcome),
                                          "seconds": None, "message": ""})
                rec.data["counts"] = outcome_counts(rec.data["tests"])
                rec.save()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=max(5.0, ctx.time_left() - 10))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        returncode = None
    reader.join(timeout=10)
    output = "".join(tail)
    rec.data.update(returncode=returncode, output_tail=output[-LOG_TAIL:])
    if junit.is_file():
        rec.data["tests"] = junit_outcomes(junit)
    outcomes = rec.data["tests"]
    counts = rec.data["counts"] = outcome_counts(outcomes)
    rec.data["skip_reasons"] = sorted({t["message"] for t in outcomes if t["outcome"] == "skipped" and t["message"]})
    if returncode is None:
        rec.data["reason"] = "pytest ran past its limit; the outcomes before it are kept"
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


def outcome_counts(outcomes: list[dict[str, Any]]) -> dict[str, int]:
    counts = collections.Counter(t["outcome"] for t in outcomes)
    return {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")}


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


# ---------------------------------------------------------------------- parity


def section_parity(ctx: Context, rec: Record) -> str:
    import torch

    from bench.throughput import transformers_unavailable
    from qwenvl_vision.model.attention import resolve_attn_impl
    from qwenvl_vision.testing.workloads import FAMILY_SMALL

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
    from qwenvl_vision.model.attention import unavailable_reason

    return "; ".join(f"{name}: {unavailable_reason(name, device, dtype)}" for name in ("flash", "torch_varlen"))


def parity_one(cfg, device, dtype, fused_reason: str | None, entry: dict, extra_grids: bool) -> None:
    """Our bf16 tower against transformers' fp32 tower (same weights, same device); then sdpa against fused."""
    import torch

    from qwenvl_vision.testing.reference import hf_forward, hf_tower, item_errors, ours_from
    from qwenvl_vision.testing.workloads import grids_for, inputs

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
    ours.set_attention("sdpa")
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


# ---------------------------------------------------------------------- teardown


TEARDOWN_CYCLES = 3  # on the GPU; a leak shows from the first cycle, repeats show it is not a one-off
TEARDOWN_RUNS = (("per-instance", "del"), ("per-instance", "close"), ("transformers", "del"))


def section_teardown(ctx: Context, rec: Record) -> str:
    """Per preset, each run (our encoder torn down by ``del``, by ``close()``, transformers' tower by ``del``) is
    its own ``cmd_teardown`` call, saved when it ends."""
    from bench.teardown import TRANSFORMERS, transformers_variant
    from bench.throughput import transformers_unavailable
    from qwenvl_vision import preset
    from qwenvl_vision.teardown.cycles import PER_INSTANCE, run_ok
    from qwenvl_vision.teardown.study import add_teardown_arguments, cmd_teardown

    cycles = 1 if ctx.dry_run else TEARDOWN_CYCLES
    rec.data.update(cycles=cycles, presets={})
    statuses = []
    for name in PRESETS:
        source, cfg = ["--preset", name], preset(name)
        if ctx.dry_run:  # the preset's family at FAMILY_SMALL size
            source, cfg = ["--config", str(small_config_file(ctx.tmp, name))], small_config(name)
        entry = rec.data["presets"][name] = {"runs": [], "skipped": {}, "reports": []}
        transformers_reason = transformers_unavailable(cfg, "sdpa")
        for variant, teardown in TEARDOWN_RUNS:
            label = f"{variant}/{teardown}"
            if variant == TRANSFORMERS and transformers_reason is not None:
                entry["skipped"][label] = transformers_reason
            else:
                parser = argparse.ArgumentParser()
                add_teardown_arguments(parser, variants=(PER_INSTANCE, TRANSFORMERS))
                args = parser.parse_args([*source, "--variants", variant, "--teardown", teardown, "--cycles",
                                          str(cycles), "--device", ctx.device.type, "--dtype",
                                          "fp32" if ctx.dry_run else "bf16", "--snapshot-dir", str(ctx.tmp), "--quiet"])
                reports: list[dict] = []
                try:
                    cmd_teardown(args, extra_variants={TRANSFORMERS: transformers_variant}, after=reports.append)
                    summary = teardown_summary(reports[0], run_ok)
                    entry["runs"] += summary["runs"]
                    entry["skipped"].update({s["variant"]: s["reason"] for s in summary["skipped"]})
                    entry.update({k: summary[k] for k in ("model", "device", "dtype", "metric")})
                    entry["reports"].append(reports[0])
                    entry["snapshot"] = entry.get("snapshot") or keep_snapshot(reports[0], ctx.out)
                except Exception as e:  # noqa: BLE001 - recorded; the next run still goes
                    entry.setdefault("errors", {})[label] = error_text(e)
                release_memory()
            entry["status"] = teardown_status(entry)
            rec.save()
        statuses.append(entry["status"])
    return combine(statuses)


def teardown_status(entry: dict) -> str:
    """A preset's status: error if a run raised, fail if one of ours kept memory; transformers' tower is reported,
    not judged (it holds no per-instance cache to release)."""
    if entry.get("errors"):
        return "error"
    ours = [r for r in entry["runs"] if r["ok"] is not None]
    if not ours:
        return "skipped"
    return "ok" if all(r["ok"] for r in ours) else "fail"


def small_config(preset_name: str):
    """The dry run's stand-in for a preset: its family's FAMILY_SMALL tower, named after it."""
    from qwenvl_vision.model.config import preset
    from qwenvl_vision.testing.workloads import FAMILY_SMALL

    return FAMILY_SMALL[preset(preset_name).model_type].replace(name=f"{preset_name} (dry run: FAMILY_SMALL size)")


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
        if target.exists():
            return {"file": None, "bytes": size, "reason": f"{target.name} holds an earlier snapshot"}
        if size > SNAPSHOT_MAX_BYTES:
            return {"file": None, "bytes": size, "reason": "over the 16 MiB a returned file may have"}
        shutil.copyfile(path, target)
        return {"file": target.name, "bytes": size}
    return None


# ---------------------------------------------------------------------- throughput


def section_throughput(ctx: Context, rec: Record) -> str:
    import torch

    import bench.throughput as tp
    from bench.workloads import build_inputs
    from qwenvl_vision import preset

    device = ctx.device
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    peak = tp.peak_rate(device, dtype, matmul_n=256 if ctx.dry_run else 8192)
    # Dry run: dynamo and AOT autograd without inductor's code generation (minutes on 2 cores). Not "eager":
    # dynamo's eager backend fails on these packs with a ConstraintViolationError that aot_eager and inductor
    # do not raise.
    compile_options = {"backend": "aot_eager"} if ctx.dry_run else {}
    repeats = 1 if ctx.dry_run else 3
    input_sets = {name: ("small",) for name in PRESETS} if ctx.dry_run else GPU_INPUTS
    rec.data.update(device=str(device), dtype=str(dtype).replace("torch.", ""), peak=peak, inputs=input_sets,
                    compile_options=compile_options, repeats=repeats, results=[], measuring=None)
    rec.save()
    statuses = []
    for name in PRESETS:
        cfg = small_config(name) if ctx.dry_run else preset(name)
        variants = None
        try:
            rec.data["measuring"] = {"preset": name, "step": "building the towers"}
            rec.save()
            variants, skipped = tp.build_variants(cfg, device, dtype, ("sdpa", "flash_attention_2"), compile_options)
            for i, inputs in enumerate(input_sets[name]):
                # What a section stopped here was doing; each finished input set is in "results".
                rec.data["measuring"] = {"preset": name, "inputs": inputs, "variants": list(variants),
                                         "skipped": skipped}
                rec.save()
                pixel_values, grid_thw, items = build_inputs(inputs, cfg)
                failed: dict[str, str] = {}
                # The first round of the first input set compiles; one more warm-up lets its autotuning settle.
                warmup = 2 if i == 0 and not ctx.dry_run else 1
                graphs_before = compiled_graphs()
                timings = tp.measure(variants, pixel_values, grid_thw, device, warmup=warmup,
                                     repeats=repeats, failed=failed)
                result = tp.summarize(cfg, name, inputs, grid_thw, items, device, dtype, timings, peak, skipped)
                # Graphs made during a later input set are recompiles: the dynamic token count should need none.
                made = compiled_graphs() - graphs_before
                result["compiled_graphs"] = {"total": compiled_graphs(), "compiled": made if i == 0 else 0,
                                             "recompiled": made if i > 0 else 0}
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
    rec.data["measuring"] = None
    return combine(statuses)


def compiled_graphs() -> int:
    """Graphs dynamo has made in this process so far (every compiled variant's)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def throughput_goals(result: dict) -> dict:
    """The speed goals, reported (not asserted): >= 2x transformers sdpa at >= 16k patches a pack, and >= 50% of
    the dense bf16 peak."""
    goals: dict[str, Any] = {"patches_at_least_16k": result["patches"] >= 16384}
    for name, v in result["variants"].items():
        if "speedup_vs" in v:
            goals[name] = {"speedup_vs_sdpa_at_least_2x": v["speedup_vs"].get("transformers", 0) >= 2,
                           "half_of_peak": v["fraction_of_peak"] >= 0.5}
    return goals


# ---------------------------------------------------------------------- load


LOAD_REPEATS = 2  # fresh-process loads per row on the GPU, after one discarded warm-up load


def section_load(ctx: Context, rec: Record) -> str:
    """``bench.load``'s rows ours and hf-tower, bf16, onto the device: every fresh-process load is saved when it
    returns (its run, and the rows' medians so far), so a section stopped midway keeps the loads that finished."""
    import torch

    import bench.load as bl
    from bench.throughput import transformers_unavailable

    argv = ["--preset", PRESETS[0], "--device", ctx.device.type, "--dtypes", "bf16", "--workdir", str(ctx.tmp)]
    argv += (["--depth", "1", "--repeats", "1", "--warmup", "0"] if ctx.dry_run
             else ["--repeats", str(LOAD_REPEATS), "--warmup", "1"])
    args = bl.parse_args(argv)
    cfg = load_config(args)
    rows = ["ours", "hf-tower"]
    rec.data.update(argv=argv, preset=cfg.name, repeats=args.repeats, warmup=args.warmup, skipped={}, errors={},
                    runs={}, rows={}, warmup_s=[])
    reason = transformers_unavailable(cfg, "sdpa")
    if reason is not None:
        rows.remove("hf-tower")
        rec.data["skipped"]["hf-tower"] = reason
    rec.data["transformers_paths"] = bl.transformers_paths(cfg.model_type, set(rows))
    folder, wrote = bl.ensure_checkpoint(args.workdir, cfg, args.seed)
    rec.data.update(checkpoint_bytes=sum(f.stat().st_size for f in folder.glob("*.safetensors")),
                    checkpoint_write_s=wrote, environment_load=bl.environment(args.device))
    rec.save()

    def child(row: str, probe: Path | None = None) -> dict:
        spec = bl.spec_for(row, "bf16", folder, cfg, probe, args.device)
        return bl.run_child(spec, max(10.0, ctx.time_left()))

    for _ in range(args.warmup):  # page cache and the CUDA driver's files: discarded
        rec.data["warmup_s"].append(child(rows[0])["seconds"])
        rec.save()
    runs: dict[tuple[str, str], list[dict]] = {}
    probes: dict[tuple[str, str], torch.Tensor] = {}
    summaries: dict[tuple[str, str], dict] = {}
    for repeat in range(args.repeats):
        for row in list(rows):
            probe = ctx.tmp / f"probe-{row}.pt" if repeat == 0 else None
            try:
                result = child(row, probe)
            except Exception as e:  # noqa: BLE001 - transformers' row may fail on another version: ours goes on
                if row == "ours":
                    raise
                rows.remove(row)
                rec.data["errors"][row] = error_text(e)
                last_line = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                rec.data["skipped"][row] = f"its load failed, so it is not compared: {last_line[:300]}"
                rec.save()
                continue
            runs.setdefault((row, "bf16"), []).append(result)
            if probe is not None:
                probes[(row, "bf16")] = torch.load(probe)
            summaries = {key: bl.summarize(r) for key, r in runs.items()}
            bl.compare(summaries, probes)
            rec.data["runs"] = {f"{r}-{dt}": rs for (r, dt), rs in runs.items()}
            rec.data["rows"] = {f"{r}-{dt}": {k: s.get(k) for k in (
                "seconds_median", "seconds_all", "peak_delta_median", "peak_over_tower", "tower_bytes",
                "tower_device", "cuda_peak_allocated", "time_vs_ours", "peak_vs_ours", "max_rel_err_vs_ours")}
                for (r, dt), s in summaries.items()}
            rec.save()
            print(f"load [{repeat + 1}/{args.repeats}] {row}: {result['seconds']:.2f} s", flush=True)
    if summaries:
        print(bl.table(summaries), flush=True)
    return "ok"


def load_config(args: argparse.Namespace):
    """The preset ``bench.load`` would load for these arguments (``--depth`` truncates it, named so)."""
    from bench.workloads import truncated
    from qwenvl_vision import preset

    cfg = preset(args.preset)
    if args.depth:
        cfg = truncated(cfg, args.depth)
        cfg = cfg.replace(name=f"{cfg.name}-depth{cfg.depth}")
    return cfg


SECTION_FUNCTIONS: dict[str, Callable[[Context, Record], str]] = {
    "parity": section_parity, "throughput": section_throughput, "tests": section_tests,
    "teardown": section_teardown, "load": section_load,
}


