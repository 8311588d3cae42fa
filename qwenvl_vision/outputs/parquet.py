"""The Parquet layout of embedding results: its schema, a table built from results, shards written atomically, and
a strict reader (``read_parquet_records``).

One row per input:

- ``path`` (as given), ``realpath`` (the resolved file: the input's identity, as in embed's manifest),
  ``status`` ("ok" / "error"), ``error`` (the one-line reason, null when ok);
- ``grid_thw`` ``fixed_size_list<int64, 3>`` and ``tokens`` (``t*h*w / merge**2``) for ok rows;
- ``embedding`` ``list<fixed_size_list<float32, D>>`` (tokens x D), when the run stores tokens;
- ``pooled`` ``fixed_size_list<float32, D>`` (the mean over the tokens), when it stores pooled vectors: a
  fixed-size float list is the vector column DuckDB (``array_cosine_similarity``) and LanceDB search directly;
- ``deepstack_0`` .. ``deepstack_{L-1}`` like ``embedding`` (Qwen3-VL's DeepStack levels), with the tokens;
- ``video``: a struct of the frames used, their times, the file's and the sampled fps and its frame count, as
  embed's manifest records them; null for images;
- the columns carried from a table of inputs (``embed --keep-columns``), each of its type (``string``, ``int64``,
  ``float64``, ``bool``; ``json`` as a string of JSON), null for an input no table row named.

Text columns are UTF-8, as Parquet's strings must be. A file name that is not valid UTF-8 (Python holds its
undecodable bytes as surrogates, ``b'caf\\xe9.jpg'`` -> ``'caf\\udce9.jpg'``) cannot be stored as it is: ``text``
writes every character UTF-8 cannot encode as its backslash escape (``caf\\udce9.jpg``, as ``json`` and ``repr``
spell it). That spelling is not a file name (a literal one could be the same text), so embed records such an input
as an error row (``needs_escape``), never as an ok row that a resume would skip by it.

Tensors of an error row are null. Arrow has no bfloat16: a bf16 (or fp16) run stores float32, which holds every
such value exactly, and the file records the run's dtype so that the reader gives back the very tensors the encoder
returned. The file's schema metadata (key ``qwenvl_vision``) holds the layout (D, L, merge size, dtype, which
tensor columns) and the run record the caller gives (a JSON dict, e.g. embed's run.json).

Durability: ``write_table_atomic`` writes a temporary file in the target's folder, fsyncs it, renames it into place
and fsyncs the folder: a reader sees a whole shard or none. Temporary files end in ``.tmp`` and are never read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..devices import DTYPES, dtype_name
from ..errors import ManifestError
from ..inputs.pixels import is_url
from ..inputs.urls import redacted_text
from .durable import replace_atomically
from .records import EmbeddingRecord

PARQUET_FORMAT = 1
METADATA_KEY = b"qwenvl_vision"
SHARD_SUFFIX = ".parquet"
STATUSES = ("ok", "error")
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
        if any(t not in CARRIED_TYPES for _, t in self.columns):
            raise ValueError(f"carried column types must be among {sorted(CARRIED_TYPES)}, got {self.columns}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        counts = (self.dim, self.levels, self.merge_size)
        if any(type(n) is not int for n in counts) or any(type(b) is not bool for b in (self.tokens, self.pooled)):
            raise ValueError(f"not a layout (dim, levels and merge_size are integers, tokens and pooled true or "
                             f"false): {self}")
        if self.dim < 1 or self.levels < 0 or self.merge_size < 1 or not (self.tokens or self.pooled):
            raise ValueError(f"not a layout: {self}")

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
    if value is None or not needs_escape(value):
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def needs_escape(value: str) -> bool:
    """Whether ``value`` holds a character UTF-8 cannot encode (``text`` then stores an escaped spelling)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------------- writing


def _as_float32(tensor: torch.Tensor) -> np.ndarray:
    # bf16 / fp16 -> fp32 is exact; numpy has no bf16, so the conversion happens in torch.
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def _token_column(tensors: list[torch.Tensor | None], dim: int, what: str) -> pa.Array:
    """(tokens_i, dim) tensors (None: a null row) as ``list<fixed_size_list<float32, dim>>``."""
    lengths = []
    for i, t in enumerate(tensors):
        if t is not None and (t.ndim != 2 or t.shape[1] != dim):
            raise ValueError(f"row {i}: {what} has shape {tuple(t.shape)}, expected (tokens, {dim})")
        lengths.append(0 if t is None else t.shape[0])
    offsets = np.zeros(len(tensors) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [_as_float32(t).reshape(-1) for t in tensors if t is not None]
    flat = np.concatenate(present) if present else np.zeros(0, np.float32)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dim)
    mask = pa.array([t is None for t in tensors], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), vectors, mask=mask)


