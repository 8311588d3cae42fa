"""A stand-in of the Hugging Face Hub for tests: loopback HTTP only. ``FakeHub`` serves checkpoint folders the way
``hf_hub_download`` expects the Hub to (HEAD/GET on ``/{repo}/resolve/{revision}/{file}``, ETags, commit headers,
ranged resumes, the Hub's error codes) and records every request; ``serve_hub`` runs one and points huggingface_hub
at it with an empty cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Revision:
    commit: str
    files: dict[str, Path]  # repo path -> file on disk
    etags: dict[str, str] = field(default_factory=dict)


class FakeHub:
    """Repos -> revisions (branch names and their commit hashes) -> files; a record of every request."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Revision]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, decoded path)
        self.cut: set[str] = set()  # files whose body stops half way, the connection dropped
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.endpoint = ""

    def add(self, repo_id: str, folder: Path, *, branch: str = "main") -> str:
        """Serve every file of `folder` as `repo_id` at `branch`; return the commit hash it resolves to."""
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
        # The Hub's ETag is the git blob sha1 for small files and the LFS sha256 for large ones; any stable
        # content hash will do here.
        etags = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()}
        revision = Revision(commit, files, etags)
        refs = self.repos.setdefault(repo_id, {})
        refs[branch] = revision
        refs[commit] = revision
        return commit

    def log(self, method: str, path: str) -> None:
        with self.lock:
            self.requests.append((method, path))

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def resolve_paths(self, method: str | None = None) -> list[str]:
        with self.lock:
            return [p for m, p in self.requests if method is None or m == method]

    def files_touched(self) -> set[str]:
        return {path.split("/resolve/", 1)[1].split("/", 1)[1] for path in self.resolve_paths()}

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so no pooled keep-alive connection outlives hub.stop().
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:  # keep pytest output quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _reply(self, status: int, headers: dict[str, str], data: bytes = b"", body: bool = True,
                   cut: bool = False) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and data:
                self.wfile.write(data[:len(data) // 2] if cut else data)  # one request a connection: it closes

        def _error(self, status: int, code: str, message: str, commit: str | None = None, body: bool = True) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
            if commit is not None:
                headers["X-Repo-Commit"] = commit  # the Hub sends it with EntryNotFound: HF caches the absence
            self._reply(status, headers, f'{{"error": "{message}"}}'.encode(), body)

        def _serve(self, body: bool) -> None:
            raw = urlsplit(self.path).path
            parts = raw.split("/")  # "", org, name, "resolve", revision (quoted, may hold %2F), file...
            hub.log(self.command, unquote(raw))
            if len(parts) < 6 or parts[3] != "resolve":
                return self._error(404, "EntryNotFound" if parts[1:2] == ["api"] else "RepoNotFound",
                                   "Not served by this stand-in", body=body)
            repo_id = f"{unquote(parts[1])}/{unquote(parts[2])}"
            revision_name, filename = unquote(parts[4]), unquote("/".join(parts[5:]))
            refs = hub.repos.get(repo_id)
            if refs is None:
                return self._error(404, "RepoNotFound", "Repository not found", body=body)
            revision = refs.get(revision_name)
            if revision is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + revision_name, body=body)
            path = revision.files.get(filename)
            if path is None:
                return self._error(404, "EntryNotFound", "Entry not found", revision.commit, body=body)
            data = path.read_bytes()
            etag = f'"{revision.etags[filename]}"'
            headers = {"X-Repo-Commit": revision.commit, "ETag": etag, "X-Linked-Etag": etag,
                       "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            status, start = 200, 0
            requested = self.headers.get("Range", "")
            if body and requested.startswith("bytes=") and requested.endswith("-"):  # resume: "bytes=N-"
                start = int(requested[len("bytes="):-1])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._reply(status, headers, data[start:], body, filename in hub.cut)

    return Handler


def use_endpoint(monkeypatch, endpoint: str) -> None:
    """Point huggingface_hub at `endpoint` (it read HF_ENDPOINT into its constants at import time)."""
    from huggingface_hub import constants as hf_constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@contextlib.contextmanager
def serve_hub(tmp_path: Path, monkeypatch) -> Iterator[FakeHub]:
    """A running stand-in Hub; huggingface_hub pointed at it, with an empty temporary cache and HF home
    (`tmp_path/hf-home`). The `hub` fixture of conftest.py is this, for one test."""
    from huggingface_hub import constants as hf_constants

    # huggingface_hub read HF_HUB_CACHE / HF_HUB_OFFLINE into constants at import time, too.
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.server = server
    fake.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    use_endpoint(monkeypatch, fake.endpoint)
    cache = tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    try:  # user-agent agent detection may fetch {ENDPOINT}/api/agent-harnesses once: keep it off the record
        from huggingface_hub.utils import _detect_agent
        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    except (ImportError, AttributeError):
        pass
    fake.cache = cache
    try:
        yield fake
    finally:
        fake.stop()
        thread.join(timeout=5)
