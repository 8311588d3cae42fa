"""Tables of inputs (docs/embed.md, "Tables"): a Parquet, CSV, TSV or JSON Lines file whose rows name the files to
embed (``--path-column``), with columns to carry into the outputs (``--keep-columns``), as img2dataset's ``url_col``
and ``save_additional_columns`` and clip-retrieval's metadata do.

A JSON Lines line that is not a JSON object is one failed input naming the table and the line. A column the table
lacks is a ``ConfigError`` naming the table and the columns it has, and so is a Parquet path column that is not text.
A carried column's type is each table's (``read_table``): a Parquet column's own (integers as ``int64``, floating
point as ``float64``, ``bool``, text as ``string``, a dictionary-encoded column as its values; anything else as its
JSON text, ``json``), every CSV / TSV cell ``string``, a JSON Lines field the one of ``int64``, ``float64``, ``bool``
or ``string`` all its values share, else ``json``; a column of nulls alone is ``null``. A run's tables, a dataset's
parts, are then typed together (``joined``) and their cells stored so (``cell``).
"""

from __future__ import annotations

import base64
import csv
import functools
import io
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..inputs.pixels import is_url, local_name

TABLE_EXTENSIONS = {".parquet", ".csv", ".tsv", ".jsonl"}
# The names the outputs use for themselves: a carried column may not take one.
RESERVED = {"path", "realpath", "status", "error", "grid_thw", "tokens", "embedding", "pooled", "video", "rank",
            "shard", "key", "id", "modality", "levels", "timestamps", "second_per_grid_t", "columns", "pixels_sha256"}
RESERVED_PATTERN = re.compile(r"deepstack_\d+")  # the DeepStack levels' columns
INT64 = range(-(1 << 63), 1 << 63)


@dataclass
class Row:
    """One row: its 1-based number, the path it names (None when it names none) and its carried values."""

    number: int
    path: str | None
    columns: dict[str, Any]
    error: str | None = None


def is_table(path: str) -> bool:
    return Path(path).suffix.lower() in TABLE_EXTENSIONS


def check_keep_columns(keep: Sequence[str], path_column: str) -> None:
    """The carried columns' names: no output field's name, not the path column, none twice."""
    taken = sorted(name for name in keep if name in RESERVED or RESERVED_PATTERN.fullmatch(name))
    if taken:
        raise ConfigError(f"--keep-columns {','.join(taken)}: the outputs use that name for their own field; rename "
                          f"the column in the table")
    if path_column in keep:
        raise ConfigError(f"--keep-columns {path_column}: that is the path column, recorded as each input's path")
    if len(set(keep)) != len(keep):
        raise ConfigError(f"--keep-columns {','.join(keep)} names a column twice")


def read_table(path: Path, path_column: str, keep: Sequence[str]) -> tuple[list[Row], dict[str, str]]:
    """(the rows, each with its carried values as read; each carried column's type) of the table at ``path``."""
    suffix = path.suffix.lower()
    if path.is_dir():  # Spark's and Dask's output: the dataset's parts are its files
        raise ConfigError(f"table {path} is a folder: give its part files ({path}/*{suffix})")
    if suffix == ".parquet":
        rows, types = _parquet_rows(path, path_column, keep)
    elif suffix == ".jsonl":
        rows, types = _jsonl_rows(path, path_column, keep)
    else:
        rows, types = _csv_rows(path, path_column, keep, "\t" if suffix == ".tsv" else ",")
    for row in rows:
        if row.error is None:
            row.path, row.error = _checked_path(path, row.number, path_column, row.path)
    return rows, types


def _missing(path: Path, wanted: Sequence[str], have: Sequence[str]) -> None:
    missing = [c for c in wanted if c not in have]
    if missing:
        raise ConfigError(f"table {path} has no column {', '.join(map(repr, missing))}; its columns: "
                          f"{', '.join(map(str, have)) or 'none'} (choose with --path-column / --keep-columns)")
    twice = [c for c in wanted if list(have).count(c) > 1]  # a CSV header's: which one is meant, no reader knows
    if twice:
        raise ConfigError(f"table {path} has more than one column {', '.join(map(repr, twice))}; rename all but one")


def _checked_path(table: Path, number: int, column: str, value: Any) -> tuple[str | None, str | None]:
    """(the path a cell names, resolved from the table's folder; or None and why it names none)."""
    where = f"table {table}, row {number}"
    if not isinstance(value, str) or not value.strip():
        return None, f"{where}: column {column!r} is {json.dumps(value)[:80]}, not a path"
    try:
        named = b"\0" not in os.fsencode(value)
    except UnicodeEncodeError:  # a JSON escape's surrogate ("\ud800") that no file name's bytes decode to
        named = False
    if not named:
        return None, f"{where}: column {column!r} is {json.dumps(value)[:80]}, not a path (a NUL or a surrogate)"
    value = local_name(value.strip())
    if is_url(value):
        return value, None  # read from its store (remote.py)
    return str(table.parent / value), None  # an absolute path stays as it is


def _parquet_rows(path: Path, path_column: str, keep: Sequence[str]) -> tuple[list[Row], dict[str, str]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"table {path}: reading Parquet needs pyarrow: pip install 'qwenvl-vision[parquet]'") \
            from None
    try:
        schema = pq.read_schema(path)
        _missing(path, [path_column, *keep], schema.names)
        table = pq.read_table(path, columns=[path_column, *keep])
        path_type = table.schema.field(path_column).type
        if _arrow_type(path_type) != "string":  # bytes or timestamps name no file: one line, not a TypeError per row
            raise ConfigError(f"table {path}: column {path_column!r} holds {path_type}, not text paths (choose "
                              f"another with --path-column, or store the paths as strings)")
        paths = table.column(path_column).to_pylist()
        values = {name: table.column(name).to_pylist() for name in keep}
    except (OSError, ValueError, pa.ArrowException) as e:  # ValueError: a struct whose fields share a name
        raise ConfigError(f"table {path} cannot be read as Parquet ({e})") from None
    types = {name: _arrow_type(table.schema.field(name).type) for name in keep}
    return [Row(i + 1, p, {name: values[name][i] for name in keep}) for i, p in enumerate(paths)], types