def _vector_column(vectors: list[torch.Tensor | None], dim: int) -> pa.Array:
    """(dim,) tensors (None: a null row) as ``fixed_size_list<float32, dim>``."""
    values = np.zeros((len(vectors), dim), np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            if tuple(v.shape) != (dim,):
                raise ValueError(f"row {i}: pooled has shape {tuple(v.shape)}, expected ({dim},)")
            values[i] = _as_float32(v)
    mask = pa.array([v is None for v in vectors], pa.bool_())
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), dim, mask=mask)


def result_columns(records: Sequence[EmbeddingRecord], layout: ParquetLayout) -> dict[str, pa.Array]:
    """The records' result columns in ``layout`` (``status`` .. ``video``, everything but the input's identity),
    the one conversion of records to Arrow: the Parquet writer and Ray's Embedder both build their rows here. A
    record that does not fit the layout (a vector of another width, a missing tensor, a level count that differs)
    is a ValueError: the writer's mistake, caught before anything is written."""
    for i, r in enumerate(records):
        if r.status not in STATUSES or (r.status == "error") != (r.error is not None):
            raise ValueError(f"row {i} ({r.path}): status {r.status!r} with error {r.error!r}")
        if not r.ok:
            continue
        needed = {"grid_thw": r.grid_thw, "tokens": r.tokens}
        if layout.tokens:
            needed["embedding"] = r.embedding
        if layout.pooled:
            needed["pooled"] = r.pooled
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            raise ValueError(f"row {i} ({r.path}): an ok record without {missing}")
        if layout.tokens and (len(r.deepstack) != layout.levels or
                              any(t.shape[0] != r.tokens for t in [r.embedding, *r.deepstack])):
            raise ValueError(f"row {i} ({r.path}): {len(r.deepstack)} DeepStack levels (the layout has "
                             f"{layout.levels}) or tensors of other than its {r.tokens} tokens")
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
        columns["embedding"] = _token_column([r.embedding if r else None for r in ok], layout.dim, "embedding")
    if layout.pooled:
        columns["pooled"] = _vector_column([r.pooled if r else None for r in ok], layout.dim)
    for level, name in enumerate(layout.level_columns):
        columns[name] = _token_column([r.deepstack[level] if r else None for r in ok], layout.dim, name)
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


def write_table_atomic(table: pa.Table, path: str | os.PathLike, **write_options: Any) -> Path:
    """Write ``table`` to ``path`` whole or not at all: a temporary file in the same folder (a rename across file
    systems would not be atomic), fsynced, renamed into place, then the folder fsynced. An OSError (a full disk,
    a read-only folder) leaves no temporary file behind. ``write_options`` go to ``pyarrow.parquet.write_table``;
    every page carries its CRC (Parquet's page checksum), which the readers here verify: a flipped bit in a tensor
    is a damaged file, not another value."""
    path = Path(path)
    write_options.setdefault("write_page_checksum", True)
    replace_atomically(path, path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp"),
                       lambda f: pq.write_table(table, f, **write_options))
    return path


def shard_name(rank: int, number: int) -> str:
    """A shard's file name, as embed names its safetensors shards: ``shard-r{rank}-{number:06d}.parquet``."""
    return f"shard-r{rank}-{number:06d}{SHARD_SUFFIX}"


# ---------------------------------------------------------------------- reading


