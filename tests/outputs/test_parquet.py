"""qwenvl_vision.outputs.parquet and parquet_reader: the layout (column types, metadata) as plain pyarrow reads it,
the values bitwise the encoder's (bf16 runs: tests/embed/test_parquet_writer.py), atomic shard writes, and the
reader refusing damaged files with one error naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qwenvl_vision import ManifestError, load_encoder
from qwenvl_vision.embed.manifest import parquet_shards
from qwenvl_vision.inputs.video_io import VideoInfo
from qwenvl_vision.results import ItemResult
from tests.helpers import make_image_folder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import qwenvl_vision.outputs.parquet as qparquet  # noqa: E402
from qwenvl_vision.outputs.parquet import ParquetLayout, results_table, shard_name, write_table_atomic  # noqa: E402
from qwenvl_vision.outputs.parquet_reader import (  # noqa: E402
    read_parquet_index,
    read_parquet_records,
    read_parquet_table,
)
from qwenvl_vision.outputs.records import EmbeddingRecord, record_from_result  # noqa: E402

SETTINGS = dict(min_pixels=32 * 32, max_pixels=96 * 96)
RUN = {"model": "tiny-qwen3", "dtype": "float32", "run_id": "r1", "threads": 2, "cpu_plan": None}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """Three good images of different sizes and a corrupt one, in that order."""
    folder = tmp_path_factory.mktemp("parquet-media")
    (folder / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 3)
    return [str(p) for p in make_image_folder(folder, 3, bad=False)] + [str(folder / "cut.jpg")]


@pytest.fixture(scope="module")
def fp32(checkpoint3, inputs):
    """(records, layout): every input encoded (tokens, DeepStack and pooled), as embed would hand them over."""
    with load_encoder(checkpoint3, device="cpu") as enc:
        results = [r for batch in enc.iter_encode(inputs, pooled=True, **SETTINGS) for r in batch]
        layout = ParquetLayout.for_encoder(enc, pooled=True)
    return [record_from_result(r, inputs[r.index], os.path.realpath(inputs[r.index])) for r in results], layout


@pytest.fixture
def shard(tmp_path, fp32) -> Path:
    records, layout = fp32
    return write_table_atomic(results_table(records, layout, RUN), tmp_path / shard_name(0, 0))


def test_plain_pyarrow_reads_the_layout(shard, fp32):
    records, layout = fp32
    assert (layout.dim, layout.levels, layout.merge_size, layout.dtype) == (64, 2, 2, "float32")
    table = pq.read_table(shard)
    types = {f.name: f.type for f in table.schema}
    vectors = pa.list_(pa.float32(), 64)
    assert types == {"path": pa.string(), "realpath": pa.string(), "status": pa.string(), "error": pa.string(),
                     "grid_thw": pa.list_(pa.int64(), 3), "tokens": pa.int64(), "embedding": pa.list_(vectors),
                     "pooled": vectors, "deepstack_0": pa.list_(vectors), "deepstack_1": pa.list_(vectors),
                     "video": qparquet.VIDEO_TYPE}
    meta = json.loads(table.schema.metadata[b"qwenvl_vision"])
    assert meta["run"] == RUN and meta["layout"]["dtype"] == "float32" and meta["layout"]["dim"] == 64
    rows = table.to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "error"]
    assert "not a recognised image file" in rows[3]["error"] or "corrupt" in rows[3]["error"]
    assert rows[3]["embedding"] is None and rows[3]["pooled"] is None and rows[3]["grid_thw"] is None
    for row, record in zip(rows[:3], records[:3], strict=True):
        assert row["path"] == record.path and row["realpath"] == str(Path(record.path).resolve())
        assert tuple(row["grid_thw"]) == record.grid_thw and row["tokens"] == record.embedding.shape[0]
        assert row["tokens"] == np.prod(row["grid_thw"]) // 4
        assert torch.equal(torch.tensor(row["embedding"]), record.embedding)
        assert torch.equal(torch.tensor(row["pooled"]), record.pooled)
        for level in range(2):
            assert torch.equal(torch.tensor(row[f"deepstack_{level}"]), record.deepstack[level])


def assert_same_records(got, want):
    """The same fields, and bitwise the same tensors of the same dtype (none for an error row)."""
    got = list(got)
    assert [(r.path, r.status, r.error, r.grid_thw, r.tokens) for r in got] == \
        [(r.path, r.status, r.error, r.grid_thw, r.tokens) for r in want]
    for a, b in zip(got, want, strict=True):
        for x, y in zip([a.embedding, a.pooled, *a.deepstack], [b.embedding, b.pooled, *b.deepstack], strict=True):
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))


def test_read_parquet_records_gives_back_the_encoder_tensors(shard, fp32):
    records, _ = fp32
    assert_same_records(read_parquet_records([shard]), records)
    assert read_parquet_table(shard)[2] == RUN


def test_a_folder_is_read_in_rank_and_shard_number_order(tmp_path, fp32):
    """Rank 10's shards after rank 2's (the job's order), not before them as by name."""
    records, layout = fp32
    for rank, number, record in ((10, 0, records[0]), (2, 1, records[1]), (2, 0, records[2])):
        write_table_atomic(results_table([record], layout, RUN), tmp_path / shard_name(rank, number))
    assert [r.path for r in read_parquet_records(parquet_shards(tmp_path))] == [records[i].path for i in (2, 1, 0)]


def test_a_flipped_bit_in_a_stored_value_is_caught_by_the_page_checksum(shard, fp32):
    """Random floats do not compress: a value's four bytes are in the file as they are, and a bit flipped there
    reads as another valid float unless the page's CRC is checked."""
    records, _ = fp32
    data = bytearray(shard.read_bytes())
    value = records[0].embedding[1, 5].numpy().tobytes()
    at = data.find(value)
    assert at > 0 and data.count(value) == 1
    data[at] ^= 0x10  # a low mantissa bit
    shard.write_bytes(bytes(data))
    for read in (read_parquet_table, lambda p: list(read_parquet_records([p]))):
        with pytest.raises(ManifestError, match="not a readable Parquet file.*CRC"):
            read(shard)


def test_pooled_only_layout_and_the_video_column(tmp_path, fp32):
    """A run that stores only mean vectors has no token columns; a video's frames survive the round trip."""
    records, layout = fp32
    layout = ParquetLayout(layout.dim, layout.levels, layout.merge_size, layout.dtype, tokens=False, pooled=True)
    info = VideoInfo(total_frames=20, video_fps=10.0, frame_indices=[0, 5, 10, 15], height=40, width=56)
    first = record_from_result(ItemResult(0, "video", records[0].embedding, records[0].grid_thw, [], records[0].pooled,
                                          info), records[0].path, records[0].realpath)
    path = write_table_atomic(results_table([first, *records[1:]], layout, RUN), tmp_path / "a.parquet")
    assert pq.read_schema(path).names == ["path", "realpath", "status", "error", "grid_thw", "tokens", "pooled",
                                          "video"]
    back = list(read_parquet_records([path]))
    assert back[0].video == {"frames": [0, 5, 10, 15], "timestamps": [0.0, 0.5, 1.0, 1.5], "fps": 10.0,
                             "sampled_fps": info.sampled_fps, "total_frames": 20}
    assert back[1].video is None and back[0].embedding is None and back[0].tokens == records[0].tokens
    assert all(torch.equal(got.pooled, want.pooled) for got, want in zip(back[:3], records[:3], strict=True))


def test_the_writer_refuses_a_vector_of_another_width(fp32):
    _, layout = fp32
    wide = EmbeddingRecord("x", "/x", "ok", None, (1, 2, 2), 1, torch.zeros(1, 65), [torch.zeros(1, 65)] * 2,
                           torch.zeros(65))
    with pytest.raises(ValueError, match="row 0: embedding has shape"):
        results_table([wide], layout, RUN)


def test_a_failed_write_leaves_neither_a_shard_nor_a_temporary_file(tmp_path, fp32, monkeypatch):
    records, layout = fp32
    table = results_table(records, layout, RUN)
    target = tmp_path / shard_name(0, 1)

    def full_disk(table, where, **options):
        where.write(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qparquet.pq, "write_table", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_table_atomic(table, target)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("metadata, message", [(None, "no qwenvl_vision metadata"),
                                               ({b"qwenvl_vision": b"{not json"}, "damaged qwenvl_vision metadata")])
def test_a_file_without_our_metadata_is_one_error_naming_it(shard, metadata, message):
    pq.write_table(pq.read_table(shard).replace_schema_metadata(metadata), shard)
    for read in (read_parquet_table, lambda p: list(read_parquet_records([p]))):
        with pytest.raises(ManifestError, match=message) as caught:
            read(shard)
        assert str(shard) in str(caught.value)


def test_an_unreadable_file_is_refused_and_a_write_in_progress_is_no_shard(shard):
    (shard.parent / f".{shard.name}.abc.tmp").write_bytes(b"a write in progress")
    assert parquet_shards(shard.parent) == [shard]
    other = shard.parent / "z.parquet"
    other.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ManifestError, match=r"z.parquet: not a readable Parquet file"):
        list(read_parquet_records([shard, other]))
    data = bytearray(shard.read_bytes())
    data[4:68] = b"\xff" * 64  # the first page's header, after the magic: pyarrow's message runs over lines
    other.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"z.parquet: not a readable Parquet file .*thrift") as caught:
        list(read_parquet_records([other]))
    assert "\n" not in str(caught.value)


