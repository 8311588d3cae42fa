"""The public API: ``load_encoder(source)`` -> ``VisionEncoder`` with ``encode_patches`` / ``encode_images``.

The encoder owns its tower and the tower owns its caches; ``close()`` (or leaving the ``with`` block)
releases the weights and caches at once, even while other references to the encoder or its model are
still held, and any later call raises ``EncoderClosedError``.

Threads: ``encode_*`` may run on several threads at once. Each forward holds a reference that ``close()``
respects: ``close()`` first refuses new calls (they raise ``EncoderClosedError``), then waits for the
forwards already running to return their results, then frees. Code that calls ``encoder.model`` directly
is outside this protocol.

Decode memory: ``iter_encode`` (and so ``encode_images`` / ``encode_videos`` and ``embed``) decodes on worker
threads under one byte budget (``decode_bytes``, 1 GiB by default): an input is admitted, in input order,
only when its estimated decode cost fits beside the inputs already being decoded or waiting for their
batch (an input larger than the budget waits until it is alone). Files whose header declares more than
``max_input_pixels`` are refused before decoding.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import PIL.Image
import torch

from .attention import resolve_attn_impl
from .config import VisionConfig, resolve_config
from .devices import resolve_device, resolve_dtype
from .errors import ConfigError, EncoderClosedError, InputError, NumericalError, QwenVLVisionError
from .hub import resolve_folder
from .init import random_tower
from .preprocess import (
    DEFAULT_MAX_INPUT_PIXELS,
    PreprocessConfig,
    PreprocessError,
    check_resize_backend,
    input_name,
    preprocess_image,
)
from .tower import VisionTower
from .video import (
    VideoConfig,
    VideoInfo,
    is_video_file,
    preprocess_video,
    preprocess_video_file,
    probe_video,
    sample_indices,
    video_target_size,
)
from .weights import load_tower, open_checkpoint

DEFAULT_DECODE_BYTES = 1 << 30
# Peak bytes per header pixel while a file is decoded and converted to RGB, measured on 12 and 64 MP files
# decoded one at a time: ~4 for an RGB file (Pillow holds RGB as 4 bytes a pixel); 8.0 for the
# worst kinds, where a second full image exists for a moment: an EXIF-rotated photo (the transpose), a CMYK,
# RGBA, grayscale or palette file (the RGB conversion). Rounded up.
DECODE_BYTES_PER_PIXEL = 9


@dataclass
class EncodeResult:
    """Per-item outputs in input order.

    embeddings: one (tokens_i, out_hidden_size) tensor per image/video (tokens_i = t*h*w/4).
    grid_thw: (n, 3) int64, each item's patch grid.
    deepstack: per item, the list of its DeepStack levels (each the shape of its embedding); empty lists for
        towers without DeepStack (every family but Qwen3-VL, Qwen3-VL-MoE and Qwen3-Omni).
    pooled: (n, out_hidden_size) mean over each item's tokens, when requested.
    video_info: per item, what was read from a video file (frames kept, source fps, timestamps; a
        ``video.VideoInfo``), None for images and for videos given as frames.
    """

    embeddings: list[torch.Tensor]
    grid_thw: torch.Tensor
    deepstack: list[list[torch.Tensor]] = field(default_factory=list)
    pooled: torch.Tensor | None = None
    video_info: list[VideoInfo | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.embeddings)


@dataclass
class ItemResult:
    """One input's outcome in a streamed encode: either tensors or the error that stopped it."""

    index: int
    name: str
    embedding: torch.Tensor | None = None
    grid_thw: tuple[int, int, int] | None = None
    deepstack: list[torch.Tensor] | None = None
    pooled: torch.Tensor | None = None
    video_info: VideoInfo | None = None  # a video file's frames, fps and timestamps
    error: str | None = None
    error_class: type[QwenVLVisionError] = PreprocessError  # what encode_images raises for this error

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Prepared:
    index: int
    name: str
    pixel_values: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    error: str | None = None
    tokens: int = field(default=0)
    held: int = 0  # bytes of the decode budget this input holds until it joins a batch
    video_info: VideoInfo | None = None


