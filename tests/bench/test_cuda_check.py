"""bench.cuda_check, the one prepared run for a lent GPU, through its ``--dry-run`` on CPU: every section runs in
its own process and leaves its JSON, so a broken check is caught here and not in the GPU's few minutes. The dry
runs start processes (slow); the in-process check of a failing variant is not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FAMILY_SMALL, REPO

SECTIONS = ("tests", "parity", "teardown", "throughput", "load")
PRESETS = ("qwen2.5-vl-3b", "qwen3-vl-8b")
COMMON_KEYS = {"section", "status", "dry_run", "environment", "seconds", "limit_s", "expected_s", "wall_s", "log_tail"}
SECTION_KEYS = {
    "tests": {"command", "counts", "tests", "returncode", "output_tail"},
    "parity": {"families", "tolerance", "fused_reason", "device", "dtype", "reference_dtype"},
    "teardown": {"presets"},
    "throughput": {"results", "peak", "inputs", "compile_options"},
    "load": {"rows", "report", "argv"},
}


def dry_run(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "bench.cuda_check", "--dry-run", "--out", str(out), *options],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cuda_check")
    return out, dry_run(out)


def section(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_every_section_writes_its_json_and_passes_on_cpu(run):
    out, proc = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["ok"] is True
    assert list(summary["sections"]) == list(SECTIONS)
    for name in SECTIONS:
        data = section(out, name)
        assert data["status"] in ("ok", "skipped"), (name, data.get("reason"), data.get("error"), data["log_tail"])
        assert data["dry_run"] is True
        assert COMMON_KEYS | SECTION_KEYS[name] <= data.keys(), (name, sorted(data))
        assert summary["sections"][name]["status"] == data["status"]
    assert (out / "summary.txt").read_text().strip().endswith("ALL OK")
    # What the device tool brings back: at most 8 plain files, named in letters, digits, '.', '_' and '-'.
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert set(summary["files"]) == set(files)


@pytest.mark.slow
def test_tests_section_runs_the_cuda_tests(run):
    out, _ = run
    data = section(out, "tests")
    cases = [t for t in data["tests"] if "test_cuda" in t["test"]]
    assert len(cases) >= 8 and sum(data["counts"].values()) == len(data["tests"])
    if torch.cuda.is_available():  # the dry run still runs the CUDA tests where there is a GPU: they pass
        assert data["status"] == "ok" and data["counts"]["passed"] > 0, data["tests"]
        assert not data["counts"]["failed"] and not data["counts"]["error"], data["output_tail"]
    else:  # every CUDA test skips, and the section says why
        assert data["status"] == "skipped" and "needs CUDA" in data["reason"]
        assert data["counts"]["skipped"] == len(data["tests"])


@pytest.mark.slow
def test_parity_section_covers_every_family_within_tolerance(run):
    out, _ = run
    data = section(out, "parity")
    assert set(data["families"]) == set(FAMILY_SMALL)
    for family, entry in data["families"].items():
        assert entry["status"] == "ok", (family, entry)
        assert entry["max_rel_err"] <= data["tolerance"]["bf16_vs_transformers_fp32"]
        assert len(entry["rel_err"]["deepstack"]) == len(FAMILY_SMALL[family].deepstack_visual_indexes)
        assert any(t == 2 for t, _, _ in entry["grids"])  # the pack holds a 2-frame video
        assert entry["fused_vs_sdpa"] == {"status": "skipped", "reason": "no CUDA"}


@pytest.mark.slow
def test_teardown_section_retains_nothing_after_del_and_close(run):
    out, _ = run
    data = section(out, "teardown")
    assert set(data["presets"]) == set(PRESETS)
    for entry in data["presets"].values():
        ours = {r["teardown"]: r for r in entry["runs"] if r["variant"] == "per-instance"}
        assert set(ours) == {"del", "close"}
        assert all(r["retained_bytes"] == 0 and r["ok"] for r in ours.values())
        assert ours["close"]["held_after_close_bytes"] == 0


@pytest.mark.slow
def test_throughput_section_times_every_variant_against_transformers(run):
    out, _ = run
    data = section(out, "throughput")
    assert data["peak"]["peak_tflops"] > 0 and data["peak"]["peak_source"]
    assert {r["preset"] for r in data["results"]} == set(PRESETS)
    for result in data["results"]:
        assert result["status"] == "ok" and not result["failed"], result.get("failed")
        assert {"ours", "ours-compiled", "transformers"} <= set(result["variants"])
        flash = "transformers-flash_attention_2"
        assert flash in result["variants"] or result["skipped"][flash]  # measured, or skipped with its reason
        for name in ("ours", "ours-compiled"):
            variant = result["variants"][name]
            assert variant["speedup_vs"]["transformers"] > 0 and variant["fraction_of_peak"] > 0
            assert variant["rel_err_vs"]["transformers"] < 1e-4  # fp32 on CPU: the same numbers


@pytest.mark.slow
def test_load_section_times_ours_and_transformers(run):
    out, _ = run
    rows = section(out, "load")["rows"]
    assert {"ours-bf16", "hf-tower-bf16"} <= set(rows)
    assert rows["hf-tower-bf16"]["max_rel_err_vs_ours"] < 3e-2


@pytest.mark.slow
def test_a_section_past_its_limit_is_recorded_and_the_next_still_runs(tmp_path):
    proc = dry_run(tmp_path, "--only", "parity,tests", "--limits", "parity=1")
    assert proc.returncode == 1  # not all ok
    assert section(tmp_path, "parity")["status"] == "timeout"
    assert section(tmp_path, "tests")["status"] == "skipped"  # ran after it (its CUDA tests skip on CPU)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["parity"]["status"] == "timeout" and summary["ok"] is False


def test_a_variant_that_raises_is_dropped_and_the_others_keep_their_numbers():
    """What the GPU run relies on when, e.g., compiled blocks fail on its torch: the other variants are still timed."""
    import bench.throughput as tp
    from qwenvl_vision.model.random_init import random_tower
    from qwenvl_vision.testing.workloads import build_inputs

    cfg = FAMILY_SMALL["qwen2_5_vl"]
    pixel_values, grid_thw, items = build_inputs("small", cfg)

    def broken(model, pixel_values, grid_thw):
        raise RuntimeError("no kernel image is available for execution on the device")

    ours = random_tower(cfg, "cpu", torch.float32)
    variants = {"ours": tp.Variant(tp.run_ours, ours), "ours-compiled": tp.Variant(broken, ours)}
    failed: dict[str, str] = {}
    timings = tp.measure(variants, pixel_values, grid_thw, torch.device("cpu"), warmup=1, repeats=2, failed=failed)
    assert failed == {"ours-compiled": "RuntimeError: no kernel image is available for execution on the device"}
    result = tp.summarize(cfg, "small tower", "small", grid_thw, items, torch.device("cpu"), torch.float32, timings)
    assert list(result["variants"]) == ["ours"] and result["repeats"] == 2
