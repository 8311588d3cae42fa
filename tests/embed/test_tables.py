"""Tables of inputs (qwenvl_vision.embed.tables): Parquet, CSV, TSV and JSON Lines files whose rows name the files,
their columns carried into every output format, in row order, for the local engine, torchrun and Ray; the tensors
bitwise those of the same files embedded from a folder."""

from __future__ import annotations

import base64
import csv
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.embed.manifest import parquet_shards
from qwenvl_vision.outputs.parquet_reader import read_parquet_records
from tests.helpers import make_image_folder
from tests.helpers.embed import (
    ENV,
    embed_cmd,
    kill_at_instants,
    local_ray,  # noqa: F401 - a fixture
    one_error_line,
    run_embed,
    torchrun_embed_cmd,
)
from tests.helpers.servers import http_folder

SMALL = ["--max-pixels", str(64 * 64), "--quiet"]
KEEP = ["--keep-columns", "caption,idx"]


def rows_for(paths: list[Path], root: Path, base_url: str = "http://127.0.0.1:9") -> list[dict]:
    """One row per image (paths relative to the table's folder), then a row naming no file, a URL the loopback
    server lacks and a missing file: every row with a caption and an index."""
    rows = [{"path": str(p.relative_to(root)), "caption": f"photo {i}", "idx": i} for i, p in enumerate(paths)]
    bad = [("", "empty"), (f"{base_url}/nowhere.jpg", "url"), ("imgs/missing.png", "gone")]
    return rows + [{"path": path, "caption": caption, "idx": 90 + i} for i, (path, caption) in enumerate(bad)]


def write_table(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if path.suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, checkpoint):
    """The images embedded from their folder: the tensors every table must give, by real path; and an HTTP server
    on loopback."""
    root = tmp_path_factory.mktemp("tables")
    paths = make_image_folder(root / "imgs", 4, bad=False)
    out = root / "from-folder"
    assert main(["embed", str(root / "imgs"), "--model", str(checkpoint), "--out", str(out), *SMALL]) == 0
    realpath = {r["path"]: r["realpath"] for r in read_manifest_lines(out / "manifest.jsonl")}
    (root / "served").mkdir()
    with http_folder(root / "served") as base_url:  # a real server on loopback, which lacks what rows ask of it
        yield root, sorted(paths), {realpath[p]: t for p, t in read_embeddings(out)}, base_url


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".tsv", ".jsonl"])
def test_a_table_s_rows_embed_bitwise_as_the_folder_and_carry_their_columns_in_row_order(folder_run, checkpoint,
                                                                                          suffix):
    root, paths, want, base_url = folder_run
    rows = rows_for(paths, root, base_url)
    rows[0]["caption"] += " long" * 40_000  # a cell over the csv module's default field limit
    table = write_table(root / f"inputs{suffix}", rows)
    out = root / f"out{suffix}"
    assert main(["embed", str(table), "--model", str(checkpoint), "--out", str(out), *KEEP, *SMALL]) == 1
    records = read_manifest_lines(out / "manifest.jsonl")
    assert [r["columns"]["caption"] for r in records] == [r["caption"] for r in rows]  # row order, bad rows too
    typed = str if suffix in (".csv", ".tsv") else int  # CSV cells are text; the others keep their type
    assert [r["columns"]["idx"] for r in records] == [typed(r["idx"]) for r in rows]
    assert read_run(out)["columns"] == [["caption", "string"], ["idx", "string" if typed is str else "int64"]]
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) == len(paths)
    got = dict(read_embeddings(out))
    for r in ok:
        assert torch.equal(got[r["path"]], want[r["realpath"]])
    errors = [r["error"] for r in records if r["status"] == "error"]
    assert f"table {table}, row {len(paths) + 1}: column 'path'" in errors[0]
    assert errors[1] == f"{base_url}/nowhere.jpg: cannot read its metadata (not found)"  # a failed input
    assert "missing.png" in errors[2]


