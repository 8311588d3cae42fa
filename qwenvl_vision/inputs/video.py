"""Videos for the Qwen-VL vision towers: frames sampled, sized and normalised like transformers' video processors.

Reference (transformers 5.24): ``models/qwen2_vl/video_processing_qwen2_vl.py`` (``Qwen2VLVideoProcessor``:
``__init__`` size overrides, ``sample_frames``, ``resize``, ``patchify``) and
``models/qwen3_vl/video_processing_qwen3_vl.py`` (``Qwen3VLVideoProcessor``: ``sample_frames``, its temporal
``smart_resize``, ``resize``), and the ``TorchvisionBackend`` they inherit (``image_processing_backends.py``:
``resize`` = torchvision antialiased bicubic, ``rescale_and_normalize`` fused). Files are read by ``video_io``
(``read_video_pyav``); per video the pipeline is

    header metadata -> frame indices (family's fps rule) -> decode only those frames (rgb24)
    -> one target size for the clip (family's resize rule) -> uint8 bicubic antialias resize per frame
    -> (x - 255*mean) / (255*std) in float32 -> pad to a multiple of T with the last frame -> patchify

with the same torch calls (``pixels.resize_uint8_torch``, ``pixels.normalize_table(backend="torch")``),
so ``pixel_values`` match the video processors to float32 bits (the tests measure a max abs difference of 0).
Which rule a family uses is ``config.Family.video_sampling``: "qwen2" (Qwen2-VL, Qwen2.5-VL, both Omnis) or
"qwen3" (Qwen3-VL, Qwen3.5, Qwen4-Exp), as transformers' ``AutoVideoProcessor`` maps them.

Deviations from the reference, on purpose (those of reading files: ``video_io``'s docstring):

- Sampling always happens at ``VideoConfig.fps`` (2.0 by default, what Qwen's own tools use). The Qwen2 class
  has no fps and ``do_sample_frames=False`` (it keeps every frame unless the caller asks); a file that writes
  that backward-compatible default is read as "sample at the default fps". ``num_frames`` is refused.
- A clip shorter than the temporal patch size T: Qwen2's sampler divides by zero and Qwen3's ``smart_resize``
  raises; here every frame is kept and the size is computed as if the clip had T frames (patchify pads it to T
  by repeating the last frame anyway). Qwen2's sampler can also step one index past the last frame: dropped.
- Frames given as arrays: 1 channel is repeated and an all-opaque 4th channel dropped, as the video
  processors' ``convert_to_rgb`` does; frames with real transparency are refused (the reference blends them
  in float and resizes the float frames, which this module does not reproduce). Frames given one by one as
  paths or PIL images are converted as transformers' torchvision image processor converts them.
- The frames of one video must share one size (the reference stacks them and fails otherwise).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import Event
from typing import Any

import numpy as np
import PIL.Image
import torch

from ..errors import ConfigError, InputError, PreprocessError
from ..model.config import Family, family_named
from .images import PreprocessConfig, check_supported, image_target_size
from .pixels import (
    BICUBIC,
    MAX_ASPECT_RATIO,
    RESCALE_FACTOR,
    as_hwc,
    check_aspect_ratio,
    check_pixel_bounds,
    check_resize_backend,
    input_name,
    is_file_input,
    is_number,
    load_rgb,
    normalize,
    normalize_table,
    patchify,
    resize_image,
    resize_uint8_torch,
    smart_resize,
)
from .video_io import (
    VideoInfo,
    read_video_frames,
)

SAMPLINGS = ("qwen2", "qwen3")
# Class defaults of the two transformers video processors (their ``size`` and ``max_video_tokens``).
_CLASS_DEFAULTS = {
    "qwen2": {"processor": "Qwen2VLVideoProcessor", "min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768,
              "max_video_tokens": 128000},
    "qwen3": {"processor": "Qwen3VLVideoProcessor", "min_pixels": 128 * 32 * 32, "max_pixels": 32 * 32 * 768,
              "max_video_tokens": 768},
}


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoConfig:
    """Video settings of one checkpoint (its ``video_preprocessor_config.json``) and how frames are sampled.

    ``sampling``: "qwen2" follows ``Qwen2VLVideoProcessor`` (sampler, ``resize``), "qwen3"
    ``Qwen3VLVideoProcessor``. ``min_pixels`` / ``max_pixels`` are the processor's ``size.shortest_edge`` /
    ``size.longest_edge``: per frame for qwen2, for the whole clip (frames x height x width) for qwen3.
    ``cap_pixels_per_frame``: the qwen-vl-utils total-pixel budget both processors apply when asked; off when a
    file does not say, as in transformers 5.24 (whose warning announces it as a future default);
    ``max_video_tokens`` its budget (qwen2: tokens for the whole clip, qwen3: per frame).
    Field defaults are the Qwen2 class defaults; use ``for_family`` or ``from_dict``.
    """

    sampling: str = "qwen2"
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"VideoConfig.sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        for key in ("min_pixels", "max_pixels", "min_frames", "max_frames", "max_video_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"VideoConfig.{key} must be a positive int, got {value!r}")
        if not is_number(self.fps) or not math.isfinite(self.fps) or self.fps <= 0:
            raise ConfigError(f"VideoConfig.fps must be a finite positive number, got {self.fps!r}")
        object.__setattr__(self, "fps", float(self.fps))
        if not isinstance(self.cap_pixels_per_frame, bool):
            raise ConfigError(f"VideoConfig.cap_pixels_per_frame must be true or false, got "
                              f"{self.cap_pixels_per_frame!r}")
        check_pixel_bounds(self.min_pixels, self.max_pixels, ("VideoConfig.min_pixels", "VideoConfig.max_pixels"))
        if self.min_frames > self.max_frames:
            raise ConfigError(f"VideoConfig.min_frames ({self.min_frames}) is above max_frames ({self.max_frames})")

    @classmethod
    def for_family(cls, family: Family | str) -> VideoConfig:
        """The class defaults of the transformers video processor this family uses (``AutoVideoProcessor``).

        Qwen2-VL, Qwen2.5-VL and both Omnis use ``Qwen2VLVideoProcessor`` (128*28*28 .. 28*28*768 pixels per
        frame, 128000 video tokens), Qwen3-Omni too although its patch is 16: the bounds stay pixel counts, the
        size grid follows the checkpoint's patch. The Qwen3-VL family uses ``Qwen3VLVideoProcessor``
        (128*32*32 .. 32*32*768 pixels per clip, 768 tokens per frame). Released checkpoints write their own
        values (``from_dict``); without a ``video_preprocessor_config.json`` transformers reads the video
        settings from ``preprocessor_config.json``.
        """
        spec = family_named(family)
        d = _CLASS_DEFAULTS[spec.video_sampling]
        return cls(sampling=spec.video_sampling, min_pixels=d["min_pixels"], max_pixels=d["max_pixels"],
                   max_video_tokens=d["max_video_tokens"])

    @classmethod
    def from_dict(cls, d: dict | None, family: Family | str, pre: PreprocessConfig | None = None) -> VideoConfig:
        """Parse a ``video_preprocessor_config.json`` dict; keys it lacks (or null) take ``for_family``'s values.

        Pixel bounds as ``Qwen2VLVideoProcessor.__init__`` reads them: ``size.shortest_edge`` /
        ``size.longest_edge``, overridden by top-level ``min_pixels`` / ``max_pixels`` (Qwen2 rule only: the
        Qwen3 class ignores those keys, so a file for it that sets them differently from ``size`` is refused).
        With ``pre``, the file's patch sizes and mean/std must agree with the image settings. Settings this
        module cannot reproduce raise ConfigError naming the field.
        """
        base = cls.for_family(family)
        if d is None:
            return base
        if not isinstance(d, dict):
            raise ConfigError(f"video_preprocessor_config.json must hold a JSON object, got {type(d).__name__}")
        _check_video_supported(d, pre)
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"video preprocessor config size must be a dict of pixel bounds, got {size!r}")
        min_pixels = size.get("shortest_edge", base.min_pixels)
        max_pixels = size.get("longest_edge", base.max_pixels)
        for key, current in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            value = d.get(key)
            if value is None:
                continue
            if base.sampling == "qwen3" and value != current:
                raise ConfigError(f"video preprocessor config {key}={value!r} differs from size ({current!r}); "
                                  "Qwen3VLVideoProcessor ignores it: set size.shortest_edge/longest_edge")
            min_pixels, max_pixels = (value, max_pixels) if key == "min_pixels" else (min_pixels, value)

        def get(key: str) -> Any:
            return d[key] if d.get(key) is not None else getattr(base, key)

        return cls(sampling=base.sampling, min_pixels=min_pixels, max_pixels=max_pixels, fps=get("fps"),
                   min_frames=get("min_frames"), max_frames=get("max_frames"),
                   cap_pixels_per_frame=get("cap_pixels_per_frame"), max_video_tokens=get("max_video_tokens"))

    def to_dict(self, pre: PreprocessConfig | None = None) -> dict:
        """A ``video_preprocessor_config.json`` dict that ``from_dict`` and transformers' video processor of this
        sampling rule load to the same settings (with ``pre``, also its patch sizes and mean/std)."""
        d = {
            "video_processor_type": _CLASS_DEFAULTS[self.sampling]["processor"],
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": int(BICUBIC),
            "do_rescale": True,
            "rescale_factor": RESCALE_FACTOR,
            "do_normalize": True,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "do_sample_frames": True,
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "cap_pixels_per_frame": self.cap_pixels_per_frame,
            "max_video_tokens": self.max_video_tokens,
        }
        if pre is not None:
            d.update(patch_size=pre.patch_size, temporal_patch_size=pre.temporal_patch_size,
                     merge_size=pre.merge_size, image_mean=list(pre.image_mean), image_std=list(pre.image_std))
        return d


def _check_video_supported(d: dict, pre: PreprocessConfig | None) -> None:
    """Refuse video processor settings the transformers pipeline would honour but this module does not."""
    check_supported(d, "video preprocessor config")
    if d.get("num_frames") is not None:
        raise ConfigError(f"video preprocessor config num_frames={d['num_frames']!r} is not supported "
                          "(frames are sampled by fps)")
    if d.get("do_sample_frames") not in (None, True, False):
        raise ConfigError(f"video preprocessor config do_sample_frames must be true or false, "
                          f"got {d['do_sample_frames']!r}")
    if d.get("do_sample_frames") is False and d.get("fps") is not None:
        # The Qwen2 class's backward-compatible default (false, fps null) means "the caller decides"; a file that
        # sets an fps and turns sampling off asks for every frame, which this package does not do.
        raise ConfigError("video preprocessor config sets do_sample_frames=false with an fps; "
                          "only sampling by fps is supported")
    if pre is None:
        return
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        if d.get(key) is not None and d[key] != getattr(pre, key):
            raise ConfigError(f"video preprocessor config {key}={d[key]!r} differs from the image "
                              f"preprocessor's {getattr(pre, key)!r}")
    for key in ("image_mean", "image_std"):
        value = d.get(key)
        if value is None:
            continue
        values = [value] * 3 if is_number(value) else value
        if not (isinstance(values, list) and all(is_number(v) for v in values)
                and [float(v) for v in values] == list(getattr(pre, key))):
            raise ConfigError(f"video preprocessor config {key}={value!r} differs from the image "
                              f"preprocessor's {list(getattr(pre, key))}")


# --------------------------------------------------------------------------------------------------
# Frame sampling
# --------------------------------------------------------------------------------------------------


def sample_frame_indices(num_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                         max_frames: int = 768, temporal_patch_size: int = 2) -> list[int]:
    """Indices of the frames to keep when sampling ``fps`` frames per second from a ``video_fps`` video.

    Follows ``Qwen2VLVideoProcessor.sample_frames`` (its fps branch): the count is clamped to
    [min_frames, min(max_frames, num_frames)], floored to a multiple of ``temporal_patch_size``, and the
    indices are ``torch.arange(0, num_frames, num_frames / count).int()`` (float32 steps, as there).
    Deviations: a video shorter than ``temporal_patch_size`` frames returns all its frames (the reference
    divides by zero); preprocess_video pads them. The float step can make the reference's arange one
    element longer than ``count`` (e.g. 1001 frames at 1 fps sampled at 0.5 fps: 501 indices ending in
    1001, past the last frame, so indexing the video fails); indices >= num_frames are dropped here, and
    an extra index that is still in range is kept, as in the reference.
    Qwen3-VL's variant is ``sample_frame_indices_qwen3``.
    """
    _check_video_args(num_frames, video_fps, fps)
    max_frames = math.floor(min(max_frames, num_frames) / temporal_patch_size) * temporal_patch_size
    count = num_frames / video_fps * fps
    count = min(max(count, min_frames), max_frames, num_frames)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count == 0:
        return list(range(num_frames))
    indices = torch.arange(0, num_frames, num_frames / count, dtype=torch.float32).int().tolist()
    return [i for i in indices if i < num_frames]


def sample_frame_indices_qwen3(num_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                               max_frames: int = 768) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames`` (fps branch): evenly spaced, first and last frame included.

    The count is ``int(num_frames / video_fps * fps)`` clamped to [min_frames, max_frames] and to
    num_frames, not rounded to a multiple of T (padding happens later), and the indices are
    ``np.linspace(0, num_frames - 1, count).round()``.
    """
    _check_video_args(num_frames, video_fps, fps)
    count = int(num_frames / video_fps * fps)
    count = min(max(count, min_frames), max_frames, num_frames)
    return np.linspace(0, num_frames - 1, count).round().astype(int).tolist()


