"""qwenvl_vision.embed.reader and .manifest: reading an output back; damaged lines named, a torn last line left
out, a run stopped before its ranks' parts were merged told as such; the reader alone needs no writer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from qwenvl_vision import load_encoder, read_encoded
from qwenvl_vision.embed import MANIFEST, RUN_FORMAT, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.errors import ManifestError
from qwenvl_vision.outputs.handoff import to_vllm
from tests.helpers import ENV, QWEN3_SMALL_72, write_checkpoint
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import assert_each_input_once, make_media_folder, one_error_line, records, run_embed


def test_a_damaged_manifest_line_is_named_and_a_resume_restores_its_record_from_its_shard(tmp_path, checkpoint,
                                                                                           capsys):
    make_folder(tmp_path / "imgs", 4, bad=False)
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs"], checkpoint, out) == 0
    lines = (out / MANIFEST).read_text().splitlines()
    damaged = json.loads(lines[1])
    lines[1] = lines[1][:-5]  # a damaged middle line (not the torn tail of a killed run)
    (out / MANIFEST).write_text("\n".join(lines) + "\n")
    for read in (lambda: list(read_embeddings(out)), lambda: read_manifest_lines(out / MANIFEST)):
        with pytest.raises(ManifestError, match=r"manifest.jsonl, line 2: damaged manifest line"):
            read()
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    capsys.readouterr()
    assert run_embed([tmp_path / "imgs"], checkpoint, out, "--resume") == 0
    one_error_line(capsys.readouterr().err, "embedded 4 of 4 inputs")
    restored = {r["path"]: r for r in assert_each_input_once(out, 4)}
    assert restored[damaged["path"]] == damaged  # its record came back from its shard
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards  # nothing embedded again


def test_a_torn_last_line_is_left_out_and_a_run_stopped_before_merging_says_so(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs"], checkpoint, out, "--quiet") == 0
    with open(out / MANIFEST, "a") as f:
        f.write('{"path": "half a reco')  # a run killed mid-append
    assert len(dict(read_embeddings(out))) == 2
    (out / MANIFEST).rename(out / "manifest.rank0.jsonl")  # a multi-rank run stopped before merging its parts
    with pytest.raises(ManifestError, match="before merging.*--resume"):
        list(read_embeddings(out))


# The reader imports neither the writer, the lock (fcntl) nor the job. fcntl itself is no proof: the standard
# library's subprocess imports it (and torch imports subprocess), so the child makes it unimportable instead.
READ_WITHOUT_FCNTL = """
import sys
sys.modules["fcntl"] = None  # every import of fcntl now fails
import qwenvl_vision
assert "qwenvl_vision.embed.writer" not in sys.modules, "import qwenvl_vision loaded the writer"
from qwenvl_vision.embed import read_embeddings, read_manifest_lines, read_run
out = sys.argv[1]
print(len(dict(read_embeddings(out))), len(read_manifest_lines(out + "/manifest.jsonl")), read_run(out)["format"])
print(" ".join(sorted(m for m in sys.modules if m.startswith("qwenvl_vision.embed"))))
"""


@pytest.mark.slow
def test_reading_an_output_needs_neither_the_writer_nor_the_lock(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2)  # 2 images and 3 bad files
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs"], checkpoint, out, "--quiet") == 1
    result = subprocess.run([sys.executable, "-c", READ_WITHOUT_FCNTL, str(out)], env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    counts, loaded = result.stdout.splitlines()
    assert counts.split() == ["2", "5", str(RUN_FORMAT)]
    # What the folder's files are, never the writer, the lock, the job or the inputs' listing.
    assert loaded.split() == ["qwenvl_vision.embed", "qwenvl_vision.embed.manifest", "qwenvl_vision.embed.reader"]


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_stored_results_hand_over_like_the_encoder_result(tmp_path, checkpoint3, file_format):
    """read_encoded gives what encode_images gives the language model: vLLM's layout (DeepStack levels along the
    features) and transformers' grids, bitwise, for the paths asked, in the order asked."""
    make_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs"], checkpoint3, out, "--quiet", "--format", file_format) == 0
    paths = sorted(r["path"] for r in records(out)) if file_format == "safetensors" else None
    stored = read_encoded(out, paths[::-1] if paths else None)
    asked = paths[::-1] if paths else [p for p, _ in read_embeddings(out)]
    expected = load_encoder(checkpoint3, device="cpu").encode_images(asked)
    ours, theirs = to_vllm(stored)["image"], expected.to_vllm()["image"]
    assert stored.family == "qwen3_vl" and len(stored.embeddings) == 3
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.equal(ours["image_embeds"], theirs["image_embeds"])
    with pytest.raises(ManifestError, match="no ok record"):
        read_encoded(out, ["nowhere.jpg"])
    with pytest.raises(ManifestError, match="a video"):
        read_encoded(out, asked[:1], modality="video")
    with pytest.raises(ManifestError, match="modality 'images'"):
        read_encoded(out, modality="images")
    with pytest.raises(ManifestError, match=r"got one .*: pass \[it\]"):
        read_encoded(out, asked[0])


