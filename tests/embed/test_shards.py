"""WebDataset shards as inputs (qwenvl_vision.embed.shards): members read from the tar, never extracted, bitwise the
tensors of the same files from a folder; brace patterns; the sample's key and text members carried; members that
leave the shard refused; kill-and-resume records each member once; torchrun splits by shard."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from qwenvl_vision.cli import main
from qwenvl_vision.embed import MANIFEST, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.embed.inputs import gather_inputs
from qwenvl_vision.embed.manifest import parquet_shards
from qwenvl_vision.embed.shards import ItemOpener
from qwenvl_vision.outputs.parquet_reader import read_parquet_records
from tests.helpers import ENV, make_image_folder, write_video
from tests.helpers.embed import embed_cmd, kill_at_instants, local_ray, run_embed, torchrun_embed_cmd  # noqa: F401

SMALL = ["--max-pixels", str(64 * 64), "--quiet"]


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, files: list[Path], start: int, extra: dict[str, bytes] | None = None) -> list[str]:
    """A webdataset shard: sample i is {key}.{ext} with {key}.txt and {key}.json beside it; its member names."""
    names = []
    with tarfile.open(path, "w") as tar:
        for i, f in enumerate(files):
            key = f"{start + i:06d}"
            add(tar, f"{key}{f.suffix}", f.read_bytes())
            add(tar, f"{key}.txt", f"caption of {f.name}".encode())
            add(tar, f"{key}.json", json.dumps({"source": f.name}).encode())
            names.append(f"{key}{f.suffix}")
        for name, data in (extra or {}).items():
            add(tar, name, data)
    return names


@pytest.fixture(scope="module")
def collection(tmp_path_factory, checkpoint):
    """8 images in a folder and the same in two shards, and the folder's tensors by file name."""
    root = tmp_path_factory.mktemp("shards")
    paths = sorted(make_image_folder(root / "imgs", 8, bad=False), key=lambda p: p.name)
    names = [name for i in (0, 1) for name in write_shard(root / f"shards-00000{i}.tar", paths[4 * i:4 * i + 4], 4 * i)]
    assert run_embed([root / "imgs"], checkpoint, root / "from-folder", *SMALL) == 0
    return root, paths, names, {Path(p).name: t for p, t in read_embeddings(root / "from-folder")}


def test_brace_patterns_expand_as_webdataset_s(tmp_path):
    def expanded(pattern: str) -> list[str]:  # each name a missing shard: one failed input of its own
        return [os.path.relpath(p, tmp_path) for p in gather_inputs([str(tmp_path / pattern)]).paths]

    assert expanded("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expanded("{a,b}/x-{8..10}.tar") == ["a/x-8.tar", "a/x-9.tar", "a/x-10.tar", "b/x-8.tar", "b/x-9.tar",
                                              "b/x-10.tar"]
    assert expanded("plain.tar") == ["plain.tar"]
    assert expanded("s-{0..4..2}.tar") == ["s-0.tar", "s-2.tar", "s-4.tar"]  # bash's steps, as webdataset reads them


def test_shards_embed_bitwise_as_the_folder_with_the_sample_key_and_texts(collection, checkpoint):
    root, paths, names, want = collection
    out = root / "from-shards"
    pattern = str(root / "shards-{000000..000001}.tar")
    assert run_embed([pattern], checkpoint, out, "--keep-columns", "txt,json", *SMALL) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    shard_of = [f"shards-00000{i // 4}.tar" for i in range(8)]
    assert [r["path"] for r in records] == [str(root / s / n) for s, n in zip(shard_of, names, strict=True)]
    assert [r["columns"]["__key__"] for r in records] == [f"{i:06d}" for i in range(8)]
    assert [r["columns"]["txt"] for r in records] == [f"caption of {p.name}" for p in paths]
    assert [json.loads(r["columns"]["json"])["source"] for r in records] == [p.name for p in paths]
    got = dict(read_embeddings(out))
    for r, p in zip(records, paths, strict=True):
        assert torch.equal(got[r["path"]], want[p.name])
    assert not any(f.suffix in (".jpg", ".png") for f in out.rglob("*")) and sorted(os.listdir(root)) == sorted(
        ["imgs", "from-folder", "from-shards", "shards-000000.tar", "shards-000001.tar"])  # nothing extracted


