"""The Parquet layout of embedding results and its writing: the schema, a table built from records, shards written
atomically (``parquet_reader`` reads them back). The columns and why a name that is not UTF-8 is an error row:
docs/embed.md, "Parquet columns" and "File names".

An error row's tensors are null, and so are the carried columns (``embed --keep-columns``; ``json`` as a string of
JSON) of an input no table row named. ``text`` writes what UTF-8 cannot encode (a surrogate) as its backslash
escape, as ``repr`` spells it; embed records such an input as an error row (``needs_escape``). Arrow has no
bfloat16: a bf16 or fp16 run stores float32, which holds every such value exactly. The schema metadata (key
``qwenvl_vision``) holds the layout (D, L, merge size, dtype, which tensor columns) and the caller's run record (a
JSON dict, e.g. run.json), so the reader gives back the very tensors the encoder returned. A shard is written
whole or not at all (``write_table_atomic``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..devices import dtype_name
from ..inputs.urls import redacted_text
from .durable import replace_atomically
from .records import EmbeddingRecord

PARQUET_FORMAT = 1
METADATA_KEY = b"qwenvl_vision"
# The video struct holds what embed's manifest records for a video file (see video.VideoInfo).
VIDEO_TYPE = pa.struct([("frames", pa.list_(pa.int64())), ("timestamps", pa.list_(pa.float64())),
                        ("fps", pa.float64()), ("sampled_fps", pa.float64()), ("total_frames", pa.int64())])
CARRIED_TYPES = {"string": pa.string(), "json": pa.string(), "int64": pa.int64(), "float64": pa.float64(),
                 "bool": pa.bool_()}


@dataclass(frozen=True)
class ParquetLayout:
    """What a run's Parquet files hold: vectors of ``dim`` floats, ``levels`` DeepStack levels, the tower's merge
    size (tokens = grid product / merge**2), the run's dtype (``"float32"``, ``"bfloat16"``, ``"float16"``), and
    which tensor columns are there (``tokens``: embedding and DeepStack levels; ``pooled``: the mean vector), and
    the columns carried from a table of inputs, (name, type) pairs of ``CARRIED_TYPES``."""

    dim: int
    levels: int
    merge_size: int
    dtype: str
    tokens: bool = True
    pooled: bool = False
    columns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple((str(n), str(t)) for n, t in self.columns))  # JSON gives lists

    @classmethod
    def for_encoder(cls, encoder: Any, *, tokens: bool = True, pooled: bool = False,
                    columns: dict[str, str] | None = None) -> ParquetLayout:
        """The layout of what ``encoder`` (a ``VisionEncoder``) produces, with ``columns`` carried."""
        config = encoder.config
        return cls(dim=config.out_hidden_size, levels=len(config.deepstack_visual_indexes),
                   merge_size=config.spatial_merge_size, dtype=dtype_name(encoder.dtype),
                   tokens=tokens, pooled=pooled, columns=tuple((columns or {}).items()))

    @property
    def level_columns(self) -> list[str]:
        return [f"deepstack_{i}" for i in range(self.levels)] if self.tokens else []

    def schema(self, run: dict | None = None) -> pa.Schema:
        """The Arrow schema of this layout; with ``run``, carrying the layout and the run in its metadata."""
        tokens_type = pa.list_(pa.list_(pa.float32(), self.dim))
        fields = [("path", pa.string()), ("realpath", pa.string()), ("status", pa.string()), ("error", pa.string()),
                  ("grid_thw", pa.list_(pa.int64(), 3)), ("tokens", pa.int64())]
        if self.tokens:
            fields.append(("embedding", tokens_type))
        if self.pooled:
            fields.append(("pooled", pa.list_(pa.float32(), self.dim)))
        fields += [(name, tokens_type) for name in self.level_columns]
        fields.append(("video", VIDEO_TYPE))
        fields += [(name, CARRIED_TYPES[kind]) for name, kind in self.columns]
        schema = pa.schema(fields)
        if run is None:
            return schema
        meta = {"format": PARQUET_FORMAT, "layout": dataclasses.asdict(self), "run": run}
        return schema.with_metadata({METADATA_KEY: json.dumps(meta).encode()})


def text(value: str | None) -> str | None:
    """``value`` as Parquet can store it: characters UTF-8 cannot encode (surrogates, a non-UTF-8 file name's
    undecodable bytes) as their backslash escapes (``\\udce9``); any other text unchanged."""
    return None if value is None else value.encode("utf-8", "backslashreplace").decode("utf-8")


def needs_escape(value: str) -> bool:
    """Whether ``value`` holds a character UTF-8 cannot encode (``text`` then stores an escaped spelling)."""
    return text(value) != value


def _float_column(tensors: list[torch.Tensor | None], dim: int, what: str, per_row_vectors: bool) -> pa.Array:
    """(tokens_i, dim) tensors as ``list<fixed_size_list<float32, dim>>``, or (``per_row_vectors`` false) (dim,)
    tensors as ``fixed_size_list<float32, dim>``; None: a null row."""
    rows = [np.zeros((0, dim), np.float32)]  # so that a batch of no rows concatenates too
    for i, t in enumerate(tensors):
        if t is not None and tuple(t.shape[1:] if per_row_vectors else t.shape) != (dim,):
            raise ValueError(f"row {i}: {what} has shape {tuple(t.shape)}, expected "
                             f"{f'(tokens, {dim})' if per_row_vectors else f'({dim},)'}")
        # A null row holds no vector in a list column, a zeroed slot in a vector column. bf16 / fp16 -> fp32 is
        # exact; numpy has no bf16, so the conversion happens in torch.
        rows.append(np.zeros((0 if per_row_vectors else 1, dim), np.float32) if t is None else
                    t.detach().to("cpu", torch.float32).contiguous().numpy().reshape(-1, dim))
    mask = pa.array([t is None for t in tensors], pa.bool_())
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(rows).reshape(-1), pa.float32()), dim,
                                                mask=None if per_row_vectors else mask)
    if not per_row_vectors:
        return vectors
    offsets = np.zeros(len(tensors) + 1, np.int32)
    np.cumsum([len(r) for r in rows[1:]], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), vectors, mask=mask)


def result_columns(records: Sequence[EmbeddingRecord], layout: ParquetLayout) -> dict[str, pa.Array]:
    """The records' result columns in ``layout`` (``status`` .. ``video``, everything but the input's identity),
    the one conversion of records to Arrow: the Parquet writer and Ray's Embedder both build their rows here. A
    vector of another width than the layout's is a ValueError naming the row."""
    ok = [r if r.ok else None for r in records]
    grids = np.array([r.grid_thw if r else (0, 0, 0) for r in ok], np.int64).reshape(-1)
    columns: dict[str, pa.Array] = {
        "status": pa.array([r.status for r in records], pa.string()),
        "error": pa.array([text(redacted_text(r.error)) for r in records], pa.string()),
        "grid_thw": pa.FixedSizeListArray.from_arrays(pa.array(grids, pa.int64()), 3,
                                                      mask=pa.array([r is None for r in ok], pa.bool_())),
        "tokens": pa.array([r.tokens if r else None for r in ok], pa.int64()),
    }
    if layout.tokens:
        columns["embedding"] = _float_column([r.embedding if r else None for r in ok], layout.dim, "embedding", True)
    if layout.pooled:
        columns["pooled"] = _float_column([r.pooled if r else None for r in ok], layout.dim, "pooled", False)
    for level, name in enumerate(layout.level_columns):
        columns[name] = _float_column([r.deepstack[level] if r else None for r in ok], layout.dim, name, True)
    columns["video"] = pa.array([r.video for r in records], VIDEO_TYPE)
    for name, kind in layout.columns:
        values = [(r.columns or {}).get(name) for r in records]
        try:
            columns[name] = pa.array([text(v) if isinstance(v, str) else v for v in values], CARRIED_TYPES[kind])
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise ValueError(f"carried column {name!r} ({kind}): {e}") from None
    return columns


def results_table(records: Iterable[EmbeddingRecord], layout: ParquetLayout, run: dict) -> pa.Table:
    """The records as one Arrow table in ``layout`` (their identity, then ``result_columns``), the run record in
    its metadata."""
    records = list(records)
    columns = {"path": pa.array([text(redacted_text(r.path)) for r in records], pa.string()),
               "realpath": pa.array([text(redacted_text(r.realpath)) for r in records], pa.string()),
               **result_columns(records, layout)}
    schema = layout.schema(run)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def write_table_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` whole or not at all (``durable.replace_atomically``). Every page carries its CRC
    (Parquet's page checksum), which the readers here verify: a flipped bit in a tensor is a damaged file, not another
    value."""
    path = Path(path)
    replace_atomically(path, path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp"),
                       lambda f: pq.write_table(table, f, write_page_checksum=True))
    return path


def shard_name(rank: int, number: int) -> str:
    """A shard's file name, as embed names its safetensors shards: ``shard-r{rank}-{number:06d}.parquet``."""
    return f"shard-r{rank}-{number:06d}.parquet"

