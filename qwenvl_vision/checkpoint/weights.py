"""Loading a vision tower from a checkpoint folder: index its vision tensors, read them, build the tower (writing
a vision-only checkpoint is ``save``'s).

Layouts understood:
- released: ``config.json`` + ``model.safetensors.index.json`` + ``model-0000K-of-0000N.safetensors`` shards,
  or a single ``model.safetensors`` (the names transformers' ``save_pretrained`` writes:
  ``SAFE_WEIGHTS_INDEX_NAME`` / ``SAFE_WEIGHTS_NAME`` in ``transformers/utils/__init__.py``); vision tensors under
  the family's prefix (``config.Family.prefixes``: ``visual.*`` in Qwen2-VL / Qwen2.5-VL releases,
  ``model.visual.*`` in Qwen3-VL / Qwen3.5 releases and anything re-saved by transformers 4.52+ (the
  ``^visual -> model.visual`` renaming of ``transformers/conversion_mapping.py``), ``thinker.visual.*`` in the
  Omni models);
- vision-only, as written by ``qwenvl-vision extract-weights`` (``save.save_vision_only``): ``config.json`` with
  ``family`` and ``"format": "qwenvl-vision"``, ``preprocessor_config.json`` and one ``model.safetensors``
  holding the family's tensor names without prefix.

Every file is checked before it is used (``checks``: regular files only, strict JSON, plain shard
names, safetensors headers as strict as the format's own reader); a file that is a symbolic link to nothing (a
broken Hugging Face cache) is an error naming it, never read as absent (``present``). Tensors are read under the
checkpoint's own names and only then stacked or renamed into module tensors (``model.names``), so every error names
a tensor as the checkpoint spells it.

The model is built on the meta device and every tensor is materialised once, directly on the target device
in the target dtype, so a load never holds a second copy of the tower. Anything unexpected in the files (a
missing or surplus tensor, a wrong shape, a truncated or corrupt shard, a shard name leaving the folder, a NaN
weight) raises a ``CheckpointError`` naming it; nothing is ever loaded partially. Only the calls that interpret
the files turn a bare builtin error into a project error (``_named_errors``): an error in this module's own
logic stays what it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError, QwenVLVisionError
from ..model.build import build_model
from ..model.config import FAMILIES, VisionConfig, from_config_json
from ..model.names import to_checkpoint_state, to_module_state
from ..model.tower import VisionTower
from .checks import (
    SAFETENSORS_DTYPES,
    check_vision_entry,
    json_type,
    open_regular,
    parse_weight_map,
    read_header,
    read_json,
    read_open_header,
)

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
    """Where one vision tensor is stored."""

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
        if not present(path, what):
            return None
        settings = read_json(path, what)
        if not isinstance(settings, dict):
            raise ConfigError(f"{path} is not a JSON object (found {json_type(settings)})")
        return settings


def present(path: Path, what: str) -> bool:
    """Whether the checkpoint has the file ``path``: False only when no entry of that name exists at all.

    A symbolic link whose target is missing (a Hugging Face cache whose blob is gone) or that loops is a
    ``CheckpointError`` naming it: reading it as "absent" would silently put defaults in place of its settings.
    """
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        if not os.path.islink(path):
            return False
        raise CheckpointError(f"{what} {path} is a symbolic link to {os.readlink(path)}, which is missing (a "
                              f"broken Hugging Face cache?): download the checkpoint again, or remove the "
                              f"link if the checkpoint has no such file") from None
    except OSError as e:  # a link loop, a folder we may not search
        raise CheckpointError(f"cannot read {what} {path}: {e.strerror or e}") from e


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

    Only around the calls that interpret a file (the config, the index, a header, a tensor's bytes): their
    checks name the culprit precisely, and this is the backstop that keeps a case nobody thought of from
    escaping as a bare ``TypeError``. The code between those calls is ours, and a bug there must surface as
    itself, not as a bad file. Running out of memory is not the checkpoint's fault: it passes.
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
    config_path = folder / CONFIG_FILE
    if not present(config_path, "config"):
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    with _named_errors(CheckpointError, f"cannot read config {config_path}"):
        config_json = read_json(config_path, "config")
    if not isinstance(config_json, dict):
        raise ConfigError(f"{config_path} is not a JSON object (found {json_type(config_json)})")
    with _named_errors(ConfigError, f"{config_path} does not describe a vision tower"):
        config = from_config_json(config_json, name=config_json.get("name", "") or folder.name)
    vision_only = config_json.get("format") == VISION_ONLY_FORMAT
    prefixes = config.family.prefixes
    # transformers' order: the single file first, so an index that save_pretrained left beside the file it rewrote
    # (it keeps the index, removing the shards) is not read.
    index_path, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if present(single, "shard"):
        with _named_errors(CheckpointError, f"cannot read shard {single}"):
            header, _ = read_header(single)
        files = dict.fromkeys(header, single)
    elif present(index_path, "index"):
        with _named_errors(CheckpointError, f"cannot read index {index_path}"):
            weight_map = parse_weight_map(read_json(index_path, "index"), str(index_path))
        files = {name: folder / shard for name, shard in weight_map.items()}
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
    """The checkpoint holds exactly the tower's tensors: none missing, none more."""
    missing = sorted(set(expected) - set(checkpoint.tensors))
    surplus = sorted(set(checkpoint.tensors) - set(expected))
    if missing or surplus:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
        if surplus:
            parts.append(f"unexpected {len(surplus)} tensor(s): {_names(surplus)}")
        raise CheckpointError(f"{checkpoint.folder} does not match the {checkpoint.config.family.label} tower "
                              f"({len(expected)} tensors expected): " + "; ".join(parts))


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _by_shard(checkpoint: VisionCheckpoint) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for key, source in checkpoint.tensors.items():
        by_file.setdefault(source.file, []).append(key)
    return dict(sorted(by_file.items()))


