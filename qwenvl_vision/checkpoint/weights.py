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

Shards are read by ``safetensors`` itself, which validates each header as the format defines it; only the shards
the index names for vision tensors are opened. Only regular files are read (a FIFO would hang the open), an
index's shard names must be plain file names in the folder (transformers joins them to the folder unchecked),
and a file that is a symbolic link to nothing (a broken Hugging Face cache) is an error naming it, never read as
absent (``present``). Tensors are read under the checkpoint's own names and only then stacked or renamed into
module tensors (``model.names``), so every error names a tensor as the checkpoint spells it.

The model is built on the meta device and every tensor is copied once out of the shard's mapping, directly onto
the target device in the target dtype, into memory the tower owns (nothing stays mapped to the files). Anything
unexpected in the files (a missing or surplus tensor, a wrong shape, an integer dtype, a truncated or corrupt
shard, a shard name leaving the folder, a NaN weight) raises a ``CheckpointError`` naming it; nothing is ever
loaded partially.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from ..devices import SAFETENSORS_DTYPES
from ..errors import CheckpointError, ConfigError, QwenVLVisionError
from ..model.build import build_model
from ..model.config import FAMILIES, VisionConfig, from_config_json
from ..model.names import to_checkpoint_state, to_module_state
from ..model.tower import VisionTower

# Every family's prefixes, longest first ("thinker.visual." before "visual.").
VISION_PREFIXES = tuple(sorted({p for f in FAMILIES.values() for p in f.prefixes}, key=len, reverse=True))
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
VISION_ONLY_FORMAT = "qwenvl-vision"
# A shard's mapping keeps every page read through it resident until it is closed: it is reopened after this many
# bytes, so a load holds the tower plus at most this much (or one tensor) of the files.
MAPPED_BYTES = 32 << 20


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


# ---------------------------------------------------------------------- files: regular only; JSON; the index


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_regular(path: Path, what: str, holds: str = "") -> None:
    """Refuse anything but a regular file (symlinks followed, as in the HF cache) before it is opened: a FIFO would
    block the open forever and a device may never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise CheckpointError(f"{what} {path}{holds} is missing") from e
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL byte
        raise CheckpointError(f"cannot read {what} {path}{holds}: {e}") from e
    if not stat.S_ISREG(mode):
        kind = next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "not a regular file")
        raise CheckpointError(f"{what} {path}{holds} is {kind}, not a regular file")


def read_json(path: Path, what: str = "file") -> object:
    """A JSON file's value (any JSON type: callers check it), read only if it is a regular file."""
    check_regular(path, what)
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"cannot read {what} {path}: {e}") from e


def json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


def check_shard_name(shard: str, where: str, tensor: str) -> None:
    """An index's shard name must be a plain file name in the checkpoint folder, as every release writes them:
    '../other/x' would load another folder's weights without a word. A symlink named plainly inside the folder
    stays allowed (the Hugging Face cache is made of them), and so does a name merely containing two dots."""
    parts = re.split(r"[/\\]", shard)
    if not shard:
        reason = "is empty"
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


@contextlib.contextmanager
def open_shard(path: Path, holds: str = "") -> Iterator[safe_open]:
    """A shard opened by safetensors, which validates its header as the format defines it (the header's length,
    dtypes, offsets that tile the data); a corrupt, truncated or unreadable file is one CheckpointError naming it."""
    check_regular(path, "shard", holds)
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"shard {path}{holds} is corrupt or truncated: {' '.join(str(e).split())}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read shard {path}{holds}: {e}") from e


# ---------------------------------------------------------------------- builtin errors -> project errors


_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
# What malformed data makes Python or torch raise; anything else (a NameError...) is a bug and stays visible.
_DATA_ERRORS = (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError, RuntimeError)


