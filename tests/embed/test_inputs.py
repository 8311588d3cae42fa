"""qwenvl_vision.embed.inputs: what a run works on (files, folders, list files; one input per real file) and each
rank's share."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from qwenvl_vision.embed import read_run, remote
from qwenvl_vision.embed.inputs import INPUT_KINDS, file_identity, file_of, gather_inputs, shard_for_rank
from tests.helpers import ENV, REPO
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import embed_cmd, one_error_line, records, run_embed


def test_gather_inputs_folders_lists_and_files_and_what_is_read_only_on_its_own(tmp_path):
    """A compressed tar, or a shard or table named in a list, decoded as an image would be "not a recognised image
    file": the error says what is read instead. A missing file is kept: the decoder says so."""
    paths = make_folder(tmp_path / "imgs", 4)
    gz = tmp_path / "shard.tar.gz"
    gz.write_bytes(b"\x1f\x8b" + bytes(100))
    listing = tmp_path / "list.txt"
    listing.write_text(f"{paths[0]}\n# a comment\n\nimgs/img001.png\na.tar\nb.csv\n")
    found = gather_inputs([str(tmp_path / "imgs"), str(listing), str(tmp_path / "missing.jpg"), str(gz)])
    assert str(tmp_path / "imgs" / "readme.md") not in found.paths
    assert str(tmp_path / "imgs" / "corrupt.jpg") in found.paths
    assert found.paths[-2:] == [str(tmp_path / "missing.jpg"), str(gz)]
    assert len(found.paths) == len(set(found.paths)) == 4 + 3 + 2 + 2  # the listed images: already in the folder
    assert set(found.errors) == {str(tmp_path / "a.tar"), str(tmp_path / "b.csv"), str(gz)}
    real = str(paths[0].resolve())  # a file's identity, stamped where it is listed: its real path, size and mtime
    assert found.keys[str(paths[0])] == file_identity(real) != real and file_of(found.keys[str(paths[0])]) == real
    assert "uncompressed .tar" in found.errors[str(gz)] and "compressed tar" in found.errors[str(gz)]
    for name in ("a.tar", "b.csv"):
        assert found.errors[str(tmp_path / name)].startswith(f"{tmp_path / name}: named in list {listing}")


def test_a_file_that_cannot_be_checked_is_still_an_input(tmp_path, monkeypatch):
    """In a folder readable but not searchable a file cannot be stat'ed: it stays an input (its read says why)."""
    paths = make_folder(tmp_path / "imgs", 2)
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path) == str(paths[0]):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert str(paths[0]) in gather_inputs([str(tmp_path / "imgs")]).paths


def test_each_rank_takes_every_world_th_input_never_a_duplicate():
    paths = [f"img{i}.png" for i in range(7)]
    shares = [shard_for_rank(paths, rank, 3) for rank in range(3)]
    assert shares == [["img0.png", "img3.png", "img6.png"], ["img1.png", "img4.png"], ["img2.png", "img5.png"]]
    assert sorted(p for share in shares for p in share) == sorted(paths)


def test_binary_list_file_is_one_failed_input_and_the_run_goes_on(tmp_path, checkpoint, capsys):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    binary = tmp_path / "paths.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(f"{paths[0]}\ncaf\xe9.jpg\n".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text(f"# my list\n{paths[1]}\n")
    out = tmp_path / "out"
    assert run_embed([binary, latin1, good, paths[2]], checkpoint, out) == 1
    one_error_line(capsys.readouterr().err, "embedded 2 of 4 inputs", "2 failed")
    by_path = {r["path"]: r for r in records(out)}
    assert "not a text file (NUL byte" in by_path[str(binary)]["error"]
    assert "not a UTF-8 text file (byte" in by_path[str(latin1)]["error"]
    assert by_path[str(paths[1])]["status"] == by_path[str(paths[2])]["status"] == "ok"


