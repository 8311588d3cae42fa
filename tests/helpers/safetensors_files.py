"""Editing written checkpoints in place, byte for byte as the safetensors format lays them out: the index's
weight map, a shard's header (its length prefix, the JSON, the padding) and its data section. The corruption
tests (test_checkpoint_validation.py, test_cli.py's inspect, test_hub.py, test_loading.py) start from a
``write_checkpoint`` folder and change one thing with these.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
LN_Q = "visual.merger.ln_q.weight"  # F32 (160,), in the second (vision + LLM) shard of QWEN2_5_SMALL's checkpoint


def read_index(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def write_index(folder: Path, index: object) -> None:
    (folder / INDEX_FILE).write_text(json.dumps(index))


def shard_of(folder: Path, name: str) -> Path:
    """The shard holding tensor `name`: by the index, or the one ``model.safetensors`` of a single-file layout."""
    if not (folder / INDEX_FILE).exists():
        return folder / "model.safetensors"
    return folder / read_index(folder)["weight_map"][name]


def split_shard(shard: Path) -> tuple[dict, bytes]:
    """A shard's header (``__metadata__`` included) and its data section."""
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join_shard(shard: Path, header: object, data: bytes, *, header_text: str | None = None) -> None:
    """Write a shard from a header (or its exact text) and a data section, the header padded as safetensors pads
    it."""
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(folder: Path, name: str, edit) -> Path:
    """Apply edit(header) to the header of the shard holding `name`; return that shard."""
    shard = shard_of(folder, name)
    header, data = split_shard(shard)
    edit(header)
    join_shard(shard, header, data)
    return shard


def set_entry(folder: Path, name: str, **fields) -> Path:
    """Overwrite fields (dtype, shape, data_offsets) of tensor `name`'s header entry; return its shard."""
    return edit_header(folder, name, lambda header: header[name].update(fields))


def offsets_of(folder: Path, name: str) -> list[int]:
    return split_shard(shard_of(folder, name))[0][name]["data_offsets"]


def same_size_pair(folder: Path) -> tuple[Path, str, str]:
    """Two vision tensors in LN_Q's shard with equal byte lengths, the second stored after the first."""
    shard = shard_of(folder, LN_Q)
    header, _ = split_shard(shard)
    entries = sorted((e["data_offsets"], n) for n, e in header.items() if n.startswith("visual."))
    for (a_off, a), (b_off, b) in zip(entries, entries[1:]):
        if a_off[1] - a_off[0] == b_off[1] - b_off[0]:
            return shard, a, b
    raise AssertionError("no two adjacent equal-size tensors")
