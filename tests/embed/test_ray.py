"""qwenvl_vision.embed.ray: Embedder over path, bytes and image columns, bad rows as status="error" rows, each good row
bitwise what encode_images gives for the same input with the same settings; the Ray pipeline on a local 2-CPU
Ray; Ray's rows back as records; ``import qwenvl_vision`` loads neither Ray nor pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from qwenvl_vision import load_encoder
from qwenvl_vision.errors import ConfigError
from tests.helpers import REPO, synthetic_photo
from tests.helpers import embed as embed_helpers

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")

from qwenvl_vision.embed.ray import Embedder, embed_dataset, records_from_batch  # noqa: E402
from qwenvl_vision.errors import ForwardFaultError, InputError  # noqa: E402
from qwenvl_vision.outputs.parquet import ParquetLayout, result_columns  # noqa: E402
from qwenvl_vision.outputs.records import EmbeddingRecord  # noqa: E402

local_ray = embed_helpers.local_ray  # the session's Ray (a fixture shared with test_ray_engine)

# Small images and small pixel bounds: every image a handful of tokens (patch 16, merge 2: 32x32 pixels a token).
SETTINGS = dict(min_pixels=32 * 32, max_pixels=96 * 96)
SIZES = [(40, 56), (64, 96), (50, 50)]
# Rows are compared bitwise with the test's own encoder, in this process and in Ray's actors. oneDNN and addmm
# round differently, and "auto" takes the plan measured for the thread count (the actors run one thread, this
# process may run more), so every encoder here runs transformers' kernels.
LOAD = dict(device="cpu", dtype="float32", cpu_kernels="reference")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, list]:
    """Good image files (JPEG and PNG), bad ones (corrupt, empty, text named as an image), and their bytes."""
    folder = tmp_path_factory.mktemp("ray-media")
    good = []
    for i, (h, w) in enumerate(SIZES):
        path = folder / f"good{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(synthetic_photo(h, w, seed=i)).save(path)
        good.append(str(path))
    corrupt, empty, text = folder / "cut.jpg", folder / "empty.jpg", folder / "notes.png"
    corrupt.write_bytes(Path(good[0]).read_bytes()[:200])
    empty.write_bytes(b"")
    text.write_text("just text, wrongly named\n" * 10)
    return {"good": good, "bad": [str(corrupt), str(empty), str(text)]}


@pytest.fixture(scope="module")
def encoder(checkpoint3):
    with load_encoder(checkpoint3, **LOAD) as enc:
        yield enc


@pytest.fixture(scope="module")
def embedder(checkpoint3):
    """An Embedder called directly, as Ray's actor calls it (the UDF without a cluster)."""
    return Embedder(str(checkpoint3), **LOAD, **SETTINGS)


def test_an_actor_decodes_on_pillow_blocks_that_go_back_to_the_system(checkpoint3, monkeypatch):
    """An actor decodes for hours, as embed's process does: Pillow's blocks above glibc's mmap threshold (freed ones
    go back to the system), unless PILLOW_BLOCK_SIZE chose."""
    monkeypatch.delenv("PILLOW_BLOCK_SIZE", raising=False)
    before = Image.core.get_block_size()
    Image.core.set_block_size(16 << 20)  # Pillow's default
    try:
        Embedder(str(checkpoint3), **LOAD)
        assert Image.core.get_block_size() == 64 << 20
    finally:
        Image.core.set_block_size(before)


def interleave(good: list, bad: list) -> tuple[list, list[bool]]:
    """bad and good items alternating, a bad one first, and which ones are good."""
    return [item for pair in zip(bad, good, strict=True) for item in pair], [False, True] * len(good)


def check_rows(rows: list[dict], is_good: list[bool], reference, levels: int, pooled: bool = False) -> None:
    """Each good row bitwise the reference's next item, each bad one an error row with its reason."""
    assert len(rows) == len(is_good)
    good = iter(range(len(reference)))
    for row, ok in zip(rows, is_good, strict=True):
        if not ok:
            assert row["status"] == "error" and row["error"], row
            assert "\n" not in row["error"] and row["grid_thw"] is None and row["tokens"] is None
            continue
        i = next(good)
        assert row["status"] == "ok" and row["error"] is None, row
        assert tuple(row["grid_thw"]) == tuple(reference.grid_thw[i].tolist())
        want = (reference.pooled if pooled else reference.embeddings)[i].float()
        assert torch.equal(torch.from_numpy(_tensor(row, "pooled" if pooled else "embedding")), want)
        if pooled:
            continue  # a pooled run stores no token rows or DeepStack levels
        assert row["tokens"] == reference.embeddings[i].shape[0]
        assert len(reference.deepstack[i]) == levels
        for level, ref in enumerate(reference.deepstack[i]):
            assert torch.equal(torch.from_numpy(_tensor(row, f"deepstack_{level}")), ref.float())


# ---------------------------------------------------------------------- the UDF itself


