"""What an embed output keeps on disk through damage and foreign files: a truncated, torn or corrupted manifest is
rebuilt from the records each shard (or encoder-cache item) carries, even for inputs a resume does not list, and
nothing is deleted; a link planted where the run writes its own files is refused, named, and its target untouched;
a run's recorded CPU plan; an existing encoder-cache item counts only if it is the item it must be."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.loading import load_encoder
from tests.helpers import make_image_folder
from tests.helpers.embed import one_error_line

SMALL = ["--max-pixels", str(64 * 64), "--batch-patches", "1"]  # one input a batch: one shard each
FIXED_RUN = "0123456789abcdef0123456789abcdef"


def embed(inputs, checkpoint, out, *extra) -> int:
    return main(["embed", *map(str, inputs), "--model", str(checkpoint), "--out", str(out), "--quiet", *SMALL,
                 *extra])


def files_of(out: Path) -> dict[str, bytes]:
    """Every stored tensor file of an output, by its name in the folder, with its bytes."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*.safetensors")}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    return make_image_folder(tmp_path_factory.mktemp("imgs"), 5, bad=False)


DAMAGE = {  # what each kind of damage leaves of a manifest's bytes, given them and their lines
    "truncated": lambda data, lines: data[: len(lines[0]) + len(lines[1]) // 2],  # cut inside the second line
    "torn": lambda data, lines: lines[0][:10] + b"\n" + b"".join(lines[1:]),  # the first line cut short
    "corrupted": lambda data, lines: b"".join(lines[:-1]) + b"\x00\xff" * 20 + b"\n",  # a bad disk's bytes
    "emptied": lambda data, lines: b"",
}


@pytest.mark.parametrize("file_format", ["safetensors", "vllm-cache"])
@pytest.mark.parametrize("how", ["truncated", "corrupted", pytest.param("torn", marks=pytest.mark.slow),
                                 pytest.param("emptied", marks=pytest.mark.slow)])
def test_a_damaged_manifest_then_a_resume_with_other_inputs_keeps_every_input(tmp_path, checkpoint, images, how,
                                                                              file_format):
    out = tmp_path / "out"
    first, second = images[:3], images[3:]
    assert embed(first, checkpoint, out, "--format", file_format) == 0
    stored = dict(read_embeddings(out))
    assert len(stored) == 3
    kept = files_of(out)
    data = (out / "manifest.jsonl").read_bytes()
    (out / "manifest.jsonl").write_bytes(DAMAGE[how](data, data.splitlines(keepends=True)))
    assert embed(second, checkpoint, out, "--resume") == 0
    now = dict(read_embeddings(out))
    assert set(now) == {str(p) for p in images}  # both runs' inputs, each once
    for path, tensor in stored.items():
        assert torch.equal(now[path], tensor), path
    recs = read_manifest_lines(out / "manifest.jsonl")
    assert len(recs) == len({r["realpath"] for r in recs}) == 5
    after = files_of(out)
    assert {name: after.get(name) for name in kept} == kept  # no file deleted or changed
    assert not list(out.rglob("*.tmp"))


def test_a_shard_renamed_but_never_recorded_is_rolled_forward_not_deleted(tmp_path, checkpoint, images):
    """The manifest's last lines lost, as a kill between a shard's rename and its append leaves it."""
    out = tmp_path / "out"
    assert embed(images[:2], checkpoint, out) == 0
    stored = dict(read_embeddings(out))
    manifest = out / "manifest.jsonl"
    manifest.write_bytes(manifest.read_bytes().splitlines(keepends=True)[0])
    assert embed(images[:1], checkpoint, out, "--resume") == 0
    assert {p: torch.equal(t, stored[p]) for p, t in read_embeddings(out)} == {p: True for p in stored}
    assert {r["shard"] for r in read_manifest_lines(manifest)} == {p.name for p in out.glob("*.safetensors")}


def test_a_recorded_shard_that_cannot_be_read_stops_the_resume_and_once_moved_out_its_input_is_redone(
        tmp_path, checkpoint, images, capsys):
    out = tmp_path / "out"
    assert embed(images[:2], checkpoint, out) == 0
    stored = {path: tensor.clone() for path, tensor in read_embeddings(out)}  # not a view of the file cut below
    shards = [r["shard"] for r in read_manifest_lines(out / "manifest.jsonl")]
    assert len(set(shards)) == 2  # the one moved out below leaves another's in place, whose name is not reused
    damaged = out / shards[0]
    damaged.write_bytes(damaged.read_bytes()[:100])  # a bad disk's, or a copy cut short
    capsys.readouterr()
    assert embed(images[:2], checkpoint, out, "--resume") == 2
    one_error_line(capsys.readouterr().err, damaged.name, "move it out")
    damaged.rename(tmp_path / damaged.name)
    assert embed(images[:2], checkpoint, out, "--resume") == 0
    assert {p: torch.equal(t, stored[p]) for p, t in read_embeddings(out)} == {p: True for p in stored}


def test_a_recorded_cache_item_that_cannot_be_read_is_written_again_by_a_resume(tmp_path, checkpoint, images):
    out = tmp_path / "out"
    assert embed(images[:2], checkpoint, out, "--format", "vllm-cache") == 0
    stored = {path: tensor.clone() for path, tensor in read_embeddings(out)}
    damaged = out / read_manifest_lines(out / "manifest.jsonl")[0]["shard"]
    damaged.write_bytes(damaged.read_bytes()[:100])
    assert embed(images[:2], checkpoint, out, "--resume") == 0
    assert {p: torch.equal(t, stored[p]) for p, t in read_embeddings(out)} == {p: True for p in stored}


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_a_resume_of_fewer_inputs_keeps_the_others_failures_and_retries_its_own(tmp_path, checkpoint, images,
                                                                                file_format):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("a.png", "b.png"):  # two inputs that fail: not images
        (folder / name).write_text("not an image")
    out = tmp_path / "out"
    assert embed([folder / "a.png", folder / "b.png", images[0]], checkpoint, out, "--format", file_format) == 1
    shutil.copy(images[1], folder / "a.png")  # fixed: the resume that lists it embeds it
    assert embed([folder / "a.png"], checkpoint, out, "--format", file_format, "--resume") == 0
    if file_format == "parquet":
        from qwenvl_vision.embed.parquet_writer import statuses

        recorded = statuses(out)
    else:
        recorded = [(r["realpath"], r["status"]) for r in read_manifest_lines(out / "manifest.jsonl")]
    assert sorted((Path(key).name.split("#")[0], status) for key, status in recorded) == [
        ("a.png", "ok"), ("b.png", "error"), (images[0].name, "ok")]  # each once, b's failure kept


# ---------------------------------------------------------------------- links where the run writes


@pytest.fixture
def fixed_run_id(monkeypatch):
    """A fresh run's id known in advance, so that a test can plant a link at its temporary file names."""
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(FIXED_RUN))
    return FIXED_RUN


