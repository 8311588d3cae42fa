"""How inputs become batches (qwenvl_vision.batching): the call's options, the token bound of a batch, the decode
budget (admission in input order, an oversized input alone, waiters woken on close), ordered prefetch and the
decode-cost estimates. End-to-end parity with transformers is tests/test_encoder.py's.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import qwenvl_vision.batching as batching
from qwenvl_vision import load_encoder
from qwenvl_vision.batching import (
    DECODE_BYTES_PER_PIXEL,
    BudgetClosed,
    DecodeBudget,
    decode_cost,
    ordered_prefetch,
    prepared_batches,
)
from qwenvl_vision.errors import ConfigError
from qwenvl_vision.inputs.images import PreprocessConfig
from qwenvl_vision.inputs.video import VideoConfig
from qwenvl_vision.options import EncodeOptions
from tests.helpers import FAMILY_SMALL, QWEN2_5_SMALL, photo, synthetic_photo

WAIT = 5.0  # seconds a thread that should proceed is given; a thread that should wait is watched for 0.2 s


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
    pre = PreprocessConfig.from_dict(None, "qwen2_5_vl")
    options = EncodeOptions(video_config=VideoConfig.for_family("qwen2_5_vl"), max_batch_patches=200, num_workers=3)
    inputs = [synthetic_photo(112, 112, 0), np.zeros((0, 4, 3), np.uint8), synthetic_photo(140, 196, 1),
              synthetic_photo(56, 84, 2), "/nonexistent/x.png", synthetic_photo(224, 224, 3)]
    seen = []
    batches = list(prepared_batches(inputs, options, pre, on_prepared=seen.append))
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
           ({"max_batch_patches": None}, "max_batch_patches must be a positive integer, got None"),
           ({"decode_bytes": 0}, "decode_bytes must be positive, got 0"),
           ({"max_input_pixels": -1}, "max_input_pixels must be positive, got -1"),
           ({"prefetch": -1}, "prefetch must be positive, got -1"),
           ({"min_pixels": 9000, "max_pixels": 4000}, "min_pixels 9000 is above max_pixels 4000"),
           ({"max_pixels": True}, "max_pixels must be a positive integer, got True")]
    for changes, message in bad:
        with pytest.raises(ConfigError, match=f"^{message}$"):
            EncodeOptions(video_config=video_config, **changes)
    with pytest.raises(ConfigError, match="resize"):
        EncodeOptions(video_config=video_config, resize="bilinear")
    assert EncodeOptions(video_config=video_config, num_workers=0).workers == 1
    given = EncodeOptions(video_config=video_config, max_batch_patches=np.int64(4096)).max_batch_patches
    assert given == 4096 and type(given) is int  # a NumPy integer is taken as the int it is
    with pytest.raises(ConfigError, match=r"^max_batch_patches must be a positive integer, got 4096\.0$"):
        EncodeOptions(video_config=video_config, max_batch_patches=4096.0)


# ---------------------------------------------------------------------- the decode budget


def _admit_in_thread(budget: DecodeBudget, ticket: int, cost: int):
    """Start budget.admit on a thread; returns (admitted event, outcome list)."""
    admitted, outcome = threading.Event(), []

    def run():
        try:
            outcome.append(budget.admit(ticket, cost))
        except BudgetClosed as e:
            outcome.append(e)
        admitted.set()

    threading.Thread(target=run, daemon=True).start()
    return admitted, outcome


def test_budget_admits_in_input_order():
    budget = DecodeBudget(1000)
    admitted, outcome = _admit_in_thread(budget, 1, 10)
    assert not admitted.wait(0.2)  # input 1 waits for input 0 although it fits
    assert budget.admit(0, 10) == 10
    assert admitted.wait(WAIT) and outcome == [10] and budget.used == 20


def test_budget_holds_a_later_input_until_bytes_are_released():
    budget = DecodeBudget(100)
    held = budget.admit(0, 60)
    admitted, _ = _admit_in_thread(budget, 1, 60)
    assert not admitted.wait(0.2)
    held = budget.resize(held, 30)  # decoded: now only its resized pixels, and 30 + 60 fits
    assert admitted.wait(WAIT) and budget.used == 90
    budget.release(held)
    assert budget.used == 60


def test_an_input_larger_than_the_budget_is_admitted_alone():
    budget = DecodeBudget(100)
    assert budget.admit(0, 10_000) == 10_000  # nothing else holds bytes: it goes in
    admitted, _ = _admit_in_thread(budget, 1, 1)
    assert not admitted.wait(0.2)
    budget.release(10_000)
    assert admitted.wait(WAIT)
    assert DecodeBudget(None).admit(0, 1 << 60) == 1 << 60  # no bound


def test_closing_the_budget_wakes_its_waiters():
    budget = DecodeBudget(10)
    budget.admit(0, 10)
    admitted, outcome = _admit_in_thread(budget, 1, 10)
    assert not admitted.wait(0.2)
    budget.close()
    assert admitted.wait(WAIT) and isinstance(outcome[0], BudgetClosed)
    with pytest.raises(BudgetClosed):
        budget.admit(1, 0)


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
    large_cost = 1000 * 800 * DECODE_BYTES_PER_PIXEL
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = batching.preprocess_image

    def tracked(image, *args, **kwargs):
        big = Image.open(image).size == (1000, 800)
        with lock:
            in_flight[0] += big
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.05)  # a slow decode, so that overlaps would happen
            return real(image, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= big

    monkeypatch.setattr(batching, "preprocess_image", tracked)
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    bounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4,
                                                  decode_bytes=large_cost + 1000) for r in batch]
    assert peak[0] == 1 and all(r.ok for r in bounded)
    peak[0] = 0
    unbounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4, decode_bytes=None)
                 for r in batch]
    assert peak[0] > 1  # the check can fail: without the budget, large images do overlap
    for a, b in zip(bounded, unbounded, strict=True):
        assert torch.equal(a.embedding, b.embedding)


# ---------------------------------------------------------------------- ordered prefetch


def test_ordered_prefetch_yields_in_input_order_and_reads_at_most_depth_ahead():
    from concurrent.futures import ThreadPoolExecutor

    pulled = []

    def items():
        for i in range(10):
            pulled.append(i)
            yield i

    def slow_first(item, index):  # the first input finishes last
        time.sleep(0.2 if index == 0 else 0)
        return item * 10

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = ordered_prefetch(pool, items(), 2, slow_first)
        assert next(results) == 0
        assert len(pulled) == 3  # the first plus `depth` ahead
        assert list(results) == [10 * i for i in range(1, 10)]


# ---------------------------------------------------------------------- decode cost estimates


def test_decode_cost_reads_the_header_of_files_only(tmp_path):
    path = tmp_path / "a.png"
    Image.fromarray(synthetic_photo(80, 100)).save(path)
    assert decode_cost(str(path), False, None) == 100 * 80 * DECODE_BYTES_PER_PIXEL
    assert decode_cost([str(path), str(path)], True, None) == 100 * 80 * DECODE_BYTES_PER_PIXEL  # one frame at a time
    assert decode_cost(str(path), False, 7999) == 0  # refused unread by preprocessing
    assert decode_cost(synthetic_photo(80, 100), False, None) == 0  # already in memory
    assert decode_cost(str(tmp_path / "missing.png"), False, None) == 0
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "pipe.png"
        os.mkfifo(fifo)
        assert decode_cost(str(fifo), False, None) == 0  # never opened: that would block
