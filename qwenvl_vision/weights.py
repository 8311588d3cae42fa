"""Reading vision tensors from checkpoints: only the tower, only the shards that hold it, strictly.

Layouts understood (see REFERENCE.md, "Checkpoint layout"):
- released: ``config.json`` + ``model.safetensors.index.json`` + ``model-0000K-of-0000N.safetensors`` shards,
  or a single ``model.safetensors``; vision tensors under the family's prefix (``config.Family.prefixes``:
  ``visual.*`` in Qwen2-VL / Qwen2.5-VL releases, ``model.visual.*`` in Qwen3-VL / Qwen3.5 releases and anything
  re-saved by transformers 4.52+, ``thinker.visual.*`` in the Omni models);
- vision-only, as written by ``qwenvl-vision extract-weights``: ``config.json`` with ``family``,
  ``preprocessor_config.json`` and one ``model.safetensors`` holding the family's tensor names without prefix.

Tensors are read under the checkpoint's own names and only then stacked or renamed into module tensors
(``names.py``), so every error names a tensor as the checkpoint spells it.

The model is built on the meta device and every tensor is materialised once, directly on the target device
in the target dtype, so a load never holds a second copy of the tower. Anything unexpected (a missing or
surplus tensor, a wrong shape, a truncated or corrupt shard, a shard name leaving the folder, a NaN weight)
raises a ``CheckpointError`` naming it; nothing is ever loaded partially.

Every safetensors header read (sharded or single file, loading or ``inspect``) is validated as the format's
reference reader does (safetensors 0.8, Rust ``SafeTensors::read_metadata`` and ``Metadata::validate``): an
8-byte little-endian header length of at most 100 MB that fits the file; a UTF-8 JSON object; each tensor
entry an object with a known ``dtype``, a ``shape`` of unsigned integers and two unsigned integer
``data_offsets`` whose span is exactly numel x element size; optional ``__metadata__`` mapping strings to
strings; the tensors, sorted by offset, tile the data section from its first to its last byte, so no two
overlap. Python's JSON reader is made as strict as serde's: UTF-8 only, no ``NaN``/``Infinity`` literals,
``true`` is not an integer, a lone surrogate escape in a name is refused. Deviations, all stricter: a tensor
name given twice is refused (safetensors keeps the last of two identical entries); a vision tensor must be
stored in a dtype torch can load, and a floating-point parameter must not be stored as an integer dtype.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

import numpy as np
import torch

from .config import FAMILIES, VisionConfig, from_config_json
from .errors import CheckpointError, ConfigError, QwenVLVisionError
from .models import build_model
from .names import to_checkpoint_state, to_module_state
from .tower import VisionTower

# Every family's prefixes, longest first ("thinker.visual." before "visual.").
VISION_PREFIXES = tuple(sorted({p for f in FAMILIES.values() for p in f.prefixes}, key=len, reverse=True))
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
VISION_ONLY_FORMAT = "qwenvl-vision"


@dataclass
class TensorSource:
    file: Path  # the shard holding it
    name: str  # its name in that shard


@dataclass
class VisionCheckpoint:
    """Where each vision tensor of a checkpoint folder lives, without reading any tensor data."""

    folder: Path
    config_json: dict
    config: VisionConfig
    tensors: dict[str, TensorSource]  # checkpoint tensor name without the prefix -> where it is
    vision_only: bool

    @property
    def shard_files(self) -> list[Path]:
        return sorted({s.file for s in self.tensors.values()})

    def preprocessor_json(self) -> dict | None:
        return self._settings(PREPROCESSOR_FILE, "preprocessor config")

    def video_preprocessor_json(self) -> dict | None:
        """The video processor's settings: ``video_preprocessor_config.json``, else ``preprocessor_config.json``
        (transformers' ``BaseVideoProcessor.get_video_processor_dict`` falls back to it the same way)."""
        return self._settings(VIDEO_PREPROCESSOR_FILE, "video preprocessor config") or self.preprocessor_json()

    def _settings(self, filename: str, what: str) -> dict | None:
        path = self.folder / filename
        if not path.exists():
            return None
        settings = read_json(path, what)
        if not isinstance(settings, dict):
            raise ConfigError(f"{path} is not a JSON object (found {_json_type(settings)})")
        return settings


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


def parse_json(raw: bytes, what: str) -> object:
    """Strict JSON from bytes: UTF-8 only, no key given twice, no NaN/Infinity literals; errors name `what`."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_reject_constant)
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


def read_json(path: Path, what: str = "file") -> object:
    """A JSON file's value (any JSON type: callers check it), read only if it is a regular file."""
    with open_regular(path, what) as f:
        try:
            raw = f.read()
        except OSError as e:
            raise CheckpointError(f"cannot read {what} {path}: {e}") from e
    return parse_json(raw, f"{what} {path}")


def _json_type(value: object) -> str:
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
        raise CheckpointError(f"{where} is not a JSON object (found {_json_type(index)})")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        found = "none" if weight_map is None else _json_type(weight_map)
        raise CheckpointError(f"{where} has no weight_map object (found {found})")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{where}: weight_map[{name!r}] is {_json_type(shard)} ({shard!r}), "
                                  f"not a shard file name")
        check_shard_name(shard, where, name)
    return weight_map