def _arrow_type(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):  # a pandas Categorical: its values' type, not their JSON text
        return _arrow_type(arrow_type.value_type)
    kinds = {"null": pa.types.is_null(arrow_type), "bool": pa.types.is_boolean(arrow_type),
             "float64": pa.types.is_floating(arrow_type),
             "int64": pa.types.is_integer(arrow_type) and not pa.types.is_uint64(arrow_type),  # uint64 may not fit
             "string": pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
             or pa.types.is_string_view(arrow_type)}  # what Polars writes
    return next((kind for kind, hit in kinds.items() if hit), "json")


def joined(kind: str, other: str) -> str:
    """One type for the values of two types: a column of nulls takes the other's, integers and floats together
    ``float64`` (as in one table), any other pair ``json``."""
    if kind == other or other == "null":
        return kind
    if kind == "null":
        return other
    return "float64" if {kind, other} == {"int64", "float64"} else "json"


def cell(value: Any, kind: str) -> Any:
    """A cell as its column's type stores it (``json``: its JSON text, strict JSON; not-a-number floats as null,
    nested ones too)."""
    value = _plain(value) if kind == "json" else value
    if value is None or (kind == "float64" and not math.isfinite(value)):
        return None
    if kind == "json":
        return json.dumps(value, default=str, ensure_ascii=False, allow_nan=False)
    return float(value) if kind == "float64" else value


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: NaN and infinities as null, binary as base64 (protobuf's JSON mapping of bytes);
    what JSON has no type for (dates, decimals) is left to ``json.dumps``' ``default``, its str."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def _csv_rows(path: Path, path_column: str, keep: Sequence[str], delimiter: str
              ) -> tuple[list[Row], dict[str, str]]:
    text = _text(path)
    # The field limit guards memory against a runaway cell; the whole text is in memory already (raised, never lowered).
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    taken, ended = [], []  # the lines of the record being read; set once the reader asks past the last line
    # Lenient, as pandas reads '"Best" pizza'; a quote that never closes is found per record (_check_record).
    reader = csv.DictReader(_lines(text, taken, ended), delimiter=delimiter)
    rows, done = [], 0  # done: the lines of the records before the one being read
    try:
        names = reader.fieldnames or []  # reads the header line: csv.Error too
        if names:
            _check_record(path, taken, 0, bool(ended), delimiter)
        _missing(path, [path_column, *keep], names)
        done += len(taken)
        taken.clear()
        for i, record in enumerate(reader):
            _check_record(path, taken, done, bool(ended), delimiter)
            done += len(taken)
            taken.clear()
            rows.append(Row(i + 1, record.get(path_column), {name: record.get(name) for name in keep}))
    except csv.Error as e:
        raise ConfigError(f"table {path}, line {reader.reader.line_num or 1}: {e}") from None
    return rows, dict.fromkeys(keep, "string")


def _lines(text: str, taken: list[str], ended: list) -> Iterator[str]:
    for line in io.StringIO(text, newline=""):
        taken.append(line)
        yield line
    ended.append(True)


def _check_record(path: Path, lines: list[str], before: int, ended: bool, delimiter: str) -> None:
    """Refuse a record holding a quote that never closes, which the lenient reader would fill with every row up to
    the next quote: one read past the last line, or one of several lines where a strict reader finds the quote
    closed on a later line with more text after it (a quote closing a cell's lines is followed by its delimiter)."""
    blank = next((n for n, line in enumerate(lines) if line.strip()), 0)  # blank lines the reader skipped
    if len(lines) - blank > 1 and not ended:
        strict = csv.reader(lines[blank:], delimiter=delimiter, strict=True)
        try:
            for _ in strict:
                pass
        except csv.Error:
            ended = strict.line_num > 1
    if ended:
        raise ConfigError(f"table {path}: the record from line {before + blank + 1} opens a quote that never closes")


def _jsonl_rows(path: Path, path_column: str, keep: Sequence[str]) -> tuple[list[Row], dict[str, str]]:
    rows, seen = [], set()
    # Only "\n" ends a line: str.splitlines would also split at U+2028, U+2029 and U+0085, legal in a JSON string.
    for i, line in enumerate(_text(path).split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record, error = None, f"table {path}, line {i + 1}: not JSON ({e.msg})"
        else:
            error = None if isinstance(record, dict) else f"table {path}, line {i + 1}: not a JSON object"
        if error:
            rows.append(Row(i + 1, None, {}, error))
            continue
        seen.update(record)
        rows.append(Row(i + 1, record.get(path_column), {name: record.get(name) for name in keep}))
    if seen:  # a part with no object (empty, torn) names no columns: its lines fail alone
        _missing(path, [path_column], sorted(seen))
    # A field no line holds is left out of the types: a writer may leave out a field that is null (Spark's JSON does),
    # so that only the run's tables together say whether a kept column exists (gather_inputs).
    return rows, {name: functools.reduce(joined, (_json_type(r.columns[name]) for r in rows if r.error is None),
                                         "null") for name in keep if name in seen}


def _json_type(value: Any) -> str:
    return ("null" if value is None else "bool" if isinstance(value, bool) else "int64" if isinstance(value, int)
            and value in INT64 else "float64" if isinstance(value, float) else "string" if isinstance(value, str)
            else "json")


def _text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"table {path} cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"table {path} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
