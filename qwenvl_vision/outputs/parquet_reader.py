"""Reading back ``parquet``'s layout: one shard whole (``read_parquet_table``: its pages' checksums and its metadata
checked), or only what a question needs (``read_parquet_index``: which inputs are done; ``read_parquet_grids``: the
grids a hand-off needs), and the records of shards (``read_parquet_records``), tensors bitwise the encoder's. Any
fault is one ManifestError naming the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..devices import DTYPES
from ..errors import ManifestError, first_line
from ..inputs.pixels import is_url
from .parquet import METADATA_KEY, PARQUET_FORMAT, ParquetLayout
from .records import EmbeddingRecord


def _read(path: Path, read: Callable[..., Any], **options: Any) -> Any:
    """``read(path, **options)`` (``pq.read_table`` or ``pq.read_schema``); a fault is one ManifestError naming it."""
    try:
        return read(path, **options)
    except (OSError, pa.ArrowException) as e:
        raise ManifestError(f"{path}: not a readable Parquet file ({first_line(e)})") from None  # one line of several


def read_metadata(schema: pa.Schema, where: str) -> tuple[ParquetLayout, dict]:
    """The layout and the run record a file's schema carries; ManifestError naming ``where`` when absent or bad."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ManifestError(f"{where}: no {METADATA_KEY.decode()} metadata (not written by qwenvl-vision)")
    try:
        meta = json.loads(raw)
        if meta["format"] != PARQUET_FORMAT:
            raise ValueError(f"format {meta['format']!r}, this version reads {PARQUET_FORMAT}")
        return ParquetLayout(**meta["layout"]), meta["run"]
    except (ValueError, TypeError, KeyError) as e:
        raise ManifestError(f"{where}: damaged {METADATA_KEY.decode()} metadata ({e})") from None


def read_parquet_table(path: str | os.PathLike, columns: Sequence[str] | None = None
                       ) -> tuple[pa.Table, ParquetLayout, dict]:
    """One Parquet file of embeddings, or only its ``columns`` (the tensors unread): its metadata (layout, run)
    checked first, then its pages read with their checksums verified. Any fault is one ManifestError naming the
    file."""
    path = Path(path)
    layout, run = read_metadata(_read(path, pq.read_schema), str(path))
    return _read(path, pq.read_table, columns=columns, page_checksum_verification=True), layout, run


def read_parquet_grids(path: str | os.PathLike) -> list[tuple[str, list[int], dict | None, int]]:
    """(path, grid_thw, video entry or None for an image, tokens) of one shard's ok rows, from its footer and the
    path, status, grid, video and tokens columns only (what a hand-off needs before it reads any tensor)."""
    names = ["path", "status", "grid_thw", "video", "tokens"]
    table = read_parquet_table(path, names)[0]
    rows = zip(*(table.column(name).to_pylist() for name in names), strict=True)
    return [(name, grid, video, tokens) for name, status, grid, video, tokens in rows if status == "ok"]


