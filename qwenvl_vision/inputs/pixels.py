"""An image's way from an input to pixel rows, step by step in this order, each bit-identical to transformers:
how errors name an input (``input_name``); a file's checks and its header (``check_regular_file``, ``open_header``:
the input pixel limit, the aspect ratio), read once, by the decode itself; RGB conversion (``load_rgb``) for either
resize backend; the target size (``smart_resize``); resize (``resize_image``, ``resize_uint8_torch``); rescale +
normalise as a per-channel table of the 256 uint8 levels (``normalize_table``, ``normalize``: the reference's bits
without its float copy of the image); ``patchify`` into merge-block order. The image and the video pipelines share
them; what each input type goes through, and the deliberate deviations, are ``images``'s and ``video``'s docstrings.

Reference (transformers 5.24): ``image_utils.load_image`` (paths), ``image_transforms.convert_to_rgb``, ``resize``,
``rescale`` and ``normalize`` as ``Qwen2VLImageProcessorPil`` (``image_processing_pil_qwen2_vl.py``) and the
``PilBackend`` / ``TorchvisionBackend`` it inherits (``image_processing_backends.py``) call them, the image
``smart_resize``, and the processors' ``patchify``.
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import os
import re
import stat
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
from einops import rearrange

from ..errors import ConfigError, PreprocessError
from .urls import redacted

RESCALE_FACTOR = 1 / 255  # BaseImageProcessor.rescale_factor
MAX_ASPECT_RATIO = 200
BICUBIC = PIL.Image.Resampling.BICUBIC  # == 3 == transformers' PILImageResampling.BICUBIC
# Whose pipeline the pixels match: transformers' PIL processor, its torchvision processor, or vLLM's image loading
# (ImageMediaIO) before that torchvision processor.
RESIZE_BACKENDS = ("pil", "torch", "vllm")
# The formats a file may be opened as: the raster formats Pillow decodes itself, vLLM 0.33's ImageMediaIO list. Not
# EPS, a PostScript program Pillow hands to Ghostscript, nor WMF (Windows) or the stubs (BUFR, GRIB, HDF5, MPEG).
IMAGE_FORMATS = ("AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO",
                 "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD",
                 "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB")
# Files whose header declares more pixels are refused before decoding (max_input_pixels=None: no limit): above
# every common camera, under PIL's own decompression-bomb limit, and about half a GB to decode.
DEFAULT_MAX_INPUT_PIXELS = 64_000_000


def check_resize_backend(value: Any, what: str) -> str:
    """``value`` if it names a resize backend (RESIZE_BACKENDS), else a ConfigError naming ``what``."""
    if value not in RESIZE_BACKENDS:
        raise ConfigError(f"{what} must be one of {', '.join(RESIZE_BACKENDS)}, got {value!r}")
    return value


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (JSON numbers as configs hold them)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def whole_number(value: Any, name: str, least: int = 1) -> int:
    """``value`` as a plain int (a NumPy or 0-d torch integer as the int it is) of at least ``least``; a
    ConfigError naming ``name`` otherwise (a bool, a float, a string)."""
    number = None
    with contextlib.suppress(TypeError):
        number = None if isinstance(value, bool) else operator.index(value)
    if number is None or number < least:
        raise ConfigError(f"{name} must be {'a positive integer' if least == 1 else f'an integer of at least {least}'}"
                          f", got {value!r}")
    return number


def check_pixel_bounds(min_pixels: int | None, max_pixels: int | None,
                       names: tuple[str, str] = ("min_pixels", "max_pixels")) -> None:
    """Pixel bounds, each a whole number already checked (``whole_number``, or the command line's types) or None
    (the checkpoint's): min not above max; ``names``: the two as the caller spells them."""
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ConfigError(f"{names[0]} {min_pixels} is above {names[1]} {max_pixels}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, num_frames: int = 1,
                 temporal_factor: int = 1) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    Copied from transformers ``qwen2_vl.image_processing_pil_qwen2_vl.smart_resize`` (Python ``round``
    rounds half to even, so 70/28 = 2.5 gives 56), without its aspect-ratio check: the caller runs
    ``check_aspect_ratio`` first, naming the input. With ``num_frames``, a clip's:
    ``qwen3_vl.video_processing_qwen3_vl.smart_resize``, whose bounds apply to frames x height x width (``t_bar``
    rounds the count to a multiple of ``temporal_factor``, ``beta`` uses the count itself); its scaling up of a
    side below ``factor`` is the caller's, and the caller passes at least ``temporal_factor`` frames (it raises
    below that).
    """
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


def check_input_pixels(height: int, width: int, max_input_pixels: int | None, name: str) -> None:
    """Refuse a file whose header declares more than max_input_pixels, before anything is decoded."""
    if max_input_pixels is not None and height * width > max_input_pixels:
        raise PreprocessError(f"{name}: {width}x{height} = {height * width:,} pixels is above the input limit of "
                              f"{max_input_pixels:,} (max_input_pixels, embed --max-input-pixels)")


def check_aspect_ratio(height: int, width: int, name: str) -> None:
    """The smart_resize aspect check, run on the header size before anything is decoded."""
    if height <= 0 or width <= 0:
        raise PreprocessError(f"{name}: zero-size image (height {height}, width {width})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise PreprocessError(f"{name}: aspect ratio {ratio:.1f} (height {height}, width {width}) exceeds "
                              f"{MAX_ASPECT_RATIO}")


class FileBytes:
    """A file's bytes held in memory under a name (a WebDataset member, an object read from storage): checked,
    decoded and named exactly as the file at ``name`` would be, its kind (image or video) by the name's
    extension. Nothing is written to disk.

    ``fetch`` (instead of ``data``): called for the bytes on first use (``read``), on the thread that decodes the
    input, with the most bytes they may have (the decode budget; None: no bound)."""

    def __init__(self, name: str | os.PathLike, data: bytes | None = None,
                 fetch: Callable[[int | None], bytes] | None = None) -> None:
        if (data is None) == (fetch is None):
            raise TypeError("FileBytes takes data or fetch, one of them")
        if not isinstance(name, (str, os.PathLike)):  # its extension says what it holds
            raise TypeError(f"FileBytes: name must be the file's name (str), got {type(name).__name__}")
        self.name, self._data, self._fetch, self._limit = os.fspath(name), data, fetch, None

    def read(self, limit: int | None = None) -> bytes:
        """The bytes, fetched by the first call with at most ``limit`` of them (fetched again after ``release``: with
        the first call's limit where none is given)."""
        if self._data is None:
            self._limit = limit = self._limit if limit is None else limit
            data = self._fetch(limit)
            if not isinstance(data, (bytes, bytearray, memoryview)):  # None read as "empty", a str as "corrupt"
                raise TypeError(f"its fetch returned {type(data).__name__}, not bytes")
            self._data = data  # returned as fetched: another thread may release it at once
            return data
        return self._data

    def release(self) -> None:
        """Drop fetched bytes (a decoded input waits for its batch with its pixels, not its file); a later ``read``
        fetches them again. Bytes given are the caller's, kept."""
        if self._fetch is not None:
            self._data = None

    @property
    def fetched(self) -> bool:
        """Whether the bytes are here (given, or fetched already)."""
        return self._data is not None

    def __repr__(self) -> str:
        size = f"{len(self._data)} bytes" if self._data is not None else "not fetched"
        return f"FileBytes({self.name!r}, {size})"


def is_url(text: str) -> bool:
    """A name with a scheme (``s3://``, ``https://``, ...): an object in storage, never a local path."""
    return isinstance(text, str) and bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text)) \
        and not text.lower().startswith("file://")