def plant(link: Path, victim: Path) -> None:
    victim.write_bytes(b"somebody else's data\n")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)


@pytest.mark.parametrize("where", ["embed.lock", "shard temp", "run.json temp", "cache item temp"])
def test_a_link_planted_where_the_run_writes_is_refused_and_its_target_untouched(tmp_path, checkpoint, images,
                                                                                   fixed_run_id, where, capsys):
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    extra = []
    name = {"embed.lock": "embed.lock", "shard temp": f"shard-r0-000000.{fixed_run_id}.tmp",
            "run.json temp": f"run.json.{fixed_run_id}.tmp"}.get(where)
    if where == "cache item temp":  # at the item's own name: its id, as the API names it
        encoder = load_encoder(checkpoint, device="cpu")
        (item,) = encoder.encode_images([str(images[0])], max_pixels=64 * 64).to_vllm_cache(tmp_path / "api")
        name = f"{item['id']}/encoder_cache.safetensors.{fixed_run_id}-r0.tmp"
        extra = ["--format", "vllm-cache"]
    plant(out / name, victim)
    capsys.readouterr()
    assert embed(images[:1], checkpoint, out, *extra) == 3
    one_error_line(capsys.readouterr().err, name.rsplit("/", 1)[-1], "symbolic link")
    assert victim.read_bytes() == b"somebody else's data\n" and (out / name).is_symlink()


def test_a_dangling_link_at_the_manifest_is_not_written_through(tmp_path, checkpoint, images, capsys):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere.jsonl"
    (out / "manifest.jsonl").symlink_to(target)
    capsys.readouterr()
    assert embed(images[:1], checkpoint, out) == 3
    one_error_line(capsys.readouterr().err, "manifest.jsonl", "symbolic link")
    assert not target.exists() and (out / "manifest.jsonl").is_symlink()


# ---------------------------------------------------------------------- run.json's CPU plan


@pytest.fixture(scope="module")
def finished(tmp_path_factory, checkpoint, images) -> Path:
    out = tmp_path_factory.mktemp("finished") / "out"
    assert embed(images[:1], checkpoint, out) == 0
    return out


