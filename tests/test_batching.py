"""How inputs become batches (qwenvl_vision.batching): the call's options, the token bound of a batch, the decode
budget (admission in input order, at most the workers decoding, an oversized input alone, waiters woken on close),
prefetch in input order and what a decode is charged. End-to-end parity with transformers is tests/test_encoder.py's;
time limits and stuck decodes are tests/inputs/test_decode_limits.py's.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import qwenvl_vision.batching as batching
from qwenvl_vision import load_encoder
from qwenvl_vision.batching import DECODE_BYTES_PER_PIXEL, BudgetClosed, DecodeBudget, Decoding, prepared_batches
from qwenvl_vision.errors import ConfigError
from qwenvl_vision.inputs.images import PreprocessConfig
from qwenvl_vision.inputs.pixels import FileBytes
from qwenvl_vision.inputs.video import VideoConfig
from qwenvl_vision.options import EncodeOptions
from tests.helpers import FAMILY_SMALL, QWEN2_5_SMALL, photo, synthetic_photo, write_video

WAIT = 5.0  # seconds a thread that should proceed is given; a thread that should wait is watched for 0.2 s
PRE = PreprocessConfig.from_dict(None, "qwen2_5_vl")


def _options(**changes) -> EncodeOptions:
    return EncodeOptions(video_config=VideoConfig.for_family("qwen2_5_vl"), **changes)


@pytest.fixture(scope="module", params=list(FAMILY_SMALL))
def encoder(request):
    return load_encoder(FAMILY_SMALL[request.param], random_weights=True, device="cpu")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Inputs of many sizes and kinds: a file, PIL images (one upscaled by min_pixels), numpy and torch arrays."""
    path = tmp_path_factory.mktemp("images") / "photo.jpg"
    Image.fromarray(photo(300, 256)).save(path)
    hopper = Image.fromarray(photo(600, 512))
    return {
        "photo.jpg": str(path),
        "small": hopper.resize((40, 47), Image.BICUBIC),
        "gray": hopper.convert("L").resize((333, 211)),
        "palette": hopper.convert("P", palette=Image.ADAPTIVE, colors=64).resize((256, 192)),
        "numpy": np.asarray(hopper.resize((200, 150))),
        "torch": torch.from_numpy(np.array(hopper.resize((150, 220)))).permute(2, 0, 1).contiguous(),
    }


# ---------------------------------------------------------------------- batches and their patch bound


def test_patch_budget_does_not_change_a_bit(encoder, images):
    """On the CPU each item of a batch runs as its own forward (``model.execution.forwards_on``): how inputs are batched
    changes no bit, on any CPU."""
    chosen = [images[n] for n in ("photo.jpg", "small", "gray", "numpy")]
    one_batch = encoder.encode_images(chosen, max_batch_patches=1 << 20)
    singles = encoder.encode_images(chosen, max_batch_patches=1)  # every item above budget runs alone
    for a, b in zip(one_batch.embeddings, singles.embeddings, strict=True):
        assert torch.equal(a, b)


def test_batches_respect_the_patch_budget(encoder, images):
    chosen = [images[n] for n in ("small", "gray", "numpy", "torch", "palette")]
    patches = [int(g.prod()) for g in encoder.encode_images(chosen).grid_thw]
    budget = max(patches) + min(patches)
    batches = list(encoder.iter_encode(chosen, max_batch_patches=budget))
    assert [r.index for b in batches for r in b] == list(range(len(chosen)))
    for batch in batches:
        assert len(batch) == 1 or sum(patches[r.index] for r in batch) <= budget
    assert len(batches) > 1


def test_prepared_batches_keep_input_order_and_carry_failures_with_the_next_batch():
    options = _options(max_batch_patches=200, num_workers=3)
    inputs = [synthetic_photo(112, 112, 0), np.zeros((0, 4, 3), np.uint8), synthetic_photo(140, 196, 1),
              synthetic_photo(56, 84, 2), "/nonexistent/x.png", synthetic_photo(224, 224, 3)]
    seen = []
    batches = list(prepared_batches(inputs, options, PRE, on_prepared=seen.append))
    assert [p.index for p in seen] == list(range(len(inputs)))  # every input reported once, in order
    assert {p.index for p in seen if p.error} == {1, 4}
    order = [p.index for batch, failed in batches for p in sorted(batch + failed, key=lambda p: p.index)]
    assert order == list(range(len(inputs)))
    for batch, failed in batches:
        assert all(p.error for p in failed) and not any(p.error for p in batch)
        assert len(batch) <= 1 or sum(p.patches for p in batch) <= options.max_batch_patches
        for p in batch:
            assert p.pixel_values.shape[0] == p.patches == int(np.prod(p.grid))
    assert "image 1" in seen[1].error and "x.png" in seen[4].error


