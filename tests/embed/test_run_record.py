"""qwenvl_vision.embed.run_record: run.json records what the tensors depend on, --resume refuses other settings,
and the pixel bounds are the ones encode_images and transformers' processor use for the same options."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_run
from qwenvl_vision.embed.run_record import crossed_bounds_note, pixel_bounds
from qwenvl_vision.loading import load_encoder
from tests.helpers import ENV, synthetic_photo
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import one_error_line, records, torchrun_embed_cmd


def test_pixel_bounds_are_each_option_else_the_checkpoints_even_where_they_cross():
    pre = SimpleNamespace(min_pixels=65536, max_pixels=16777216)

    def options(low=None, high=None):
        return SimpleNamespace(min_pixels=low, max_pixels=high)

    assert pixel_bounds(options(), pre) == (65536, 16777216)
    assert pixel_bounds(options(high=50176), pre) == (65536, 50176)  # crossed: kept, as encode_images keeps it
    assert pixel_bounds(options(low=20_000_000), pre) == (20_000_000, 16777216)
    assert pixel_bounds(options(4096, 50176), pre) == (4096, 50176)
    assert crossed_bounds_note(options(high=50176), pre).startswith(
        "the checkpoint's min_pixels 65536 is above --max-pixels 50176: ")
    assert "--min-pixels 20000000 is above the checkpoint's max_pixels 16777216" in crossed_bounds_note(
        options(low=20_000_000), pre)
    assert crossed_bounds_note(options(4096, 50176), pre) is None and crossed_bounds_note(options(), pre) is None


def test_max_pixels_below_the_checkpoints_min_embeds_what_encode_images_and_transformers_give(
        tmp_path, checkpoint3, capsys):
    """Qwen3-VL's min_pixels 65536 is above --max-pixels 50176: a small image is upscaled past the max, a large one
    shrinks below it, in transformers' processor as in encode_images(max_pixels=50176); embed stores exactly
    encode_images' tensors, says so in one line (even --quiet) and records the bounds the images were sized by."""
    from transformers import AutoImageProcessor

    small, large = tmp_path / "small.png", tmp_path / "large.png"
    Image.fromarray(synthetic_photo(120, 160, 1)).save(small)  # 19,200 pixels: below both bounds
    Image.fromarray(synthetic_photo(300, 400, 2)).save(large)  # 120,000 pixels: above both
    paths = [str(small), str(large)]
    out = tmp_path / "out"
    assert main(["embed", *paths, "--model", str(checkpoint3), "--out", str(out), "--max-pixels", "50176",
                 "--quiet"]) == 0
    note, summary = capsys.readouterr().err.splitlines()
    assert note.startswith("embed: note: the checkpoint's min_pixels 65536 is above --max-pixels 50176: ")
    assert summary.startswith("embedded 2 of 2 inputs")
    run = read_run(out)
    assert (run["min_pixels"], run["max_pixels"]) == (65536, 50176)

    with load_encoder(checkpoint3, device="cpu") as encoder:
        expected = encoder.encode_images(paths, max_pixels=50176)
    stored = dict(read_embeddings(out))
    recorded = {r["path"]: r for r in records(out)}
    processor = AutoImageProcessor.from_pretrained(checkpoint3, max_pixels=50176)
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (65536, 50176)
    for path, embedding, grid in zip(paths, expected.embeddings, expected.grid_thw.tolist()):
        assert torch.equal(stored[path], embedding), path
        reference_grid = processor(Image.open(path).convert("RGB"), return_tensors="pt")["image_grid_thw"][0]
        assert recorded[path]["grid_thw"] == grid == reference_grid.tolist(), path
    patch = encoder.preprocess_config.patch_size
    areas = [g[1] * g[2] * patch * patch for g in expected.grid_thw.tolist()]
    assert areas[0] >= 65536 > 50176 >= areas[1]  # the small image past the max, the large one within it


