"""embed --engine ray (qwenvl_vision.embed.ray_engine) on a local 2-CPU Ray: the same tensors as every other path
for the same settings (encode_images / encode_videos, embed in either format; crossed pixel bounds too); every
input exactly once when an actor dies mid-run (Ray restarts it) and when the driver is SIGKILLed and resumed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.loading import load_encoder
from tests.helpers import ENV, REPO, make_image_folder
from tests.helpers import embed as embed_helpers
from tests.helpers.embed import assert_each_parquet_input_once, embed_cmd, kill_when, make_media_folder, parquet_rows

ray = pytest.importorskip("ray")
pytest.importorskip("av")

from qwenvl_vision.embed import ray as qv_ray  # noqa: E402

pytestmark = pytest.mark.slow
local_ray = embed_helpers.local_ray  # the session's Ray (a fixture shared with test_ray)
# The actors unpickle CrashOnce: by value, since pytest imports this file under a name they cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("max_pixels", [None, 50176])
def test_every_path_gives_the_same_tensors(tmp_path, local_ray, checkpoint3, max_pixels):
    """At one thread (run.json's threads) and the same options, encode_images / encode_videos, embed --format
    safetensors, --format parquet, --format vllm-cache and --engine ray in both its formats store bitwise the same
    tensors (the encoder caches under the same ids). With --max-pixels 50176 under
    the checkpoint's min_pixels 65536 (crossed bounds), every path keeps both bounds, as encode_images does, and
    records them."""
    images, videos = make_media_folder(tmp_path / "media", 3, 2)
    bounds = ["--max-pixels", str(max_pixels)] if max_pixels else []
    options = [str(tmp_path / "media"), "--model", str(checkpoint3), "--threads", "1", "--fps", "3", "--quiet",
               *bounds]
    outs = {"safetensors": [], "parquet": ["--format", "parquet"], "ray": ["--engine", "ray"],
            "vllm-cache": ["--format", "vllm-cache"], "ray-vllm-cache": ["--engine", "ray", "--format", "vllm-cache"]}
    for name, extra in outs.items():
        assert main(["embed", *options, "--out", str(tmp_path / name), *extra]) == 0, name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with load_encoder(checkpoint3, device="cpu") as encoder:
            want = {str(p): (e, d) for p, e, d in zip(images, *_pair(encoder.encode_images(
                [str(p) for p in images], max_pixels=max_pixels)))}
            want.update({str(p): (e, d) for p, e, d in zip(videos, *_pair(encoder.encode_videos(
                [str(p) for p in videos], fps=3.0)))})
            low, high = encoder.preprocess_config.min_pixels, max_pixels or encoder.preprocess_config.max_pixels
    finally:
        torch.set_num_threads(threads)
    for name in outs:
        run = read_run(tmp_path / name)
        assert (run["min_pixels"], run["max_pixels"], run["threads"]) == (low, high, 1), name
        assert run["engine"] == ("ray" if name.startswith("ray") else "local")
        got = dict(read_embeddings(tmp_path / name, deepstack=True))
        assert got.keys() == want.keys(), name
        for path, (embedding, levels) in got.items():
            assert torch.equal(embedding, want[path][0]), (name, path)
            assert len(levels) == 2 and all(torch.equal(a, b) for a, b in zip(levels, want[path][1])), (name, path)
    assert parquet_rows(tmp_path / "ray")[0].keys() == parquet_rows(tmp_path / "parquet")[0].keys()
    # The video entries too (frames, times, the fps asked for, which an Omni model's hand-off needs).
    ids = {name: {r["path"]: (r["id"], r["grid_thw"], r.get("timestamps"), r.get("video"))
                  for r in read_manifest_lines(tmp_path / name / "manifest.jsonl")}
           for name in ("vllm-cache", "ray-vllm-cache")}
    assert ids["ray-vllm-cache"] == ids["vllm-cache"] and len(ids["vllm-cache"]) == len(want)


def _pair(result) -> tuple[list, list]:
    return result.embeddings, result.deepstack


class CrashOnce(qv_ray.Embedder):
    """Kills its actor (os._exit, no cleanup) the first time a batch holds crash-me.png; a marker file next to the
    input says it happened, so the retried batch (on the restarted actor) goes through."""

    def __call__(self, batch):
        for path in batch["path"]:
            marker = Path(path).with_name("crashed.marker")
            if Path(path).name == "crash-me.png" and not marker.exists():
                marker.touch()
                os._exit(1)
        return super().__call__(batch)


def test_an_actor_killed_mid_run_is_restarted_and_no_row_is_lost_or_doubled(tmp_path, local_ray, checkpoint,
                                                                            monkeypatch):
    paths = make_image_folder(tmp_path / "imgs", 40, bad=False)
    paths[25].rename(paths[25].with_name("crash-me.png"))
    monkeypatch.setattr(qv_ray, "Embedder", CrashOnce)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--engine", "ray",
                 "--quiet"]) == 0
    assert (tmp_path / "imgs" / "crashed.marker").exists()  # the actor did die
    rows = assert_each_parquet_input_once(out, 40)
    assert all(r["status"] == "ok" for r in rows)


class CrashThenFailHalf(qv_ray.Embedder):
    """Kills its actor at its second batch, once; the retried task's first batch then fails half its rows (fetches
    that fail this time), so that its rows split into other blocks than on the first try."""

    def __call__(self, batch):
        given = [str(p) for p in batch["given"]]
        first = Path(batch["path"][0]).with_name("first-batch.json")
        if not first.exists():
            first.write_text(json.dumps(given))
        elif not first.with_name("crashed.marker").exists():
            first.with_name("crashed.marker").touch()
            os._exit(1)
        elif json.loads(first.read_text()) == given:
            batch = {**batch, "path": batch["path"].copy()}
            batch["path"][::2] = "/nonexistent/failed-this-time.png"
        return super().__call__(batch)


def test_rows_a_retried_task_gives_back_otherwise_are_each_recorded_once(tmp_path, local_ray, checkpoint3,
                                                                          monkeypatch):
    """Ray skips what a retried task's first try handed on by its place among the task's blocks, which their sizes
    decide: a retry whose rows differ gives some twice and loses others."""
    make_image_folder(tmp_path / "imgs", 80, bad=False)
    monkeypatch.setattr(qv_ray, "Embedder", CrashThenFailHalf)
    monkeypatch.setattr(ray.data.DataContext.get_current(), "target_max_block_size", 6000)  # a row or two a block
    from_items = ray.data.from_items
    monkeypatch.setattr(ray.data, "from_items", lambda items, override_num_blocks: from_items(
        items, override_num_blocks=4))  # tasks of two batches, where the actor dies between the two
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint3), "--out", str(out), "--engine", "ray",
                 "--ray-actors", "1", "--threads", "1", "--max-pixels", "4096", "--min-pixels", "1024",
                 "--quiet"]) == 1
    assert (tmp_path / "imgs" / "crashed.marker").exists()  # the actor did die
    rows = assert_each_parquet_input_once(out, 80)
    assert any(r["status"] == "error" for r in rows)


def test_driver_sigkilled_then_resumed_embeds_each_input_once(tmp_path, local_ray, checkpoint):
    make_image_folder(tmp_path / "imgs", 80, bad=False)
    out = tmp_path / "out"
    cmd = embed_cmd([tmp_path / "imgs"], checkpoint, out, "--engine", "ray", "--quiet")
    err = kill_when(cmd, lambda: any(out.glob("shard-*.parquet")))
    assert not re.search(r"\b(INFO|WARNING)\b", err), err  # --quiet: Ray's and Ray Data's notices too
    killed_at = len(parquet_rows(out))
    assert 0 < killed_at < 80
    assert main(cmd[3:] + ["--resume"]) == 0  # on the session's Ray
    rows = assert_each_parquet_input_once(out, 80)
    assert all(r["status"] == "ok" for r in rows)
    assert read_run(out)["threads"] == 1


def test_the_readme_map_batches_example_runs_as_written(tmp_path):
    """The "Many machines: Ray Data" python block of docs/embed.md runs as written in a fresh process (its own
    ray.init) from a folder holding examples/photos, and says what it claims."""
    section = (REPO / "docs" / "embed.md").read_text().split("## Many machines: Ray Data", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "map_batches(" in code and "Embedder" in code
    shutil.copytree(REPO / "examples" / "photos", tmp_path / "examples" / "photos")
    check = "\nassert sorted(r.status for r in records) == ['ok', 'ok']\nassert records[0].embedding.shape[1] == 1024\n"
    done = subprocess.run([sys.executable, "-c", code + check], cwd=tmp_path, env=embed_helpers.ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


class Reports(qv_ray.Embedder):
    """Writes what its actor runs with (torch threads, the CPU plan) next to the first input it sees."""

    def __call__(self, batch):
        import json

        first = Path(batch["path"][0])
        report = first.parent / f"actor-{os.getpid()}.json"
        report.write_text(json.dumps({"threads": torch.get_num_threads(),
                                      "plan": self.encoder.cpu_plan.to_dict()}))
        return super().__call__(batch)


def test_actors_run_at_the_run_threads_and_plan_bitwise_another_process(tmp_path, local_ray, checkpoint,
                                                                       monkeypatch):
    """At --threads 2 (Ray's own default is 1) and with the driver's machine plan made to pick oneDNN everywhere
    (the actors' own would not), every actor runs 2 threads and the run's plan, and its tensors are bitwise
    encode_images in this process under the same threads and plan."""
    import json

    from qwenvl_vision.backends.cpu import machine, probes
    from qwenvl_vision.backends.cpu.kernels import onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    paths = make_image_folder(tmp_path / "imgs", 3, bad=False)
    monkeypatch.setenv("QWENVL_VISION_CACHE", str(tmp_path / "driver-cache"))  # the actors keep the session's
    monkeypatch.setattr(machine, "PLANS", {})
    monkeypatch.setattr(probes, "measure_linear", lambda *_, **__: "onednn")
    monkeypatch.setattr(qv_ray, "Embedder", Reports)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--engine", "ray",
                 "--threads", "2", "--quiet"]) == 0
    run = read_run(out)
    assert run["threads"] == 2 and set(run["cpu_plan"]["linear"].values()) == {"onednn"}
    reports = [json.loads(p.read_text()) for p in (tmp_path / "imgs").rglob("actor-*.json")]
    assert reports and all(r == {"threads": 2, "plan": run["cpu_plan"]} for r in reports), reports
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with load_encoder(checkpoint, device="cpu", cpu_kernels=run["cpu_plan"]) as encoder:
            want = encoder.encode_images([str(p) for p in paths])
    finally:
        torch.set_num_threads(threads)
    got = dict(read_embeddings(out))
    assert all(torch.equal(got[str(p)], e) for p, e in zip(paths, want.embeddings))


class CannotStart(qv_ray.Embedder):
    """An actor whose tower is not the run's: the constructor's check fails, as on a node with another checkpoint."""

    def __init__(self, source, **options):
        options["weights_sha256"] = "0" * 64
        super().__init__(source, **options)


@pytest.mark.parametrize("node", ["another checkpoint", "another version"])
def test_an_actor_that_cannot_start_is_one_line_exit_2(tmp_path, local_ray, checkpoint, monkeypatch, capsys, node):
    """An actor on a node whose tower hashes otherwise, or whose installed package is another release than the one
    that began the run (here the driver's is patched; the actors run the installed one), fails to start."""
    make_image_folder(tmp_path / "imgs", 2, bad=False)
    if node == "another checkpoint":
        monkeypatch.setattr(qv_ray, "Embedder", CannotStart)
        culprit = ["CheckpointError:", "hashes to"]
    else:
        monkeypatch.setattr("qwenvl_vision.embed.run_record.package_version", lambda: "0.0.1")
        culprit = ["ConfigError:", "the run's 0.0.1"]
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / "out"),
                 "--engine", "ray", "--quiet"]) == 2
    embed_helpers.one_error_line(capsys.readouterr().err, f"an actor could not start ({culprit[0]}", culprit[1],
                                 "--resume")