def local_name(text: str) -> str:
    """A ``file://`` URL (of no host, or localhost) as the local path it names; any other name as it is."""
    if isinstance(text, str) and text[:7].lower() == "file://" and \
            (parts := urllib.parse.urlsplit(text)).netloc.lower() in ("", "localhost"):
        return urllib.parse.unquote(parts.path, errors="surrogateescape")  # a name's bytes that are no UTF-8 kept
    return text


def is_file_input(item: Any) -> bool:
    """A file to decode: a path, or a file's bytes in memory."""
    return isinstance(item, (str, os.PathLike, FileBytes))


def file_name(item: str | os.PathLike | FileBytes) -> str:
    """A file input's name: its path, or the name its bytes go by."""
    return item.name if isinstance(item, FileBytes) else os.fspath(item)


def readable(item: str | os.PathLike | FileBytes) -> str | io.BytesIO:
    """What PIL and PyAV open: the path, or the bytes as a file."""
    return io.BytesIO(item.read()) if isinstance(item, FileBytes) else os.fspath(item)


def input_name(kind: str, index: int | None, item: Any = None) -> str:
    """How every error message names an input, whichever entry point meets the problem: a file by its path as
    given ("image 'photos/a.jpg'"), anything else by its position ("image 3", "video 2 frame 5"; "image" alone
    without an index). A path is what the user can act on, and embed's positions mean nothing to its user. A URL's
    secrets are not shown (``urls.redacted``): messages end up in logs."""
    if is_file_input(item):
        name = file_name(item)
        return f"{kind} {(redacted(name) if is_url(name) else name)!r}"
    return kind if index is None else f"{kind} {index}"


