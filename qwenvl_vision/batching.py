"""Decoding and batching: from a stream of inputs to token-bounded batches of pixel rows, in input order, under a
decode-memory budget (the call's settings are ``options.EncodeOptions``).

``preflight`` refuses bad inputs before any compute (``encode_images`` / ``encode_videos``). ``prepared_batches``
decodes and resizes each input on a thread of its own (``prepare``), at most ``prefetch`` ahead, and groups them
into batches of at most ``max_batch_patches`` patches; running the tower on a batch is the encoder's job. One
``DecodeBudget`` admits the inputs in input order, each once a worker is free and its estimated peak bytes fit:
an image file's read from the header its own decode opens (``decode_cost``), a video file's from its probe. An
object in storage is fetched within its decode time, so it is admitted before its size is known and charged once
its header is read, without waiting: the inputs behind it wait for those bytes (memory may exceed the budget by
what objects admitted before such a charge cost).

An input whose decode runs longer than ``decode_timeout`` seconds from its admission (or from the start of the header
read that asks for it: a stuck file system) is recorded as failed and the run goes on: its bytes, its worker and its
turn leave the budget at once, so a decode stuck in C code stalls none of the inputs behind it (memory may exceed the
budget by what stuck decodes hold). Threads cannot be killed, so each
decode runs on a daemon thread that nothing joins: neither the end of an iteration, Ctrl-C nor the interpreter's
exit waits for one. A video's frame loop stops at its next frame once its input is given up; an image decode runs
to its end in the background.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
import torch

from .errors import PreprocessError, first_line
from .inputs.images import PreprocessConfig, preprocess_image, probe_image
from .inputs.item_ids import pixels_sha256
from .inputs.pixels import FileBytes, input_name, is_file_input, open_header
from .inputs.urls import redacted_text
from .inputs.video import (
    VideoConfig,
    checked_frames,
    preprocess_video,
    preprocess_video_file,
    sample_indices,
    video_target_size,
)
from .inputs.video_io import VideoInfo, is_video_file, probe_video
from .options import EncodeOptions

# Peak bytes per header pixel while a file is decoded, converted to RGB and resized, by resize backend: the most
# any image mode holds (the RSS high-water mark, measured per mode in docs/embed.md), rounded up.
DECODE_BYTES_PER_PIXEL = {"pil": 9, "torch": 21, "vllm": 21}
# The longest the iterating thread blocks in one wait, so that Ctrl-C (handled between waits) is prompt.
WAIT_SLICE = 0.25
# The most failed inputs held for the next batch: then they go with the batch so far (an embed's shard of them).
FAILURES_HELD = 1024


@dataclass
class Prepared:
    """One input decoded and resized (or the error that stopped it), waiting for its batch."""

    index: int
    name: str
    pixel_values: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    error: str | None = None
    patches: int = 0  # pixel rows, not embedding rows
    held: int = 0  # bytes of the decode budget this input holds until it joins a batch
    video_info: VideoInfo | None = None
    pixels_sha256: str | None = None  # item_ids.pixels_sha256, hashed here on the decode thread


def preflight(items: list[Any], options: EncodeOptions, pre: PreprocessConfig) -> None:
    """Reject unreadable or oversized files, zero-size arrays and extreme aspect ratios before any compute (bytes not
    fetched yet are checked when their decode fetches them)."""
    video, min_pixels, max_pixels = options.video, options.min_pixels, options.max_pixels
    for i, item in enumerate(items):
        first, name = item, None
        if isinstance(item, FileBytes) and not item.fetched:  # fetched within the decode budget, checked there
            continue
        if video and is_file_input(item):
            name = input_name("video", i, item)
            video_file_plan(probe_video(item, name, options.max_input_pixels), pre, options.video_config, min_pixels,
                            max_pixels, name, (options.resize or pre.resize) == "vllm")
            continue
        if video:
            first = checked_frames(item, input_name("video", i))[0]
            name = input_name(f"{input_name('video', i)} frame", 0, first)  # as preprocess_video names it
        probe_image(first, pre, index=i, min_pixels=min_pixels, max_pixels=max_pixels,
                    max_input_pixels=options.max_input_pixels, name=name)


@dataclass(eq=False)
class Decoding:
    """One input's decode as its thread and the iterating thread share it; changed under the budget's lock."""

    stop: threading.Event = field(default_factory=threading.Event)  # ends a video's frame loop
    started: float | None = None  # time.monotonic() at admission
    reading: float | None = None  # time.monotonic() its thread began, until it asks for admission (module docstring)
    held: int = 0  # decode budget bytes
    over: bool = False  # ended, or given up by the iterating side: it holds no worker any more


class BudgetClosed(Exception):
    """The iteration that owned a decode budget stopped; inputs still waiting for it are dropped."""


class DecodeBudget:
    """Bytes and workers that inputs being decoded, or decoded and waiting for their batch (bytes only), hold.

    Admission is in input order (input i waits until inputs 0..i-1 were admitted): a small later input never
    overtakes a large earlier one, so whatever holds bytes is consumed before the waiter and every wait ends. An
    input costing more than the whole budget is admitted when nothing else holds any. capacity None: no bound on
    bytes (inputs are still admitted in order, at most ``workers`` decoding at once).
    """

    def __init__(self, capacity: int | None, workers: int) -> None:
        self.capacity, self.workers = capacity, workers
        self.used = self._busy = self._next = 0
        self._closed = False
        self._cond = threading.Condition()

    def admit(self, ticket: int, decoding: Decoding, cost: int) -> None:
        """Wait until input ``ticket`` is next, a worker is free and ``cost`` bytes fit; ``decoding`` then holds
        them."""
        with self._cond:
            decoding.reading = None
            while not (self._closed or decoding.over) and (ticket != self._next or self._busy >= self.workers or not (
                    self.capacity is None or self.used == 0 or self.used + cost <= self.capacity)):
                self._cond.wait()
            if self._closed or decoding.over:  # the iteration stopped, or gave this input up before its admission
                raise BudgetClosed
            self._next += 1
            self._busy += 1
            self.used += cost
            decoding.held, decoding.started = cost, time.monotonic()
            self._cond.notify_all()

    def end(self, decoding: Decoding, now: int = 0) -> bool:
        """A decode ends, its input now holding ``now`` bytes; the iterating side gives it up with 0 (one not admitted
        yet, its header read stuck: its turn passes).
        False when the other side came first (given up: nobody takes its result; ended: take it).

        A given-up input's bytes leave the budget at once, though its thread may hold them until it ends: counted,
        a decode that never returns would keep every input behind it from being admitted."""
        with self._cond:
            if decoding.over:
                return False
            decoding.over = True
            if decoding.started is None:  # given up before its admission (its header read hung): its turn passes
                self._next += 1
            else:
                self._busy -= 1
                self.used += now - decoding.held
                decoding.held = now
            self._cond.notify_all()
        return True

    def charge(self, decoding: Decoding, cost: int) -> None:
        """An admitted decode's ``cost`` bytes more, never waited for: the inputs behind it wait for them instead."""
        with self._cond:
            if not decoding.over:
                self.used += cost
                decoding.held += cost

    def release(self, held: int) -> None:
        """A decoded input joined its batch: its ``held`` bytes are counted by the batch's token bound instead."""
        with self._cond:
            self.used -= held
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def is_video(item: Any, options: EncodeOptions) -> bool:
    return is_video_file(item) if options.video is None else options.video


