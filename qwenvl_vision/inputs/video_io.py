"""Video files for the Qwen-VL vision towers: opened, probed and decoded with PyAV as transformers reads them.

Reference (transformers 5.24): ``video_utils.read_video_pyav`` (decode + metadata, through ``load_video``) and
``video_utils.VideoMetadata`` (timestamps, sampled_fps). Frames are decoded with PyAV,
``frame.to_ndarray(format="rgb24")``, the frame count and rate read from the header as there. Which frames to keep
is the caller's rule (``video.sample_indices``, the family's ``sample_frames``); this module knows no sampling rule.

Deviations from the reference, on purpose:

- A header frame count of 0 (Matroska/WebM write none) makes ``read_video_pyav`` sample from 0 frames and fail;
  here the video stream's packets are counted by demuxing (no decoding) and that count is used. A stream
  without ``average_rate`` (the reference takes ``float(None)`` and fails) falls back to ``guessed_rate``.
- A file that decodes fewer frames than its header declares: the reference returns fewer frames than indices.
  Here, when the missing frames are the ones an mp4 edit list hides (a cut made without re-encoding: the packets
  it shows, not ``packet.is_discard``, are the frames decoded and add up to the stream's duration), the shown
  frames are sampled as if the header had counted them (``total_frames`` is that count); otherwise (truncated)
  a PreprocessError says so. Every other failure (missing, empty, a directory, not a video, a still image such
  as a JPEG named .mp4, audio only, corrupt data) is a one-line PreprocessError naming the file, never a bare
  PyAV exception.
- Only the sampled frames are kept while decoding (the reference's ``load_video`` without a sampler keeps every
  frame), each resized to the clip's target size as soon as it is decoded (the same single resize from the
  source size), so memory is the sampled frames at their target size plus the output; decoding stops after the
  last sampled index.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from threading import Event
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..errors import PreprocessError
from .pixels import (
    FileBytes,
    check_aspect_ratio,
    check_input_pixels,
    check_regular_file,
    file_name,
    input_name,
    is_file_input,
    is_url,
    readable,
    resize_uint8_torch,
)

# What ``embed`` and ``iter_encode(video=None)`` take for a video file (anything else is read as an image).
# (Not ".ts": in a source tree those are TypeScript far more often than MPEG transport streams.)
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".wmv", ".flv",
                              ".3gp", ".ogv"})
# What ``embed`` takes from a folder as an image, and ``serve`` keeps as an image item's extension.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"})


def is_video_file(item: Any) -> bool:
    """A file (a path, or ``FileBytes``) whose name's extension is a video container's."""
    if not is_file_input(item):
        return False
    name = file_name(item)
    if is_url(name):  # a presigned or query-string URL: the extension is the path's
        name = urlsplit(name).path
    return os.path.splitext(name)[1].lower() in VIDEO_EXTENSIONS


@dataclasses.dataclass
class VideoInfo:
    """What was read from a video file, or sampled from frames in memory by their rate, JSON-friendly
    (``dataclasses.asdict``).

    As transformers' ``VideoMetadata``: ``total_frames`` / ``video_fps`` from the header (or counted, see the
    module docstring), ``timestamps`` = index / video_fps in seconds, ``sampled_fps`` = kept / total * fps.
    ``height`` / ``width``: the source frames' (None for frames in memory). ``requested_fps``: the rate the frames
    were asked to be sampled at (the video settings' ``fps``; the Omni processors' ``fps`` keyword, from which they
    compute the seconds per temporal patch), None where the caller picked the frames itself.
    """

    total_frames: int
    video_fps: float
    frame_indices: list[int]
    height: int | None
    width: int | None
    timestamps: list[float] = dataclasses.field(init=False)
    sampled_fps: float = dataclasses.field(init=False)
    requested_fps: float | None = None

    def __post_init__(self) -> None:
        self.timestamps = [i / self.video_fps for i in self.frame_indices]
        self.sampled_fps = len(self.frame_indices) / self.total_frames * self.video_fps


def video_record(info: VideoInfo | None) -> dict | None:
    """A ``VideoInfo`` as every embed output records it (None for an image): the frames kept, their times, the
    source and sampled fps, the frame count and, where known, the fps asked for."""
    if info is None:
        return None
    record = {"frames": list(info.frame_indices), "timestamps": list(info.timestamps), "fps": info.video_fps,
              "sampled_fps": info.sampled_fps, "total_frames": info.total_frames}
    if info.requested_fps is not None:
        record["requested_fps"] = info.requested_fps
    return record


def _av_error(error: Exception, name: str, what: str) -> PreprocessError:
    """One line for what PyAV/FFmpeg raised while opening (``what`` = "open") or decoding the file."""
    if isinstance(error, PermissionError):
        return PreprocessError(f"{name}: cannot read file ({error.strerror})")
    message = str(getattr(error, "strerror", None) or error).splitlines()[0] if str(error) else type(error).__name__
    if what == "open":
        return PreprocessError(f"{name}: not a recognised video file (corrupt, or not a video: {message})")
    return PreprocessError(f"{name}: corrupt or truncated video data ({type(error).__name__}: {message})")


def _open_video(path: str | os.PathLike, name: str, max_input_pixels: int | None,
                counted: int | None = None) -> tuple[Any, Any, int, float]:
    """Open the container, check it holds a video stream within the limits; (container, stream, frames, fps) as
    ``read_video_pyav`` reads them, with the fallbacks of the module docstring. ``counted``: a probe's count of this
    file's packets, so a header without a frame count is not demuxed again. The caller closes the container."""
    try:
        import av
    except ImportError:
        raise PreprocessError(f"{name}: reading video files needs PyAV: pip install 'qwenvl-vision[video]'") from None
    check_regular_file(path, name)
    try:
        # FFmpeg reads a name's "proto:" prefix (file:, concat:, subfile,...) as a protocol and would open
        # another file; an absolute path starts with "/", which no protocol name does, so it is only a path. A
        # demuxer may open other files or URLs itself (an ffconcat playlist names files): bytes sent to a server
        # may open none, a path only files.
        if isinstance(path, FileBytes):
            container = av.open(readable(path), container_options={"protocol_whitelist": "none"})
        else:
            container = av.open(os.path.abspath(path), container_options={"protocol_whitelist": "file"})
    except Exception as e:  # noqa: BLE001 - FFmpeg raises many error types for bad files
        raise _av_error(e, name, "open") from e
    try:
        # FFmpeg opens a single still image (a JPEG or PNG renamed .mp4) as a one-frame stream: not a video.
        if container.format.name in ("image2", "image2pipe") or container.format.name.endswith("_pipe"):
            raise PreprocessError(f"{name}: a still image ({container.format.name}), not a video")
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["no streams"]
            raise PreprocessError(f"{name}: no video stream (found: {', '.join(kinds)})")
        stream = container.streams.video[0]
        if stream.codec_context is None:  # a codec FFmpeg does not know: PyAV gives the stream no size
            raise PreprocessError(f"{name}: the video stream's codec is unknown to FFmpeg (corrupt, or unsupported)")
        check_input_pixels(stream.height, stream.width, max_input_pixels, name)
        check_aspect_ratio(stream.height, stream.width, name)
        rate = stream.average_rate or stream.guessed_rate
        if not rate or not float(rate) > 0:
            raise PreprocessError(f"{name}: the video stream declares no frame rate")
        total = stream.frames or counted or len(shown_packets(container, stream, name)[0])
        if total <= 0:
            raise PreprocessError(f"{name}: the video stream holds no frames")
    except BaseException:
        container.close()
        raise
    return container, stream, int(total), float(rate)


