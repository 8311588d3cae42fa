"""qwenvl_vision.inputs.video_io (and the file path through video.py) against transformers' video pipeline:
``video_utils.load_video(backend="pyav")`` then the video processors with ``do_sample_frames=True``: header metadata,
frame counts (also counted where a header has none), edit lists, the frames decoded, and the one-line errors for bad
files. The videos are written here with PyAV (``tests.helpers.write_video``: a real photo panned, plus noise, so that
sampling the wrong frame or resizing differently would show); the reference processors are configured from literal
values (``tests.helpers.processors``), not from this package's configs.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from qwenvl_vision.errors import PreprocessError
from qwenvl_vision.inputs.images import PreprocessConfig
from qwenvl_vision.inputs.video import VideoConfig, preprocess_video, preprocess_video_file, sample_indices
from qwenvl_vision.inputs.video_io import VideoInfo, is_video_file, probe_video, read_video_frames, video_record
from qwenvl_vision.loading import load_encoder
from tests.helpers import (
    PIXEL_TOL,
    QWEN2_5_SAVED_VIDEO,
    QWEN3_SAVED_VIDEO,
    VIDEO_SETTINGS,
    content,
    sample_photo,
    video_processor,
    video_processor_class,
    write_video,
)

av = pytest.importorskip("av")
pytest.importorskip("torchvision")
pytest.importorskip("matplotlib.cbook")
from transformers.video_utils import VideoMetadata, load_video  # noqa: E402

VIDEOS = {  # name -> (frames, width, height, rate)
    "clip.mp4": (45, 64, 48, 24),
    "ntsc.avi": (90, 100, 76, fractions.Fraction(30000, 1001)),
    "tall.mp4": (7, 40, 200, 10),
    "noframecount.mkv": (20, 64, 48, 30),
    "tiny.mp4": (12, 24, 16, 10),
    "one.mp4": (1, 64, 48, 10),
}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    for name, spec in VIDEOS.items():
        write_video(folder / name, *spec)
    return {name: str(folder / name) for name in VIDEOS}


def configs(family: str, **changes):
    return PreprocessConfig.for_family(family), dataclasses.replace(VideoConfig.for_family(family), **changes)


def reference(family, vcfg, frames, metadata, size=None):
    """The family's transformers video processor, sampling from all frames with their metadata."""
    processor = video_processor(family, temporal_patch_size=2, merge_size=2, min_frames=vcfg.min_frames,
                                max_frames=vcfg.max_frames, max_video_tokens=vcfg.max_video_tokens,
                                size=size or {"shortest_edge": vcfg.min_pixels, "longest_edge": vcfg.max_pixels})
    out = processor(frames, video_metadata=[metadata], do_sample_frames=True, fps=vcfg.fps,
                    cap_pixels_per_frame=vcfg.cap_pixels_per_frame, return_tensors="pt", return_metadata=True)
    return out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist()), out["video_metadata"][0]


def assert_matches(values, grid, info, ref):
    ref_values, ref_grid, metadata = ref
    assert grid == ref_grid
    assert values.dtype == torch.float32 and values.shape == ref_values.shape
    assert float((values - ref_values).abs().max()) <= PIXEL_TOL
    assert info.frame_indices == np.asarray(metadata.frames_indices).tolist()
    assert info.timestamps == metadata.timestamps
    assert info.sampled_fps == pytest.approx(metadata.sampled_fps, rel=1e-12)
    assert (info.total_frames, info.video_fps) == (metadata.total_num_frames, metadata.fps)
    json.dumps(dataclasses.asdict(info))