def test_a_video_member_and_bad_members_are_inputs_of_their_own(collection, checkpoint, tmp_path):
    pytest.importorskip("av")
    root, paths, _, want = collection
    clip = tmp_path / "clip.mp4"
    write_video(clip, 9, 48, 40, 4)
    shard = tmp_path / "mixed.tar"
    write_shard(shard, [paths[0]], 0, {"000001.mp4": clip.read_bytes(), "000002.jpg": b"not a jpeg",
                                       "../escape.jpg": paths[1].read_bytes(), "000003.cls": b"7"})
    out = tmp_path / "out"
    beside = tmp_path / "escape.jpg"  # the file "../escape.jpg" would name if it were resolved: its own input
    beside.write_bytes(paths[2].read_bytes())
    assert run_embed([shard, clip, beside], checkpoint, out, *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
    assert by_path[f"{shard}/000000{paths[0].suffix}"]["status"] == "ok"
    assert "not a recognised image" in by_path[f"{shard}/000002.jpg"]["error"]
    assert "leaves the shard" in by_path[f"{shard}/../escape.jpg"]["error"]
    got = dict(read_embeddings(out))
    assert torch.equal(got[f"{shard}/000001.mp4"], got[str(clip)])  # a video member: bitwise its file
    assert torch.equal(got[f"{shard}/000000{paths[0].suffix}"], want[paths[0].name])
    assert by_path[str(beside)]["status"] == "ok" and torch.equal(got[str(beside)], want[paths[2].name])


def test_members_are_as_tar_defines_them_and_a_bad_member_or_shard_is_a_failed_input(collection, checkpoint,
                                                                                       tmp_path):
    """``tar -C dir .`` names its members ./x: inside the shard, read like any member. The last member of a name is
    the one (tar -r appends a newer one: --resume embeds it, and reads back the newer one); a hard link (tar cf's
    second name of one file) reads its target's bytes, as tarfile.extractfile does. A symbolic link member, a sparse
    member (GNU tar -S stores its data without its holes: no run of the shard's bytes is the file), a shard that is
    not a tar and a missing one are failed inputs, never the bytes of what follows them."""
    root, paths, _, want = collection
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(paths[0].read_bytes())
    with open(folder / "b.jpg", "wb") as f:  # a real image, then a hole, then one byte: GNU tar -S stores it sparse
        f.write(paths[1].read_bytes())
        f.seek(1 << 20, os.SEEK_CUR)
        f.write(b"\xd9")
    (folder / "c.jpg").write_bytes(paths[2].read_bytes())
    dots, links, broken = tmp_path / "dots.tar", tmp_path / "links.tar", tmp_path / "broken.tar"
    subprocess.run(["tar", "-S", "--sort=name", "-cf", str(dots), "-C", str(folder), "."], check=True)
    with tarfile.open(dots) as tar:
        assert [(m.name, m.issparse()) for m in tar.getmembers() if m.isreg()] == [
            ("./a.jpg", False), ("./b.jpg", True), ("./c.jpg", False)]
    os.link(folder / "a.jpg", folder / "h.jpg")
    (folder / "s.jpg").symlink_to("a.jpg")
    subprocess.run(["tar", "cf", str(links), "-C", str(folder), "a.jpg", "h.jpg", "s.jpg"], check=True)
    broken.write_bytes(b"no tar here" * 100)
    inputs, out = [dots, links, broken, tmp_path / "absent.tar"], tmp_path / "out"
    assert run_embed(inputs, checkpoint, out, *SMALL) == 1
    (folder / "a.jpg").unlink()
    (folder / "a.jpg").write_bytes(paths[3].read_bytes())
    subprocess.run(["tar", "rf", str(links), "-C", str(folder), "a.jpg"], check=True)
    with tarfile.open(links) as tar:
        assert [m.type for m in tar.getmembers()] == [tarfile.REGTYPE, tarfile.LNKTYPE, tarfile.SYMTYPE,
                                                      tarfile.REGTYPE]
        assert tar.extractfile("a.jpg").read() == paths[3].read_bytes()
        assert tar.extractfile("h.jpg").read() == paths[0].read_bytes()
    assert gather_inputs([str(links)]).paths == [f"{links}/{n}" for n in ("a.jpg", "h.jpg", "s.jpg")]  # once each
    assert run_embed(inputs, checkpoint, out, "--resume", *SMALL) == 1
    errors = {Path(r["path"]).name: r["error"] for r in read_manifest_lines(out / MANIFEST) if r["status"] == "error"}
    assert "sparse member" in errors["b.jpg"] and "symbolic link" in errors["s.jpg"]
    assert "cannot be read as a tar" in errors["broken.tar"] and "file not found" in errors["absent.tar"]
    got = dict(read_embeddings(out))
    assert torch.equal(got[f"{dots}/./a.jpg"], want[paths[0].name])
    assert torch.equal(got[f"{dots}/./c.jpg"], want[paths[2].name])
    assert torch.equal(got[f"{links}/a.jpg"], want[paths[3].name])  # appended since it was recorded: embedded again
    assert torch.equal(got[f"{links}/h.jpg"], want[paths[0].name])


DAMAGES = {  # shard bytes -> (the members still inputs, the member cut short or None, why)
    "truncated header": (lambda d: d[:3584 + 100], ["0.jpg"], None, "truncated header"),
    "truncated data": (lambda d: d[:4096 + 1000], ["0.jpg"], "1.jpg", "unexpected end of data"),
    "garbage in the middle": (lambda d: d[:3584] + b"garbage!" * 64 + d[4096:], ["0.jpg"], None, "header"),
    "zeros in the middle": (lambda d: d[:3584] + bytes(512) + d[4096:], ["0.jpg"], None, "zero block"),
    "no end of archive": (lambda d: d[:10752], ["0.jpg", "1.jpg", "2.jpg"], None, "cut short"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_shard_is_a_failed_input_wherever_it_is_damaged(damage, tmp_path):
    cut, kept, short, why = DAMAGES[damage]
    whole = tmp_path / "whole.tar"
    with tarfile.open(whole, "w") as tar:  # members of 3000 bytes: headers at 0, 3584 and 7168, the end at 10752
        for i in range(3):
            add(tar, f"{i}.jpg", bytes([i]) * 3000)
    assert gather_inputs([str(whole)]).errors == {}
    shard = tmp_path / "damaged.tar"
    shard.write_bytes(cut(whole.read_bytes()))
    found = gather_inputs([str(shard)])
    assert "damaged" in found.errors[str(shard)] and why in found.errors[str(shard)]
    assert [p for p in found.paths if p not in found.errors] == [f"{shard}/{n}" for n in kept]
    members = {p: e for p, e in found.errors.items() if p != str(shard)}  # the member cut short, where one is
    assert sorted(members) == ([f"{shard}/{short}"] if short else [])
    assert all("cut short" in e for e in members.values())


def test_a_malformed_pax_field_is_damage_too(tmp_path):
    """tarfile raises ValueError, no TarError, for a GNU sparse map that is not numbers: in the first header the
    shard is no tar, after it the shard is damaged there."""
    for bad in (0, 1):
        shard = tmp_path / f"pax-{bad}.tar"
        with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
            for i in range(2):
                info = tarfile.TarInfo(f"{i}.jpg")
                info.size, info.pax_headers = 3000, {"GNU.sparse.map": "x,y"} if i == bad else {}
                tar.addfile(info, io.BytesIO(bytes(3000)))
        found = gather_inputs([str(shard)])
        assert ("damaged" if bad else "cannot be read as a tar") in found.errors[str(shard)]
        assert [p for p in found.paths if p not in found.errors] == [f"{shard}/0.jpg"][:bad]


def test_a_member_is_read_when_decoded_within_the_decode_budget(collection, checkpoint, tmp_path):
    """A member's bytes are the decode budget's, as an object's in storage are: one larger is refused unread."""
    root, paths, _, _ = collection
    noise = io.BytesIO()
    Image.frombytes("RGB", (1024, 768), os.urandom(1024 * 768 * 3)).save(noise, "PNG")
    assert noise.tell() > 1 << 20
    shard, out = tmp_path / "big.tar", tmp_path / "out"
    with tarfile.open(shard, "w") as tar:
        add(tar, "0.png", noise.getvalue())
        add(tar, "1.jpg", paths[0].read_bytes())
    assert run_embed([shard], checkpoint, out, "--decode-mib", "1", *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / MANIFEST)}
    assert "decode budget" in by_path[f"{shard}/0.png"]["error"] and by_path[f"{shard}/1.jpg"]["status"] == "ok"


def test_an_actor_holds_the_index_of_one_shard_at_a_time(collection, tmp_path):
    """An actor's members of one shard come together: a shard met again is listed again, as it is now."""
    _, paths, _, _ = collection
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    write_shard(a, paths[:2], 0)
    write_shard(b, paths[2:3], 0)
    opener = ItemOpener()
    assert opener(f"{a}/000001{paths[1].suffix}").read() == paths[1].read_bytes()
    assert opener(f"{b}/000000{paths[2].suffix}").read() == paths[2].read_bytes()
    write_shard(a, paths[1:2], 1)  # the member 000001 now first, at another offset
    assert opener(f"{a}/000001{paths[1].suffix}").read() == paths[1].read_bytes()


@pytest.mark.slow  # SIGKILLs at several instants
def test_kill_and_resume_over_shards_records_each_member_once(collection, checkpoint, tmp_path):
    root, paths, names, want = collection
    out = tmp_path / "killed"
    threads = str(read_run(root / "from-folder")["threads"])  # CPU bits are the same at the same thread count
    cmd = embed_cmd([root / "shards-{000000..000001}.tar"], checkpoint, out, "--batch-patches", "32", "--threads",
                    threads, *SMALL)
    kill_at_instants(cmd, out)
    assert main([*cmd[3:], "--resume"]) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    assert sorted(r["path"] for r in records) == sorted(str(root / f"shards-00000{i // 4}.tar" / n)
                                                        for i, n in enumerate(names))
    got = dict(read_embeddings(out))
    for r in records:
        source = paths[names.index(Path(r["path"]).name)]
        assert torch.equal(got[r["path"]], want[source.name])


def test_torchrun_ranks_take_whole_shards(collection, checkpoint, tmp_path):
    root, _, names, _ = collection
    out = tmp_path / "ranks"
    result = subprocess.run(torchrun_embed_cmd([root / "shards-000000.tar", root / "shards-000001.tar"], checkpoint,
                                               out, *SMALL), env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_manifest_lines(out / "manifest.jsonl")
    assert len(records) == len(names)
    assert {Path(r["path"]).parent.name: r["rank"] for r in records} == {"shards-000000.tar": 0,
                                                                         "shards-000001.tar": 1}


@pytest.mark.slow  # a local Ray instance
def test_ray_engine_reads_shard_members_bitwise(collection, checkpoint, local_ray):  # noqa: F811 - the fixture
    root, paths, names, want = collection
    out = root / "ray"
    threads = str(read_run(root / "from-folder")["threads"])  # CPU bits are the same at the same thread count
    assert run_embed([root / "shards-{000000..000001}.tar"], checkpoint, out, "--engine", "ray", "--ray-actors", "1",
                     "--threads", threads, "--keep-columns", "txt", *SMALL) == 0
    records = list(read_parquet_records(parquet_shards(out)))
    assert len(records) == len(names)
    for r in records:
        source = paths[names.index(Path(r.path).name)]
        assert torch.equal(r.embedding, want[source.name]) and r.columns["txt"] == f"caption of {source.name}"

    # Members found as the local engine finds them: a ./ name as written, a name held twice by its last member, a
    # hard link by its target's bytes.
    odd = root / "odd"
    odd.mkdir(exist_ok=True)
    with tarfile.open(odd / "dots.tar", "w") as tar:
        add(tar, "./a.jpg", paths[0].read_bytes())
    with tarfile.open(odd / "dup.tar", "w") as tar:
        add(tar, "x.jpg", paths[1].read_bytes())
        link = tarfile.TarInfo("y.jpg")
        link.type, link.linkname = tarfile.LNKTYPE, "x.jpg"
        tar.addfile(link)
        add(tar, "x.jpg", paths[2].read_bytes())
    for engine in ("local", "ray"):
        argv = ["embed", "dots.tar", "dup.tar", "--model", str(checkpoint), "--out", f"out-{engine}", "--format",
                "parquet", "--threads", threads, *SMALL]
        cwd = os.getcwd()
        os.chdir(odd)  # relative paths: the actors get them joined to this folder, never normalised
        try:
            assert main([*argv, *(["--engine", "ray", "--ray-actors", "1"] if engine == "ray" else [])]) == 0
        finally:
            os.chdir(cwd)
        got = {r.path: r.embedding for r in read_parquet_records(parquet_shards(odd / f"out-{engine}"))}
        assert torch.equal(got["dots.tar/./a.jpg"], want[paths[0].name])
        assert torch.equal(got["dup.tar/x.jpg"], want[paths[2].name])
        assert torch.equal(got["dup.tar/y.jpg"], want[paths[1].name])