def check_regular_file(path: str | FileBytes, name: str) -> None:
    """The checks every file input gets before its decoder sees it (images and videos alike), so each kind of bad
    path reads the same: missing, not a regular file, empty (a file in memory: empty only)."""
    if isinstance(path, FileBytes):
        if not path.read():
            raise PreprocessError(f"{name}: file is empty (0 bytes)")
        return
    try:  # os.path.exists would read a folder it may not search, or a loop of links, as "not found"
        mode, size = (info := os.stat(path)).st_mode, info.st_size
    except FileNotFoundError:
        raise PreprocessError(f"{name}: " + ("a URL, not a file: embed and serve fetch URLs, FileBytes(url, fetch=...) "
                                             "brings its bytes" if is_url(path) else "file not found")) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise PreprocessError(f"{name}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(mode):
        raise PreprocessError(f"{name}: not a regular file")
    if size == 0:
        raise PreprocessError(f"{name}: file is empty (0 bytes)")


def load_rgb(image: Any, name: str, *, check_aspect: bool = False, max_input_pixels: int | None = None,
             backend: str = "pil", on_header: Callable[[PIL.Image.Image], None] | None = None) -> PIL.Image.Image:
    """An input as an RGB PIL image, converted as transformers' image processor of ``backend`` converts that
    input type (``images``'s docstring), with named errors; with check_aspect, the aspect ratio is checked before
    any pixel is decoded.

    A file: ``open_header`` (its checks, ``max_input_pixels`` and ``on_header``), then ``image_utils.load_image`` and
    ``convert_to_rgb``; the torchvision processor's decode (``decode_image(mode=RGB)``, EXIF applied) keeps no
    transparency at all, so a single tRNS colour is not turned white there, and a GIF's transparent index and the
    screen around its first frame show its background colour. Deviations: torchvision's WebP decoder ignores EXIF
    orientation, which transformers asks for (and torchcodec, its preferred decoder, applies); a WebP is turned
    upright here, as is a file whose orientation only Pillow reads (in XMP, a PNG's text chunk or an eXIf chunk
    after the pixels; torchvision reads a JPEG's Exif segment and a PNG's eXIf chunk before them). A PIL image or
    an array passed in is already in memory. ``backend``: whose RGB conversion, the PIL or the torchvision image
    processor's (they differ for files and 4-channel arrays).
    """
    composite = backend == "pil"
    if isinstance(image, PIL.Image.Image):
        if check_aspect or min(image.size) <= 0:
            check_aspect_ratio(image.height, image.width, name)
        return _pil_to_rgb(image, name)
    if not is_file_input(image):
        array = as_hwc(image, name)
        if check_aspect:
            check_aspect_ratio(array.shape[0], array.shape[1], name)
        return PIL.Image.fromarray(np.ascontiguousarray(_array_to_rgb(array, composite)))
    opened = open_header(image, name, max_input_pixels, check_aspect, on_header)
    try:
        if backend == "vllm":  # vLLM's ImageMediaIO.load_bytes: normalize_image keeps the image as it was where the
            with opened:  # EXIF transpose of a copy fails
                turned = opened
                with contextlib.suppress(Exception):
                    turned = PIL.ImageOps.exif_transpose(opened)
                return _onto_white_as_vllm(turned)
        # load_image: EXIF orientation applied, then a plain convert("RGB") that drops any alpha band without
        # compositing. The reference copies the image in both (exif_transpose returns a copy, and convert to
        # the image's own mode is a copy); the same pixels come out of transposing in place (it decodes) and
        # of skipping convert when the image is RGB already and Pillow closed its file after decoding.
        if not composite and opened.format == "GIF" and opened.mode in ("P", "L"):  # no EXIF in a GIF
            with opened:
                return _gif_as_decode_gif(opened)
        PIL.ImageOps.exif_transpose(opened, in_place=True)
        if opened.mode == "RGB" and getattr(opened, "fp", None) is None:
            rgb = opened
        elif composite and opened.mode == "P" and isinstance(opened.info.get("transparency"), int):
            with opened:
                return _palette_onto_white(opened)
        else:  # another mode, or a multi-frame file Pillow keeps open: convert, then close the file
            with opened:
                rgb = opened.convert("RGB")
    except Exception as e:  # noqa: BLE001 - see _unreadable
        opened.close()
        raise _unreadable(e, name, max_input_pixels) from e
    return _pil_to_rgb(rgb, name) if composite else rgb


def as_hwc(image: Any, name: str) -> np.ndarray:
    """A uint8 numpy array (read as HWC) or torch tensor (read as CHW) as HxWxC with C in (1, 3, 4); anything else
    is refused."""
    channels_first = isinstance(image, torch.Tensor)
    if channels_first:
        if image.dtype != torch.uint8:
            raise PreprocessError(f"{name}: expected a uint8 tensor, got {image.dtype}")
        try:
            image = image.detach().cpu().numpy()
        except (RuntimeError, TypeError, NotImplementedError) as e:  # a sparse or meta tensor: no dense pixels
            raise PreprocessError(f"{name}: cannot read the tensor's pixels ({e})") from None
    elif not isinstance(image, np.ndarray):
        raise PreprocessError(f"{name}: unsupported input type {type(image).__name__}; expected a path, PIL image, "
                              "uint8 numpy array or uint8 torch tensor")
    image = np.asarray(image)  # an ndarray subclass (np.matrix) indexes its own way
    if image.ndim not in (2, 3):
        raise PreprocessError(f"{name}: expected a 2-D or 3-D image array, got shape {tuple(image.shape)}")
    if image.size == 0:
        raise PreprocessError(f"{name}: zero-size array of shape {tuple(image.shape)}")
    if image.dtype != np.uint8:
        raise PreprocessError(f"{name}: expected a uint8 array, got {image.dtype}")
    if image.ndim == 2:
        return image[:, :, None]
    first_fits, last_fits = image.shape[0] in (1, 3, 4), image.shape[2] in (1, 3, 4)
    if first_fits and (channels_first or not last_fits):
        return image.transpose(1, 2, 0)
    if last_fits:
        return image
    raise PreprocessError(f"{name}: array of shape {tuple(image.shape)} has no axis of 1, 3 or 4 channels")


def open_header(path: str | os.PathLike | FileBytes, name: str, max_input_pixels: int | None, check_aspect: bool,
                on_header: Callable[[PIL.Image.Image], None] | None = None) -> PIL.Image.Image:
    """``PIL.Image.open`` (the header only) after the file checks, then the header checks: what probing and
    loading a file share, so that each kind of bad file gets the same message from both. The caller closes it.
    ``on_header(opened)`` runs once the checks pass, before any pixel is decoded (the decode budget admits the
    file there, at the cost its header tells).

    With a ``max_input_pixels``, that limit replaces PIL's decompression-bomb limit: this process's
    ``PIL.Image.MAX_IMAGE_PIXELS`` is raised to it if lower (never lowered, and left alone when None), so a
    file within the limit decodes the same in every process that decodes it (a Ray actor included),
    whatever PIL's default there.
    """
    check_regular_file(path, name)
    # PIL's bomb check (an error above twice ``MAX_IMAGE_PIXELS``, a warning above it) reads the process-wide value
    # at every open, also inside its plugins (GIF frames, TIFF tiles): it cannot be passed per call, so the value is
    # raised where our own header check, which runs first, takes over.
    limit = PIL.Image.MAX_IMAGE_PIXELS
    if max_input_pixels is not None and limit is not None and limit < max_input_pixels:
        PIL.Image.MAX_IMAGE_PIXELS = max_input_pixels
    try:
        opened = PIL.Image.open(readable(path), formats=IMAGE_FORMATS)
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad headers
        raise _unreadable(e, name, max_input_pixels) from e
    try:
        # Reject before decoding megapixels.
        check_input_pixels(opened.height, opened.width, max_input_pixels, name)
        if check_aspect:
            check_aspect_ratio(opened.height, opened.width, name)
        if on_header is not None:
            on_header(opened)
    except BaseException:  # closed whatever stops it here
        opened.close()
        raise
    return opened


def _unreadable(error: Exception, name: str, max_input_pixels: int | None) -> PreprocessError:
    """The one message for a file PIL could not open or decode, by kind (header and pixel data alike: a file
    cut short can fail in either, depending on where the cut is)."""
    if isinstance(error, PIL.UnidentifiedImageError):
        return PreprocessError(f"{name}: not a recognised image file (corrupt, or not an image)")
    if isinstance(error, PIL.Image.DecompressionBombError) and max_input_pixels is not None:  # PIL's check came first
        return PreprocessError(f"{name}: it declares more than {2 * PIL.Image.MAX_IMAGE_PIXELS:,} pixels, above the "
                               f"input limit of {max_input_pixels:,} (max_input_pixels, embed --max-input-pixels)")
    if isinstance(error, PIL.Image.DecompressionBombError):
        return PreprocessError(f"{name}: refused by PIL's decompression-bomb limit ({error})")
    if isinstance(error, PermissionError):
        return PreprocessError(f"{name}: cannot read file ({error.strerror})")
    # PIL's decoders raise OSError, ValueError, SyntaxError, EOFError ...
    return PreprocessError(f"{name}: corrupt or truncated image data ({type(error).__name__}: {error})")


def _palette_onto_white(image: PIL.Image.Image) -> PIL.Image.Image:
    """A palette image with one transparent index, as ``convert("RGB")`` then ``_pil_to_rgb`` give it, with
    one full-size copy instead of four (RGB, RGBA, the white background, the composite; ~21 bytes a pixel).

    There the transparency becomes a colour (the transparent index's), every pixel of that colour gets alpha 0
    and all others 255, and compositing onto white gives white or the pixel's own colour: so the palette entries
    of that colour are made white and the image converted once, the same bits."""
    image.load()
    index = image.info.pop("transparency")
    probe = PIL.Image.new("P", (1, 1))  # Pillow's own way (Image.convert) of finding the transparent colour
    probe.putpalette(image.palette, image.palette.mode)
    probe.putpixel((0, 0), index)
    transparent = list(probe.convert("RGB").getpixel((0, 0)))
    palette = image.getpalette("RGB")
    for i in range(0, len(palette), 3):
        if palette[i:i + 3] == transparent:
            palette[i:i + 3] = [255, 255, 255]
    image.putpalette(palette, "RGB")
    return image.convert("RGB")


def _gif_as_decode_gif(image: PIL.Image.Image) -> PIL.Image.Image:
    """A GIF's first frame (a palette image, or a grey ramp Pillow opens as "L") as torchvision's ``decode_gif``
    paints it: on the screen (as large as the frame where it is smaller), in its background colour (the global
    colour table's, black without one) where the frame does not cover it and under the frame's transparent index;
    Pillow fills both with index 0's colour, or the transparent index's own, and widens the image to a frame that
    runs past the screen, where torchvision cuts it off. Unmatched: what lies outside the screen and uncovered by
    the frame (its transparent pixels too), which torchvision leaves uninitialised."""
    image.fp.seek(6)  # the screen's size: Pillow's is widened to a frame that runs past it
    screen = int.from_bytes(image.fp.read(2), "little"), int.from_bytes(image.fp.read(2), "little")
    image.load()
    frame, index, table, background = image.dispose_extent, image.info.get("transparency"), \
        getattr(image, "global_palette", None), image.info.get("background")  # set only with a global table
    if table is not None:
        colour = list(table.palette[3 * background:3 * background + 3]) or [0, 0, 0]
    else:  # a grey ramp Pillow keeps no table for, or no global table at all
        colour = [0, 0, 0] if background is None else [background] * 3
    if image.mode == "L":  # its raw indices under the grey ramp (under a coloured global table, Pillow keeps that
        image = PIL.Image.frombytes("P", image.size, image.tobytes())  # palette on the frame)
        image.putpalette([i for i in range(256) for _ in range(3)], "RGB")
    if isinstance(index, int):
        palette = image.getpalette("RGB")
        palette += [0] * (3 * index + 3 - len(palette))  # an index past the frame's table shows the screen too
        palette[3 * index:3 * index + 3] = colour
        image.putpalette(palette, "RGB")
    if frame == (0, 0, *screen):  # the usual file: no canvas, no copy of the frame
        return image.convert("RGB")
    rgb = PIL.Image.new("RGB", (max(screen[0], frame[2] - frame[0]), max(screen[1], frame[3] - frame[1])),
                        tuple(colour))
    rgb.paste(image.crop(frame).convert("RGB"), frame[:2])
    return rgb


# PIL reads an opened file on first use, not thread-safely, and one image object may reach several decode threads at
# once (given twice, a frame of two videos): each image is read under one of these locks, chosen by its address
# (PIL images are unhashable; two images sharing a lock only wait for each other's read).
PIL_LOADS = tuple(threading.Lock() for _ in range(64))


def large_pillow_blocks() -> None:
    """For a process that decodes for hours (embed's, a Ray actor): Pillow's image blocks made larger than glibc's
    32 MiB mmap threshold, so that a freed one goes back to the system; 16 MiB ones stayed in each decode thread's
    arena (its peak). Not where the user chose (``PILLOW_BLOCK_SIZE``)."""
    if "PILLOW_BLOCK_SIZE" not in os.environ:
        PIL.Image.core.set_block_size(64 << 20)


def _pil_to_rgb(image: PIL.Image.Image, name: str) -> PIL.Image.Image:
    """transformers.image_transforms.convert_to_rgb, PIL branch: transparency composited onto white.

    "Has alpha" is decided exactly as the reference does: an "A" band (so RGBA, LA, PA, and LAB whose
    a* band is named "A"; not premultiplied RGBa/La) or a non-None ``info["transparency"]``.
    """
    try:
        with PIL_LOADS[(id(image) >> 4) % len(PIL_LOADS)]:  # read once, by one thread (``PIL_LOADS``)
            image.load()
    except Exception as e:  # a lazily opened image cut short, say: PIL raises many types
        raise _unreadable(e, name, None) from e
    try:
        has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
        if not has_alpha:  # convert to the image's own mode is a copy of the same pixels: skipped
            return image if image.mode == "RGB" else image.convert("RGB")
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    except Exception as e:  # unsupported mode conversions
        raise PreprocessError(f"{name}: cannot convert mode {image.mode} to RGB ({type(e).__name__}: {e})") from e


def _onto_white_as_vllm(image: PIL.Image.Image) -> PIL.Image.Image:
    """vLLM's ``convert_image_mode(image, "RGB")``: an image with an alpha band (RGBA, LA, PA) or a tRNS entry is
    pasted onto white through its alpha (``Image.paste``'s rounding, not ``alpha_composite``'s), any other converted;
    the file is decoded here."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        rgb = PIL.Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")


def _array_to_rgb(hwc: np.ndarray, composite: bool) -> np.ndarray:
    """``convert_to_rgb`` of uint8 channels-last pixels: 1 channel repeated, 4 blended onto white, as the PIL
    processor (``image_transforms.convert_to_rgb``, numpy branch; ``composite``) or the torchvision one does it."""
    channels = hwc.shape[2]
    if channels == 1:
        return np.repeat(hwc, 3, axis=2)
    if channels != 4:
        return hwc
    if not composite:  # float32, truncated back (``to_dtype(scale=True)`` multiplies by 255.999)
        x = torch.from_numpy(np.array(hwc)).to(torch.float32).mul_(1.0 / 255)
        alpha = x[..., 3:]
        return (x[..., :3] * alpha + (1 - alpha)).mul(255 + 1.0 - 1e-3).to(torch.uint8).numpy()
    # Float64 rounded half-to-even: not PIL's alpha_composite rounding, so a 4-channel array and the same pixels as
    # a PIL RGBA image can differ by one level.
    alpha = hwc[..., 3:4] / 255
    return np.round(alpha * hwc[..., :3] + (1 - alpha) * 255).astype(np.uint8)


def resize_image(image: PIL.Image.Image, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """Resize an RGB image to (height, width) bicubic, as the ``backend``'s image processor does. HxWx3 uint8."""
    if backend != "pil":
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


def normalize_table(mean: Sequence[float], std: Sequence[float], backend: str = "pil") -> np.ndarray:
    """(3, 256) float32: the normalised value of every uint8 level in every channel.

    Reference arithmetic, PIL processor: ``rescale`` computes ``float32(float64(x) * (1/255))`` and
    ``normalize`` ``(x - float32(mean)) / float32(std)`` in float32. Torchvision processor (and the video
    processors): rescale fused into normalize, ``(float32(x) - m) / s`` with ``m = float32(mean) * 255.0``
    (``_fuse_mean_std_and_rescale_factor``) and the same for ``s``, in float32 torch ops. Both are
    elementwise in (level, channel), so the table holds exactly the reference's bits, and lookups avoid the
    reference's float image copy.
    """
    if backend != "pil":
        scale = 1.0 / RESCALE_FACTOR
        mean_t = (torch.tensor(list(mean)) * scale)[:, None]
        std_t = (torch.tensor(list(std)) * scale)[:, None]
        return ((torch.arange(256, dtype=torch.float32)[None, :] - mean_t) / std_t).numpy()
    levels = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return (levels[None, :] - mean32) / std32


def normalize(pixels: np.ndarray, table: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 -> 3xHxW float32 normalised values (rescale + normalize of the reference)."""
    height, width, channels = pixels.shape
    out = np.empty((channels, height, width), dtype=np.float32)
    # Chunks of 256 rows because numpy copies uint8 indices to int64 first: 8 bytes per pixel for a
    # whole 16 MP image, a few MB per chunk.
    for c in range(channels):
        for top in range(0, height, 256):
            rows = slice(top, top + 256)
            out[c, rows] = table[c].take(pixels[rows, :, c])
    return out


def patchify(frames: np.ndarray, temporal_patch_size: int, patch_size: int,
             merge_size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(F, C, H, W) float32 frames, F a multiple of T -> (t*h*w, C*T*P*P) rows and grid (t, h, w).

    Rows are in merge-block order (t, block_row, block_col, row_in_block, col_in_block) and each row is
    laid out (C, T, P, P): the reference's image ``patchify`` and the video processors' ``patchify``
    (``permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)`` of (B, t, T, C, h/m, m, P, w/m, m, P)), minus the batch.
    """
    num_frames, _, height, width = frames.shape
    t, p, m = temporal_patch_size, patch_size, merge_size
    rows = rearrange(frames, "(gt tp) c (bh m1 p1) (bw m2 p2) -> (gt bh bw m1 m2) (c tp p1 p2)",
                     tp=t, m1=m, m2=m, p1=p, p2=p)
    return torch.from_numpy(np.ascontiguousarray(rows)), (num_frames // t, height // p, width // p)