# family, video, VideoConfig changes, per-call (min_pixels, max_pixels)
CASES = [
    ("qwen2_5_vl", "clip.mp4", {}, (None, None)),
    ("qwen3_vl", "clip.mp4", {}, (None, None)),
    ("qwen2_5_vl", "ntsc.avi", {"cap_pixels_per_frame": False, "fps": 4.0}, (None, None)),
    ("qwen3_vl", "ntsc.avi", {"cap_pixels_per_frame": False, "fps": 4.0}, (None, None)),
    # A tight token budget: the cap, not max_pixels (nor the 1.05 * min_pixels floor), sizes the frames.
    ("qwen2_5_vl", "ntsc.avi", {"fps": 3.0, "max_video_tokens": 40, "min_pixels": 3136}, (None, None)),
    ("qwen3_vl", "ntsc.avi", {"fps": 3.0, "max_video_tokens": 6, "min_pixels": 1024}, (None, None)),
    ("qwen2_5_vl", "tall.mp4", {"fps": 1.0}, (3136, 20000)),
    ("qwen3_vl", "tall.mp4", {"fps": 1.0}, (4096, 200000)),
    # More frames than max_frames at this fps, and fewer than min_frames.
    ("qwen2_5_vl", "ntsc.avi", {"fps": 8.0, "max_frames": 6}, (3136, 50000)),
    ("qwen3_vl", "ntsc.avi", {"fps": 8.0, "max_frames": 7}, (4096, 100000)),
    ("qwen2_5_vl", "clip.mp4", {"fps": 0.5, "min_frames": 9}, (None, None)),
    ("qwen3_vl", "clip.mp4", {"fps": 0.5, "min_frames": 9}, (None, None)),
    # Frames below the factor: Qwen3 scales the sides up before its bounds apply.
    ("qwen3_vl", "tiny.mp4", {"cap_pixels_per_frame": False}, (256, 4096 * 4)),
    ("qwen2_5_vl", "tiny.mp4", {}, (784, 20000)),
]


@pytest.mark.parametrize(("family", "video", "changes", "bounds"), CASES)
def test_file_matches_transformers(videos, family, video, changes, bounds):
    pre, vcfg = configs(family, **changes)
    min_pixels, max_pixels = bounds
    values, grid, info = preprocess_video_file(videos[video], pre, vcfg, min_pixels=min_pixels,
                                               max_pixels=max_pixels)
    size = None if min_pixels is None else {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    frames, metadata = load_video(videos[video], backend="pyav")
    assert_matches(values, grid, info, reference(family, vcfg, frames, metadata, size))


@pytest.mark.parametrize("family", list(VIDEO_SETTINGS))
def test_files_read_video_pyav_cannot_sample(videos, family):
    """Matroska writes no frame count (read_video_pyav then samples from 0 frames): packets are counted instead.
    One frame: sized as if padded to T (Qwen3's smart_resize raises, Qwen2's sampler divides by zero)."""
    pre, vcfg = configs(family)
    path = videos["noframecount.mkv"]
    with av.open(path) as container:
        assert container.streams.video[0].frames == 0
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert probe_video(path) == (20, 30.0, 48, 64)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=30.0, height=48, width=64)
    assert_matches(*preprocess_video_file(path, pre, vcfg), reference(family, vcfg, frames, metadata))
    values, grid, info = preprocess_video_file(videos["one.mp4"], pre, vcfg)
    assert info.frame_indices == [0] and grid[0] == 1
    frames, metadata = load_video(videos["one.mp4"], backend="pyav")
    metadata.total_num_frames = 2
    ref_values, ref_grid, _ = reference(family, vcfg, np.concatenate([frames, frames]), metadata)  # patchify pads
    assert grid == ref_grid and float((values - ref_values).abs().max()) <= PIXEL_TOL


