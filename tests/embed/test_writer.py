"""qwenvl_vision.embed.writer: durable shards and manifest lines. A run killed at any instant (SIGKILL) or stopped
by an I/O fault (a full disk, a read-only folder: exit code 3) loses nothing recorded, and --resume finishes it
with each input once, no orphan shard and no shard name reused."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from safetensors import safe_open

import qwenvl_vision.embed.writer as writer
from qwenvl_vision.cli import main
from qwenvl_vision.embed import MANIFEST, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.embed.inputs import file_of
from qwenvl_vision.loading import load_encoder
from tests.helpers import make_image_folder as make_folder
from tests.helpers import rel_err, synthetic_photo
from tests.helpers.embed import (
    ENV,
    assert_each_input_once,
    embed_cmd,
    kill_when,
    make_media_folder,
    one_error_line,
    records,
    run_embed,
)


def test_resume_duplicates_nothing(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 5)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-patches", "64"]
    main(args)
    first = records(out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert main(args) == 2  # refusing to mix two runs without --resume
    Image.fromarray(synthetic_photo(33, 47, 99)).save(tmp_path / "imgs" / "corrupt.jpg")  # fixed: retried on resume
    assert main([*args, "--resume"]) == 1  # empty.png and notes.png still fail
    recs = records(out)
    paths = [r["path"] for r in recs]
    assert len(paths) == len(set(paths)) == len(first)
    ok_first = {r["path"]: (r["shard"], r["key"]) for r in first if r["status"] == "ok"}
    ok_now = {r["path"]: (r["shard"], r["key"]) for r in recs if r["status"] == "ok"}
    assert {p: ok_now[p] for p in ok_first} == ok_first  # nothing recomputed
    assert len(ok_now) == len(ok_first) + 1
    assert set(shards) < {p.name for p in out.glob("*.safetensors")}


def kill_then_resume(inputs: Path, model: Path, out: Path, killed_once) -> list[dict]:
    """Run embed (one input a batch) in a child, SIGKILL it once ``killed_once(manifest records)`` holds, then
    resume it to the end; the records the killed run had left."""
    cmd = embed_cmd([inputs], model, out, "--batch-patches", "1", "--device", "cpu")
    kill_when(cmd, lambda: killed_once(read_manifest_lines(out / MANIFEST)))
    killed = read_manifest_lines(out / MANIFEST)
    resumed = subprocess.run([*cmd, "--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return killed


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 60, bad=False)
    out = tmp_path / "out"
    assert 5 <= len(kill_then_resume(tmp_path / "imgs", checkpoint, out, lambda records: len(records) >= 5)) < 60
    assert all(r["status"] == "ok" for r in assert_each_input_once(out, 60))


@pytest.mark.slow
def test_sigkill_mid_run_with_videos_then_resume(tmp_path, checkpoint):
    pytest.importorskip("av")
    images, videos = make_media_folder(tmp_path / "media", 20, 12)
    out = tmp_path / "out"
    killed = kill_then_resume(tmp_path / "media", checkpoint, out, lambda rs: any("video" in r for r in rs))
    assert 1 <= len(killed) < 32
    records = assert_each_input_once(out, 32)
    assert all(r["status"] == "ok" for r in records) and sum("video" in r for r in records) == 12
    stored = dict(read_embeddings(out))
    expected = load_encoder(checkpoint, device="cpu").encode_videos([str(p) for p in videos])
    by_path = {Path(r["path"]).name: r["path"] for r in records}
    for path, emb in zip(videos, expected.embeddings):
        assert rel_err(stored[by_path[path.name]], emb) <= 1e-5


def fail_on_call(monkeypatch, name: str, n: int, error: OSError, partial: bool = False) -> None:
    """Make writer.<name> raise `error` on its n-th call (after writing half its data when `partial`)."""
    real = getattr(writer, name)
    calls = [0]

    def faulty(*args):
        calls[0] += 1
        if calls[0] == n:
            if partial and name == "save_shard":  # a shard's temporary file that ran out of space half way
                args[1].with_name(f"{args[1].stem}.{args[2]}.tmp").write_bytes(b"\x00" * 100)
            elif partial:  # a manifest append torn half way
                with open(args[0], "a") as f:
                    f.write('{"path": "half a li')
            raise error
        return real(*args)

    monkeypatch.setattr(writer, name, faulty)


FAULTS = {
    "disk full writing a shard": ("save_shard", 3, errno.ENOSPC, "No space left on device"),
    "read-only appending the manifest": ("append_lines", 2, errno.EROFS, "Read-only file system"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_output_fault_exits_3_and_a_resume_from_another_directory_finishes(fault, tmp_path, checkpoint, capsys,
                                                                            monkeypatch):
    """Records carry the resolved file: a run stopped part-way and resumed from elsewhere, with other spellings,
    finishes each input exactly once and counts every input done."""
    name, n, code, text = FAULTS[fault]
    make_folder(tmp_path / "a" / "imgs", 12)  # 12 images and 3 bad files
    (tmp_path / "b" / "c").mkdir(parents=True)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path / "a")
    with monkeypatch.context() as patch:
        fail_on_call(patch, name, n, OSError(code, os.strerror(code), str(out / "x")), partial=True)
        assert run_embed(["imgs"], checkpoint, out, "--batch-patches", "64") == 3
    one_error_line(capsys.readouterr().err, f"cannot write to {out}", text, "this process recorded", "--resume")
    recorded = records(out)  # every complete line is valid: nothing recorded is lost
    assert 0 < len(recorded) < 15
    monkeypatch.chdir(tmp_path / "b" / "c")
    assert run_embed(["../../a/imgs"], checkpoint, out, "--batch-patches", "64", "--resume") == 1  # 3 bad files
    one_error_line(capsys.readouterr().err, "embedded 12 of 15 inputs", "3 failed")
    recs = assert_each_input_once(out, 15)
    assert {r["realpath"] for r in recs if r["status"] == "ok"} >= {r["realpath"] for r in recorded
                                                                    if r["status"] == "ok"}
    images = (tmp_path / "a" / "imgs").rglob("*")
    assert {file_of(r["realpath"]) for r in recs} == {str(p.resolve()) for p in images if p.suffix in (".jpg", ".png")}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root and mount permission needed; skipped in CI containers without them)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def remount(mount_point: Path, options: str) -> None:
    result = subprocess.run(["mount", "-o", f"remount,{options}", str(mount_point)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_real_full_disk_and_read_only_folder(small_tmpfs, tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 60, bad=False)
    out = small_tmpfs / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-patches", "64"]
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\x00" * 32 * 1024)  # leaves room for a few shards only
    assert main(args) == 3
    one_error_line(capsys.readouterr().err, "No space left on device", "--resume")
    done_when_full = len(records(out))
    assert 0 < done_when_full < 60

    remount(small_tmpfs, "ro")  # read-only from the start: not even the lock file can be made
    assert main([*args, "--resume"]) == 3
    one_error_line(capsys.readouterr().err, "Read-only file system", "--resume")

    remount(small_tmpfs, "rw")
    filler.unlink()
    remount(small_tmpfs, "size=4m")
    real_append = writer.append_lines
    calls = [0]

    def append_then_turn_read_only(path, recs):  # the folder turns read-only mid-run
        calls[0] += 1
        if calls[0] == 3:
            # A read-only bind mount over the folder: the lock's open descriptor (on the writable mount
            # underneath) would make a plain remount fail with EBUSY.
            subprocess.run(["mount", "--bind", str(out), str(out)], check=True)
            remount(out, "bind,ro")
        real_append(path, recs)

    with monkeypatch.context() as patch:
        patch.setattr(writer, "append_lines", append_then_turn_read_only)
        assert main([*args, "--resume"]) == 3
    one_error_line(capsys.readouterr().err, "Read-only file system")
    assert len(records(out)) > done_when_full

    subprocess.run(["umount", str(out)], check=True)
    assert main([*args, "--resume"]) == 0
    recs = assert_each_input_once(out, 60)
    assert all(r["status"] == "ok" for r in recs)


def test_shards_follow_the_umask_and_name_their_run(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        assert run_embed([tmp_path / "imgs"], checkpoint, out) == 0
    finally:
        os.umask(old)
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name
    (shard,) = out.glob("*.safetensors")
    with safe_open(shard, framework="pt") as f:
        assert f.metadata()["qwenvl_vision_run"] == read_run(out)["run_id"]