def shown_packets(container: Any, stream: Any, name: str) -> tuple[list[int], int]:
    """The durations of the stream's packets an edit list shows (not marked discarded), and how many it discards,
    demuxed without decoding from the start; the container is rewound. The shown count is the frames of a stream
    whose header declares none (public so that a test can count how often a file is demuxed for that: once per
    input)."""
    try:
        container.seek(0)
        packets = [(packet.duration or 0, packet.is_discard) for packet in container.demux(stream) if packet.size > 0]
        container.seek(0)
    except Exception as e:  # noqa: BLE001
        raise _av_error(e, name, "decode") from e
    shown = [duration for duration, discard in packets if not discard]
    return shown, len(packets) - len(shown)


def probe_video(path: str | os.PathLike, name: str | None = None,
                max_input_pixels: int | None = None) -> tuple[int, float, int, int]:
    """(total_frames, fps, height, width) from the container header, nothing decoded (a header without a frame
    count has its packets counted); the same one-line PreprocessErrors as ``read_video_frames``."""
    name = name or input_name("video", None, path)
    container, stream, total, rate = _open_video(path, name, max_input_pixels)
    with container:
        return total, rate, stream.height, stream.width


def read_video_frames(path: str | os.PathLike, pick_indices: Callable[[int, float], list[int]], *,
                      name: str | None = None, max_input_pixels: int | None = None,
                      size: Callable[[int, int, int], tuple[int, int]] | None = None,
                      counted: int | None = None, stop: Event | None = None, turn: bool = False
                      ) -> tuple[np.ndarray, VideoInfo]:
    """Decode the frames ``pick_indices(total_frames, video_fps)`` keeps: ((F, H, W, 3) uint8 RGB, VideoInfo), as
    ``read_video_pyav`` with it as ``sample_indices_fn`` (deviations: module docstring). ``size``: ``(frames,
    height, width) -> (h, w)``, asked with the first frame's size; each frame is resized to it as soon as it is
    decoded. ``counted``: ``probe_video``'s frame count of this file, if the caller has it. ``stop``: once set,
    the read ends at its next frame with a PreprocessError (how a caller that gave up waiting frees the thread).
    ``turn``: each frame turned upright by its rotation metadata (a phone's display matrix) before it is resized,
    as vLLM's OpenCV reader does (quarter turns only); transformers' reader keeps the frames as stored.
    """
    name = name or input_name("video", None, path)
    container, stream, total, rate = _open_video(path, name, max_input_pixels, counted)
    with container:
        indices = pick_indices(total, rate)
        frames, decoded = _decode_sampled(container, stream, indices, name, size, stop, turn)
        if decoded == 0:
            raise PreprocessError(f"{name}: no frame decodes")
        if decoded <= indices[-1]:
            # Fewer frames than the header counts: an edit list (a cut made without re-encoding) hides them when
            # the packets it shows are the frames decoded, and either the discarded ones make up the header's
            # count (a cut inside a frame) or the shown ones last as long as the stream (a head cut that drops the
            # cut packets from the index); else the file is truncated.
            shown, discarded = shown_packets(container, stream, name)
            edit_list = (discarded and len(shown) + discarded == total) or (
                stream.duration and sum(shown) == stream.duration)
            if len(shown) != decoded or not edit_list:
                raise PreprocessError(f"{name}: header declares {total} frames but only {decoded} decode")
            total, indices = decoded, pick_indices(decoded, rate)
            frames, decoded = _decode_sampled(container, stream, indices, name, size, stop, turn)
            if decoded <= indices[-1]:
                raise PreprocessError(f"{name}: only {decoded} frames decode on a second read")
        return frames, VideoInfo(total_frames=total, video_fps=rate, frame_indices=list(indices),
                                 height=stream.height, width=stream.width)


