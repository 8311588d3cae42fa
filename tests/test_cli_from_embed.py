"""CLI tests that lived among the embed tests (to merge into tests/test_cli.py): preset names, --version, inspect
of a preset, extract-weights into a non-empty folder."""

from __future__ import annotations

import json

from qwenvl_vision.cli import main
from qwenvl_vision.version import package_version
from tests.embed_helpers import one_error_line


def test_cli_names_random_weights_version_and_inspect_preset(tmp_path, capsys):
    assert main(["embed", str(tmp_path), "--model", "qwen3-vl-2b", "--out", str(tmp_path / "o")]) == 2
    one_error_line(capsys.readouterr().err, "qwen3-vl-2b is a preset", "--random-weights")
    assert main(["extract-weights", "qwen3-vl-2b"]) == 2
    one_error_line(capsys.readouterr().err, "qwen3-vl-2b is a preset", "no weights")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"qwenvl-vision {package_version()}"
    assert main(["inspect", "Qwen3-VL-2B", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The released Qwen3-VL-2B tower: 24 blocks of width 1024, out 2048, DeepStack after blocks 5, 11, 17.
    assert (report["preset"], report["family"], report["config"]["depth"], report["config"]["out_hidden_size"]) \
        == ("qwen3-vl-2b", "qwen3_vl", 24, 2048)
    assert report["config"]["deepstack_visual_indexes"] == [5, 11, 17]
    assert 350e6 < report["parameters"] < 450e6 and report["bytes_bf16"] == 2 * report["parameters"]


def test_extract_weights_refuses_a_non_empty_target_without_force(tmp_path, checkpoint, capsys):
    target = tmp_path / "vision"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert main(["extract-weights", str(checkpoint), "--out", str(target)]) == 2
    one_error_line(capsys.readouterr().err, str(target), "is not empty", "--force")
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert main(["extract-weights", str(checkpoint), "--out", str(target), "--force"]) == 0
    assert (target / "keep.txt").read_text() == "mine" and (target / "model.safetensors").is_file()
