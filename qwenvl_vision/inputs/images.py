"""Image preprocessing for the Qwen-VL vision towers, bit-identical to transformers: a checkpoint's settings
(``PreprocessConfig``) and one image to pixel values (``preprocess_image``) or to its size unread (``probe_image``).

Reference (transformers 5.24): ``models/qwen2_vl/image_processing_pil_qwen2_vl.py``
(``Qwen2VLImageProcessorPil``), the ``PilBackend`` it inherits from (``image_processing_backends.py``),
and the helpers those call: ``image_utils.load_image`` (paths), ``image_transforms.convert_to_rgb``,
``resize``, ``rescale`` and ``normalize``. Per image the pipeline is

    load -> convert to RGB -> smart_resize -> PIL bicubic resize -> float64 x * (1/255) cast to float32
    -> (x - mean) / std in float32 -> patchify into merge-block order, duplicated over T

and every step here uses the same PIL calls and the same float arithmetic, so ``pixel_values`` are
bit-identical to the reference (the tests measure a max abs difference of exactly 0).

What transformers does per input, reproduced here (the steps are ``pixels``'s: ``load_rgb`` and what it calls):

- PIL image: if it has an "A" band (RGBA, LA, PA; also LAB, whose a* band is named "A") or
  ``info["transparency"]`` is set (P/L/RGB with tRNS), it is converted to RGBA and alpha-composited onto
  white with PIL; otherwise ``convert("RGB")`` (L, P, 1, CMYK naive, YCbCr, I, I;16, F ...). I;16 / I / F
  are *clipped* to 0..255 by PIL, not scaled, so a typical 16-bit photo comes out nearly all white.
  EXIF orientation is ignored for PIL inputs.
- Path: ``PIL.Image.open`` -> ``ImageOps.exif_transpose`` -> ``convert("RGB")`` first (this drops an
  RGBA/LA alpha channel *without* compositing), then the PIL rule above. A P or L image whose tRNS is
  a single index/level keeps it as an RGB colour in ``info``, so every pixel of that colour becomes
  white; a P image with per-entry alpha bytes loses its transparency entirely.
- uint8 array / tensor: 1 channel is repeated to 3; 4 channels are blended onto white in float64 and
  rounded with ``np.round`` (half to even), which can differ by one level from PIL's alpha_composite.

Deviations from the reference, on purpose:

- Arrays must be uint8 (transformers also takes floats in 0..1); HxW arrays are accepted as grayscale
  (transformers rejects them); 2-channel arrays are rejected (transformers too, less clearly).
- Array layout: numpy arrays are read as HWC and torch tensors as CHW when both readings fit (e.g.
  shape (3, 500, 3)); transformers always guesses channels-first in that ambiguous case. When only one
  reading fits, both agree.
- ``os.PathLike`` paths are accepted (transformers takes ``str`` only); URLs and base64 strings are not.
- A 16-bit file (PNG I;16) given as a path with ``resize="torch"`` is read like the PIL path (clipped to 0..255):
  transformers' torch backend decodes it with torchvision's ``decode_image``, which keeps the uint16 values, and
  rescales them as if they were 8-bit (pixel values in the hundreds), which no model was trained on.
- Rescale + normalise is a per-channel table of the 256 uint8 levels (``pixels.normalize_table``) instead of
  the reference's float64 copy of the image: the same bits, less memory and time.

Videos are ``video.py`` (sampling, the video processors' sizes, frames to pixel values) and ``video_io.py`` (files).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch

from ..errors import ConfigError
from ..model.config import CLIP_MEAN, CLIP_STD, Family, family_named
from .pixels import (
    BICUBIC,
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
    open_header,
    patchify,
    resize_image,
    smart_resize,
    whole_number,
)


@dataclass(frozen=True)
class PreprocessConfig:
    """Preprocessing settings of one checkpoint (its ``preprocessor_config.json``).

    Field defaults are transformers' ``Qwen2VLImageProcessor`` class defaults (56*56 and 28*28*1280
    pixels, CLIP mean/std); the released checkpoints differ, so use ``for_family`` or ``from_dict``.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    resize: str = "pil"  # "pil" or "torch": which transformers backend the pixels match (module docstring)

    def __post_init__(self) -> None:
        check_resize_backend(self.resize, "PreprocessConfig.resize")
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            object.__setattr__(self, key, whole_number(getattr(self, key), f"PreprocessConfig.{key}"))
        check_pixel_bounds(self.min_pixels, self.max_pixels,
                           ("PreprocessConfig.min_pixels", "PreprocessConfig.max_pixels"))
        for key in ("image_mean", "image_std"):
            # A scalar means the same value for all three channels, as transformers' normalize allows.
            value = getattr(self, key)
            value = (value,) * 3 if isinstance(value, (int, float)) else value
            if not isinstance(value, (list, tuple)) or not all(is_number(v) for v in value):
                raise ConfigError(f"PreprocessConfig.{key} must be 3 numbers (R, G, B), got {value!r}")
            value = tuple(float(v) for v in value)
            if len(value) != 3 or not all(math.isfinite(v) for v in value):
                raise ConfigError(f"PreprocessConfig.{key} must have 3 values (R, G, B), got {value}")
            object.__setattr__(self, key, value)
        if any(s == 0 for s in self.image_std):
            raise ConfigError(f"PreprocessConfig.image_std must be non-zero, got {self.image_std}")

    @property
    def factor(self) -> int:
        """Side granularity of a resized image: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def for_family(cls, family: Family | str) -> PreprocessConfig:
        """The released checkpoints' settings for a family (a ``config.Family`` or its model_type)."""
        spec = family_named(family)
        return cls(patch_size=spec.patch_size, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                   image_mean=spec.image_mean, image_std=spec.image_std, resize=spec.resize)

    @classmethod
    def from_dict(cls, d: dict | None, family: Family | str) -> PreprocessConfig:
        """Parse a ``preprocessor_config.json`` dict; keys it lacks take transformers' class defaults (the field
        defaults; the resize backend the family's), ``d=None`` (no file) the family's values.

        Pixel bounds follow ``Qwen2VLImageProcessorPil.__init__``: ``size.shortest_edge`` /
        ``size.longest_edge`` (Qwen3-VL files), overridden by top-level ``min_pixels`` / ``max_pixels``
        (Qwen2.5-VL files). Settings this module cannot reproduce (no resize, another resample filter,
        another rescale factor ...) raise ConfigError instead of being silently ignored.
        """
        if d is None:
            return cls.for_family(family)
        base = cls(resize=family_named(family).resize)
        if not isinstance(d, dict):
            raise ConfigError(f"preprocessor_config.json must hold a JSON object, got {type(d).__name__}")
        check_supported(d)
        size = d.get("size")
        if size is not None and not isinstance(size, dict):
            raise ConfigError(f"preprocessor config size must be a dict of pixel bounds, got {size!r}")
        # Older files spelled the size keys min_pixels / max_pixels; a top-level key overrides size; a size without
        # a bound is refused, as transformers' resize refuses it (no size at all: the class defaults).
        bounds = {key: d[key] if d.get(key) is not None else getattr(base, key) if size is None else
                  size.get(edge, size.get(key)) for key, edge in (("min_pixels", "shortest_edge"),
                                                                   ("max_pixels", "longest_edge"))}
        if None in bounds.values():
            raise ConfigError(f"preprocessor config size {size!r} lacks shortest_edge or longest_edge")

        given = {key: d[key] for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
                 if d.get(key) is not None}
        # ``...Fast`` names transformers' torchvision processor; any other name (``Qwen2VLImageProcessor``,
        # ``...Pil``, none) the PIL/numpy processor that name loaded by default before transformers 5.
        if "image_processor_type" in d:
            given["resize"] = "torch" if str(d["image_processor_type"]).endswith("Fast") else "pil"
        return dataclasses.replace(base, **bounds, **given)

    def to_dict(self) -> dict:
        """A ``preprocessor_config.json`` dict that both ``from_dict`` and transformers load identically.

        Both spellings of the pixel bounds are written so that old and new readers agree.
        """
        return {
            "image_processor_type": "Qwen2VLImageProcessorFast" if self.resize != "pil" else "Qwen2VLImageProcessor",
            **FIXED_SETTINGS,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
        }


