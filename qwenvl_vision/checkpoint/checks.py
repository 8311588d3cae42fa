"""Checks of a checkpoint's files before anything is read from them: regular files only, strict JSON, the
index's shard names, and safetensors headers validated as the format's own reader does.

Every safetensors header read (sharded or single file, loading or ``inspect``) is validated as the reference
reader does (safetensors 0.8, ``safetensors/src/tensor.rs``: ``SafeTensors::read_metadata`` and
``Metadata::validate``): an 8-byte little-endian header length of at most 100 MB (``MAX_HEADER_SIZE``) that fits
the file; a UTF-8 JSON object; each tensor entry an object with a known ``dtype``, a ``shape`` of unsigned
integers and two unsigned integer ``data_offsets`` whose span is exactly numel x element size; optional
``__metadata__`` mapping strings to strings; the tensors, sorted by offset, tile the data section from its first
to its last byte, so no two overlap. Python's JSON reader is made as strict as serde's: UTF-8 only, no
``NaN``/``Infinity`` literals, ``true`` is not an integer, a lone surrogate escape in a name is refused.

Deviations, all stricter: a tensor name given twice is refused (safetensors keeps the last of two identical
entries); a vision tensor must be stored in a dtype torch can load, and a floating-point parameter must not be
stored as an integer dtype (``check_vision_entry``); an index's shard names must be plain file names in the
checkpoint folder (transformers joins them to the folder unchecked).

Every failure is a ``CheckpointError`` naming the file and, in a header, the tensor at fault. Nothing here knows
the towers or their names: ``weights.py`` (loading) and ``hub.py`` (fetching) use these checks.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

import torch

from ..errors import CheckpointError

# ---------------------------------------------------------------------- files: regular only, JSON strictly


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # POSIX; Windows has no FIFOs to open by path
_OPEN_FLAGS = os.O_RDONLY | _NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _file_kind(mode: int) -> str:
    for is_kind, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if is_kind(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path, what: str, holds: str = "") -> BinaryIO:
    """Open `path` for unbuffered binary reading if it is a regular file (symlinks followed, as in the HF cache).

    A FIFO would block the open or the read forever and a device may never end: both are refused before any
    read. The open itself is non-blocking, so a path swapped for a FIFO after the stat cannot hang it either,
    and the type is checked again on the opened descriptor.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise CheckpointError(f"{what} {path}{holds} is missing") from e
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL byte
        raise CheckpointError(f"cannot read {what} {path}{holds}: {e}") from e
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{what} {path}{holds} is {_file_kind(mode)}, not a regular file")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path}{holds}: {e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{what} {path}{holds} is {_file_kind(mode)}, not a regular file")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


class _DuplicateKey(ValueError):
    pass


class _NonStandardConstant(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise _NonStandardConstant(name)


def parse_json(raw: bytes, what: str, unsigned: bool = False) -> object:
    """Strict JSON from bytes: UTF-8 only, no key given twice, no NaN/Infinity literals; errors name `what`.
    ``unsigned``: -0 is refused (a safetensors header's sizes and offsets are u64, which serde refuses signed;
    Python reads -0 as the 0 a size may be, other negatives are refused by the header's checks, naming the tensor)."""
    def integer(text: str) -> int:
        if unsigned and text == "-0":
            raise _NonStandardConstant("the signed integer -0")
        return int(text)

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_reject_constant,
                          parse_int=integer)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8: {e}") from e
    except _DuplicateKey as e:
        raise CheckpointError(f"{what} gives the key {e.args[0]!r} twice") from e
    except _NonStandardConstant as e:
        raise CheckpointError(f"{what} holds {e.args[0]}, which is not JSON") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} is not valid JSON: {e}") from e
    except RecursionError as e:
        raise CheckpointError(f"{what} is not valid JSON: nested too deeply") from e
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise CheckpointError(f"{what} is not valid JSON: {e}") from e


def read_json(path: Path, what: str = "file") -> object:
    """A JSON file's value (any JSON type: callers check it), read only if it is a regular file."""
    with open_regular(path, what) as f:
        try:
            raw = f.read()
        except OSError as e:
            raise CheckpointError(f"cannot read {what} {path}: {e}") from e
    return parse_json(raw, f"{what} {path}")


def json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------- the index: names of shards


def check_shard_name(shard: str, where: str, tensor: str) -> None:
    """An index's shard name must be a plain file name in the checkpoint folder, as every release writes them.

    Absolute names, ``..`` components and any other separator are refused (a symlink named plainly inside
    the folder stays allowed: the Hugging Face cache is made of them). A name merely containing two dots
    (``model..safetensors``) is a plain name and allowed.
    """
    parts = re.split(r"[/\\]", shard)
    if not shard:
        reason = "is empty"
    elif "\x00" in shard:
        reason = "contains a NUL byte"
    elif PurePosixPath(shard).is_absolute() or PureWindowsPath(shard).anchor:
        reason = "is an absolute path"
    elif ".." in parts:
        reason = "leaves the checkpoint folder ('..')"
    elif len(parts) > 1 or shard == ".":
        reason = "is not a plain file name"
    else:
        return
    raise CheckpointError(f"{where}: shard name {shard!r} (for tensor {tensor!r}) {reason}; shard names must be "
                          f"plain file names in the checkpoint folder")


