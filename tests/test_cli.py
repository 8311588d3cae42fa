"""The ``qwenvl-vision`` command line (``qwenvl_vision/cli.py``): ``extract-weights`` (from a folder and from a repo
id), ``inspect`` (its report, and its header checks, the same a load makes), the one-line errors and a reader
that goes away, and every family's extract-weights round trip. `embed` has its own test files (tests/test_embed_*.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision import build_model, load_encoder
from qwenvl_vision.cli import main
from qwenvl_vision.version import package_version
from tests.helpers import (
    ENV,
    FAMILY_SMALL,
    QWEN2_5_SMALL,
    grids_for,
    inputs,
    make_image_folder,
    offsets_of,
    same_size_pair,
    set_entry,
    write_checkpoint,
)
from tests.helpers.embed import one_error_line

# ---------------------------------------------------------------------- extract-weights


def test_extract_weights_default_dir_is_under_weights(tmp_path, monkeypatch, capsys):
    src = tmp_path / "Qwen2.5-VL-tiny"
    write_checkpoint(src, QWEN2_5_SMALL)
    monkeypatch.chdir(tmp_path)
    assert main(["extract-weights", str(src)]) == 0
    assert (tmp_path / "weights" / "Qwen2.5-VL-tiny-vision" / "model.safetensors").is_file()
    shutil.rmtree(tmp_path / "weights")
    assert main(["extract-weights", "Qwen2.5-VL-tiny/."]) == 0  # "." is named after the folder it is
    assert (tmp_path / "weights" / "Qwen2.5-VL-tiny-vision" / "model.safetensors").is_file()
    assert main(["extract-weights", str(src), "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err


def test_extract_weights_from_a_repo_keeps_its_stored_dtype_and_the_umask(hub, tmp_path):
    """An fp32 checkpoint on the Hub is extracted in fp32 (the stored dtype, not the releases' bf16), and the
    written files follow the umask like everything else the package writes."""
    folder = tmp_path / "qwen25"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True, other_shards=2)
    hub.add("org/qwen25-tiny", folder)
    out = tmp_path / "extracted"
    assert main(["extract-weights", "org/qwen25-tiny", "--out", str(out)]) == 0
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.float32}
    mask = os.umask(0)
    os.umask(mask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~mask, name


# ---------------------------------------------------------------------- inspect


@pytest.mark.parametrize("corruption", ["negative-begin", "integer-dtype", "overlap"])
def test_inspect_validates_headers_as_loading_does(tmp_path, capsys, corruption):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, QWEN2_5_SMALL)
    shard, a, b = same_size_pair(ckpt)
    if corruption == "negative-begin":
        set_entry(ckpt, a, data_offsets=[-8, 632])
    elif corruption == "integer-dtype":
        set_entry(ckpt, a, dtype="I32")
    else:
        set_entry(ckpt, b, data_offsets=offsets_of(ckpt, a))
    assert main(["inspect", str(ckpt)]) == 2
    # The format's rules (offsets) are safetensors', whose errors name the shard; the integer dtype is refused by
    # ours, naming the tensor too.
    one_error_line(capsys.readouterr().err, shard.name, *([a] if corruption == "integer-dtype" else []))


# ---------------------------------------------------------------------- errors, a reader gone


@pytest.mark.slow  # a subprocess
def test_cli_output_into_a_closed_pipe_stops_quietly():
    """`qwenvl-vision inspect ... | head`: no traceback and no error line, exit 141 (128 + SIGPIPE)."""
    code = ("import sys; from qwenvl_vision.cli import main; "
            "sys.exit(max(main(['inspect', 'qwen3.5-0.8b', '--json']) for _ in range(300)))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10) == b'{\n  "prese'
    proc.stdout.close()  # the reader goes away, as `head -c 10` does
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""


def test_cli_names_random_weights_version_and_inspect_preset(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    one_error_line(capsys.readouterr().err, "missing")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert main(["inspect", str(tmp_path / "model.safetensors")]) == 2
    one_error_line(capsys.readouterr().err, "model.safetensors is a file: give the folder")
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
    # Another checkpoint's transformers 5 settings, read before the flat files by transformers and by us: removed.
    (target / "processor_config.json").write_text('{"image_processor": {"size": {"longest_edge": 3136}}}')
    assert main(["extract-weights", str(checkpoint), "--out", str(target), "--force"]) == 0
    assert (target / "keep.txt").read_text() == "mine" and (target / "model.safetensors").is_file()
    assert not (target / "processor_config.json").exists()
    assert load_encoder(target, device="cpu").preprocess_config == load_encoder(checkpoint,
                                                                                 device="cpu").preprocess_config


@pytest.mark.parametrize("family", list(FAMILY_SMALL))
def test_extract_weights_and_inspect(tmp_path, capsys, family):
    """A release (its language model's shards too) extracted: the family's own vision tensor names only, in the
    stored dtype (bf16), the same settings and bitwise the same encoder as the release; inspect reports both."""
    cfg = FAMILY_SMALL[family]
    folder = tmp_path / "released"
    vision = write_checkpoint(folder, cfg, sharded=True, other_shards=2, dtype=torch.bfloat16)
    out = tmp_path / "vision-only"
    assert main(["extract-weights", str(folder), "--out", str(out)]) == 0
    stored = load_file(str(out / "model.safetensors"))
    assert f"wrote {len(stored)} vision tensors" in capsys.readouterr().out
    assert set(stored) == set(vision) and {t.dtype for t in stored.values()} == {torch.bfloat16}
    src, dst = load_encoder(folder, device="cpu"), load_encoder(out, device="cpu")
    assert (dst.preprocess_config, dst.video_config) == (src.preprocess_config, src.video_config)
    pack = inputs(cfg, grids_for(cfg))
    assert all(torch.equal(a, b) for a, b in zip(src.encode_patches(*pack).embeddings,
                                                 dst.encode_patches(*pack).embeddings, strict=True))
    parameters = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    for source in (folder, out):
        assert main(["inspect", str(source), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["family"], report["tensors"], report["bytes"]) == (cfg.model_type, len(stored), 2 * parameters)


# ---------------------------------------------------------------------- what a command says on the way


@pytest.mark.slow  # a subprocess: under pytest a warning is recorded, not shown as the command shows it
def test_the_fp16_warning_names_the_family_on_one_line(tmp_path, checkpoint3):
    result = subprocess.run([sys.executable, "-m", "qwenvl_vision.cli", "extract-weights", str(checkpoint3), "--out",
                             str(tmp_path / "out"), "--dtype", "fp16"], env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    [warning] = [line for line in lines if "float16" in line]
    assert warning.startswith("UserWarning: float16 can overflow in the Qwen3-VL tower;"), warning
    assert not any(".py:" in line or line.startswith(" ") for line in lines), result.stderr  # no source line


def test_embed_says_when_it_measures_the_cpu_plan_and_for_how_long(tmp_path, checkpoint, monkeypatch, capsys):
    """The first load on a machine measures its CPU kernels (seconds): one line says so; a later process reads them
    back and says nothing."""
    from qwenvl_vision.backends.cpu import machine

    monkeypatch.setenv("QWENVL_VISION_CACHE", str(tmp_path / "cache"))
    make_image_folder(tmp_path / "imgs", 1, bad=False)
    said = []
    for run in range(2):
        monkeypatch.setattr(machine, "PLANS", {})  # each run as a new process would start
        assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / f"{run}")
                     ]) == 0
        said.append([line for line in capsys.readouterr().err.splitlines() if "CPU kernels" in line])
    [line] = said[0]
    assert re.fullmatch(r"embed: measured this machine's CPU kernels in \d+\.\d s, once: later loads read them "
                        r"from .*cpu-plans.*\.json", line), line
    assert said[1] == []
