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
(safetensors reads straight into CUDA memory) in the target dtype, so a load never holds a second copy
of the tower. Anything unexpected (a missing or surplus tensor, a wrong shape, a truncated shard) raises a
``CheckpointError`` naming it; nothing is ever loaded partially.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open  # header-only reads of a single-file checkpoint

from .config import FAMILIES, VisionConfig, from_config_json
from .errors import CheckpointError
from .models import build_model
from .names import checkpoint_shapes, to_checkpoint_state, to_module_state
from .tower import VisionTower

# Every family's prefixes, longest first ("thinker.visual." before "visual.").
VISION_PREFIXES = tuple(sorted({p for f in FAMILIES.values() for p in f.prefixes}, key=len, reverse=True))
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
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
        path = self.folder / PREPROCESSOR_FILE
        return read_json(path) if path.is_file() else None


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def strip_vision_prefix(name: str, prefixes: tuple[str, ...] = VISION_PREFIXES) -> str | None:
    """The name without its vision prefix, or None for a tensor outside the tower."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def shard_tensor_names(path: Path) -> list[str]:
    """Tensor names in one safetensors file, from its header only."""
    if not path.is_file():
        raise CheckpointError(f"shard {path} is missing")
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise CheckpointError(f"cannot read shard {path}: {e}") from e


def open_checkpoint(folder: str | os.PathLike) -> VisionCheckpoint:
    """Index a checkpoint folder's vision tensors (reads config and headers, never tensor data)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    config_json = read_json(config_path)
    config = from_config_json(config_json)
    config = config if config.name else config.replace(name=folder.name)
    vision_only = config_json.get("format") == VISION_ONLY_FORMAT
    prefixes = config.spec.prefixes
    index_path = folder / INDEX_FILE
    tensors: dict[str, TensorSource] = {}
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map")
        for name, shard in weight_map.items():
            module_path = name if vision_only else strip_vision_prefix(name, prefixes)
            if module_path is not None:
                tensors[module_path] = TensorSource(folder / shard, name)
    elif (folder / SINGLE_FILE).is_file():
        single = folder / SINGLE_FILE
        for name in shard_tensor_names(single):
            module_path = name if vision_only else strip_vision_prefix(name, prefixes)
            if module_path is not None:
                tensors[module_path] = TensorSource(single, name)
    else:
        raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    if not tensors:
        raise CheckpointError(f"{folder} holds no vision tensors (no names starting with {prefixes})")
    return VisionCheckpoint(folder, config_json, config, tensors, vision_only)


def check_names(checkpoint: VisionCheckpoint, expected: dict[str, torch.Size]) -> None:
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


SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
}


def read_header(path: Path) -> tuple[dict, int]:
    """A shard's safetensors header and where its data starts; a truncated or corrupt file is named."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"shard {path} is truncated ({size} bytes)")
        header_len = struct.unpack("<Q", raw)[0]
        if 8 + header_len > size:
            raise CheckpointError(f"shard {path} is truncated or corrupt: header of {header_len} bytes, file {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"shard {path} has a corrupt header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path} has a corrupt header (not a JSON object)")
    header.pop("__metadata__", None)
    start = 8 + header_len
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if start + end > size:
        raise CheckpointError(f"shard {path} is truncated: its header needs {start + end} bytes, the file has {size}")
    return header, start


def _read_one(f, path: Path, name: str, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor's bytes read into fresh host memory (no mmap: the result owns its storage)."""
    stored = SAFETENSORS_DTYPES.get(entry["dtype"])
    if stored is None:
        raise CheckpointError(f"tensor {name} in {path} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    buffer = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(data_start + begin)
    if f.readinto(buffer.numpy()) != end - begin:
        raise CheckpointError(f"shard {path} is truncated inside tensor {name}")
    return buffer.view(stored).view(entry["shape"])


def read_tensors(checkpoint: VisionCheckpoint, expected: dict[str, torch.Size], device: torch.device,
                 dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every vision tensor once, onto `device` in `dtype` (None: as stored), shapes checked before reading.

    Bytes are read with plain file reads into memory the tensor owns (nothing stays mapped to the
    checkpoint, so the files may change afterwards); a tensor already in the target dtype on CPU is
    used as read, otherwise converted one tensor at a time on the target device, so the host peak is
    the tower plus one tensor.
    """
    by_file: dict[Path, list[str]] = {}
    for module_path, source in checkpoint.tensors.items():
        by_file.setdefault(source.file, []).append(module_path)
    state: dict[str, torch.Tensor] = {}
    for path, module_paths in sorted(by_file.items()):
        if not path.is_file():
            raise CheckpointError(f"shard {path} holds vision tensors ({_names(sorted(module_paths), 3)}) "
                                  f"but is missing")
        header, data_start = read_header(path)
        for module_path in module_paths:
            name = checkpoint.tensors[module_path].name
            if name not in header:
                raise CheckpointError(f"tensor {name} is listed in the index for {path} but is not in that shard")
            shape = tuple(header[name]["shape"])
            if shape != tuple(expected[module_path]):
                raise CheckpointError(f"tensor {name} in {path} has shape {shape}, expected "
                                      f"{tuple(expected[module_path])}")
        with open(path, "rb", buffering=0) as f:
            for module_path in sorted(module_paths, key=lambda m: header[checkpoint.tensors[m].name]["data_offsets"]):
                name = checkpoint.tensors[module_path].name
                tensor = _read_one(f, path, name, header[name], data_start)
                state[module_path] = tensor.to(device=device, dtype=dtype or tensor.dtype)
                del tensor
    return state


def load_tower(checkpoint: VisionCheckpoint, device: torch.device, dtype: torch.dtype | None,
               attn_impl: str = "auto", **model_options) -> VisionTower:
    """Build the tower on meta, check names and shapes, then materialise each tensor once on `device`."""
    model = build_model(checkpoint.config, device="meta", attn_impl=attn_impl, **model_options)
    module_shapes = {name: t.shape for name, t in model.state_dict().items()}
    expected = checkpoint_shapes(checkpoint.config, module_shapes)
    check_names(checkpoint, expected)
    tensors = read_tensors(checkpoint, expected, device, dtype)
    model.load_state_dict(to_module_state(checkpoint.config, tensors, module_shapes), strict=True, assign=True)
    first = next(model.parameters())
    model.set_attention(attn_impl, first.device, first.dtype)
    return model.eval().requires_grad_(False)


def save_vision_only(model: VisionTower, folder: str | os.PathLike, preprocessor: dict | None = None) -> Path:
    """Write a self-contained vision-only checkpoint that ``open_checkpoint`` reads back."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config_json = {**model.config.to_config_json(), "format": VISION_ONLY_FORMAT}
    state = {k: v.detach().contiguous().cpu() for k, v in to_checkpoint_state(model.config, model.state_dict()).items()}
    tmp = folder / (SINGLE_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "family": model.config.family})
    os.replace(tmp, folder / SINGLE_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
    if preprocessor is not None:
        (folder / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor, indent=2) + "\n")
    return folder
