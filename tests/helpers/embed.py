"""Helpers the tests of ``qwenvl_vision.embed`` share (tests/test_embed_*.py): reading an output's manifest, the
CLI's one-line errors, and embed runs in child processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qwenvl_vision.embed import read_embeddings, read_manifest_lines
from tests.helpers import ENV, make_image_folder, write_video


def records(out: Path) -> list[dict]:
    """The manifest records of the embed output `out`."""
    return read_manifest_lines(out / "manifest.jsonl")


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress and loading lines ('embed: ...', which --quiet silences)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("embed: ", "embed[rank"))]


def one_error_line(stderr: str, *needles: str) -> str:
    """stderr is exactly one line, no traceback, naming every needle."""
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_each_input_once(out: Path, expected: int) -> list[dict]:
    """`expected` records, one per input; every shard referenced, none left over, no temporary file; all readable."""
    recs = records(out)
    paths = [r["path"] for r in recs]
    assert len(paths) == len(set(paths)) == expected
    referenced = {r["shard"] for r in recs if r["status"] == "ok"}
    assert referenced == {p.name for p in out.glob("*.safetensors")}  # no orphan shard
    assert not list(out.glob("*.tmp"))
    assert len(dict(read_embeddings(out))) == sum(r["status"] == "ok" for r in recs)
    return recs


def run_embed(inputs, model, out, *extra) -> int:
    """``qwenvl-vision embed`` in this process: its exit code."""
    from qwenvl_vision.cli import main

    return main(["embed", *map(str, inputs), "--model", str(model), "--out", str(out), *extra])


def embed_cmd(inputs, model, out, *extra) -> list[str]:
    """``qwenvl-vision embed`` as a child process."""
    return [sys.executable, "-m", "qwenvl_vision.cli", "embed", *map(str, inputs), "--model", str(model),
            "--out", str(out), *extra]


def torchrun_embed_cmd(inputs, model, out, *extra) -> list[str]:
    """``qwenvl-vision embed`` on two CPU ranks under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *embed_cmd(inputs, model, out, "--device", "cpu", *extra)[1:]]


def make_media_folder(root: Path, images: int, videos: int) -> tuple[list[Path], list[Path]]:
    """Images (make_image_folder, no bad files) and small video files (mp4, avi, mkv) in one folder tree."""
    image_paths = make_image_folder(root, images, bad=False)
    video_paths = []
    for i in range(videos):
        path = root / ("sub" if i % 2 else ".") / f"clip{i:03d}{('.mp4', '.avi', '.mkv')[i % 3]}"
        write_video(path, 5 + 3 * i, 48 + 8 * (i % 3), 40, 4 + i % 3)  # 1..3 s at 4..6 fps: 2..6 frames sampled
        video_paths.append(path)
    return image_paths, video_paths


def parquet_rows(out: Path) -> list[dict]:
    """Every row of the output's Parquet shards as plain ``pyarrow.parquet`` reads them (no package code)."""
    import pyarrow.parquet as pq

    rows = []
    for shard in sorted(out.glob("shard-r*.parquet")):
        rows += pq.read_table(shard).to_pylist()
    return rows


def assert_each_parquet_input_once(out: Path, expected: int) -> list[dict]:
    """`expected` rows, one per input (by realpath), no temporary file left, all readable by read_embeddings."""
    rows = parquet_rows(out)
    keys = [r["realpath"] for r in rows]
    assert len(keys) == len(set(keys)) == expected, (len(keys), len(set(keys)), expected)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    assert len(dict(read_embeddings(out))) == sum(r["status"] == "ok" for r in rows)
    return rows


def kill_when(cmd: list[str], ready, timeout: float = 180) -> str:
    """Run `cmd` in a child and SIGKILL it once ``ready()`` holds (polled every 5 ms); it must not finish first.
    Returns what it wrote to stderr."""
    import signal
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None and not ready():
            time.sleep(0.005)
        assert proc.poll() is None, "the run finished (or failed) before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        err.seek(0)
        return err.read().decode(errors="replace")


def kill_at_instants(cmd: list[str], out: Path, delays: tuple[float, ...] = (2.5, 3.5, 5.0)) -> None:
    """Run `cmd` (with --resume once `out` exists) in a child and SIGKILL it `delay` seconds in, once per delay:
    some kills land mid-run, some after it ended."""
    import signal
    import subprocess
    import time

    for delay in delays:
        proc = subprocess.Popen(cmd + (["--resume"] if out.exists() else []), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the session, on the 2 CPUs the test machines have, no dashboard (it takes seconds); shared
    by the modules that import it (the first to run starts it, the session's end stops it)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
