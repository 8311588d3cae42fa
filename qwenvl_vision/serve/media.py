"""A request's items: the image and video parts of its chat messages, in vLLM 0.33's content-part shapes
(``{"type": "image_url", "image_url": {"url": URL}, "uuid": ID}``, the url also as a plain string, ``video_url``
alike), each checked against the media policy and handed to the encoder as ``FileBytes`` named by its place in
the request (``messages[0].content[1]``), with the extension that tells the decoder an image from a video.

Sources: ``data:`` URLs (base64) always; http(s) only from ``allowed_domains``, redirects followed only within
them; ``file://`` only under ``local_root`` (symbolic links resolved before the check), regular files only. URLs and
files are read when the app asks (``FileBytes.read``, in its media threads), within the bytes an item may take and, for
a URL, the decode timeout as a whole; never on the encoder's thread."""

from __future__ import annotations

import base64
import contextlib
import http.client
import mimetypes
import os
import reprlib
import socket
import stat
import string
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urljoin, urlsplit

from ..errors import PreprocessError, QwenVLVisionError
from ..inputs.pixels import FileBytes
from ..inputs.urls import redacted
from ..inputs.video_io import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from ..outputs.vllm_cache import ITEM_NAME

TEXT_TYPES = ("text", "input_text", "refusal", "thinking")
EXTENSIONS = {"image": (IMAGE_EXTENSIONS, ".png"), "video": (VIDEO_EXTENSIONS, ".mp4")}
LIMIT = "the most one item may read (--decode-mib, or --max-bodies-mib where less)"


class RequestError(QwenVLVisionError, ValueError):
    """A request the server refuses, with the HTTP status it answers (one line naming the item)."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: frozenset[str]  # lowercase, as urlsplit's hostname
    local_root: Path | None  # resolved
    timeout_s: float  # a fetch's, the decode timeout
    # The fetches under way, by their file: cut when their request is answered without them (it would hold a media
    # thread, and the process's exit, until the decode timeout).
    reading: dict[FileBytes, Connections] = field(default_factory=dict, compare=False)


@dataclass
class Item:
    label: str  # its place in the request: messages[i].content[j]
    modality: str
    uuid: str | None
    file: FileBytes


def request_items(body: Any, policy: MediaPolicy, need_uuid: bool) -> list[Item]:
    """The image and video items of a chat request's messages, in request order; text is skipped."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        raise RequestError("messages: a list of chat messages is required")
    for name in ("mm_processor_kwargs", "media_io_kwargs"):  # vLLM hashes them with each uuid: the item is elsewhere
        if body.get(name):
            raise RequestError(f"{name}: not served (preprocessing is the command line's; vLLM's consumer would "
                               f"look for each item under a hash of these and its uuid)")
    items, modalities = [], {}
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{m}]: a message is an object with role and content")
        content = message.get("content")
        if not isinstance(content, (list, str, type(None))):  # an item there would be dropped unanswered
            raise RequestError(f"messages[{m}].content: a string or a list of content parts")
        for c, part in enumerate(content if isinstance(content, list) else []):  # a string content is text
            label = f"messages[{m}].content[{c}]"
            if not isinstance(part, dict):
                raise RequestError(f"{label}: a content part is an object")
            kind = part.get("type")
            if kind in TEXT_TYPES:
                continue
            field = next((f for f in ("image_url", "video_url") if f in part), None)
            if field is None or kind not in (None, field, "input_image"):
                raise RequestError(f"{label}: content type {reprlib.repr(kind)} is not served (image_url, video_url or "
                                   f"text)")
            url = part[field].get("url") if isinstance(part[field], dict) else part[field]
            if not isinstance(url, str):
                raise RequestError(f"{label}: {field} has no url")
            uuid = part.get("uuid")
            uuid = None if uuid is None else str(uuid)  # vLLM takes any value as its text
            if uuid is None and need_uuid:
                raise RequestError(f"{label}: no uuid: the encoder role writes each item under its uuid (vLLM's "
                                   f"consumer finds it there); give every image and video a uuid")
            if uuid is not None and not ITEM_NAME.fullmatch(uuid):
                raise RequestError(f"{label}: uuid {uuid[:140]!r} is not a plain token ([A-Za-z0-9_-], at most "
                                   f"128 characters)")
            modality = field.removesuffix("_url")
            if uuid is not None and modalities.setdefault(uuid, modality) != modality:  # one file under it, one kind
                raise RequestError(f"{label}: uuid {uuid!r} is given to both an image and a video: give each item "
                                   f"its own uuid")
            items.append(Item(label, modality, uuid, media_file(url, label, modality, policy)))
    return items


