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
  by repeating the last frame anyway). Qwen2's sampler can also step one index past the last frame: dropped
  (vLLM's reader, ``as_vllm``, takes the last frame there).
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
from threading import Event
from typing import Any

import numpy as np
import PIL.Image
import torch

from ..errors import ConfigError, InputError, PreprocessError
from ..model.config import Family, family_named
from .images import FIXED_SETTINGS, PreprocessConfig, check_supported, image_target_size
from .pixels import (
    as_hwc,
    check_pixel_bounds,
    check_resize_backend,
    input_name,
    is_file_input,
    load_rgb,
    normalize,
    normalize_table,
    patchify,
    resize_image,
    whole_number,
)
from .video_io import VideoInfo, read_video_frames

# The two transformers video processors by sampling rule, and their class defaults (``size``, ``max_video_tokens``).
PROCESSORS = {"qwen2": "Qwen2VLVideoProcessor", "qwen3": "Qwen3VLVideoProcessor"}
_CLASS_DEFAULTS = {"qwen2": dict(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, max_video_tokens=128000),
                   "qwen3": dict(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, max_video_tokens=768)}
# A video processor file's keys that must agree with the image settings: a tower has one patch layout and one mean.
_SHARED_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")


def positive_number(value: Any) -> bool:
    """A real number above zero and finite (not a bool, a string or a tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True)
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
        if self.sampling not in PROCESSORS:
            raise ConfigError(f"VideoConfig.sampling must be one of {', '.join(PROCESSORS)}, got {self.sampling!r}")
        for key in ("min_pixels", "max_pixels", "min_frames", "max_frames", "max_video_tokens"):
            object.__setattr__(self, key, whole_number(getattr(self, key), f"VideoConfig.{key}"))
        if not positive_number(self.fps):
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
        """The class defaults of the transformers video processor this family uses (``AutoVideoProcessor``):
        ``Qwen2VLVideoProcessor`` for Qwen2-VL, Qwen2.5-VL and both Omnis (Qwen3-Omni too although its patch is 16:
        the bounds stay pixel counts, the size grid follows the checkpoint's patch), ``Qwen3VLVideoProcessor`` for
        the Qwen3-VL family. Released checkpoints write their own values (``from_dict``)."""
        sampling = family_named(family).video_sampling
        return cls(sampling=sampling, **_CLASS_DEFAULTS[sampling])

    @classmethod
    def from_dict(cls, d: dict | None, family: Family | str, pre: PreprocessConfig | None = None) -> VideoConfig:
        """Parse a ``video_preprocessor_config.json`` dict; keys it lacks (or null) take ``for_family``'s values.

        Pixel bounds as ``Qwen2VLVideoProcessor.__init__`` reads them: ``size.shortest_edge`` /
        ``size.longest_edge``, overridden by top-level ``min_pixels`` / ``max_pixels`` (Qwen2 rule only: the
        Qwen3 class ignores those keys, so a file for it that sets them differently from ``size`` is refused).
        With ``pre``, the file's patch sizes and mean/std must agree with the image settings. Every setting the
        video processor would honour and this module does not reproduce is refused here, naming the key.
        """
        base = cls.for_family(family)
        if d is None:
            return base
        what = "video preprocessor config"
        if not isinstance(d, dict):
            raise ConfigError(f"video_preprocessor_config.json must hold a JSON object, got {type(d).__name__}")
        check_supported(d, what)
        if d.get("num_frames") is not None:
            raise ConfigError(f"{what} num_frames={d['num_frames']!r} is not supported (frames are sampled by fps)")
        if d.get("do_sample_frames") is False and d.get("fps") is not None:
            # The Qwen2 class's backward-compatible default (false, fps null) means "the caller decides"; a file
            # that sets an fps and turns sampling off asks for every frame, which this package does not do.
            raise ConfigError(f"{what} sets do_sample_frames=false with an fps; only sampling by fps is supported")
        size = d.get("size")  # None: the class defaults; one without a bound is refused, as the reference's resize
        if size is not None and not isinstance(size, dict):
            raise ConfigError(f"{what} size must be a dict of pixel bounds, got {size!r}")
        bounds = {"min_pixels": base.min_pixels if size is None else size.get("shortest_edge"),
                  "max_pixels": base.max_pixels if size is None else size.get("longest_edge")}
        for key, current in list(bounds.items()):
            if d.get(key) is not None and d[key] != current:
                if base.sampling == "qwen3":
                    raise ConfigError(f"{what} {key}={d[key]!r} differs from size ({current!r}); "
                                      "Qwen3VLVideoProcessor ignores it: set size.shortest_edge/longest_edge")
                bounds[key] = d[key]
        if None in bounds.values():
            raise ConfigError(f"{what} size {size!r} lacks shortest_edge or longest_edge")
        for key in _SHARED_KEYS if pre is not None else ():
            if d.get(key) is not None:
                try:  # read as the image settings read it (a scalar mean is one per channel)
                    same = getattr(dataclasses.replace(pre, **{key: d[key]}), key) == getattr(pre, key)
                except ConfigError:
                    same = False
                if not same:
                    raise ConfigError(f"{what} {key}={d[key]!r} differs from the image preprocessor's "
                                      f"{getattr(pre, key)!r}")
        given = {key: d[key] for key in ("fps", "min_frames", "max_frames", "cap_pixels_per_frame",
                                         "max_video_tokens") if d.get(key) is not None}
        return dataclasses.replace(base, **bounds, **given)

    def to_dict(self, pre: PreprocessConfig | None = None) -> dict:
        """A ``video_preprocessor_config.json`` dict that ``from_dict`` and transformers' video processor of this
        sampling rule load to the same settings (with ``pre``, also its patch sizes and mean/std)."""
        d = {
            "video_processor_type": PROCESSORS[self.sampling],
            **FIXED_SETTINGS,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "do_sample_frames": True,
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "cap_pixels_per_frame": self.cap_pixels_per_frame,
            "max_video_tokens": self.max_video_tokens,
        }
        if pre is not None:
            d.update({key: getattr(pre, key) for key in _SHARED_KEYS},
                     image_mean=list(pre.image_mean), image_std=list(pre.image_std))
        return d


def sample_indices(num_frames: int, video_fps: float, vcfg: VideoConfig, temporal_patch_size: int,
                   clamp: bool = False) -> list[int]:
    """The frame indices ``vcfg``'s rule keeps when sampling ``vcfg.fps`` frames a second from ``num_frames``
    frames at ``video_fps`` (both positive: the file's header or the caller's ``video_fps`` is checked first).

    ``Qwen3VLVideoProcessor.sample_frames`` (fps branch) for qwen3: evenly spaced, first and last frame included,
    the count not rounded to a multiple of T (padding happens later). ``Qwen2VLVideoProcessor.sample_frames`` (fps
    branch) for qwen2: a count that is a multiple of T, float32 steps; where the reference's count rounds down to 0
    it divides by zero: a video shorter than T frames keeps all its frames, a longer one T of them (one temporal
    patch, whatever fps or max_frames asked). The float step can make the reference's arange one element longer
    than the count (1001 frames at 1 fps sampled at 0.5 fps: 501 indices ending in 1001, past the last frame, so
    indexing the video fails); indices past the last frame are dropped, an extra one still in range is kept.
    ``clamp``: they are the last frame instead, as vLLM's ``Qwen2VLVideoBackend`` clamps them.
    """
    if vcfg.sampling == "qwen3":
        # The rate capped at every frame before int() (the same count): a huge fps would overflow it.
        count = min(max(int(min(num_frames / video_fps * vcfg.fps, num_frames)), vcfg.min_frames), vcfg.max_frames,
                    num_frames)
        return np.linspace(0, num_frames - 1, count).round().astype(int).tolist()
    t = temporal_patch_size
    if num_frames < t:
        return list(range(num_frames))
    max_frames = math.floor(min(vcfg.max_frames, num_frames) / t) * t
    count = min(max(num_frames / video_fps * vcfg.fps, vcfg.min_frames), max_frames, num_frames)
    count = max(math.floor(count / t) * t, t)
    indices = torch.arange(0, num_frames, num_frames / count, dtype=torch.float32).int().tolist()
    return [min(i, num_frames - 1) for i in indices if clamp or i < num_frames]


def sample_frames_by_fps(videos: list[Any], fps: float, video_fps: Any, video_config: VideoConfig,
                         temporal_patch_size: int) -> tuple[list[Any], list[VideoInfo | None]]:
    """Frames in memory sampled at ``fps`` with the family's rule, from their own rate ``video_fps`` (one value, or
    one per video), each with its ``VideoInfo`` as a file of that rate gets (its height and width unknown: None);
    files are left as they are (sampled, and given theirs, when they are read), with None."""
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
    sampled, infos = [], []
    for i, (video, rate) in enumerate(zip(videos, rates, strict=True)):
        info = None
        if not is_file_input(video):
            frames = checked_frames(video, input_name("video", i))
            keep = sample_indices(len(frames), rate, vcfg, temporal_patch_size)
            video = frames[keep] if hasattr(frames, "shape") else [frames[i] for i in keep]
            info = VideoInfo(len(frames), float(rate), keep, None, None, requested_fps=fps)
        sampled.append(video)
        infos.append(info)
    return sampled, infos


def video_target_size(num_frames: int, height: int, width: int, pre: PreprocessConfig, vcfg: VideoConfig,
                      min_pixels: int | None = None, max_pixels: int | None = None,
                      name: str = "video") -> tuple[int, int]:
    """(height, width) every frame of a ``num_frames``-frame clip (at least one) of ``height`` x ``width`` is
    resized to: ``Qwen2VLVideoProcessor.resize`` (the image ``smart_resize`` with the video bounds) or
    ``Qwen3VLVideoProcessor.resize`` (``smart_resize`` of the clip), ``max_pixels`` first lowered to the token budget
    with ``cap_pixels_per_frame``, as there. ``num_frames`` is the sampled count before padding, as there; for
    qwen3 a count below T is sized as T (module docstring). ``min_pixels`` / ``max_pixels`` override the config's
    bounds (the processors' ``size``).
    """
    lo = vcfg.min_pixels if min_pixels is None else min_pixels
    hi = vcfg.max_pixels if max_pixels is None else max_pixels
    factor, t = pre.factor, pre.temporal_patch_size
    if vcfg.sampling == "qwen2":
        if vcfg.cap_pixels_per_frame:
            budget = int(vcfg.max_video_tokens * factor * factor * 0.9)
            hi = max(min(hi, budget * t // num_frames), int(lo * 1.05))
        return image_target_size(height, width, pre, lo, hi, name)
    frames = max(num_frames, t)
    if vcfg.cap_pixels_per_frame:
        hi = max(min(vcfg.max_video_tokens * factor * factor, hi // frames), int(lo * 1.05)) * frames
    if height < factor or width < factor:  # Qwen3's smart_resize first scales a small side up (int truncation)
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return image_target_size(height, width, pre, lo, hi, name, frames, t)


def preprocess_video_file(path: str | os.PathLike, pre: PreprocessConfig, vcfg: VideoConfig, *,
                          index: int | None = None, min_pixels: int | None = None, max_pixels: int | None = None,
                          max_input_pixels: int | None = None, counted: int | None = None,
                          stop: Event | None = None, as_vllm: bool = False
                          ) -> tuple[torch.Tensor, tuple[int, int, int], VideoInfo]:
    """A video file -> (pixel_values float32 (t*h*w, C*T*P*P), grid (t, h, w), VideoInfo), as transformers'
    video processor of ``vcfg.sampling`` does with ``load_video(backend="pyav")``, ``do_sample_frames=True``,
    ``fps=vcfg.fps`` and ``cap_pixels_per_frame=vcfg.cap_pixels_per_frame``. Errors name the file;
    ``max_input_pixels``, ``counted``, ``stop`` and the file errors: ``video_io.read_video_frames``'s. ``as_vllm``:
    as vLLM 0.33 reads the file instead (frames turned upright, Qwen2's tail index clamped).
    """
    name = input_name("video", index, path)
    frames, info = read_video_frames(
        path, lambda total, rate: sample_indices(total, rate, vcfg, pre.temporal_patch_size, as_vllm), name=name,
        size=lambda *clip: video_target_size(*clip, pre, vcfg, min_pixels, max_pixels, name),
        max_input_pixels=max_input_pixels, counted=counted, stop=stop, turn=as_vllm)
    info.requested_fps = vcfg.fps
    return *_pixel_rows(len(frames), frames.__getitem__, pre, "torch"), info


def checked_frames(frames: Any, name: str) -> Any:
    """A video in memory as its frames: the array or tensor itself, or a list; a PreprocessError naming ``name``
    for anything else (a single image, a string) or no frames."""
    if (not isinstance(frames, (Sequence, np.ndarray, torch.Tensor)) or isinstance(frames, (str, bytes))
            or getattr(frames, "ndim", 4) != 4):
        got = f"shape {tuple(frames.shape)}" if hasattr(frames, "shape") else type(frames).__name__
        raise PreprocessError(f"{name}: expected a sequence of frames or a 4-D frame array (F, H, W, C) or "
                              f"(F, C, H, W), got {got}")
    if len(frames) == 0:
        raise PreprocessError(f"{name}: no frames")
    return frames if hasattr(frames, "shape") else list(frames)


def preprocess_video(frames: Any, config: PreprocessConfig, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, index: int | None = None,
                     max_input_pixels: int | None = None, resize: str | None = None,
                     video_config: VideoConfig | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Decoded frames, not sampled here -> (pixel_values float32 (t*h*w, C*T*P*P), grid_thw (t, h, w)) in the
    video layout. ``frames``: a sequence of anything ``pixels.load_rgb`` takes, or a uint8 array / tensor (F, H, W, C)
    or (F, C, H, W); padded to a multiple of T by repeating the last frame (the video processors' ``patchify``).

    With ``video_config``: the clip is sized by ``video_target_size`` and ``resize`` None means "torch", the video
    processors' own pipeline (they exist only for torchvision); "pil" resizes the same sizes with PIL. Without it:
    every frame goes through the PIL image processor's steps, sized by the image ``smart_resize`` of the first
    frame, and ``resize`` None means "pil". ``max_input_pixels`` applies to frames given as paths.
    """
    name = input_name("video", index)
    video = video_config is not None
    backend = check_resize_backend(resize or ("torch" if video else "pil"), "resize")
    frame_list = list(checked_frames(frames, name))

    def rgb(i: int) -> PIL.Image.Image:
        """Frame ``i`` in RGB, converted as the chosen pipeline converts that input (module docstring)."""
        item, frame_name = frame_list[i], input_name(f"{name} frame", i, frame_list[i])
        if video and isinstance(item, (np.ndarray, torch.Tensor)):  # transparency: module docstring
            hwc = as_hwc(item, frame_name)
            if hwc.shape[2] == 4 and (hwc[..., 3] < 255).any():
                raise PreprocessError(f"{frame_name}: frames with transparency are not supported for videos "
                                      "(composite them onto a background first)")
        return load_rgb(item, frame_name, check_aspect=i == 0, max_input_pixels=max_input_pixels,
                        backend=backend if video else "pil")

    first = rgb(0)
    if video:
        target = video_target_size(len(frame_list), first.height, first.width, config, video_config, min_pixels,
                                   max_pixels, name)
    else:
        target = image_target_size(first.height, first.width, config, min_pixels, max_pixels, name)

    def frame(i: int) -> np.ndarray:
        image = first if i == 0 else rgb(i)
        if video and image.size != first.size:
            raise PreprocessError(f"{name}: frame {i} is {image.width}x{image.height}, frame 0 "
                                  f"{first.width}x{first.height}; a video's frames must share one size")
        return resize_image(image, *target, backend)

    return _pixel_rows(len(frame_list), frame, config, backend)


def _pixel_rows(count: int, frame: Callable[[int], np.ndarray], pre: PreprocessConfig,
                backend: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``count`` frames (``frame(i)``: HxWx3 uint8 at the clip's size) normalised and patchified T at a time, the
    last repeated up to a multiple of T: peak memory is the output plus T frames."""
    table = normalize_table(pre.image_mean, pre.image_std, backend)
    t = pre.temporal_patch_size
    grid_t = math.ceil(count / t)
    out = None
    for g in range(grid_t):
        group = []
        for i in range(g * t, (g + 1) * t):  # slot 0 of a group is always a real frame
            group.append(normalize(frame(i), table) if i < count else group[-1])
        rows, (_, grid_h, grid_w) = patchify(np.stack(group), t, pre.patch_size, pre.merge_size)
        if out is None:
            out = torch.empty((grid_t * rows.shape[0], rows.shape[1]), dtype=torch.float32)
        out[g * rows.shape[0]:(g + 1) * rows.shape[0]] = rows
    return out, (grid_t, grid_h, grid_w)

