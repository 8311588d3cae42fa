"""qwenvl_vision.embed.writer: durable shards and manifest lines. A run killed at any instant (SIGKILL) or stopped
by an I/O fault (a full disk, a read-only folder: exit code 3) loses nothing recorded, and --resume finishes it
with each input once, no orphan shard and no shard name reused."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image
from safetensors import safe_open

import qwenvl_vision.embed.writer as writer
from qwenvl_vision.cli import main
from qwenvl_vision.embed import MANIFEST, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.embed.manifest import file_of
from qwenvl_vision.loading import load_encoder
from tests.helpers import make_image_folder as make_folder
from tests.helpers import rel_err, synthetic_photo
from tests.helpers.embed import ENV, assert_each_input_once, embed_cmd, make_media_folder, one_error_line, records


def test_resume_duplicates_nothing(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 5)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-patches", "64"]
    main(args)
    first = records(out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert main(args) == 2  # refusing to mix two runs without --resume
    (tmp_path / "imgs" / "corrupt.jpg").unlink()
    # fixed between runs: retried on resume
    Image.fromarray(synthetic_photo(33, 47, 99)).save(tmp_path / "imgs" / "corrupt.jpg")
    assert main([*args, "--resume"]) == 1  # empty.png and notes.png still fail
    recs = records(out)
    paths = [r["path"] for r in recs]
    assert len(paths) == len(set(paths)) == len(first)
    ok_first = {r["path"]: (r["shard"], r["key"]) for r in first if r["status"] == "ok"}
    ok_now = {r["path"]: (r["shard"], r["key"]) for r in recs if r["status"] == "ok"}
    assert {p: ok_now[p] for p in ok_first} == ok_first  # nothing recomputed
    assert len(ok_now) == len(ok_first) + 1
    assert set(shards) < {p.name for p in out.glob("*.safetensors")}


def kill_then_resume(inputs: Path, model: Path, out: Path, killed_once) -> int:
    """Run embed (one input a batch) in a child, SIGKILL it once ``killed_once(manifest records)`` holds, then
    resume it to the end; returns how many records the killed run had left."""
    cmd = embed_cmd([inputs], model, out, "--batch-patches", "1", "--device", "cpu")
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if killed_once(read_manifest_lines(out / "manifest.jsonl")):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_manifest_lines(out / "manifest.jsonl"))
    resumed = subprocess.run([*cmd, "--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return killed_at


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 60, bad=False)
    out = tmp_path / "out"
    killed_at = kill_then_resume(tmp_path / "imgs", checkpoint, out, lambda records: len(records) >= 5)
    assert 5 <= killed_at < 60
    records = read_manifest_lines(out / MANIFEST)
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == 60
    assert all(r["status"] == "ok" for r in records)
    referenced = {r["shard"] for r in records}
    assert referenced == {p.name for p in out.glob("*.safetensors")}  # no orphan shard left behind
    assert not list(out.glob("*.tmp"))
    assert len(dict(read_embeddings(out))) == 60  # every shard readable


@pytest.mark.slow
def test_sigkill_mid_run_with_videos_then_resume(tmp_path, checkpoint):
    pytest.importorskip("av")
    images, videos = make_media_folder(tmp_path / "media", 20, 12)
    out = tmp_path / "out"
    killed_at = kill_then_resume(tmp_path / "media", checkpoint, out,
                                  lambda records: any("video" in r for r in records))
    assert 1 <= killed_at < 32
    records = read_manifest_lines(out / MANIFEST)
    assert len({r["path"] for r in records}) == len(records) == 32
    assert all(r["status"] == "ok" for r in records)
    assert sum("video" in r for r in records) == 12
    assert {r["shard"] for r in records} == {p.name for p in out.glob("*.safetensors")}
    assert not list(out.glob("*.tmp"))
    encoder = load_encoder(checkpoint, device="cpu")
    stored = dict(read_embeddings(out))
    expected = encoder.encode_videos([str(p) for p in videos])
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
            if partial and name == "save_shard":  # a shard that ran out of space half way
                Path(args[1]).write_bytes(b"\x00" * 100)
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
def test_output_fault_exits_3_and_resume_finishes(fault, tmp_path, checkpoint, capsys, monkeypatch):
    name, n, code, text = FAULTS[fault]
    make_folder(tmp_path / "imgs", 12)  # 12 images and 3 bad files
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-patches", "64"]
    with monkeypatch.context() as patch:
        fail_on_call(patch, name, n, OSError(code, os.strerror(code), str(out / "x")), partial=True)
        assert main(args) == 3
    one_error_line(capsys.readouterr().err, f"cannot write to {out}", text, "this process recorded", "--resume")
    recorded = records(out)  # every complete line is valid: nothing recorded is lost
    assert 0 < len(recorded) < 15
    assert main([*args, "--resume"]) == 1  # the 3 bad files fail again
    recs = assert_each_input_once(out, 15)
    assert {r["path"]: r for r in recs if r["status"] == "ok"}.keys() >= {r["path"] for r in recorded
                                                                          if r["status"] == "ok"}


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


def test_resume_of_a_stopped_run_from_another_directory_redoes_only_what_is_missing(
        tmp_path, checkpoint, capsys, monkeypatch):
    """Records carry the resolved file: a run stopped part-way and resumed from elsewhere, with other spellings,
    finishes each input exactly once and counts every input done."""
    (tmp_path / "a").mkdir()
    make_folder(tmp_path / "a" / "imgs", 4, bad=False)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path / "a")
    with monkeypatch.context() as patch:
        fail_on_call(patch, "save_shard", 2, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)))
        assert main(["embed", "imgs", "--model", str(checkpoint), "--out", str(out), "--batch-patches", "64"]) == 3
    assert 0 < len(records(out)) < 4
    (tmp_path / "b" / "c").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "b" / "c")
    capsys.readouterr()
    assert main(["embed", "../../a/imgs", "--model", str(checkpoint), "--out", str(out), "--resume"]) == 0
    one_error_line(capsys.readouterr().err, "embedded 4 of 4 inputs", "0 failed")
    assert main(["embed", "../../a/imgs", "--model", str(checkpoint), "--out", str(out), "--resume"]) == 0
    recs = assert_each_input_once(out, 4)
    assert {file_of(r["realpath"]) for r in recs} == {str(p.resolve()) for p in (tmp_path / "a" / "imgs").rglob("img*")}


def test_shards_follow_the_umask(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name


def test_shard_metadata_names_the_run(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    (shard,) = out.glob("*.safetensors")
    with safe_open(shard, framework="pt") as f:
        assert f.metadata()["qwenvl_vision_run"] == read_run(out)["run_id"]