def strip_vision_prefix(name: str, prefixes: tuple[str, ...] = VISION_PREFIXES) -> str | None:
    """The name without its vision prefix, or None for a tensor outside the tower."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


# ---------------------------------------------------------------------- builtin errors -> project errors


_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
# What malformed data makes Python or torch raise; anything else (a NameError...) is a bug and stays visible.
_DATA_ERRORS = (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError, RuntimeError)


@contextlib.contextmanager
def _named_errors(error: type[QwenVLVisionError], what: str) -> Iterator[None]:
    """Re-raise a bare builtin error from reading data as `error` naming `what`, the original chained.

    The checks above name the culprit precisely; this is the backstop that keeps a case nobody thought of
    from escaping as a bare ``TypeError``. Running out of memory is not the checkpoint's fault: it passes.
    """
    try:
        yield
    except QwenVLVisionError:
        raise
    except _OUT_OF_MEMORY:
        raise
    except _DATA_ERRORS as e:
        raise error(f"{what}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------- opening a checkpoint folder


def open_checkpoint(folder: str | os.PathLike) -> VisionCheckpoint:
    """Index a checkpoint folder's vision tensors (reads config, index and headers, never tensor data)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    with _named_errors(CheckpointError, f"cannot open checkpoint {folder}"):
        return _open_checkpoint(folder)


def _open_checkpoint(folder: Path) -> VisionCheckpoint:
    config_path = folder / CONFIG_FILE
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    config_json = read_json(config_path, "config")
    if not isinstance(config_json, dict):
        raise ConfigError(f"{config_path} is not a JSON object (found {_json_type(config_json)})")
    with _named_errors(ConfigError, f"{config_path} does not describe a vision tower"):
        config = from_config_json(config_json, name=config_json.get("name", "") or folder.name)
    vision_only = config_json.get("format") == VISION_ONLY_FORMAT
    prefixes = config.spec.prefixes
    index_path, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_path.exists():
        weight_map = parse_weight_map(read_json(index_path, "index"), str(index_path))
        files = {name: folder / shard for name, shard in weight_map.items()}
    elif single.exists():
        files = dict.fromkeys(read_header(single)[0], single)
    else:
        raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    tensors: dict[str, TensorSource] = {}
    for name, path in files.items():
        key = name if vision_only else strip_vision_prefix(name, prefixes)
        if key is None:
            continue
        if key in tensors:  # 'visual.x' and 'model.visual.x': which one is meant cannot be told
            raise CheckpointError(f"{folder} holds {key} twice, as {tensors[key].name} and {name}")
        tensors[key] = TensorSource(path, name)
    if not tensors:
        raise CheckpointError(f"{folder} holds no vision tensors (no names starting with {prefixes})")
    return VisionCheckpoint(folder, config_json, config, tensors, vision_only)


def check_names(checkpoint: VisionCheckpoint, expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(checkpoint.tensors))
    surplus = sorted(set(checkpoint.tensors) - set(expected))
    if missing or surplus:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
        if surplus:
            parts.append(f"unexpected {len(surplus)} tensor(s): {_names(surplus)}")
        raise CheckpointError(f"{checkpoint.folder} does not match the {checkpoint.config.spec.label} tower "
                              f"({len(expected)} tensors expected): " + "; ".join(parts))


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


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
        return _read_header(f, path)


