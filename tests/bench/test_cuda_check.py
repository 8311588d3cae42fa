"""bench.cuda_check, the one prepared run for a lent GPU. Its ``--dry-run`` on CPU runs every section in its own
process and leaves its JSON, so a broken check is caught here and not in the GPU's few minutes (those dry runs start
processes: slow). The parent's order, its budget and the sections' save-after-every-measurement and
skip-with-reason behaviour are checked in-process, with the measuring pieces replaced (fast)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bench.cuda_check as cc
import bench.cuda_sections as cs
from tests.helpers import FAMILY_SMALL, REPO

# The numbers that matter first, so a run cut short still answers them.
SECTIONS = ("parity", "throughput", "tests", "teardown", "load")
PRESETS = ("qwen2.5-vl-3b", "qwen3-vl-8b")
DEVICE_BUDGET_S = 480  # 8 of the device's 15 minutes; the rest is the machine's start and a margin
COMMON_KEYS = {"section", "status", "dry_run", "environment", "seconds", "limit_s", "planned_limit_s", "estimate_s",
               "wall_s", "log_tail"}
SECTION_KEYS = {
    "tests": {"command", "counts", "tests", "returncode", "output_tail"},
    "parity": {"families", "tolerance", "fused_reason", "device", "dtype", "reference_dtype"},
    "teardown": {"presets", "cycles"},
    "throughput": {"results", "peak", "inputs", "compile_options", "measuring"},
    "load": {"rows", "runs", "argv", "skipped"},
}
MISSING = "transformers has no tower for this family (stand-in for an older transformers)"


class Stopped(BaseException):
    """A section's process stopped from outside in the middle of a measurement (its limit, the device's end):
    nothing after the raise runs, not even the section's own last save."""


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
    assert summary["dry_run"] is True and summary["ok"] is True and summary["not_run_yet"] == []
    assert list(summary["sections"]) == list(SECTIONS)
    assert proc.stdout.index("== parity") < proc.stdout.index("== throughput") < proc.stdout.index("== load")
    # The GPU run's plan, as the dry run records it, fits the device's budget.
    budget = summary["device_budget"]
    assert budget["ok"] and list(budget["sections"]) == list(SECTIONS)
    assert sum(b["estimate_s"] for b in budget["sections"].values()) == budget["estimate_sum_s"] <= DEVICE_BUDGET_S
    assert sum(b["limit_s"] for b in budget["sections"].values()) == budget["limit_sum_s"] <= DEVICE_BUDGET_S
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
    assert set(data["presets"]) == set(PRESETS) and data["cycles"] == 1
    for entry in data["presets"].values():
        assert entry["status"] == "ok" and not entry.get("errors")
        assert [(r["variant"], r["teardown"]) for r in entry["runs"]] == [
            ("per-instance", "del"), ("per-instance", "close"), ("transformers", "del")]
        ours = {r["teardown"]: r for r in entry["runs"] if r["variant"] == "per-instance"}
        assert all(r["retained_bytes"] == 0 and r["ok"] for r in ours.values())
        assert ours["close"]["held_after_close_bytes"] == 0


@pytest.mark.slow
def test_throughput_section_times_every_variant_against_transformers(run):
    out, _ = run
    data = section(out, "throughput")
    assert data["peak"]["peak_tflops"] > 0 and data["peak"]["peak_source"]
    assert {r["preset"] for r in data["results"]} == set(PRESETS)
    assert data["measuring"] is None  # it finished
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
    data = section(out, "load")
    rows = data["rows"]
    assert {"ours-bf16", "hf-tower-bf16"} <= set(rows) and not data["skipped"]
    assert rows["hf-tower-bf16"]["max_rel_err_vs_ours"] < 3e-2
    assert all(len(runs) == data["repeats"] for runs in data["runs"].values())


@pytest.mark.slow
def test_a_section_past_its_limit_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    proc = dry_run(tmp_path, "--only", "parity,tests", "--limits", "parity=1")
    assert proc.returncode == 1  # not all ok
    assert not list(scratch.glob("cuda_check-*"))  # the killed section's checkpoints are gone with it
    assert section(tmp_path, "parity")["status"] == "timeout"
    assert section(tmp_path, "tests")["status"] == "skipped"  # ran after it (its CUDA tests skip on CPU)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["parity"]["status"] == "timeout" and summary["ok"] is False


