"""Loading a vision tower from a checkpoint folder: index its vision tensors, read them, build the tower (writing
a vision-only checkpoint is ``save``'s).

Layouts: released (``config.json`` + ``model.safetensors``, or ``model.safetensors.index.json`` and its shards:
transformers' ``SAFE_WEIGHTS_NAME`` / ``SAFE_WEIGHTS_INDEX_NAME``), the vision tensors under the family's prefix
(``config.Family.prefixes``: ``visual.``, ``model.visual.`` as transformers 4.52+ re-saves it, or the Omni models'
``thinker.visual.``); or vision-only, as ``qwenvl-vision extract-weights`` writes it (``"format": "qwenvl-vision"``
in config.json, the family's tensor names without prefix in one ``model.safetensors``).

A checkpoint comes from anywhere: ``safetensors`` validates each header as the format defines it, and this module
adds only what the format cannot say (the index's shard names stay in the folder, only regular files are opened,
a link to nothing is an error rather than an absent file, the tensors are the tower's in a float dtype and shape,
no NaN). Tensors are read under the checkpoint's own names and only then stacked or renamed into module tensors
(``model.names``), so every error names a tensor as the checkpoint spells it. The model is built on the meta
device and every tensor is copied once out of the shard's mapping, directly onto the target device in the target
dtype, into memory the tower owns (nothing stays mapped to the files); nothing is ever loaded partially.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..devices import SAFETENSORS_DTYPES, dtype_name
from ..errors import CheckpointError, ConfigError, QwenVLVisionError
from ..model.build import build_model
from ..model.config import VisionConfig, from_config_json, tower_family
from ..model.names import to_checkpoint_state, to_module_names_
from ..model.tower import VisionTower

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # transformers 5 saves every processor's settings in it, nested
VISION_ONLY_FORMAT = "qwenvl-vision"
# A shard's mapping keeps every page read through it resident until it is closed: it is reopened after this many
# bytes, so a load holds the tower plus at most this much (or one tensor) of the files.
MAPPED_BYTES = 32 << 20


@dataclass
class VisionCheckpoint:
    """Where each vision tensor of a checkpoint folder lives, without reading any tensor data."""

    folder: Path
    config: VisionConfig
    tensors: dict[str, tuple[Path, str]]  # checkpoint tensor name without the prefix -> (its shard, its name there)
    vision_only: bool

    @property
    def shard_files(self) -> list[Path]:
        return sorted({file for file, _ in self.tensors.values()})

    def preprocessor_json(self) -> dict | None:
        """The image processor's settings, where transformers 5's ``ImageProcessingMixin.get_image_processor_dict``
        reads them: ``processor_config.json``'s ``image_processor``, else ``preprocessor_config.json``."""
        nested = self.nested_json("image_processor")
        if nested is None:
            return self.file_json(PREPROCESSOR_FILE, "preprocessor config")
        # transformers 5 saves either processor as Qwen2VLImageProcessor and loads that name as its torchvision one
        # wherever torchvision is installed: spelled here as files written before 5 name that one.
        return {**nested, "image_processor_type": "Qwen2VLImageProcessorFast"}

    def video_preprocessor_json(self) -> dict | None:
        """The video processor's settings, in transformers 5's ``BaseVideoProcessor.get_video_processor_dict``
        order: ``processor_config.json``'s ``video_processor``, ``video_preprocessor_config.json``,
        ``preprocessor_config.json``."""
        nested = self.nested_json("video_processor")
        if nested is not None:
            return nested
        video = self.file_json(VIDEO_PREPROCESSOR_FILE, "video preprocessor config")
        return video if video is not None else self.file_json(PREPROCESSOR_FILE, "preprocessor config")

    def nested_json(self, key: str) -> dict | None:
        """``processor_config.json``'s entry ``key`` (None where the file or the entry is absent, as transformers
        then reads the older files)."""
        processor = self.file_json(PROCESSOR_FILE, "processor config")
        value = None if processor is None else processor.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{self.folder / PROCESSOR_FILE}: {key} is not a JSON object")
        return value

    def file_json(self, name: str, what: str) -> dict | None:
        path = self.folder / name
        return read_json(path, what, ConfigError) if present(path, what) else None


def present(path: Path, what: str) -> bool:
    """Whether the checkpoint has the file ``path``. A symbolic link to nothing (a Hugging Face cache whose blob is
    gone) is a ``CheckpointError`` naming it: read as absent, its settings would silently become the defaults."""
    if path.exists():
        return True
    if path.is_symlink():
        raise CheckpointError(f"{what} {path} is a symbolic link to {os.readlink(path)}, which is missing (a "
                              f"broken Hugging Face cache?): download the checkpoint again, or remove the link if "
                              f"the checkpoint has no such file")
    return False