def test_a_run_with_an_older_format_of_cpu_plan_reads_but_does_not_resume(tmp_path, checkpoint, images, finished,
                                                                           capsys):
    """This version runs only its own plan format: a run whose run.json holds an older one still reads (its
    embeddings are what they are), and a resume is refused with one line naming the format, writing nothing."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    run = json.loads((out / "run.json").read_text())
    run["cpu_plan"] = {"format": 2, "machine": "old", "linear": {}}
    (out / "run.json").write_text(json.dumps(run))
    assert read_run(out)["cpu_plan"]["format"] == 2
    expected, got = list(read_embeddings(finished)), list(read_embeddings(out))
    assert got and [path for path, _ in got] == [path for path, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
    before = sorted(os.listdir(out))
    capsys.readouterr()
    assert embed(images[1:2], checkpoint, out, "--resume") == 2
    one_error_line(capsys.readouterr().err, "run.json", "CPU plan format 2")
    assert sorted(os.listdir(out)) == before


def test_a_run_started_off_the_cpu_records_the_plan_of_its_first_cpu_resume(tmp_path, checkpoint, images, finished):
    """A run started on a GPU has no CPU plan (null): its first resume on a CPU records the plan it ran with, so
    every later resume, rank and actor runs the same kernels; nothing else of run.json changes."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "cpu_plan": None}))
    assert embed(images[1:2], checkpoint, out, "--resume") == 0
    resumed = read_run(out)
    assert resumed["cpu_plan"] == run["cpu_plan"] and resumed["cpu_plan"] is not None
    assert {k: v for k, v in resumed.items() if k != "cpu_plan"} == {k: v for k, v in run.items() if k != "cpu_plan"}


# ---------------------------------------------------------------------- encoder-cache items already in place


def test_an_unreadable_item_in_place_is_rewritten_by_the_run(tmp_path, checkpoint, images):
    """A file at an item's name that safetensors cannot read (a crashed writer's) is replaced by the item."""
    out = tmp_path / "cache"
    encoder = load_encoder(checkpoint, device="cpu")
    (entry,) = encoder.encode_images([str(images[0])], max_pixels=64 * 64).to_vllm_cache(out)
    path = out / entry["id"] / "encoder_cache.safetensors"
    expected = load_file(path)["ec_cache"].clone()  # not a view of the file the test overwrites
    path.write_bytes(b"\x08" + b"\x00" * 7 + b"not a header at all")
    assert embed(images[:1], checkpoint, out, "--format", "vllm-cache") == 0
    (record,) = read_manifest_lines(out / "manifest.jsonl")
    stored = load_file(out / record["shard"])
    assert list(stored) == ["ec_cache"] and torch.allclose(stored["ec_cache"], expected, rtol=1e-5, atol=1e-6)
    assert not list(out.rglob("*.tmp"))


@pytest.mark.parametrize("carriers", [(1,), (1, 0)], ids=["one rank", "both ranks"])
def test_an_input_whose_lines_were_lost_is_rolled_forward_by_one_rank_only(tmp_path, carriers):
    """Two ranks; the lines of an input that rank 1's shard carries (or both ranks' shards: the input list changed
    between two stopped runs) were lost (a kill between a shard's rename and its line, or damage). Whichever rank
    recovers first, the lowest rank carrying it rolls it forward from its shard and the other counts it done: it is
    recorded once, never embedded twice."""
    from qwenvl_vision.embed.manifest import part_name
    from qwenvl_vision.embed.writer import RankWriter
    from qwenvl_vision.outputs.records import EmbeddingRecord

    path, owner = str(tmp_path / "a.jpg"), min(carriers)
    for rank in carriers:
        record = EmbeddingRecord(path, path, "ok", grid_thw=(1, 4, 4), tokens=4, embedding=torch.randn(4, 8))
        RankWriter(tmp_path, rank, 2, "run1").write_records([record])
    for order in ((0, 1), (1, 0)):
        for rank in carriers:
            (tmp_path / part_name(rank, 2)).write_text("")  # its lines are lost (again: the first pass restored one)
        writers = {rank: RankWriter(tmp_path, rank, 2, "run1") for rank in order}
        for rank in order:
            writers[rank].recover({})
        for rank in order:
            writers[rank].finish_recovery()
        assert path in writers[owner].own and path not in writers[1 - owner].own and path in writers[1 - owner].done
    lines = [json.loads(line) for line in (tmp_path / part_name(owner, 2)).read_text().splitlines()]
    assert [r["path"] for r in lines] == [path] and not (tmp_path / part_name(1 - owner, 2)).read_text()