def test_text_columns_store_a_non_utf8_name_escaped(tmp_path, fp32):
    """A surrogate-escaped file name ('caf\\udce9.jpg', Python's b'caf\\xe9.jpg') and an error naming it: plain
    pa.array refuses them (UnicodeEncodeError); the layout stores their backslash escapes, valid text unchanged."""
    _, layout = fp32
    odd = "/data/caf\udce9.jpg"
    with pytest.raises(UnicodeEncodeError):
        pa.array([odd], pa.string())
    records = [EmbeddingRecord(odd, odd, "error", f"image {odd}: not a recognised image file"),
               EmbeddingRecord("/data/né.jpg", "/data/né.jpg", "error", "gone")]
    path = write_table_atomic(results_table(records, layout, RUN), tmp_path / shard_name(0, 0))
    rows = pq.read_table(path).to_pylist()
    assert [r["path"] for r in rows] == ["/data/caf\\udce9.jpg", "/data/né.jpg"]
    assert rows[0]["realpath"] == "/data/caf\\udce9.jpg" and "caf\\udce9.jpg" in rows[0]["error"]
    assert qparquet.text("plain é") == "plain é" and qparquet.needs_escape(odd) and not qparquet.needs_escape("é")


def test_the_index_reads_realpaths_and_statuses(tmp_path, fp32):
    """read_parquet_index gives what a resume needs without the tensors."""
    records, layout = fp32
    first = write_table_atomic(results_table(records, layout, RUN), tmp_path / shard_name(0, 0))
    realpaths, statuses = read_parquet_index(first)
    assert statuses == [r.status for r in records] and realpaths == [r.realpath for r in records]
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ManifestError, match="not a readable Parquet file"):
        read_parquet_index(tmp_path / "junk.parquet")


def test_a_shard_of_another_layout_version_is_one_error_naming_it(shard):
    """A shard of a newer layout is refused as damaged, never read into records of another layout."""
    table = pq.read_table(shard)
    meta = json.loads(table.schema.metadata[b"qwenvl_vision"])
    meta.update(format=2)
    pq.write_table(table.replace_schema_metadata({b"qwenvl_vision": json.dumps(meta).encode()}), shard)
    with pytest.raises(ManifestError, match="format 2, this version reads 1") as caught:
        list(read_parquet_records([shard]))
    assert str(shard) in str(caught.value)


def test_the_grids_a_hand_off_reads_are_the_ok_rows_only(shard, fp32):
    """read_parquet_grids (read_encoded's first read): an error row has no grid, no tokens, and is no item."""
    from qwenvl_vision.outputs.parquet_reader import read_parquet_grids

    records, _ = fp32
    assert read_parquet_grids(shard) == [(r.path, list(r.grid_thw), None, r.tokens) for r in records[:3]]


def test_a_shard_whose_columns_are_not_its_layout_s_is_one_error_naming_it(shard):
    table = pq.read_table(shard)
    column = table.schema.get_field_index("tokens")
    table = table.set_column(column, pa.field("tokens", pa.int32()), table.column("tokens").cast(pa.int32()))
    pq.write_table(table, shard)  # the schema's metadata kept: a layout that says int64
    with pytest.raises(ManifestError, match=r"column 'tokens' is int32, not int64") as caught:
        list(read_parquet_records([shard]))
    assert str(shard) in str(caught.value)


def test_a_carried_text_value_utf8_cannot_encode_is_stored_escaped_and_a_pooled_vector_of_another_width_refused(
        tmp_path, fp32):
    """A JSONL table can hold a lone surrogate ("\\udce9" in JSON): stored as its backslash escape, as names are.
    A mean vector of another width is a ValueError naming the row, not a misaligned column."""
    records, layout = fp32
    carried = ParquetLayout(layout.dim, layout.levels, layout.merge_size, layout.dtype, pooled=True,
                            columns=(("caption", "string"),))
    row = EmbeddingRecord("/data/a.jpg", "/data/a.jpg", "error", "gone", columns={"caption": "caf\udce9"})
    path = write_table_atomic(results_table([row], carried, RUN), tmp_path / shard_name(0, 0))
    assert pq.read_table(path).column("caption").to_pylist() == ["caf\\udce9"]
    for pooled in (torch.zeros(65), torch.zeros(2, 64)):
        wide = EmbeddingRecord("x", "/x", "ok", None, records[0].grid_thw, records[0].tokens, records[0].embedding,
                               records[0].deepstack, pooled)
        with pytest.raises(ValueError, match=r"row 1: pooled has shape"):
            results_table([records[1], wide], carried, RUN)


def test_a_url_s_password_and_signature_never_reach_a_parquet_row(tmp_path, fp32):
    """A URL input's path, realpath and error are stored redacted (inputs.urls), as in the manifest."""
    _, layout = fp32
    url = "https://user:secret@host.example/a.png?X-Amz-Signature=abc123&x=1"
    row = EmbeddingRecord(url, url, "error", f"cannot read {url}: 403")
    path = write_table_atomic(results_table([row], layout, RUN), tmp_path / shard_name(0, 0))
    (stored,) = pq.read_table(path).to_pylist()
    assert stored["path"] == stored["realpath"] == "https://user:***@host.example/a.png?X-Amz-Signature=***&x=1"
    assert "secret" not in stored["error"] and "abc123" not in stored["error"]