def strip_vision_prefix(name: str, prefixes: tuple[str, ...]) -> str | None:
    """The name without its vision prefix, or None for a tensor outside the tower."""
    return next((name[len(prefix):] for prefix in prefixes if name.startswith(prefix)), None)


def check_regular(path: Path, what: str) -> None:
    """Only regular files are opened (links followed, as in the Hugging Face cache): a FIFO would block the open
    forever and a device may never end."""
    try:
        problem = None if stat.S_ISREG(path.stat().st_mode) else "not a regular file"
    except FileNotFoundError:
        problem = "missing"
    except (OSError, ValueError) as e:  # a name too long, a link loop, a NUL: an index from outside may name anything
        problem = f"unreadable ({getattr(e, 'strerror', None) or e})"
    if problem:
        raise CheckpointError(f"{what} {path} is {problem}")


def read_json(path: Path, what: str, error: type[QwenVLVisionError] = CheckpointError) -> dict:
    """A JSON file holding an object, read only if it is a regular file; `error` for any other JSON value."""
    check_regular(path, what)
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(value, dict):
        raise error(f"{path} is not a JSON object (found {type(value).__name__})")
    return value


def parse_weight_map(index: dict, where: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name); errors name `where`.

    A shard name must be a plain file name in the checkpoint folder, as every release writes them: '../other/x'
    would load another folder's weights without a word (transformers joins them to the folder unchecked). A link
    named plainly inside the folder stays allowed: the Hugging Face cache is made of them.
    """
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where} has no weight_map object (found {type(weight_map).__name__})")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise CheckpointError(f"{where}: shard name {shard!r} (for tensor {name!r}) is not a plain file name "
                                  f"in the checkpoint folder")
    return weight_map


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[safe_open]:
    """A shard opened by safetensors, which validates its header as the format defines it (the header's length,
    dtypes, offsets that tile the data); a corrupt, truncated or unreadable file is one CheckpointError naming it."""
    check_regular(path, "shard")
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"shard {path} is corrupt or truncated: {' '.join(str(e).split())}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read shard {path}: {e}") from e


def open_checkpoint(folder: str | os.PathLike) -> VisionCheckpoint:
    """Index a checkpoint folder's vision tensors (reads config, index and headers, never tensor data)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config_path = folder / CONFIG_FILE
    if not present(config_path, "config"):
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    config_json = read_json(config_path, "config", ConfigError)
    config = from_config_json(config_json, name=config_json.get("name", "") or folder.name)
    # Ours, or a tower transformers saved on its own: its tensors' names have no prefix.
    vision_only = (config_json.get("format") == VISION_ONLY_FORMAT
                   or tower_family(config_json.get("model_type")) is not None)
    prefixes = config.family.prefixes
    # transformers' order: the single file first, so an index that save_pretrained left beside the file it rewrote
    # (it keeps the index, removing the shards) is not read.
    index_path, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if present(single, "shard"):
        with open_shard(single) as f:
            files = dict.fromkeys(f.keys(), single)
    elif present(index_path, "index"):
        files = {name: folder / shard for name, shard in parse_weight_map(read_json(index_path, "index"),
                                                                          str(index_path)).items()}
    else:
        raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    tensors: dict[str, tuple[Path, str]] = {}
    for name, path in files.items():
        key = name if vision_only else strip_vision_prefix(name, prefixes)
        if key is None:
            continue
        if key in tensors:  # 'visual.x' and 'model.visual.x': which one is meant cannot be told
            raise CheckpointError(f"{folder} holds {key} twice, as {tensors[key][1]} and {name}")
        tensors[key] = (path, name)
    if not tensors:
        raise CheckpointError(f"{folder} holds no vision tensors (no names starting with {prefixes})")
    return VisionCheckpoint(folder, config, tensors, vision_only)


def vision_entries(checkpoint: VisionCheckpoint, expected: dict[str, torch.Tensor] | None = None) -> dict[str, dict]:
    """Every vision tensor's entry (name without prefix -> its ``file``, ``name`` there, ``dtype`` (safetensors'
    name), ``shape`` and ``bytes``), from the headers only, one open per shard, each shard's in file order.

    Each is checked to be in its shard and stored in a floating-point dtype (an integer relabelling would load as
    weights) and, with `expected` (the meta tensors they fill), of the expected shape.
    """
    entries: dict[str, dict] = {}
    by_file: dict[Path, dict[str, str]] = {}  # per shard: names in it -> names without prefix
    for key, (file, name) in checkpoint.tensors.items():
        by_file.setdefault(file, {})[name] = key
    for path, names in sorted(by_file.items()):
        with open_shard(path) as f:
            absent = sorted(set(names) - set(f.keys()))
            if absent:
                raise CheckpointError(f"tensor {absent[0]} is listed in the index for {path} but is not in that shard")
            for name in (name for name in f.offset_keys() if name in names):  # file order: sequential reads
                stored, key = f.get_slice(name), names[name]
                dtype, shape = stored.get_dtype(), tuple(stored.get_shape())
                if dtype not in SAFETENSORS_DTYPES:
                    raise CheckpointError(f"tensor {name} in {path} is stored as {dtype}, not as a floating-point "
                                          f"dtype ({', '.join(SAFETENSORS_DTYPES)})")
                if expected is not None and shape != tuple(expected[key].shape):
                    raise CheckpointError(f"tensor {name} in {path} has shape {shape}, expected "
                                          f"{tuple(expected[key].shape)}")
                entries[key] = {"file": path, "name": name, "dtype": dtype, "shape": shape,
                                "bytes": math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize}
    return entries