@contextlib.contextmanager
def _named_errors(error: type[QwenVLVisionError], what: str) -> Iterator[None]:
    """Re-raise a bare builtin error from interpreting the config as `error` naming `what`, the original chained.

    Only around the calls that interpret it: a bug in the code between them must surface as itself, not as a bad
    file. Running out of memory is not the checkpoint's fault: it passes.
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
        with open_shard(single) as f:
            files = dict.fromkeys(f.keys(), single)
    elif present(index_path, "index"):
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


def _by_shard(checkpoint: VisionCheckpoint) -> dict[Path, dict[str, str]]:
    """Per shard holding vision tensors: their names in it -> their names without prefix."""
    by_file: dict[Path, dict[str, str]] = {}
    for key, source in checkpoint.tensors.items():
        by_file.setdefault(source.file, {})[source.name] = key
    return dict(sorted(by_file.items()))


def _holds(names: dict[str, str]) -> str:
    return f" (it holds vision tensors {_names(sorted(names.values()), 3)})"


def check_vision_entry(path: Path, f: safe_open, name: str, expected: torch.Tensor | None) -> dict:
    """A vision tensor as the open shard `f` stores it: present, in a floating-point dtype and (with `expected`,
    the meta tensor it fills) of the expected shape. Returns its ``dtype`` (safetensors' name), ``shape`` and
    ``bytes``."""
    try:
        stored = f.get_slice(name)
    except SafetensorError as e:
        raise CheckpointError(f"tensor {name} is listed in the index for {path} but is not in that shard") from e
    dtype, shape = stored.get_dtype(), stored.get_shape()
    if dtype not in SAFETENSORS_DTYPES:  # every tower tensor is a float: an integer relabelling would load as weights
        raise CheckpointError(f"tensor {name} in {path} is stored as {dtype}, not as a floating-point dtype "
                              f"({', '.join(SAFETENSORS_DTYPES)})")
    if expected is not None and tuple(shape) != tuple(expected.shape):
        raise CheckpointError(f"tensor {name} in {path} has shape {tuple(shape)}, expected {tuple(expected.shape)}")
    return {"dtype": dtype, "shape": shape, "bytes": math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize}


def vision_entries(checkpoint: VisionCheckpoint) -> dict[str, dict]:
    """Every vision tensor's entry (name without prefix -> ``check_vision_entry``'s), one open per shard: every
    check a load makes short of building the tower and reading data (what ``inspect`` reports from)."""
    entries: dict[str, dict] = {}
    for path, names in _by_shard(checkpoint).items():
        with open_shard(path, _holds(names)) as f:
            for name, key in names.items():
                entries[key] = check_vision_entry(path, f, name, None)
    return entries


# ---------------------------------------------------------------------- reading tensors


# The bits of +Inf and -Inf per float dtype. Exponent all ones (NaN or Inf) means: the bits read as signed >= +Inf's
# for a positive value, read as unsigned >= -Inf's for a negative one.
_INF_BITS = {torch.bfloat16: (0x7F80, 0xFF80), torch.float16: (0x7C00, 0xFC00),
             torch.float32: (0x7F80_0000, 0xFF80_0000), torch.float64: (0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000)}
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _refuse_non_finite(tensor: torch.Tensor, name: str, path: Path) -> None:
    """A NaN or Inf weight is a CheckpointError naming the tensor, with the count of each.

    Two integer maxima over the bits, in numpy: exact (a sum overflows on finite fp16 values) and single-threaded
    (torch's reductions fan out to its OpenMP threads, whose barriers stalled a bf16 3B check at 1.3 s against
    0.05 s with the cores busy).
    """
    positive_inf, negative_inf = _INF_BITS[tensor.dtype]
    bits = tensor.reshape(-1).view(_SIGNED[tensor.element_size()]).numpy()
    if not bits.size or bits.max() < positive_inf and bits.view(f"u{bits.itemsize}").max() < negative_inf:
        return
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    raise CheckpointError(f"tensor {name} in {path} holds {nan} NaN and {inf} infinite value(s) "
                          f"(pass check_finite=False to load it anyway)")


def read_tensors(checkpoint: VisionCheckpoint, expected: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype | None, *, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Every vision tensor once, onto `device` in `dtype` (None: as stored), a shard's checks made before reading.

    expected: tensor name without prefix -> the (meta) tensor it fills, for shape checks. Each tensor is copied
    out of the shard's mapping on its own, straight onto the device and into the target dtype, so the host peak
    is the tower plus ``MAPPED_BYTES``. With `check_finite`, each is checked for NaN/Inf as stored.
    """
    state: dict[str, torch.Tensor] = {}
    for path, names in _by_shard(checkpoint).items():
        with open_shard(path, _holds(names)) as f:
            for name, key in names.items():
                check_vision_entry(path, f, name, expected[key])
            pending = [name for name in f.offset_keys() if name in names]  # in file order: sequential reads
        while pending:
            with open_shard(path, _holds(names)) as f:
                mapped = 0
                while pending and mapped < MAPPED_BYTES:
                    name = pending.pop(0)
                    stored = f.get_tensor(name)
                    mapped += stored.nbytes
                    if check_finite:
                        _refuse_non_finite(stored, name, path)
                    state[names[name]] = stored.to(device=device, dtype=dtype or stored.dtype, copy=True)
                    del stored
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