def positive_number(value: Any) -> bool:
    """A real number above zero and finite (not a bool, a string or a tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def sample_frames_by_fps(videos: list[Any], fps: float, video_fps: Any, video_config: VideoConfig,
                         temporal_patch_size: int) -> list[Any]:
    """Frames in memory sampled at ``fps`` with the family's rule, from their own rate ``video_fps`` (one value, or
    one per video); files are left as they are (sampled when they are read)."""
    if video_fps is None:
        raise InputError("sampling frames in memory by fps needs their own frame rate: pass video_fps")
    try:
        rates = [video_fps] * len(videos) if positive_number(video_fps) else list(video_fps)
    except TypeError:  # not iterable (a 0-d tensor too)
        rates = None
    if rates is None or isinstance(video_fps, (str, bytes)):
        raise InputError(f"video_fps {video_fps!r} is neither a positive number nor one per video")
    if len(rates) != len(videos):
        raise InputError(f"video_fps has {len(rates)} entries for {len(videos)} videos")
    bad = [i for i, rate in enumerate(rates) if not positive_number(rate)]
    if bad:
        raise InputError(f"video_fps of video {bad[0]}, {rates[bad[0]]!r}, is not a positive number of frames per "
                         f"second")
    vcfg = dataclasses.replace(video_config, fps=fps)
    sampled = []
    for video, rate in zip(videos, rates, strict=True):
        if is_file_input(video):
            sampled.append(video)
            continue
        frames = video if hasattr(video, "shape") else list(video)
        keep = sample_indices(len(frames), rate, vcfg, temporal_patch_size)
        sampled.append(frames[keep] if hasattr(frames, "shape") else [frames[i] for i in keep])
    return sampled


def sample_indices(num_frames: int, video_fps: float, vcfg: VideoConfig, temporal_patch_size: int) -> list[int]:
    """The frame indices ``vcfg``'s rule keeps from a ``num_frames`` video at ``video_fps``."""
    if vcfg.sampling == "qwen3":
        return sample_frame_indices_qwen3(num_frames, video_fps, vcfg.fps, vcfg.min_frames, vcfg.max_frames)
    return sample_frame_indices(num_frames, video_fps, vcfg.fps, vcfg.min_frames, vcfg.max_frames,
                                temporal_patch_size)


