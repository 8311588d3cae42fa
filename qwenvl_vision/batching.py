"""Decoding and batching: from a stream of inputs to token-bounded batches of pixel rows, in input order, under a
decode-memory budget (the call's settings are ``options.EncodeOptions``).

``preflight`` refuses bad inputs
before any compute (``encode_images`` / ``encode_videos``); ``prepared_batches`` decodes and resizes inputs on
worker threads (``prepare``), at most ``prefetch`` ahead (``ordered_prefetch``), each admitted in input order by
one byte budget (``DecodeBudget``) sized from its file header (``decode_cost`` / ``video_file_cost``), and groups
them into batches of at most ``max_batch_patches`` patches. Running the tower on a batch is the encoder's job.

An input whose decode runs longer than ``decode_timeout`` seconds is recorded as failed and the run goes on.
Threads cannot be killed, so the decode threads are daemon threads that nothing joins (``DecodePool``): a decode
stuck in C code holds neither the end of an iteration, Ctrl-C, nor the interpreter's exit. A video's frame loop
stops at its next frame once its input is given up; an image decode runs to its end in the background. A given-up
input's bytes leave the decode budget at once and a new thread takes its worker's place, so neither the budget nor
the threads stall the inputs behind it (memory may exceed the budget by what the stuck decodes hold).
"""

from __future__ import annotations

import math
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
import torch

from .errors import PreprocessError, QwenVLVisionError
from .inputs.images import PreprocessConfig, preprocess_image, probe_image
from .inputs.item_ids import pixels_sha256
from .inputs.pixels import FileBytes, input_name, is_file_input, open_header
from .inputs.video import VideoConfig, preprocess_video, preprocess_video_file, sample_indices, video_target_size
from .inputs.video_io import VideoInfo, is_video_file, probe_video
from .options import EncodeOptions

# The decode budget's capacity while this thread decodes an input under it: the most bytes of a file's body that
# may be held in memory (an object fetched as it is decoded, ``embed.remote.fetch``, is refused above it).
DECODE_LIMIT: ContextVar[int | None] = ContextVar("DECODE_LIMIT", default=None)
# Peak bytes per header pixel while a file is decoded, converted to RGB and resized (``preprocess_image``),
# measured as the RSS high-water mark above the process's baseline, one 16 MP file at a time, by mode: with the
# PIL resize ~4.3 for RGB (Pillow holds RGB as 4 bytes a pixel), 5.0 for L, P (with or without a transparent
# index), 1; 6.0 for I;16; 8.0 where a second full image exists for a moment: an EXIF-rotated photo (the
# transpose), CMYK, RGBA, LA (the RGB conversion). Rounded up.
DECODE_BYTES_PER_PIXEL = 9
# The same with the torch resize, which holds the pixels three more times (numpy's RGB copy, its CHW copy,
# the resize kernel's 4-byte unpacked input): 14.7 for 8-bit modes, 17.3 for 16-bit ones (16.8 for a 9 MP
# palette file: smaller files round up to more per pixel). Rounded up.
TORCH_DECODE_BYTES_PER_PIXEL = 18
TORCH_WIDE_DECODE_BYTES_PER_PIXEL = 21
_WIDE_MODES = ("I", "F")  # I, I;16 and its variants, F: 2 or 4 bytes a sample
# The longest the iterating thread blocks in one wait, so that Ctrl-C (handled between waits) is prompt.
_WAIT_SLICE = 0.25


@dataclass
class Prepared:
    """One input decoded and resized (or the error that stopped it), waiting for its batch."""

    index: int
    name: str
    pixel_values: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    error: str | None = None
    patches: int = field(default=0)  # pixel rows, not embedding rows
    held: int = 0  # bytes of the decode budget this input holds until it joins a batch
    video_info: VideoInfo | None = None
    pixels_sha256: str | None = None  # item_ids.pixels_sha256, hashed here on the worker thread


