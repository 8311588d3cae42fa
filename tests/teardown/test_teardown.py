"""Tearing an encoder down gives every byte back.

- ``del`` frees the encoder, its tower, every submodule and the shape cache by reference counting alone
  (checked with the cyclic gc disabled), and the live-tensor census returns to its baseline;
- ``close()`` frees weights and caches while the caller still holds the encoder and its model, and a
  later call raises EncoderClosedError;
- the package contains no functools cache (the class-level-cache bug: ruff B019);
- the teardown benchmark itself: per-instance retains 0 bytes, class-level-cache retains memory that
  grows with the number of instances.
"""

from __future__ import annotations

import ast
import gc
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import qwenvl_vision
from qwenvl_vision import EncoderClosedError, load_encoder
from qwenvl_vision.teardown.cycles import make_inputs, tracked
from tests.helpers import FAMILY_SMALL, QWEN2_5_SMALL, QWEN3_SMALL_72, census
from tests.helpers.embed import one_error_line

PACKAGE = Path(qwenvl_vision.__file__).resolve().parent
REPO = PACKAGE.parent
CONFIGS = [QWEN2_5_SMALL, QWEN3_SMALL_72]
IDS = ["qwen2.5", "qwen3"]
# Several shapes: a video (t=2), sizes that are not multiples of Qwen2.5's window, the smallest grid.
GRIDS = [(1, 4, 4), (2, 4, 6), (1, 2, 2), (1, 10, 6)]
IMAGE_SIZES = [(1, 1), (2, 3), (3, 2)]  # in merged tokens (h, w)