def read_metadata(schema: pa.Schema, where: str) -> tuple[ParquetLayout, dict]:
    """The layout and the run record a file's schema carries; ManifestError naming ``where`` when absent or bad."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ManifestError(f"{where}: no {METADATA_KEY.decode()} metadata (not written by qwenvl-vision)")
    try:
        meta = json.loads(raw)
        if meta.get("format") != PARQUET_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, this version reads {PARQUET_FORMAT}")
        if not isinstance(meta.get("run"), dict):
            raise ValueError("no run record")
        layout = ParquetLayout(**meta["layout"])
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ManifestError(f"{where}: damaged {METADATA_KEY.decode()} metadata ({e})") from None
    return layout, meta["run"]


def _rows_problem(table: pa.Table, layout: ParquetLayout) -> tuple[int, str] | None:
    """The first row that breaks the layout's rules, and why (None: every row is sound)."""
    status = table.column("status").to_pylist()
    error = table.column("error").to_pylist()
    grids = table.column("grid_thw").to_pylist()
    tokens = table.column("tokens").to_pylist()
    tensor_names = (["embedding"] if layout.tokens else []) + (["pooled"] if layout.pooled else []) \
        + layout.level_columns
    tensors = {name: table.column(name).combine_chunks() for name in tensor_names}
    lengths = {name: (None if name == "pooled" else col.value_lengths().fill_null(0).to_numpy())
               for name, col in tensors.items()}
    valid = {name: col.is_valid().to_numpy(zero_copy_only=False) for name, col in tensors.items()}
    paths, realpaths = table.column("path").to_pylist(), table.column("realpath").to_pylist()
    merge_unit = layout.merge_size ** 2
    for row in range(table.num_rows):
        if not paths[row] or not realpaths[row]:
            return row, "no path or realpath"
        if status[row] not in STATUSES:
            return row, f"status {status[row]!r} (expected one of {list(STATUSES)})"
        present = [name for name in tensor_names if valid[name][row]]
        if status[row] == "error":
            if not error[row]:
                return row, "status error without an error message"
            if present or grids[row] is not None or tokens[row] is not None:
                return row, f"an error row holding tensors ({present or 'grid_thw/tokens'})"
            continue
        if error[row] is not None:
            return row, f"status ok with an error ({error[row]!r})"
        grid = grids[row]
        if grid is None or any(x is None or x < 1 for x in grid):
            return row, f"grid_thw {grid} (expected three positive numbers)"
        count, rest = divmod(math.prod(grid), merge_unit)
        if rest or count != tokens[row]:
            return row, f"tokens {tokens[row]} but grid_thw {grid} gives {math.prod(grid)}/{merge_unit} merged tokens"
        for name in tensor_names:
            if not valid[name][row]:
                return row, f"status ok without {name}"
            if lengths[name] is not None and lengths[name][row] != count:
                return row, f"{name} has {lengths[name][row]} vectors of {layout.dim}, grid_thw {grid} gives {count}"
    return None


def _vectors_of(column: pa.Array, per_row_vectors: bool) -> tuple[pa.Array, np.ndarray]:
    """A tensor column's vectors (a fixed_size_list array, null rows' slots included) and each row's first and
    last-plus-one vector (offsets, n + 1 of them)."""
    if per_row_vectors:  # list<fixed_size_list>: the list offsets index the vectors
        return column.values, column.offsets.to_numpy()
    # fixed_size_list<float32, D>: each row is one vector, its floats re-wrapped as vectors without the row nulls
    size = column.type.list_size
    vectors = pa.FixedSizeListArray.from_arrays(column.values.slice(column.offset * size, len(column) * size), size)
    return vectors, np.arange(len(column) + 1)


def _floats_of(vectors: pa.Array) -> pa.Array:
    """The float values of a fixed_size_list array, in order (null vectors' slots included)."""
    size = vectors.type.list_size
    return vectors.values.slice(vectors.offset * size, len(vectors) * size)


