"""URLs as the project keeps them: ``canonical``, an object's identity, and ``redacted``, what a record or a message
shows. Neither holds a secret: a password in the URL, or the values that sign it (a presigned S3 or GCS URL, a
CloudFront signature, an Azure SAS token).

- ``canonical``: without the password and user, and (for http(s), where a query is a query) without the signing
  parameters, so a URL signed again for a ``--resume`` names the same object; every other query parameter stays
  (it may choose the content: a size, a version).
- ``redacted``: the URL with the password and each signing value replaced by ``***``, its other parts as given.

An s3:// or gs:// path has no query: '?' and '#' are characters of its key, kept as they are.
"""

from __future__ import annotations

import re

# Query parameters that sign a URL or carry a credential: AWS SigV4 and SigV2, GCS V4 and V2, CloudFront, Azure SAS.
SIGNING_PREFIXES = ("x-amz-", "x-goog-")
SIGNING_NAMES = frozenset({
    "signature", "expires", "awsaccesskeyid", "googleaccessid", "key-pair-id", "policy",
    "sig", "se", "sp", "sv", "sr", "st", "spr", "ss", "srt", "si", "sdd", "skoid", "sktid", "skt", "ske", "sks",
    "skv", "saoid", "suoid", "scid",
})
HIDDEN = "***"
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def signing(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith(SIGNING_PREFIXES) or lowered in SIGNING_NAMES


def _rewritten(url: str, hide: bool) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{HIDDEN}@{host}" if hide and colon else (f"{user}@{host}" if hide else host)
    if scheme.lower() in ("http", "https") and "?" in tail:
        path, _, query = tail.partition("?")
        query, hash_, fragment = query.partition("#")
        kept = []
        for parameter in query.split("&"):
            name, equals, _ = parameter.partition("=")
            if not signing(name):
                kept.append(parameter)
            elif hide:
                kept.append(f"{name}{equals}{HIDDEN}")
        tail = path + ("?" + "&".join(kept) if kept else "") + hash_ + fragment
    return f"{scheme}{sep}{netloc}{slash}{tail}"


def canonical(url: str) -> str:
    """The object ``url`` names, without credentials or signature (see the module)."""
    return _rewritten(url, hide=False)


def redacted(url: str) -> str:
    """``url`` with its password and signing values as ``***`` (see the module)."""
    return _rewritten(url, hide=True)


def redacted_text(text: str | None) -> str | None:
    """``text`` (a message, a path) with every URL in it redacted."""
    return text if text is None else URL_IN_TEXT.sub(lambda m: redacted(m.group(0)), text)