def test_resume_refuses_other_settings(tmp_path, checkpoint, checkpoint3, capsys):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    run = read_run(out)
    assert run["model"] == str(checkpoint) and run["dtype"] == "float32" and run["pooled"] is False
    assert (run["min_pixels"], run["max_pixels"]) == (3136, 12845056)  # the checkpoint's
    before = (out / "manifest.jsonl").read_bytes(), sorted(p.name for p in out.iterdir())

    cases = [
        (["--pooled-only"], ["pooled false (now true)"]),
        (["--pooled-only", "--normalize"], ["pooled false (now true)", "normalize false (now true)"]),
        (["--dtype", "bf16"], ['dtype "float32" (now "bfloat16")']),
        (["--max-pixels", "50000"], ["max_pixels 12845056 (now 50000)"]),
        (["--min-pixels", "1000"], ["min_pixels 3136 (now 1000)"]),
        (["--threads", str(run["threads"] + 1)], [f"threads {run['threads']}"]),  # bitwise equal at one count only
        (["--resize", "torch"], ['resize "pil" (now "torch")']),
        (["--compile"], ["compile false (now true)"]),  # other kernels: other bits
        (["--model", str(checkpoint3)], ["config_sha256", "weights_sha256", "another model"]),
    ]
    for extra, needles in cases:
        argv = ["embed", str(tmp_path / "imgs"), "--out", str(out), "--resume", *extra]
        if "--model" not in extra:
            argv += ["--model", str(checkpoint)]
        assert main(argv) == 2, extra
        one_error_line(capsys.readouterr().err, "other settings", *needles)
        assert ((out / "manifest.jsonl").read_bytes(), sorted(p.name for p in out.iterdir())) == before

    # A run begun by an earlier release: what it wrote may differ from what this one computes for the same settings.
    (out / "run.json").write_text(json.dumps({**run, "package_version": "0.0.1"}))
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--resume"]) == 2
    now = run["package_version"]
    one_error_line(capsys.readouterr().err, "other settings", f'package_version "0.0.1" (now "{now}")')

    # A run file without a field (one this version would compare or reuse) is damaged: refused, naming the field,
    # never read as some default.
    for field in ("resize", "video", "threads", "compile", "cpu_plan", "family", "cwd"):
        (out / "run.json").write_text(json.dumps({k: v for k, v in run.items() if k != field}))
        base = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--resume"]
        assert main(base) == 2, field
        one_error_line(capsys.readouterr().err, "run.json is damaged", f"no {field}")
    (out / "run.json").write_text(json.dumps(run))

    # Same settings (and a moved model folder: the hashes decide, not the spelling): resumes.
    moved = tmp_path / "moved-ckpt"
    moved.symlink_to(checkpoint)
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(moved), "--out", str(out), "--resume"]) == 0


def test_rerun_without_resume_is_one_line_and_touches_nothing(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(args) == 2
    one_error_line(capsys.readouterr().err, str(out), "already holds a run", "--resume")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_a_torchrun_rank_with_another_package_version_stops_a_fresh_run_before_writing(tmp_path, checkpoint):
    """Another node's install: refused as a resume would refuse it, not mixed into the run's records."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.metadata, os\n"
        "if os.environ.get('RANK') == '1':  # this rank's node has another release installed\n"
        "    version = importlib.metadata.version\n"
        "    importlib.metadata.version = lambda name: '0.0.1' if name == 'qwenvl-vision' else version(name)\n")
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    env = {**ENV, "PYTHONPATH": f"{site}{os.pathsep}{ENV['PYTHONPATH']}"}
    result = subprocess.run(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, out), env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("qwenvl-vision embed")]
    assert len(ours) == 1 and "[rank 1]" in ours[0] and "rank 0 runs" in ours[0], result.stderr
    assert '"0.0.1"' in ours[0] and "package_version" in ours[0]
    assert not (out / "run.json").exists() and not list(out.glob("shard-*"))
