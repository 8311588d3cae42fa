"""``qwenvl-vision serve`` as its users start it (``serving``: a child process, uvicorn, on a free loopback port);
the requests the proxy sends (``chat``, ``part``, ``data_url``), the check of an error answer (``error_of``)."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

# The child imports this checkout's package, single-threaded (a 2-core machine runs several processes at once).
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
START_S = 180  # a bound on loading, so that a server that never answers fails the test instead of hanging it


class Served(str):
    """The server's base URL (``http://127.0.0.1:PORT``); ``process`` is its ``subprocess.Popen``, ``log()`` what it
    printed so far (stdout and stderr)."""

    process: subprocess.Popen
    log_file: object

    def log(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read().decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str] | None = None) -> Iterator[Served]:
    """``qwenvl-vision serve ARGS --port P`` running until the block ends, ready (``GET /health`` answered 200).
    Yields its URL. Leaving the block sends SIGTERM and, when the block raised nothing, asserts the server exited 0
    (kill after START_S seconds otherwise); ``process.returncode`` is then set."""
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "qwenvl_vision.cli", "serve", *map(str, args), "--port", str(free_port())]
    process = subprocess.Popen(cmd, env=env or ENV, stdout=log, stderr=subprocess.STDOUT)
    url = Served(f"http://127.0.0.1:{cmd[-1]}")
    url.process, url.log_file = process, log
    ok = False
    try:
        deadline = time.monotonic() + START_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"serve exited {process.returncode} before it was ready:\n{url.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"serve not ready after {START_S} s:\n{url.log()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            time.sleep(0.1)
        yield url
        ok = True
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(START_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:
            if ok:
                assert process.returncode == 0, f"serve exited {process.returncode} on SIGTERM:\n{url.log()}"
        finally:
            log.close()


KEY = "test-key"  # the serve tests' API key


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


def part(url: str, uuid: str | None = None, kind: str = "image_url") -> dict:
    """A content part as vLLM's proxy sends it."""
    return {"type": kind, kind: {"url": url}, **({"uuid": uuid} if uuid is not None else {})}


def chat(*parts: dict, **extra) -> dict:
    """A chat request with a text part before the items (the proxy removes text; a client may not)."""
    return {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                                      *parts]}], **extra}


def error_of(response, status: int, *needles: str) -> str:
    """The answer is ``status`` with one error line naming every needle."""
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert "\n" not in message and response.json()["error"]["code"] == status
    for needle in needles:
        assert needle in message, message
    return message