def test_every_format_carries_the_columns_typed_and_a_resume_keeps_each_row_once(folder_run, checkpoint):
    """JSON Lines split at newlines only: U+2028, U+2029 and U+0085 are legal raw in a JSON string."""
    root, paths, want, _ = folder_run
    captions = ["a\u2028b", "c\u2029d", "e\u0085f", "plain"]
    rows = [{"path": str(p.relative_to(root)), "caption": captions[i], "idx": i, "score": i / 4, "keep": i % 2 == 0,
             "meta": {"n": i}} for i, p in enumerate(paths)]
    table = write_table(root / "typed.jsonl", rows[:2])
    keep = ["--keep-columns", "caption,idx,score,keep,meta"]
    out = root / "typed-parquet"
    assert run_embed([table], checkpoint, out, "--format", "parquet", *keep, *SMALL) == 0
    write_table(table, rows)  # two more rows: the resume embeds them, and only them
    assert run_embed([table], checkpoint, out, "--resume", *keep, *SMALL) == 0
    shards = sorted(out.glob("shard-*.parquet"))
    schema = pq.read_schema(shards[0])
    assert [str(schema.field(n).type) for n in ("caption", "idx", "score", "keep", "meta")] == \
        ["string", "int64", "double", "bool", "string"]
    table_rows = pa.concat_tables([pq.read_table(s) for s in shards]).to_pylist()
    assert [r["caption"] for r in table_rows] == [r["caption"] for r in rows]
    assert [json.loads(r["meta"]) for r in table_rows] == [r["meta"] for r in rows]
    assert [r["keep"] for r in table_rows] == [r["keep"] for r in rows]
    records = list(read_parquet_records(parquet_shards(out)))
    assert [r.columns["score"] for r in records] == [r["score"] for r in rows]
    assert all(torch.equal(r.embedding, want[r.realpath]) for r in records)

    cache = root / "typed-cache"
    assert run_embed([table], checkpoint, cache, "--format", "vllm-cache", *keep, *SMALL) == 0
    lines = read_manifest_lines(cache / "manifest.jsonl")
    assert [line["columns"] for line in lines] == [{k: r[k] if k != "meta" else json.dumps(r[k]) for k in
                                                    ("caption", "idx", "score", "keep", "meta")} for r in rows]


def test_a_file_given_before_its_table_row_carries_the_row_s_columns(folder_run, checkpoint):
    """The first spelling of a file is the one recorded; a table's row naming it later still gives its columns."""
    root, paths, _, _ = folder_run
    table = write_table(root / "late.csv", [{"path": str(paths[0]), "caption": "first"}])
    out = root / "out-late"
    assert run_embed([paths[0], table], checkpoint, out, "--keep-columns", "caption", *SMALL) == 0
    (record,) = read_manifest_lines(out / "manifest.jsonl")
    assert record["path"] == str(paths[0]) and record["columns"] == {"caption": "first"}