def _holds(keys: list[str]) -> str:
    return f" (it holds vision tensors {_names(sorted(keys), 3)})"


def _shard_header(f: BinaryIO, path: Path) -> tuple[dict[str, dict], int]:
    with _named_errors(CheckpointError, f"cannot read shard {path}"):
        return read_open_header(f, path)


def vision_entries(checkpoint: VisionCheckpoint) -> dict[str, dict]:
    """Every vision tensor's validated header entry (name without prefix -> entry), one header read per shard.

    What ``inspect`` reports from: every check a load makes short of building the tower and reading data.
    """
    entries: dict[str, dict] = {}
    for path, keys in _by_shard(checkpoint).items():
        with open_regular(path, "shard", _holds(keys)) as f:
            header, _ = _shard_header(f, path)
        for key in keys:
            entries[key] = check_vision_entry(path, header, checkpoint.tensors[key].name, None)
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
        with open_regular(path, "shard", _holds(keys)) as f:
            header, data_start = _shard_header(f, path)
            plan = [(key, check_vision_entry(path, header, checkpoint.tensors[key].name, expected[key]))
                    for key in keys]
            for key, entry in sorted(plan, key=lambda item: item[1]["data_offsets"]):
                name = checkpoint.tensors[key].name
                with _named_errors(CheckpointError, f"cannot read tensor {name} from shard {path}"):
                    tensor = _read_one(f, path, name, entry, data_start, check_finite=check_finite)
                state[key] = tensor.to(device=device, dtype=dtype or tensor.dtype)
                del tensor
    return state


def load_tower(checkpoint: VisionCheckpoint, device: torch.device, dtype: torch.dtype | None, *,
               attn_impl: str = "auto", check_finite: bool = True, **model_options) -> VisionTower:
    """Build the tower on meta, check names and shapes, then materialise each tensor once on `device`.

    check_finite=False skips the NaN/Inf check, for checkpoints that hold such values on purpose.
    """
    with _named_errors(ConfigError, f"cannot build the {checkpoint.config.family.label} tower of {checkpoint.folder}"):
        model = build_model(checkpoint.config, device="meta", attn_impl=attn_impl, **model_options)
    module_state = model.state_dict()
    expected = to_checkpoint_state(checkpoint.config, module_state)  # meta tensors under the checkpoint's names
    check_names(checkpoint, expected)
    tensors = read_tensors(checkpoint, expected, device, dtype, check_finite=check_finite)
    # Names and shapes were checked against `expected`, which to_checkpoint_state made from this very model: a
    # failure from here on is a bug of ours (names.py), not the checkpoint's, and is not renamed into one.
    model.load_state_dict(to_module_state(checkpoint.config, tensors, module_state), strict=True, assign=True)
    model.set_attention(attn_impl)
    return model.eval().requires_grad_(False)