MISSING_MODULE = """
import sys
from qwenvl_vision.cli import main
from qwenvl_vision.embed import ray as qv_ray

class MissingModule(qv_ray.Embedder):
    def __init__(self, source, **options):
        raise ModuleNotFoundError("No module named 'a_node_lacks_it'")

qv_ray.Embedder = MissingModule
sys.exit(main(["embed", *sys.argv[1:], "--engine", "ray"]))
"""


def test_an_actor_whose_constructor_raises_is_exit_2_without_ray_s_stack_trace(tmp_path, checkpoint):
    """A node lacking a module the actor imports fails every try alike: exit 2 naming it, not exit 3's --resume. Ray
    Data logs the failure's stack trace on the process's stderr (which capsys cannot see): it stays off the console,
    without --quiet too. A process of its own, with its own local Ray."""
    make_image_folder(tmp_path / "imgs", 2, bad=False)
    (tmp_path / "run.py").write_text(MISSING_MODULE)
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "imgs"), "--model",
                           str(checkpoint), "--out", str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "stack trace" not in done.stderr, done.stderr[-3000:]
    assert "an actor could not start (ModuleNotFoundError: No module named 'a_node_lacks_it')" in \
        done.stderr.splitlines()[-1], done.stderr[-3000:]


def test_a_shard_member_s_error_names_it_as_given(tmp_path, local_ray, checkpoint, monkeypatch):
    """The actors read absolute paths; a member over the decode budget is named as the local engine names it."""
    big = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (900, 900, 3), dtype=np.uint8)).save(big)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        tar.add(big, "noise.png")
    monkeypatch.chdir(tmp_path)
    assert main(["embed", "s.tar", "--model", str(checkpoint), "--out", "out", "--engine", "ray", "--decode-mib",
                 "1", "--format", "parquet", "--quiet"]) == 1
    [row] = parquet_rows(tmp_path / "out")
    assert row["error"].startswith("s.tar/noise.png: ") and str(tmp_path) not in row["error"], row["error"]