def _read_exactly(f: BinaryIO, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = f.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, dict], int]:
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
    header = parse_json(_read_exactly(f, header_len), f"the header of shard {path}")
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path} has a corrupt header (found {_json_type(header)}, not a JSON object)")
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
        raise CheckpointError(f"{where}: header entry is {_json_type(entry)}, not an object")
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
    """numel x element bits, or None once past `cap` (a forged shape of huge dims costs nothing)."""
    if 0 in shape:
        return 0
    bits = element_bits
    for dim in shape:
        bits *= dim
        if bits > cap:
            return None
    return bits


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


def _vision_entry(path: Path, header: dict[str, dict], name: str, expected: torch.Tensor | None) -> dict:
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


def _by_shard(checkpoint: VisionCheckpoint) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for key, source in checkpoint.tensors.items():
        by_file.setdefault(source.file, []).append(key)
    return dict(sorted(by_file.items()))


def _holds(keys: list[str]) -> str:
    return f" (it holds vision tensors {_names(sorted(keys), 3)})"


def vision_entries(checkpoint: VisionCheckpoint) -> dict[str, dict]:
    """Every vision tensor's validated header entry (name without prefix -> entry), one header read per shard.

    What ``inspect`` reports from: every check a load makes short of building the tower and reading data.
    """
    entries: dict[str, dict] = {}
    for path, keys in _by_shard(checkpoint).items():
        with _named_errors(CheckpointError, f"cannot read shard {path}"), \
                open_regular(path, "shard", _holds(keys)) as f:
            header, _ = _read_header(f, path)
        for key in keys:
            entries[key] = _vision_entry(path, header, checkpoint.tensors[key].name, None)
    return entries


# ---------------------------------------------------------------------- reading tensors


# Per float dtype: its bits as signed and unsigned integers, and the bits of +Inf and -Inf. Exponent all ones
# (NaN or Inf) means: signed bits >= +Inf's for a positive value, unsigned bits >= -Inf's for a negative one.
_FLOAT_BITS = {
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float16: (np.int16, np.uint16, 0x7C00, 0xFC00),
    torch.float32: (np.int32, np.uint32, 0x7F80_0000, 0xFF80_0000),
    torch.float64: (np.int64, np.uint64, 0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000),
}
_CHECKED_PIECE = 1 << 18  # bytes read, then checked while still in the CPU's L2 cache


def _finite_bits(piece: np.ndarray, bits: tuple) -> bool:
    """No NaN or Inf among the floats whose bytes are `piece`: two integer maxima over their bits.

    Exact (a sum overflows on finite fp16 values) and single-threaded on purpose: torch's reductions fan out
    to its OpenMP threads, and with the cores busy (a shared machine, a data loader) their barriers stalled a
    bf16 3B check at 1.3 s against 0.05 s for these numpy maxima.
    """
    signed, unsigned, positive_inf, negative_inf = bits
    return piece.view(signed).max() < positive_inf and piece.view(unsigned).max() < negative_inf


def _readinto_fully(f: BinaryIO, piece: np.ndarray, path: Path, name: str) -> None:
    view, done = memoryview(piece), 0
    while done < len(view):  # one read returns at most ~2 GiB on Linux
        count = f.readinto(view[done:])
        if not count:
            raise CheckpointError(f"shard {path} is truncated inside tensor {name}")
        done += count