def recovered(folder: Path, listed: dict[str, str] | None = None) -> list:
    """Two ranks of run1 resumed as under torchrun: each recovers, then (past a barrier) each finishes."""
    from qwenvl_vision.embed.writer import RankWriter

    writers = [RankWriter(folder, rank, 2, "run1") for rank in (0, 1)]
    for writer in writers:
        writer.recover(listed or {})
    for writer in writers:
        writer.finish_recovery()
    return writers


@pytest.mark.parametrize("stopped", ["after the merge", "before the merge"])
def test_a_two_rank_resume_that_lists_nothing_keeps_every_record_once(tmp_path, stopped):
    """A finished run's failures stay in the merged manifest; an input both ranks' parts hold (the split changed
    between two stopped runs) is recorded once."""
    from qwenvl_vision.embed.manifest import MANIFEST
    from qwenvl_vision.embed.writer import RankWriter, merge_parts
    from qwenvl_vision.outputs.records import EmbeddingRecord

    ok = EmbeddingRecord("a.jpg", "/d/a.jpg", "ok", grid_thw=(1, 4, 4), tokens=4, embedding=torch.randn(4, 8))
    failed = EmbeddingRecord("b.jpg", "/d/b.jpg", "error", error="b.jpg: broken")
    RankWriter(tmp_path, 0, 2, "run1").write_records([ok, failed])
    if stopped == "after the merge":
        merge_parts(tmp_path, 2, "run1")
    else:
        RankWriter(tmp_path, 1, 2, "run1").write_records([ok])
    recovered(tmp_path)
    merge_parts(tmp_path, 2, "run1")
    records = sorted((r["path"], r["status"]) for r in read_manifest_lines(tmp_path / MANIFEST))
    assert records == [("a.jpg", "ok"), ("b.jpg", "error")]


def test_another_run_s_shard_copied_into_the_folder_is_neither_adopted_nor_removed(tmp_path):
    """Its records are of other settings: a manifest rebuilt from the shards takes only this run's."""
    from qwenvl_vision.embed.manifest import MANIFEST
    from qwenvl_vision.embed.writer import RankWriter
    from qwenvl_vision.outputs.records import EmbeddingRecord

    ok = EmbeddingRecord("a.jpg", "/d/a.jpg", "ok", grid_thw=(1, 4, 4), tokens=4, embedding=torch.randn(4, 8))
    RankWriter(tmp_path, 0, 1, "runA").write_records([ok])
    shards = sorted(tmp_path.glob("shard-*"))
    (tmp_path / MANIFEST).write_text("")  # as if this folder's own run had recorded nothing yet
    writer = RankWriter(tmp_path, 0, 1, "runB")
    writer.recover({})
    writer.finish_recovery()
    assert not writer.done and not read_manifest_lines(tmp_path / MANIFEST)
    assert shards and sorted(tmp_path.glob("shard-*")) == shards


def test_a_resume_stopped_before_the_merge_leaves_each_input_once_for_the_next(tmp_path):
    """Two ranks; a resume drops the record of a file replaced since (rank 0's), rank 1 records it anew, and the run
    stops before rank 0 merges the parts (a kill, a full disk): the merged manifest still holds the old record. The
    next resume, of fewer inputs, takes each rank's records from its part: the file once, as it is now."""
    from qwenvl_vision.embed.inputs import file_of
    from qwenvl_vision.embed.manifest import MANIFEST, part_name
    from qwenvl_vision.embed.writer import RankWriter, merge_parts
    from qwenvl_vision.outputs.records import EmbeddingRecord

    def record(key: str) -> EmbeddingRecord:
        return EmbeddingRecord("x.jpg", key, "ok", grid_thw=(1, 4, 4), tokens=4, embedding=torch.randn(4, 8))

    old, new = "/d/x.jpg#size=1,mtime_ns=1", "/d/x.jpg#size=2,mtime_ns=2"
    RankWriter(tmp_path, 0, 2, "run1").write_records([record(old)])
    merge_parts(tmp_path, 2, "run1")
    writers = recovered(tmp_path, {file_of(new): new})  # the split changed: rank 1 embeds it
    writers[1].write_records([record(new)])
    assert [r["realpath"] for r in read_manifest_lines(tmp_path / MANIFEST)] == [old]  # stopped before the merge
    recovered(tmp_path)
    merge_parts(tmp_path, 2, "run1")
    assert [r["realpath"] for r in read_manifest_lines(tmp_path / MANIFEST)] == [new]
    assert not (tmp_path / part_name(0, 2)).exists()


