"""The encode API: ``VisionEncoder`` (``encode_images`` / ``encode_videos`` / ``iter_encode`` / ``encode_patches``)
and its lifecycle; ``loading`` builds one (``load_encoder``).

The encoder owns its tower and the tower owns its caches, which ``close()`` frees; ``encode_*`` may run on several
threads at once. The call's settings are ``options``'; decoding and batching, under one decode-memory budget, are
``batching``'s (see ``iter_encode``); this module runs the tower on each batch, tells what a failed forward means
(out of memory, the machine's fault, an input's own, inf/nan) and assembles the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .backends.cpu.backend import CpuBackend, use_cpu_kernels
from .backends.cpu.plan import CpuPlan
from .batching import Prepared, preflight, prepared_batches
from .devices import dtype_name, upload
from .errors import EncoderClosedError, ForwardFaultError, InputError, NumericalError, QwenVLVisionError, first_line
from .inputs.images import PreprocessConfig
from .inputs.item_ids import config_sha256, is_sha256, weights_sha256
from .inputs.item_ids import pixels_sha256 as item_pixels_sha256
from .inputs.pixels import DEFAULT_MAX_INPUT_PIXELS, check_pixel_bounds, is_file_input
from .inputs.video import VideoConfig, positive_number, sample_frames_by_fps
from .model.config import VisionConfig
from .model.tower import VisionTower
from .options import (
    DEFAULT_BATCH_PATCHES,
    DEFAULT_DECODE_BYTES,
    DEFAULT_DECODE_TIMEOUT,
    EncodeOptions,
    check_option_rules,
)
from .results import EncodeResult, ItemResult


class VisionEncoder(contextlib.AbstractContextManager):
    """A loaded vision tower with its preprocessing; see ``load_encoder``. ``with`` closes it on leaving."""

    def __init__(self, model: VisionTower, preprocess_config: PreprocessConfig, source: str = "",
                 video_config: VideoConfig | None = None) -> None:
        self._model: VisionTower | None = model
        self.preprocess_config = preprocess_config
        self.video_config = video_config or VideoConfig.for_family(model.config.family)
        self.source = source
        self.config: VisionConfig = model.config
        # Guards _model, _closing and _forwards: forwards and plan switches in flight, which close() waits for.
        self._state = threading.Condition()
        self._closing = False
        self._forwards = 0
        self._loaded: dict[str, str] | None = None  # identity()'s weights hash and dtype, kept after close

    # ------------------------------------------------------------------ lifecycle

    @property
    def model(self) -> VisionTower:
        model = self._model
        if model is None or self._closing:
            raise EncoderClosedError(f"encoder for {self.source or self.config.name!r} is closed")
        return model

    @property
    def closed(self) -> bool:
        return self._model is None or self._closing

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[VisionTower]:
        """The model, counted in flight until the block ends: close() waits for it rather than freeing under it."""
        with self._state:
            model = self.model
            self._forwards += 1
        try:
            yield model
        finally:
            with self._state:
                self._forwards -= 1
                self._state.notify_all()

    def close(self) -> None:
        """Free weights and caches now, whoever else still references this encoder or its model (docs/api.md,
        Memory): forwards already running finish first; code that calls ``encoder.model`` directly is outside this
        protocol. Do not call it from inside a forward."""
        with self._state:
            self._closing = True
            while self._forwards:
                self._state.wait()
            model, self._model = self._model, None
        if model is not None:
            model.shape_cache.clear()
            model.to("meta")  # storage-less: a reference to the module kept elsewhere no longer pins the weights
            model.backend.release(model)
            torch.cuda.empty_cache()  # a no-op where CUDA was never used

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.device}, {self.dtype}"
        return f"VisionEncoder({self.config.name or self.config.model_type}, {state})"

    def describe(self) -> dict:
        """The tower's ``describe()`` (sizes, attention, device, dtype, kernels), its preprocessing and its source."""
        return {**self.model.describe(), "source": self.source,
                "preprocess": dataclasses.asdict(self.preprocess_config),
                "video": dataclasses.asdict(self.video_config)}

    def identity(self) -> dict[str, str]:
        """Which model this is, as its outputs record it (``item_ids``: family, config hash, weights
        hash, dtype). The weights are hashed on the first call (about a second per GB) and remembered until the
        tower is cast (weights changed in place are not seen: load the encoder again)."""
        model = None if self.closed and self._loaded is not None else self.model
        if self._loaded is None or model is not None and self._loaded["dtype"] != dtype_name(model.dtype):
            self._loaded = {"weights_sha256": weights_sha256(model), "dtype": dtype_name(model.dtype)}
        return {"family": self.family, "config_sha256": config_sha256(self.config, self.preprocess_config),
                **self._loaded}

    @property
    def family(self) -> str:
        """The tower's model_type, as its results' ``family`` says (``config.family`` is the ``Family``)."""
        return self.config.model_type

    @property
    def cpu_plan(self) -> CpuPlan | None:
        """The CPU plan the inference calls run on, the same kernels as ``cpu_kernels`` on any machine (None: the
        modules' own forward, e.g. off the CPU, compiled or ``cpu_kernels="reference"``)."""
        backend = self.model.backend
        return backend.plan(self.model) if isinstance(backend, CpuBackend) else None

    def set_cpu_kernels(self, cpu_kernels: str | dict | CpuPlan) -> None:
        """Run the CPU inference calls from now on as ``load_encoder``'s ``cpu_kernels`` says ("auto", "reference"
        or a plan, e.g. a run's recorded one): prepared now where the weights are on the CPU, the layers left
        packed where the setting resolves to the plan they are packed for; off the CPU only checked."""
        with self._in_use() as model:  # it packs and unpacks weights: close() must not free them meanwhile
            use_cpu_kernels(model, cpu_kernels)

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
                       pooled: bool = False, normalize: bool = False, modality: str = "image",
                       pixels_sha256: Sequence[str] | None = None) -> EncodeResult:
        """Encode inputs already processed the transformers way (rows in merge-block order).

        ``modality`` ("image" or "video") is what the rows are, recorded in the result; the tower's math is the
        same for both. ``video_info`` is one None per item: nothing was read from a file here.
        ``pixels_sha256``: the items' ``item_ids.pixels_sha256`` where the caller has them (the batch job hashes
        each input on its decode thread); else CPU rows are hashed here, and rows on another device are not (the
        hash is a host computation: pass it, or ``to_vllm_cache`` refuses the result).

        Outputs that are not finite (in any dtype: float16 overflows in the Qwen2.5-VL tower; absurd weights or a
        config overflow in any) raise ``NumericalError`` naming the items, or ``InputError`` where ``pixel_values``
        hold inf/nan.
        """
        check_option_rules(pooled=pooled, normalize=normalize)
        result = self._encode_unchecked(pixel_values, grid_thw, pooled=pooled, normalize=normalize,
                                        modality=modality, pixels_sha256=pixels_sha256)
        bad = nonfinite_items(result)
        if bad and not torch.isfinite(pixel_values).all():  # looked at only then: the check costs a pass
            raise InputError("pixel_values hold inf/nan: the outputs are not finite because the inputs are not")
        if bad:
            raise NumericalError(nonfinite_message(f"item{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}",
                                                   self.dtype))
        return result

    def _encode_unchecked(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence, *,
                          pooled: bool = False, normalize: bool = False, modality: str = "image",
                          pixels_sha256: Sequence[str] | None = None) -> EncodeResult:
        """``encode_patches`` without its finiteness check (a batch job checks each item on its own)."""
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            what = pixel_values.dtype if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise InputError(f"pixel_values must be a floating-point torch.Tensor, got {what}")
        if modality not in ("image", "video"):
            raise InputError(f'modality must be "image" or "video", got {modality!r}')
        with self._in_use() as model:
            grids = model.grid_list(grid_thw)
            if pixels_sha256 is not None:  # refused before the forward it would waste
                one = isinstance(pixels_sha256, str) or not isinstance(pixels_sha256, Iterable)
                pixels_sha256 = [pixels_sha256] if one else list(pixels_sha256)
                if len(pixels_sha256) != len(grids) or not all(d is None or is_sha256(d) for d in pixels_sha256):
                    raise InputError(f"pixels_sha256 must be one 64-hex-digit hash (or None) per item, {len(grids)} "
                                     f"items; got {pixels_sha256!r:.120}")
            with torch.inference_mode():
                merged, levels = model(pixel_values, grids)
        if pixels_sha256 is None and pixel_values.device.type == "cpu":
            pixels_sha256 = [item_pixels_sha256(rows) for rows in pixel_values.split([t * h * w for t, h, w in grids])]
        elif pixels_sha256 is None:
            pixels_sha256 = [None] * len(grids)
        sizes = [t * h * w // self.config.merge_unit for t, h, w in grids]
        embeddings = list(merged.split(sizes))
        per_level = [level.split(sizes) for level in levels]
        deepstack = [[chunks[i] for chunks in per_level] for i in range(len(grids))]
        pooled_out = None
        if pooled:
            means = torch.stack([e.float().mean(0) for e in embeddings])
            pooled_out = (torch.nn.functional.normalize(means, dim=-1) if normalize else means).to(merged.dtype)
        return EncodeResult(embeddings, torch.tensor(grids, dtype=torch.int64), deepstack, pooled_out,
                            video_info=[None] * len(grids), modality=modality, family=self.family,
                            pixels_sha256=list(pixels_sha256), encoder=weakref.ref(self),
                            merge_size=self.config.spatial_merge_size)

    def iter_encode(self, items: Iterable[Any], *, video: bool | None = False, min_pixels: int | None = None,
                    max_pixels: int | None = None, max_batch_patches: int = DEFAULT_BATCH_PATCHES,
                    pooled: bool = False, normalize: bool = False, num_workers: int | None = None, prefetch: int = 8,
                    max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS,
                    decode_bytes: int | None = DEFAULT_DECODE_BYTES,
                    decode_timeout: float | None = DEFAULT_DECODE_TIMEOUT,
                    on_prepared: Callable[[int, int], None] | None = None,
                    resize: str | None = None,
                    video_config: VideoConfig | None = None,
                    hash_pixels: bool = False, max_item_tokens: int | None = None) -> Iterator[list[ItemResult]]:
        """Yield results batch by batch, in input order; a bad input yields an ItemResult with its error.

        ``video``: False, every item is an image; True, every item is a video (a file, or frames); None, an item
        is a video when it is a path with a video extension (``video.VIDEO_EXTENSIONS``), else an image, and
        ``min_pixels`` / ``max_pixels`` then bound the images only (videos keep their video settings' bounds).
        ``video_config``: the video settings for this call (None: ``self.video_config``).

        ``on_prepared(index, tokens)`` is called once per input, in input order, on the iterating thread, as soon
        as the input is decoded and resized (or has failed: tokens 0), before it joins its batch; tokens is the
        number of embedding rows it will get. Progress can so advance image by image: a batch is one tower call
        (on the CPU each of its items its own forward), and a small job is a single batch.

        Inputs are decoded and resized by worker threads ahead of the compute (PIL and torch release the
        GIL), at most `prefetch` inputs ahead. Host memory for inputs is bounded by `decode_bytes` (inputs
        being decoded, at what the resize backend holds at its peak per pixel, plus decoded ones waiting
        for their batch; an input larger than that is handled alone; a ``FileBytes`` fetched here is charged once its
        header is read, not before; None: no bound) plus the batch being encoded
        (`max_batch_patches` patches, or one larger input). A
        file whose header declares more than `max_input_pixels` pixels is refused before decoding and yields an
        error (None: no limit; it replaces PIL's own bomb limit). ``decode_timeout``: seconds one input may spend
        decoding (from its admission by the decode budget, or from the start of a header read that hangs) before it
        yields an error naming it and the limit, and the others go on (None: no limit). A generator of ``items``
        that waits for the results so far before it yields more needs ``prefetch=0``: what is ready is then
        yielded before each input is pulled (each its own batch). ``resize``: images' "pil", "torch" or "vllm" (see
        encode_images); None takes the checkpoint's. Videos always use the video processors' pipeline; "vllm" also
        reads a video file as vLLM's reader does (turned upright by its rotation metadata, Qwen2's frames picked as
        it picks them).
        ``hash_pixels``: give each result its ``pixels_sha256`` (hashed on the decode threads, about 15 ms per
        megapixel), what an encoder cache names the item by. ``max_item_tokens``: an input that resizes to more
        embedding rows yields an error naming it instead of its forward, a video file before its frames decode (None:
        no bound; a long video can take hundreds of thousands).
        """
        options = self._options(
            items, video=video, min_pixels=min_pixels, max_pixels=max_pixels, max_input_pixels=max_input_pixels,
            resize=resize, video_config=video_config, pooled=pooled, normalize=normalize,
            max_batch_patches=max_batch_patches, num_workers=num_workers, prefetch=prefetch,
            decode_bytes=decode_bytes, decode_timeout=decode_timeout, hash_pixels=hash_pixels,
            max_item_tokens=max_item_tokens)
        # batching counts patches; the caller is told embedding rows.
        report_rows = None if on_prepared is None else \
            (lambda p: on_prepared(p.index, p.patches // self.config.merge_unit))
        yield from self._encode_batches(items, options, report_rows)

    def _options(self, items: Any, video_config: VideoConfig | None = None, **settings: Any) -> EncodeOptions:
        """A call's options, once the encoder is known open and ``items`` a sequence of inputs (a str would be read as
        one file per character, an image array as one grayscale image per row)."""
        self.model  # noqa: B018 - raises if closed, before any work
        if one_array(items, settings["video"]):
            one = f"{'video' if settings['video'] else 'image'} array (shape {tuple(items.shape)})"
        elif isinstance(items, (str, bytes, os.PathLike)) or hasattr(items, "getpixel"):
            one = f"{'image' if hasattr(items, 'getpixel') else 'path'} ({str(items)[-200:]!r})"
        else:
            one = None
        if one is not None:
            raise InputError(f"the inputs must be a sequence of inputs, got one {one}: pass [it]")
        try:
            iter(items)  # a sequence by __getitem__ alone (a map-style Dataset) iterates too
        except TypeError:
            raise InputError(f"the inputs must be a sequence of inputs, got {type(items).__name__}") from None
        options = EncodeOptions(video_config=video_config or self.video_config, **settings)
        if options.video is True and options.max_pixels is None:  # an image's min_pixels: frames resized to gigabytes
            check_pixel_bounds(options.min_pixels, options.video_config.max_pixels,
                               ("min_pixels", "the videos' max_pixels"))
        return options

    def _encode_batches(self, items: Iterable[Any], options: EncodeOptions,
                        on_prepared: Callable[[Prepared], None] | None = None) -> Iterator[list[ItemResult]]:
        """Batches prepared by ``batching``, each one tower call here; its failed inputs become error results."""
        batches = prepared_batches(items, options, self.preprocess_config, on_prepared=on_prepared)
        # Closing the batches, however this generator ends, releases the decode workers and their budget.
        with contextlib.closing(batches):
            for batch, failed in batches:
                results = [ItemResult(p.index, p.name, error=p.error) for p in failed]
                if batch:
                    results += self._forward_batch(batch, options)
                yield sorted(results, key=lambda r: r.index)

    def _forward_batch(self, batch: list[Prepared], options: EncodeOptions) -> list[ItemResult]:
        """A batch's results. Out of memory: the batch again item by item; an item that alone runs out of memory is
        a failed input. Another failure: a forward of the smallest input tells whose fault it is: if that fails
        too, the machine's (``ForwardFaultError`` naming the batch's inputs); else item by item, and an item that
        fails alone is a failed input (a shape a kernel refuses would otherwise stop every resume). An item with
        inf/nan outputs is a failed input; attention never crosses items, so the others are unaffected."""
        failure: BaseException | str | None = None
        try:
            pixel_values = upload([p.pixel_values for p in batch], self.device)
            out = self._encode_unchecked(pixel_values, [p.grid for p in batch], pooled=options.pooled,
                                         normalize=options.normalize,
                                         pixels_sha256=[p.pixels_sha256 for p in batch])
            bad = set(nonfinite_items(out))  # CUDA's faults surface here
        except (RuntimeError, MemoryError) as e:
            if isinstance(e, QwenVLVisionError):
                raise
            out = None
            text = str(e).lower()  # an allocator's out of memory may be a plain RuntimeError that only says so
            if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not any(
                    s in text for s in ("out of memory", "can't allocate memory", "not enough memory", "alloc_failed")):
                traceback.clear_frames(e.__traceback__)  # kept for its message: not the failed forward's tensors
                failure = e
        if out is None:  # outside the except block, so the failed forward's frames (and memory) are freed
            pixel_values = None
            torch.cuda.empty_cache()  # the caching allocator's free blocks back before the probe or a smaller retry
            if failure is not None:
                try:
                    self._check_machine(batch, failure)
                finally:  # its traceback holds this frame: kept in it, the two (and the encoder) would wait for gc
                    failure = first_line(failure)
            if len(batch) > 1:
                return [r for p in batch for r in self._forward_batch([p], options)]
            p = batch[0]
            if failure is None:
                return [ItemResult(p.index, p.name, error=f"{p.name}: out of memory encoding it alone ({p.patches:,} "
                                   f"patches on {self.device}): lower its size (max_pixels, --max-pixels)",
                                   error_class=ForwardFaultError)]
            return [ItemResult(p.index, p.name, error=f"{p.name}: its forward fails alone while the device works: "
                               f"{failure}", error_class=InputError)]
        return [ItemResult(p.index, p.name, error=nonfinite_message(p.name, self.dtype), error_class=NumericalError)
                if i in bad else
                ItemResult(p.index, p.name, embedding=out.embeddings[i], grid_thw=p.grid, deepstack=out.deepstack[i],
                           pooled=out.pooled[i] if out.pooled is not None else None, video_info=p.video_info,
                           pixels_sha256=out.pixels_sha256[i])
                for i, p in enumerate(batch)]

    def _check_machine(self, batch: list[Prepared], failure: BaseException) -> None:
        """Raise ``ForwardFaultError`` (from ``failure``) unless a forward of the smallest input works on this
        device: then ``failure`` was the batch's inputs' doing, not the machine's. The probe's outputs are checked
        on the host, which waits for the device (CUDA reports a kernel's fault at the next sync)."""
        unit = self.config.spatial_merge_size
        try:
            rows = torch.zeros(unit * unit, self.config.patch_dim, dtype=self.dtype, device=self.device)
            if nonfinite_items(self._encode_unchecked(rows, [(1, unit, unit)])):
                raise RuntimeError("the smallest input's outputs are not finite")
        except (RuntimeError, MemoryError) as e:
            if isinstance(e, QwenVLVisionError):
                raise
            names = [p.name for p in batch]
            listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ForwardFaultError(f"the forward of a batch of {len(names)} input{'s' if len(names) != 1 else ''} "
                                    f"({listed}) failed: {first_line(failure)}") from failure

    def _encode_all(self, items: list[Any], options: EncodeOptions) -> EncodeResult:
        """Every input encoded, or the first bad one raised: refused before any compute when preflight sees it."""
        preflight(items, options, self.preprocess_config)
        results: list[ItemResult] = []
        for batch in self._encode_batches(items, options):
            for r in batch:
                if r.error is not None:
                    raise r.error_class(r.error)
            results.extend(batch)  # the batches come in input order
        return EncodeResult(
            embeddings=[r.embedding for r in results],
            grid_thw=torch.tensor([r.grid_thw for r in results], dtype=torch.int64).view(-1, 3),
            deepstack=[r.deepstack for r in results],
            pooled=(torch.stack([r.pooled for r in results]) if results else torch.empty(
                0, self.config.out_hidden_size, dtype=self.dtype, device=self.device)) if options.pooled else None,
            video_info=[r.video_info for r in results],
            modality="video" if options.video else "image",
            family=self.family,
            pixels_sha256=[r.pixels_sha256 for r in results],
            encoder=weakref.ref(self),
            merge_size=self.config.spatial_merge_size,
        )

    def encode_images(self, images: Sequence[Any], *, min_pixels: int | None = None, max_pixels: int | None = None,
                      max_batch_patches: int = DEFAULT_BATCH_PATCHES, pooled: bool = False, normalize: bool = False,
                      num_workers: int | None = None, max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS,
                      resize: str | None = None) -> EncodeResult:
        """Images (paths, PIL images, HxWxC uint8 arrays, CxHxW uint8 tensors) -> embeddings, in input order.

        Preprocessing reproduces transformers' Qwen2VL image processor with this checkpoint's preprocessor
        config; min/max pixels override it per call. ``resize``: "pil" or "torch", the transformers backend to
        match, or "vllm", vLLM's image loading before the torch one (docs/api.md says which); None takes the
        checkpoint's (``preprocess_config.resize``). Batches hold at most
        `max_batch_patches` patches (an item larger than that runs alone). Bad input raises PreprocessError naming
        it, and so does a file whose header declares more than `max_input_pixels` (None: only PIL's own limit).
        ``pooled``: also each input's mean token; ``normalize``: of unit L2 norm (for cosine retrieval).
        """
        options = self._options(images, video=False, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_input_pixels=max_input_pixels, resize=resize, pooled=pooled, normalize=normalize,
                                max_batch_patches=max_batch_patches, num_workers=num_workers, hash_pixels=True)
        return self._encode_all(list(images), options)

    def encode_videos(self, videos: Sequence[Any], *, min_pixels: int | None = None, max_pixels: int | None = None,
                      max_batch_patches: int = DEFAULT_BATCH_PATCHES, pooled: bool = False, normalize: bool = False,
                      num_workers: int | None = None, fps: float | None = None,
                      video_fps: float | Sequence[float] | None = None,
                      max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS, resize: str | None = None
                      ) -> EncodeResult:
        """Videos (file paths, sequences of frames, (F, H, W, C) / (F, C, H, W) uint8 arrays) -> embeddings, as
        transformers' video processor of this family + the tower; see encode_images, and docs/api.md for the
        sampling (``fps``, default the checkpoint's; ``video_fps``: frames in memory's source rate, one value or one
        per video, with which they are sampled as a file of that rate is; without it they are kept as given, and
        ``fps`` is refused) and sizing (``video.video_target_size``, whose bounds ``min_pixels`` / ``max_pixels``
        override). ``resize`` "vllm": files read as vLLM's reader reads them (see iter_encode). grid_t = frames / 2.
        """
        if fps is not None and not positive_number(fps):
            raise InputError(f"fps {fps!r} is not a positive number of frames per second")
        options = self._options(videos, video=True, min_pixels=min_pixels, max_pixels=max_pixels,
                                max_input_pixels=max_input_pixels, pooled=pooled, normalize=normalize,
                                video_config=None if fps is None else dataclasses.replace(self.video_config, fps=fps),
                                max_batch_patches=max_batch_patches, num_workers=num_workers, hash_pixels=True,
                                resize=resize)
        videos = list(videos)
        infos = [None] * len(videos)
        if video_fps is not None or fps is not None and any(not is_file_input(v) for v in videos):
            videos, infos = sample_frames_by_fps(videos, self.video_config.fps if fps is None else fps, video_fps,
                                                 self.video_config, self.config.temporal_patch_size)
        out = self._encode_all(videos, options)
        out.video_info = [info or read for info, read in zip(infos, out.video_info, strict=True)]
        return out


def one_array(items: Any, video: bool | None) -> bool:
    """An array that is one input as transformers reads one array, given where a sequence of inputs belongs: 2-D, or
    3-D with an axis of 1, 3 or 4 channels (``as_hwc``), one image (a stack of grayscale images has none); 4-D, one
    video's frames. Iterated, it would be one input per row."""
    if not (isinstance(items, torch.Tensor) or isinstance(items, np.ndarray) and items.dtype.kind in "biuf"):
        return False
    shape = tuple(items.shape)
    if video:
        return len(shape) == 4
    return len(shape) == 2 or len(shape) == 3 and bool({shape[0], shape[2]} & {1, 3, 4})


def nonfinite_items(result: EncodeResult) -> list[int]:
    """Indices of the items whose embedding, DeepStack levels or pooled vector hold inf or nan (one host sync)."""
    finite = torch.stack([torch.stack([t.isfinite().all() for t in (embedding, *levels)]).all()
                          for embedding, levels in zip(result.embeddings, result.deepstack)])
    if result.pooled is not None:
        finite &= result.pooled.isfinite().all(dim=-1)
    return (~finite).nonzero().flatten().tolist()


def nonfinite_message(what: str, dtype: torch.dtype) -> str:
    """The one line for outputs with inf/nan: float16 overflows in the tower; in another dtype the weights or the
    config are at fault."""
    if dtype == torch.float16:
        return f"{what}: the tower's outputs contain inf/nan in float16 (the tower overflowed); use bfloat16 or float32"
    return (f"{what}: the tower's outputs contain inf/nan in {dtype_name(dtype)}: the checkpoint's "
            f"weights or config values overflow; check them (qwenvl-vision inspect shows the config)")


