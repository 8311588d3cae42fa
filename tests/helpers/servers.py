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


@contextlib.contextmanager
def http_folder(folder: Path) -> Iterator[str]:
    """``folder`` served over HTTP on 127.0.0.1 (a free port); yields the base URL."""
    handler = functools.partial(QuietHandler, directory=str(folder))
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
