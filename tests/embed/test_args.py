"""qwenvl_vision.embed.args: every bad option is one line, exit 2, nothing written; every option has help."""

from __future__ import annotations

import pytest

from qwenvl_vision.cli import main
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import one_error_line

USAGE_ERRORS = {
    "unknown device": (["--device", "tpu9"], ["--device", "tpu9"]),
    "device with a typo": (["--device", "cdua"], ["unknown device 'cdua'"]),
    "dtype fp8": (["--dtype", "fp8"], ["unsupported dtype 'fp8'", "bf16"]),
    "batch patches 0": (["--batch-patches", "0"], ["--batch-patches must be at least 1, got 0"]),
    "max pixels 0": (["--max-pixels", "0"], ["--max-pixels must be at least 1, got 0"]),
    "max pixels -1": (["--max-pixels", "-1"], ["--max-pixels must be at least 1, got -1"]),
    "max pixels not a number": (["--max-pixels", "1e6"], ["--max-pixels must be an integer"]),
    "min above max": (["--min-pixels", "50000", "--max-pixels", "40000"],
                      ["--min-pixels 50000 is above --max-pixels 40000"]),
    "max input pixels 0": (["--max-input-pixels", "0"], ["--max-input-pixels must be at least 1"]),
    "a GPU index for Ray's actors": (["--engine", "ray", "--device", "cuda:1"], ["--device cuda:1", "--engine ray"]),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_errors_are_one_line_exit_2_nothing_written(case, tmp_path, checkpoint, capsys):
    extra, needles = USAGE_ERRORS[case]
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), *extra])
    assert code == 2
    one_error_line(capsys.readouterr().err, "error", *needles)
    assert not out.exists()


def test_every_option_has_help_with_its_default(capsys):
    from qwenvl_vision.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for command in ("embed", "extract-weights", "inspect"):
        sub = subparsers.choices[command]
        for action in sub._actions:
            assert action.help, f"{command} {action.option_strings or action.dest} has no help text"
    assert main(["embed", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("cpu, cuda or cuda:N", "bf16/bfloat16", "default: bf16 on CUDA, fp32 on CPU",
                   "default: the checkpoint's", "default 16384", "default 64000000"):
        assert needle in text
    for kind in ("video", "URLs", "folders", ".txt", ".parquet", ".csv", ".jsonl", "uncompressed .tar shards"):
        assert kind in text  # every kind of INPUT read


def test_batch_patches_bounds_each_forward(tmp_path, checkpoint):
    """--batch-patches counts patches: a budget of one runs each image alone, one shard per forward."""
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-patches",
                 "1", "--quiet"]) == 0
    assert len(list(out.glob("shard-*.safetensors"))) == 2
