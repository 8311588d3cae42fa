"""WebDataset shards as inputs (docs/embed.md, "WebDataset shards"): an INPUT ending in ``.tar`` (or a brace pattern)
whose image and video members are inputs, each named ``{shard}/{member}``.

A shard is read as a stream, never extracted: its member headers are listed (an uncompressed tar holds each
member's bytes at one offset), and a member's bytes are read when it is decoded, within the decode budget
(``FileBytes``). A sample's key is the member name up to the first dot of its last path part, as webdataset groups
them. Members are as tar defines them (the last of a name is the one; a hard link reads its target's bytes). Refused,
one failed input each, never read: a member whose name leaves the shard (absolute, ``..``, empty parts), a symbolic
link member, a sparse member, one the shard's end cuts short or larger than the decode budget, and a shard that is
missing, not a tar or damaged (the members listed before the damage stay inputs).
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import PreprocessError
from ..inputs.pixels import FileBytes, is_url
from .remote import over_budget, remote_file

TAR_SUFFIX = ".tar"
KEY_COLUMN = "__key__"  # webdataset's name for a sample's key
TEXT_LIMIT = 1 << 20  # a carried member is text for a column: at most 1 MiB of it


@dataclass(frozen=True)
class Member:
    """One image or video member of a shard: where its bytes are."""

    shard: str  # as given
    name: str
    offset: int
    size: int


def is_shard(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIX)


def list_shard(shard: str, is_media: Callable[[str], bool], keep: tuple[str, ...]) -> list[tuple]:
    """The inputs ``shard`` holds, from its headers, each as ``Inputs.add`` takes it (path, why it failed or None,
    carried columns, Member, identity): every ``is_media(name)`` member in order, carrying its sample's key and the
    sample's ``keep`` extensions' members as text; then the shard itself where it is damaged (see the module)."""
    entries: dict[str, tuple[str, Member | str]] = {}  # a media member's name -> (its sample, its bytes or why not)
    texts: dict[str, dict[str, str | None]] = {}  # a sample's key -> {extension: text}
    try:
        if not stat.S_ISREG(os.stat(shard).st_mode):  # a FIFO's open would wait for a writer for good
            return [(shard, f"shard {shard}: not a regular file", None, None, None)]
        with open(shard, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
            end = os.fstat(raw.fileno()).st_size
            infos, damage = _headers(tar, raw, end)
            held: dict[str, tuple] = {}  # a name, normalised as tarfile finds a link's target -> _bytes_of it
            for info in infos:
                source, problem = held[os.path.normpath(info.name)] = _bytes_of(info, held, end)
                if info.isdir():
                    continue
                # '.' parts stay in the shard: ``tar -C dir .`` names every member ./x (webdataset reads them so).
                if info.name.startswith("/") or any(part in ("", "..") for part in info.name.split("/")):
                    problem = "its name leaves the shard (absolute, '..' or empty parts): refused, never read"
                folder, _, base = info.name.rpartition("/")
                stem, _, ext = base.partition(".")  # webdataset's grouping: 000123.seg.png is 000123's "seg.png"
                key = f"{folder}/{stem}" if folder else stem
                if is_media(info.name):
                    entries[info.name] = key, (f"member {info.name!r} of shard {shard}: {problem}" if problem
                                               else Member(shard, info.name, source.offset_data, source.size))
                elif ext in keep:
                    text = None
                    if not problem:
                        raw.seek(source.offset_data)
                        text = raw.read(min(source.size, TEXT_LIMIT)).decode("utf-8", "replace")
                    texts.setdefault(key, {})[ext] = text
    except FileNotFoundError:
        return [(shard, f"shard {shard}: file not found", None, None, None)]
    except (OSError, tarfile.TarError, ValueError) as e:  # ValueError: a malformed first header (see _headers)
        return [(shard, f"shard {shard} cannot be read as a tar file ({getattr(e, 'strerror', None) or e})", None,
                 None, None)]
    # A member's identity: the shard's real path and the name inside it, never normalised (a refused ``../x.jpg``
    # stays inside its shard's name and meets no real file's identity).
    real, found = os.path.realpath(shard), []
    for name, (key, got) in entries.items():
        columns = {KEY_COLUMN: key, **{ext: texts.get(key, {}).get(ext) for ext in keep}}
        found.append((f"{shard}/{name}", None, columns, got, f"{real}/{name}") if isinstance(got, Member)
                     else (f"{shard}/{name}", got, None, None, f"{real}/{name}"))
    damaged = f"shard {shard} is damaged ({damage}); the members before it are inputs"
    return found + ([(shard, damaged, None, None, None)] if damage else [])


def _headers(tar: tarfile.TarFile, raw, end: int) -> tuple[list[tarfile.TarInfo], str | None]:
    """Every member header tarfile reads, and what damage stopped it, if any. tarfile ends as quietly at a header
    it cannot read (after the first) as at tar's end of archive, so where it stopped is checked to be that end."""
    infos = []
    try:
        while (info := tar.next()) is not None:
            infos.append(info)
    except (tarfile.TarError, ValueError) as e:  # tarfile's int() of a malformed pax field raises ValueError
        return infos, f"{e} at byte {min(tar.offset, end)}"
    raw.seek(tar.offset)
    block = raw.read(2 * tarfile.BLOCKSIZE)
    why = "a header tarfile did not read"
    try:
        tarfile.TarInfo.frombuf(block[:tarfile.BLOCKSIZE], tar.encoding, tar.errors)
    except tarfile.EOFHeaderError:  # a zero block: the end, unless what follows it is not zeros as well
        if not block.strip(b"\0"):
            return infos, None
        why = "a zero block with data after it"
    except tarfile.EmptyHeaderError:
        why = "no end-of-archive blocks: cut short"
    except tarfile.HeaderError as e:
        why = str(e)
    return infos, f"{why} at byte {tar.offset}"