class VisionEncoder:
    """A loaded vision tower with its preprocessing; see ``load_encoder``."""

    def __init__(self, model: VisionTower, preprocess_config: PreprocessConfig, source: str = "",
                 video_config: VideoConfig | None = None) -> None:
        self._model: VisionTower | None = model
        self.preprocess_config = preprocess_config
        self.video_config = video_config or VideoConfig.for_family(model.config.family)
        self.source = source
        self.config: VisionConfig = model.config
        # Guards _model, _closing and _forwards: forwards in flight, which close() waits for.
        self._state = threading.Condition()
        self._closing = False
        self._forwards = 0

    # ------------------------------------------------------------------ lifecycle

    def _closed_error(self) -> EncoderClosedError:
        return EncoderClosedError(f"encoder for {self.source or self.config.name!r} is closed")

    @property
    def model(self) -> VisionTower:
        model = self._model
        if model is None or self._closing:
            raise self._closed_error()
        return model

    @property
    def closed(self) -> bool:
        return self._model is None or self._closing

    def _begin_forward(self) -> VisionTower:
        """The model, counted as in use until _end_forward: close() waits for it rather than freeing under it."""
        with self._state:
            if self._model is None or self._closing:
                raise self._closed_error()
            self._forwards += 1
            return self._model

    def _end_forward(self) -> None:
        with self._state:
            self._forwards -= 1
            if self._forwards == 0:
                self._state.notify_all()

    def close(self) -> None:
        """Free weights and caches now, whoever else still references this encoder or its model.

        Calls that start after close() began raise EncoderClosedError; forwards already running on other
        threads finish first (close() waits for them), so they never see freed weights. Do not call it from
        inside a forward.
        """
        with self._state:
            self._closing = True
            while self._forwards:
                self._state.wait()
            model, self._model = self._model, None
        if model is None:
            return
        model.clear_cache()
        # Replace every parameter by a storage-less meta tensor: a reference to the module kept
        # elsewhere no longer pins the weights.
        model.to("meta")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> VisionEncoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.device}, {self.dtype}"
        return f"VisionEncoder({self.config.name or self.config.family}, {state})"

    def describe(self) -> dict:
        """The tower (family, sizes, attention backend, device, dtype), its image and video preprocessing and where
        it came from."""
        pre = self.preprocess_config
        return {**self.model.describe(), "source": self.source,
                "preprocess": {"patch_size": pre.patch_size, "min_pixels": pre.min_pixels,
                               "max_pixels": pre.max_pixels, "image_mean": list(pre.image_mean),
                               "image_std": list(pre.image_std), "resize": pre.resize},
                "video": dataclasses.asdict(self.video_config)}

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    # ------------------------------------------------------------------ encoding

    def encode_patches(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence, *,
                       pooled: bool = False) -> EncodeResult:
        """Encode inputs already processed the transformers way (rows in merge-block order)."""
        if not isinstance(pixel_values, torch.Tensor):
            raise InputError(f"pixel_values must be a torch.Tensor, got {type(pixel_values).__name__}")
        model = self._begin_forward()
        try:
            grids = model.grid_list(grid_thw)
            model.check_pixels(pixel_values, grids)
            with torch.inference_mode():
                merged, levels = model(pixel_values, grids)
        finally:
            self._end_forward()
        self._check_finite(merged, levels)
        sizes = [t * h * w // self.config.merge_unit for t, h, w in grids]
        embeddings = list(merged.split(sizes))
        per_level = [level.split(sizes) for level in levels]
        deepstack = [[chunks[i] for chunks in per_level] for i in range(len(grids))]
        pooled_out = torch.stack([e.float().mean(0) for e in embeddings]).to(merged.dtype) if pooled else None
        return EncodeResult(embeddings, torch.tensor(grids, dtype=torch.int64), deepstack, pooled_out)

    def _check_finite(self, merged: torch.Tensor, levels: list[torch.Tensor]) -> None:
        if merged.dtype != torch.float16:
            return
        for name, t in [("merged tokens", merged)] + [(f"DeepStack level {i}", x) for i, x in enumerate(levels)]:
            if not torch.isfinite(t).all():
                raise NumericalError(f"{name} contain inf/nan in float16 (the tower overflowed); "
                                     f"use bfloat16 or float32")

    def _prepare(self, item: Any, index: int, video: bool | None, min_pixels: int | None, max_pixels: int | None,
                 max_input_pixels: int | None, budget: _DecodeBudget, pin: bool, resize: str | None,
                 video_config: VideoConfig) -> _Prepared:
        """Decode and resize one input on a worker thread, admitted by the decode budget in input order."""
        if video is None:  # mixed: the pixel bounds given are the images'; videos keep their video_config's
            video = is_video_file(item)
            if video:
                min_pixels = max_pixels = None
        name = input_name("video" if video else "image", index, item)
        # A video file's header is read once: for its decode estimate, and its frame count for the read itself.
        header = _probe_quietly(item, max_input_pixels) if video and isinstance(item, (str, os.PathLike)) else None
        cost = _video_file_cost(header, self.preprocess_config, video_config) if header else \
            _decode_cost(item, video, max_input_pixels)
        held = budget.admit(index, cost)
        info = None
        # `resize` chooses between transformers' two image processors; its video processors have one pipeline.
        options = dict(min_pixels=min_pixels, max_pixels=max_pixels, index=index, max_input_pixels=max_input_pixels)
        try:
            if not video:
                pixel_values, grid = preprocess_image(item, self.preprocess_config, resize=resize, **options)
            elif isinstance(item, (str, os.PathLike)):
                pixel_values, grid, info = preprocess_video_file(item, self.preprocess_config, video_config,
                                                                 counted=header[0] if header else None, **options)
            else:
                pixel_values, grid = preprocess_video(item, self.preprocess_config, video_config=video_config,
                                                      **options)
        except PreprocessError as e:
            budget.release(held)
            return _Prepared(index, name, error=str(e))
        except Exception as e:  # noqa: BLE001 - a batch job records any per-input failure and goes on
            budget.release(held)
            return _Prepared(index, name, error=f"{name}: {type(e).__name__}: {e}")
        if pin:
            pixel_values = pixel_values.pin_memory()
        # From here on the input holds its resized pixels, not its decode peak.
        held = budget.resize(held, pixel_values.element_size() * pixel_values.nelement())
        return _Prepared(index, name, pixel_values, tuple(grid), tokens=math.prod(grid), held=held, video_info=info)

    def iter_encode(self, items: Iterable[Any], *, video: bool | None = False, min_pixels: int | None = None,
                    max_pixels: int | None = None, max_batch_tokens: int = 16384, pooled: bool = False,
                    num_workers: int | None = None, prefetch: int = 8,
                    max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS,
                    decode_bytes: int | None = DEFAULT_DECODE_BYTES,
                    on_prepared: Callable[[int, int], None] | None = None,
                    resize: str | None = None,
                    video_config: VideoConfig | None = None) -> Iterator[list[ItemResult]]:
        """Yield results batch by batch, in input order; a bad input yields an ItemResult with its error.

        ``video``: False, every item is an image; True, every item is a video (a file, or frames); None, an item
        is a video when it is a path with a video extension (``video.VIDEO_EXTENSIONS``), else an image, and
        ``min_pixels`` / ``max_pixels`` then bound the images only (videos keep their video settings' bounds).
        ``video_config``: the video settings for this call (None: ``self.video_config``).

        ``on_prepared(index, tokens)`` is called once per input, in input order, on the iterating thread, as soon
        as the input is decoded and resized (or has failed: tokens 0), before it joins its batch; tokens is the
        number of embedding rows it will get. Progress can so advance image by image: a batch is one forward,
        and a small job is a single batch.

        Inputs are decoded and resized by worker threads ahead of the compute (PIL and torch release the
        GIL), at most `prefetch` inputs ahead. Host memory for inputs is bounded by `decode_bytes` (inputs
        being decoded, at ~9 bytes per header pixel, plus decoded ones waiting for their batch; an input
        larger than that is handled alone; None: no bound) plus the batch being encoded (`max_batch_tokens`
        patches, or one larger input). A file whose header declares more than `max_input_pixels` pixels
        is refused before decoding and yields an error (None: no limit beyond PIL's own). ``resize``: images'
        "pil" or "torch" (see encode_images); None takes the checkpoint's. Videos always use the video processors'
        pipeline.
        """
        self.model  # noqa: B018 - raises if closed, before any work
        if resize is not None:
            check_resize_backend(resize, "resize")
        for option, value in (("max_batch_tokens", max_batch_tokens), ("max_input_pixels", max_input_pixels),
                              ("decode_bytes", decode_bytes), ("prefetch", prefetch)):
            if value is not None and value < (0 if option == "prefetch" else 1):
                raise ConfigError(f"{option} must be positive, got {value}")
        _check_pixel_bounds(min_pixels, max_pixels)
        pin = self.device.type == "cuda"
        budget = _DecodeBudget(decode_bytes)
        workers = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            prefetched = _ordered_prefetch(pool, items, prefetch, lambda item, i: self._prepare(
                item, i, video, min_pixels, max_pixels, max_input_pixels, budget, pin, resize,
                video_config or self.video_config))
            try:
                batch: list[_Prepared] = []
                failed: list[_Prepared] = []
                for prepared in prefetched:
                    if on_prepared is not None:
                        on_prepared(prepared.index, prepared.tokens // self.config.merge_unit)
                    if prepared.error is not None:
                        failed.append(prepared)
                        continue
                    if batch and sum(p.tokens for p in batch) + prepared.tokens > max_batch_tokens:
                        yield self._run_batch(batch, failed, pooled)
                        batch, failed = [], []
                    batch.append(prepared)
                    budget.release(prepared.held)  # now counted by the batch's token bound instead
                if batch or failed:
                    yield self._run_batch(batch, failed, pooled)
            finally:
                # Stopped early (an error, or the caller left the loop): wake the workers waiting for
                # budget and drop the inputs not started, so the pool's shutdown does not wait on them.
                budget.close()
                prefetched.close()

    def _run_batch(self, batch: list[_Prepared], failed: list[_Prepared], pooled: bool) -> list[ItemResult]:
        results = [ItemResult(p.index, p.name, error=p.error) for p in failed]
        if batch:
            pixel_values = torch.cat([p.pixel_values for p in batch]).to(self.device, non_blocking=True)
            try:
                out = self.encode_patches(pixel_values, [p.grid for p in batch], pooled=pooled)
            except NumericalError as e:  # the batch is lost, the stream goes on (embed records each input)
                results += [ItemResult(p.index, p.name, error=f"{p.name}: {e}", error_class=NumericalError)
                            for p in batch]
                return sorted(results, key=lambda r: r.index)
            for i, p in enumerate(batch):
                results.append(ItemResult(
                    p.index, p.name, embedding=out.embeddings[i], grid_thw=p.grid,
                    deepstack=out.deepstack[i],
                    pooled=out.pooled[i] if out.pooled is not None else None, video_info=p.video_info,
                ))
        return sorted(results, key=lambda r: r.index)

    def _encode_all(self, items: Sequence[Any], video: bool, pooled: bool, **options: Any) -> EncodeResult:
        items = list(items)
        _check_pixel_bounds(options.get("min_pixels"), options.get("max_pixels"))
        self._preflight(items, video, options.get("min_pixels"), options.get("max_pixels"),
                        options.get("max_input_pixels"), options.get("video_config") or self.video_config)
        results: list[ItemResult] = []
        for batch in self.iter_encode(items, video=video, pooled=pooled, **options):
            for r in batch:
                if r.error is not None:
                    raise r.error_class(r.error)
            results.extend(batch)
        results.sort(key=lambda r: r.index)
        return EncodeResult(
            embeddings=[r.embedding for r in results],
            grid_thw=torch.tensor([r.grid_thw for r in results], dtype=torch.int64).view(-1, 3),
            deepstack=[r.deepstack for r in results],
            pooled=torch.stack([r.pooled for r in results]) if pooled and results else None,
            video_info=[r.video_info for r in results],
        )

    def _preflight(self, items: list[Any], video: bool, min_pixels: int | None, max_pixels: int | None,
                   max_input_pixels: int | None, video_config: VideoConfig) -> None:
        """Reject unreadable or oversized files, zero-size arrays and extreme aspect ratios before any compute."""
        from .preprocess import probe_image

        for i, item in enumerate(items):
            first, name = item, None
            if video and isinstance(item, (str, os.PathLike)):
                total, rate, height, width = probe_video(item, input_name("video", i, item), max_input_pixels)
                count = len(sample_indices(total, rate, video_config, self.config.temporal_patch_size))
                video_target_size(count, height, width, self.preprocess_config, video_config, min_pixels, max_pixels,
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
            probe_image(first, self.preprocess_config, index=i, min_pixels=min_pixels, max_pixels=max_pixels,
                        max_input_pixels=max_input_pixels, name=name)

    def encode_images(self, images: Sequence[Any], *, min_pixels: int | None = None, max_pixels: int | None = None,
                      max_batch_tokens: int = 16384, pooled: bool = False, num_workers: int | None = None,
                      max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS,
                      resize: str | None = None) -> EncodeResult:
        """Images (paths, PIL images, HxWxC uint8 arrays, CxHxW uint8 tensors) -> embeddings, in input order.

        Preprocessing reproduces transformers' Qwen2VL image processor with this checkpoint's preprocessor
        config; min/max pixels override it per call. ``resize``: "pil" matches its PIL backend
        (``Qwen2VLImageProcessorPil``, and transformers without torchvision), "torch" its torchvision backend
        (transformers with torchvision, the processor ``...Fast`` configs name); None takes what this
        checkpoint's ``preprocessor_config.json`` names (``preprocess_config.resize``). Batches hold at most
        `max_batch_tokens` patches (an item larger than that runs alone). Bad input raises PreprocessError
        naming it, and so does a file whose header declares more than `max_input_pixels` (None: only PIL's own
        limit).
        """
        return self._encode_all(images, False, pooled, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_batch_tokens=max_batch_tokens, num_workers=num_workers,
                                max_input_pixels=max_input_pixels, resize=resize)

    def encode_videos(self, videos: Sequence[Any], *, min_pixels: int | None = None, max_pixels: int | None = None,
                      max_batch_tokens: int = 16384, pooled: bool = False, num_workers: int | None = None,
                      fps: float | None = None, video_fps: float | Sequence[float] | None = None,
                      max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS) -> EncodeResult:
        """Videos -> embeddings, as transformers' video processor of this family + the tower; see encode_images.

        Each video is a file path (decoded with PyAV, the ``[video]`` extra), a sequence of frames, or an
        (F, H, W, C) / (F, C, H, W) uint8 array. Files are sampled at ``fps`` frames per second (default: the
        checkpoint's ``video_config.fps``, 2.0) with the family's rule (Qwen2VLVideoProcessor's or
        Qwen3VLVideoProcessor's: min/max frames, the frame-count rule), and ``EncodeResult.video_info`` says
        which frames were used, at what source fps and timestamps. Frames given in memory are used as given,
        unless ``fps`` and their source rate ``video_fps`` (one value, or one per video) are passed. Every clip is
        sized by the video processor's rule (``video.video_target_size``: the video pixel bounds, the
        total-pixel budget, Qwen3-VL's frame-count-aware size); ``min_pixels`` / ``max_pixels`` override its
        bounds. The count is padded to a multiple of 2 by repeating the last frame; grid_t = frames / 2. Frames
        are resized and normalised by the video processors' own pipeline (the torchvision one; there is no other).
        """
        videos = list(videos)
        if fps is not None and any(not isinstance(v, (str, os.PathLike)) for v in videos):
            videos = self._sample_by_fps(videos, fps, video_fps)
        video_config = self.video_config if fps is None else dataclasses.replace(self.video_config, fps=fps)
        return self._encode_all(videos, True, pooled, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_batch_tokens=max_batch_tokens, num_workers=num_workers,
                                max_input_pixels=max_input_pixels, video_config=video_config)

    def _sample_by_fps(self, videos: list[Any], fps: float, video_fps: float | Sequence[float] | None) -> list[Any]:
        """Frames in memory sampled at ``fps`` with the family's rule (files are sampled when they are read)."""
        if video_fps is None:
            raise InputError("sampling frames in memory by fps needs their own frame rate: pass video_fps")
        rates = [video_fps] * len(videos) if isinstance(video_fps, (int, float)) else list(video_fps)
        if len(rates) != len(videos):
            raise InputError(f"video_fps has {len(rates)} entries for {len(videos)} videos")
        vcfg = dataclasses.replace(self.video_config, fps=fps)
        sampled = []
        for video, rate in zip(videos, rates):
            if isinstance(video, (str, os.PathLike)):
                sampled.append(video)
                continue
            frames = video if hasattr(video, "shape") else list(video)
            keep = sample_indices(len(frames), rate, vcfg, self.config.temporal_patch_size)
            sampled.append(frames[keep] if hasattr(frames, "shape") else [frames[i] for i in keep])
        return sampled


def _check_pixel_bounds(min_pixels: int | None, max_pixels: int | None) -> None:
    """Per-call pixel bounds: whole numbers of at least 1 (None: the checkpoint's), min not above max."""
    for option, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{option} must be a positive integer, got {value!r}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ConfigError(f"min_pixels {min_pixels} is above max_pixels {max_pixels}")


def _ordered_prefetch(pool: ThreadPoolExecutor, items: Iterable[Any], depth: int, fn) -> Iterator[Any]:
    """fn(item, index) on the pool, at most `depth` in flight, results in input order."""
    pending: deque = deque()
    try:
        for index, item in enumerate(items):
            pending.append(pool.submit(fn, item, index))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


class _BudgetClosed(Exception):
    """The iteration that owned a decode budget stopped; inputs still waiting for it are dropped."""


class _DecodeBudget:
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

    def admit(self, ticket: int, cost: int) -> int:
        with self._cond:
            while not self._closed and (ticket != self._next or not self._fits(cost)):
                self._cond.wait()
            if self._closed:
                raise _BudgetClosed
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


def _probe_quietly(path: str | os.PathLike, max_input_pixels: int | None) -> tuple[int, float, int, int] | None:
    """``probe_video``'s (frames, fps, height, width), or None when it fails: preprocessing names the problem."""
    try:
        return probe_video(path, max_input_pixels=max_input_pixels)
    except Exception:  # noqa: BLE001 - this only feeds an estimate
        return None


def _video_file_cost(header: tuple[int, float, int, int], pre: PreprocessConfig, video_config: VideoConfig) -> int:
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


def _decode_cost(item: Any, video: bool, max_input_pixels: int | None) -> int:
    """Estimated peak bytes of decoding `item`, read from a file's header; 0 for what is already in memory.

    Frames given as a list are estimated by their first frame: they are decoded one at a time (video files:
    ``_video_file_cost``). A file refused by max_input_pixels, or whose header cannot be read, costs nothing:
    preprocessing refuses it unread.
    """
    first = item
    if video:
        if not isinstance(item, (list, tuple)) or not item:
            return 0
        first = item[0]
    if not isinstance(first, (str, os.PathLike)):
        return 0
    try:
        if not stat.S_ISREG(os.stat(first).st_mode):  # opening a FIFO would block: preprocessing refuses it
            return 0
        with PIL.Image.open(first) as image:
            pixels = image.width * image.height
    except Exception:  # noqa: BLE001 - preprocessing names the problem; this is only an estimate
        return 0
    if max_input_pixels is not None and pixels > max_input_pixels:
        return 0
    return pixels * DECODE_BYTES_PER_PIXEL


# ---------------------------------------------------------------------- loading


def load_encoder(
    source: str | os.PathLike | VisionConfig | dict,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    random_weights: bool = False,
    seed: int = 0,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    cache_size: int = 1024,
    cache_bytes: int | None = 1 << 30,
    preprocess_config: PreprocessConfig | dict | None = None,
    video_config: VideoConfig | dict | None = None,
    compile: bool | dict = False,
    attn_impl: str = "auto",
    check_finite: bool = True,
) -> VisionEncoder:
    """Load a Qwen2.5-VL / Qwen3-VL vision encoder, reading only the vision tensors.

    source: a checkpoint folder in the released layout (sharded or single file, LLM shards may be absent),
    a vision-only folder from ``qwenvl-vision extract-weights``, a Hugging Face repo id (only configs, index
    and vision shards are fetched, into the HF cache), or, with ``random_weights=True``, a preset name /
    config for benchmarks. Defaults: CUDA when available, else CPU; bf16 on CUDA, fp32 on CPU.
    compile: True (or a dict of torch.compile options) compiles every block with a dynamic token count,
    attention kept outside the graphs (``VisionTower.compile_blocks``); the first forwards pay the compile.
    attn_impl: "auto" (flash-attn, else PyTorch's varlen kernel on CUDA in half precision; else SDPA), "sdpa",
    "flash" or "torch_varlen"; a backend that cannot run on this device and dtype is a ConfigError.
    check_finite: refuse a checkpoint holding NaN or infinite weights (a ``CheckpointError`` naming the
    tensor); False loads such a checkpoint as it is, for deliberately odd ones.
    preprocess_config / video_config: override the checkpoint's ``preprocessor_config.json`` /
    ``video_preprocessor_config.json`` (a settings object, or a dict in the file's format).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolve_attn_impl(attn_impl, device, dtype)  # refuse an impossible backend before any download or read
    options = dict(cache_size=cache_size, cache_bytes=cache_bytes, attn_impl=attn_impl)
    if random_weights:
        config = resolve_config(source)
        model = _compiled(random_tower(config, device, dtype, seed=seed, **options), compile)
        pre = _preprocess_config(preprocess_config, None, config)
        return VisionEncoder(model, pre, source=config.name or config.family,
                             video_config=_video_config(video_config, None, config, pre))
    if isinstance(source, (VisionConfig, dict)):
        raise ConfigError("a config alone has no weights: pass random_weights=True, or a checkpoint folder/repo id")
    folder = resolve_folder(os.fspath(source), revision, local_files_only, cache_dir, token)
    checkpoint = open_checkpoint(folder)
    model = _compiled(load_tower(checkpoint, device, dtype, check_finite=check_finite, **options), compile)
    pre = _preprocess_config(preprocess_config, checkpoint.preprocessor_json(), checkpoint.config)
    video = _video_config(video_config, checkpoint.video_preprocessor_json(), checkpoint.config, pre)
    return VisionEncoder(model, pre, source=os.fspath(source), video_config=video)


def _compiled(model: VisionTower, compile: bool | dict) -> VisionTower:
    if compile:
        model.compile_blocks(**(compile if isinstance(compile, dict) else {}))
    return model


def _preprocess_config(given: PreprocessConfig | dict | None, from_checkpoint: dict | None,
                       config: VisionConfig) -> PreprocessConfig:
    """The preprocessing settings, refused when their patch grid is not the tower's (the pixel rows would not
    match what the tower was trained on, yet still have a plausible shape)."""
    pre = given if isinstance(given, PreprocessConfig) else \
        PreprocessConfig.from_dict(given if given is not None else from_checkpoint, config.family)
    pairs = (("patch_size", pre.patch_size, config.patch_size), ("merge_size", pre.merge_size,
             config.spatial_merge_size), ("temporal_patch_size", pre.temporal_patch_size, config.temporal_patch_size))
    for name, ours, tower in pairs:
        if ours != tower:
            raise ConfigError(f"the preprocessor config's {name} is {ours} but the vision tower's is {tower}")
    return pre


def _video_config(given: VideoConfig | dict | None, from_checkpoint: dict | None, config: VisionConfig,
                  pre: PreprocessConfig) -> VideoConfig:
    if isinstance(given, VideoConfig):
        return given
    return VideoConfig.from_dict(given if given is not None else from_checkpoint, config.family, pre)