def preflight(items: list[Any], options: EncodeOptions, pre: PreprocessConfig) -> None:
    """Reject unreadable or oversized files, zero-size arrays and extreme aspect ratios before any compute."""
    video, min_pixels, max_pixels = options.video, options.min_pixels, options.max_pixels
    for i, item in enumerate(items):
        first, name = item, None
        if video and is_file_input(item):
            total, rate, height, width = probe_video(item, input_name("video", i, item), options.max_input_pixels)
            count = len(sample_indices(total, rate, options.video_config, pre.temporal_patch_size))
            video_target_size(count, height, width, pre, options.video_config, min_pixels, max_pixels,
                              input_name("video", i, item))
            continue
        if video:
            if isinstance(item, torch.Tensor) or hasattr(item, "shape"):
                if len(item) == 0:
                    raise PreprocessError(f"{input_name('video', i)}: no frames")
                first = item[0]
            else:
                frames = list(item)
                if not frames:
                    raise PreprocessError(f"{input_name('video', i)}: no frames")
                first = frames[0]
            name = input_name(f"{input_name('video', i)} frame", 0, first)  # as preprocess_video names it
        probe_image(first, pre, index=i, min_pixels=min_pixels, max_pixels=max_pixels,
                    max_input_pixels=options.max_input_pixels, name=name)


@dataclass(eq=False)
class Decoding:
    """One input's decode as its worker and the iterating thread share it: when the decode budget admitted it, the
    budget bytes it holds, the event that stops its frame loop, and which side let go first (``finish`` /
    ``abandon``). The bytes move with the input: the worker changes them only while the input is not given up."""

    stop: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # time.monotonic() at admission
    held: int = 0  # decode budget bytes
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _finished: bool = False
    _abandoned: bool = False

    def admitted(self, held: int) -> None:
        with self._lock:
            self.held, self.started = held, time.monotonic()

    def hold(self, budget: DecodeBudget, now: int) -> int:
        """The input now holds ``now`` bytes (0: none); a given-up input's bytes were released already."""
        with self._lock:
            if not self._abandoned:
                budget.resize(self.held, now)
                self.held = now
        return now

    def finish(self) -> bool:
        """The worker is done: False when the iterating side gave up on it first (nobody takes its result)."""
        with self._lock:
            self._finished = True
            return not self._abandoned

    def abandon(self, budget: DecodeBudget) -> bool:
        """The iterating side gives up on the input: False when its worker finished first (take its result).

        Its bytes leave the budget at once, though its worker may hold them until it ends: counted, a decode that
        never returns would keep every input behind it from being admitted, and the run would stall on it."""
        with self._lock:
            if self._finished:
                return False
            self._abandoned = True
            budget.release(self.held)
            self.held = 0
        self.stop.set()
        return True


def input_kind(item: Any, options: EncodeOptions) -> tuple[bool, str]:
    """(whether ``item`` is read as a video, how errors name input ``index`` of that kind: its ``input_name`` kind)."""
    video = is_video_file(item) if options.video is None else options.video
    return video, "video" if video else "image"


def prepare(item: Any, index: int, options: EncodeOptions, pre: PreprocessConfig, budget: DecodeBudget,
            decoding: Decoding | None = None) -> Prepared:
    """Decode and resize one input on a worker thread, admitted by the decode budget in input order.

    ``decoding``: shared with the thread waiting for the result; a video's frame loop stops once it is
    abandoned, and the budget a result holds is released here when nobody will take it."""
    decoding = decoding or Decoding()
    limit = DECODE_LIMIT.set(budget.capacity)
    try:
        prepared = _prepare(item, index, options, pre, budget, decoding)
    finally:
        DECODE_LIMIT.reset(limit)
    decoding.finish()
    return prepared