def test_a_variant_that_raises_is_dropped_and_the_others_keep_their_numbers():
    """What the GPU run relies on when, e.g., compiled blocks fail on its torch: the other variants are still timed."""
    import bench.throughput as tp
    from bench.workloads import build_inputs
    from qwenvl_vision.model.random_init import random_tower

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


# ---------------------------------------------------------------------- the parent, in-process


def ok_child(name: str, out: Path, dry_run: bool, limit_s: float) -> tuple[int, str, float]:
    """A section's process that measured nothing and passed."""
    cs.write_json(out / f"{name}.json", {"section": name, "status": "ok", "estimate_s": 1})
    return 0, "", 0.1


def test_sections_run_in_the_order_that_answers_first_and_the_summary_follows_each(tmp_path, monkeypatch):
    ran: list[str] = []

    def child_after_summary(name, out, dry_run, limit_s):
        if ran:  # the summary so far is on disk before the next section starts
            summary = json.loads((out / "summary.json").read_text())
            assert list(summary["sections"]) == ran and summary["not_run_yet"] == list(SECTIONS[len(ran):])
            assert summary["ok"] is False  # not finished
        ran.append(name)
        return ok_child(name, out, dry_run, limit_s)

    monkeypatch.setattr(cc, "run_child", child_after_summary)
    monkeypatch.setattr(cc, "feature_probes", dict)
    assert cc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    assert ran == list(SECTIONS)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and list(summary["sections"]) == list(SECTIONS) and summary["not_run_yet"] == []
    budget = summary["device_budget"]
    assert budget["ok"] and budget["budget_s"] == DEVICE_BUDGET_S
    assert budget["estimate_sum_s"] <= budget["limit_sum_s"] <= DEVICE_BUDGET_S
    assert "GPU run's plan: estimates" in (tmp_path / "summary.txt").read_text()