def _bytes_of(info: tarfile.TarInfo, held: dict[str, tuple], end: int) -> tuple[tarfile.TarInfo | None, str | None]:
    """(the member whose bytes ``info`` reads, or None; why it cannot be read, or None). ``held``: each name before
    it, normalised, with its own; ``end``: the shard's size."""
    if info.islnk():  # as tarfile.extractfile follows it: the last member of its target's name before it
        return held.get(os.path.normpath(info.linkname),
                        (None, f"a hard link to {info.linkname!r}, which no member before it holds"))
    if info.issym():
        return None, f"a symbolic link (to {info.linkname!r}): refused, never followed"
    if not info.isreg():
        return None, "not a file (a folder, device or FIFO)"
    if info.issparse():  # its data has the holes left out: no run of bytes to read
        return None, "a sparse member (GNU tar -S), whose bytes are not stored in one run: refused, never read"
    if info.offset_data + info.size > end:
        return None, f"its data is cut short (the shard ends at byte {end})"
    return info, None


def member_file(path: str, member: Member) -> FileBytes:
    """The member's bytes, read when decoded and at most the read's limit (the decode budget): a larger member is
    one failed input, and so is one whose shard cannot be read any more (moved or cut since it was listed)."""
    def fetch(limit: int | None) -> bytes:
        if limit is not None and member.size > limit:
            raise over_budget(path, limit, member.size)
        try:
            with open(member.shard, "rb") as f:  # a file of its own: decode threads share no seek position
                f.seek(member.offset)
                data = f.read(member.size)
        except OSError as e:
            raise PreprocessError(f"{path}: its shard cannot be read ({e.strerror or e})") from None
        if len(data) < member.size:
            raise PreprocessError(f"{path}: its shard ends before the member's data (cut since it was listed)")
        return data

    return FileBytes(path, fetch=fetch)


def items_of(paths: list[str], members: dict[str, Member], keys: dict[str, str] | None = None) -> Iterator[object]:
    """What the encoder takes for each input, lazily and in order: a path, or a member's or an object's bytes to be
    fetched by its decoder (a URL's: the object its identity in ``keys`` names)."""
    for path in paths:
        member = members.get(path)
        if is_url(path):
            yield remote_file(path, (keys or {}).get(path))
        else:
            yield path if member is None else member_file(path, member)


def member_of(path: str) -> tuple[str, str] | None:
    """(shard, member name) when ``path`` names a member inside a tar file (``.../shards-000.tar/000123.jpg``),
    else None."""
    parts = path.split("/")
    shards = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1) if is_shard(parts[i])]
    return next(((shard, path[len(shard) + 1:]) for shard in shards if os.path.isfile(shard)), None)


class ItemOpener:
    """Paths as the encoder takes them where only the path travels (a Ray actor): a URL's bytes fetched when
    decoded (with its identity as the run listed it, ``remote.identity``: that object's), a shard member's bytes
    read by its shard's index (listed when its shard comes, one shard's held at a time), else the path itself."""

    def __init__(self) -> None:
        self.shard: str | None = None
        self.index: dict[str, Member] = {}  # the shard in hand's only: an actor's members of one shard come together

    def __call__(self, path: str, identity: str | None = None) -> object:
        if is_url(path):
            return remote_file(path, identity)
        inside = member_of(path)
        if inside is None:
            return path
        shard, name = inside
        if shard != self.shard:
            # The driver's listing: one member a name, so an actor reads the very member the local engine would.
            self.shard, self.index = shard, {m.name: m for *_, m, _ in list_shard(shard, lambda _: True, ()) if m}
        member = self.index.get(name)
        # Not a member: decoded as a path, a file not found, one failed input.
        return path if member is None else member_file(path, member)