def test_columns_that_cannot_be_carried_are_refused_in_one_line(folder_run, checkpoint, capsys):
    root, paths, _, _ = folder_run
    table = write_table(root / "plain.csv", rows_for(paths, root))
    damaged = write_table(root / "damaged.parquet", rows_for(paths, root))
    damaged.write_bytes(damaged.read_bytes()[:4] + b"\xff" * 64 + damaged.read_bytes()[68:])  # its first page header
    unclosed = root / "unclosed.csv"  # a quote that never closes would take every later row into its cell
    unclosed.write_text(f"path,caption\n{paths[0]},a\n{paths[1]},\"6 inch\n{paths[2]},b\n")
    runaway = root / "runaway.tsv"  # the same quote, which a later quoted word closes: the rows between swallowed
    runaway.write_text(f"path\tcaption\n{paths[0]}\t\"6 inch\n{paths[1]}\tb\n{paths[2]}\t\"Best\" view\n")
    doubled = root / "doubled.csv"  # pandas would take the first 'path', the csv module the last
    doubled.write_text(f"path,path\n{paths[0]},{paths[1]}\n")
    cases = [
        (table, ["--path-column", "file"], ["no column 'file'", "path, caption, idx"]),
        (table, ["--keep-columns", "caption,nope"], ["no column 'nope'"]),
        (write_table(root / "plain.jsonl", rows_for(paths, root)), ["--keep-columns", "caption,nope"],
         ["--keep-columns nope", "no line of the tables holds"]),
        (table, ["--keep-columns", "status"], ["status", "rename the column"]),
        (table, ["--keep-columns", "deepstack_0"], ["deepstack_0", "rename the column"]),
        (table, ["--keep-columns", "caption,,idx"], ["--keep-columns"]),
        (root / "imgs", KEEP, ["no input is a table"]),
        (unclosed, [], ["unclosed.csv: the record from line 3", "opens a quote that never closes"]),
        (runaway, [], ["runaway.tsv: the record from line 2", "opens a quote that never closes"]),
        (damaged, [], ["damaged.parquet cannot be read as Parquet", "thrift"]),
        (doubled, [], ["doubled.csv has more than one column 'path'"]),
    ]
    for i, column in enumerate([pa.array([b"imgs/x.png"]), pa.array([0], pa.timestamp("ms")), pa.array([7])]):
        pq.write_table(pa.table({"file": column}), root / f"typed-path{i}.parquet")  # a path column not of text
        cases.append((root / f"typed-path{i}.parquet", ["--path-column", "file"],
                      [f"typed-path{i}.parquet", "'file'", str(column.type)]))
    (root / "dataset.parquet").mkdir()  # Spark's output: its parts are the tables
    write_table(root / "dataset.parquet" / "part-0.parquet", rows_for(paths, root))
    cases.append((root / "dataset.parquet", [], ["dataset.parquet is a folder", "dataset.parquet/*.parquet"]))
    cases.append((root / "missing.jsonl", KEEP, ["missing.jsonl cannot be read"]))  # not "no input is a table"
    pq.write_table(pa.table({"path": ["x.png"], "x": pa.StructArray.from_arrays([pa.array([1]), pa.array([2])],
                                                                                names=["a", "a"])}),
                   root / "twice.parquet")  # a struct whose fields share a name has no Python value
    cases.append((root / "twice.parquet", ["--keep-columns", "x"], ["twice.parquet cannot be read as Parquet"]))
    for source, extra, needles in cases:
        out = root / "refused"
        assert run_embed([source], checkpoint, out, *extra, *SMALL) == 2
        one_error_line(capsys.readouterr().err, *needles)
        assert not out.exists()


def test_a_dataset_s_parts_are_typed_together_as_one_table_would_be(folder_run, checkpoint):
    """Parts written apart type a column apart (a part's scores all whole, a part's captions all missing, a part
    empty): the run types each column over all of them, integers and floats as float64, text and numbers as JSON."""
    root, paths, want, _ = folder_run
    parts = root / "parts"
    parts.mkdir()
    rel = [str(Path("..") / p.relative_to(root)) for p in paths]
    write_table(parts / "a.jsonl", [{"path": rel[0], "score": 1, "caption": None, "tag": 1}])
    write_table(parts / "b.jsonl", [{"path": rel[1], "score": 2.5, "caption": "two", "tag": "x"}])
    write_table(parts / "b2.jsonl", [{"path": rel[3], "score": 4}])  # null fields left out, as Spark writes them
    (parts / "c.jsonl").write_text("")  # a part left with no rows
    pq.write_table(pa.table({"path": [rel[2]], "score": [3], "caption": pa.nulls(1), "tag": [3]}), parts / "d.parquet")
    out = root / "parts-out"
    assert run_embed(sorted(parts.iterdir()), checkpoint, out, "--format", "parquet", "--keep-columns",
                     "score,caption,tag", *SMALL) == 0
    table = pa.concat_tables([pq.read_table(s) for s in sorted(out.glob("shard-*.parquet"))])
    assert [str(table.schema.field(n).type) for n in ("score", "caption", "tag")] == ["double", "string", "string"]
    assert table.select(["score", "caption", "tag"]).to_pylist() == [
        {"score": 1.0, "caption": None, "tag": "1"}, {"score": 2.5, "caption": "two", "tag": '"x"'},
        {"score": 4.0, "caption": None, "tag": None}, {"score": 3.0, "caption": None, "tag": "3"}]
    assert all(torch.equal(r.embedding, want[r.realpath]) for r in read_parquet_records(parquet_shards(out)))