def _prepare(item: Any, index: int, options: EncodeOptions, pre: PreprocessConfig, budget: DecodeBudget,
             decoding: Decoding) -> Prepared:
    video, kind = input_kind(item, options)
    min_pixels, max_pixels = options.min_pixels, options.max_pixels
    if options.video is None and video:  # mixed: the pixel bounds given are the images'; videos keep their own
        min_pixels = max_pixels = None
    name = input_name(kind, index, item)
    is_file = is_file_input(item)
    # Bytes still to be fetched (an object in storage) are fetched inside the decode's time limit, so they are
    # not read for an estimate before it: they cost nothing up front, like inputs already in memory.
    estimate = is_file and not (isinstance(item, FileBytes) and not item.fetched)
    # A video file's header is read once: for its decode estimate, and its frame count for the read itself.
    header = probe_quietly(item, options.max_input_pixels) if video and estimate else None
    if is_file and not estimate:
        cost = 0
    elif header:
        cost = video_file_cost(header, pre, options.video_config)
    else:
        cost = decode_cost(item, video, options.max_input_pixels, "torch" if video else options.resize or pre.resize)
    decoding.admitted(budget.admit(index, cost))
    info = None
    sizes = dict(min_pixels=min_pixels, max_pixels=max_pixels, index=index, max_input_pixels=options.max_input_pixels)
    try:
        if not video:
            # `resize` chooses between transformers' two image processors; its video processors have one pipeline.
            pixel_values, grid = preprocess_image(item, pre, resize=options.resize, **sizes)
        elif is_file:
            pixel_values, grid, info = preprocess_video_file(item, pre, options.video_config,
                                                             counted=header[0] if header else None,
                                                             stop=decoding.stop, **sizes)
        else:
            pixel_values, grid = preprocess_video(item, pre, video_config=options.video_config, **sizes)
    except PreprocessError as e:
        decoding.hold(budget, 0)
        return Prepared(index, name, error=str(e))
    except Exception as e:  # noqa: BLE001 - a batch job records any per-input failure and goes on
        decoding.hold(budget, 0)
        return Prepared(index, name, error=f"{name}: {type(e).__name__}: {e}")
    digest = pixels_sha256(pixel_values) if options.hash_pixels else None
    # From here on the input holds its resized pixels, not its decode peak.
    held = decoding.hold(budget, pixel_values.element_size() * pixel_values.nelement())
    return Prepared(index, name, pixel_values, tuple(grid), patches=math.prod(grid), held=held, video_info=info,
                    pixels_sha256=digest)


def prepared_batches(items: Iterable[Any], options: EncodeOptions, pre: PreprocessConfig, *,
                     on_prepared: Callable[[Prepared], None] | None = None
                     ) -> Iterator[tuple[list[Prepared], list[Prepared]]]:
    """(batch, failed) in input order: the inputs of one tower call (at most ``max_batch_patches`` patches, or one
    larger input) and the inputs that failed since the previous batch. ``on_prepared`` sees every input, on the
    iterating thread, as soon as it is ready (or has failed). Close the iterator when stopping early: that wakes
    the workers waiting for budget and drops the inputs not started."""
    budget = DecodeBudget(options.decode_bytes)
    decodings: dict[int, Decoding] = {}  # per input in flight; either thread may create its entry first

    def decode(item: Any, index: int) -> Prepared:
        return prepare(item, index, options, pre, budget, decodings.setdefault(index, Decoding()))

    def collect(future: Future, item: Any, index: int) -> Prepared:
        decoding = decodings.setdefault(index, Decoding())
        limit = options.decode_timeout
        while True:
            try:
                prepared = future.result(timeout=_WAIT_SLICE)
            except FutureTimeout:  # the builtin TimeoutError only from Python 3.11
                started = decoding.started
                if limit is None or started is None or time.monotonic() - started < limit or \
                        not decoding.abandon(budget):
                    continue  # not admitted yet (waiting for budget is not decoding), within its time, or just done
                pool.replace(future)  # its thread may be stuck for good: stuck threads cannot starve the rest
                name = input_name(input_kind(item, options)[1], index, item)
                prepared = Prepared(index, name, error=f"{name}: not decoded within {limit:g} s (the decode time "
                                                        f"limit: embed --decode-timeout, decode_timeout); left out, "
                                                        f"a larger limit lets it finish")
            decodings.pop(index, None)
            return prepared

    pool = DecodePool(options.workers)
    prefetched = ordered_prefetch(pool, items, options.prefetch, decode, collect)
    try:
        batch: list[Prepared] = []
        failed: list[Prepared] = []
        for prepared in prefetched:
            if on_prepared is not None:
                on_prepared(prepared)
            if prepared.error is not None:
                failed.append(prepared)
                continue
            if batch and sum(p.patches for p in batch) + prepared.patches > options.max_batch_patches:
                yield batch, failed
                batch, failed = [], []
            batch.append(prepared)
            budget.release(prepared.held)  # now counted by the batch's token bound instead
        if batch or failed:
            yield batch, failed
    finally:
        # Stopped early (an error, Ctrl-C, or the caller left the loop): wake the workers waiting for budget,
        # stop the video decodes in flight at their next frame, drop the inputs not started, and let the
        # workers end on their own: none is waited for.
        budget.close()
        for decoding in list(decodings.values()):
            decoding.stop.set()
        prefetched.close()
        pool.shutdown()