# What a processor file says of the steps this package runs always (check_supported refuses any other value).
FIXED_SETTINGS = {"do_convert_rgb": True, "do_resize": True, "resample": int(BICUBIC), "do_rescale": True,
                  "rescale_factor": RESCALE_FACTOR, "do_normalize": True}


def check_supported(d: dict, what: str = "preprocessor config") -> None:
    """Reject settings the transformers pipeline would honour but this package does not (the image and the
    video processors share these; ``what`` names the file in the message)."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(key) is False:
            raise ConfigError(f"{what} sets {key}=false, which is not supported")
    if d.get("resample") is not None and d["resample"] != int(BICUBIC):
        raise ConfigError(f"{what} resample={d['resample']!r} is not supported (only 3, bicubic)")
    factor = d.get("rescale_factor")
    if factor is not None and not (is_number(factor) and math.isclose(factor, RESCALE_FACTOR, rel_tol=1e-9)):
        raise ConfigError(f"{what} rescale_factor={factor!r} is not supported (only 1/255)")
    for key in ("do_center_crop", "do_pad"):
        if d.get(key):
            raise ConfigError(f"{what} sets {key}=true, which is not supported")


def image_target_size(height: int, width: int, config: PreprocessConfig, min_pixels: int | None,
                      max_pixels: int | None, name: str, num_frames: int = 1, temporal_factor: int = 1
                      ) -> tuple[int, int]:
    """smart_resize with the config's bounds (or the overrides), errors naming the input."""
    min_pixels = config.min_pixels if min_pixels is None else min_pixels
    max_pixels = config.max_pixels if max_pixels is None else max_pixels
    check_aspect_ratio(height, width, name)  # smart_resize's own check, naming the input
    # A side that rounds to 0 leaves an area below min_pixels (at least 1): scaled up to one factor at least.
    return smart_resize(height, width, config.factor, min_pixels, max_pixels, num_frames, temporal_factor)