def parse_weight_map(index: object, where: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name), every entry checked; errors name `where`."""
    if not isinstance(index, dict):
        raise CheckpointError(f"{where} is not a JSON object (found {json_type(index)})")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        found = "none" if weight_map is None else json_type(weight_map)
        raise CheckpointError(f"{where} has no weight_map object (found {found})")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{where}: weight_map[{name!r}] is {json_type(shard)} ({shard!r}), "
                                  f"not a shard file name")
        check_shard_name(shard, where, name)
    return weight_map


# ---------------------------------------------------------------------- safetensors headers


# Every dtype safetensors 0.8 knows, with its size in bits; a shard may hold any of them (the language model's
# tensors are never read), the vision tensors only those torch loads (SAFETENSORS_DTYPES).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
_U64_MAX = 2**64 - 1  # safetensors reads sizes and offsets as usize


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """A shard's validated safetensors header and where its data starts (see the module docstring).

    Entries are ``{"dtype": str, "shape": list[int], "data_offsets": [begin, end]}``; ``__metadata__`` is dropped.
    """
    with open_regular(path, "shard") as f:
        return read_open_header(f, path)


def _read_exactly(f: BinaryIO, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = f.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_open_header(f: BinaryIO, path: Path) -> tuple[dict[str, dict], int]:
    """``read_header`` on a shard already opened with ``open_regular``, read from its first byte: a load reads
    the header and then the tensors through one descriptor, so the file cannot change in between."""
    size = os.fstat(f.fileno()).st_size
    prefix = _read_exactly(f, 8)
    if len(prefix) < 8:
        raise CheckpointError(f"shard {path} is truncated ({size} bytes)")
    header_len = int.from_bytes(prefix, "little")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"shard {path} is corrupt: header length {header_len} exceeds safetensors' "
                              f"limit of {MAX_HEADER_BYTES} bytes")
    if 8 + header_len > size:
        raise CheckpointError(f"shard {path} is truncated or corrupt: header of {header_len} bytes, file {size}")
    header = parse_json(_read_exactly(f, header_len), f"the header of shard {path}", unsigned=True)
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path} has a corrupt header (found {json_type(header)}, not a JSON object)")
    _check_metadata(path, header.pop("__metadata__", None))
    data_size = size - 8 - header_len
    entries = {name: _check_entry(path, name, entry, data_size) for name, entry in header.items()}
    _check_tiling(path, entries, data_size)
    return entries, 8 + header_len


def _check_metadata(path: Path, metadata: object) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"shard {path} has a corrupt header: __metadata__ must map strings to strings")


def _is_size(value: object) -> bool:
    return type(value) is int and 0 <= value <= _U64_MAX  # type(): True is an int to Python, not to JSON


def _check_entry(path: Path, name: str, entry: object, data_size: int) -> dict:
    """One tensor's header entry, checked on its own; returned normalised."""
    where = f"tensor {name!r} in shard {path}"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape: Python's JSON reader accepts it, serde does not
        raise CheckpointError(f"tensor {name!r} in shard {path}: the name is not valid Unicode") from e
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is {json_type(entry)}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise CheckpointError(f"{where}: header entry has no {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets begin {begin} > end {end}")
    if end > data_size:
        raise CheckpointError(f"{where}: data_offsets end {end} is past the end of the data ({data_size} bytes): "
                              f"the shard is truncated or the header corrupt")
    bits = _bits(shape, SAFETENSORS_DTYPE_BITS[dtype], cap=8 * data_size)
    if bits is None:
        raise CheckpointError(f"{where}: {dtype} x {shape} needs more than the whole shard's data")
    if bits % 8:
        raise CheckpointError(f"{where}: {dtype} x {shape} does not fill whole bytes")
    if end - begin != bits // 8:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                              f"but {dtype} x {shape} needs {bits // 8}")
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _bits(shape: list[int], element_bits: int, cap: int) -> int | None:
    """numel x element bits, or None past `cap` or where safetensors' own count overflows u64: it multiplies the
    dims in order, so a zero dim after an overflowing product does not save it."""
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > _U64_MAX:
            return None
    bits = numel * element_bits
    return None if bits > cap else bits


def _check_tiling(path: Path, entries: dict[str, dict], data_size: int) -> None:
    """Sorted by offset, the tensors cover the data section exactly: no overlap, no gap, no trailing bytes."""
    position, previous = 0, None
    for (begin, end), name in sorted((e["data_offsets"], name) for name, e in entries.items()):
        if begin < position:
            raise CheckpointError(f"shard {path}: tensors {previous!r} and {name!r} overlap "
                                  f"(bytes {begin} to {position} of the data)")
        if begin > position:
            raise CheckpointError(f"shard {path}: tensor {name!r} starts at byte {begin} of the data, the "
                                  f"previous one ({previous!r}) ends at {position}: bytes between tensors")
        position, previous = end, name
    if position != data_size:
        raise CheckpointError(f"shard {path}: {data_size - position} bytes after the last tensor "
                              f"({previous!r}) belong to no tensor")


def check_vision_entry(path: Path, header: dict[str, dict], name: str, expected: torch.Tensor | None) -> dict:
    """A vision tensor's entry: present, in a dtype torch loads, floating point if its parameter is, and
    (with `expected`, the meta tensor it fills) of the expected shape."""
    entry = header.get(name)
    if entry is None:
        raise CheckpointError(f"tensor {name} is listed in the index for {path} but is not in that shard")
    dtype = entry["dtype"]
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"tensor {name} in {path} has unsupported dtype {dtype}")
    floating = expected is None or expected.is_floating_point()  # every tower tensor is floating point
    if floating and not SAFETENSORS_DTYPES[dtype].is_floating_point:
        raise CheckpointError(f"tensor {name} in {path} is stored as {dtype}, an integer dtype, but it is a "
                              f"floating-point parameter")
    if expected is not None and tuple(entry["shape"]) != tuple(expected.shape):
        raise CheckpointError(f"tensor {name} in {path} has shape {tuple(entry['shape'])}, expected "
                              f"{tuple(expected.shape)}")
    return entry
