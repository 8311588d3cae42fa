"""embed --format parquet (qwenvl_vision.embed.parquet_writer and the job around it): one row per input as plain
pyarrow reads it, tensors bitwise encode_images / encode_videos (bf16 stored as exact float32), run.json in the
schema metadata, read_embeddings giving what the safetensors run of the same inputs gives; resume records every
input once (killed by SIGKILL too) and never mixes formats."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_run
from qwenvl_vision.embed.inputs import file_of, gather_inputs
from qwenvl_vision.loading import load_encoder
from tests.helpers import make_image_folder, synthetic_photo
from tests.helpers.embed import (
    ENV,
    assert_each_parquet_input_once,
    embed_cmd,
    kill_when,
    make_media_folder,
    one_error_line,
    parquet_rows,
    run_embed,
    torchrun_embed_cmd,
)

pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("av")


def _media(root: Path) -> tuple[list[Path], list[Path], Path]:
    images, videos = make_media_folder(root, 3, 2)
    broken = root / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg" * 3)
    return images, videos, broken


def test_parquet_rows_equal_the_api_and_the_safetensors_run(tmp_path, checkpoint3):
    images, videos, broken = _media(tmp_path / "media")
    out, twin = tmp_path / "pq", tmp_path / "st"
    assert run_embed([tmp_path / "media"], checkpoint3, out, "--quiet", "--fps", "3", "--format", "parquet") == 1
    assert run_embed([tmp_path / "media"], checkpoint3, twin, "--quiet", "--fps", "3") == 1  # broken.jpg fails
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "shard-r0-000000.parquet"]  # no manifest

    rows = {Path(r["path"]).name: r for r in parquet_rows(out)}
    assert len(rows) == 6
    assert rows["broken.jpg"]["status"] == "error" and "broken.jpg" in rows["broken.jpg"]["error"]
    assert rows["broken.jpg"]["embedding"] is None and rows["broken.jpg"]["grid_thw"] is None
    schema = pq.read_schema(out / "shard-r0-000000.parquet")
    assert schema.names == ["path", "realpath", "status", "error", "grid_thw", "tokens", "embedding",
                            "deepstack_0", "deepstack_1", "video"]
    assert json.loads(schema.metadata[b"qwenvl_vision"])["run"] == json.loads((out / "run.json").read_text())
    run = read_run(out)
    assert (run["file_format"], run["engine"], run["threads"]) == ("parquet", "local", torch.get_num_threads())

    with load_encoder(checkpoint3, device="cpu") as encoder:
        want_images = encoder.encode_images([str(p) for p in images])
        want_videos = encoder.encode_videos([str(p) for p in videos], fps=3.0)
    pairs = list(zip(images, want_images.embeddings, want_images.deepstack)) + \
        list(zip(videos, want_videos.embeddings, want_videos.deepstack))
    for path, embedding, levels in pairs:
        row = rows[path.name]
        assert row["status"] == "ok" and row["tokens"] == embedding.shape[0]
        assert torch.equal(torch.tensor(row["embedding"]), embedding)  # plain pyarrow: float32 lists
        for level, want in enumerate(levels):
            assert torch.equal(torch.tensor(row[f"deepstack_{level}"]), want)
    for path, info in zip(videos, want_videos.video_info):
        assert rows[path.name]["video"]["frames"] == info.frame_indices
    assert all(rows[p.name]["video"] is None for p in images)

    got, same = dict(read_embeddings(out, deepstack=True)), dict(read_embeddings(twin, deepstack=True))
    assert got.keys() == same.keys() and len(got) == 5
    for path, (embedding, levels) in got.items():
        assert torch.equal(embedding, same[path][0]) and len(levels) == len(same[path][1]) == 2
        assert all(torch.equal(a, b) for a, b in zip(levels, same[path][1]))
    assert {k: v for k, v in read_run(out).items() if k not in ("run_id", "created", "file_format")} == \
        {k: v for k, v in read_run(twin).items() if k not in ("run_id", "created", "file_format")}


def test_bf16_is_stored_as_exact_float32_and_pooled_reads_as_safetensors_does(tmp_path, checkpoint3):
    paths = make_image_folder(tmp_path / "imgs", 3, bad=False)
    out, pooled, twin = tmp_path / "bf16", tmp_path / "pooled", tmp_path / "pooled-st"
    runs = {out: ["parquet"], pooled: ["parquet", "--pooled-only"], twin: ["safetensors", "--pooled-only"]}
    for folder, extra in runs.items():
        assert run_embed(paths, checkpoint3, folder, "--dtype", "bf16", "--quiet", "--format", *extra) == 0
    assert read_run(out)["dtype"] == "bfloat16"
    assert pq.read_schema(next(out.glob("*.parquet"))).field("embedding").type.value_type.value_type == "float"
    with load_encoder(checkpoint3, device="cpu", dtype="bf16") as encoder:
        want = encoder.encode_images([str(p) for p in paths])
        want_pooled = encoder.encode_images([str(p) for p in paths], pooled=True)
    got = dict(read_embeddings(out))
    for path, embedding in zip(paths, want.embeddings):
        assert got[str(path)].dtype == torch.bfloat16 and torch.equal(got[str(path)], embedding)
    vectors, same = dict(read_embeddings(pooled)), dict(read_embeddings(twin))
    assert vectors.keys() == same.keys()
    for path, vector in zip(paths, want_pooled.pooled):
        assert vectors[str(path)].dtype == same[str(path)].dtype == torch.float32
        assert torch.equal(vectors[str(path)], vector.float()) and torch.equal(same[str(path)], vector.float())
    assert "embedding" not in parquet_rows(pooled)[0]


def test_normalize_stores_unit_vectors_in_every_format_and_needs_pooled_only(tmp_path, checkpoint3, capsys):
    paths = make_image_folder(tmp_path / "imgs", 3, bad=False)
    outs = {fmt: tmp_path / fmt for fmt in ("parquet", "safetensors")}
    for fmt, out in outs.items():
        assert run_embed(paths, checkpoint3, out, "--quiet", "--pooled-only", "--normalize", "--format", fmt) == 0
        assert read_run(out)["normalize"] is True
    with load_encoder(checkpoint3, device="cpu") as encoder:
        raw = encoder.encode_images([str(p) for p in paths], pooled=True).pooled
        want = encoder.encode_images([str(p) for p in paths], pooled=True, normalize=True).pooled
    assert torch.allclose(want, torch.nn.functional.normalize(raw.double(), dim=-1).float(), atol=1e-6)
    for out in outs.values():
        got = dict(read_embeddings(out))
        for path, vector in zip(paths, want):
            assert torch.equal(got[str(path)], vector)
    capsys.readouterr()
    assert run_embed(paths, checkpoint3, tmp_path / "tokens", "--normalize") == 2
    one_error_line(capsys.readouterr().err, "--normalize", "--pooled-only")
    assert not (tmp_path / "tokens").exists()


def test_resume_records_each_input_once_and_keeps_one_format(tmp_path, checkpoint, capsys):
    """A resume redoes the failed inputs only, in the folder's format. A file name that is not UTF-8 (b'caf\\xe9.jpg',
    Python's 'caf\\udce9.jpg'), which pyarrow cannot store as a string, is an error row under an escaped name, the
    rest of its batch ok, recorded once again by a resume (no traceback, nothing lost); --format safetensors embeds
    it (JSON escapes it)."""
    folder = tmp_path / "imgs"
    make_image_folder(folder, 4)  # with a corrupt, an empty and a text file named as images
    odd = os.fsdecode(os.fsencode(str(folder)) + b"/caf\xe9.jpg")
    Image.fromarray(synthetic_photo(40, 48, 7)).save(odd, format="JPEG")
    out = tmp_path / "out"
    args = ["embed", str(folder), "--model", str(checkpoint), "--out", str(out), "--quiet"]
    assert main([*args, "--format", "parquet"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    first = {r["realpath"]: r for r in parquet_rows(out) if r["status"] == "ok"}
    assert main([*args, "--resume", "--format", "safetensors"]) == 2
    one_error_line(capsys.readouterr().err, "holds a --format parquet run", "--format safetensors")
    assert run_embed([folder], checkpoint, tmp_path / "o2", "--engine", "ray", "--format", "safetensors") == 2
    one_error_line(capsys.readouterr().err, "--engine ray writes --format parquet or vllm-cache")
    assert not (tmp_path / "o2").exists()

    Image.fromarray(synthetic_photo(33, 47, 99)).save(folder / "corrupt.jpg")  # fixed: retried
    assert main([*args, "--resume"]) == 1  # takes the folder's format; empty.png and notes.png still fail
    rows = assert_each_parquet_input_once(out, 8)
    ok = {r["realpath"]: r for r in rows if r["status"] == "ok"}
    assert len(ok) == len(first) + 1 and all(ok[k]["embedding"] == r["embedding"] for k, r in first.items())
    (escaped,) = [r for r in rows if "caf" in r["path"]]
    assert escaped["path"].endswith("caf\\udce9.jpg") and "not valid UTF-8" in escaped["error"]
    assert sorted(p.name for p in out.glob("*.parquet")) == ["shard-r0-000000.parquet", "shard-r0-000001.parquet"]
    assert run_embed([folder], checkpoint, tmp_path / "st", "--quiet") == 1
    assert odd in dict(read_embeddings(tmp_path / "st"))


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_parquet(tmp_path, checkpoint):
    make_image_folder(tmp_path / "imgs", 40, bad=False)
    out = tmp_path / "out"
    cmd = embed_cmd([tmp_path / "imgs"], checkpoint, out, "--batch-patches", "1", "--device", "cpu", "--format",
                    "parquet", "--quiet")
    kill_when(cmd, lambda: len(list(out.glob("shard-*.parquet"))) >= 5)
    assert 5 <= len(parquet_rows(out)) < 40
    assert main(cmd[3:] + ["--resume"]) == 0
    assert all(r["status"] == "ok" for r in assert_each_parquet_input_once(out, 40))


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_parquet_shards_each_input_once(tmp_path, checkpoint):
    make_image_folder(tmp_path / "imgs", 7)
    out = tmp_path / "out"
    done = subprocess.run(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, out, "--format", "parquet"), env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = assert_each_parquet_input_once(out, 10)  # 7 images and 3 bad files
    assert sum(r["status"] == "ok" for r in rows) == 7
    assert {p.name.split("-")[1] for p in out.glob("shard-*.parquet")} == {"r0", "r1"}
    assert not list(out.glob("manifest*.jsonl"))
    assert read_run(out)["world_size"] == 2


def test_recover_reads_only_then_rewrites_and_a_resume_removes_what_a_kill_left(tmp_path, checkpoint, monkeypatch):
    """Under torchrun every rank reads every rank's shards: ``recover`` changes nothing in the folder (another
    rank may be reading it), ``finish_recovery`` (after the barrier) drops this rank's error rows. A temporary shard
    and a run.json being rewritten, as a kill leaves them, are removed by a resume; shards of only ok rows are read
    by their footer and realpath / status columns, never whole."""
    from qwenvl_vision.embed import parquet_writer
    from qwenvl_vision.embed.manifest import parquet_shards
    from qwenvl_vision.embed.parquet_writer import ParquetRankWriter
    from qwenvl_vision.outputs.parquet import ParquetLayout

    make_image_folder(tmp_path / "imgs", 2)  # 2 images and 3 bad files
    out = tmp_path / "out"
    args = ["--quiet", "--format", "parquet", "--batch-patches", "1"]
    assert run_embed([tmp_path / "imgs"], checkpoint, out, *args) == 1
    run = read_run(out)
    layout = ParquetLayout(**json.loads(pq.read_schema(parquet_shards(out)[0]).metadata[b"qwenvl_vision"])["layout"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    writer = ParquetRankWriter(out, 0, run, layout)
    listed = gather_inputs([str(tmp_path / "imgs")]).keys.values()  # the invocation's inputs, failed ones retried
    writer.recover({file_of(key): key for key in listed})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(writer.done) == 2 and writer.to_rewrite
    writer.finish_recovery()
    assert [r["status"] for r in parquet_rows(out)] == ["ok", "ok"]

    (out / ".shard-r0-000009.parquet.0123abcd.tmp").write_bytes(b"half a shard")
    (out / f"run.json.{run['run_id']}.tmp").write_text("{")
    monkeypatch.setattr(parquet_writer, "read_parquet_table", lambda path: pytest.fail(f"{path} read whole"))
    assert run_embed([tmp_path / "imgs"], checkpoint, out, *args, "--resume") == 1  # the 3 bad files again
    assert_each_parquet_input_once(out, 5)


def test_parquet_output_without_pyarrow_is_one_line_naming_the_extra(tmp_path, checkpoint, monkeypatch, capsys):
    import sys

    for name in ("pyarrow", "pyarrow.parquet", "qwenvl_vision.outputs.parquet"):  # as on an install without it
        monkeypatch.setitem(sys.modules, name, None)
    make_image_folder(tmp_path / "imgs", 1, bad=False)
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / "out"),
                 "--format", "parquet", "--quiet"]) == 2
    one_error_line(capsys.readouterr().err, "--format parquet", "qwenvl-vision[parquet]")