@pytest.mark.parametrize("family", list(VIDEO_SETTINGS))
def test_frames_as_arrays_equal_the_file(videos, family):
    pre, vcfg = configs(family, fps=3.0)
    path = videos["ntsc.avi"]
    values, grid, _ = preprocess_video_file(path, pre, vcfg)
    frames, _ = read_video_frames(path, lambda total, rate: sample_indices(total, rate, vcfg, 2))  # source size
    for given in (frames, torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), list(frames)):
        other, other_grid = preprocess_video(given, pre, video_config=vcfg)
        assert other_grid == grid and torch.equal(other, values)
    # And against the reference given the same frames as an array (no sampling: they are the sampled ones).
    processor = video_processor(family, size={"shortest_edge": vcfg.min_pixels, "longest_edge": vcfg.max_pixels})
    out = processor([frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt")
    assert tuple(out["video_grid_thw"][0].tolist()) == grid
    assert float((out["pixel_values_videos"] - values).abs().max()) <= PIXEL_TOL
    opaque = np.concatenate([frames, np.full(frames.shape[:3] + (1,), 255, np.uint8)], axis=3)
    assert torch.equal(preprocess_video(opaque, pre, video_config=vcfg)[0], values)
    opaque[1, 0, 0, 3] = 254
    with pytest.raises(PreprocessError, match="video 4 frame 1: frames with transparency"):
        preprocess_video(opaque, pre, video_config=vcfg, index=4)
    with pytest.raises(PreprocessError, match="frame 1 is 50x38, frame 0 100x76"):
        preprocess_video([frames[0], frames[1][::2, ::2]], pre, video_config=vcfg)
    # resize="pil" resizes the video processors' sizes with PIL.
    pil_values, pil_grid = preprocess_video(frames, pre, video_config=vcfg, resize="pil")
    assert pil_grid == grid and not torch.equal(pil_values, values)


def _write_x264(path, pts, **options) -> None:
    """H.264 in mp4 (faststart), one random 64x48 frame per presentation time in ``pts``."""
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=25, options=options)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        rng = np.random.default_rng(0)
        for i in pts:
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, videos):
    folder = tmp_path_factory.mktemp("bad")
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "folder.mp4").mkdir()
    (folder / "text.mp4").write_text("not a video\n" * 20)
    Image.open(sample_photo("grace_hopper.jpg")).save(folder / "photo.mp4", format="JPEG")
    with av.open(str(folder / "audio.mp4"), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = open(videos["clip.mp4"], "rb").read()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 2])  # the index (moov) is at the end: nothing opens
    write_video(folder / "whole.avi", 60, 64, 48, 24)
    data = (folder / "whole.avi").read_bytes()
    (folder / "cut.avi").write_bytes(data[: len(data) * 2 // 3])  # cut inside a packet
    with av.open(str(folder / "whole.avi")) as container:
        positions = [packet.pos for packet in container.demux(video=0) if packet.size]
    (folder / "short.avi").write_bytes(data[: positions[30]])  # 30 whole packets; the header still declares 60
    _write_x264(folder / "nothing.mp4", range(-5, 0))  # every frame before the edit list's start
    write_video(folder / "big.avi", 3, 100, 76, 10)  # above the limit the test sets
    _write_x264(folder / "h264.mp4", range(3))
    (folder / "codec.mp4").write_bytes((folder / "h264.mp4").read_bytes().replace(b"avc1", b"zzzz"))
    return folder


@pytest.mark.parametrize(("file", "message"), [
    ("missing.mp4", "file not found"),
    ("folder.mp4", "not a regular file"),
    ("empty.mp4", r"file is empty \(0 bytes\)"),
    ("text.mp4", "not a recognised video file"),
    ("photo.mp4", r"a still image \(jpeg_pipe\), not a video"),
    ("audio.mp4", r"no video stream \(found: audio\)"),
    ("cut.mp4", "not a recognised video file"),
    ("cut.avi", r"corrupt or truncated video data \(InvalidDataError"),
    ("short.avi", "header declares 60 frames but only 30 decode"),
    ("nothing.mp4", "no frame decodes$"),
    ("big.avi", "100x76 = 7,600 pixels is above the input limit"),  # refused before decoding
    ("codec.mp4", "the video stream's codec is unknown to FFmpeg"),  # PyAV gives such a stream no size
])
def test_bad_files_raise_one_line_naming_the_file(bad_files, file, message):
    path = str(bad_files / file)
    with pytest.raises(PreprocessError, match=rf"^video '.*{file}': {message}") as info:
        preprocess_video_file(path, *configs("qwen3_vl"), index=7, max_input_pixels=5000)
    assert "\n" not in str(info.value)
    if file not in ("cut.avi", "short.avi", "nothing.mp4"):  # the header is fine: only decoding finds these
        with pytest.raises(PreprocessError, match=rf"^video '.*{file}': {message}"):
            probe_video(path, max_input_pixels=5000)


def test_a_frame_grown_mid_stream_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    """H.264 changes size in-band: the header (checked against max_input_pixels) gives the first frames' size only,
    so a later frame's size is checked before its RGB array is made."""
    import io

    def h264(width, height, count):
        buffer = io.BytesIO()
        with av.open(buffer, "w", format="h264") as container:
            stream = container.add_stream("libx264", rate=8, options={"preset": "ultrafast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for _ in range(count):
                frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        return buffer.getvalue()

    (tmp_path / "grown.h264").write_bytes(h264(64, 48, 8) + h264(2048, 2048, 1))
    with av.open(str(tmp_path / "grown.h264")) as source, av.open(str(tmp_path / "grown.mkv"), "w") as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        for n, packet in enumerate(p for p in source.demux(source.streams.video[0]) if p.size):
            packet.stream, packet.time_base, packet.pts, packet.dts = stream, fractions.Fraction(1, 8), n, n
            out.mux(packet)
    converted = []

    def recorded(frame, **options):  # each conversion to RGB recorded
        converted.append((frame.width, frame.height))
        return frame.to_ndarray(**options)

    monkeypatch.setattr(av, "open", decoding_with(recorded))
    with pytest.raises(PreprocessError, match=r"frame 8 is 2048x2048, earlier frames 64x48"):
        preprocess_video_file(str(tmp_path / "grown.mkv"), *configs("qwen3_vl"), max_input_pixels=5000)
    assert converted and (2048, 2048) not in converted  # the grown frame's RGB array was never made


def test_frames_are_turned_upright_only_when_asked(tmp_path):
    """Rotation metadata in counter-clockwise degrees, as vLLM's reader applies it (tests/contract/test_serve.py)."""
    frames = [content(48, 64, seed=i) for i in range(3)]
    for angle, turns in ((0, 0), (90, 1), (-90, 3), (180, 2)):
        path = tmp_path / f"turned{angle}.mp4"
        with av.open(str(path), "w") as container:  # lossless: the frames come back as written
            stream = container.add_stream("libx264rgb", rate=10, options={"qp": "0"})
            stream.width, stream.height, stream.pix_fmt = 64, 48, "rgb24"
            stream.set_display_rotation(angle)
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        stored, _ = read_video_frames(path, lambda total, rate: list(range(total)))
        turned, _ = read_video_frames(path, lambda total, rate: list(range(total)), turn=True)
        assert np.array_equal(stored, np.stack(frames)), angle
        assert np.array_equal(turned, np.rot90(stored, turns, axes=(1, 2))), angle


def test_missing_pyav_names_the_extra(videos, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # import av now raises ImportError
    with pytest.raises(PreprocessError, match=r"^video '.*clip.mp4': reading video files needs PyAV: "
                                              r"pip install 'qwenvl-vision\[video\]'$"):
        preprocess_video_file(videos["clip.mp4"], *configs("qwen2_5_vl"))


@pytest.mark.parametrize(("family", "saved"), [("qwen2_5_vl", QWEN2_5_SAVED_VIDEO), ("qwen3_vl", QWEN3_SAVED_VIDEO)],
                         ids=["QWEN2_5_SAVED_VIDEO", "QWEN3_SAVED_VIDEO"])
def test_saved_config_as_transformers_loads_it(videos, family, saved):
    """No settings passed by hand: the processor transformers builds from the file, against ours from the same file
    (what a checkpoint folder holding it gives both)."""
    # The Qwen2 file samples nothing (do_sample_frames false, fps null): here both sample at 2 fps.
    d = dict(saved, fps=2, do_sample_frames=True)
    processor = video_processor_class(family).from_dict({k: v for k, v in d.items() if v is not None})
    pre = PreprocessConfig.for_family(family)
    vcfg = VideoConfig.from_dict(d, family, pre)
    frames, metadata = load_video(videos["clip.mp4"], backend="pyav")
    out = processor(frames, video_metadata=[metadata], do_sample_frames=True, return_tensors="pt",
                    return_metadata=True)
    values, grid, info = preprocess_video_file(videos["clip.mp4"], pre, vcfg)
    assert_matches(values, grid, info, (out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist()),
                                        out["video_metadata"][0]))


def test_edit_list_frames_are_sampled_from_the_shown_frames(tmp_path):
    """An mp4 cut without re-encoding: its header counts 45 frames, its edit list hides 5, 40 decode."""
    path = tmp_path / "edit.mp4"
    _write_x264(path, range(-5, 40))  # negative timestamps: the muxer writes an edit list that starts at frame 0
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 45
        assert sum(1 for _ in container.decode(video=0)) == 40
    # Qwen2's sampler stops short of the hidden frames: the header's count stands, as in the reference.
    frames, metadata = load_video(str(path), backend="pyav")
    pre, vcfg = configs("qwen2_5_vl")
    assert_matches(*preprocess_video_file(str(path), pre, vcfg), reference("qwen2_5_vl", vcfg, frames, metadata))
    # Qwen3's always takes the last frame, which the reference cannot decode: sampled from the 40 shown frames.
    _, grid, info = preprocess_video_file(str(path), *configs("qwen3_vl"))
    assert info.total_frames == 40 and info.frame_indices[-1] == 39
    assert grid[0] == math.ceil(len(info.frame_indices) / 2)


def test_an_edit_list_starting_inside_a_frame_is_not_a_truncated_file(tmp_path):
    """A cut without re-encoding whose edit starts 100 ticks into a frame: the shown packets no longer last as long
    as the stream, but the discarded ones make up the header's count."""
    import struct

    _write_x264(tmp_path / "edit.mp4", range(-5, 40))
    data = bytearray((tmp_path / "edit.mp4").read_bytes())
    at = data.find(b"elst")
    duration, media_time = struct.unpack(">Ii", data[at + 12:at + 20])
    data[at + 12:at + 20] = struct.pack(">Ii", duration, media_time + 100)
    (tmp_path / "cut.mp4").write_bytes(data)
    _, grid, info = preprocess_video_file(str(tmp_path / "cut.mp4"), *configs("qwen3_vl"))
    assert info.total_frames == 39 and info.frame_indices[-1] == 38


def test_head_cut_by_edit_list_drops_packets_the_header_still_counts(tmp_path):
    """A head cut of 12 frames made by editing the mp4's edit list (no re-encoding), short GOPs: FFmpeg leaves the
    cut packets it does not need out of its index altogether (none marked discarded); the header still says 40."""
    import struct

    _write_x264(tmp_path / "gop.mp4", range(40), g="5", bf="0")
    data = bytearray((tmp_path / "gop.mp4").read_bytes())
    at = data.find(b"elst")
    duration, media_time = struct.unpack(">Ii", data[at + 12:at + 20])
    data[at + 12:at + 20] = struct.pack(">Ii", duration - 12 * 40, media_time + 512 * 12)  # 40 ms, 512 ticks a frame
    (tmp_path / "cut.mp4").write_bytes(data)
    with av.open(str(tmp_path / "cut.mp4")) as container:
        assert container.streams.video[0].frames == 40
        assert sum(1 for _ in container.decode(video=0)) == 28
    for family in VIDEO_SETTINGS:
        _, grid, info = preprocess_video_file(str(tmp_path / "cut.mp4"), *configs(family))
        assert info.total_frames == 28 and info.frame_indices[-1] <= 27 and grid[0] == 2


def test_a_header_without_frame_count_is_counted_once_per_video(videos, checkpoint, monkeypatch):
    """Matroska writes no frame count: the decode estimate's probe counts the packets, and the read reuses it."""
    import qwenvl_vision.inputs.video_io as video_io

    counts = []
    real = video_io.shown_packets
    monkeypatch.setattr(video_io, "shown_packets", lambda *a: counts.append(1) or real(*a))
    encoder = load_encoder(checkpoint, device="cpu")
    [[result]] = list(encoder.iter_encode([videos["noframecount.mkv"]], video=None))
    assert result.ok and result.video_info.total_frames == 20
    assert len(counts) == 1


def test_resize_vllm_picks_qwen2_s_frames_as_vllm_does_and_bounds_them_so(tmp_path, checkpoint, monkeypatch):
    """75 frames at 10 fps: Qwen2's float step reaches index 75, which transformers' reader drops (14 frames, 7
    temporal patches) and vLLM's takes as the last frame (15, padded to 8); the token bound, checked before any
    frame decodes, counts the same."""
    import qwenvl_vision.inputs.video as video

    reads = []
    monkeypatch.setattr(video, "read_video_frames", lambda *a, **k: reads.append(1) or read_video_frames(*a, **k))
    path = tmp_path / "clip.avi"
    write_video(path, 75, 32, 32, 10)
    with load_encoder(checkpoint, device="cpu") as encoder:
        as_transformers = encoder.encode_videos([str(path)], resize="torch")
        as_vllm = encoder.encode_videos([str(path)], resize="vllm")
        assert [r.grid_thw.tolist()[0][0] for r in (as_transformers, as_vllm)] == [7, 8]
        assert as_vllm.video_info[0].frame_indices[-2:] == [69, 74]
        tokens = as_vllm.embeddings[0].shape[0]
        for bound in (tokens, tokens - 1):
            reads.clear()
            [[result]] = encoder.iter_encode([str(path)], video=True, resize="vllm", max_item_tokens=bound)
            assert (result.ok, len(reads)) == ((True, 1) if bound == tokens else (False, 0)), result.error
        assert f"{tokens:,} tokens, more than the bound of {tokens - 1:,}" in result.error


def test_video_extensions_are_read_in_any_case():
    """Cameras and phones write .MP4."""
    assert is_video_file("holiday/CLIP.MP4") and is_video_file("a.MoV")


def test_a_video_record_names_the_requested_fps_only_when_known():
    """A null would win over the run's fps when the record is read back (an Omni hand-off needs it)."""
    info = VideoInfo(total_frames=20, video_fps=10.0, frame_indices=[0, 5], height=40, width=56)
    assert "requested_fps" not in video_record(info)
    info.requested_fps = 2.0
    assert video_record(info)["requested_fps"] == 2.0


@pytest.fixture(scope="module")
def cut_avi(tmp_path_factory):
    """whole.avi (40 frames, 64 x 48) and short.avi: its first 20 packets, the header still declaring 40."""
    folder = tmp_path_factory.mktemp("cut")
    write_video(folder / "whole.avi", 40, 64, 48, 10)
    data = (folder / "whole.avi").read_bytes()
    with av.open(str(folder / "whole.avi")) as container:
        positions = [packet.pos for packet in container.demux(video=0) if packet.size]
    (folder / "short.avi").write_bytes(data[: positions[20]])
    return folder


def test_a_cut_file_whose_last_index_is_the_decoded_count_is_refused(cut_avi):
    """Not a frame of uninitialised memory at the end."""
    with pytest.raises(PreprocessError, match="header declares 40 frames but only 20 decode"):
        read_video_frames(cut_avi / "short.avi", lambda total, rate: [0, 20])


def test_video_info_records_the_source_size_and_the_fps_asked(cut_avi):
    pre = PreprocessConfig.for_family("qwen3_vl")
    vcfg = dataclasses.replace(VideoConfig.for_family("qwen3_vl"), fps=3.0)
    _, _, info = preprocess_video_file(cut_avi / "whole.avi", pre, vcfg)
    assert (info.height, info.width, info.requested_fps) == (48, 64, 3.0)


def test_an_unreadable_file_and_running_out_of_memory_are_not_called_corrupt(tmp_path, monkeypatch):
    """A refused read is the file system's answer, not the video's; a MemoryError leaves the reader as itself, not as
    an error calling the data corrupt."""
    write_video(tmp_path / "v.avi", 4, 64, 48, 10)

    def out_of_memory(frame, **options):
        raise MemoryError

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    running_out = decoding_with(out_of_memory)
    monkeypatch.setattr(av, "open", refused)
    with pytest.raises(PreprocessError, match=r"cannot read file \(Permission denied\)"):
        read_video_frames(tmp_path / "v.avi", lambda total, rate: [0])
    monkeypatch.setattr(av, "open", running_out)
    with pytest.raises(MemoryError):
        read_video_frames(tmp_path / "v.avi", lambda total, rate: [0])


def decoding_with(to_ndarray):
    """``av.open`` as it is now, its decoded frames converted to arrays by ``to_ndarray(frame, **options)``."""
    open_file = av.open

    class Frame:
        def __init__(self, frame):
            self.frame = frame

        def __getattr__(self, name):
            return getattr(self.frame, name)

        def to_ndarray(self, **options):
            return to_ndarray(self.frame, **options)

    class Container:
        def __init__(self, *args, **kwargs):
            self.container = open_file(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.container, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.container.__exit__(*exc)

        def decode(self, *args, **kwargs):
            return map(Frame, self.container.decode(*args, **kwargs))

    return Container
