"""qwenvl_vision.embed.progress: without a terminal, a line input by input (at the test's rate) and one at the end;
nothing but the summary with --quiet."""

from __future__ import annotations

import re

import qwenvl_vision.embed.progress as progress
from qwenvl_vision.cli import main
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import records


def test_progress_without_a_terminal_and_quiet(tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 6, bad=False)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert len({r["shard"] for r in records(tmp_path / "out")}) == 1  # one batch
    # The CPU plan is measured once per test session: by whichever test loads a tower first.
    lines = [line for line in capsys.readouterr().err.splitlines() if "measured this machine's CPU kernels" not in line]
    assert lines[0].startswith("embed: reading 2 shards with the vision tensors (") and "onto cpu" in lines[0]
    assert lines[1].startswith("embed: loaded the qwen2_5_vl tower (float32) in ")
    assert lines[2] == "embed: 6 inputs to embed"
    step = r"embed: \d+/6 inputs \(\d+%\), [\d.]+ inputs/s, \d+ tok/s, ETA "
    steps = [line for line in lines if re.match(step, line)]
    assert [int(line.split()[1].split("/")[0]) for line in steps] == [1, 2, 3, 4, 5, 6]  # input by input
    assert steps[-1] == lines[-2]  # the last one once everything is written, just before the summary
    assert lines[-1].startswith("embedded 6 of 6 inputs")

    assert main([*args, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"embedded 6 of 6 inputs into {tmp_path / 'quiet'} (0 failed; see {tmp_path / 'quiet' / 'manifest.jsonl'})"]