def _decode_sampled(container: Any, stream: Any, indices: list[int], name: str,
                    size: Callable[[int, int, int], tuple[int, int]] | None,
                    stop: Event | None, turn: bool) -> tuple[np.ndarray | None, int]:
    """(the frames at ``indices``, resized by ``size`` if given; how many frames were decoded). Only FFmpeg's work
    is reported as the file's fault: the size rule, the resize and running out of memory raise their own errors."""
    slots: dict[int, list[int]] = {}
    for slot, i in enumerate(indices):
        slots.setdefault(i, []).append(slot)
    frames = source = target = None
    decoded, stream_frames = 0, container.decode(stream)
    while decoded <= indices[-1]:
        if stop is not None and stop.is_set():
            raise PreprocessError(f"{name}: decoding stopped after {decoded} frames (its time limit passed, or the "
                                  f"run was stopped)")
        try:
            frame = next(stream_frames, None)
            rgb = rotation = None
            if frame is not None and decoded in slots:
                rotation = frame.rotation if turn else 0
                # Checked before converting: a frame grown mid-stream (in-band) would pass the header's limit.
                shape = (frame.width, frame.height, rotation)
                if source not in (None, shape):
                    shown = [f"{w}x{h}" + (f" turned {turned}" if turned else "") for w, h, turned in (shape, source)]
                    raise PreprocessError(f"{name}: frame {decoded} is {shown[0]}, earlier frames {shown[1]}; the "
                                          f"size must not change")
                source, rgb = shape, frame.to_ndarray(format="rgb24")
        except (MemoryError, PreprocessError):
            raise
        except Exception as e:  # noqa: BLE001 - FFmpeg's decoders raise many error types
            raise _av_error(e, name, "decode") from e
        if frame is None:
            break
        if rgb is not None:
            if rotation and rotation % 90 == 0:  # counter-clockwise degrees, as np.rot90 turns
                rgb = np.ascontiguousarray(np.rot90(rgb, rotation // 90))
            if frames is None:
                target = size(len(indices), *rgb.shape[:2]) if size is not None else rgb.shape[:2]
                frames = np.empty((len(indices), *target, 3), dtype=np.uint8)
            frames[slots[decoded]] = resize_uint8_torch(rgb, *target)
        decoded += 1
    return frames, decoded
