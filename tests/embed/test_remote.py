"""Objects in storage as inputs (qwenvl_vision.embed.remote), against real servers on loopback: an HTTP server over
a folder, and moto's S3 server. Bitwise the tensors of the same files from a folder; the URL (with the ETag) as
the identity a resume matches; a failing, slow or vanished object is one failed input and the run goes on."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_encoded, read_manifest_lines, read_run, remote
from qwenvl_vision.embed.manifest import parquet_shards
from qwenvl_vision.errors import PreprocessError
from qwenvl_vision.inputs.pixels import FileBytes
from qwenvl_vision.outputs.parquet_reader import read_parquet_records
from tests.helpers import ENV, REPO, make_image_folder
from tests.helpers.embed import local_ray, one_error_line, run_embed  # noqa: F401 - a fixture
from tests.helpers.servers import QuietHandler, http_folder, s3_client

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
SMALL = ["--max-pixels", str(64 * 64), "--quiet"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory, checkpoint):
    """4 images in a folder and their tensors by file name."""
    root = tmp_path_factory.mktemp("remote")
    paths = sorted(make_image_folder(root / "imgs", 4, bad=False), key=lambda p: p.name)
    assert run_embed([root / "imgs"], checkpoint, root / "from-folder", *SMALL) == 0
    return root, paths, {Path(p).name: t for p, t in read_embeddings(root / "from-folder")}


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def served(tmp_path: Path, files: list[Path]) -> Path:
    """A folder to serve, holding copies of ``files``."""
    (tmp_path / "served").mkdir()
    for f in files:
        shutil.copy(f, tmp_path / "served" / f.name)
    return tmp_path / "served"


def test_http_objects_embed_bitwise_and_a_missing_one_fails_alone(photos, checkpoint, tmp_path):
    root, paths, want = photos
    folder = served(tmp_path, paths)
    with http_folder(folder) as base:
        urls = [f"{base}/{p.name}" for p in paths]
        table = tmp_path / "urls.jsonl"
        table.write_text("".join(f'{{"path": "{u}", "n": {i}}}\n' for i, u in enumerate([*urls, f"{base}/gone.jpg"])))
        out = tmp_path / "out"
        assert run_embed([table], checkpoint, out, "--keep-columns", "n", *SMALL) == 1
        records = read_manifest_lines(out / "manifest.jsonl")
        assert [r["path"] for r in records] == [*urls, f"{base}/gone.jpg"]
        assert [r["columns"]["n"] for r in records] == list(range(5))
        assert records[-1]["error"] == f"{base}/gone.jpg: cannot read its metadata (not found)"
        got = dict(read_embeddings(out))
        for url, p in zip(urls, paths, strict=True):
            assert torch.equal(got[url], want[p.name])
        # A list file may name URLs too; a scheme no file system knows is one failed input, the run goes on.
        listed = tmp_path / "urls.txt"
        listed.write_text(f"{urls[1]}\ns4://nowhere/x.jpg\n")
        mixed = tmp_path / "mixed"
        assert run_embed([listed], checkpoint, mixed, *SMALL) == 1
        by_path = {r["path"]: r for r in read_manifest_lines(mixed / "manifest.jsonl")}
        assert by_path[urls[1]]["status"] == "ok" and by_path[urls[1]]["realpath"] == urls[1]
        assert "no file system for s4://" in by_path["s4://nowhere/x.jpg"]["error"]
        # Vanished between listing and reading: one failed input naming the URL, the others embedded.
        (folder / paths[0].name).unlink()
        again = tmp_path / "again"
        assert run_embed(urls, checkpoint, again, *SMALL) == 1
        (failed,) = [r for r in read_manifest_lines(again / "manifest.jsonl") if r["status"] == "error"]
        assert failed["path"] == urls[0] and "not found" in failed["error"]


def test_a_server_that_never_answers_is_not_asked_again_and_a_store_s_text_keeps_no_password(monkeypatch):
    monkeypatch.setattr(remote, "TIMEOUT_S", 1)
    with socket.socket() as silent:  # connections are taken (into the backlog) and never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/a.jpg"
        ((_, error),) = remote.identities([url]).values()
    assert error == f"{url}: cannot read its metadata (no answer within 1 s)"

    def quoting():  # botocore names the bucket of s3://user:password@bucket/key as it took it
        raise RuntimeError('Invalid bucket name "AKID:S3cretPass@bucket"')

    with pytest.raises(PreprocessError) as caught:
        remote.retried(quoting, "s3://AKID:S3cretPass@bucket/a.jpg", "read it")
    assert "S3cretPass" not in str(caught.value) and '"AKID:***@bucket"' in str(caught.value)
    with pytest.raises(PreprocessError) as caught:  # a one-letter password hides that userinfo, no other letter
        remote.retried(quoting, "s3://AKID:a@bucket/a.jpg", "read it")
    assert "cannot read it after" in str(caught.value)


def test_a_transient_error_is_retried_and_a_slow_object_times_out_alone(photos, checkpoint, tmp_path, monkeypatch):
    calls = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("the peer reset the connection")
        return b"the bytes"

    assert remote.retried(flaky, "http://127.0.0.1:9/a.jpg", "read it") == b"the bytes" and len(calls) == 2

    def stalls(u: str, key: str | None = None, limit: int | None = None) -> bytes:
        time.sleep(4)  # past the 1 s limit: the run records it failed and goes on
        return b""

    monkeypatch.setattr(remote, "fetch", stalls)
    with http_folder(served(tmp_path, photos[1][:1])) as base:
        url = f"{base}/{photos[1][0].name}"
        assert run_embed([url], checkpoint, tmp_path / "slow", "--decode-timeout", "1", *SMALL) == 1
    (r,) = read_manifest_lines(tmp_path / "slow" / "manifest.jsonl")
    assert r["status"] == "error" and url in r["error"] and "1 s" in r["error"], r["error"]


@pytest.mark.parametrize("versioned", [False, True], ids=["etag", "version"])
def test_an_object_replaced_after_listing_is_never_stored_under_its_listed_identity(photos, checkpoint, tmp_path,
                                                                                   monkeypatch, capsys, versioned):
    """S3 objects embed bitwise, their identity the URL with the object's ETag or version. Listed (its identity
    read), then replaced under its URL before its bytes are read: with a version in its identity the listed version
    is read by its id (the old object's tensors); with an ETag the bytes read are the new object's, which the ETag
    check after reading refuses (one failed input); a resume embeds the new object under its new identity, and
    another does nothing until an object is replaced again, when it is embedded again and its old record dropped.
    Nothing is stored under an identity it does not have."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from qwenvl_vision.embed import inputs

    root, paths, want = photos
    with s3_client(monkeypatch) as client:
        bucket = f"replaced-{'version' if versioned else 'etag'}"  # moto keeps buckets across its servers
        client.create_bucket(Bucket=bucket)
        if versioned:
            client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        for p in paths[:2]:  # '::' in a key is a character, not fsspec's URL chaining
            client.put_object(Bucket=bucket, Key=f"set::1/{p.name}", Body=p.read_bytes())
        urls = [f"s3://{bucket}/set::1/{p.name}" for p in paths[:2]]
        real = inputs.identities

        def listed_then_replaced(listed: list[str]) -> dict:
            found = real(listed)
            client.put_object(Bucket=bucket, Key=f"set::1/{paths[0].name}", Body=paths[2].read_bytes())
            return found

        monkeypatch.setattr(inputs, "identities", listed_then_replaced)
        out = tmp_path / "out"
        code = run_embed(urls, checkpoint, out, *SMALL)
        records = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
        label = "version" if versioned else "etag"
        assert all(r["realpath"].startswith(f"{u}#{label}=") for u, r in records.items()), records
        got = dict(read_embeddings(out))
        assert torch.equal(got[urls[1]], want[paths[1].name])
        # A version reads the listed object (its tensors); an ETag refuses the new one's bytes (one failed input).
        assert code == (0 if versioned else 1)
        assert torch.equal(got[urls[0]], want[paths[0].name]) if versioned else urls[0] not in got
        if versioned:
            # A URL naming a version (?versionId=) reads that version, not the latest.
            versions = client.list_object_versions(Bucket=bucket, Prefix=f"set::1/{paths[0].name}")["Versions"]
            pinned = f"{urls[0]}?versionId={versions[::-1][0]['VersionId']}"
            assert run_embed([pinned], checkpoint, tmp_path / "pinned", *SMALL) == 0
            assert torch.equal(dict(read_embeddings(tmp_path / "pinned"))[pinned], want[paths[0].name])
            return
        assert records[urls[0]]["error"].startswith(f"{urls[0]}: changed since the run listed it (etag ")
        monkeypatch.setattr(inputs, "identities", real)
        for _ in range(2):  # the second resume: nothing to do
            assert run_embed(urls, checkpoint, out, "--resume", *SMALL) == 0
            assert len(read_manifest_lines(out / "manifest.jsonl")) == 2
        assert torch.equal(dict(read_embeddings(out))[urls[0]], want[paths[2].name])
        client.put_object(Bucket=bucket, Key=f"set::1/{paths[0].name}", Body=paths[3].read_bytes())
        before = {r["path"]: r["realpath"] for r in read_manifest_lines(out / "manifest.jsonl")}
        capsys.readouterr()
        assert run_embed(urls, checkpoint, out, "--resume", *SMALL) == 0  # replaced again: a new input
        assert "1 changed" in capsys.readouterr().err
        now = {r["path"]: r["realpath"] for r in read_manifest_lines(out / "manifest.jsonl")}
        assert len(now) == 2 and now[urls[0]] != before[urls[0]] and now[urls[1]] == before[urls[1]]
        assert [torch.equal(t, want[paths[3].name]) for p, t in read_embeddings(out) if p == urls[0]] == [True]
        assert torch.equal(read_encoded(out, urls[:1]).embeddings[0], want[paths[3].name])  # its one record


def test_a_ray_actor_reads_the_object_its_identity_column_names(photos, checkpoint, monkeypatch):
    """Where only a row travels (a Ray actor, ``Embedder`` with ``identity_column``), a URL is read with the
    identity the run listed beside it: an object replaced since is that row's failure. A path is never parsed for
    a pin (a URL may hold '#', and so may an ETag), and without the column nothing is checked."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    pytest.importorskip("ray")
    from qwenvl_vision.embed.ray import Embedder

    root, paths, want = photos
    with s3_client(monkeypatch) as client:
        client.create_bucket(Bucket="actor")  # moto keeps buckets across its servers in a process
        url = f"s3://actor/a#1/{paths[0].name}"  # a '#' in the key itself
        client.put_object(Bucket="actor", Key=f"a#1/{paths[0].name}", Body=paths[0].read_bytes())
        listed = remote.identity(url)
        assert remote.pin_of(url, listed)[0] == "etag" and remote.pin_of(url, url) is None
        client.put_object(Bucket="actor", Key=f"a#1/{paths[0].name}", Body=paths[1].read_bytes())
        batch = {"path": np.array([url]), "realpath": np.array([listed])}
        checked = Embedder(checkpoint, identity_column="realpath", max_pixels=64 * 64, device="cpu")(batch)
        (error,) = checked.column("error").to_pylist()
        assert error.startswith(f"{url}: changed since the run listed it (etag ")
        unchecked = Embedder(checkpoint, max_pixels=64 * 64, device="cpu")(batch)
        assert unchecked.column("error").to_pylist() == [None]


def test_a_store_without_credentials_is_the_run_s_setup_error_at_once(checkpoint, tmp_path, monkeypatch, capsys):
    """Not each object's failure after its retries (hours of listing for a large collection): exit 2, one line."""
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's, made with credentials, is not this one
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role asked for
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing leaves the machine
    monkeypatch.setattr(remote, "BACKOFF_S", 10)  # retries would show as a minute
    started = time.monotonic()
    capsys.readouterr()
    assert run_embed([f"s3://bucket/{i}.jpg" for i in range(3)], checkpoint, tmp_path / "out", *SMALL) == 2
    one_error_line(capsys.readouterr().err, "NoCredentialsError", "AWS_ACCESS_KEY_ID")
    assert time.monotonic() - started < 30


def test_urls_without_the_extra_are_refused_in_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # every import of fsspec fails now
    assert run_embed(["http://127.0.0.1:9/a.jpg"], checkpoint, tmp_path / "o", *SMALL) == 2
    one_error_line(capsys.readouterr().err, "qwenvl-vision[remote]")
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.slow  # a local Ray instance
def test_ray_engine_reads_urls_bitwise(photos, checkpoint, tmp_path, local_ray):  # noqa: F811 - the fixture
    root, paths, want = photos
    threads = str(read_run(root / "from-folder")["threads"])  # CPU bits are the same at the same thread count
    with http_folder(served(tmp_path, paths)) as base:
        urls = [f"{base}/{p.name}" for p in paths]
        out = tmp_path / "ray"
        assert run_embed(urls, checkpoint, out, "--engine", "ray", "--ray-actors", "1", "--threads", threads,
                         *SMALL) == 0
    records = {r.path: r for r in read_parquet_records(parquet_shards(out))}
    for url, p in zip(urls, paths, strict=True):
        assert records[url].realpath == url and torch.equal(records[url].embedding, want[p.name])


def test_a_url_s_secrets_are_never_stored_and_a_url_signed_again_is_the_same_input(photos, checkpoint, tmp_path):
    """A presigned URL (and one with a password) is read as given; what the run stores shows neither the password
    nor the signature, and its identity is the URL without them, so a resume with the URL signed again embeds
    nothing twice."""
    root, paths, want = photos
    with http_folder(served(tmp_path, paths[:1])) as base:
        host = base.split("://", 1)[1]

        def signed(name: str, signature: str) -> str:
            return (f"http://alice:S3cretPass@{host}/{name}?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature={signature}"
                    f"&w=1")

        out = tmp_path / "out"
        argv = ["--model", str(checkpoint), "--out", str(out), *SMALL]
        assert main(["embed", signed(paths[0].name, "sig1"), signed("gone.jpg", "sig1"), *argv]) == 1
        assert main(["embed", signed(paths[0].name, "sig2"), signed("gone.jpg", "sig2"), "--resume", *argv]) == 1
        stored = (out / "manifest.jsonl").read_text()
        assert not any(secret in stored for secret in ("S3cretPass", "sig1", "sig2", "AKIAEXAMPLE"))
        records = read_manifest_lines(out / "manifest.jsonl")
        (ok,) = [r for r in records if r["status"] == "ok"]  # embedded once: the URL signed again is the same
        assert ok["path"] == (f"http://alice:***@{host}/{paths[0].name}?X-Amz-Credential=***&X-Amz-Signature=***"
                              f"&w=1")
        assert ok["realpath"] == f"http://{host}/{paths[0].name}?w=1"
        assert torch.equal(dict(read_embeddings(out))[ok["path"]], want[paths[0].name])
        # Asked for by the URL as given (any signature), the record is found as stored.
        (embedding,) = read_encoded(out, [signed(paths[0].name, "sig3")]).embeddings
        assert torch.equal(embedding, want[paths[0].name])
        assert all("not found" in r["error"] and "***" in r["error"] for r in records if r["status"] == "error")


def test_http_statuses_decide_what_is_retried_and_a_failed_url_says_what_happened(photos, checkpoint, tmp_path):
    """A server's 503 is retried (it was read as 'not found' at listing and failed the input at once); a 403 (no
    access, an expired signature) is not retried and says so; a 404 is 'not found'. A server that always answers
    500, a redirect to another scheme (never followed), a redirect loop and a port nothing listens at (retried) each
    fail their input saying so, none as 'not found'."""
    root, paths, want = photos
    busy, refused = paths[0].name, paths[1].name
    requests: list[tuple[str, str]] = []
    with http_folder(served(tmp_path, paths[:2]), requests=requests,
                     failures={busy: [503, 503], refused: [403] * 20, "down.jpg": [500] * 100},
                     redirects={"away.jpg": "file:///etc/passwd", "loop.jpg": "/loop.jpg"}) as base:
        out = tmp_path / "out"
        urls = [f"{base}/{name}" for name in (busy, refused, "gone.jpg", "down.jpg", "away.jpg", "loop.jpg")]
        with socket.socket() as closed:  # a port nothing listens at
            closed.bind(("127.0.0.1", 0))
            urls.append(f"http://127.0.0.1:{closed.getsockname()[1]}/x.jpg")
        assert run_embed(urls, checkpoint, out, *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
    assert by_path[urls[0]]["status"] == "ok"
    assert torch.equal(dict(read_embeddings(out))[urls[0]], want[busy])
    refused_error, gone, down, away, loop, no_server = (by_path[url]["error"] for url in urls[1:])
    assert refused_error.startswith(urls[1]) and "HTTP 403" in refused_error and "attempts" not in refused_error
    assert len([r for r in requests if r[1] == refused]) <= 2  # fsspec's HEAD, then its GET: never retried
    assert gone.startswith(urls[2]) and gone.endswith("(not found)")
    assert down.startswith(urls[3]) and down.endswith(f"after {remote.RETRIES + 1} attempts (HTTP 500)")
    assert away.startswith(urls[4]) and "redirect to another scheme refused: file:///etc/passwd" in away
    assert loop.startswith(urls[5]) and "redirect loop" in loop
    assert no_server.startswith(urls[6])
    assert f"after {remote.RETRIES + 1} attempts (ClientConnectorError: Cannot connect" in no_server
    assert not any("not found" in error for error in (down, away, loop, no_server))


def test_a_ray_actor_holds_the_objects_it_decodes_not_its_whole_batch(photos, checkpoint, tmp_path, monkeypatch):
    """An actor's batch of URLs is fetched as the decode workers reach each one: at most the workers' count (and
    the one being fetched) are held at once, as in the local engine, not every object of the batch."""
    from qwenvl_vision.embed.ray import Embedder

    root, paths, want = photos
    folder = served(tmp_path, [])
    for i in range(12):
        shutil.copy(paths[i % len(paths)], folder / f"p{i:02d}{paths[i % len(paths)].suffix}")
    peak, real = [0], remote.fetch

    def counted(url, key=None, limit=None):
        data = real(url, key, limit)
        held = sum(1 for o in gc.get_objects() if isinstance(o, FileBytes) and o.fetched)
        peak[0] = max(peak[0], held + 1)
        return data

    monkeypatch.setattr(remote, "fetch", counted)
    with http_folder(folder) as base:
        urls = [f"{base}/{p.name}" for p in sorted(folder.iterdir())]
        keys = remote.identities(urls)
        embedder = Embedder(str(checkpoint), device="cpu", max_pixels=64 * 64, num_workers=2,
                            identity_column="realpath")
        table = embedder({"path": np.array(urls), "realpath": np.array([keys[u][0] for u in urls])})
    assert table.column("status").to_pylist() == ["ok"] * 12
    assert peak[0] <= 3


def test_a_body_above_the_decode_budget_fails_alone_unread(photos, checkpoint, tmp_path):
    """A URL's body is held to the decode budget (--decode-mib): a larger size announced is refused before any of
    it is read, a body sent without a size is read no further than the budget, and one within it is embedded."""
    root, paths, want = photos
    folder = served(tmp_path, paths[:1])
    budget = 1 << 20  # --decode-mib 1
    for name in ("sized.jpg", "unsized.jpg"):
        (folder / name).write_bytes(bytes(2 * budget))
    requests: list[tuple[str, str]] = []
    with http_folder(folder, requests=requests, unsized=frozenset({"unsized.jpg", paths[0].name})) as base:
        urls = [f"{base}/{name}" for name in ("sized.jpg", "unsized.jpg", paths[0].name)]
        out = tmp_path / "out"
        assert run_embed(urls, checkpoint, out, "--decode-mib", "1", *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
    sized, unsized = by_path[urls[0]]["error"], by_path[urls[1]]["error"]
    assert sized.startswith(urls[0]) and f"{2 * budget:,} bytes" in sized and f"budget of {budget:,} bytes" in sized
    assert ("GET", "sized.jpg") not in requests  # refused by its size alone
    assert unsized.startswith(urls[1]) and f"budget of {budget:,} bytes" in unsized
    assert by_path[urls[2]]["status"] == "ok"
    assert torch.equal(dict(read_embeddings(out))[urls[2]], want[paths[0].name])


def test_a_versioned_object_above_the_budget_is_refused_by_its_size_and_an_empty_one_as_empty(
        photos, checkpoint, tmp_path, monkeypatch):
    """An S3 object read by its version (a versioned bucket) is held to the budget as the latest is: by its size."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    root, paths, want = photos
    budget = 1 << 20  # --decode-mib 1
    with s3_client(monkeypatch) as client:
        client.create_bucket(Bucket="budget-version")
        client.put_bucket_versioning(Bucket="budget-version", VersioningConfiguration={"Status": "Enabled"})
        bodies = {"large.jpg": bytes(2 * budget), "empty.jpg": b"", paths[0].name: paths[0].read_bytes()}
        for name, body in bodies.items():
            client.put_object(Bucket="budget-version", Key=name, Body=body)
        urls = [f"s3://budget-version/{name}" for name in bodies]
        out = tmp_path / "out"
        assert run_embed(urls, checkpoint, out, "--decode-mib", "1", *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
    assert all("#version=" in r["realpath"] for r in by_path.values())
    assert f"{2 * budget:,} bytes, more than the decode budget" in by_path[urls[0]]["error"]
    assert "empty" in by_path[urls[1]]["error"] and "attempts" not in by_path[urls[1]]["error"]
    assert torch.equal(dict(read_embeddings(out))[urls[2]], want[paths[0].name])


def test_a_body_longer_than_announced_is_read_no_further_than_the_budget(checkpoint, tmp_path):
    """A server that announces 100 bytes and answers the GET with 206 and an endless body: the read stops one byte
    past the budget (the input fails saying so), and the server sends little more than that."""
    import http.server
    import threading

    sent = []

    class Lying(QuietHandler):
        protocol_version = "HTTP/1.0"

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self):
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-99/100")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(256):  # 256 MiB, unless the client stops reading
                    self.wfile.write(bytes(1 << 20))
                    sent.append(1)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/x.jpg"
    try:
        out = tmp_path / "out"
        assert run_embed([url], checkpoint, out, "--decode-mib", "1", *SMALL) == 1
    finally:
        server.shutdown()
        server.server_close()
    (record,) = read_manifest_lines(out / "manifest.jsonl")
    assert record["error"].startswith(url) and f"budget of {1 << 20:,} bytes" in record["error"]
    assert len(sent) < 64  # MiB: what the sockets buffered past the budget, not the whole body


def test_urls_whose_stores_fail_at_once_are_each_their_failed_input_in_a_fresh_process():
    """The metadata threads read aiohttp's errors: one thread's failure met the module another was still importing
    (an AttributeError that ended the run). A fresh process, so that nothing imported aiohttp before."""
    script = ("from qwenvl_vision.embed.inputs import gather_inputs\n"
              "urls = ['http://127.0.0.1:9/a.jpg', 'zip://x/a.jpg', 'zip://y/b.jpg']\n"
              "found = gather_inputs(urls)\n"
              "assert sorted(found.errors) == sorted(urls), found.errors\n")
    result = subprocess.run([sys.executable, "-c", script], env=ENV, cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
