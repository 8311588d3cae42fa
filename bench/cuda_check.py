"""The one prepared check for a lent GPU: bf16 parity, throughput, the CUDA tests, teardown and load, as JSON.

    python -m bench.cuda_check --out DIR                      # on the GPU machine (DIR: the device tool's $OUT)
    python -m bench.cuda_check --out DIR --dry-run            # the same logic on CPU with tiny configs (CI)
    python -m bench.cuda_check --out DIR --only parity,load   # some sections (e.g. a rerun)

From the repository root (``bench`` is a package). With the device tool (its python3 has torch and transformers;
nothing is installed):

    run(command="PYTHONUNBUFFERED=1 python3 -m bench.cuda_check --out $OUT", timeout_s=570)

Every section runs in its own fresh process (``--section NAME``, started by this script) under its own time limit,
so a crash, a CUDA error that poisons the context, a hang or leftover GPU memory stays in that section: it is
recorded and the next section runs. A section rewrites ``DIR/<section>.json`` after every measurement (a parity
family, a throughput input set, a teardown run, a test's outcome, a fresh-process load), so a section stopped at
its limit still leaves what it measured. ``DIR/summary.json`` and ``DIR/summary.txt`` are rewritten after every
section (the final one also printed): each section's status (ok / fail / skipped / error / timeout / not_run),
its estimate, limit and time, and its key numbers. At most one more file is written, a CUDA memory snapshot of a
failed teardown: 8 files in all, what the device tool brings back.

The sections run in the order that lets a run cut short still answer what matters most: the numbers (parity,
throughput) first, then what CI cannot check without a GPU. Their estimated time on an H200 (16 CPU cores) and
their limit, each including its process start (~5 s: torch, transformers, the CUDA context), are estimates from
the FLOP counts, the CPU runs and the machine notes (an 8192^3 bf16 matmul at ~790 TFLOP/s there), not
measurements. The whole run is planned for ``DEVICE_BUDGET_S`` (480 s of the device's 15 minutes, the rest for the
machine's start): the estimates add up to 370 s and the limits to 480 s, and every run records that plan and
fails if it no longer fits. ``--budget`` stops the run earlier: a section's limit is cut so that every later
section keeps its estimated time, and a section left with less than ``MIN_LIMIT_S`` is not run, with that reason,
which fails the run (a skip is for what the machine lacks).

1. ``parity`` (~20 s, limit 40 s): every family of ``testing.workloads.FAMILY_SMALL``: our tower in bf16 against
   transformers' tower of that family in fp32 (same weights, same device, TF32 off), on a packed mix with a
   2-frame video, a 2x2 grid, frames off the window grid and (GPU) a 64x80-patch frame: merged tokens and every
   DeepStack level of every item within 3e-2 relative error. Then the same tower with ``attn_impl="sdpa"`` against
   the fused varlen path that ``"auto"`` chose (flash or torch_varlen), within 1e-2: both are bf16 with fp32 softmax
   accumulation and the same weights, so they differ only where the attention output rounds differently, a
   part of the bf16-vs-fp32 error of these towers (7e-3 to 1.2e-2 on CPU; each entry also records the sdpa
   path's error against fp32, the noise floor of that run), while a wrong segment boundary gives errors near 1.
2. ``throughput`` (~185 s, limit 215 s): ``bench.throughput``'s pieces, bf16, qwen2.5-vl-3b then qwen3-vl-8b,
   each on 16 images of 1024 patches (the goal's batch) and the mixed pack (29k / 22k patches), then for the 3B
   batches of 1, 4 and 64 such images: ours eager, ours compiled, transformers sdpa and flash_attention_2 where
   usable, 3 timed repeats after warm-up, with images/s, patches/s, TFLOP/s and the fraction of the dense bf16
   peak (the bf16 GEMM rate measured in the same run beside it); host time and CUDA-event time (a host time
   well above the GPU's is a launch-bound call); peak memory above the weights and inputs; the graphs dynamo
   made, and how many of them a later input set added (recompiles). Per preset: ~45 s compiling, ~1 s per
   transformers forward on the mixed pack (a Python loop over ~450 windows in 28 blocks) and ~0.1 s per forward
   of ours, so ~80 s; the 3B's batch sweep adds ~85 images a round, ~15 s with transformers' forwards.
3. ``tests`` (~60 s, limit 85 s): ``pytest -v tests/backends/test_cuda.py``, the tests that need the GPU (CI runs
   every other file): counts, every test's outcome and the output tail. Its two compiled tests spend most of it
   in Triton compiles.
4. ``teardown`` (~45 s, limit 65 s): ``qwenvl_vision.teardown.study.cmd_teardown`` (with bench.teardown's
   transformers tower as comparison) for qwen2.5-vl-3b and qwen3-vl-8b, random weights at real size, bf16,
   3 cycles each of ``del`` and of ``close()`` and of transformers' tower by ``del``: ``memory_allocated`` against
   the baseline after each, and the reserved bytes after ``torch.cuda.empty_cache()``. Each cycle is ~1 s on a
   GPU (load 1.3 GB, encode 5 images, 6 memory readings with a census of live tensors), 18 cycles in all.
5. ``load`` (~60 s, limit 75 s): ``bench.load``'s pieces onto the GPU: a real-layout bf16 qwen2.5-vl-3b checkpoint
   (1.3 GB of vision tensors, written once, ~10 s), then 1 warm-up and 2 measured fresh-process loads each of
   ours and of transformers' tower (~9 s a process: torch, the CUDA context, transformers): load time, peak host
   RSS against the tower bytes, peak GPU allocation.

Versions are probed, never assumed (the GPU machine has torch 2.11 and transformers 5.17, no flash-attn and no
PyAV): flash-attn, Triton, torch's ``varlen_attn`` (and its ``scale`` keyword), the backend ``"auto"`` picks and
transformers' flash_attention_2 are probed once by the parent into summary.json's ``environment`` (a probe that
raises records why); each section records its own versions and device. A comparison that needs what the machine
lacks (a transformers tower class, flash-attn, CUDA) is skipped with the reason, never a crash.

``--dry-run`` runs the same sections and code on CPU, with ``"dry_run": true``, in ~65 s on 2 idle cores with a
warm CPU-plan cache (its limits are generous, 240 s a section, 360 s for load, 900 s in all, since it checks the
logic, not a busy machine's speed: with a cold CPU-plan cache its load section first measures this machine's
kernels, ~55 s idle). The tests section's CUDA tests skip; parity runs the same small towers in bf16 against fp32
on CPU, the fused comparison skipped ("no CUDA"); teardown and throughput stand each preset's ``FAMILY_SMALL``
tower in for it (1 teardown cycle; the "small" inputs, 1 warm-up and 1 timed repeat, compiled with
``backend="aot_eager"``: dynamo and AOT autograd without inductor's code generation, divided by a measured fp32
matmul rate); load writes and loads a one-block qwen2.5-vl-3b checkpoint, 1 load a row. It cannot check anything
CUDA-specific: kernels, the fused varlen path, memory counters, inductor/Triton code generation, speed, real-size
memory.

This module is the parent (plan, limits, processes, summary) and a section's process entry; the sections
themselves are ``bench.cuda_sections``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cuda_sections import (
    LOG_TAIL,
    REPO,
    SECTION_FUNCTIONS,
    Context,
    Record,
    environment,
    error_text,
    write_json,
    write_whole,
)

MAX_FILES = 8  # what the device tool brings back from $OUT
MIN_LIMIT_S = 20  # a section given less than this is not run


DEVICE_BUDGET_S = 480  # the real run's whole budget: the device's 15 minutes less its start and a margin


@dataclass(frozen=True)
class Section:
    estimate_s: int  # on an H200, process start included
    limit_s: int
    dry_estimate_s: int  # on 2 shared CPU cores
    dry_limit_s: int  # generous: a dry run checks the logic, not the speed of a machine that may be busy

    def plan(self, dry_run: bool) -> tuple[int, int]:
        """(estimate, limit) in seconds for this kind of run."""
        return (self.dry_estimate_s, self.dry_limit_s) if dry_run else (self.estimate_s, self.limit_s)


# In the order a run cut short should still answer: the numbers first, then the checks CI cannot make.
SECTIONS: dict[str, Section] = {
    "parity": Section(20, 40, 15, 240),
    "throughput": Section(185, 215, 15, 240),
    "tests": Section(60, 85, 8, 240),
    "teardown": Section(45, 65, 12, 240),
    # A dry run's first CPU load with a cold plan cache (a fresh clone, the test suite's own cache folder) measures
    # this machine's kernels first: ~55 s on 2 idle cores, ~3 minutes beside other work.
    "load": Section(60, 75, 15, 360),
}


def device_budget() -> dict[str, Any]:
    """The real run's plan: every section's estimate and limit, their sums, and whether both fit in
    ``DEVICE_BUDGET_S`` (the limits fitting means no section's limit has to be cut by the budget)."""
    plan = {name: {"estimate_s": s.estimate_s, "limit_s": s.limit_s} for name, s in SECTIONS.items()}
    estimate_sum = sum(s.estimate_s for s in SECTIONS.values())
    limit_sum = sum(s.limit_s for s in SECTIONS.values())
    problems = [f"the sections' {what} add up to {total} s, over the {DEVICE_BUDGET_S} s budget"
                for what, total in (("estimates", estimate_sum), ("limits", limit_sum)) if total > DEVICE_BUDGET_S]
    return {"budget_s": DEVICE_BUDGET_S, "sections": plan, "estimate_sum_s": estimate_sum, "limit_sum_s": limit_sum,
            "ok": not problems, "reason": "; ".join(problems) or None}


def feature_probes() -> dict[str, Any]:
    """Every optional feature a comparison depends on, probed once in the parent (no tensor is made on the GPU):
    flash-attn, Triton, torch's varlen_attn and its scale keyword (importing it loads torch._dynamo: seconds),
    the backend "auto" picks on CUDA in bf16 (None without CUDA), and transformers' flash_attention_2. A probe
    that raises records why, and the others are still probed."""
    import torch

    from qwenvl_vision.model.attention import resolve_attn_impl, torch_varlen_missing

    def varlen() -> dict[str, Any]:
        reason = torch_varlen_missing()
        return {"available": reason is None, "reason": reason}

    def auto_on_cuda() -> str | None:
        return resolve_attn_impl("auto", "cuda", torch.bfloat16) if torch.cuda.is_available() else None

    def transformers_flash() -> bool:
        from transformers.utils import is_flash_attn_2_available

        return is_flash_attn_2_available()

    probes: dict[str, Any] = {}
    for name, probe in (("flash_attn", lambda: _module_version("flash_attn")),
                        ("triton", lambda: _module_version("triton")), ("torch_varlen", varlen),
                        ("attn_auto_cuda_bf16", auto_on_cuda), ("transformers_flash_attention_2", transformers_flash)):
        try:
            probes[name] = probe()
        except Exception as e:  # noqa: BLE001 - an unknown answer, said so; the sections resolve what they need
            probes[name] = f"not probed: {type(e).__name__}: {e}"[:500]
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


def run_section(name: str, out: Path, dry_run: bool, limit_s: float, scratch: Path) -> int:
    """In the section's own process: run it, record its status; exit 0 unless the JSON could not be written.
    ``scratch`` (its checkpoints) belongs to the parent, which removes it even when it kills this process."""
    started = time.monotonic()
    estimate, planned_limit = SECTIONS[name].plan(dry_run)
    rec = Record(out / f"{name}.json", {
        "section": name, "status": "running", "dry_run": dry_run, "limit_s": round(limit_s),
        "planned_limit_s": planned_limit, "estimate_s": estimate, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    rec.save()
    ctx = Context(name, out, dry_run, limit_s, scratch, started)
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
    later selected section keeps its estimated time."""
    later = selected[selected.index(name) + 1:]
    available = deadline - time.monotonic() - sum(SECTIONS[n].plan(dry_run)[0] for n in later)
    return min(overrides.get(name, SECTIONS[name].plan(dry_run)[1]), available), available


def run_child(name: str, out: Path, dry_run: bool, limit_s: float) -> tuple[int | None, str, float]:
    """The section in a fresh process (its own process group, so its children stop with it); its output streams
    through with a prefix. Returns (exit code or None on timeout, output tail, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "bench.cuda_check", "--section", name, "--out", str(out),
               "--limit", str(limit_s)] + (["--dry-run"] if dry_run else [])
    start = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=200)
    with tempfile.TemporaryDirectory(prefix=f"cuda_check-{name}-", ignore_cleanup_errors=True) as scratch:
        proc = subprocess.Popen(command + ["--scratch", scratch], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                tail.append(line)
                print(f"[{name}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # at its limit, or this process stopped: the section and its children end before its folder
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
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
        data = {"section": name, "dry_run": dry_run, "limit_s": round(limit_s),
                "estimate_s": SECTIONS[name].plan(dry_run)[0]}
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
            lines += [f"{preset_name} {run}: error {error.strip().splitlines()[-1][:200]}"
                      for run, error in e.get("errors", {}).items()]
            lines += [f"{preset_name} {run}: skipped: {reason[:200]}" for run, reason in e.get("skipped", {}).items()]
    elif name == "throughput":
        for r in data.get("results", ()):
            if "variants" not in r:
                lines.append(f"{r['preset']}: {r['status']} {r.get('error', '')[-200:]}")
                continue
            parts = [f"{n} {v['median_s'] * 1e3:.0f} ms"
                     + (f" (GPU {v['device_median_s'] * 1e3:.0f} ms)" if v.get("device_median_s") else "")
                     + f" {v['items_per_s']:.1f} img/s {v['patches_per_s']:.0f} tok/s"
                     + f" {v['fraction_of_peak']:.0%} of peak"
                     + (f" peak +{v['peak_bytes'] / 2**30:.2f} GiB" if v.get("peak_bytes") else "")
                     for n, v in r["variants"].items()]
            speed = [f"{n} {v['speedup_vs']['transformers']:.2f}x" for n, v in r["variants"].items()
                     if "transformers" in v.get("speedup_vs", {})]
            graphs = r.get("compiled_graphs", {})
            lines.append(f"{r['preset']} {r['inputs']} ({r['patches']} patches): " + "; ".join(parts)
                         + (f"; vs transformers sdpa: {', '.join(speed)}" if speed else "")
                         + (f"; graphs {graphs['total']} ({graphs['recompiled']} recompiled here)" if graphs else ""))
            for what, variants in (("skipped", r.get("skipped", {})), ("FAILED", r.get("failed", {}))):
                lines += [f"{r['preset']} {r['inputs']} {n}: {what}: {why[:200]}" for n, why in variants.items()]
        if data.get("measuring"):
            lines.append(f"stopped while measuring {json.dumps(data['measuring'])[:300]}")
    elif name == "load":
        for row, r in data.get("rows", {}).items():
            lines.append(f"{row}: {r['seconds_median']:.2f} s, host peak {r['peak_over_tower']:.2f}x tower bytes"
                         + (f", {r['time_vs_ours']:.2f}x ours' time" if r.get("time_vs_ours") else ""))
        lines += [f"{row}: skipped: {reason[:300]}" for row, reason in data.get("skipped", {}).items()]
    if data.get("status") in ("error", "timeout", "skipped", "fail", "not_run") and data.get("reason"):
        lines.append(f"reason: {data['reason'][:300]}")
    if data.get("status") == "error" and data.get("error"):
        lines.append(f"error: {data['error'].strip().splitlines()[-1][:300]}")
    return lines


def summarize_run(out: Path, dry_run: bool, budget_s: float, results: dict[str, dict], started: float,
                  probes: dict[str, Any], remaining: list[str], final: bool = True) -> int:
    """Write summary.json and summary.txt for the sections run so far (``remaining`` not yet run), after every
    section, so a run stopped from outside still says what it found; the final call prints the text too.
    Returns the exit code: 0 if every section is ok or skipped and the real run's plan fits its budget."""
    device_env = next((d["environment"] for d in results.values() if "environment" in d), {})
    budget = device_budget()
    summary = {
        "dry_run": dry_run, "budget_s": budget_s, "seconds": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:], "environment": {**device_env, **probes}, "device_budget": budget,
        "sections": {name: {"status": d.get("status"), "wall_s": d.get("wall_s"), "limit_s": d.get("limit_s"),
                            "estimate_s": d.get("estimate_s"), "file": f"{name}.json", "reason": d.get("reason"),
                            "headline": headline(d)}
                     for name, d in results.items()},
        "not_run_yet": remaining,
    }
    ok = budget["ok"] and not remaining and all(d.get("status") in ("ok", "skipped") for d in results.values())
    summary["ok"] = ok
    text = summary_text(summary)
    files = {p.name for p in out.iterdir() if not p.name.endswith(".partial")} | {"summary.json", "summary.txt"}
    write_json(out / "summary.json", {**summary, "files": sorted(files)})
    write_whole(out / "summary.txt", text + "\n")
    if final:
        print("\n" + text, flush=True)
        if len(files) > MAX_FILES:
            print(f"warning: {len(files)} files in {out}; the device tool brings back {MAX_FILES}", flush=True)
    return 0 if ok else 1


def summary_text(summary: dict[str, Any]) -> str:
    env = summary["environment"]

    def probed(name: str, key: str) -> Any:  # a probe that raised is its "not probed: ..." text
        value = env.get(name)
        return value.get(key) if isinstance(value, dict) else value

    varlen = probed("torch_varlen", "available")
    lines = [f"cuda_check{' (dry run, CPU)' if summary['dry_run'] else ''}: {env.get('device_name', 'no GPU')}, "
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, "
             f"flash-attn {probed('flash_attn', 'version')}, torch varlen "
             f"{({True: 'yes', False: 'no'}).get(varlen, varlen)}, auto attention on CUDA bf16: "
             f"{env.get('attn_auto_cuda_bf16')}; {summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget"]
    for name, s in summary["sections"].items():
        wall = f"{s['wall_s']:.0f} s" if s.get("wall_s") is not None else "-"
        lines.append(f"[{s['status']}] {name} ({wall}, limit {s.get('limit_s')} s, estimate {s.get('estimate_s')} s)")
        lines += [f"    {line}" for line in s["headline"]]
    if summary["not_run_yet"]:
        lines.append(f"not run yet: {', '.join(summary['not_run_yet'])}")
    budget = summary["device_budget"]
    lines.append(f"GPU run's plan: estimates {budget['estimate_sum_s']} s, limits {budget['limit_sum_s']} s, budget "
                 f"{budget['budget_s']} s" + (f": OVER: {budget['reason']}" if not budget["ok"] else ""))
    lines.append("ALL OK" if summary["ok"] else "NOT ALL OK: see the sections above and their JSON files")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files (the device tool's $OUT)")
    p.add_argument("--dry-run", action="store_true", help="the same logic on CPU with tiny configs")
    p.add_argument("--only", help=f"comma-separated sections, in this order: {','.join(SECTIONS)}")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 480, dry run 900)")
    p.add_argument("--limits", default="", help="override section limits, e.g. tests=300,load=60")
    p.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)  # run one section, in this process
    p.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)  # the parent's folder for the section's files
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"cuda_check: --out {args.out} cannot be a folder ({e.strerror or e})", file=sys.stderr)
        return 2
    if args.section:
        return run_section(args.section, args.out, args.dry_run,
                           args.limit or SECTIONS[args.section].plan(args.dry_run)[1], args.scratch)
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
    budget = args.budget or (900.0 if args.dry_run else float(DEVICE_BUDGET_S))
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
    for i, name in enumerate(selected):
        limit, available = section_limit(name, selected, deadline, args.dry_run, overrides)
        if available < MIN_LIMIT_S:
            results[name] = {"section": name, "status": "not_run", "dry_run": args.dry_run,
                             "estimate_s": SECTIONS[name].plan(args.dry_run)[0],
                             "reason": f"budget spent: {available:.0f} s left for it after keeping the later "
                                       f"sections' estimated time (budget {budget:.0f} s)"}
            write_json(args.out / f"{name}.json", results[name])
        else:
            print(f"== {name}: limit {limit:.0f} s", flush=True)
            code, log, seconds = run_child(name, args.out, args.dry_run, limit)
            results[name] = finish_record(name, args.out, args.dry_run, code, log, seconds, limit)
            print(f"== {name}: {results[name]['status']} in {seconds:.0f} s", flush=True)
        summarize_run(args.out, args.dry_run, budget, results, started, probes, selected[i + 1:], final=False)
    return summarize_run(args.out, args.dry_run, budget, results, started, probes, [])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a kill stops as Ctrl-C does
    sys.exit(main())