def test_the_same_file_by_two_spellings_is_embedded_once(tmp_path, checkpoint, capsys, monkeypatch):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    (tmp_path / "link.png").symlink_to(paths[1])
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(paths[0], tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{paths[0]}\n./{relative}\nfile://{paths[2]}\n")  # a file URL names its local path
    out = tmp_path / "out"
    assert run_embed([relative, paths[0], "imgs", listing, "link.png", f"FILE://localhost{paths[1]}"], checkpoint,
                     out) == 0
    one_error_line(capsys.readouterr().err, "embedded 3 of 3 inputs", "0 failed")
    # First spellings: the relative name, then the folder's files as the folder spells them.
    assert [r["path"] for r in records(out)] == [relative, "imgs/img001.png", "imgs/img002.jpg"]
    assert read_run(out)["cwd"] == str(tmp_path)

    # Resumed from elsewhere with other spellings: everything is already done.
    monkeypatch.chdir(REPO)
    assert run_embed([tmp_path / "imgs"], checkpoint, out, "--resume") == 0
    one_error_line(capsys.readouterr().err, "embedded 3 of 3 inputs")
    assert len(records(out)) == 3


def test_empty_input_set_is_one_line_exit_2(tmp_path, checkpoint, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "notes.md").write_text("no images here")
    (tmp_path / "empty.txt").write_text("# nothing listed\n")
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs", tmp_path / "empty.txt"], checkpoint, out) == 2
    one_error_line(capsys.readouterr().err, "no inputs", str(tmp_path / "imgs"), ".jpg")
    assert not out.exists()


@pytest.mark.slow
def test_a_fifo_among_the_inputs_is_one_failed_input_not_a_hang(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2, bad=False)
    os.mkfifo(tmp_path / "pipe.jpg")  # named on the command line: a folder scan skips what is not a file
    out = tmp_path / "out"
    result = subprocess.run(embed_cmd([tmp_path / "imgs", tmp_path / "pipe.jpg"], checkpoint, out, "--quiet"), env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1, result.stderr[-2000:]
    (failed,) = [r for r in records(out) if r["status"] == "error"]
    assert failed["path"].endswith("pipe.jpg") and "not a regular file" in failed["error"]


@pytest.mark.parametrize("identity, file", [
    ("/d/a.jpg#size=5,mtime_ns=-7", "/d/a.jpg"),  # dated before 1970
    ("/d/a#size=1,mtime_ns=2.jpg#size=5,mtime_ns=6", "/d/a#size=1,mtime_ns=2.jpg"),  # a name holding such text
    ("/d/x#size=1,mtime_ns=2/a.jpg", "/d/x#size=1,mtime_ns=2/a.jpg"),  # a file that could not be read: bare
    ("/d/shot#etag=1.jpg", "/d/shot#etag=1.jpg"),
    ("/d/s.TAR#size=5,mtime_ns=6/sub/m#size=1,mtime_ns=2.jpg", "/d/s.TAR/sub/m#size=1,mtime_ns=2.jpg"),  # a member
    ("s3://b/shot#etag=1.jpg#etag=abc", "s3://b/shot#etag=1.jpg"),
    ("https://h/a.jpg#etag=W/a#b", "https://h/a.jpg"),  # an ETag may hold a '#'
])
def test_a_state_or_version_is_read_where_it_is_written(identity, file):
    assert file_of(identity) == file


def test_a_fifo_named_as_a_shard_is_a_failed_input_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "pipe.tar")  # opened for reading, it would wait for a writer for good
    found = []
    worker = threading.Thread(target=lambda: found.append(gather_inputs([str(tmp_path / "pipe.tar")])), daemon=True)
    worker.start()
    worker.join(30)
    assert found and "not a regular file" in found[0].errors[str(tmp_path / "pipe.tar")]


def test_a_url_refused_before_it_is_read_keeps_no_secret_in_its_identity():
    """A URL is refused unread where it names no media (a compressed tar, a table): its identity is the URL without
    its password or signature, never the local path it would be."""
    urls = ["https://user:s3cret@127.0.0.1:9/a.tar.gz", "s3://AKID:SKSECRET@b/z.tgz",
            "https://h/x.csv?X-Amz-Signature=SIG&w=1"]
    found = gather_inputs(urls)
    assert all(found.errors.get(url) for url in urls)
    assert [found.keys[url] for url in urls] == ["https://127.0.0.1:9/a.tar.gz", "s3://AKID@b/z.tgz",
                                                 "https://h/x.csv?w=1"]


def test_two_spellings_of_one_url_are_one_input_whether_or_not_their_metadata_could_be_read(tmp_path, monkeypatch):
    """torchrun's ranks list the inputs each at its own moment and split them by position: a signature refused on
    one rank and not another must not change which inputs there are."""
    from tests.helpers.servers import http_folder

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "INFO_WORKERS", 1)  # in order: the refusals below meet the first spelling
    names = [p.name for p in make_folder(tmp_path / "imgs", 3, bad=False) if p.parent.name == "imgs"]
    listed = []
    for failures in ({}, {names[0]: [403] * 2}):  # fsspec's metadata read tries a HEAD, then a GET
        with http_folder(tmp_path / "imgs", failures=failures, etag="v1") as base:
            urls = [f"{base}/{names[0]}?X-Amz-Signature=old", f"{base}/{names[1]}",
                    f"{base}/{names[0]}?X-Amz-Signature=new"]
            found = gather_inputs(urls)
        listed.append([p.replace(base, "") for p in found.paths])
    assert listed[0] == listed[1] == [urls[0].replace(base, ""), f"/{names[1]}"]


def test_a_url_is_told_by_its_path_not_its_query(monkeypatch):
    """An image whose query ends in .csv is read (here: nothing listens, so it fails reading); a shard whose query
    ends in anything is refused unread as a shard."""
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    image, shard = "http://127.0.0.1:9/a.jpg?name=x.csv", "http://127.0.0.1:9/s.tar?X-Amz-Signature=SIG"
    odd = "http://[::1/x.jpg"  # no URL urllib can split: one failed input, not the run's end
    found = gather_inputs([image, shard, odd])
    assert "cannot read its metadata" in found.errors[image] and "not a valid URL" in found.errors[odd]
    assert found.errors[shard].endswith("read as a local file only; INPUTs are " + INPUT_KINDS)
