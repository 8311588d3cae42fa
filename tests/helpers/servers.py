"""Real servers on loopback for the remote-input tests: a plain HTTP server over a folder, and an S3-compatible one
(moto's server mode). Nothing leaves the machine."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class FailingHandler(QuietHandler):
    """Answers a request for a name in ``failures`` (name -> [status, ...]) with the next status listed, then serves
    it; one in ``redirects`` (name -> URL) always with a redirect there; one in ``unsized`` with its file and no
    length (the body ends as the connection closes). ``requests`` records (method, name) of every request; ``etag``,
    where given, is every answer's ETag (as an object store sends one)."""

    failures: dict[str, list[int]] = {}
    redirects: dict[str, str] = {}
    unsized: frozenset[str] = frozenset()
    requests: list[tuple[str, str]] = []
    etag: str | None = None

    def end_headers(self) -> None:
        if self.etag:
            self.send_header("ETag", f'"{self.etag}"')
        super().end_headers()

    def answer(self, method: str) -> bool:
        name = self.path.split("?", 1)[0].rsplit("/", 1)[-1]
        self.requests.append((method, name))
        pending = self.failures.get(name)
        if pending:
            self.send_error(pending.pop(0))
        elif name in self.redirects:
            self.send_response(302)
            self.send_header("Location", self.redirects[name])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif name in self.unsized:
            self.send_response(200)
            self.end_headers()
            if method == "GET":
                with contextlib.suppress(ConnectionError):  # a client that read enough closes the connection
                    self.wfile.write((Path(self.directory) / name).read_bytes())
        else:
            return False
        return True

    def do_HEAD(self) -> None:
        if not self.answer("HEAD"):
            super().do_HEAD()

    def do_GET(self) -> None:
        if not self.answer("GET"):
            super().do_GET()


@contextlib.contextmanager
def http_folder(folder: Path, failures: dict[str, list[int]] | None = None,
                requests: list[tuple[str, str]] | None = None, redirects: dict[str, str] | None = None,
                unsized: frozenset[str] = frozenset(), etag: str | None = None) -> Iterator[str]:
    """``folder`` served over HTTP on 127.0.0.1 (a free port); yields the base URL. ``failures``: name -> the HTTP
    statuses its next requests get before it is served; ``requests``: filled with (method, name) of each;
    ``redirects``: name -> where it always redirects; ``unsized``: names served without a length; ``etag``: every
    answer's ETag."""
    handler_class = QuietHandler
    if failures is not None or requests is not None or redirects is not None or unsized or etag:
        handler_class = type("Failing", (FailingHandler,), {
            "failures": failures or {}, "requests": requests if requests is not None else [],
            "redirects": redirects or {}, "unsized": unsized, "etag": etag})
    handler = functools.partial(handler_class, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def s3_server(monkeypatch_env: dict) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (a free port); fills ``monkeypatch_env`` with the variables a client needs
    (endpoint, fake credentials, region) and yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    with contextlib.suppress(ImportError):  # fsspec keeps file systems per options: one made for an earlier
        import s3fs  # server (the endpoint is read from the environment) would still talk to that one

        s3fs.S3FileSystem.clear_instance_cache()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    monkeypatch_env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                           AWS_DEFAULT_REGION="us-east-1")
    try:
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def s3_client(monkeypatch) -> Iterator:
    """``s3_server`` with its variables set through ``monkeypatch`` (for the code under test too): a boto3 client
    on it."""
    import boto3

    env: dict = {}
    with s3_server(env) as endpoint:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield boto3.client("s3", endpoint_url=endpoint)