def _damaged_row(column: pa.Array, per_row_vectors: bool, dtype: torch.dtype | None) -> tuple[int, str] | None:
    """(row, what) of the first valid row of a tensor column holding a null vector or float, or, with ``dtype``
    (bf16 or fp16), a float that dtype cannot hold: such a run stores its values widened to float32, exactly, so any
    other value is damage (rounding it back would hide it). None: every value is sound."""
    vectors, offsets = _vectors_of(column, per_row_vectors)
    floats = _floats_of(vectors)
    size = vectors.type.list_size
    if vectors.null_count or floats.null_count:
        bad = np.union1d(np.flatnonzero(~vectors.is_valid().to_numpy(zero_copy_only=False)),
                         np.flatnonzero(~floats.is_valid().to_numpy(zero_copy_only=False)) // size)
        row = _first_valid_row(column, offsets, bad)
        if row is not None:
            return row, "holds a null value"
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    values = np.asarray(floats.to_numpy(zero_copy_only=False), dtype=np.float32)
    if dtype == torch.bfloat16:  # exact in bf16: the low 16 bits of the float32 are zero
        inexact = (values.view(np.uint32) & 0xFFFF) != 0
    else:
        with np.errstate(over="ignore"):  # a value past fp16's range is inexact, not an error
            inexact = values.astype(np.float16).astype(np.float32) != values
    row = _first_valid_row(column, offsets, np.unique(np.flatnonzero(inexact & ~np.isnan(values)) // size))
    return None if row is None else (row, f"holds a value a {dtype_name(dtype)} run cannot have stored")


def _first_valid_row(column: pa.Array, offsets: np.ndarray, vector_indices: np.ndarray) -> int | None:
    """The first valid row of ``column`` holding one of the vectors at ``vector_indices`` (rows' vectors start at
    ``offsets``)."""
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    rows = np.searchsorted(offsets, vector_indices, side="right") - 1
    inside = [int(r) for r, v in zip(rows, vector_indices) if 0 <= r < len(column) and valid[r] and v < offsets[r + 1]]
    return min(inside) if inside else None


def read_parquet_table(path: str | os.PathLike) -> tuple[pa.Table, ParquetLayout, dict]:
    """One Parquet file of embeddings, validated strictly: its metadata (layout, run), its schema (exactly the
    layout's), every row (status and error agree, grid product / merge**2 = tokens = every tensor column's
    length, no null value inside a tensor). Any fault is one ManifestError naming the file (and the row)."""
    path = Path(path)
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise ManifestError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    layout, run = read_metadata(table.schema, str(path))
    expected = layout.schema()
    if not table.schema.remove_metadata().equals(expected):
        differ = [f"{f.name}: {f.type}" for f in table.schema if f.name not in expected.names
                  or expected.field(f.name).type != f.type]
        missing = [name for name in expected.names if name not in table.schema.names]
        why = [f"columns of another name or type: {differ}"] if differ else []
        why += [f"missing {missing}"] if missing else []
        why = "; ".join(why) or "columns out of order"
        raise ManifestError(f"{path}: schema is not the layout's ({why})")
    problem = _rows_problem(table, layout)
    if problem is not None:
        raise ManifestError(f"{path}, row {problem[0]}: {problem[1]}")
    for name in (["embedding"] if layout.tokens else []) + layout.level_columns + (["pooled"] if layout.pooled else []):
        # The tokens are the run's dtype widened; the pooled mean is computed and kept in float32.
        damaged = _damaged_row(table.column(name).combine_chunks(), name != "pooled",
                               None if name == "pooled" else DTYPES[layout.dtype])
        if damaged is not None:
            raise ManifestError(f"{path}, row {damaged[0]}: {name} {damaged[1]}")
    return table, layout, run


def read_parquet_grids(path: str | os.PathLike) -> list[tuple[str, list[int], dict | None, int]]:
    """(path, grid_thw, video entry or None for an image, tokens) of one shard's ok rows, from its footer and the
    path, status, grid, video and tokens columns only (what a hand-off needs before it reads any tensor). Any fault
    is one ManifestError naming the file."""
    path = Path(path)
    try:
        schema = pq.read_schema(path)
        read_metadata(schema, str(path))
        table = pq.read_table(path, columns=["path", "status", "grid_thw", "video", "tokens"],
                              page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise ManifestError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    rows = zip(*(table.column(name).to_pylist() for name in ("path", "status", "grid_thw", "video", "tokens")),
               strict=True)
    found = []
    for row, (name, status, grid, video, tokens) in enumerate(rows):
        if status != "ok":
            continue
        if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and g > 0 for g in grid)):
            raise ManifestError(f"{path}, row {row}: status ok with grid_thw {grid!r}, not three positive integers")
        if not (isinstance(tokens, int) and tokens > 0):
            raise ManifestError(f"{path}, row {row}: status ok with tokens {tokens!r}, not a positive integer")
        found.append((name, grid, video, tokens))
    return found


def read_parquet_index(path: str | os.PathLike) -> tuple[list[str], list[str], ParquetLayout, dict]:
    """(realpaths, statuses, layout, run) of one shard, reading only its footer and those two columns (a resume's
    question: which inputs are done), checked as far as they go: metadata and schema as ``read_parquet_table``
    checks them, every row a realpath and a known status. The tensors are not read (``read_parquet_table`` reads
    and checks everything). Any fault is one ManifestError naming the file."""
    path = Path(path)
    try:
        schema = pq.read_schema(path)
        layout, run = read_metadata(schema, str(path))
        if not schema.remove_metadata().equals(layout.schema()):
            raise ManifestError(f"{path}: schema is not the layout's (read it with read_parquet_table for why)")
        table = pq.read_table(path, columns=["realpath", "status"], page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise ManifestError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    realpaths, status = table.column("realpath").to_pylist(), table.column("status").to_pylist()
    for row, (realpath, state) in enumerate(zip(realpaths, status)):
        if not realpath or state not in STATUSES:
            raise ManifestError(f"{path}, row {row}: realpath {realpath!r} with status {state!r}")
    return realpaths, status, layout, run


def same_run(a: dict, b: dict) -> bool:
    """Whether two shards' run records are one run's: equal, but for the CPU plan a run started off the CPU records
    at its first resume on a CPU (null in the shards written before)."""
    plans = a.get("cpu_plan"), b.get("cpu_plan")
    return ({**a, "cpu_plan": None} == {**b, "cpu_plan": None}
            and (plans[0] == plans[1] or None in plans))


def _tensors(column: pa.Array, dim: int, dtype: torch.dtype, per_row_vectors: bool) -> list[torch.Tensor | None]:
    """A tensor column's rows as tensors of the run's dtype (float32 -> bf16/fp16 is exact: the values came from
    there); each row owns its memory, so a record kept does not pin the whole table."""
    vectors, offsets = _vectors_of(column, per_row_vectors)
    values = _floats_of(vectors).to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out: list[torch.Tensor | None] = []
    for row, ok in enumerate(valid):
        if not ok:
            out.append(None)
            continue
        rows = torch.from_numpy(values[offsets[row] * dim: offsets[row + 1] * dim].copy())
        out.append((rows.view(-1, dim) if per_row_vectors else rows).to(dtype))
    return out


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
    """A table's rows as records, tensors in ``dtype`` (the run's): a Parquet shard validated by
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
    has_realpath = "realpath" in names
    plain = table.select([path_column, "status", "error", "grid_thw", "tokens", "video",
                          *(n for n in ("realpath", "pixels_sha256") if n in names)]).to_pylist()
    values = table.select(list(carried)).to_pylist() if carried else None
    records = []
    for row, r in enumerate(plain):
        grid = tuple(r["grid_thw"]) if r["grid_thw"] is not None else None
        path = r[path_column]
        records.append(EmbeddingRecord(
            path, r["realpath"] if has_realpath and r["realpath"] is not None else
            path if is_url(path) else os.path.realpath(path),
            r["status"], r["error"], grid,
            r["tokens"], embeddings[row], [level[row] for level in deepstack] if r["status"] == "ok" else [],
            pooled[row], r["video"], r.get("pixels_sha256"), None if values is None else values[row]))
    return records


def parquet_files(folder: str | os.PathLike) -> list[Path]:
    """The shards of a folder, by name (temporary files of a write in progress are not shards)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ManifestError(f"{folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.name.endswith(SHARD_SUFFIX) and not p.name.startswith(".")
                   and p.is_file())
    if not files:
        raise ManifestError(f"{folder}: holds no {SHARD_SUFFIX} files")
    return files


def read_parquet_run(folder: str | os.PathLike) -> dict:
    """The run record the folder's shards carry (their metadata, no rows read): the first shard's, with the CPU plan
    of the first that records one (a run started off the CPU records it at its first resume on one)."""
    run = None
    for path in parquet_files(folder):
        try:
            schema = pq.read_schema(path)
        except (OSError, pa.ArrowException) as e:
            raise ManifestError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        found = read_metadata(schema, str(path))[1]
        run = run or found
        if found.get("cpu_plan") is not None:
            return {**run, "cpu_plan": found["cpu_plan"]}
    return run


def read_parquet_records(folder: str | os.PathLike, *, files: Sequence[str | os.PathLike] | None = None
                         ) -> Iterator[EmbeddingRecord]:
    """Every record of a folder of shards (or of ``files``), shard by shard in name order, rows in order; tensors
    in the run's dtype, bitwise the encoder's. Each shard is validated whole before its first record (see
    ``read_parquet_table``), and every shard must carry the first one's layout and run (``same_run``): a folder
    mixing runs is refused like a damaged file, naming the shard."""
    paths = [Path(f) for f in files] if files is not None else parquet_files(folder)
    first: tuple[ParquetLayout, dict, Path] | None = None
    for path in paths:
        table, layout, run = read_parquet_table(path)
        if first is None:
            first = (layout, run, path)
        elif layout != first[0] or not same_run(run, first[1]):
            what = "layout" if layout != first[0] else "run record"
            raise ManifestError(f"{path}: its {what} differs from {first[2].name}'s (shards of another run)")
        elif first[1].get("cpu_plan") is None and run.get("cpu_plan") is not None:
            first = (layout, run, path)  # the plan the run recorded: every later shard's must be the same
        yield from records_of_table(table, layout.dtype, carried=[name for name, _ in layout.columns])