def prepare(item: Any, index: int, options: EncodeOptions, pre: PreprocessConfig, budget: DecodeBudget,
            decoding: Decoding) -> Prepared | None:
    """Decode and resize one input on its thread, admitted by the budget in input order; None when the iterating
    side gave it up first (nobody takes its result)."""
    decoding.reading = time.monotonic()
    name = input_name("video" if is_video(item, options) else "image", index, item)

    def admit(cost: int) -> None:
        if decoding.started is None:
            budget.admit(index, decoding, cost)
        else:  # fetched after its admission (see decode): its cost counted, not waited for, as it holds its turn
            budget.charge(decoding, cost)

    error = None
    try:
        pixel_values, grid, info = decode(item, index, options, pre, budget.capacity, admit, decoding.stop)
    except BudgetClosed:
        raise
    except PreprocessError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a batch job records any per-input failure and goes on
        error = redacted_text(f"{name}: {first_line(e)}")  # a fetch's message may quote its signed URL
    if isinstance(item, FileBytes):
        item.release()
    if error is None:  # its forward's time and memory
        error = over_bound(name, math.prod(grid) // pre.merge_size ** 2, options.max_item_tokens)
    admit(0)  # refused before its cost was known, it still takes its turn: the inputs behind it wait for that
    if error is not None:
        budget.end(decoding)
        return Prepared(index, name, error=error)
    digest = pixels_sha256(pixel_values) if options.hash_pixels else None
    held = pixel_values.element_size() * pixel_values.nelement()  # its resized pixels now, not its decode peak
    if not budget.end(decoding, held):
        return None
    return Prepared(index, name, pixel_values, tuple(grid), patches=math.prod(grid), held=held, video_info=info,
                    pixels_sha256=digest)


def decode(item: Any, index: int, options: EncodeOptions, pre: PreprocessConfig, limit: int | None,
           admit: Callable[[int], None], stop: threading.Event) -> tuple[torch.Tensor, Any, VideoInfo | None]:
    """(pixel values, grid, video info) of one input, ``admit(cost)`` called once its decode cost is known and
    before its pixels are decoded (an object in storage: also with 0 before its fetch); ``limit``: the most bytes
    a file's body fetched here may have."""
    video = is_video(item, options)
    min_pixels, max_pixels = options.min_pixels, options.max_pixels
    if options.video is None and video:  # mixed: the pixel bounds given are the images'; videos keep their own
        min_pixels = max_pixels = None
    sizes = dict(min_pixels=min_pixels, max_pixels=max_pixels, index=index, max_input_pixels=options.max_input_pixels)
    if isinstance(item, FileBytes) and not item.fetched:
        admit(0)
        item.read(limit)
    backend = options.resize or pre.resize
    if not video:
        if not is_file_input(item):
            admit(0)
        # `resize` chooses between transformers' two image processors; its video processors have one pipeline.
        return *preprocess_image(item, pre, resize=options.resize, **sizes,
                                 on_header=lambda image: admit(decode_cost(image, backend))), None
    if not is_file_input(item):
        admit(first_frame_cost(item, options.max_input_pixels))
        return *preprocess_video(item, pre, video_config=options.video_config, **sizes), None
    try:  # a video file's header is read once: for its token count, its decode estimate, and the read's frame count
        header = probe_video(item, max_input_pixels=options.max_input_pixels)
        plan = video_file_plan(header, pre, options.video_config, min_pixels, max_pixels, as_vllm=backend == "vllm")
    except Exception:  # noqa: BLE001 - preprocessing names the problem
        header = plan = None
    if plan:  # a long video refused before its frames are decoded
        frames, height, width = plan
        tokens = -(-frames // pre.temporal_patch_size) * height * width // pre.factor ** 2
        if error := over_bound(input_name("video", index, item), tokens, options.max_item_tokens):
            raise PreprocessError(error)
    admit(video_file_cost(header, plan, pre) if plan else 0)
    return preprocess_video_file(item, pre, options.video_config, counted=header[0] if header else None, stop=stop,
                                 as_vllm=backend == "vllm", **sizes)


def prepared_batches(items: Iterable[Any], options: EncodeOptions, pre: PreprocessConfig, *,
                     on_prepared: Callable[[Prepared], None] | None = None
                     ) -> Iterator[tuple[list[Prepared], list[Prepared]]]:
    """(batch, failed) in input order: the inputs of one tower call (at most ``max_batch_patches`` patches, or one
    larger input; none when only failures are ready) and the inputs that failed since the previous batch (at most
    ``FAILURES_HELD``). With ``prefetch=0`` and inputs that are no sequence, what is ready is yielded before each
    input is pulled, so a producer that waits for the results so far gets them. ``on_prepared`` sees every input, on the
    iterating thread, as soon as it is ready (or has failed). Close the iterator when stopping early: that wakes
    the decodes waiting for budget and stops the videos' frame loops; none is waited for."""
    budget = DecodeBudget(options.decode_bytes, options.workers)
    pending: deque[tuple[Future, Decoding, Any, int]] = deque()
    lazy = options.prefetch == 0 and not isinstance(items, Sequence)  # a list is no producer that waits

    def run(future: Future, *args: Any) -> None:
        try:
            future.set_result(prepare(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the future
            future.set_exception(e)

    def collect() -> Prepared:
        future, decoding, item, index = pending[0]  # taken off once done: stopping early still sees it in flight
        limit = options.decode_timeout
        while True:
            try:
                prepared = future.result(timeout=WAIT_SLICE)
                break
            except FutureTimeout:  # the builtin TimeoutError only from Python 3.11
                started = decoding.started or decoding.reading  # None: waiting for the budget, not decoding
                if limit is not None and started is not None and time.monotonic() - started >= limit and \
                        budget.end(decoding):
                    decoding.stop.set()
                    name = input_name("video" if is_video(item, options) else "image", index, item)
                    prepared = Prepared(index, name, error=f"{name}: not decoded within {limit:g} s (the decode time "
                                        "limit: embed --decode-timeout, decode_timeout); left out, a larger limit lets "
                                        "it finish")
                    break
        pending.popleft()
        return prepared

    def prefetched() -> Iterator[Prepared | None]:
        for index, item in enumerate(items):
            decoding, future = Decoding(), Future()
            threading.Thread(target=run, args=(future, item, index, options, pre, budget, decoding),
                             name=f"qwenvl-decode-{index}", daemon=True).start()
            pending.append((future, decoding, item, index))
            if len(pending) > options.prefetch:
                yield collect()
            if lazy:  # before the next input is pulled: its producer may wait for the results so far
                yield None
        while pending:
            yield collect()

    try:
        batch: list[Prepared] = []
        failed: list[Prepared] = []
        for prepared in prefetched():
            if prepared is None:  # nothing in flight: what is ready goes now
                if batch or failed:
                    yield batch, failed
                batch, failed = [], []
                continue
            if on_prepared is not None:
                on_prepared(prepared)
            if prepared.error is not None:
                failed.append(prepared)
                if len(failed) >= FAILURES_HELD:  # a long run of failures is not held back (nor kept) until its end
                    yield batch, failed
                    batch, failed = [], []
                continue
            if batch and sum(p.patches for p in batch) + prepared.patches > options.max_batch_patches:
                yield batch, failed
                batch, failed = [], []
            batch.append(prepared)
            budget.release(prepared.held)  # now counted by the batch's token bound instead
        if batch or failed:
            yield batch, failed
    finally:
        # Stopped early (an error, Ctrl-C, or the caller left the loop): wake the decodes waiting for budget (they
        # end there) and stop the videos' frame loops in flight; none is waited for.
        budget.close()
        for _, decoding, _, _ in pending:
            decoding.stop.set()


def decode_cost(image: PIL.Image.Image, backend: str) -> int:
    """Estimated peak bytes of decoding the opened file ``image`` (its header read) with the ``backend`` resize."""
    return image.width * image.height * DECODE_BYTES_PER_PIXEL[backend]


def first_frame_cost(frames: Any, max_input_pixels: int | None) -> int:
    """Frames given as a list are decoded one at a time: the first one's cost where it is a file whose header
    reads (else 0: in memory, or refused unread by preprocessing, which names the problem)."""
    first = frames[0] if isinstance(frames, (list, tuple)) and frames else None
    if not is_file_input(first) or isinstance(first, FileBytes) and not first.fetched:
        return 0
    try:
        with open_header(first, "", max_input_pixels, check_aspect=False) as image:
            return decode_cost(image, "torch")
    except Exception:  # noqa: BLE001 - this is only an estimate
        return 0


def over_bound(name: str, tokens: int, bound: int | None) -> str | None:
    """The error of an input of ``tokens`` embedding rows over ``max_item_tokens``, or None."""
    if bound is not None and tokens > bound:
        return f"{name}: {tokens:,} tokens, more than the bound of {bound:,} (max_item_tokens, --max-item-tokens)"
    return None


def video_file_plan(header: tuple[int, float, int, int], pre: PreprocessConfig, video_config: VideoConfig,
                    min_pixels: int | None, max_pixels: int | None, name: str = "video", as_vllm: bool = False
                    ) -> tuple[int, int, int]:
    """(frames sampled, height and width each is resized to) as preprocessing will read a video file of this header
    (``probe_video``'s; ``as_vllm``: ``preprocess_video_file``'s, a quarter-turned file's height and width
    swapped, which changes no count), or the PreprocessError naming ``name`` that preprocessing will raise. Only an
    edit list hiding frames the header counts, or a first frame of another size than the header's, makes the read
    differ."""
    total, rate, height, width = header
    frames = len(sample_indices(total, rate, video_config, pre.temporal_patch_size, as_vllm))
    return frames, *video_target_size(frames, height, width, pre, video_config, min_pixels, max_pixels, name)


def video_file_cost(header: tuple[int, float, int, int], plan: tuple[int, int, int], pre: PreprocessConfig) -> int:
    """Estimated peak bytes of reading a video file: its sampled frames resized (3 bytes a pixel, each resized as
    it is decoded) and its float32 output (12 bytes a pixel of every padded frame), beside one decoded source
    frame and its conversions (an image's rate)."""
    frames, height, width = plan
    target = height * width
    padded = -(-frames // pre.temporal_patch_size) * pre.temporal_patch_size
    return frames * target * 3 + padded * target * 12 + header[2] * header[3] * DECODE_BYTES_PER_PIXEL["pil"]
