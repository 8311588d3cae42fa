"""URLs as the project keeps them: ``canonical``, an object's identity, and ``redacted``, what a record or a message
shows. Neither holds a secret: a password in the URL, or the values that sign it (a presigned S3 or GCS URL, a
CloudFront or S3 SigV2 signature, an Azure SAS token) or carry a credential (``token``, ``access_token``,
``api_key``).

- ``canonical``: without the password (and for http(s) without the user too, which only authenticates; elsewhere
  the user may choose the object: ``abfs://container@account``), and for http(s) without the signing and credential
  parameters, so a URL signed again for a ``--resume`` names the same object; every other query parameter stays (it
  may choose the content: a size, a version).
- ``redacted``: the URL with the password (for http(s) a user given alone too: a token, ``https://TOKEN@host``) and
  each signing or credential value replaced by ``***``.

A signature's companions count only beside it: Azure's short names (``sp``, ``se``, ...) where ``sig`` and ``sv``
are both given (every SAS has them), ``Expires`` and ``Policy`` where ``Signature`` or ``Key-Pair-Id`` is, so
``?sig=2`` alone or ``?sp=1`` stays.
An s3:// or gs:// path has no query: '?' and '#' are characters of its key, kept as they are.
"""

from __future__ import annotations

import re

SIGNING_PREFIXES = ("x-amz-", "x-goog-")
SIGNING_NAMES = frozenset({"signature", "awsaccesskeyid", "googleaccessid", "key-pair-id", "token", "access_token",
                           "api_key", "apikey"})
# Azure SAS: signing where "sig" and "sv" are both given.
SAS_NAMES = frozenset({"sig", "sv", "ss", "srt", "sp", "se", "st", "spr", "si", "sr", "sdd", "skoid", "sktid", "skt",
                       "ske", "sks", "skv", "saoid", "suoid", "scid"})
# S3 SigV2 and CloudFront: signing where "Signature" or "Key-Pair-Id" is given.
SIGNED_URL_NAMES = frozenset({"expires", "policy"})
HIDDEN = "***"
# A URL inside a message: it ends before the punctuation that follows it in a sentence.
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>.,;:)\]]")


def _signing_names(names: list[str]) -> set[str]:
    """Which of a query's parameter names (lowercased) sign it or carry a credential."""
    present = set(names)
    signing = {n for n in present if n.startswith(SIGNING_PREFIXES) or n in SIGNING_NAMES}
    if {"sig", "sv"} <= present:
        signing |= present & SAS_NAMES
    if present & {"signature", "key-pair-id"}:
        signing |= present & SIGNED_URL_NAMES
    return signing


def _split(url: str) -> tuple[str, str, str, bool]:
    """(scheme, netloc, the rest, whether http(s)); a name without a scheme is all rest."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", "", url, False
    http = scheme.lower() in ("http", "https")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest)) if http else \
        (rest.find("/") if "/" in rest else len(rest))
    return scheme, rest[:end], rest[end:], http


def _rewritten(url: str, hide: bool) -> str:
    scheme, netloc, tail, http = _split(url)
    if not scheme:
        return url
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        if hide:
            netloc = f"{user}:{HIDDEN}@{host}" if colon else f"{HIDDEN}@{host}" if http else netloc
        else:
            netloc = host if http else f"{user}@{host}"
    if http and "?" in tail:
        path, _, query = tail.partition("?")
        query, hash_, fragment = query.partition("#")
        parameters = query.split("&")
        signing = _signing_names([p.partition("=")[0].lower() for p in parameters])
        kept = []
        for parameter in parameters:
            name, equals, _ = parameter.partition("=")
            if name.lower() not in signing:
                kept.append(parameter)
            elif hide:
                kept.append(f"{name}{equals}{HIDDEN}")
        tail = path + ("?" + "&".join(kept) if kept else "") + hash_ + fragment
    return f"{scheme}://{netloc}{tail}"


def canonical(url: str) -> str:
    """The object ``url`` names, without credentials or signature (see the module)."""
    return _rewritten(url, hide=False)


def redacted(url: str) -> str:
    """``url`` with its password and signing values as ``***`` (see the module)."""
    return _rewritten(url, hide=True)


def redacted_text(text: str | None, url: str = "") -> str | None:
    """``text`` (a message, a path) with every URL in it redacted, and so ``url``'s (what it is about) user and
    password wherever they are: a store may quote them without the scheme (an S3 bucket's name)."""
    if text is None:
        return None
    user, colon, password = _split(url)[1].rpartition("@")[0].partition(":")
    text = URL_IN_TEXT.sub(lambda m: redacted(m.group(0)), text)
    return text.replace(f"{user}:{password}@", f"{user}:{HIDDEN}@") if password else text