def ordered_prefetch(pool: Any, items: Iterable[Any], depth: int, fn: Callable[[Any, int], Any],
                     collect: Callable[[Future, Any, int], Any] | None = None) -> Iterator[Any]:
    """fn(item, index) on the pool (anything with ``submit``), at most `depth` in flight, results in input order.

    ``collect(future, item, index)`` waits for one result (default: the future's result); each wait is in short
    slices, so that Ctrl-C reaches the iterating thread while a result is slow."""
    pending: deque = deque()

    def result(entry: tuple[Future, Any, int]) -> Any:
        if collect is not None:
            return collect(*entry)
        while True:
            try:
                return entry[0].result(timeout=_WAIT_SLICE)
            except FutureTimeout:  # the builtin TimeoutError only from Python 3.11
                continue

    try:
        for index, item in enumerate(items):
            pending.append((pool.submit(fn, item, index), item, index))
            if len(pending) > depth:
                yield result(pending.popleft())
        while pending:
            yield result(pending.popleft())
    finally:
        for future, _, _ in pending:
            future.cancel()


class DecodePool:
    """Decode threads: ``submit`` as ``ThreadPoolExecutor``'s, but daemon threads that nothing joins.

    ``ThreadPoolExecutor`` joins its threads on shutdown and again at interpreter exit, so one decode stuck in
    C code (a huge progressive JPEG, a hung read) would hold Ctrl-C and the process's exit. Here ``shutdown``
    only tells the threads to end once they are idle.
    """

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"qwenvl-decode-{i}", daemon=True)
                         for i in range(workers)]
        self._lock = threading.Lock()
        self._given_up: set[Future] = set()  # jobs still running whose thread was replaced: it ends after them
        for thread in self._threads:
            thread.start()

    @property
    def live(self) -> int:
        """Threads still running (the pool's size, plus those still busy with a job given up)."""
        return sum(thread.is_alive() for thread in self._threads)

    def replace(self, future: Future) -> None:
        """A new thread in place of the one running ``future``, a job given up; that one ends once its job does.
        Nothing happens if the job is done already (its thread is free)."""
        with self._lock:
            if future.done():
                return
            self._given_up.add(future)
            thread = threading.Thread(target=self._work, name=f"qwenvl-decode-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
        thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the future
                future.set_exception(e)
            with self._lock:  # after the result is set: ``replace`` sees the job done, or this thread sees it given up
                replaced = future in self._given_up
                self._given_up.discard(future)
            del job, future  # an idle thread holds no finished input's pixels
            if replaced:
                return

    def shutdown(self) -> None:
        """Each thread ends once the jobs queued before this call are done or skipped (a job whose future was
        cancelled is skipped); nothing waits for them."""
        for _ in self._threads:
            self._jobs.put(None)


class BudgetClosed(Exception):
    """The iteration that owned a decode budget stopped; inputs still waiting for it are dropped."""


class DecodeBudget:
    """Bytes that inputs being decoded, or decoded and waiting for their batch, may hold at once.

    Admission is in input order (input i waits until inputs 0..i-1 were admitted): a small later input never
    overtakes a large earlier one, so whatever holds bytes is consumed before the waiter and every wait
    ends. An input costing more than the whole budget is admitted when nothing else holds any.
    capacity None: no bound (inputs are still admitted in order).
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._cond = threading.Condition()
        self._used = 0
        self._next = 0
        self._closed = False

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    def admit(self, ticket: int, cost: int) -> int:
        """Wait until input `ticket` is next and its `cost` fits; returns the bytes it now holds."""
        with self._cond:
            while not self._closed and (ticket != self._next or not self._fits(cost)):
                self._cond.wait()
            if self._closed:
                raise BudgetClosed
            self._next += 1
            self._used += cost
            self._cond.notify_all()
            return cost

    def _fits(self, cost: int) -> bool:
        return self.capacity is None or self._used == 0 or self._used + cost <= self.capacity

    def resize(self, held: int, now: int) -> int:
        """An admitted input now holds `now` bytes instead of `held` (may exceed the budget: it is already in)."""
        with self._cond:
            self._used += now - held
            self._cond.notify_all()
        return now

    def release(self, held: int) -> None:
        self.resize(held, 0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def probe_quietly(path: str | os.PathLike, max_input_pixels: int | None) -> tuple[int, float, int, int] | None:
    """``probe_video``'s (frames, fps, height, width), or None when it fails: preprocessing names the problem."""
    try:
        return probe_video(path, max_input_pixels=max_input_pixels)
    except Exception:  # noqa: BLE001 - this only feeds an estimate
        return None


def video_file_cost(header: tuple[int, float, int, int], pre: PreprocessConfig, video_config: VideoConfig) -> int:
    """Estimated peak bytes of reading a video file: its sampled frames resized (3 bytes a pixel, each resized as
    it is decoded) and its float32 output (12 bytes a pixel of every padded frame), beside one decoded source
    frame and its conversions (the image rate)."""
    total, rate, height, width = header
    try:
        kept = len(sample_indices(total, rate, video_config, pre.temporal_patch_size))
        target = math.prod(video_target_size(kept, height, width, pre, video_config))
    except QwenVLVisionError:  # preprocessing names the problem; this is only an estimate
        return 0
    padded = -(-kept // pre.temporal_patch_size) * pre.temporal_patch_size
    return kept * target * 3 + padded * target * 12 + height * width * DECODE_BYTES_PER_PIXEL


def decode_bytes_per_pixel(image: PIL.Image.Image, backend: str) -> int:
    """Peak bytes per header pixel of preprocessing an opened file (its mode read from the header) with the
    ``backend`` resize: the measured rates above."""
    if backend == "torch":
        return TORCH_WIDE_DECODE_BYTES_PER_PIXEL if image.mode.startswith(_WIDE_MODES) else TORCH_DECODE_BYTES_PER_PIXEL
    return DECODE_BYTES_PER_PIXEL


def decode_cost(item: Any, video: bool, max_input_pixels: int | None, backend: str = "pil") -> int:
    """Estimated peak bytes of decoding `item` with the ``backend`` resize (``decode_bytes_per_pixel``), read
    from a file's header; 0 for what is already in memory.

    Frames given as a list are estimated by their first frame: they are decoded one at a time (video files:
    ``video_file_cost``). A file refused by max_input_pixels, or whose header cannot be read, costs nothing:
    preprocessing refuses it unread.
    """
    first = item
    if video:
        if not isinstance(item, (list, tuple)) or not item:
            return 0
        first = item[0]
    if not is_file_input(first):
        return 0
    try:
        if not isinstance(first, FileBytes) and not stat.S_ISREG(os.stat(first).st_mode):
            return 0  # opening a FIFO would block: preprocessing refuses it
        # open_header: the header checks decoding makes (a file it refuses costs nothing), PIL's limit as there.
        with open_header(first, "", max_input_pixels, check_aspect=False) as image:
            pixels = image.width * image.height
            per_pixel = decode_bytes_per_pixel(image, backend)
    except Exception:  # noqa: BLE001 - preprocessing names the problem; this is only an estimate
        return 0
    return pixels * per_pixel