def test_a_replaced_file_that_fails_is_not_read_as_it_was_by_a_resume_that_does_not_list_it(tmp_path, checkpoint,
                                                                                               images):
    folder = tmp_path / "imgs"
    folder.mkdir()
    x = folder / "x.png"
    shutil.copy(images[0], x)
    out = tmp_path / "out"
    assert embed([x, images[1]], checkpoint, out) == 0
    x.write_text("replaced by something that is no image")
    assert embed([x, images[1]], checkpoint, out, "--resume") == 1  # its old record dropped, its failure recorded
    assert embed([images[1]], checkpoint, out, "--resume") == 0  # the old record, which its shard carries, stays out
    assert [r["status"] for r in read_manifest_lines(out / "manifest.jsonl") if r["path"] == str(x)] == ["error"]
    assert str(x) not in dict(read_embeddings(out))


def test_a_dropped_record_comes_back_as_the_newest_its_shards_carry_when_the_file_is_no_longer_listed(tmp_path):
    """A file embedded twice (replaced between), then replaced again: the resume listing it drops its record and
    stops before embedding it. A later resume that does not list it rolls forward the record of its newest shard,
    once: what it was last embedded as, not what it was first."""
    from qwenvl_vision.embed.inputs import file_of
    from qwenvl_vision.embed.writer import RankWriter
    from qwenvl_vision.outputs.records import EmbeddingRecord

    versions = [f"/d/x.jpg#size={n},mtime_ns={n}" for n in (1, 2, 3)]
    for now in versions:
        writer = RankWriter(tmp_path, 0, 1, "run1")
        if now != versions[0]:
            writer.recover({file_of(now): now})
            writer.finish_recovery()
        if now != versions[-1]:  # the last resume stops before it embeds the file
            writer.write_records([EmbeddingRecord("x.jpg", now, "ok", grid_thw=(1, 4, 4), tokens=4,
                                                  embedding=torch.randn(4, 8))])
    assert read_manifest_lines(tmp_path / "manifest.jsonl") == []
    writer = RankWriter(tmp_path, 0, 1, "run1")
    writer.recover({})
    writer.finish_recovery()
    assert [r["realpath"] for r in read_manifest_lines(tmp_path / "manifest.jsonl")] == [versions[1]]


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_a_file_recorded_ok_that_cannot_be_read_now_keeps_its_record_and_is_not_retried(tmp_path, checkpoint, images,
                                                                                        file_format):
    """Its bytes unknown (a mount gone for a moment), the file is not known to be replaced: done, as it was."""
    x = tmp_path / "x.png"
    shutil.copy(images[0], x)
    out = tmp_path / "out"
    assert embed([x, images[1]], checkpoint, out, "--format", file_format) == 0
    stored = {path: tensor.clone() for path, tensor in read_embeddings(out)}
    x.rename(tmp_path / "away.png")
    assert embed([x, images[1]], checkpoint, out, "--format", file_format, "--resume") == 0
    assert {p: torch.equal(t, stored[p]) for p, t in read_embeddings(out)} == {p: True for p in stored}


def test_a_resume_listing_a_file_that_is_not_there_records_its_failure(tmp_path, checkpoint, images):
    """Never recorded, it is no done input whose bytes are unknown for a moment: it fails, with its row."""
    out = tmp_path / "out"
    assert embed(images[:2], checkpoint, out) == 0
    gone = tmp_path / "gone.jpg"
    assert embed([*images[:2], gone], checkpoint, out, "--resume") == 1
    records = {r["path"]: r["status"] for r in read_manifest_lines(out / "manifest.jsonl")}
    assert records == {**{str(p): "ok" for p in images[:2]}, str(gone): "error"}


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_a_file_recorded_ok_that_cannot_be_read_at_the_resume_keeps_its_record(tmp_path, checkpoint, monkeypatch,
                                                                               file_format):
    """Its bytes are not known for a moment (its identity is its bare path): neither embedded again nor failed."""
    from qwenvl_vision.embed import inputs

    paths = make_image_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--format", file_format]
    assert main(args) == 0
    before = read_manifest_lines(out / "manifest.jsonl") if file_format == "safetensors" else None
    stored = [(path, tensor.clone()) for path, tensor in read_embeddings(out)]
    hidden, identity = str(paths[0].resolve()), inputs.file_identity
    monkeypatch.setattr(inputs, "file_identity", lambda path: path if path == hidden else identity(path))
    assert main([*args, "--resume"]) == 0
    if before is not None:
        assert read_manifest_lines(out / "manifest.jsonl") == before
    now = list(read_embeddings(out))  # each input once, its tensors as they were
    assert [p for p, _ in now] == [p for p, _ in stored]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(now, stored))
