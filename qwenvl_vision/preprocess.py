"""Image and video preprocessing for the Qwen-VL vision towers, bit-identical to transformers.

Reference (transformers 5.24): ``models/qwen2_vl/image_processing_pil_qwen2_vl.py``
(``Qwen2VLImageProcessorPil``), the ``PilBackend`` it inherits from (``image_processing_backends.py``),
and the helpers those call: ``image_utils.load_image`` (paths), ``image_transforms.convert_to_rgb``,
``resize``, ``rescale`` and ``normalize``. Per image the pipeline is

    load -> convert to RGB -> smart_resize -> PIL bicubic resize -> float64 x * (1/255) cast to float32
    -> (x - mean) / std in float32 -> patchify into merge-block order, duplicated over T

and every step here uses the same PIL calls and the same float arithmetic, so ``pixel_values`` are
bit-identical to the reference (the tests measure a max abs difference of exactly 0).

What transformers does per input, reproduced here (see ``_pil_to_rgb`` / ``_load_path``):

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
- Rescale + normalise is a per-channel table of the 256 uint8 levels (``_normalize_table``) instead of
  the reference's float64 copy of the image: the same bits, less memory and time.
- Video lives in ``video.py`` (files, sampling, the video processors' sizes, torch pipeline); its
  ``preprocess_video``, ``sample_frame_indices`` and ``sample_frame_indices_qwen3`` stay importable from here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
from einops import rearrange

from .config import CLIP_MEAN as OPENAI_CLIP_MEAN
from .config import CLIP_STD as OPENAI_CLIP_STD
from .config import FAMILIES, FAMILY_ALIASES
from .errors import ConfigError, PreprocessError

RESCALE_FACTOR = 1 / 255  # BaseImageProcessor.rescale_factor
MAX_ASPECT_RATIO = 200
BICUBIC = PIL.Image.Resampling.BICUBIC  # == 3 == transformers' PILImageResampling.BICUBIC
RESIZE_BACKENDS = ("pil", "torch")
# Files whose header declares more pixels are refused before decoding (max_input_pixels=None: no limit).
# Decoding a path holds at most about 8 bytes per pixel at its peak (measured: the decoded image and, for a
# rotated or non-RGB file, its transposed or converted copy), so 64 MP is ~0.5 GB: well under PIL's own
# decompression-bomb limit (PIL.Image.MAX_IMAGE_PIXELS, 89.5 MP, a warning; an error at twice that) and above every
# common camera (61 MP).
DEFAULT_MAX_INPUT_PIXELS = 64_000_000




# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreprocessConfig:
    """Preprocessing settings of one checkpoint (its ``preprocessor_config.json``).

    Field defaults are transformers' ``Qwen2VLImageProcessor`` class defaults (56*56 and 28*28*1280
    pixels, CLIP mean/std); the released checkpoints differ, so use ``for_family`` or ``from_dict``.
    """

    patch_size: int
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    resize: str = "pil"  # "pil" or "torch": which transformers backend the pixels match (module docstring)

    def __post_init__(self) -> None:
        check_resize_backend(self.resize, "PreprocessConfig.resize")
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"PreprocessConfig.{key} must be a positive int, got {value!r}")
        for key in ("image_mean", "image_std"):
            # A scalar means the same value for all three channels, as transformers' normalize allows.
            value = getattr(self, key)
            value = (value,) * 3 if isinstance(value, (int, float)) else value
            if not isinstance(value, (list, tuple)) or not all(_is_number(v) for v in value):
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
    def for_family(cls, family: str) -> PreprocessConfig:
        """The released checkpoints' settings for a family (a config model_type, see config.FAMILIES)."""
        spec = FAMILIES.get(FAMILY_ALIASES.get(family, family))
        if spec is None:
            raise ConfigError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
        return cls(patch_size=spec.patch_size, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                   image_mean=spec.image_mean, image_std=spec.image_std, resize=spec.resize)

    @classmethod
    def from_dict(cls, d: dict | None, family: str) -> PreprocessConfig:
        """Parse a ``preprocessor_config.json`` dict; keys it lacks (or ``d=None``) take the family's values.

        Pixel bounds follow ``Qwen2VLImageProcessorPil.__init__``: ``size.shortest_edge`` /
        ``size.longest_edge`` (Qwen3-VL files), overridden by top-level ``min_pixels`` / ``max_pixels``
        (Qwen2.5-VL files). Settings this module cannot reproduce (no resize, another resample filter,
        another rescale factor ...) raise ConfigError instead of being silently ignored.
        """
        base = cls.for_family(family)
        if d is None:
            return base
        if not isinstance(d, dict):
            raise ConfigError(f"preprocessor_config.json must hold a JSON object, got {type(d).__name__}")
        check_supported(d)
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"preprocessor config size must be a dict of pixel bounds, got {size!r}")
        # Older files spelled the size keys min_pixels / max_pixels.
        min_pixels = size.get("shortest_edge", size.get("min_pixels", base.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", base.max_pixels))
        if d.get("min_pixels") is not None:
            min_pixels = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_pixels = d["max_pixels"]

        def get(key: str) -> Any:
            return d[key] if d.get(key) is not None else getattr(base, key)

        return cls(
            patch_size=get("patch_size"),
            temporal_patch_size=get("temporal_patch_size"),
            merge_size=get("merge_size"),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=get("image_mean"),
            image_std=get("image_std"),
            resize=resize_backend_of(d["image_processor_type"]) if "image_processor_type" in d else base.resize,
        )

    def to_dict(self) -> dict:
        """A ``preprocessor_config.json`` dict that both ``from_dict`` and transformers load identically.

        Both spellings of the pixel bounds are written so that old and new readers agree.
        """
        return {
            "image_processor_type": "Qwen2VLImageProcessorFast" if self.resize == "torch" else "Qwen2VLImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": int(BICUBIC),
            "do_rescale": True,
            "rescale_factor": RESCALE_FACTOR,
            "do_normalize": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
        }


def check_resize_backend(value: Any, what: str) -> str:
    if value not in RESIZE_BACKENDS:
        raise ConfigError(f"{what} must be one of {', '.join(RESIZE_BACKENDS)}, got {value!r}")
    return value


def resize_backend_of(image_processor_type: Any) -> str:
    """The resize backend a checkpoint's ``image_processor_type`` names: ``...Fast`` is transformers'
    torchvision processor ("torch"); any other name (``Qwen2VLImageProcessor``, ``...Pil``, none) is the
    PIL/numpy processor that name loaded by default before transformers 5 ("pil")."""
    return "torch" if isinstance(image_processor_type, str) and image_processor_type.endswith("Fast") else "pil"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_supported(d: dict, what: str = "preprocessor config") -> None:
    """Reject settings the transformers pipeline would honour but this package does not (the image and the
    video processors share these; ``what`` names the file in the message)."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(key) is False:
            raise ConfigError(f"{what} sets {key}=false, which is not supported")
    if d.get("resample") is not None and d["resample"] != int(BICUBIC):
        raise ConfigError(f"{what} resample={d['resample']!r} is not supported (only 3, bicubic)")
    factor = d.get("rescale_factor")
    if factor is not None and not (_is_number(factor) and math.isclose(factor, RESCALE_FACTOR, rel_tol=1e-9)):
        raise ConfigError(f"{what} rescale_factor={factor!r} is not supported (only 1/255)")
    for key in ("do_center_crop", "do_pad"):
        if d.get(key):
            raise ConfigError(f"{what} sets {key}=true, which is not supported")


# --------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    Copied from transformers ``qwen2_vl.image_processing_pil_qwen2_vl.smart_resize`` (Python ``round``
    rounds half to even, so 70/28 = 2.5 gives 56). Raises PreprocessError (not a bare ValueError) for an
    aspect ratio above 200 and, unlike the reference, for a non-positive side.
    """
    if height <= 0 or width <= 0:
        raise PreprocessError(f"image size must be positive, got height {height}, width {width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise PreprocessError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _target_size(height: int, width: int, config: PreprocessConfig, min_pixels: int | None,
                 max_pixels: int | None, name: str) -> tuple[int, int]:
    """smart_resize with the config's bounds (or the overrides), errors naming the input."""
    min_pixels = config.min_pixels if min_pixels is None else min_pixels
    max_pixels = config.max_pixels if max_pixels is None else max_pixels
    try:
        target = smart_resize(height, width, config.factor, min_pixels, max_pixels)
    except PreprocessError as e:
        raise PreprocessError(f"{name}: {e}") from None
    if min(target) <= 0:
        # Only reachable with min_pixels < factor**2 (round() gave 0 and no upscale happened); the
        # reference would fail inside PIL.
        raise PreprocessError(f"{name}: resizes to {target} with min_pixels={min_pixels}; raise min_pixels")
    return target


def _check_input_pixels(height: int, width: int, max_input_pixels: int | None, name: str) -> None:
    """Refuse a file whose header declares more than max_input_pixels, before anything is decoded."""
    if max_input_pixels is not None and height * width > max_input_pixels:
        raise PreprocessError(f"{name}: {width}x{height} = {height * width:,} pixels is above the input limit of "
                              f"{max_input_pixels:,} (max_input_pixels, embed --max-input-pixels)")


def _check_aspect_ratio(height: int, width: int, name: str) -> None:
    """The smart_resize aspect check, run on the header size before anything is decoded."""
    if height <= 0 or width <= 0:
        raise PreprocessError(f"{name}: zero-size image (height {height}, width {width})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise PreprocessError(
            f"{name}: aspect ratio {ratio:.1f} (height {height}, width {width}) exceeds {MAX_ASPECT_RATIO}"
        )


# --------------------------------------------------------------------------------------------------
# Loading and RGB conversion
# --------------------------------------------------------------------------------------------------


def input_name(kind: str, index: int | None, item: Any = None) -> str:
    """How every error message names an input, whichever entry point meets the problem: a file by its path as
    given ("image 'photos/a.jpg'"), anything else by its position ("image 3", "video 2 frame 5"; "image" alone
    without an index). A path is what the user can act on, and embed's positions mean nothing to its user."""
    if isinstance(item, (str, os.PathLike)):
        return f"{kind} {os.fspath(item)!r}"
    return kind if index is None else f"{kind} {index}"


def load_image(image: Any, *, index: int | None = None) -> PIL.Image.Image:
    """Load a path, PIL image, uint8 numpy array (HxWxC or HxW) or uint8 torch tensor (CxHxW) as RGB.

    The conversion is the one ``Qwen2VLImageProcessorPil`` applies to that input type (module docstring):
    paths go through ``transformers.image_utils.load_image`` (EXIF transpose, convert("RGB")) and then
    ``convert_to_rgb``; PIL images only through ``convert_to_rgb``; arrays through its numpy branch.
    Raises PreprocessError naming ``index`` and the path for anything unreadable.
    """
    return _load_rgb(image, input_name("image", index, image))


def _load_rgb(image: Any, name: str, *, check_aspect: bool = False,
              max_input_pixels: int | None = None, backend: str = "pil") -> PIL.Image.Image:
    """load_image; with check_aspect, the aspect ratio is checked before any pixel is decoded.

    max_input_pixels applies to paths only (what their header declares, checked before decoding): a PIL
    image or an array passed in is already in memory. ``backend``: whose RGB conversion, the PIL or the
    torchvision image processor's (they differ for paths and 4-channel arrays; module docstring).
    """
    if isinstance(image, (str, os.PathLike)):
        return _load_path(image, name, check_aspect, max_input_pixels, composite=backend == "pil")
    if isinstance(image, PIL.Image.Image):
        if check_aspect or min(image.size) <= 0:
            _check_aspect_ratio(image.height, image.width, name)
        return _pil_to_rgb(image, name)
    array = _as_hwc(image, name)
    if check_aspect:
        _check_aspect_ratio(array.shape[0], array.shape[1], name)
    to_rgb = _array_to_rgb_torch if backend == "torch" else _array_to_rgb
    return PIL.Image.fromarray(np.ascontiguousarray(to_rgb(array)))


def _as_hwc(image: Any, name: str) -> np.ndarray:
    """A uint8 numpy array (read as HWC) or torch tensor (read as CHW) as HxWxC; anything else is refused."""
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8:
            raise PreprocessError(f"{name}: expected a uint8 tensor, got {image.dtype}")
        return _array_to_hwc(image.detach().cpu().numpy(), name, prefer_channels_first=True)
    if isinstance(image, np.ndarray):
        return _array_to_hwc(image, name, prefer_channels_first=False)
    raise PreprocessError(f"{name}: unsupported input type {type(image).__name__}; expected a path, PIL image, "
                          "uint8 numpy array or uint8 torch tensor")


def _open_header(path: str | os.PathLike, name: str, max_input_pixels: int | None,
                 check_aspect: bool) -> PIL.Image.Image:
    """``PIL.Image.open`` (the header only) after the file checks, then the header checks: what probing and
    loading a file share, so that each kind of bad file gets the same message from both. The caller closes it.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise PreprocessError(f"{name}: file not found")
    if not os.path.isfile(path):
        raise PreprocessError(f"{name}: not a regular file")
    if os.path.getsize(path) == 0:
        raise PreprocessError(f"{name}: file is empty (0 bytes)")
    try:
        opened = PIL.Image.open(path)
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad headers
        raise _unreadable(e, name) from e
    try:
        # Reject before decoding megapixels.
        _check_input_pixels(opened.height, opened.width, max_input_pixels, name)
        if check_aspect:
            _check_aspect_ratio(opened.height, opened.width, name)
    except PreprocessError:
        opened.close()
        raise
    return opened


def _unreadable(error: Exception, name: str) -> PreprocessError:
    """The one message for a file PIL could not open or decode, by kind (header and pixel data alike: a file
    cut short can fail in either, depending on where the cut is)."""
    if isinstance(error, PIL.UnidentifiedImageError):
        return PreprocessError(f"{name}: not a recognised image file (corrupt, or not an image)")
    if isinstance(error, PIL.Image.DecompressionBombError):
        return PreprocessError(f"{name}: refused by PIL's decompression-bomb limit ({error})")
    if isinstance(error, PermissionError):
        return PreprocessError(f"{name}: cannot read file ({error.strerror})")
    # PIL's decoders raise OSError, ValueError, SyntaxError, EOFError ...
    return PreprocessError(f"{name}: corrupt or truncated image data ({type(error).__name__}: {error})")


def _load_path(path: str | os.PathLike, name: str, check_aspect: bool,
               max_input_pixels: int | None = None, composite: bool = True) -> PIL.Image.Image:
    """transformers.image_utils.load_image for a local file, then convert_to_rgb, with named errors.

    composite=False is the torchvision processor's decode (``decode_image(mode=RGB)``, EXIF applied), which
    keeps no transparency at all: a single tRNS colour is not turned white."""
    opened = _open_header(path, name, max_input_pixels, check_aspect)
    try:
        # load_image: EXIF orientation applied, then a plain convert("RGB") that drops any alpha band without
        # compositing. The reference copies the image in both (exif_transpose returns a copy, and convert to
        # the image's own mode is a copy); the same pixels come out of transposing in place (it decodes) and
        # of skipping convert when the image is RGB already and Pillow closed its file after decoding.
        PIL.ImageOps.exif_transpose(opened, in_place=True)
        if opened.mode == "RGB" and getattr(opened, "fp", None) is None:
            image = opened
        else:  # another mode, or a multi-frame file Pillow keeps open: convert, then close the file
            with opened:
                image = opened.convert("RGB")
    except Exception as e:  # noqa: BLE001 - see _unreadable
        opened.close()
        raise _unreadable(e, name) from e
    return _pil_to_rgb(image, name) if composite else image


def _pil_to_rgb(image: PIL.Image.Image, name: str) -> PIL.Image.Image:
    """transformers.image_transforms.convert_to_rgb, PIL branch: transparency composited onto white.

    "Has alpha" is decided exactly as the reference does: an "A" band (so RGBA, LA, PA, and LAB whose
    a* band is named "A"; not premultiplied RGBa/La) or a non-None ``info["transparency"]``.
    """
    try:
        has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
        if not has_alpha:  # convert to the image's own mode is a copy of the same pixels: skipped
            return image if image.mode == "RGB" else image.convert("RGB")
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    except Exception as e:  # unsupported mode conversions, or a lazily opened image that fails to decode
        raise PreprocessError(f"{name}: cannot convert mode {image.mode} to RGB ({type(e).__name__}: {e})") from e


def _array_to_hwc(array: np.ndarray, name: str, *, prefer_channels_first: bool) -> np.ndarray:
    """Validate a uint8 image array and return it as HxWxC with C in (1, 3, 4)."""
    if array.ndim not in (2, 3):
        raise PreprocessError(f"{name}: expected a 2-D or 3-D image array, got shape {tuple(array.shape)}")
    if array.size == 0:
        raise PreprocessError(f"{name}: zero-size array of shape {tuple(array.shape)}")
    if array.dtype != np.uint8:
        raise PreprocessError(f"{name}: expected a uint8 array, got {array.dtype}")
    if array.ndim == 2:
        return array[:, :, None]
    first_fits, last_fits = array.shape[0] in (1, 3, 4), array.shape[2] in (1, 3, 4)
    if first_fits and (prefer_channels_first or not last_fits):
        return array.transpose(1, 2, 0)
    if last_fits:
        return array
    raise PreprocessError(f"{name}: array of shape {tuple(array.shape)} has no axis of 1, 3 or 4 channels")


def _array_to_rgb_torch(hwc: np.ndarray) -> np.ndarray:
    """The torchvision processor's ``convert_to_rgb`` (uint8, channels-last): 1 channel repeated; 4 channels
    blended onto white in float32 and truncated back (``to_dtype(scale=True)`` multiplies by 255.999)."""
    channels = hwc.shape[2]
    if channels == 1:
        return np.repeat(hwc, 3, axis=2)
    if channels == 4:
        x = torch.from_numpy(np.array(hwc)).to(torch.float32).mul_(1.0 / 255)
        alpha = x[..., 3:]
        blended = x[..., :3] * alpha + (1 - alpha)
        return blended.mul(255 + 1.0 - 1e-3).to(torch.uint8).numpy()
    return hwc


def _array_to_rgb(hwc: np.ndarray) -> np.ndarray:
    """transformers.image_transforms.convert_to_rgb, numpy branch (uint8, channels-last)."""
    channels = hwc.shape[2]
    if channels == 1:
        return np.repeat(hwc, 3, axis=2)
    if channels == 4:
        # Float64 blend onto white rounded half-to-even: not PIL's alpha_composite rounding, so a
        # 4-channel array and the same pixels as a PIL RGBA image can differ by one level.
        alpha = hwc[..., 3:4] / 255
        return np.round(alpha * hwc[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return hwc


# --------------------------------------------------------------------------------------------------
# Resize, normalise, patchify
# --------------------------------------------------------------------------------------------------


def _resize(image: PIL.Image.Image, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """Resize an RGB image to (height, width) bicubic, as the ``backend``'s image processor does. HxWx3 uint8."""
    if backend == "torch":
        return resize_uint8_torch(np.asarray(image), height, width)
    # transformers.image_transforms.resize: PIL bicubic, no reducing_gap.
    return np.asarray(image.resize((width, height), resample=BICUBIC))


def resize_uint8_torch(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """HxWxC uint8 -> (height, width): transformers' torchvision processor, with torch only.

    That processor calls ``torchvision.transforms.v2.functional.resize(bicubic, antialias=True)`` on a contiguous
    uint8 CxHxW tensor; on the CPU torchvision hands uint8 straight to ``torch.nn.functional.interpolate``
    (``_do_native_uint8_resize_on_cpu`` is true for bicubic), whose uint8 kernel rounds and clamps itself, and
    it returns the input unchanged when the size already matches. The same call here gives the same bits
    without torchvision. (On a GPU torchvision instead interpolates float32, clamps and rounds; preprocessing
    here always runs on the CPU.)
    """
    if pixels.shape[:2] == (height, width):
        return pixels
    chw = torch.from_numpy(np.array(pixels.transpose(2, 0, 1), order="C"))  # a writable contiguous copy
    out = torch.nn.functional.interpolate(chw[None], size=[height, width], mode="bicubic", align_corners=False,
                                          antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def _normalize_table(mean: Sequence[float], std: Sequence[float], backend: str = "pil") -> np.ndarray:
    """(3, 256) float32: the normalised value of every uint8 level in every channel.

    Reference arithmetic, PIL processor: ``rescale`` computes ``float32(float64(x) * (1/255))`` and
    ``normalize`` ``(x - float32(mean)) / float32(std)`` in float32. Torchvision processor (and the video
    processors): rescale fused into normalize, ``(float32(x) - m) / s`` with ``m = float32(mean) * 255.0``
    (``_fuse_mean_std_and_rescale_factor``) and the same for ``s``, in float32 torch ops. Both are
    elementwise in (level, channel), so the table holds exactly the reference's bits, and lookups avoid the
    reference's float image copy.
    """
    if backend == "torch":
        scale = 1.0 / RESCALE_FACTOR
        mean_t = (torch.tensor(list(mean)) * scale)[:, None]
        std_t = (torch.tensor(list(std)) * scale)[:, None]
        return ((torch.arange(256, dtype=torch.float32)[None, :] - mean_t) / std_t).numpy()
    levels = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return (levels[None, :] - mean32) / std32


_ROWS_PER_CHUNK = 256


def _normalize(pixels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 -> 3xHxW float32 normalised values (rescale + normalize of the reference)."""
    height, width, channels = pixels.shape
    out = np.empty((channels, height, width), dtype=np.float32)
    # Chunks of rows because numpy copies uint8 indices to int64 first: 8 bytes per pixel for a
    # whole 16 MP image, a few MB per chunk.
    for c in range(channels):
        for top in range(0, height, _ROWS_PER_CHUNK):
            rows = slice(top, top + _ROWS_PER_CHUNK)
            out[c, rows] = table[c].take(pixels[rows, :, c])
    return out


def _patchify(frames: np.ndarray, config: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(F, C, H, W) float32 frames, F a multiple of T -> (t*h*w, C*T*P*P) rows and grid (t, h, w).

    Rows are in merge-block order (t, block_row, block_col, row_in_block, col_in_block) and each row is
    laid out (C, T, P, P): the reference's image ``patchify`` and the video processors' ``patchify``
    (``permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)`` of (B, t, T, C, h/m, m, P, w/m, m, P)), minus the batch.
    """
    num_frames, _, height, width = frames.shape
    t, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    rows = rearrange(frames, "(gt tp) c (bh m1 p1) (bw m2 p2) -> (gt bh bw m1 m2) (c tp p1 p2)",
                     tp=t, m1=m, m2=m, p1=p, p2=p)
    return torch.from_numpy(np.ascontiguousarray(rows)), (num_frames // t, height // p, width // p)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def preprocess_image(image: Any, config: PreprocessConfig, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, index: int | None = None,
                     max_input_pixels: int | None = None,
                     resize: str | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (pixel_values float32 (h*w, C*T*P*P), grid_thw (1, h, w)), as transformers' Qwen2VL
    image processor: ``resize="pil"`` its PIL backend (``Qwen2VLImageProcessorPil``), ``"torch"`` its
    torchvision backend; None takes ``config.resize``.

    ``min_pixels`` / ``max_pixels`` override the config's bounds for this call (the reference's ``size``
    call argument). The still image is repeated over the T temporal slots of each row. A file whose
    header declares more than ``max_input_pixels`` pixels is refused before decoding (None: no limit
    beyond PIL's own; the reference has none).
    """
    backend = check_resize_backend(resize or config.resize, "resize")
    name = input_name("image", index, image)
    rgb = _load_rgb(image, name, check_aspect=True, max_input_pixels=max_input_pixels, backend=backend)
    height, width = _target_size(rgb.height, rgb.width, config, min_pixels, max_pixels, name)
    table = _normalize_table(config.image_mean, config.image_std, backend)
    normalized = _normalize(_resize(rgb, height, width, backend), table)
    # The reference broadcasts the single frame over T; a zero-stride view, copied once by _patchify.
    frames = np.broadcast_to(normalized[None], (config.temporal_patch_size, *normalized.shape))
    return _patchify(frames, config)


def probe_image(image: Any, config: PreprocessConfig, *, index: int | None = None, min_pixels: int | None = None,
                max_pixels: int | None = None, max_input_pixels: int | None = None,
                name: str | None = None) -> tuple[int, int]:
    """Check an input without decoding its pixels; return the resized (height, width) it will get.

    Catches what can be known up front (missing, empty or unidentifiable file, unsupported type, zero-size
    array, aspect ratio over 200, a target size of zero, a file above max_input_pixels) so that batch APIs
    fail before any compute, with the words loading would have used (``input_name``, ``_open_header``).
    ``name``: how messages name the input, if not as image `index` (a video's first frame).
    """
    name = name or input_name("image", index, image)
    if isinstance(image, (str, os.PathLike)):
        with _open_header(image, name, max_input_pixels, check_aspect=False) as opened:
            height, width = opened.height, opened.width
    elif isinstance(image, PIL.Image.Image):
        height, width = image.height, image.width
    else:
        height, width = _as_hwc(image, name).shape[:2]
    _check_aspect_ratio(height, width, name)
    return _target_size(height, width, config, min_pixels, max_pixels, name)


# The video entry points moved to video.py, which imports this module; they are looked up on first use (PEP 562)
# so that importing either module first never meets a half-initialised other.
_MOVED_TO_VIDEO = ("preprocess_video", "sample_frame_indices", "sample_frame_indices_qwen3", "_split_frames",
                   "_check_video_args")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_VIDEO:
        from . import video

        return getattr(video, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