class BrokenDevice(qv_ray.Embedder):
    """An actor whose device fails every forward, its probe too: the machine's fault, no input's."""

    def __call__(self, batch):
        def broken(*args, **kwargs):
            raise RuntimeError("an illegal memory access was encountered (a stand-in)")

        self.encoder._encode_unchecked = broken
        return super().__call__(batch)


def test_an_actor_s_device_fault_is_exit_4_naming_the_batch_as_the_local_engine(tmp_path, local_ray, checkpoint,
                                                                                 monkeypatch, capsys):
    make_image_folder(tmp_path / "imgs", 2, bad=False)
    monkeypatch.setattr(qv_ray, "Embedder", BrokenDevice)
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / "out"),
                 "--engine", "ray", "--quiet"]) == 4
    line = embed_helpers.one_error_line(capsys.readouterr().err, "the forward of a batch of",
                                        "an illegal memory access", "--resume")
    assert line.count("--resume") == 1, line  # the advice once, as the local engine gives it


def test_a_bf16_encoder_cache_from_ray_is_the_local_one_bit_for_bit(tmp_path, local_ray, checkpoint3):
    """Ray's rows travel as float32; the driver writes the cache items in the run's dtype again: the same files,
    dtype and bits as --engine local at the same threads."""
    images = make_image_folder(tmp_path / "imgs", 3, bad=False)
    options = [*map(str, images), "--model", str(checkpoint3), "--threads", "1", "--dtype", "bf16", "--quiet",
               "--format", "vllm-cache", "--max-pixels", str(64 * 64)]
    assert main(["embed", *options, "--out", str(tmp_path / "local")]) == 0
    assert main(["embed", *options, "--out", str(tmp_path / "ray"), "--engine", "ray"]) == 0
    local = {r["path"]: r for r in read_manifest_lines(tmp_path / "local" / "manifest.jsonl")}
    remote = {r["path"]: r for r in read_manifest_lines(tmp_path / "ray" / "manifest.jsonl")}
    assert local.keys() == remote.keys() and len(local) == 3
    for path, record in local.items():
        assert remote[path]["id"] == record["id"]
        mine, theirs = (load_file(tmp_path / name / record["shard"])["ec_cache"] for name in ("local", "ray"))
        assert mine.dtype == theirs.dtype == torch.bfloat16 and torch.equal(mine, theirs), path