# ---------------------------------------------------------------------- options


def test_options_are_frozen_and_refused_when_out_of_range():
    video_config = VideoConfig.for_family("qwen3_vl")
    options = EncodeOptions(video_config=video_config, prefetch=0)  # no prefetch is allowed
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.pooled = True  # type: ignore[misc]
    bad = [({"max_batch_patches": 0}, "max_batch_patches must be a positive integer, got 0"),
           ({"max_batch_patches": None}, "max_batch_patches .* got None"),
           ({"decode_bytes": 0}, "decode_bytes .* got 0"),
           ({"max_input_pixels": -1}, "max_input_pixels .* got -1"),
           ({"prefetch": -1}, "prefetch must be an integer of at least 0, got -1"),
           ({"max_item_tokens": "100"}, "max_item_tokens .* got '100'"),
           ({"max_item_tokens": 2.5}, "max_item_tokens .* got 2.5"),
           ({"max_item_tokens": True}, "max_item_tokens .* got True"),
           ({"min_pixels": 9000, "max_pixels": 4000}, "min_pixels 9000 is above max_pixels 4000"),
           ({"max_pixels": True}, "max_pixels must be a positive integer, got True"),
           ({"video_config": {"fps": 1}}, r"video_config must be a VideoConfig \(.*\), got dict")]
    for changes, message in bad:
        with pytest.raises(ConfigError, match=f"^{message}$"):
            EncodeOptions(**{"video_config": video_config, **changes})
    with pytest.raises(ConfigError, match="resize"):
        EncodeOptions(video_config=video_config, resize="bilinear")
    assert EncodeOptions(video_config=video_config, num_workers=0).workers == 1
    for option in ("max_batch_patches", "max_pixels"):
        given = getattr(EncodeOptions(video_config=video_config, **{option: np.int64(4096)}), option)
        assert given == 4096 and type(given) is int  # a NumPy integer is taken as the int it is
    with pytest.raises(ConfigError, match=r"^max_batch_patches .* got 4096\.0$"):
        EncodeOptions(video_config=video_config, max_batch_patches=4096.0)


# ---------------------------------------------------------------------- the decode budget


def _admit_in_thread(budget: DecodeBudget, ticket: int, cost: int):
    """Start budget.admit on a thread; returns (admitted event, outcome list)."""
    admitted, outcome = threading.Event(), []

    def run():
        try:
            outcome.append(budget.admit(ticket, Decoding(), cost))
        except BudgetClosed as e:
            outcome.append(e)
        admitted.set()

    threading.Thread(target=run, daemon=True).start()
    return admitted, outcome


def test_budget_admits_in_input_order_at_most_its_workers_at_once():
    budget = DecodeBudget(None, workers=1)  # no bound on bytes
    admitted, _ = _admit_in_thread(budget, 1, 0)
    assert not admitted.wait(0.2)  # input 1 waits for input 0
    first = Decoding()
    budget.admit(0, first, 1 << 60)
    assert not admitted.wait(0.2)  # its turn, but the one worker decodes input 0
    assert budget.end(first, 10) and not budget.end(first)  # whichever side ends a decode first, once
    assert admitted.wait(WAIT) and budget.used == 10


@pytest.mark.parametrize("first_cost,second_cost", [(60, 60), (10_000, 1)])
def test_budget_holds_a_later_input_until_bytes_are_freed(first_cost, second_cost):
    """60 + 60 do not fit in 100 until the first is decoded to 30; an input larger than the whole budget is
    admitted alone, and the next once it is given up (its bytes leave at once)."""
    budget = DecodeBudget(100, workers=4)
    first = Decoding()
    budget.admit(0, first, first_cost)
    admitted, _ = _admit_in_thread(budget, 1, second_cost)
    assert not admitted.wait(0.2)
    held = 30 if first_cost == 60 else 0
    budget.end(first, held)
    assert admitted.wait(WAIT) and budget.used == held + second_cost
    budget.release(held)
    assert budget.used == second_cost