def _read_one(f: BinaryIO, path: Path, name: str, entry: dict, data_start: int, *,
              check_finite: bool) -> torch.Tensor:
    """One tensor's bytes read into fresh host memory (no mmap: the result owns its storage).

    With `check_finite`, a floating-point tensor is read in 256 KiB pieces, each checked for NaN/Inf right
    after it lands (cached, the check costs a fraction of a second pass over memory); a NaN or Inf is a
    CheckpointError naming the tensor, with the count of each.
    """
    begin, end = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    buffer = torch.empty(end - begin, dtype=torch.uint8)
    data = buffer.numpy()
    bits = _FLOAT_BITS.get(dtype) if check_finite else None
    step = _CHECKED_PIECE if bits is not None else max(len(data), 1)
    finite = True
    f.seek(data_start + begin)
    for start in range(0, len(data), step):
        piece = data[start : start + step]
        _readinto_fully(f, piece, path, name)
        finite = finite and (bits is None or _finite_bits(piece, bits))
    tensor = buffer.view(dtype).view(entry["shape"])
    if not finite:
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise CheckpointError(f"tensor {name} in {path} holds {nan} NaN and {inf} infinite value(s) "
                              f"(pass check_finite=False to load it anyway)")
    return tensor


def read_tensors(checkpoint: VisionCheckpoint, expected: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype | None, *, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Every vision tensor once, onto `device` in `dtype` (None: as stored), all checks made before reading.

    expected: tensor name without prefix -> the (meta) tensor it fills, for shape and floating-point checks.
    Bytes are read with plain file reads into memory the tensor owns (nothing stays mapped to the
    checkpoint, so the files may change afterwards); a tensor already in the target dtype on CPU is
    used as read, otherwise converted one tensor at a time on the target device, so the host peak is
    the tower plus one tensor. With `check_finite`, each tensor is checked for NaN/Inf as stored, as it is read.
    """
    state: dict[str, torch.Tensor] = {}
    for path, keys in _by_shard(checkpoint).items():
        with _named_errors(CheckpointError, f"cannot read shard {path}"), \
                open_regular(path, "shard", _holds(keys)) as f:
            header, data_start = _read_header(f, path)
            plan = [(key, _vision_entry(path, header, checkpoint.tensors[key].name,
                                                expected[key])) for key in keys]
            for key, entry in sorted(plan, key=lambda item: item[1]["data_offsets"]):
                name = checkpoint.tensors[key].name
                tensor = _read_one(f, path, name, entry, data_start, check_finite=check_finite)
                state[key] = tensor.to(device=device, dtype=dtype or tensor.dtype)
                del tensor
    return state


def load_tower(checkpoint: VisionCheckpoint, device: torch.device, dtype: torch.dtype | None, *,
               attn_impl: str = "auto", check_finite: bool = True, **model_options) -> VisionTower:
    """Build the tower on meta, check names and shapes, then materialise each tensor once on `device`.

    check_finite=False skips the NaN/Inf check, for checkpoints that hold such values on purpose.
    """
    with _named_errors(ConfigError, f"cannot build the {checkpoint.config.family} tower of {checkpoint.folder}"):
        model = build_model(checkpoint.config, device="meta", attn_impl=attn_impl, **model_options)
    module_state = model.state_dict()
    expected = to_checkpoint_state(checkpoint.config, module_state)  # meta tensors under the checkpoint's names
    check_names(checkpoint, expected)
    tensors = read_tensors(checkpoint, expected, device, dtype, check_finite=check_finite)
    with _named_errors(CheckpointError, f"cannot load the weights of {checkpoint.folder}"):
        model.load_state_dict(to_module_state(checkpoint.config, tensors, module_state), strict=True, assign=True)
    first = next(model.parameters())
    model.set_attention(attn_impl, first.device, first.dtype)
    return model.eval().requires_grad_(False)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_vision_only(model: VisionTower, folder: str | os.PathLike, preprocessor: dict | None = None,
                     video_preprocessor: dict | None = None) -> Path:
    """Write a self-contained vision-only checkpoint that ``open_checkpoint`` reads back."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config_json = {**model.config.to_config_json(), "format": VISION_ONLY_FORMAT}
    state = {k: v.detach().contiguous().cpu() for k, v in to_checkpoint_state(model.config, model.state_dict()).items()}
    tmp = folder / (SINGLE_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "family": model.config.family})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its file 0600; the folder's other files follow the umask
    os.replace(tmp, folder / SINGLE_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
    if preprocessor is not None:
        (folder / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor, indent=2) + "\n")
    if video_preprocessor is not None:
        (folder / VIDEO_PREPROCESSOR_FILE).write_text(json.dumps(video_preprocessor, indent=2) + "\n")
    return folder