def test_a_cell_quoted_only_in_part_is_read_as_pandas_reads_it(folder_run, checkpoint):
    """Hand-written tables quote a word, not the cell ('"Best" pizza'): read as the cell's text without the quotes,
    as pandas and the csv module read it, where only a quote that never closes is refused."""
    root, paths, want, _ = folder_run
    table = root / "quoted.tsv"
    table.write_text(f"path\tcaption\n{paths[0].relative_to(root)}\t\"Best\" pizza\n")
    out = root / "quoted-out"
    assert run_embed([table], checkpoint, out, "--keep-columns", "caption", *SMALL) == 0
    (record,) = read_manifest_lines(out / "manifest.jsonl")
    assert record["columns"] == {"caption": "Best pizza"}


def test_torchrun_ranks_carry_each_row_s_columns(folder_run, checkpoint):
    root, paths, want, _ = folder_run
    table = write_table(root / "ranks.parquet", rows_for(paths, root)[:len(paths)])
    out = root / "ranks"
    result = subprocess.run(torchrun_embed_cmd([table], checkpoint, out, *KEEP, *SMALL), env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_manifest_lines(out / "manifest.jsonl")
    assert {r["rank"] for r in records} == {0, 1}
    assert sorted((r["columns"]["idx"], Path(r["path"]).name) for r in records) == \
        [(i, p.name) for i, p in enumerate(paths)]


@pytest.mark.slow  # a local Ray instance
def test_ray_engine_carries_each_row_s_columns(folder_run, checkpoint, local_ray):  # noqa: F811 - the fixture
    root, paths, want, _ = folder_run
    rows = [r for r in rows_for(paths, root) if "://" not in r["path"]]  # Ray reads local files only
    table = write_table(root / "ray.csv", rows)
    out = root / "ray"
    threads = str(read_run(root / "from-folder")["threads"])  # CPU bits are the same at the same thread count
    assert run_embed([table], checkpoint, out, "--engine", "ray", "--ray-actors", "1", "--threads", threads, *KEEP,
                     *SMALL) == 1
    records = list(read_parquet_records(parquet_shards(out)))
    assert sorted(r.columns["caption"] for r in records) == sorted(r["caption"] for r in rows)
    for r in records:
        if r.ok:
            assert torch.equal(r.embedding, want[r.realpath])


@pytest.mark.slow  # SIGKILLs at several instants
def test_kill_and_resume_over_a_table_records_each_row_once_with_its_columns(folder_run, checkpoint, tmp_path):
    root, paths, want, _ = folder_run
    rows = rows_for(paths, root)[: len(paths)]
    table = write_table(root / "killed.csv", rows)
    out = tmp_path / "killed"
    threads = str(read_run(root / "from-folder")["threads"])  # CPU bits are the same at the same thread count
    cmd = embed_cmd([table], checkpoint, out, "--batch-patches", "32", "--threads", threads, *KEEP, *SMALL)
    kill_at_instants(cmd, out)
    assert main([*cmd[3:], "--resume"]) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    assert sorted(r["columns"]["caption"] for r in records) == sorted(r["caption"] for r in rows)
    got = dict(read_embeddings(out))
    assert all(torch.equal(got[r["path"]], want[r["realpath"]]) for r in records)


@pytest.mark.parametrize("kind", ["dictionary", "string_view"])
def test_a_dictionary_encoded_or_string_view_column_is_carried_as_its_values(folder_run, checkpoint, kind):
    """A pandas Categorical is stored dictionary-encoded, Polars writes its text as string_view: the values are
    carried as text, not as their JSON, and such a path column names files."""
    root, paths, _, _ = folder_run
    table = root / f"{kind}.parquet"
    labels = ["a cat", "a dog", "a cat", "a bird"]
    text = (lambda values: pa.array(values).dictionary_encode()) if kind == "dictionary" else \
        (lambda values: pa.array(values, pa.string_view()))
    pq.write_table(pa.table({"path": text([str(p) for p in paths]), "label": text(labels)}), table)
    for file_format in ("safetensors", "parquet"):
        out = root / f"out-{kind}-{file_format}"
        assert run_embed([table], checkpoint, out, "--keep-columns", "label", "--format", file_format, *SMALL) == 0
        assert read_run(out)["columns"] == [["label", "string"]]
        if file_format == "parquet":
            assert [r.columns["label"] for r in read_parquet_records(parquet_shards(out))] == labels
        else:
            assert [r["columns"]["label"] for r in read_manifest_lines(out / "manifest.jsonl")] == labels


def test_nested_non_numbers_and_binary_cells_are_carried_as_strict_json(folder_run, checkpoint):
    """As a float column's NaN is null, so is one inside a list; bytes as base64 (not Python's repr)."""
    root, paths, _, _ = folder_run
    table = root / "nested.parquet"
    scores, blobs = [[0.5, float("nan")], [float("inf")], [], None], [b"\x00\xff", b"", b"png", None]
    pq.write_table(pa.table({"path": [str(p) for p in paths], "scores": scores,
                             "blob": pa.array(blobs, pa.binary())}), table)
    out = root / "out-nested"
    assert run_embed([table], checkpoint, out, "--keep-columns", "scores,blob", "--format", "parquet", *SMALL) == 0
    cells = [r.columns for r in read_parquet_records(parquet_shards(out))]
    strict = {"parse_constant": lambda constant: pytest.fail(f"{constant} is not JSON")}
    assert [c["scores"] and json.loads(c["scores"], **strict) for c in cells] == [[0.5, None], [None], [], None]
    assert [c["blob"] and base64.b64decode(json.loads(c["blob"])) for c in cells] == blobs
    mixed = write_table(root / "nested.jsonl", [{"path": str(p), "meta": m}  # a field of no one type: JSON text
                                                for p, m in zip(paths, ["a", float("nan"), [1, float("nan")], None])])
    out = root / "out-nested-jsonl"
    assert run_embed([mixed], checkpoint, out, "--keep-columns", "meta", "--format", "parquet", *SMALL) == 0
    assert [r.columns["meta"] for r in read_parquet_records(parquet_shards(out))] == ['"a"', None, "[1, null]", None]


def test_a_row_naming_a_lone_surrogate_or_a_nul_is_that_row_s_failed_input(folder_run, checkpoint):
    """JSON's escape "\\ud800" reads as a surrogate that no file name's bytes decode to, and no file name holds a NUL:
    the row names no file."""
    root, paths, _, _ = folder_run
    table = root / "surrogate.jsonl"
    table.write_text("".join(json.dumps({"path": p}) + "\n" for p in (str(paths[0]), "x\ud800.jpg", "x\0.jpg")))
    out = root / "out-surrogate"
    assert run_embed([table], checkpoint, out, *SMALL) == 1
    by_path = {r["path"]: r for r in read_manifest_lines(out / "manifest.jsonl")}
    assert by_path[str(paths[0])]["status"] == "ok"
    for row in (2, 3):
        assert f"table {table}, row {row}" in by_path[f"{table}#row{row}"]["error"]