def preprocess_image(image: Any, config: PreprocessConfig, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, index: int | None = None,
                     max_input_pixels: int | None = None, resize: str | None = None,
                     on_header: Callable[[PIL.Image.Image], None] | None = None
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (pixel_values float32 (h*w, C*T*P*P), grid_thw (1, h, w)), as transformers' Qwen2VL
    image processor: ``resize="pil"`` its PIL backend (``Qwen2VLImageProcessorPil``), ``"torch"`` its
    torchvision backend; None takes ``config.resize``.

    ``min_pixels`` / ``max_pixels`` override the config's bounds for this call (the reference's ``size``
    call argument). The still image is repeated over the T temporal slots of each row. A file whose
    header declares more than ``max_input_pixels`` pixels is refused before decoding (None: no limit
    beyond PIL's own; the reference has none). ``on_header``: ``pixels.open_header``'s, for a file.
    """
    backend = check_resize_backend(resize or config.resize, "resize")
    name = input_name("image", index, image)
    rgb = load_rgb(image, name, check_aspect=True, max_input_pixels=max_input_pixels, backend=backend,
                   on_header=on_header)
    height, width = image_target_size(rgb.height, rgb.width, config, min_pixels, max_pixels, name)
    table = normalize_table(config.image_mean, config.image_std, backend)
    normalized = normalize(resize_image(rgb, height, width, backend), table)
    # The reference broadcasts the single frame over T; a zero-stride view, copied once by patchify.
    frames = np.broadcast_to(normalized[None], (config.temporal_patch_size, *normalized.shape))
    return patchify(frames, config.temporal_patch_size, config.patch_size, config.merge_size)


def probe_image(image: Any, config: PreprocessConfig, *, index: int | None = None, min_pixels: int | None = None,
                max_pixels: int | None = None, max_input_pixels: int | None = None,
                name: str | None = None) -> None:
    """Check an input without decoding its pixels.

    Catches what can be known up front (missing, empty or unidentifiable file, unsupported type, zero-size
    array, aspect ratio over 200, a target size of zero, a file above max_input_pixels) so that batch APIs
    fail before any compute, with the words loading would have used (``input_name``, ``open_header``).
    ``name``: how messages name the input, if not as image `index` (a video's first frame).
    """
    name = name or input_name("image", index, image)
    if is_file_input(image):
        with open_header(image, name, max_input_pixels, check_aspect=False) as opened:
            height, width = opened.height, opened.width
    elif isinstance(image, PIL.Image.Image):
        height, width = image.height, image.width
    else:
        height, width = as_hwc(image, name).shape[:2]
    image_target_size(height, width, config, min_pixels, max_pixels, name)

