"""What an embed run works on: the inputs gathered from files, folders, list files, tables (``tables``), WebDataset
shards (``shards``) and URLs (``remote``), and each rank's share.

Inputs are deduplicated by real path (the first spelling is the one recorded, and a table's first row naming a
file gives its carried columns). A list that is not text is one
failed input; a missing file is kept (recorded as an error later, not dropped). A path with a video extension
(``video.VIDEO_EXTENSIONS``) is a video file. Under ``torchrun`` (RANK / WORLD_SIZE set) inputs are split
statically, rank r taking inputs r, r+W, r+2W, ... (never padded with duplicates).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from braceexpand import UnbalancedBracesError, braceexpand

from ..errors import ConfigError
from ..inputs.pixels import is_url, local_name
from ..inputs.urls import canonical
from ..inputs.video_io import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from .remote import identities
from .shards import KEY_COLUMN, TAR_SUFFIX, Member, is_shard, list_shard
from .tables import cell, check_keep_columns, is_table, joined, read_table

MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
LIST_EXTENSIONS = {".txt", ".lst", ".list"}
COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
INPUT_KINDS = ("image and video files or URLs, folders (recursive), lists (.txt .lst .list) of image and video paths "
               "or URLs, tables (.parquet .csv .tsv .jsonl) and uncompressed .tar shards ('shards-{000..009}.tar')")

@dataclass
class Inputs:
    """Inputs in order, one per real file (first spelling kept); `errors` holds the ones already known bad."""

    paths: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # path -> its identity (file_identity; a URL's: remote)
    columns: dict[str, dict] = field(default_factory=dict)  # path -> the values its table row carries
    column_types: dict[str, str] = field(default_factory=dict)  # carried column -> its type (parquet.CARRIED_TYPES)
    members: dict[str, Member] = field(default_factory=dict)  # path -> where a shard member's bytes are
    _pending: list[tuple] = field(default_factory=list, repr=False)

    def add(self, path: str, error: str | None = None, columns: dict | None = None,
            member: Member | None = None, key: str | None = None) -> None:
        """One more input, in order (``finish`` settles them); ``key``: its identity, where not its real path."""
        self._pending.append((path, error, columns, member, key))

    def finish(self) -> Inputs:
        """Every input added, with its identity: a URL's from its store (several at once), a file's its real path
        stamped with what its bytes are now (``file_identity``; a shard member's, its shard's). The same file twice
        (another spelling, a link) is embedded once, under its first."""
        urls = [path for path, error, _, _, key in self._pending if error is None and key is None and is_url(path)]
        known = identities(urls) if urls else {}
        seen: dict[str, str] = {}  # identity -> the input's first spelling
        self.column_types = types = {n: "string" if t == "null" else t for n, t in self.column_types.items()}
        for path, error, columns, member, given in self._pending:
            if columns is not None:
                columns = {n: cell(v, types[n]) for n, v in columns.items()}
            key, why = known.get(path, (None, None))
            key = key or given or (canonical(path) if is_url(path) else os.path.realpath(path))  # no password kept
            # A URL's version or ETag, read now, is not what makes two spellings one object: torchrun's ranks,
            # each listing the inputs at its own moment, must merge them alike to split them alike.
            same = file_of(key) if is_url(path) else key
            if same in seen:
                if columns is not None:  # a table's row naming a file given before: its columns are the file's
                    self.columns.setdefault(seen[same], columns)
                continue
            seen[same] = path
            if not is_url(path):
                file = os.path.realpath(member.shard) if member else key  # a member's key: its shard's, then name
                key = file_identity(file) + key[len(file):]
            self.paths.append(path)
            self.keys[path] = key
            if error is not None or why is not None:
                self.errors[path] = error or why
            if columns is not None:
                self.columns[path] = columns
            if member is not None:
                self.members[path] = member
        self._pending = []
        return self

    def carry(self, types: dict[str, str]) -> None:
        """Carried columns of one more source (a table, a shard), typed with the earlier ones' (``joined``)."""
        self.column_types.update({n: joined(self.column_types.get(n, "null"), t) for n, t in types.items()})