def read_parquet_index(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(realpaths, statuses) of one shard, reading only its footer and those two columns (a resume's question: which
    inputs are done). Any fault is one ManifestError naming the file."""
    table = read_parquet_table(path, ["realpath", "status"])[0]
    return table.column("realpath").to_pylist(), table.column("status").to_pylist()


def _tensors(column: pa.Array, dim: int, dtype: torch.dtype, per_row_vectors: bool) -> list[torch.Tensor | None]:
    """A tensor column's rows as tensors of the run's dtype (float32 -> bf16/fp16 is exact: the values came from
    there); each row owns its memory, so a record kept does not pin the whole table. ``flatten`` skips null rows."""
    floats = column.flatten().flatten() if per_row_vectors else column.flatten()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    lengths = column.value_lengths().fill_null(0).to_numpy() if per_row_vectors else valid
    rows = np.split(floats.to_numpy(zero_copy_only=False), np.cumsum(lengths * dim)[:-1])
    shape = (-1, dim) if per_row_vectors else (dim,)
    return [torch.from_numpy(row.copy()).view(shape).to(dtype) if ok else None for row, ok in zip(rows, valid)]


def layout_of_columns(schema: pa.Schema, dtype: str) -> ParquetLayout:
    """The layout whose result columns ``schema`` holds beside any other columns (Ray's ``Embedder`` rows, a
    validated shard), its merge size unknown (1); a ValueError naming the first column that does not fit: the
    tensor columns' dim from ``embedding`` (or ``pooled``), DeepStack levels ``deepstack_0`` .. in order, every
    result column of the layout's type."""
    names = set(schema.names)
    tokens, pooled = "embedding" in names, "pooled" in names
    if not (tokens or pooled):
        raise ValueError("no embedding or pooled column")
    source = "embedding" if tokens else "pooled"
    vector = schema.field(source).type
    vector = vector.value_type if tokens and pa.types.is_list(vector) else vector
    if not pa.types.is_fixed_size_list(vector):
        raise ValueError(f"column {source!r} is {schema.field(source).type}, not of fixed-size float32 vectors")
    levels = sum(bool(re.fullmatch(r"deepstack_\d+", name)) for name in names) if tokens else 0
    layout = ParquetLayout(dim=vector.list_size, levels=levels, merge_size=1, dtype=dtype, tokens=tokens,
                           pooled=pooled)
    for field in layout.schema():
        if field.name in ("path", "realpath"):  # the input's identity: Ray's rows carry it in a column of their own
            continue
        if field.name not in names:
            raise ValueError(f"no column {field.name!r}" + (" (DeepStack levels are deepstack_0, deepstack_1, ..)"
                                                            if field.name.startswith("deepstack_") else ""))
        if schema.field(field.name).type != field.type:
            raise ValueError(f"column {field.name!r} is {schema.field(field.name).type}, not {field.type}")
    return layout


def records_of_table(table: pa.Table, dtype: str, *, path_column: str = "path", carried: Sequence[str] = ()
                     ) -> list[EmbeddingRecord]:
    """A table's rows as records, tensors in ``dtype`` (the run's): a Parquet shard read by
    ``read_parquet_table``, or Ray's ``Embedder`` rows (``result_columns`` beside the input's columns: the path in
    ``path_column``; without a ``realpath`` column the path is resolved here). The tensor columns are those of
    ``layout_of_columns`` (whose ValueError names a column that does not fit); ``carried``: the table columns
    each record carries (a shard's ``layout.columns``)."""
    torch_dtype = DTYPES[dtype]
    layout = layout_of_columns(table.schema, dtype)
    names = set(table.column_names)

    def tensors(name: str, per_row_vectors: bool) -> list[torch.Tensor | None]:
        if name not in names:
            return [None] * table.num_rows
        return _tensors(table.column(name).combine_chunks(), layout.dim, torch_dtype, per_row_vectors)

    embeddings, pooled = tensors("embedding", True), tensors("pooled", False)
    deepstack = [tensors(name, True) for name in layout.level_columns]
    plain = table.select([path_column, "status", "error", "grid_thw", "tokens", "video",
                          *(n for n in ("realpath", "pixels_sha256") if n in names)]).to_pylist()
    values = table.select(list(carried)).to_pylist() if carried else None
    records = []
    for row, r in enumerate(plain):
        path, grid = r[path_column], r["grid_thw"]
        records.append(EmbeddingRecord(
            path, r.get("realpath") or (path if is_url(path) else os.path.realpath(path)), r["status"], r["error"],
            None if grid is None else tuple(grid), r["tokens"], embeddings[row],
            [level[row] for level in deepstack] if r["status"] == "ok" else [], pooled[row], r["video"],
            r.get("pixels_sha256"), None if values is None else values[row]))
    return records


def read_parquet_records(files: Sequence[str | os.PathLike]) -> Iterator[EmbeddingRecord]:
    """Every record of the shards ``files``, in order, rows in order; tensors in the run's dtype, bitwise the
    encoder's. Each shard is validated whole before its first record (see ``read_parquet_table``)."""
    for path in files:
        table, layout, _ = read_parquet_table(path)
        try:
            records = records_of_table(table, layout.dtype, carried=[name for name, _ in layout.columns])
        except ValueError as e:  # columns that are not its layout's
            raise ManifestError(f"{path}: {e}") from None
        yield from records