def test_a_cost_charged_after_admission_holds_the_inputs_behind_it():
    """An object fetched after its admission is charged its decode once its header is read, without waiting (it
    holds its turn): a later input then waits for those bytes as for an admitted cost."""
    budget = DecodeBudget(100, workers=4)
    first = Decoding()
    budget.admit(0, first, 0)
    budget.charge(first, 60)
    admitted, _ = _admit_in_thread(budget, 1, 60)
    assert not admitted.wait(0.2)
    budget.end(first, 30)
    assert admitted.wait(WAIT) and budget.used == 90
    given_up = Decoding()
    budget.admit(2, given_up, 0)
    budget.end(given_up)  # the iterating side gave it up: a charge from its thread afterwards counts nothing
    budget.charge(given_up, 60)
    assert budget.used == 90


def test_closing_the_budget_wakes_its_waiters():
    budget = DecodeBudget(10, workers=4)
    budget.admit(0, Decoding(), 10)
    admitted, outcome = _admit_in_thread(budget, 1, 10)
    assert not admitted.wait(0.2)
    budget.close()
    assert admitted.wait(WAIT) and isinstance(outcome[0], BudgetClosed)
    with pytest.raises(BudgetClosed):
        budget.admit(1, Decoding(), 0)


def test_decode_budget_bounds_what_workers_hold_at_once(tmp_path, monkeypatch):
    """Four workers, a budget that fits one large image: large images are never decoded together."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    paths = []
    for i in range(8):  # large (1000x800) and small (100x80) images, interleaved
        side = (1000, 800) if i % 2 == 0 else (100, 80)
        path = folder / f"img{i}.png"
        Image.fromarray(synthetic_photo(side[1], side[0], i)).save(path)
        paths.append(str(path))
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    large_cost = 1000 * 800 * DECODE_BYTES_PER_PIXEL[encoder.preprocess_config.resize]
    in_flight, peak, lock = [0], [0], threading.Lock()
    real, meet = batching.preprocess_image, []

    def tracked(image, *args, on_header, **kwargs):
        big = [Image.open(image).size == (1000, 800)]

        def admitted(header):  # the budget admits the file once its header is read: from here on it decodes
            on_header(header)
            with lock:
                in_flight[0] += big[0]
                peak[0] = max(peak[0], in_flight[0])
            if big[0] and meet:  # unbounded: a large image waits for another, so that they do overlap
                meet[0].wait(60)
            else:
                time.sleep(0.05)  # a slow decode, so that overlaps would happen

        try:
            return real(image, *args, on_header=admitted, **kwargs)
        finally:
            with lock:
                in_flight[0] -= big[0]

    monkeypatch.setattr(batching, "preprocess_image", tracked)
    bounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4,
                                                  decode_bytes=large_cost + 1000) for r in batch]
    assert peak[0] == 1 and all(r.ok for r in bounded)
    peak[0] = 0
    meet.append(threading.Barrier(2))
    unbounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4, decode_bytes=None)
                 for r in batch]
    assert peak[0] > 1
    for a, b in zip(bounded, unbounded, strict=True):
        assert torch.equal(a.embedding, b.embedding)


def test_inputs_are_read_at_most_prefetch_ahead_and_come_in_input_order(monkeypatch):
    pulled, seen = [], []
    real = batching.preprocess_image

    def slow_first(image, *args, **kwargs):  # the first input finishes last
        time.sleep(0.2 if kwargs["index"] == 0 else 0)
        return real(image, *args, **kwargs)

    def items():
        for i in range(10):
            pulled.append(i)
            yield synthetic_photo(56, 56, i)

    monkeypatch.setattr(batching, "preprocess_image", slow_first)
    batches = prepared_batches(items(), _options(prefetch=2, num_workers=4), PRE,
                               on_prepared=lambda p: seen.append((p.index, len(pulled))))
    assert all(not failed for _, failed in batches)
    assert [index for index, _ in seen] == list(range(10))
    assert all(read <= index + 3 for index, read in seen)  # the input yielded, plus `prefetch` ahead


def test_what_is_ready_is_not_held_back_by_a_producer_that_waits_for_it(monkeypatch):
    """A producer that yields its next input only once it has the results so far (a request/response loop) gets
    them with prefetch=0, each once; a long stream of failures is yielded before it ends, with the inputs decoded
    among them."""
    got = threading.Event()

    def producer():
        yield synthetic_photo(56, 56, 0)
        assert got.wait(WAIT), "the first result was held back while the producer waited for it"
        yield synthetic_photo(56, 56, 1)

    seen = []
    for batch, failed in prepared_batches(producer(), _options(prefetch=0), PRE):
        got.set()
        seen += [p.index for p in batch + failed]
    assert seen == [0, 1]
    listed = [synthetic_photo(56, 56, i) for i in range(3)]  # a list waits for nothing: batched as ever
    assert [len(batch) for batch, _ in prepared_batches(listed, _options(prefetch=0), PRE)] == [3]
    pulled = []

    def failures():
        for i in range(3 * batching.FAILURES_HELD):
            pulled.append(i)
            yield np.zeros((0, 4, 3), np.uint8)

    batches = prepared_batches(failures(), _options(prefetch=2), PRE)
    batch, failed = next(batches)
    assert not batch and [p.index for p in failed] == list(range(batching.FAILURES_HELD))
    assert len(pulled) <= batching.FAILURES_HELD + 3
    batches.close()
    monkeypatch.setattr(batching, "FAILURES_HELD", 2)
    bad = np.zeros((0, 4, 3), np.uint8)
    mixed = [synthetic_photo(56, 56, 0), bad, bad, synthetic_photo(56, 56, 1)]
    assert sorted(p.index for batch, failed in prepared_batches(mixed, _options(), PRE) for p in batch + failed) == \
        [0, 1, 2, 3]


def test_a_failure_of_many_lines_is_recorded_by_its_first_and_the_file_named():
    def fetch(limit):
        raise OSError("connection reset\nby the store's second line")

    failed = [p for _, failures in prepared_batches([FileBytes("x.png", fetch=fetch)], _options(), PRE)
              for p in failures]
    assert [p.error for p in failed] == ["image 'x.png': OSError: connection reset"]
    url = "https://b.s3.amazonaws.com/a.png?X-Amz-Signature=SECRET"  # a store's message quoting the signed URL

    def forbidden(limit):
        raise OSError(f"403 Forbidden for url: {url}")

    odd = [FileBytes(url, fetch=forbidden), FileBytes("y.png", fetch=lambda limit: None)]
    failed = [p.error for _, failures in prepared_batches(odd, _options(), PRE) for p in failures]
    assert "SECRET" not in failed[0] and "403 Forbidden" in failed[0]
    assert failed[1] == "image 'y.png': TypeError: its fetch returned NoneType, not bytes"  # not "file is empty"
    with pytest.raises(TypeError, match="FileBytes: name .* got NoneType"):
        FileBytes(None, b"")


def test_an_object_fetched_from_storage_is_let_go_once_decoded():
    """Objects are fetched as their decodes start, and their bytes dropped once decoded: inputs decoded ahead of a
    slow consumer hold their pixels, not their files (a video's file may be as large as the decode budget)."""
    buffer = io.BytesIO()
    Image.fromarray(synthetic_photo(56, 56)).save(buffer, "PNG")
    limits = []
    files = [FileBytes(f"https://store/{i}.png", fetch=lambda limit: (limits.append(limit), buffer.getvalue())[1])
             for i in range(12)]
    held = []
    for batch, failed in prepared_batches(files, _options(max_batch_patches=1, num_workers=2, prefetch=8), PRE):
        assert len(batch) == 1 and not failed
        time.sleep(0.05)  # the decodes run ahead meanwhile
        held.append(sum(f.fetched for f in files))
    assert len(held) == len(files) and max(held) <= 2  # at most the objects being decoded
    files[0].read()  # fetched again after its release by a reader that gives no limit: the decode budget's
    assert limits[-1] == limits[0] == _options().decode_bytes


@pytest.mark.parametrize(("name", "frames", "options"), [
    ("clip.mp4", 24, dict(video=True)),
    ("clip.mkv", 24, dict(video=True, min_pixels=64 * 64, max_pixels=300 * 300)),  # no frame count: packets counted
    ("one.mp4", 1, dict(video=None, min_pixels=64 * 64, max_pixels=80 * 80)),  # shorter than T; image bounds only
])
def test_a_video_file_over_max_item_tokens_is_refused_from_its_header_before_a_frame_decodes(encoder, tmp_path,
                                                                                             monkeypatch, name,
                                                                                             frames, options):
    pytest.importorskip("av")
    path = tmp_path / name
    write_video(path, frames, 96, 64, 8)
    [free] = next(encoder.iter_encode([str(path)], **options))
    if options["video"] is None:  # among images, a video keeps its own pixel bounds
        assert torch.equal(free.embedding, encoder.encode_videos([str(path)]).embeddings[0])
    rows = free.embedding.shape[0]
    [exact] = next(encoder.iter_encode([str(path)], max_item_tokens=rows, **options))  # the header's count is exact
    assert exact.error is None and torch.equal(exact.embedding, free.embedding)
    read = []
    monkeypatch.setattr(batching, "preprocess_video_file", lambda *args, **kwargs: read.append(args))
    [refused] = next(encoder.iter_encode([str(path)], max_item_tokens=rows - 1, **options))
    assert refused.error.startswith(f"video {str(path)!r}: {rows:,} tokens, more than the bound of {rows - 1:,}")
    assert not read


# ---------------------------------------------------------------------- what a decode is charged


def test_a_file_is_opened_once_and_charged_by_its_header(tmp_path, monkeypatch):
    """The budget charges an image file its header's pixels at the resize backend's rate, from the header its own
    decode opens (one open per file); a video given as frames, its first frame's at the video pipeline's. Nothing
    is charged up front for inputs in memory, nor for files refused unread: missing, above max_input_pixels, or
    a FIFO (never opened: that would block)."""
    path, big = tmp_path / "a.png", tmp_path / "big.png"
    Image.fromarray(synthetic_photo(80, 100)).save(path)
    Image.fromarray(synthetic_photo(100, 100)).save(big)
    inputs = [str(path), synthetic_photo(80, 100), str(tmp_path / "missing.png"), str(big)]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.png")
        inputs.append(str(tmp_path / "pipe.png"))
    costs, opens = {}, []
    admit, open_image = DecodeBudget.admit, Image.open
    monkeypatch.setattr(DecodeBudget, "admit", lambda self, ticket, decoding, cost: (
        costs.setdefault(ticket, cost), admit(self, ticket, decoding, cost))[1])
    monkeypatch.setattr(Image, "open", lambda file, *args, **kwargs: (opens.append(file),
                                                                      open_image(file, *args, **kwargs))[1])
    prepared = [p for batch, failed in prepared_batches(inputs, _options(max_input_pixels=9000), PRE)
                for p in batch + failed]
    assert [p.error is None for p in prepared] == [True, True] + [False] * (len(inputs) - 2)
    assert costs == {0: 100 * 80 * DECODE_BYTES_PER_PIXEL["pil"], **{i: 0 for i in range(1, len(inputs))}}
    assert opens.count(str(path)) == 1 and str(tmp_path / "pipe.png") not in opens
    costs.clear()
    list(prepared_batches([[str(path), str(path)]], _options(video=True), PRE))
    assert costs == {0: 100 * 80 * DECODE_BYTES_PER_PIXEL["torch"]}  # one frame at a time
    charged, charge = [], DecodeBudget.charge  # an object in storage: admitted before its fetch, charged after
    monkeypatch.setattr(DecodeBudget, "charge", lambda self, decoding, cost: (
        charged.append(cost), charge(self, decoding, cost))[1])
    costs.clear()
    remote = FileBytes("https://store/a.png", fetch=lambda limit: path.read_bytes())
    assert all(not failed for _, failed in prepared_batches([remote], _options(), PRE))
    assert costs == {0: 0} and charged[0] == 100 * 80 * DECODE_BYTES_PER_PIXEL["pil"]


def test_one_lazily_opened_image_given_many_times_decodes_as_once(encoder, tmp_path):
    """PIL reads an opened file on first use, and not thread-safely: the same image object in several decode threads
    at once (an image given again, a frame of several videos) gave other pixels, or "image file is truncated". Each
    use must give the pixels of the image loaded."""
    Image.fromarray(photo(800, 600)).save(tmp_path / "big.jpg", quality=95)
    Image.fromarray(photo(400, 300)).save(tmp_path / "big.png")
    for name in ("big.jpg", "big.png"):
        with Image.open(tmp_path / name) as loaded:
            image = loaded.copy()
        for video, items in ((False, lambda one: [one] * 4), (True, lambda one: [[one, one]] * 4)):
            want = encoder.encode_videos([[image, image]]) if video else \
                encoder.encode_images([image], max_pixels=50176)
            for _ in range(3):
                results = [r for batch in encoder.iter_encode(items(Image.open(tmp_path / name)), video=video,
                                                              max_pixels=None if video else 50176, num_workers=4)
                           for r in batch]
                assert all(r.ok and torch.equal(r.embedding, want.embeddings[0]) for r in results), \
                    [r.error for r in results]