# A local file's identity: its real path, and its size and modification time (what make and rsync go by: one stat,
# where a hash would read every input again on each resume); a shard member's is its shard's, then its name.
# The state ends a file's identity, and follows its shard's ``.tar`` in a member's: a name with such text stays.
STATE = r"#size=\d+,mtime_ns=-?\d+"  # a file dated before 1970: negative
FILE_STATE, SHARD_STATE = re.compile(STATE + r"\Z"), re.compile(rf"(?<=\{TAR_SUFFIX}){STATE}(?=/)", re.I)
# A URL's identity ends with the object's version or ETag (``remote.identity``): the last such mark.
URL_PIN = re.compile(r"#(?:version|etag)=(?:(?!#(?:version|etag)=).)*\Z", re.S)


def file_identity(realpath: str) -> str:
    """``realpath`` with what the file's bytes are now (``FILE_STATE``); a file that cannot be read keeps its bare
    path (its input fails, and a resume tries it again)."""
    try:
        state = os.stat(realpath)
    except OSError:
        return realpath
    return f"{realpath}#size={state.st_size},mtime_ns={state.st_mtime_ns}"


def file_of(key: str) -> str:
    """What an input's identity names, without what the bytes were: a local file's or shard member's state
    (``file_identity``), a URL's version or ETag; an identity without either is its own."""
    if is_url(key):
        return URL_PIN.sub("", key)
    named = FILE_STATE.sub("", key)
    return SHARD_STATE.sub("", key, count=1) if named == key else named


def gather_inputs(inputs: list[str], path_column: str = "path", keep_columns: tuple[str, ...] = ()) -> Inputs:
    """Files as given, folders recursively by image and video extension (sorted), text files as path lists, tables
    (``tables.TABLE_EXTENSIONS``) as rows naming files, ``path_column`` theirs, ``keep_columns`` carried, and local
    tar shards (webdataset's brace patterns expanded, ``shards-{000..099}.tar``) as their media members.

    A list file that cannot be read as text is one failed input, and so is each folder (the given one or one
    inside it) that cannot be listed, and each table row that names no file; a missing file is kept (recorded as
    an error later, not dropped). A table that cannot be read or lacks the columns asked for is a ``ConfigError``,
    and so are ``keep_columns`` with no table among the inputs.
    """
    found = Inputs()
    check_keep_columns(keep_columns, path_column)
    inputs = [path for item in map(local_name, inputs)
              for path in (_expand(item) if is_shard(item) and not is_url(item) else [item])]
    tables = [item for item in inputs if is_table(item) and not is_url(item)]
    if keep_columns and not tables and not any(is_shard(item) for item in inputs):
        raise ConfigError(f"--keep-columns {','.join(keep_columns)} carries a table's columns (or a shard's "
                          f"members), and no input is a table (.parquet, .csv, .tsv, .jsonl) or a .tar shard")
    for item in inputs:
        p = Path(item)
        if item in tables:
            rows, types = read_table(p, path_column, keep_columns)
            found.carry(types)
            for row in rows:
                found.add(row.path or f"{item}#row{row.number}", row.error or _other_kind(row.path, f"table {item}"),
                          row.columns)
        elif is_url(item):
            found.add(item, _other_kind(item))
        elif is_shard(item) and not p.is_dir():
            found.carry({KEY_COLUMN: "string", **dict.fromkeys(keep_columns, "string")})
            for entry in list_shard(item, _is_media, keep_columns):
                found.add(*entry)
        elif p.is_dir():
            for entry in _walk_media(p):
                found.add(*entry)
        elif p.suffix.lower() in LIST_EXTENSIONS and p.is_file():
            try:
                lines = _read_list(p)
            except (OSError, ValueError) as e:
                found.add(item, f"list file {item}: {e}")
                continue
            for line in map(local_name, lines):
                path = line if is_url(line) else str(p.parent / line)  # an absolute path stays as it is
                found.add(path, _other_kind(path, f"list {item}"))
        else:
            found.add(str(p), _other_kind(item))
    if absent := [name for name in keep_columns if name not in found.column_types]:  # in no JSON Lines line
        raise ConfigError(f"--keep-columns {','.join(absent)}: no line of the tables holds that field (or they "
                          f"hold no lines)")
    return found.finish()


def _expand(pattern: str) -> list[str]:
    """A shard's brace pattern, as webdataset expands it (backslashes kept: they are the path's); braces that do
    not pair are the name's."""
    try:
        return list(braceexpand(pattern, escape=False))
    except UnbalancedBracesError:
        return [pattern]


def _other_kind(path: str, listed_in: str | None = None) -> str | None:
    """Why ``path``, to be decoded as an image or video, names a kind of input that is read only as a local INPUT
    of its own (a shard, a table, a list) or not at all (a compressed tar), or None; the one line says what is read,
    since the decoder would call it "not a recognised image file"."""
    name = (re.split(r"[?#]", path, maxsplit=1)[0] if is_url(path) else path).lower()  # a query may end in anything
    if name.endswith(COMPRESSED_TARS):
        why = "a compressed tar is not read (a shard's members are read in place): decompress it to a .tar"
    elif (listed_in or is_url(path)) and (is_shard(name) or is_table(name) or Path(name).suffix in LIST_EXTENSIONS):
        why = f"named in {listed_in}, which names images and videos only" if listed_in else "read as a local file only"
    else:
        return None
    return f"{path}: {why}; INPUTs are {INPUT_KINDS}"


def _is_media(name: str) -> bool:
    return Path(name).suffix.lower() in MEDIA_EXTENSIONS


def _maybe_file(path: str) -> bool:
    """Not known to be anything but a regular file: one that cannot be checked (a folder readable but not
    searchable) stays an input, whose read then says why, instead of vanishing."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False  # a dangling link
    except OSError:
        return True


def _walk_media(top: Path) -> list[tuple[str, str | None]]:
    """The inputs under ``top`` as ``Inputs.add`` takes them (path, why it failed or None): each folder ``os.walk``
    cannot list, which rglob skips in silence, so that its files are reported missing rather than quietly never
    embedded; then the media files, sorted (links to files followed, links to folders not entered; a FIFO or a
    dangling link is no image)."""
    files, unreadable = [], []
    for folder, _, names in os.walk(top, onerror=unreadable.append):
        files += [Path(folder, n) for n in names if _is_media(n) and _maybe_file(os.path.join(folder, n))]
    failed = [(e.filename, f"cannot list folder {e.filename}: {e.strerror or e}; make it readable, or leave it out "
                           f"of the inputs") for e in sorted(unreadable, key=lambda e: e.filename)]
    return failed + [(str(f), None) for f in sorted(files)]


def _read_list(path: Path) -> list[str]:
    """Paths listed one per line ('#' comments, blank lines skipped), relative ones to the list's folder."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ValueError(f"not a text file (NUL byte at offset {data.index(bytes(1))})")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"not a UTF-8 text file (byte {e.start} is {data[e.start]:#04x})") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def shard_for_rank(paths: list[str], rank: int, world: int, members: dict[str, Member] | None = None
                   ) -> list[str]:
    """Rank `rank`'s inputs: every `world`-th from its own index, so the shares never overlap. Where the inputs
    hold at least `world` tar shards (``members``), a shard's members go to one rank (shards dealt in turn), so
    that each rank reads its own shards; other inputs are dealt in turn among themselves."""
    members = members or {}
    if len({m.shard for m in members.values()}) < world:
        return paths[rank::world]
    mine, ordinal, plain = [], {}, 0
    for path in paths:
        member = members.get(path)
        if member is None:
            turn, plain = plain, plain + 1
        else:
            turn = ordinal.setdefault(member.shard, len(ordinal))
        if turn % world == rank:
            mine.append(path)
    return mine

