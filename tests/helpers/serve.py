"""``qwenvl-vision serve`` as its users start it (``serving``: a child process, uvicorn, on a free loopback port), or
its app in this process (``app_of``, the test settings ``server_options``, an encoder held until let go: ``Held``);
a media server on loopback (``media_server``; ``held_answer``: media held until let go);
the requests the proxy sends (``chat``, ``part``, ``data_url``), the check of an error answer (``error_of``), a wait
with a deadline (``until``)."""

from __future__ import annotations

import base64
import contextlib
import http.server
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from qwenvl_vision.results import ItemResult
from tests.helpers import ENV

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


def until(condition, what: str) -> None:
    """Wait for ``condition()``, failing the test (never hanging it) after START_S seconds."""
    deadline = time.monotonic() + START_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {START_S} s"
        time.sleep(0.01)


def app_of(encoder, *options: str):
    """The app ``qwenvl-vision serve --served-model-name tiny its-alias OPTIONS`` serves for ``encoder``."""
    from qwenvl_vision.cli import build_parser
    from qwenvl_vision.serve.app import build_app
    from qwenvl_vision.serve.main import serve_settings

    args = build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "tiny", "its-alias",
                                      *map(str, options)])
    args.validate(args)
    return build_app(encoder, serve_settings(args, encoder))


def server_options(root: Path) -> list:
    """The in-process tests' options: a key, the encoder role over ``root/shared``, media from 127.0.0.1 and under
    ``root/local``, small limits (4 items a request, 4 waiting, 1 MiB a body and in all, 1 MiB of decode budget)."""
    return ["--api-key", KEY, "--ec-shared-storage", root / "shared", "--max-body-mib", 1, "--max-bodies-mib", 1,
            "--max-items", 4, "--max-queue", 4, "--decode-mib", 1, "--allowed-media-domains", "127.0.0.1",
            "--allowed-local-media-path", root / "local", "--decode-timeout", 30]


class Held:
    """An encoder whose ``iter_encode`` waits for ``go`` (``entered`` set once it waits), then raises ``fail`` if it
    is set, or fails each item with ``item_error`` (an error class) if that is; ``closed`` once the app closed it."""

    def __init__(self, encoder) -> None:
        self.encoder, self.entered, self.go = encoder, threading.Event(), threading.Event()
        self.fail: Exception | None = None
        self.item_error: type[Exception] | None = None

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def iter_encode(self, *args, **kwargs):
        self.entered.set()
        self.go.wait()
        if self.fail is not None:
            raise self.fail
        for batch in self.encoder.iter_encode(*args, **kwargs):
            yield [r if self.item_error is None else ItemResult(r.index, r.name, error=f"{r.name}: failed",
                                                                 error_class=self.item_error) for r in batch]


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
    assert "\n" not in message and len(message) < 1000 and response.json()["error"]["code"] == status
    for needle in needles:
        assert needle in message, message
    return message


@contextlib.contextmanager
def media_server(answer) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 whose GET calls ``answer(handler)``; yields its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        do_GET = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def held_answer(image: bytes, arrived, release: threading.Event):
    """A ``media_server`` answer that calls ``arrived()`` and sends ``image`` once ``release`` is set (at most
    START_S later): a request whose media stay in flight until the test lets them go."""
    def answer(handler) -> None:
        arrived()
        release.wait(START_S)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(image)))
        handler.end_headers()
        handler.wfile.write(image)

    return answer