def media_file(url: str, label: str, modality: str, policy: MediaPolicy) -> FileBytes:
    """The item's bytes (a data URL's now; a URL's or a file's when read, at most the bytes the read is given), or a
    RequestError naming it."""
    known, default = EXTENSIONS[modality]
    try:
        url.encode()
    except UnicodeEncodeError:  # JSON's lone "\ud800": no character, so no file, host or message can hold it
        raise RequestError(f"{label}: the URL holds a lone surrogate escape, which names no character") from None
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        header, comma, payload = url[5:].partition(",")
        mime, *params = header.split(";")
        if not comma or "base64" not in params:
            raise RequestError(f"{label}: a data URL must be data:<mime type>;base64,<data>")
        # Any media type, as vLLM's: the decoders read the content, and a name only tells the kind.
        ext = mimetypes.guess_extension(mime.strip().lower())
        try:
            return FileBytes(label + (ext if ext in known else default), base64.b64decode(payload, validate=True))
        except ValueError:  # binascii.Error, or a character outside ASCII
            raise RequestError(f"{label}: the data URL's base64 is invalid") from None
    parts = url_parts(url, label)
    ext = Path(parts.path).suffix.lower()
    name = label + (ext if ext in known else default)
    if scheme in ("http", "https"):
        check_remote(url, label, policy)
        file = FileBytes(name, fetch=lambda limit: fetch(url, label, policy, limit, file))
        return file
    if scheme == "file":
        if policy.local_root is None:
            raise RequestError(f"{label}: file URLs are refused (start the server with --allowed-local-media-path)")
        if "\0" in unquote(parts.path):  # no path holds one: the OS would refuse it as a bug
            raise RequestError(f"{label}: the file URL holds a NUL byte")
        path = Path(os.path.realpath(unquote(parts.path)))  # a link loop resolves as far as it goes (read: ELOOP)
        if parts.netloc not in ("", "localhost") or not path.is_relative_to(policy.local_root):
            raise RequestError(f"{label}: {url[:200]} is not under --allowed-local-media-path")
        return FileBytes(name, fetch=lambda limit: read_local(path, label, limit))
    raise RequestError(f"{label}: URL scheme {scheme[:20]!r} is not served (data, http(s), file)")


def url_parts(url: str, label: str, error: type[Exception] = RequestError, base: str = "") -> SplitResult:
    """``url`` (joined to ``base``) split, or ``error`` naming the item when it is malformed."""
    try:
        return urlsplit(urljoin(base, url))
    except ValueError:  # an unclosed IPv6 bracket, say
        raise error(f"{label}: {redacted(url)[:200]} is not a valid URL") from None


def check_remote(url: str, label: str, policy: MediaPolicy, error: type[Exception] = RequestError,
                 base: str = "") -> None:
    """Refuse a URL (joined to ``base``) that is not http(s) from an allowed domain, or carries credentials, with
    ``error``."""
    parts = url_parts(url, label, error, base)
    if "@" in parts.netloc:  # else urllib takes "user:password@host" for a host name that does not resolve
        raise error(f"{label}: {redacted(parts.geturl())[:200]} carries credentials, which are not sent: serve the "
                    f"media where no credentials are asked, or pass them as data URLs")
    if parts.scheme.lower() not in ("http", "https") or (parts.hostname or "") not in policy.allowed_domains:
        raise error(f"{label}: {redacted(parts.geturl())[:200]} is not an http(s) URL of --allowed-media-domains")


def read_local(path: Path, label: str, limit: int) -> bytes:
    try:  # stat within: it raises for a name too long, or a folder the server may not search
        if not stat.S_ISREG(path.stat().st_mode):  # a folder, or a FIFO, which would hold the reading thread for good
            raise RequestError(f"{label}: {path} is not a regular file")
        with open(path, "rb") as f:
            return within(f.read(limit + 1), label, limit)
    except OSError as e:
        raise RequestError(f"{label}: cannot read {path} ({e.strerror or e})") from None


def within(data: bytes, label: str, limit: int) -> bytes:
    if len(data) > limit:
        raise PreprocessError(f"{label}: more than {limit:,} bytes, {LIMIT}")
    return data


class Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed domain: another host, or a file, is the item's error."""

    def __init__(self, label: str, policy: MediaPolicy) -> None:
        self.label, self.policy = label, policy

    def http_error_302(self, req, fp, code, msg, headers):
        fp.close()  # its body unread (urllib would read all of it, unbounded)
        target = headers.get("location") or headers.get("uri") or ""
        check_remote(target, f"{self.label}: a redirect to", self.policy, PreprocessError, req.full_url)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class Connections(urllib.request.HTTPSHandler, urllib.request.HTTPHandler):
    """urllib's http(s) handlers, whose sockets ``cut`` shuts at the deadline: urllib's timeout bounds each socket
    operation, which a server trickling its TLS handshake, headers or body never trips. A socket is reached through
    a duplicate of it made when it connects (an SSL socket, or one a response reads, is not at hand: http.client
    drops the connection's once the headers are in, and TLS detaches it while shaking hands)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.deadline = time.monotonic() + timeout_s
        self.sockets: list[socket.socket] = []
        self.was_cut = False
        self.lock = threading.RLock()  # cut runs inside connect too

    def do_open(self, http_class, req, **kwargs):
        def connection(*args, **kw):
            conn = http_class(*args, **kw)
            conn._create_connection = self.connect  # http.client's seam for making its socket
            return conn
        return super().do_open(connection, req, **kwargs)

    def connect(self, address, timeout, source_address=None) -> socket.socket:  # http.client passes no source
        """``socket.create_connection``, but each of the host's addresses tried within the time left, not the whole
        timeout each (a host whose IPv6 and IPv4 addresses both drop packets held the fetch twice the timeout); a
        redirect's hop too. The name lookup is the resolver's, not bounded here."""
        error = OSError(f"no address for {address[0]}")
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
            if self.late:  # past the deadline, or cut
                raise TimeoutError
            left, sock = self.deadline - time.monotonic(), None
            try:
                sock = socket.socket(family, kind, proto)
                with self.lock:  # cut while connecting: shut, the connect ends at once
                    self.sockets.append(sock)
                sock.settimeout(max(left, 0.001))
                sock.connect(sockaddr)  # the whole address: an IPv6 one keeps its scope
                break
            except OSError as e:  # refused, timed out, or a family this machine lacks: the next address
                if sock is not None:
                    sock.close()
                error = e
        else:
            raise error
        with self.lock:
            try:
                self.sockets.append(sock.dup())
            except OSError:  # out of descriptors
                sock.close()
                raise
            if self.late:  # opened as the deadline passed
                self.cut()
        sock.settimeout(timeout)
        return sock

    @property
    def late(self) -> bool:
        return self.was_cut or time.monotonic() >= self.deadline  # the timer's clock need not be ours

    def cut(self) -> None:
        """Shut every socket (a read blocked on one returns); called at the deadline, by the timer."""
        with self.lock:
            self.was_cut = True
            for sock in self.sockets:
                with contextlib.suppress(OSError):  # its peer gone already
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self.lock:
            for sock in self.sockets:
                sock.close()
            self.sockets.clear()


def fetch(url: str, label: str, policy: MediaPolicy, limit: int, file: FileBytes) -> bytes:
    """The URL's body, at most ``limit`` bytes (read one past it to tell), all of it within the decode timeout,
    which a server trickling its bytes does not hold past it (``Connections``); ``policy.reading[file]`` while read."""
    connections = Connections(policy.timeout_s)
    opener = urllib.request.build_opener(Redirects(label, policy), connections)
    late = PreprocessError(f"{label}: {redacted(url)[:200]} not read within the decode timeout "
                           f"({policy.timeout_s:g} s)")
    timer = threading.Timer(policy.timeout_s, connections.cut)
    try:
        policy.reading[file] = connections
        timer.start()
        # Characters a path or query may not hold (an "é", a space) percent-encoded, as urllib does for a redirect;
        # the host as it is (http.client encodes a name of other letters by IDNA).
        parts = urlsplit(url)
        sent = parts._replace(path=quote(parts.path, safe=string.punctuation),
                              query=quote(parts.query, safe=string.punctuation)).geturl()
        with opener.open(sent, timeout=policy.timeout_s) as response:
            size = response.headers.get("content-length")
            if size and size.isdigit() and int(size) > limit:  # refused before its bytes come
                raise PreprocessError(f"{label}: {int(size):,} bytes, more than {limit:,}, {LIMIT}")
            chunks, read = [], 0
            while read <= limit and (chunk := response.read1(1 << 16)):
                chunks.append(chunk)
                read += len(chunk)
            if connections.late:  # a body cut short by the deadline can look whole (no length, or cut in the headers)
                raise late
            if read <= limit and response.length:  # the server closed before the length it announced
                raise PreprocessError(f"{label}: {redacted(url)[:200]} ended after {read:,} of its "
                                      f"{read + response.length:,} bytes")
            return within(b"".join(chunks), label, limit)  # bytes: BytesIO shares them
    except urllib.error.HTTPError as e:
        e.close()  # its connection, which the exception would hold until collected
        raise PreprocessError(f"{label}: {redacted(url)[:200]} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # HTTPException: a bad port, a broken
        # status line or chunked body
        if connections.late:
            raise late from None
        raise PreprocessError(f"{label}: cannot fetch {redacted(url)[:200]} ({getattr(e, 'reason', e)})") from None
    finally:
        timer.cancel()
        connections.close()
        policy.reading.pop(file, None)
