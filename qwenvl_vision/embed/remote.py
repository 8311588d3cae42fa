"""Objects in storage as inputs (docs/embed.md, "Objects in storage"): an INPUT or a table's path cell with a scheme
is read through fsspec (the ``[remote]`` extra); outputs stay local.

- Identity: ``inputs.urls.canonical`` with the object's version or ETag (``s3://b/k.jpg#etag=...``), read from the
  store's metadata (``fs.info``), several at once, when the inputs are gathered. Every writer stores the path,
  identity and error through ``inputs.urls.redacted``.
- Bytes: fetched on the thread that decodes the input (``FileBytes`` with ``fetch``), so ``--decode-timeout`` bounds
  the download too. A version is read by its id (S3); an ETag, or a version a store cannot be asked for, is checked
  against the object's metadata once its bytes are read. A body is held to ``FileBytes.read``'s limit
  (``--decode-mib``): a larger size announced is refused before any byte is read, and a read (a server may announce
  none, or lie) stops one byte past it.
- Failures: a transient error (a dropped connection, a server error) is retried ``RETRIES`` times with backoff, a
  request unanswered for ``TIMEOUT_S`` is not; a missing, vanished or refused object, a redirect to another scheme
  or in a loop, one too large or still failing is one failed input naming the URL and what happened.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ConfigError, PreprocessError
from ..inputs.pixels import FileBytes
from ..inputs.urls import canonical, redacted, redacted_text

RETRIES = 3  # attempts after the first, on transient errors
BACKOFF_S = 0.25  # doubled after each attempt
TIMEOUT_S = 60  # per request (connect and read), where the store takes one
INFO_WORKERS = 8  # metadata requests in flight while gathering
EXTRA = "pip install 'qwenvl-vision[remote]'"
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)


def require_fsspec(url: str) -> None:
    """A missing fsspec is the run's setup error (``ConfigError``), raised once for all its URLs."""
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise ConfigError(f"{redacted(url)}: reading URLs needs fsspec: {EXTRA}") from None


def filesystem(url: str) -> tuple[Any, str]:
    """(the fsspec file system for ``url``, the path in it), with request timeouts where the store takes them;
    a scheme fsspec does not know, or whose package is missing, is this input's ``PreprocessError``."""
    require_fsspec(url)
    import fsspec

    protocol, rest = url.split("://", 1)
    protocol = protocol.lower()
    url = f"{protocol}://{rest}"  # S3://b/k as s3://b/k: file systems strip their own spelling only
    options: dict[str, Any] = {}
    if protocol in ("http", "https"):
        try:
            import aiohttp
        except ImportError:
            raise PreprocessError(f"{redacted(url)}: reading http(s) needs aiohttp: {EXTRA}") from None
        # A silence is bounded, not a long download (--decode-timeout bounds that).
        options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(sock_connect=TIMEOUT_S, sock_read=TIMEOUT_S)}
    elif protocol in ("s3", "s3a"):
        options["config_kwargs"] = {"connect_timeout": TIMEOUT_S, "read_timeout": TIMEOUT_S,
                                    "retries": {"max_attempts": 1}}  # botocore's, and s3fs's below: ours only
    try:
        # Not url_to_fs: it reads '::' in a key as URL chaining. The settings a URL carries (an FTP or HDFS host,
        # an S3 ?versionId=) are the file system's, as url_to_fs takes them.
        cls = fsspec.get_filesystem_class(protocol)
        fs = fsspec.filesystem(protocol, **{**cls._get_kwargs_from_urls(url), **options})
        if protocol in ("s3", "s3a"):
            fs.retries = 1  # s3fs retries a timed-out request 5 times: the retries are ours
        return fs, fs._strip_protocol(url)
    except Exception as e:  # noqa: BLE001 - an unknown scheme, a missing package, a store refusing to connect
        raise PreprocessError(f"{redacted(url)}: no file system for {protocol}:// here ({failure(e)[0]})") from None


def retried(what: Callable[[], Any], url: str, action: str) -> Any:
    """``what()``, retried with backoff while its error is transient (``failure``); a permanent one, or the last,
    as a one-line PreprocessError."""
    for attempt in range(RETRIES + 1):
        try:
            return what()
        except PreprocessError:
            raise  # this input's one line already (an object above the decode budget)
        except Exception as e:  # noqa: BLE001 - stores raise their own types for dropped connections and 5xx
            why, transient = failure(e)
            if not transient or attempt == RETRIES:
                after = f" after {attempt + 1} attempts" if transient else ""
                raise PreprocessError(redacted_text(f"{redacted(url)}: cannot {action}{after} ({why})", url)) from None
        time.sleep(BACKOFF_S * 2**attempt)