# The bits of +Inf and -Inf per float dtype. Exponent all ones (NaN or Inf) means: the bits read as signed >= +Inf's
# for a positive value, read as unsigned >= -Inf's for a negative one.
_INF_BITS = {torch.bfloat16: (0x7F80, 0xFF80), torch.float16: (0x7C00, 0xFC00),
             torch.float32: (0x7F80_0000, 0xFF80_0000), torch.float64: (0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000)}
_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _refuse_non_finite(tensor: torch.Tensor, name: str, path: Path, stored: torch.dtype) -> None:
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
    narrowed = torch.finfo(stored).max > torch.finfo(tensor.dtype).max  # a finite weight may overflow the cast
    advice = f"load it in {dtype_name(stored)}, as stored" if narrowed else "pass check_finite=False to load it anyway"
    raise CheckpointError(f"tensor {name} in {path} holds {nan} NaN and {inf} infinite value(s) as "
                          f"{dtype_name(tensor.dtype)} ({advice})")


def read_tensors(checkpoint: VisionCheckpoint, expected: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype | None, *, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Every vision tensor once, onto `device` in `dtype` (None: as stored), every header checked before any data
    is read (``vision_entries``; `expected`: name without prefix -> the meta tensor it fills). Each is copied out of
    the shard's mapping on its own, cast on the host, then moved to the device, the shard reopened every
    ``MAPPED_BYTES``, so the host peak is the tower plus that; with `check_finite`, refused if NaN/Inf once cast (a
    finite float64 or float32 weight may overflow the dtype it is cast to).
    """
    pending = list(vision_entries(checkpoint, expected).items())
    state: dict[str, torch.Tensor] = {}
    while pending:
        path, mapped = pending[0][1]["file"], 0
        with open_shard(path) as f:
            while pending and pending[0][1]["file"] == path and mapped < MAPPED_BYTES:
                key, entry = pending.pop(0)
                stored = f.get_tensor(entry["name"])
                mapped += stored.nbytes
                stored_dtype = stored.dtype
                tensor = stored.to(dtype=dtype or stored_dtype, copy=device.type == "cpu")
                del stored  # the last reference into the mapping (on the CPU): the close unmaps it
                if check_finite:
                    _refuse_non_finite(tensor, entry["name"], path, stored_dtype)
                state[key] = tensor.to(device)
    return state


def load_tower(checkpoint: VisionCheckpoint, device: torch.device, dtype: torch.dtype | None, *,
               attn_impl: str = "auto", check_finite: bool = True, **model_options) -> VisionTower:
    """Build the tower on meta, check names and shapes, then materialise each tensor once on `device`."""
    model = build_model(checkpoint.config, device="meta", attn_impl=attn_impl, **model_options)
    module_state = model.state_dict()
    expected = to_checkpoint_state(checkpoint.config, module_state)  # meta tensors under the checkpoint's names
    # The checkpoint holds exactly the tower's tensors: none missing, none more.
    prefix = next(name[:len(name) - len(key)] for key, (_, name) in checkpoint.tensors.items())  # as files spell
    missing = sorted(prefix + key for key in set(expected) - set(checkpoint.tensors))
    surplus = sorted(checkpoint.tensors[key][1] for key in set(checkpoint.tensors) - set(expected))
    parts = [f"{what} {len(names)} tensor(s): {', '.join(names[:8])}" + (" ..." if len(names) > 8 else "")
             for what, names in (("missing", missing), ("unexpected", surplus)) if names]
    if parts:
        raise CheckpointError(f"{checkpoint.folder} does not match the {checkpoint.config.family.label} tower "
                              f"({len(expected)} tensors expected): " + "; ".join(parts))
    tensors = read_tensors(checkpoint, expected, device, dtype, check_finite=check_finite)
    model.load_state_dict(to_module_names_(checkpoint.config, tensors, module_state), strict=True, assign=True)
    model.set_attention(attn_impl)
    return model.eval().requires_grad_(False)
