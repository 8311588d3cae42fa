"""Writing a vision-only checkpoint (``qwenvl-vision extract-weights``): the tower's tensors under the family's
names without prefix in one ``model.safetensors``, its ``config.json`` marked ``"format": "qwenvl-vision"`` and the
preprocessor configs, each file replaced whole and never through a link. ``weights.open_checkpoint`` reads it back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import BinaryIO

import torch

from ..model.names import to_checkpoint_state
from ..model.tower import VisionTower
from ..outputs.durable import refuse_link, replace_atomically
from .checks import SAFETENSORS_DTYPES
from .weights import CONFIG_FILE, PREPROCESSOR_FILE, SINGLE_FILE, VIDEO_PREPROCESSOR_FILE, VISION_ONLY_FORMAT


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Every name save_vision_only writes in its folder, final and temporary: extract-weights refuses a target where one
# of them is a file of its source.
VISION_ONLY_FILES = (SINGLE_FILE, CONFIG_FILE, PREPROCESSOR_FILE, VIDEO_PREPROCESSOR_FILE)
TEMPORARY_SUFFIX = ".tmp"
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(f: BinaryIO, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``state`` in the safetensors format, streamed into the open file ``f`` one tensor at a time (no serialised
    copy of the tower in memory): the 8-byte little-endian header length, the JSON header padded with spaces to
    a multiple of 8 (as safetensors writes it), then each tensor's little-endian bytes in header order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(state):
        tensor = state[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous().reshape(-1)
        if not tensor.numel():
            continue
        data = tensor.view(torch.uint8).reshape(-1, tensor.element_size())
        if sys.byteorder == "big":  # the format is little-endian whatever the machine
            data = data.flip(-1).contiguous()
        f.write(memoryview(data.numpy()).cast("B"))


def _set_mode(f: BinaryIO, mode: int) -> None:
    if hasattr(os, "fchmod"):  # POSIX; elsewhere a file has no such mode bits
        os.fchmod(f.fileno(), mode)


def save_vision_only(model: VisionTower, folder: str | os.PathLike, preprocessor: dict | None = None,
                     video_preprocessor: dict | None = None) -> int:
    """Write a self-contained vision-only checkpoint that ``open_checkpoint`` reads back; returns the number of
    tensors written.

    Each file is replaced whole or not at all (written to ``NAME.tmp``, created exclusively, then renamed), and
    nothing is written through a symbolic link: a link at the folder or at any of the names written, final or
    temporary, is an ``OutputLinkError`` naming it, raised before any file is written. ``config.json`` is removed
    first and written last, so a folder left half-written (a full disk, a kill) does not load as a checkpoint with
    another's settings.
    """
    folder = Path(folder)
    refuse_link(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config_json = {**model.config.to_config_json(), "format": VISION_ONLY_FORMAT}
    documents = {PREPROCESSOR_FILE: preprocessor, VIDEO_PREPROCESSOR_FILE: video_preprocessor, CONFIG_FILE: config_json}
    for name in (SINGLE_FILE, *(n for n, d in documents.items() if d is not None)):
        refuse_link(folder / name)
        refuse_link(folder / (name + TEMPORARY_SUFFIX))
    (folder / CONFIG_FILE).unlink(missing_ok=True)
    state = to_checkpoint_state(model.config, model.state_dict())
    mode = 0o666 & ~_umask()  # as a plain open() would create it: the folder's other files follow the umask too

    def write_weights(f: BinaryIO) -> None:
        _set_mode(f, mode)
        write_safetensors(f, state, {"format": "pt", "family": model.config.model_type})

    replace_atomically(folder / SINGLE_FILE, folder / (SINGLE_FILE + TEMPORARY_SUFFIX), write_weights)
    for name, document in documents.items():
        if document is None:
            continue
        data = (json.dumps(document, indent=2) + "\n").encode()

        def write_document(f: BinaryIO, data: bytes = data) -> None:
            _set_mode(f, mode)
            f.write(data)

        replace_atomically(folder / name, folder / (name + TEMPORARY_SUFFIX), write_document)
    return len(state)