def failure(error: BaseException) -> tuple[str, bool]:
    """(what happened, in a few words; whether trying again may help) of a store's error. fsspec raises its own error
    from aiohttp's (its http(s) metadata read, FileNotFoundError from whatever failed), so the nearest of the error's
    causes that tells decides: a bad redirect never helps, an HTTP status may (a server's 5xx, 408 and 429; never 404
    or a refused signature); else the error's type (a connection refused or dropped may; a missing object, a refused
    certificate or a request unanswered for ``TIMEOUT_S`` never: it would hold the input that long again). A store
    without credentials is the run's ``ConfigError``."""
    aiohttp, seen = None, error
    # Imported wherever one of its errors can be there; the import statement waits for a thread still importing it
    # (sys.modules holds a module half made until then; None where it is blocked).
    if sys.modules.get("aiohttp") is not None:
        import aiohttp
    boto = sys.modules.get("botocore.exceptions")  # s3fs's: by then imported whole
    if boto is not None and isinstance(error, boto.NoCredentialsError):  # every object of the store would fail
        raise ConfigError(f"{type(error).__name__}: {error}: set the store's credentials as boto3 reads them "
                          f"(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, a role)") from None
    for _ in range(8):  # a chain of causes, never a cycle's worth
        if aiohttp and isinstance(seen, aiohttp.TooManyRedirects):
            return f"a redirect loop: too many redirects ({len(seen.history)} followed)", False
        if aiohttp and isinstance(seen, aiohttp.NonHttpUrlRedirectClientError):
            return f"a redirect to another scheme refused: {redacted_text(str(seen))[:300]}", False
        if isinstance(seen, (TimeoutError, asyncio.TimeoutError)):  # not one class before Python 3.11
            return f"no answer within {TIMEOUT_S} s", False
        if aiohttp and isinstance(seen, aiohttp.ClientConnectionError):
            error = seen  # the connection failed (fsspec re-raises it as FileNotFoundError): it may come back
            break
        status = getattr(seen, "status", None)
        if type(status) is int and 100 <= status < 600:
            if status in (401, 403):
                return f"refused, HTTP {status}: no access, or a signature expired", False
            return "not found" if status in (404, 410) else f"HTTP {status}", status >= 500 or status in (408, 429)
        if isinstance(seen, ValueError) and seen is not error:  # fsspec's "not found" from yarl's refusal
            return f"not a valid URL: {redacted_text(str(seen))[:200]}", False
        if (seen := seen.__cause__ or seen.__context__) is None:
            break
    if isinstance(error, FileNotFoundError):
        return "not found", False
    text = " ".join(redacted_text(str(error)).split()) or type(error).__name__  # a store's message may hold the URL
    permanent = isinstance(error, PERMANENT) or aiohttp and isinstance(error, aiohttp.ClientSSLError) or \
        boto is not None and isinstance(error, boto.ParamValidationError)  # a certificate; a request s3fs made wrong
    return f"{type(error).__name__}: {text[:300]}", not permanent


def identity(url: str) -> str:
    """The input's identity: the URL, and the object's version or ETag where the store gives one."""
    fs, path = filesystem(url)
    info = retried(lambda: fs.info(path), url, "read its metadata")
    if info.get("type") == "directory":
        raise PreprocessError(f"{redacted(url)}: a folder, not an object")
    for field, label in (("VersionId", "version"), ("version_id", "version"), ("ETag", "etag"), ("etag", "etag")):
        value = info.get(field)
        if value:
            return f"{canonical(url)}#{label}={str(value).strip(chr(34))}"
    return canonical(url)


