"""What identifies an embedding: the pixels the tower read and the model that read them.

An item's id (``item_id``) is a SHA-256 over the model's identity (``VisionEncoder.identity``: family, the vision and
preprocessing config, the weights as loaded, the dtype), the item's modality and patch grid, and a SHA-256 of the
pixel rows the tower was given (``pixels_sha256``). The same image or video under the same model and settings so
gets the same id from ``embed`` and from ``encode_images`` / ``encode_videos``, on any machine whose preprocessing
gives the same pixels; any setting that changes the pixels (resize bounds and backend, the video fps, the frames
kept) or the model (another checkpoint, a fine-tune, another dtype) changes it.

Deviation from hashing the input file's bytes: the pixels are what the embedding is a function of, so two files
that decode to the same pixels share one id (and one embedding), and images given in memory get ids like files.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import torch

from ..errors import InputError

IDENTITY_FIELDS = ("family", "config_sha256", "weights_sha256", "dtype")
SHA256 = re.compile(r"[0-9a-f]{64}")


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 as this module writes them: 64 lowercase hex digits, nothing else."""
    return isinstance(value, str) and SHA256.fullmatch(value) is not None


def sha256_json(value: Any) -> str:
    """A hash of a JSON value, independent of its key order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of the vision tensors as loaded (names, dtypes, shapes, bytes).

    Stronger than hashing the checkpoint's index: a fine-tune keeps its base model's tensor names and index.
    About a second per GB.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}:{data.dtype}:{tuple(tensor.shape)}\n".encode())
        h.update(data.view(torch.uint8).numpy())
    return h.hexdigest()


def config_sha256(config, preprocess_config) -> str:
    """A hash of the tower's config and its image preprocessing (``VisionConfig``, ``PreprocessConfig``)."""
    return sha256_json({"vision": config.to_vision_dict(), "preprocess": preprocess_config.to_dict()})


def pixels_sha256(rows: torch.Tensor) -> str:
    """A hash of one item's pixel rows as float32 (the preprocessors' output type), shape included."""
    data = rows.detach().float().contiguous().cpu()
    h = hashlib.sha256(f"{tuple(data.shape)}\n".encode())
    h.update(data.view(torch.uint8).numpy())
    return h.hexdigest()


def item_id(identity: dict[str, str], modality: str, grid_thw: tuple[int, int, int] | list[int],
            pixels: str) -> str:
    """An item's id: 64 hex digits over the model's identity, the modality, the grid and the pixels' hash. A missing
    or malformed pixels hash is an InputError: every item without one would share an id."""
    if not is_sha256(pixels):
        raise InputError(f"no pixel hash for this {modality} ({pixels!r:.80}), which its id needs: encode it with "
                         f"hash_pixels=True (encode_images and encode_videos do)")
    return sha256_json({"model": {k: identity[k] for k in IDENTITY_FIELDS}, "modality": modality,
                        "grid_thw": [int(g) for g in grid_thw], "pixels_sha256": pixels})