def test_deepstack_levels_are_read_back_in_their_order_past_ten(tmp_path):
    write_checkpoint(tmp_path / "ckpt", QWEN3_SMALL_72.replace(depth=11, deepstack_visual_indexes=tuple(range(11))))
    make_folder(tmp_path / "imgs", 1, bad=False)
    assert run_embed([tmp_path / "imgs"], tmp_path / "ckpt", tmp_path / "out", "--quiet") == 0
    ((path, (_, levels)),) = read_embeddings(tmp_path / "out", deepstack=True)
    expected = load_encoder(tmp_path / "ckpt", device="cpu").encode_images([path]).deepstack[0]
    assert len(levels) == 11 and all(torch.equal(a, b) for a, b in zip(levels, expected))


def test_what_is_no_embed_output_is_refused_by_every_reader(tmp_path):
    """A typo of the folder, or a file given for it, is one ManifestError naming its run.json: never an empty read."""
    (tmp_path / "a.png").write_bytes(b"not a folder")
    for out in (tmp_path / "typo", tmp_path / "a.png"):
        for read in (read_run, lambda o: list(read_embeddings(o)), read_encoded):
            with pytest.raises(ManifestError, match=r"run\.json does not exist"):
                read(out)
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "shard-r0-000000.parquet").write_bytes(b"PAR1")
    with pytest.raises(ManifestError, match=r"run\.json does not exist: .*Parquet shards copied without it"):
        read_run(tmp_path / "copied")
    for damaged in ("[]", "null", '{"format": "2"}'):
        (tmp_path / "copied" / "run.json").write_text(damaged)
        with pytest.raises(ManifestError, match=r"copied/run\.json is damaged"):
            read_run(tmp_path / "copied")


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_stored_videos_hand_over_with_the_timestamps_of_the_encoder_result(tmp_path, checkpoint3, file_format):
    """A Qwen3-VL run's video records carry the frames each video was sampled at and its frame rate, so
    read_encoded hands vLLM the same video embeddings and timestamps as encode_videos (from its video_info)."""
    pytest.importorskip("av")

    _, videos = make_media_folder(tmp_path / "media", 1, 3)
    out = tmp_path / "out"
    assert run_embed([tmp_path / "media"], checkpoint3, out, "--quiet", "--format", file_format, "--fps", "3") == 0
    stored = read_encoded(out, modality="video")
    asked = [p for p, _ in read_embeddings(out) if p.endswith((".mp4", ".avi", ".mkv"))]
    expected = load_encoder(checkpoint3, device="cpu").encode_videos(asked, fps=3.0)
    ours, theirs = to_vllm(stored)["video"], expected.to_vllm()["video"]
    assert len(stored.embeddings) == len(videos) == len(ours["timestamps"])
    assert ours["timestamps"] == theirs["timestamps"]
    assert [len(t) for t in ours["timestamps"]] == ours["video_grid_thw"][:, 0].tolist()
    assert torch.equal(ours["video_embeds"], theirs["video_embeds"])