def identities(urls: list[str]) -> dict[str, tuple[str, str | None]]:
    """url -> (identity, None), or (the URL, why it cannot be read): several metadata requests at once."""
    for url in urls[:1]:
        require_fsspec(url)  # a missing extra is the run's setup error, raised once here

    def one(url: str) -> tuple[str, str | None]:
        try:
            return identity(url), None
        except PreprocessError as e:
            return canonical(url), str(e)
        except ConfigError:
            raise  # the run's (no credentials): every other URL of the store would fail as this one
        except Exception as e:  # noqa: BLE001 - a store's own error outside the retried calls: this input's
            return canonical(url), redacted_text(f"{redacted(url)}: cannot read its metadata ({failure(e)[0]})", url)

    with ThreadPoolExecutor(INFO_WORKERS) as pool:
        return dict(zip(urls, pool.map(one, urls), strict=True))


def pin_of(url: str, key: str | None) -> tuple[str, str] | None:
    """("version" or "etag", value) that the identity ``key`` of ``url`` pins (``identity``), else None. Read after
    the URL, never searched for in it: a URL may hold '#', and so may an ETag."""
    base = canonical(url)
    if key is None or not key.startswith(base + "#"):
        return None
    label, equals, value = key[len(base) + 1:].partition("=")
    return (label, value) if equals and label in ("version", "etag") else None


def over_budget(url: str, limit: int, size: int | None = None) -> PreprocessError:
    """The failure of an object whose body (``size`` bytes, where announced) is above the decode budget."""
    said = "more" if size is None else f"{size:,} bytes, more"
    return PreprocessError(f"{redacted(url)}: {said} than the decode budget of {limit:,} bytes (decode_bytes, "
                           f"embed --decode-mib)")


def read_within(fs: Any, path: str, url: str, limit: int | None) -> bytes:
    """The object's bytes, at most one past ``limit`` (None: no bound): a size announced above it is refused unread
    (``over_budget``), and a read stops one byte past it (a server may send no size, or more than it announced)."""
    if limit is None:
        return fs.cat_file(path)
    size = fs.size(path)
    if size is not None and size > limit:
        raise over_budget(url, limit, size)
    # Over http(s) a stream (block_size 0): fsspec's ranged file reads a 206 answer whole, however long it runs.
    streamed = {"block_size": 0} if url.split("://", 1)[0].lower() in ("http", "https") else {}
    with fs.open(path, "rb", **streamed) as f:
        chunks, got = [], 0
        while got <= limit and (chunk := f.read(limit + 1 - got)):  # a stream gives what has come so far
            chunks.append(chunk)
            got += len(chunk)
    return b"".join(chunks)


def read_version(fs: Any, path: str, url: str, version: str, limit: int | None) -> bytes:
    """An S3 object's version, as ``read_within`` reads the latest: its size asked first (a range on an empty
    object is refused, and one above the budget would be fetched up to it)."""
    bucket, key, _ = fs.split_path(path)  # s3fs's info takes no version unless the whole file system is version-aware
    size = fs.call_s3("head_object", Bucket=bucket, Key=key, VersionId=version)["ContentLength"]
    if limit is not None and size > limit:
        raise over_budget(url, limit, size)
    end = None if limit is None else limit + 1
    return b"" if size == 0 else fs.cat_file(path, version_id=version, start=0, end=end)


def fetch(url: str, key: str | None = None, limit: int | None = None) -> bytes:
    """The object's bytes, at most ``limit`` of them (the decode budget it is decoded under; None: no bound); with
    ``key`` (its identity as listed), those of the object the key names, or a PreprocessError saying it changed."""
    fs, path = filesystem(url)
    pin = pin_of(url, key)
    # S3 reads a version by its id (s3fs's ranged reads of a large object size it by the latest version).
    by_version = pin is not None and pin[0] == "version" and url.split("://", 1)[0].lower() in ("s3", "s3a")
    data = retried(lambda: read_version(fs, path, url, pin[1], limit) if by_version else
                   read_within(fs, path, url, limit), url, "read it")
    if limit is not None and len(data) > limit:
        raise over_budget(url, limit)
    if pin is not None and not by_version:
        fs.invalidate_cache(path)  # the metadata as it is now, not as listed
        now = pin_of(url, identity(url))
        if now != pin:
            raise PreprocessError(f"{redacted(url)}: changed since the run listed it ({pin[0]} {pin[1][:64]}, now "
                                  f"{'none' if now is None else now[1][:64]}); a --resume embeds the new object")
    return data


def remote_file(url: str, key: str | None = None) -> FileBytes:
    """The object's bytes, fetched when its decoder first asks for them (with ``key``: the object it names)."""
    return FileBytes(url, fetch=lambda limit: fetch(url, key, limit))
