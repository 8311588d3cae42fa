"""Helpers the tests of ``qwenvl_vision.embed`` share (tests/test_embed_*.py): reading an output's manifest, the
CLI's one-line errors, and embed runs in child processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from qwenvl_vision.embed import read_embeddings, read_manifest_lines
from tests.helpers import REPO, make_image_folder, write_video

# Children import this checkout's package, single-threaded (a 2-core machine runs several at once).
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


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