def _check_video_args(num_frames: int, video_fps: float, fps: float) -> None:
    if num_frames <= 0:
        raise InputError(f"num_frames must be positive, got {num_frames}")
    if not video_fps > 0 or not fps > 0:
        raise InputError(f"video_fps and fps must be positive, got video_fps={video_fps}, fps={fps}")


# --------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------


def smart_resize_qwen3(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Copied from transformers ``qwen3_vl.video_processing_qwen3_vl.smart_resize``: sides below ``factor`` are
    first scaled up (``int`` truncation), then the bounds apply to frames x height x width (``t_bar`` rounds the
    frame count to a multiple of ``temporal_factor``; ``beta`` uses the count itself). PreprocessError instead of
    ValueError; the caller passes at least ``temporal_factor`` frames (the reference raises below that).
    """
    if height <= 0 or width <= 0:
        raise PreprocessError(f"frame size must be positive, got height {height}, width {width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise PreprocessError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                              f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_target_size(num_frames: int, height: int, width: int, pre: PreprocessConfig, vcfg: VideoConfig,
                      min_pixels: int | None = None, max_pixels: int | None = None,
                      name: str = "video") -> tuple[int, int]:
    """(height, width) every frame of a ``num_frames``-frame clip of ``height`` x ``width`` is resized to.

    qwen2: ``Qwen2VLVideoProcessor.resize`` (the image ``smart_resize`` with the video bounds; with
    ``cap_pixels_per_frame`` the per-frame maximum becomes ``max(min(max_pixels, budget * T // num_frames),
    int(min_pixels * 1.05))``, budget = ``int(max_video_tokens * factor**2 * 0.9)``). qwen3:
    ``Qwen3VLVideoProcessor.resize`` (``smart_resize_qwen3``; with the cap, ``max_pixels`` becomes
    ``max(min(max_video_tokens * factor**2, max_pixels // num_frames), int(min_pixels * 1.05)) * num_frames``).
    ``num_frames`` is the sampled count before padding, as there; for qwen3 a count below T is sized as T
    (module docstring). ``min_pixels`` / ``max_pixels`` override the config's bounds (the processors' ``size``).
    """
    lo = vcfg.min_pixels if min_pixels is None else min_pixels
    hi = vcfg.max_pixels if max_pixels is None else max_pixels
    factor, t = pre.factor, pre.temporal_patch_size
    if num_frames <= 0:
        raise PreprocessError(f"{name}: no frames")
    try:
        if vcfg.sampling == "qwen3":
            frames = max(num_frames, t)
            if vcfg.cap_pixels_per_frame:
                per_frame = max(min(vcfg.max_video_tokens * factor * factor, hi // frames), int(lo * 1.05))
                hi = per_frame * frames
            target = smart_resize_qwen3(frames, height, width, t, factor, lo, hi)
        else:
            if vcfg.cap_pixels_per_frame:
                budget = int(vcfg.max_video_tokens * factor * factor * 0.9)
                hi = max(min(hi, budget * t // num_frames), int(lo * 1.05))
            target = smart_resize(height, width, factor, lo, hi)
    except PreprocessError as e:
        raise PreprocessError(f"{name}: {e}") from None
    if min(target) <= 0:
        raise PreprocessError(f"{name}: resizes to {target} with min_pixels={lo}; raise min_pixels")
    return target


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def read_video(path: str | os.PathLike, vcfg: VideoConfig, *, name: str | None = None,
               temporal_patch_size: int = 2, max_input_pixels: int | None = None,
               size: Callable[[int, int, int], tuple[int, int]] | None = None,
               counted: int | None = None, stop: Event | None = None) -> tuple[np.ndarray, VideoInfo]:
    """Decode the frames ``vcfg``'s sampling rule keeps: ((F, H, W, 3) uint8 RGB, VideoInfo).

    ``video_io.read_video_frames`` (``read_video_pyav``) with the family's ``sample_frames`` (``sample_indices``)
    as its sampler; ``size``, ``counted``, ``stop`` and the errors are its.
    """

    def pick_indices(total_frames: int, video_fps: float) -> list[int]:
        return sample_indices(total_frames, video_fps, vcfg, temporal_patch_size)

    frames, info = read_video_frames(path, pick_indices, name=name, max_input_pixels=max_input_pixels, size=size,
                                     counted=counted, stop=stop)
    info.requested_fps = float(vcfg.fps)
    return frames, info



# --------------------------------------------------------------------------------------------------
# Frames -> pixel values
# --------------------------------------------------------------------------------------------------


def preprocess_video_file(path: str | os.PathLike, pre: PreprocessConfig, vcfg: VideoConfig, *,
                          index: int | None = None, min_pixels: int | None = None, max_pixels: int | None = None,
                          max_input_pixels: int | None = None, resize: str | None = None,
                          counted: int | None = None,
                          stop: Event | None = None) -> tuple[torch.Tensor, tuple[int, int, int], VideoInfo]:
    """A video file -> (pixel_values float32 (t*h*w, C*T*P*P), grid (t, h, w), VideoInfo), as transformers'
    video processor of ``vcfg.sampling`` does with ``load_video(backend="pyav")``, ``do_sample_frames=True``,
    ``fps=vcfg.fps`` and ``cap_pixels_per_frame=vcfg.cap_pixels_per_frame``. Errors name the file
    (``input_name("video", index, path)``); ``max_input_pixels`` refuses a larger frame before decoding.
    ``counted``, ``stop``: as in ``read_video``.
    """
    name = input_name("video", index, path)
    backend = check_resize_backend(resize or "torch", "resize")
    sized = {}

    def size(count: int, height: int, width: int) -> tuple[int, int]:
        sized["target"] = video_target_size(count, height, width, pre, vcfg, min_pixels, max_pixels, name)
        return sized["target"] if backend == "torch" else (height, width)  # PIL resizes later, from the source

    frames, info = read_video(path, vcfg, name=name, temporal_patch_size=pre.temporal_patch_size,
                              max_input_pixels=max_input_pixels, size=size, counted=counted, stop=stop)
    values, grid = _preprocess_frames(list(frames), pre, vcfg, name, min_pixels, max_pixels, None, backend,
                                      target=sized["target"])
    return values, grid, info


def preprocess_video(frames: Any, config: PreprocessConfig, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, index: int | None = None,
                     max_input_pixels: int | None = None, resize: str | None = None,
                     video_config: VideoConfig | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Decoded frames -> (pixel_values float32 (t*h*w, C*T*P*P), grid_thw (t, h, w)) in the video layout.

    ``frames``: a sequence of anything ``load_image`` takes, or a uint8 array / tensor (F, H, W, C) or
    (F, C, H, W). The count is padded to a multiple of T by repeating the last frame (the video processors'
    ``patchify``), so grid_t = ceil(F / T). Frames are not sampled here (``read_video`` samples files).

    With ``video_config``: the clip is sized by ``video_target_size`` (the video processors' ``resize``) and
    ``resize`` None means "torch", the video processors' own pipeline (they exist only for torchvision);
    "pil" resizes the same sizes with PIL (the encoder always passes one). Without it: every frame goes through
    the PIL image processor's steps, sized by the image ``smart_resize`` of the first frame with ``config``'s
    bounds, and ``resize`` None means "pil". ``min_pixels`` / ``max_pixels``
    override the bounds; ``max_input_pixels`` applies to frames given as paths.
    """
    name = input_name("video", index)
    backend = check_resize_backend(resize or ("torch" if video_config is not None else "pil"), "resize")
    return _preprocess_frames(_split_frames(frames, name), config, video_config, name, min_pixels, max_pixels,
                              max_input_pixels, backend)


def _preprocess_frames(frame_list: list, pre: PreprocessConfig, vcfg: VideoConfig | None, name: str,
                       min_pixels: int | None, max_pixels: int | None, max_input_pixels: int | None,
                       backend: str,
                       target: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resize, normalise and patchify one group of T frames at a time: peak memory is the output plus T frames.

    ``target``: the clip's size when the caller already chose it (frames decoded from a file may already have
    it; resizing to their own size is a no-op)."""
    load = _loader(frame_list, name, max_input_pixels, backend, video=vcfg is not None)
    first = load(0)
    height, width = first.shape[:2]
    if target is None and vcfg is None:
        target = image_target_size(height, width, pre, min_pixels, max_pixels, name)
    elif target is None:
        target = video_target_size(len(frame_list), height, width, pre, vcfg, min_pixels, max_pixels, name)
    table = normalize_table(pre.image_mean, pre.image_std, backend)
    t = pre.temporal_patch_size
    grid_t = math.ceil(len(frame_list) / t)
    group = np.empty((t, 3, *target), dtype=np.float32)
    out = None
    for g in range(grid_t):
        for slot in range(t):
            i = g * t + slot
            if i >= len(frame_list):  # padding; slot 0 of a group is always a real frame
                group[slot] = group[slot - 1]
                continue
            rgb = first if i == 0 else load(i)
            if vcfg is not None and rgb.shape != first.shape:
                raise PreprocessError(f"{name}: frame {i} is {rgb.shape[1]}x{rgb.shape[0]}, frame 0 "
                                      f"{width}x{height}; a video's frames must share one size")
            group[slot] = normalize(_resize_array(rgb, *target, backend), table)
        rows, (_, grid_h, grid_w) = patchify(group, t, pre.patch_size, pre.merge_size)
        if out is None:
            out = torch.empty((grid_t * rows.shape[0], rows.shape[1]), dtype=torch.float32)
        out[g * rows.shape[0]:(g + 1) * rows.shape[0]] = rows
    return out, (grid_t, grid_h, grid_w)


def _resize_array(rgb: np.ndarray, height: int, width: int, backend: str) -> np.ndarray:
    """A decoded HxWx3 frame resized by ``backend``: the video processors' uint8 torch resize, or PIL's."""
    if backend == "torch":
        return resize_uint8_torch(rgb, height, width)
    return resize_image(PIL.Image.fromarray(rgb), height, width, "pil")


def _loader(frame_list: list, name: str, max_input_pixels: int | None, backend: str, video: bool):
    """frame index -> HxWx3 uint8 RGB, converted as the chosen pipeline converts that input (module docstring)."""

    def load(i: int) -> np.ndarray:
        item = frame_list[i]
        frame_name = input_name(f"{name} frame", i, item)
        if video and isinstance(item, (np.ndarray, torch.Tensor)):
            return _video_array_to_rgb(as_hwc(item, frame_name), frame_name, check_aspect=i == 0)
        rgb = load_rgb(item, frame_name, check_aspect=i == 0, max_input_pixels=max_input_pixels,
                        backend=backend if video else "pil")
        return np.asarray(rgb)

    return load


def _video_array_to_rgb(hwc: np.ndarray, name: str, check_aspect: bool) -> np.ndarray:
    """The video processors' ``convert_to_rgb`` for uint8 frames: 1 channel repeated, an opaque alpha dropped."""
    if check_aspect:
        check_aspect_ratio(hwc.shape[0], hwc.shape[1], name)
    channels = hwc.shape[2]
    if channels == 1:
        return np.repeat(hwc, 3, axis=2)
    if channels == 4:
        if (hwc[..., 3] < 255).any():
            raise PreprocessError(f"{name}: frames with transparency are not supported for videos "
                                  "(composite them onto a background first)")
        return np.ascontiguousarray(hwc[..., :3])
    return hwc


def _split_frames(frames: Any, name: str) -> list:
    """A video input as a non-empty list of per-frame inputs."""
    if isinstance(frames, (np.ndarray, torch.Tensor)):
        if frames.ndim != 4:
            raise PreprocessError(f"{name}: expected a 4-D frame array (F, H, W, C) or (F, C, H, W), "
                                  f"got shape {tuple(frames.shape)}")
        frame_list = list(frames)
    elif isinstance(frames, Sequence) and not isinstance(frames, (str, bytes)):
        frame_list = list(frames)
    else:
        raise PreprocessError(f"{name}: expected a sequence of frames or a 4-D frame array, "
                              f"got {type(frames).__name__}")
    if not frame_list:
        raise PreprocessError(f"{name}: no frames")
    return frame_list