@pytest.fixture
def no_gc():
    """The cyclic collector off: whatever is freed here is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _patches(cfg):
    return torch.randn(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, generator=torch.Generator().manual_seed(0))


def _encode_everything(encoder, cfg):
    """encode_patches at several grids and encode_images at several sizes (the benchmark's images); returns the
    outputs."""
    out = encoder.encode_patches(_patches(cfg), GRIDS)
    images = make_inputs(cfg, torch.device("cpu"), IMAGE_SIZES, "images")
    out_images = encoder.encode_images(images.images, min_pixels=images.min_pixels, max_pixels=images.max_pixels)
    assert [tuple(g) for g in out_images.grid_thw.tolist()] == images.grids
    assert len(encoder.model.shape_cache) == len(set(GRIDS) | set(images.grids))
    return out.embeddings + out_images.embeddings


def _storage_bytes(tensors):
    """Bytes of the distinct storages under tensors (split outputs share one storage)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_del_frees_everything_by_refcount(cfg, no_gc):
    baseline = census()
    encoder = load_encoder(cfg, random_weights=True, device="cpu")
    weights = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
    outputs = _encode_everything(encoder, cfg)
    assert census() >= baseline + weights + encoder.model.shape_cache.nbytes
    refs = tracked(encoder)  # weak references to the encoder, its model, every submodule and the shape cache
    assert len(refs) > 10 and "model.shape_cache" in refs

    del encoder
    assert list(refs) == []  # gc is disabled: reference counting alone did it
    assert census() == baseline + _storage_bytes(outputs)  # the outputs the caller kept do not pin anything
    del outputs
    assert census() == baseline


def test_del_frees_everything_after_a_forward_and_a_grid_plan_failed(no_gc, monkeypatch):
    """A failure's traceback holds the frames it passed through: kept in one of them, the two would keep the encoder
    (weights, the batch's pixels) until the cyclic gc, which servers tune or turn off."""
    cfg = QWEN2_5_SMALL
    baseline = census()
    encoder = load_encoder(cfg, random_weights=True, device="cpu", cpu_kernels="reference")
    model_class, factor = type(encoder.model), cfg.patch_size * cfg.spatial_merge_size
    forward, plan = model_class.forward, model_class.compute_grid_plan

    def refusing_packs(self, pixel_values, grids):  # a kernel that refuses a pack's shape: item by item then
        if len(self.grid_list(grids)) > 1:
            raise RuntimeError("a kernel refuses this shape")
        return forward(self, pixel_values, grids)

    def failing_plan(self, grid):
        if tuple(grid) == (2, 4, 4):
            raise MemoryError("no memory for the grid plan")
        return plan(self, grid)

    monkeypatch.setattr(model_class, "forward", refusing_packs)  # on the class: no cycle of the test's own
    monkeypatch.setattr(model_class, "compute_grid_plan", failing_plan)
    images = [np.zeros((factor, factor, 3), np.uint8), np.zeros((2 * factor, factor, 3), np.uint8)]
    assert all(r.ok for batch in encoder.iter_encode(images) for r in batch)
    with pytest.raises(MemoryError):
        encoder.encode_patches(torch.randn(32, cfg.patch_dim), [(2, 4, 4)])
    refs = tracked(encoder)
    del encoder
    assert list(refs) == []  # gc is disabled: reference counting alone did it
    assert census() == baseline


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_close_frees_while_references_remain(cfg, no_gc):
    baseline = census()
    encoder = load_encoder(cfg, random_weights=True, device="cpu")
    model = encoder.model
    cache = model.shape_cache
    _encode_everything(encoder, cfg)
    assert len(cache) > 0 and census() > baseline
    refs = tracked(encoder)

    encoder.close()  # the caller still holds encoder, model and cache
    assert encoder.closed
    assert census() == baseline
    assert len(cache) == 0 and cache.nbytes == 0
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(EncoderClosedError, match="is closed"):
        encoder.encode_patches(_patches(cfg), GRIDS)
    with pytest.raises(EncoderClosedError, match="is closed"):
        encoder.encode_images([np.zeros((56, 56, 3), np.uint8)])
    with pytest.raises(EncoderClosedError):
        encoder.model  # noqa: B018
    encoder.close()  # idempotent
    assert "closed" in repr(encoder)

    del encoder, model, cache
    assert list(refs) == []
    assert census() == baseline


FRESH_PROCESS = """
import gc, json, sys, weakref
import numpy as np, torch
from qwenvl_vision import VisionConfig, load_encoder
from qwenvl_vision.teardown.census import live_tensor_bytes as census

results = {}
for name, fields in json.loads(sys.argv[1]).items():  # Qwen2.5 first: it never triggers the Qwen3 case
    cfg = VisionConfig(**fields)
    factor = cfg.patch_size * cfg.spatial_merge_size
    gc.collect()
    gc.disable()
    baseline = census()
    encoder = load_encoder(cfg, random_weights=True, device="cpu")
    grids = [(1, 4, 4), (2, 4, 6)]
    encoder.encode_patches(torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim), grids)
    encoder.encode_images([np.zeros((factor, 2 * factor, 3), np.uint8)], min_pixels=factor**2)
    refs = [weakref.ref(encoder)] + [weakref.ref(m) for m in encoder.model.modules()]
    del encoder
    results[name] = {"alive": sum(r() is not None for r in refs), "retained": census() - baseline}
    gc.enable()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_process_results():
    """The first encoder of each family built in a new process (one subprocess for both)."""
    import subprocess

    configs = {name: dict(cfg.__dict__, family=cfg.model_type) for name, cfg in zip(IDS, CONFIGS)}
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, json.dumps(configs)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_first_encoder_in_a_fresh_process_is_freed_by_refcount(fresh_process_results, name):
    """One-time work inside the first build must not pin the tower. Regression: nn.Embedding's default
    init on the meta device lazily imported torch._dynamo, whose torch.fx.wrap() keeps currentframe() in a
    reference cycle; its f_back chain held Qwen3VisionTransformer.__init__'s frame (self = the tower), so
    the first Qwen3 encoder of a process was only freed by the next gc (fixed in qwen3.py by _weight=)."""
    assert fresh_process_results[name] == {"alive": 0, "retained": 0}


# ---------------------------------------------------------------------- no functools caches in the package

BANNED = {"lru_cache", "cache"}


def functools_caches(source: str, filename: str = "<string>") -> list[str]:
    """Every functools.lru_cache / functools.cache in a module: imports of them, and uses at any level."""
    tree = ast.parse(source, filename)
    modules = set()  # names bound to the functools module
    findings = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "functools"}
        elif isinstance(node, ast.ImportFrom) and node.module == "functools":
            for alias in node.names:
                if alias.name in BANNED or alias.name == "*":
                    findings.append(f"{filename}:{node.lineno}: from functools import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in BANNED and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            findings.append(f"{filename}:{node.lineno}: {node.value.id}.{node.attr}")
    return findings


def test_package_has_no_functools_cache():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10 and PACKAGE / "teardown" / "study.py" in files
    findings = [f for path in files for f in functools_caches(path.read_text(), str(path.relative_to(REPO)))]
    assert findings == [], ("functools caches live on the function/class and keep every instance (self) and "
                            "its tensors alive for the whole process; use the instance's ShapeCache:\n"
                            + "\n".join(findings))


@pytest.mark.parametrize("snippet, caches", [
    ("import functools\n@functools.lru_cache(maxsize=None)\ndef f(x): return x\n", True),
    ("import functools as ft\nclass A:\n    @ft.cache\n    def f(self, x): return x\n", True),
    ("from functools import lru_cache\nclass A:\n    @lru_cache(maxsize=64)\n    def f(self, x): return x\n", True),
    ("from functools import cache as memo\n@memo\ndef f(x): return x\n", True),
    ("import functools\ndef g():\n    h = functools.lru_cache()(len)\n    return h\n", True),
    ((REPO / "bench" / "teardown.py").read_text(), True),  # the benchmark's deliberate class-level lru_cache
    ("import functools\nfrom functools import partial, wraps\nclass A:\n    @property\n    def cache(self): "
     "return self.shape_cache\n    @functools.wraps(len)\n    def f(self): return self.cache.get(1)\n", False),
], ids=["attribute", "alias", "from-import", "renamed", "call", "bench", "other caches"])
def test_the_scanner_finds_functools_caches_and_nothing_else(snippet, caches):
    assert bool(functools_caches(snippet)) == caches


# ---------------------------------------------------------------------- the benchmark itself


def _run_bench(tmp_path, cfg, *extra, script: bool = False):
    """The teardown benchmark on a small config: the package's CLI, or bench.teardown with its comparisons; its exit
    status and its JSON report (None when it wrote none)."""
    import importlib

    from qwenvl_vision.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg.to_config_json()))
    out = tmp_path / "teardown.json"
    argv = ["--config", str(config), "--device", "cpu", "--json", str(out), "--quiet", "--sizes", "56x56,56x112,112x84",
            *extra]
    rc = importlib.import_module("bench.teardown").main(argv) if script else main(["bench", "teardown", *argv])
    return rc, json.loads(out.read_text()) if out.exists() else None


def test_bad_sizes_are_a_one_line_usage_error_and_debug_is_taken_after_the_command(tmp_path, capsys):
    for extra in ([], ["--debug"]):
        assert _run_bench(tmp_path, QWEN2_5_SMALL, "--sizes", "big", *extra) == (2, None)
        assert "qwenvl-vision bench: error: --sizes: 'big' is not HxW in pixels" in capsys.readouterr().err
    # Refused before anything runs: a --json that is a folder would lose the whole benchmark's results at its end.
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "file").touch()
    for extra, culprit in ((["--cycles", "0"], "--cycles 0 is below 1"), (["--teardown", "foo"], "['foo']"),
                           (["--json", str(tmp_path / "folder.json")], "folder.json cannot be written"),
                           (["--json", str(tmp_path / "file" / "out.json")], "out.json cannot be written"),
                           (["--sizes", "100000x100000"], "100000x100000 is above")):
        for script in (False, True):  # the package's CLI, and bench/teardown.py
            assert _run_bench(tmp_path, QWEN2_5_SMALL, *extra, script=script)[0] == 2
            one_error_line(capsys.readouterr().err, culprit)
    assert _run_bench(tmp_path, QWEN2_5_SMALL, "--plot", str(tmp_path / "file" / "t.png"), script=True)[0] == 2
    one_error_line(capsys.readouterr().err, "t.png cannot be written")  # not after the whole run


def _runs(report):
    return {(r["variant"], r["teardown"]): r for r in report["runs"]}


@pytest.mark.slow  # the whole benchmark command, several load-encode-teardown cycles (6-10 s)
def test_cli_benchmark_measures_our_encoder_only(tmp_path):
    rc, report = _run_bench(tmp_path, QWEN2_5_SMALL, "--cycles", "2")
    assert rc == 0 and report["ok"]
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["metric"] == "tensor_census"
    runs = _runs(report)
    assert set(runs) == {("per-instance", "del"), ("per-instance", "close")}
    for teardown in ("del", "close"):
        run = runs["per-instance", teardown]
        assert run["retained_bytes"] == 0 and run["retained_by_cycle"] == [0, 0]
        assert run["freed_by_refcount"] is True
        assert run["weights_bytes"] > 0 and run["cache_bytes"] > 0
        assert len(run["cycles"]) == 2 and all(c["alive_after_teardown"] == [] for c in run["cycles"])
    assert runs["per-instance", "close"]["held_after_close_bytes"] == 0
    assert runs["per-instance", "close"]["close_raises"] is True


def test_a_benchmark_without_per_instance_gives_no_verdict_on_it(tmp_path, capsys):
    rc, report = _run_bench(tmp_path, QWEN2_5_SMALL, "--cycles", "1", "--variants", "class-level-cache",
                            "--teardown", "del", script=True)
    out = capsys.readouterr().out
    assert rc == 0 and report["ok"] is None  # no verdict, in the JSON as in the table
    assert "per-instance not run" in out and "FAIL" not in out and "PASS" not in out


def test_benchmark_class_level_cache_grows_per_instance(tmp_path, capsys):
    rc, report = _run_bench(tmp_path, QWEN2_5_SMALL, "--cycles", "2", "--variants", "per-instance,class-level-cache",
                            script=True)
    table = capsys.readouterr().out.splitlines()
    assert rc == 0 and report["ok"]
    runs = _runs(report)
    assert runs["per-instance", "del"]["retained_bytes"] == 0
    leak = runs["class-level-cache", "del"]
    weights = leak["weights_bytes"]
    first, second = leak["retained_by_cycle"]
    assert leak["retained_bytes"] > 0 and first >= weights and second >= first + weights  # grows per instance
    assert leak["freed_by_refcount"] is False and leak["freed_after_gc"] is False
    assert leak["retained_after_cache_clear"] == 0
    closed = runs["class-level-cache", "close"]  # close() drops the weights, the class cache keeps the plans
    assert 0 < closed["retained_bytes"] < weights
    # The table as a user reads it: the plans' few bytes are not shown as 0.00 beside the objects left alive, and
    # the RSS column says what it is.
    header = next(line for line in table if line.startswith("variant"))
    cells = dict(zip(re.split(r"\s{2,}", header.strip()),
                     re.split(r"\s{2,}", next(line for line in table if line.startswith("class-level-cache  close")))))
    assert float(cells["retained (worst)"]) > 0 and "objects alive even after gc" in cells["freed by refcount"]
    assert "RSS growth" in cells and any(line.startswith("RSS growth: ") and "no tensor holds" in line
                                         for line in table)


def test_the_plot_shows_del_and_close_apart_where_their_values_are_equal(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    import bench.teardown as script

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    phases = {phase: {"tensor_bytes": 100} for phase in script.PHASES}
    runs = [{"variant": "per-instance", "teardown": teardown, "baseline": {"tensor_bytes": 100},
             "cycles": [{"cycle": 1, "phases": phases}]} for teardown in ("del", "close")]
    script.plot_report({"device": "cpu", "model": "m", "dtype": "float32", "runs": runs}, str(tmp_path / "t.png"))
    drawn = {line.get_label(): line.get_transform().transform(line.get_xydata())
             for line in figures[0].axes[0].get_lines() if line.get_label() in ("del", "close")}
    assert abs(drawn["del"][:, 1] - drawn["close"][:, 1]).min() >= 2  # display points apart: both visible


@pytest.mark.slow  # the whole benchmark command per family (3 s each)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_omni", "qwen3_omni_moe", "qwen3_5"])
def test_new_families_retain_nothing(tmp_path, family):
    rc, report = _run_bench(tmp_path, FAMILY_SMALL[family], "--cycles", "2", "--teardown", "del")
    assert rc == 0 and report["ok"] and _runs(report)["per-instance", "del"]["retained_bytes"] == 0


@pytest.mark.slow  # the whole benchmark command, several load-encode-teardown cycles (6-10 s)
def test_benchmark_qwen3_script_with_transformers_and_plot(tmp_path):
    plot = tmp_path / "t.png"
    rc, report = _run_bench(tmp_path, QWEN3_SMALL_72, "--cycles", "2", "--teardown", "del", "--inputs", "patches",
                            "--plot", str(plot), script=True)
    assert rc == 0 and report["inputs"] == "patches"
    runs = _runs(report)
    assert runs["per-instance", "del"]["retained_bytes"] == 0
    assert runs["per-instance", "del"]["freed_by_refcount"]
    first, second = runs["class-level-cache", "del"]["retained_by_cycle"]
    assert 0 < first < second
    assert runs["transformers", "del"]["freed_after_gc"]
    import bench.teardown as script

    assert script.cache_entries() == 0  # the benchmark cleared the class cache after its run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_fast(tmp_path, capsys, monkeypatch):
    import bench.teardown as script

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = script.main(["--preset", "qwen2.5-vl-72b", "--plot", str(tmp_path / "p.png")])
    assert rc == 2 and "matplotlib" in capsys.readouterr().err  # before loading anything
