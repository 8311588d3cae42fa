"""A request's items: the image and video parts of its chat messages, in vLLM 0.33's content-part shapes
(``{"type": "image_url", "image_url": {"url": URL}, "uuid": ID}``, the url also as a plain string, ``video_url``
alike), each checked against the media policy and handed to the encoder as ``FileBytes`` named by its place in
the request (``messages[0].content[1]``), with the extension that tells the decoder an image from a video.

Sources: ``data:`` URLs (base64) always; http(s) only from ``allowed_domains``, redirects followed only within
them; ``file://`` only under ``local_root`` (symbolic links resolved before the check), regular files only. URLs and
files are read when the app asks (``FileBytes.read``, in its media threads; a URL by aiohttp on the event loop, which
its thread waits for), within the decode budget's bytes and, for a URL, the decode timeout as a whole; never on the
encoder's thread."""

from __future__ import annotations

import asyncio
import base64
import mimetypes
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import aiohttp

from ..errors import PreprocessError, QwenVLVisionError
from ..inputs.pixels import FileBytes
from ..inputs.urls import redacted
from ..inputs.video_io import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from ..outputs.vllm_cache import ITEM_NAME

TEXT_TYPES = ("text", "input_text", "refusal", "thinking")
EXTENSIONS = {"image": (IMAGE_EXTENSIONS, ".png"), "video": (VIDEO_EXTENSIONS, ".mp4")}


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


@dataclass
class Item:
    label: str  # its place in the request: messages[i].content[j]
    modality: str
    uuid: str | None
    file: FileBytes


def request_items(body: Any, policy: MediaPolicy, need_uuid: bool, fetch_url: Callable[[str, str, int], bytes]
                  ) -> list[Item]:
    """The image and video items of a chat request's messages, in request order; text is skipped. ``fetch_url(url,
    label, limit)`` reads an http(s) item (``Fetcher.read``)."""
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
        for c, part in enumerate(content if isinstance(content, list) else []):  # a string content is text
            label = f"messages[{m}].content[{c}]"
            if not isinstance(part, dict):
                raise RequestError(f"{label}: a content part is an object")
            kind = part.get("type")
            if kind in TEXT_TYPES:
                continue
            field = next((f for f in ("image_url", "video_url") if f in part), None)
            if field is None or kind not in (None, field, "input_image"):
                raise RequestError(f"{label}: content type {kind!r} is not served (image_url, video_url or text)")
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
            items.append(Item(label, modality, uuid, media_file(url, label, modality, policy, fetch_url)))
    return items


def media_file(url: str, label: str, modality: str, policy: MediaPolicy,
               fetch_url: Callable[[str, str, int], bytes]) -> FileBytes:
    """The item's bytes (a data URL's now; a URL's or a file's when read, at most the bytes the read is given), or a
    RequestError naming it."""
    known, default = EXTENSIONS[modality]
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        header, comma, payload = url[5:].partition(",")
        mime, *params = header.split(";")
        if not comma or "base64" not in params:
            raise RequestError(f"{label}: a data URL must be data:<mime type>;base64,<data>")
        mime = mime.strip().lower()
        if not mime.startswith(f"{modality}/"):
            raise RequestError(f"{label}: media type {mime[:80]!r} is not {modality}/* ({modality}_url)", 415)
        ext = mimetypes.guess_extension(mime)  # the decoders read the content: a name only tells the kind
        try:
            return FileBytes(label + (ext if ext in known else default), base64.b64decode(payload, validate=True))
        except ValueError:  # binascii.Error, or a character outside ASCII
            raise RequestError(f"{label}: the data URL's base64 is invalid") from None
    parts = url_parts(url, label)
    ext = Path(parts.path).suffix.lower()
    name = label + (ext if ext in known else default)
    if scheme in ("http", "https"):
        check_remote(url, label, policy)
        return FileBytes(name, fetch=lambda limit: fetch_url(url, label, limit))
    if scheme == "file":
        if policy.local_root is None:
            raise RequestError(f"{label}: file URLs are refused (start the server with --allowed-local-media-path)")
        if "\0" in unquote(parts.path):  # no path holds one: the OS would refuse it as a bug
            raise RequestError(f"{label}: the file URL holds a NUL byte")
        path = Path(unquote(parts.path)).resolve()
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
    """Refuse a URL (joined to ``base``) that is not http(s) from an allowed domain, with ``error``."""
    parts = url_parts(url, label, error, base)
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
        raise PreprocessError(f"{label}: more than the decode budget of {limit:,} bytes")
    return data


REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 10  # urllib's and aiohttp's own bound


class Fetcher:
    """http(s) media fetched by aiohttp on the app's event loop (``fetch``), one session for the app: connections
    reused, no cookie kept between requests, proxies from the environment as urllib takes them. ``read`` runs in a
    media thread, which waits for its fetch."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy

    async def __aenter__(self) -> Fetcher:
        self.loop = asyncio.get_running_loop()
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(),
                                             trust_env=True)  # no timeout of its own: fetch's deadline is the one
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.session.close()

    def read(self, url: str, label: str, limit: int) -> bytes:
        return asyncio.run_coroutine_threadsafe(fetch(self.session, url, label, self.policy, limit), self.loop).result()


async def fetch(session: aiohttp.ClientSession, url: str, label: str, policy: MediaPolicy, limit: int) -> bytes:
    """The URL's body, at most ``limit`` bytes (read one past it to tell), redirects followed only within the allowed
    domains; all of it, name lookups and a server trickling its bytes included, within the decode timeout."""
    async def body(at: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            async with session.get(at, allow_redirects=False) as response:  # a body left unread closes its connection
                if response.status in REDIRECTS:
                    target = response.headers.get("Location", "")
                    check_remote(target, f"{label}: a redirect to", policy, PreprocessError, at)
                    at = urljoin(at, target)
                    continue
                if response.status >= 400:
                    raise PreprocessError(f"{label}: {redacted(url)[:200]} answered HTTP {response.status}")
                size = response.content_length
                if size is not None and size > limit:  # refused before its bytes come
                    raise PreprocessError(f"{label}: {size:,} bytes, more than the decode budget of {limit:,} bytes")
                data = bytearray()
                try:
                    while len(data) <= limit and (chunk := await response.content.readany()):
                        data += chunk
                except aiohttp.ClientPayloadError:  # the server closed before the length it announced
                    raise PreprocessError(f"{label}: {redacted(url)[:200]} ended after {len(data):,}"
                                          f"{f' of its {size:,}' if size else ''} bytes") from None
                return within(bytes(data), label, limit)
        raise PreprocessError(f"{label}: {redacted(url)[:200]}: more than {MAX_REDIRECTS} redirects")

    try:
        return await asyncio.wait_for(body(url), policy.timeout_s)
    except asyncio.TimeoutError:
        raise PreprocessError(f"{label}: {redacted(url)[:200]} not read within the decode timeout "
                              f"({policy.timeout_s:g} s)") from None
    except PreprocessError:  # the item's, said above
        raise
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: a URL yarl cannot take (a bad port),
        why = type(e).__name__ if isinstance(e, ValueError) else e  # whose text would show the URL unredacted
        raise PreprocessError(f"{label}: cannot fetch {redacted(url)[:200]} ({why})") from None