def test_sections_the_budget_leaves_no_time_are_not_run_and_fail_the_run(tmp_path, monkeypatch):
    """A run that measured nothing is no pass: only what the machine lacks is a skip."""
    monkeypatch.setattr(cc, "run_child", ok_child)
    monkeypatch.setattr(cc, "feature_probes", dict)
    assert cc.main(["--dry-run", "--out", str(tmp_path), "--budget", "10"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {s["status"] for s in summary["sections"].values()} == {"not_run"} and not summary["ok"]


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").touch()
    assert cc.main(["--dry-run", "--out", str(tmp_path / "taken")]) == 2
    assert "taken cannot be a folder" in capsys.readouterr().err


def test_a_plan_over_the_devices_budget_fails_the_dry_run(tmp_path, monkeypatch):
    monkeypatch.setitem(cc.SECTIONS, "throughput", cc.Section(400, 420, 15, 240))
    monkeypatch.setattr(cc, "run_child", ok_child)
    monkeypatch.setattr(cc, "feature_probes", dict)
    assert cc.main(["--dry-run", "--out", str(tmp_path), "--only", "tests"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["tests"]["status"] == "ok"  # the plan alone fails the run
    budget = summary["device_budget"]
    assert not budget["ok"] and "estimates add up to" in budget["reason"] and "limits add up to" in budget["reason"]
    assert (tmp_path / "summary.txt").read_text().strip().endswith("NOT ALL OK: see the sections above and their "
                                                                     "JSON files")


def test_a_feature_probe_that_raises_is_recorded_and_the_others_still_answer(monkeypatch):
    import qwenvl_vision.model.attention as attention

    def broken(*args, **kwargs):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(attention, "resolve_attn_impl", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    probes = cc.feature_probes()
    assert probes["attn_auto_cuda_bf16"] == "not probed: RuntimeError: Found no NVIDIA driver on your system"
    assert isinstance(probes["torch_varlen"]["available"], bool) and "version" in probes["flash_attn"]


# ---------------------------------------------------------------------- the sections: saved per measurement


def start(name: str, tmp_path: Path) -> tuple[cs.Context, cs.Record, Path]:
    """A dry-run section's context and record, as run_section makes them."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    path = tmp_path / f"{name}.json"
    return cs.Context(name, tmp_path, True, 300.0, work, time.monotonic()), cs.Record(path, {"section": name}), path


def stopped_at(call: int, measure):
    """``measure`` that raises Stopped on its ``call``-th call (from 1)."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise Stopped
        return measure(*args, **kwargs)

    return fake


def fake_load(spec: dict, timeout: float) -> dict:
    """One fresh-process load's result as bench.load's child returns it (with the probe output written)."""
    if spec["probe"]:
        torch.save(torch.ones(4), spec["probe"])
    return {"seconds": 0.5, "peak_delta": 100, "peak_rss": 1000, "base_rss": 900, "loaded_bytes": 80,
            "tower_bytes": 80, "tower_dtype": "torch.bfloat16", "rss_method": "VmHWM", "tower_device": "cpu"}


def test_load_saves_each_fresh_process_load_as_it_returns(tmp_path, monkeypatch):
    import bench.load as bl

    monkeypatch.setattr(bl, "ensure_checkpoint", lambda workdir, cfg, seed: (tmp_path, None))
    monkeypatch.setattr(bl, "run_child", stopped_at(2, fake_load))  # ours loads, then hf-tower is stopped
    ctx, rec, path = start("load", tmp_path)
    with pytest.raises(Stopped):
        cs.section_load(ctx, rec)
    data = json.loads(path.read_text())
    assert list(data["rows"]) == ["ours-bf16"] and data["rows"]["ours-bf16"]["seconds_all"] == [0.5]
    assert len(data["runs"]["ours-bf16"]) == 1


def test_parity_saves_each_family_as_it_ends(tmp_path, monkeypatch):
    def first_ok(cfg, device, dtype, fused_reason, entry, extra_grids):
        entry.update(status="ok", max_rel_err=1e-3)

    monkeypatch.setattr(cs, "parity_one", stopped_at(2, first_ok))
    ctx, rec, path = start("parity", tmp_path)
    with pytest.raises(Stopped):
        cs.section_parity(ctx, rec)
    families = json.loads(path.read_text())["families"]
    first = next(iter(FAMILY_SMALL))
    assert families[first] == {"status": "ok", "max_rel_err": 1e-3}
    assert list(families) == [first]  # the second family was stopped before its save


def test_throughput_saves_each_input_set_and_says_what_it_was_measuring(tmp_path, monkeypatch):
    import bench.throughput as tp

    cfg = FAMILY_SMALL["qwen2_5_vl"]
    names = ("ours", "ours-compiled", "transformers")
    timings = tp.Timings({n: [0.1] for n in names}, {n: [] for n in names}, dict.fromkeys(names),
                         dict.fromkeys(names, 0.2),
                         {n: torch.ones(4, cfg.out_hidden_size) for n in names})
    peak = {"device_name": "cpu", "peak_tflops": 1.0, "peak_source": "stand-in", "matmul_tflops": 1.0, "matmul_n": 8}
    monkeypatch.setattr(tp, "peak_rate", lambda device, dtype, matmul_n: peak)
    monkeypatch.setattr(tp, "build_variants", lambda *args, **kwargs: (dict.fromkeys(names), {"flash": "absent"}))
    monkeypatch.setattr(tp, "measure", stopped_at(2, lambda *args, **kwargs: timings))
    ctx, rec, path = start("throughput", tmp_path)
    with pytest.raises(Stopped):
        cs.section_throughput(ctx, rec)
    data = json.loads(path.read_text())
    assert [(r["preset"], r["inputs"], r["status"]) for r in data["results"]] == [(PRESETS[0], "small", "ok")]
    assert data["measuring"] == {"preset": PRESETS[1], "inputs": "small", "variants": list(names),
                                 "skipped": {"flash": "absent"}}


def test_teardown_saves_each_run_as_it_ends(tmp_path, monkeypatch):
    import qwenvl_vision.teardown.study as study

    monkeypatch.setattr(study, "cmd_teardown", stopped_at(2, study.cmd_teardown))  # del runs, close is stopped
    ctx, rec, path = start("teardown", tmp_path)
    with pytest.raises(Stopped):
        cs.section_teardown(ctx, rec)
    entry = json.loads(path.read_text())["presets"][PRESETS[0]]
    assert [(r["variant"], r["teardown"], r["retained_bytes"]) for r in entry["runs"]] == [("per-instance", "del", 0)]
    assert entry["status"] == "ok"


def test_tests_saves_each_outcome_as_pytest_prints_it(tmp_path, monkeypatch):
    test_file = tmp_path / "test_dies.py"
    test_file.write_text("import os\n\n\ndef test_first():\n    pass\n\n\ndef test_second_kills_pytest():\n"
                         "    os._exit(3)\n")
    monkeypatch.setattr(cs, "GPU_TEST_FILES", (str(test_file),))
    ctx, rec, path = start("tests", tmp_path)
    assert cs.section_tests(ctx, rec) == "error" and rec.data["returncode"] == 3  # pytest died: no junit XML
    data = json.loads(path.read_text())  # what a section stopped here leaves: the outcome printed before
    assert [(t["test"].rsplit("::", 1)[1], t["outcome"]) for t in data["tests"]] == [("test_first", "passed")]
    assert data["counts"]["passed"] == 1


# ---------------------------------------------------------------------- the sections: what the machine lacks


def test_a_missing_transformers_tower_is_skipped_with_its_reason(tmp_path, monkeypatch):
    import bench.load as bl
    import bench.throughput as tp
    import qwenvl_vision.teardown.study as study

    monkeypatch.setattr(tp, "transformers_unavailable", lambda cfg, attn: MISSING)
    ctx, rec, path = start("parity", tmp_path)
    assert cs.section_parity(ctx, rec) == "skipped"
    families = json.loads(path.read_text())["families"]
    assert set(families) == set(FAMILY_SMALL)
    assert all(e == {"status": "skipped", "reason": MISSING} for e in families.values())

    monkeypatch.setattr(bl, "ensure_checkpoint", lambda workdir, cfg, seed: (tmp_path, None))
    monkeypatch.setattr(bl, "run_child", fake_load)
    ctx, rec, path = start("load", tmp_path)
    assert cs.section_load(ctx, rec) == "ok"
    data = json.loads(path.read_text())
    assert list(data["rows"]) == ["ours-bf16"] and data["skipped"] == {"hf-tower": MISSING}

    teardowns: list[str] = []

    def fake_teardown(args, extra_variants, after):
        teardowns.append(f"{args.variants}/{args.teardown}")
        after({"runs": [], "skipped": [], "model": args.config, "device": "cpu", "dtype": "float32",
               "metric": "tensor_census", "snapshots": []})

    monkeypatch.setattr(study, "cmd_teardown", fake_teardown)
    ctx, rec, path = start("teardown", tmp_path)
    cs.section_teardown(ctx, rec)
    assert teardowns == ["per-instance/del", "per-instance/close"] * 2
    for entry in json.loads(path.read_text())["presets"].values():
        assert entry["skipped"] == {"transformers/del": MISSING}


def test_a_comparison_row_that_fails_to_load_is_skipped_and_ours_still_measured(tmp_path, monkeypatch):
    import bench.load as bl

    def hf_tower_breaks(spec, timeout):
        if spec["row"] != "ours":
            raise RuntimeError("hf-tower bf16 failed (exit 1):\nTypeError: unexpected keyword 'key_mapping'")
        return fake_load(spec, timeout)

    monkeypatch.setattr(bl, "ensure_checkpoint", lambda workdir, cfg, seed: (tmp_path, None))
    monkeypatch.setattr(bl, "run_child", hf_tower_breaks)
    ctx, rec, path = start("load", tmp_path)
    assert cs.section_load(ctx, rec) == "ok"
    data = json.loads(path.read_text())
    assert list(data["rows"]) == ["ours-bf16"] and "key_mapping" in data["errors"]["hf-tower"]
    assert data["skipped"]["hf-tower"].endswith("TypeError: unexpected keyword 'key_mapping'")


def test_a_second_failed_teardown_s_snapshot_is_not_called_too_large(tmp_path):
    """Two presets' teardowns fail: the first snapshot comes back, the second is said to be left for that reason."""
    out = tmp_path / "out"
    out.mkdir()
    first, second = tmp_path / "a.pickle", tmp_path / "b.pickle"
    first.write_bytes(b"x" * 1000)
    second.write_bytes(b"y" * 2000)
    assert cs.keep_snapshot({"snapshots": [str(first)]}, out)["file"] == "teardown-snapshot.pickle"
    kept = cs.keep_snapshot({"snapshots": [str(second)]}, out)
    assert kept["file"] is None and "earlier" in kept["reason"]