def test_path_column_with_bad_files(embedder, encoder, media):
    paths, is_good = interleave(media["good"], media["bad"])
    table = embedder({"path": np.array(paths, dtype=object), "id": np.arange(len(paths))})
    assert table.column_names == ["path", "id", "status", "error", "grid_thw", "tokens", "embedding",
                                  "deepstack_0", "deepstack_1", "video", "pixels_sha256"]
    # The result columns are the Parquet layout's, type for type (one Arrow conversion for both).
    layout = ParquetLayout.for_encoder(encoder).schema()
    for name in table.column_names[2:-1]:
        assert table.schema.field(name).type == layout.field(name).type, name
    assert table.schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), encoder.out_hidden_size))
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == list(range(len(paths))) and [r["path"] for r in rows] == paths
    check_rows(rows, is_good, encoder.encode_images(media["good"], **SETTINGS), levels=2)
    errors = [r["error"] for r in rows if r["status"] == "error"]
    assert "corrupt or truncated image data" in errors[0] and "cut.jpg" in errors[0]
    assert errors[1].endswith("file is empty (0 bytes)")
    assert errors[2].endswith("not a recognised image file (corrupt, or not an image)")


def test_an_input_over_max_item_tokens_is_an_error_row(checkpoint3, media):
    bounded = Embedder(str(checkpoint3), **LOAD, **SETTINGS, max_item_tokens=1)
    [row] = bounded({"path": np.array(media["good"][:1], dtype=object)}).to_pylist()
    assert row["status"] == "error" and "tokens, more than the bound of 1" in row["error"]


def _tensor(row: dict, name: str) -> np.ndarray:
    """A tensor cell as to_pylist and take_all give it (nested lists of floats) as a float32 array."""
    return np.asarray(row[name], np.float32)


def test_bytes_column_decodes_as_the_files_do(embedder, encoder, media):
    """Encoded bytes give the very tensors their file gives; bad bytes are error rows naming them ``image bytes``."""
    data = [Path(p).read_bytes() for p in media["good"]]
    bad = [Path(media["bad"][0]).read_bytes(), b"", b"plain text, not an image\n" * 5]
    items, is_good = interleave(data, bad)
    batch = {"bytes": np.array(items + [None], dtype=object), "key": np.array([f"k{i}" for i in range(len(items) + 1)])}
    rows = embedder(batch).to_pylist()
    assert "bytes" not in rows[0] and [r["key"] for r in rows] == list(batch["key"])
    check_rows(rows, is_good + [False], encoder.encode_images(media["good"], **SETTINGS), levels=2)
    errors = [r["error"] for r in rows if r["status"] == "error"]
    assert all(e.startswith("image bytes: ") for e in errors), errors
    assert "corrupt or truncated image data" in errors[0] and errors[1].endswith("empty (0 bytes)")
    assert errors[2].endswith("not a recognised image file (corrupt, or not an image)")
    assert errors[3].endswith("expected bytes, got NoneType")


def test_crossed_options_are_refused_before_the_tower_loads(checkpoint3):
    with pytest.raises(ConfigError, match="pass pooled=True too"):
        Embedder(str(checkpoint3), **LOAD, normalize=True)
    with pytest.raises(ConfigError, match="min_pixels 9000 is above max_pixels 4000"):
        Embedder(str(checkpoint3), **LOAD, min_pixels=9000, max_pixels=4000)
    with pytest.raises(ConfigError, match="max_item_tokens .* got 0"):
        Embedder(str(checkpoint3), **LOAD, max_item_tokens=0)


def test_image_column_and_pooled(checkpoint3, encoder):
    """Arrays as read_images gives them; bad arrays (no pixels, two channels, a 1x300 strip) are error rows."""
    good = [synthetic_photo(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES)]
    bad = [np.zeros((0, 0, 3), np.uint8), np.zeros((8, 8, 2), np.uint8), np.zeros((1, 300, 3), np.uint8)]
    items, is_good = interleave(good, bad)
    pooled = Embedder(str(checkpoint3), **LOAD, pooled=True, **SETTINGS)
    column = np.empty(len(items), dtype=object)
    column[:] = items
    table = pooled({"image": column})
    assert table.column_names == ["status", "error", "grid_thw", "tokens", "pooled", "video", "pixels_sha256"]
    rows = table.to_pylist()
    check_rows(rows, is_good, encoder.encode_images(good, pooled=True, **SETTINGS), levels=0, pooled=True)
    errors = [r["error"] for r in rows if r["status"] == "error"]
    assert all(e.startswith("image array: ") for e in errors), errors
    assert all(r["pooled"] is None for r in rows if r["status"] == "error")


def test_a_failing_forward_costs_only_its_own_row(embedder, encoder, media, monkeypatch):
    """A forward that fails for the whole batch (out of memory, say) is retried input by input; an input that
    fails alone too is an error row, never a failed task, and the other rows keep their tensors."""
    forward = embedder.encoder._encode_unchecked  # the tower's forward under the encoder's own retries
    poisoned = tuple(encoder.encode_images([media["good"][1]], **SETTINGS).grid_thw[0].tolist())

    def out_of_memory(pixel_values, grid_thw, **options):
        if len(grid_thw) > 1 or tuple(grid_thw[0]) == poisoned:
            raise RuntimeError("out of memory (a stand-in)\nits second line")
        return forward(pixel_values, grid_thw, **options)

    monkeypatch.setattr(embedder.encoder, "_encode_unchecked", out_of_memory)
    rows = embedder({"path": np.array(media["good"], dtype=object)}).to_pylist()
    assert [r["status"] for r in rows] == ["ok", "error", "ok"]
    assert rows[1]["error"].startswith(f"image {media['good'][1]!r}: out of memory encoding it alone (")
    for row, path in zip([rows[0], rows[2]], [media["good"][0], media["good"][2]]):
        check_rows([row], [True], encoder.encode_images([path], **SETTINGS), levels=2)


def test_a_device_that_fails_every_forward_fails_the_task_not_each_row(embedder, media, monkeypatch):
    """The machine's fault (the encoder's probe of the device fails too) is no row's error: the task fails, and
    the run stops with exit 4, as the local engine does."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (a stand-in)")

    monkeypatch.setattr(embedder.encoder, "_encode_unchecked", broken)
    with pytest.raises(ForwardFaultError, match="the forward of a batch of 3 inputs"):
        embedder({"path": np.array(media["good"], dtype=object)})


# ---------------------------------------------------------------------- on Ray


@pytest.mark.slow
def test_ray_pipeline_over_every_input_kind(local_ray, checkpoint3, encoder, media):
    """map_batches(Embedder) on a local Ray over paths (two actors on two CPUs: they must leave the read tasks a
    CPU), bytes (read_binary_files) and images (read_images)."""
    # Every image alone in its forward (max_batch_patches=1), so the reference is each image encoded alone
    # whatever rows Ray puts together in a batch.
    options = dict(LOAD, max_batch_patches=1, **SETTINGS)
    # Ray runs an actor's torch on as many threads as its CPUs, here 1 (OMP_NUM_THREADS), and a CPU matmul's
    # last bits depend on how it is split over threads: the reference is computed on one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [encoder.encode_images([p], **SETTINGS) for p in media["good"]]
    finally:
        torch.set_num_threads(threads)

    def check(rows, paths):
        by_path = {r["path"]: r for r in rows}
        assert sorted(by_path) == sorted(paths)
        for path in media["bad"]:
            if path in by_path:
                assert by_path[path]["status"] == "error" and by_path[path]["error"]
        for path, ref in zip(media["good"], alone):
            if path in by_path:
                check_rows([by_path[path]], [True], ref, levels=2)

    paths, _ = interleave(media["good"], media["bad"])
    rows = ray.data.from_items([{"path": p} for p in paths])
    check(embed_dataset(rows, str(checkpoint3), concurrency=2, batch_size=2, **options).take_all(), paths)

    files = ray.data.read_binary_files(media["good"] + media["bad"], include_paths=True)
    check(embed_dataset(files, str(checkpoint3), **options).take_all(), media["good"] + media["bad"])

    images = ray.data.read_images(media["good"], include_paths=True, mode="RGB")
    check(embed_dataset(images, str(checkpoint3), **options).take_all(), media["good"])


def test_records_from_batch_names_the_column_that_is_not_embedder_s():
    """Rows in Embedder's layout read back as they were built (levels by number, the path resolved where no
    realpath column is); a batch with a level out of sequence, a variable-size vector column, a column of another
    type or none of a result column is one InputError naming that column."""
    layout = ParquetLayout(dim=4, levels=2, merge_size=1, dtype="float32")
    gen = torch.Generator().manual_seed(0)
    record = EmbeddingRecord("a.png", "", "ok", None, (1, 2, 2), 4, torch.randn(4, 4, generator=gen),
                             [torch.randn(4, 4, generator=gen) + i for i in range(2)])
    good = pa.table({"path": pa.array(["a.png"]), **result_columns([record], layout)})
    [back] = records_from_batch(good)
    assert back.realpath == os.path.realpath("a.png") and torch.equal(back.embedding, record.embedding)
    assert all(torch.equal(a, b) for a, b in zip(back.deepstack, record.deepstack, strict=True))
    variable = pa.list_(pa.list_(pa.float32()))
    for bad, culprit in [
        (good.append_column("deepstack_3", good.column("deepstack_0")), "'deepstack_2'"),
        (good.set_column(good.schema.get_field_index("embedding"), "embedding",
                         good.column("embedding").cast(variable)), "'embedding'"),
        (good.set_column(good.schema.get_field_index("grid_thw"), "grid_thw",
                         good.column("grid_thw").cast(pa.list_(pa.int32(), 3))), "'grid_thw'"),
        (good.drop_columns(["status"]), "'status'"),
    ]:
        with pytest.raises(InputError, match=culprit) as caught:
            records_from_batch(bad)
        assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_importing_the_package_loads_neither_ray_nor_pyarrow():
    code = ("import sys, qwenvl_vision; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'pyarrow'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []
