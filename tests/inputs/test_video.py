"""qwenvl_vision.inputs.video against transformers: frame sampling, the video size rules, frames -> pixel values,
VideoConfig.

Sampling is compared with ``Qwen2VLVideoProcessor.sample_frames`` / ``Qwen3VLVideoProcessor.sample_frames`` compiled
straight from the installed source files, and ``preprocess_video`` without a VideoConfig (``resize="pil"``) with every
frame through the PIL image processor's own resize / rescale / normalize then the video processors' ``patchify``:
neither needs torchvision. The size rules and VideoConfig are compared with the video processors themselves, which
import torchvision (those tests skip without it). Video files, read and sampled end to end, are
tests/inputs/test_video_io.py.
The reference processors are configured from literal values (patch 14 + CLIP mean/std, patch 16 + 0.5;
``tests.helpers.processors``), not from this package's configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types

import numpy as np
import pytest
import torch
from PIL import Image

from qwenvl_vision.errors import ConfigError, PreprocessError
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image
from qwenvl_vision.inputs.video import (
    VideoConfig,
    preprocess_video,
    sample_frame_indices,
    sample_frame_indices_qwen3,
    video_target_size,
)
from tests.helpers import (
    CLIP_MEAN,
    PIXEL_TOL,
    QWEN2_5_SAVED_VIDEO,
    QWEN3_SAVED_VIDEO,
    REFERENCE_FAMILIES,
    VIDEO_FILES,
    VIDEO_SETTINGS,
    content,
    hf_source_function,
    image_processors,
    image_reference,
    pil_config,
    reference_video,
    video_processor,
)

# transformers' video processors import torchvision: without it the tests that build one skip, the rest run.
HAS_VIDEO_PROCESSORS = importlib.util.find_spec("torchvision") is not None
if HAS_VIDEO_PROCESSORS:
    from transformers.image_utils import SizeDict
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
else:
    Qwen2VLVideoProcessor = Qwen3VLVideoProcessor = None
needs_video_processors = pytest.mark.skipif(not HAS_VIDEO_PROCESSORS,
                                            reason="transformers' video processors need torchvision")


@pytest.fixture(scope="module")
def hf():
    """family -> reference image processor (PIL) with the released checkpoints' settings."""
    return image_processors()


# --------------------------------------------------------------------------------------------------
# Frames through the PIL image processor's steps (no VideoConfig)
# --------------------------------------------------------------------------------------------------


def _frames(count: int, height: int = 120, width: int = 170) -> np.ndarray:
    return np.stack([content(height, width, 3, seed=100 + i) for i in range(count)])


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("count", [1, 4, 5])
def test_video_matches_reference(hf, family, count):
    frames = _frames(count)
    ref_values, ref_grid = reference_video(hf[family], family, list(frames))
    values, grid = preprocess_video(frames, pil_config(family), resize="pil")
    assert grid == ref_grid == (math.ceil(count / 2), ref_grid[1], ref_grid[2])
    assert values.dtype == torch.float32 and tuple(values.shape) == ref_values.shape
    assert float(np.abs(values.numpy() - ref_values).max()) <= PIXEL_TOL


def test_video_layout_and_last_frame_padding(hf):
    """Video rows: (C, T, P, P) with T slot k from frame 2t+k; the odd last frame fills both slots."""
    family = "qwen2_5_vl"
    config = pil_config(family)
    frames = _frames(5)
    values, (grid_t, grid_h, grid_w) = preprocess_video(frames, config, resize="pil")
    p, c = config.patch_size, 3
    rows = values.reshape(grid_t, grid_h * grid_w, c, 2, p, p)
    per_frame = [image_reference(hf[family], Image.fromarray(f))[0].reshape(-1, c, 2, p, p)[:, :, 0] for f in frames]
    for i in range(5):
        np.testing.assert_array_equal(rows[i // 2, :, :, i % 2].numpy(), per_frame[i])
    np.testing.assert_array_equal(rows[2, :, :, 1].numpy(), per_frame[4])  # padding repeats the last frame


def test_video_input_types_agree(tmp_path):
    frames = _frames(3, 90, 130)
    config = pil_config("qwen3_vl")
    expected, grid = preprocess_video(frames, config, resize="pil")
    paths = []
    for i, frame in enumerate(frames):
        paths.append(tmp_path / f"frame{i}.png")
        Image.fromarray(frame).save(paths[-1])
    inputs = [
        list(frames),
        [Image.fromarray(f) for f in frames],
        paths,
        torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(),
        [torch.from_numpy(f).permute(2, 0, 1) for f in frames],
    ]
    for video in inputs:
        values, other_grid = preprocess_video(video, config, resize="pil")
        assert other_grid == grid and torch.equal(values, expected)


def test_video_of_one_repeated_frame_equals_image():
    frame = content(100, 140)
    config = pil_config("qwen2_5_vl")
    assert torch.equal(preprocess_video([frame, frame], config, resize="pil")[0], preprocess_image(frame, config)[0])
    assert torch.equal(preprocess_video([frame], config, resize="pil")[0], preprocess_image(frame, config)[0])


def test_video_frames_resized_to_first_frame_size():
    config = pil_config("qwen2_5_vl")
    first, second = content(100, 140), content(300, 200, seed=5)
    values, grid = preprocess_video([first, second], config, max_pixels=50_000, resize="pil")
    assert grid == (1, *preprocess_image(first, config, max_pixels=50_000)[1][1:])
    assert values.shape[0] == grid[1] * grid[2]


def test_video_errors(tmp_path):
    config = pil_config("qwen2_5_vl")
    missing = tmp_path / "gone.png"
    with pytest.raises(PreprocessError, match=r"video 2 frame '.*gone.png': file not found"):
        preprocess_video([content(50, 50), missing], config, index=2)
    with pytest.raises(PreprocessError, match="video 0: no frames"):
        preprocess_video([], config, index=0)
    with pytest.raises(PreprocessError, match="4-D frame array"):
        preprocess_video(np.zeros((5, 10, 3), np.uint8), config)
    with pytest.raises(PreprocessError, match="sequence of frames"):
        preprocess_video(str(missing), config)
    with pytest.raises(PreprocessError, match="video frame 0: aspect ratio"):
        preprocess_video(np.zeros((3, 2, 900, 3), np.uint8), config)


# --------------------------------------------------------------------------------------------------
# Frame sampling
# --------------------------------------------------------------------------------------------------

FRAME_COUNTS = [2, 3, 7, 10, 31, 60, 61, 299, 1001, 5000]
VIDEO_FPS = [1.0, 7.5, 24.0, 29.97, 30.0, 60.0]
TARGET_FPS = [0.5, 1.0, 2.0, 4.0]


def test_sample_frame_indices_matches_qwen2_vl_reference():
    sample = hf_source_function(*VIDEO_FILES["qwen2"], "sample_frames",
                                 {"torch": torch, "math": math, "VideoMetadata": object})
    for max_frames in (768, 8):
        processor = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                                          max_frames=max_frames)
        for total in FRAME_COUNTS:
            for video_fps in VIDEO_FPS:
                for fps in TARGET_FPS:
                    metadata = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
                    expected = sample(processor, metadata, fps=fps).tolist()
                    ours = sample_frame_indices(total, video_fps, fps, max_frames=max_frames)
                    # The reference can step past the last frame (see the next test); we drop that index.
                    assert ours == [i for i in expected if i < total], (total, video_fps, fps, max_frames)


def test_sample_frame_indices_drops_reference_overrun():
    """1001 frames, 1 fps, sampled at 0.5 fps: the reference's float arange yields 501 indices, the last 1001."""
    sample = hf_source_function(*VIDEO_FILES["qwen2"], "sample_frames",
                                 {"torch": torch, "math": math, "VideoMetadata": object})
    processor = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                                      max_frames=768)
    expected = sample(processor, types.SimpleNamespace(total_num_frames=1001, fps=1.0), fps=0.5).tolist()
    assert len(expected) == 501 and expected[-1] == 1001
    assert sample_frame_indices(1001, 1.0, 0.5) == expected[:-1]


def test_sample_frame_indices_short_video():
    assert sample_frame_indices(1, 30.0) == [0]  # the reference divides by zero here
    with pytest.raises(ValueError):
        sample_frame_indices(0, 30.0)
    with pytest.raises(ValueError):
        sample_frame_indices(10, 0.0)


def test_sample_frame_indices_matches_qwen3_vl_reference():
    sample = hf_source_function(*VIDEO_FILES["qwen3"], "sample_frames",
                                 {"np": np, "VideoMetadata": object, "logger": None})
    for max_frames in (768, 8):
        processor = types.SimpleNamespace(fps=2, min_frames=4, max_frames=max_frames)
        for total in FRAME_COUNTS:
            for video_fps in VIDEO_FPS:
                for fps in TARGET_FPS:
                    metadata = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
                    expected = sample(processor, metadata, fps=fps).tolist()
                    assert sample_frame_indices_qwen3(total, video_fps, fps, max_frames=max_frames) == expected


# --------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------


TARGET_SIZES = [(16, 24), (48, 64), (75, 100), (200, 40), (480, 640)]


@needs_video_processors
@pytest.mark.parametrize("family", list(VIDEO_SETTINGS))
@pytest.mark.parametrize("cap", [True, False])
def test_video_target_size_matches_processor_resize(family, cap):
    """Our size rule against the processors' own ``resize`` on blank clips, over sizes, frame counts and bounds."""
    pre = PreprocessConfig.for_family(family)
    for min_pixels, max_pixels, tokens in [(3136, 40000, 100), (4096, 400000, 30), (65536, 16777216, 768)]:
        vcfg = dataclasses.replace(VideoConfig.for_family(family), min_pixels=min_pixels, max_pixels=max_pixels,
                                   max_video_tokens=tokens, cap_pixels_per_frame=cap)
        processor = video_processor(family, max_video_tokens=tokens)
        size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
        for height, width in TARGET_SIZES:
            for frames in (2, 3, 8, 24):
                clip = torch.zeros((1, frames, 3, height, width), dtype=torch.uint8)
                expected = processor.resize(clip, size=size, resample=3, factor=pre.factor, temporal_factor=2,
                                            cap_pixels_per_frame=cap).shape[-2:]
                assert video_target_size(frames, height, width, pre, vcfg) == tuple(expected), (height, width, frames)


# --------------------------------------------------------------------------------------------------
# VideoConfig
# --------------------------------------------------------------------------------------------------


@needs_video_processors
@pytest.mark.parametrize(("family", "cls"), [("qwen2_5_vl", Qwen2VLVideoProcessor), ("qwen2_vl", Qwen2VLVideoProcessor),
                                            ("qwen3_omni_moe", Qwen2VLVideoProcessor),
                                            ("qwen3_vl", Qwen3VLVideoProcessor), ("qwen3_5", Qwen3VLVideoProcessor)])
def test_for_family_is_its_processor_class_defaults(family, cls):
    vcfg = VideoConfig.for_family(family)
    assert vcfg.sampling == ("qwen3" if cls is Qwen3VLVideoProcessor else "qwen2")
    assert (vcfg.min_pixels, vcfg.max_pixels) == (cls.size["shortest_edge"], cls.size["longest_edge"])
    assert (vcfg.min_frames, vcfg.max_frames, vcfg.max_video_tokens) == (cls.min_frames, cls.max_frames,
                                                                        cls.max_video_tokens)
    # transformers 5.24 reads an unset cap (the class default None) as "no cap".
    assert vcfg.fps == 2.0 and vcfg.cap_pixels_per_frame is bool(cls.cap_pixels_per_frame) is False


def test_from_dict_reads_saved_configs():
    vcfg = VideoConfig.from_dict(QWEN2_5_SAVED_VIDEO, "qwen2_5_vl", PreprocessConfig.for_family("qwen2_5_vl"))
    assert (vcfg.sampling, vcfg.min_pixels, vcfg.max_pixels, vcfg.fps) == ("qwen2", 3136, 12845056, 2.0)
    overridden = VideoConfig.from_dict({"size": {"shortest_edge": 1000, "longest_edge": 9000}, "max_pixels": 5000},
                                       "qwen2_5_vl")
    assert (overridden.min_pixels, overridden.max_pixels) == (1000, 5000)  # as Qwen2VLVideoProcessor.__init__
    vcfg = VideoConfig.from_dict(QWEN3_SAVED_VIDEO, "qwen3_vl", PreprocessConfig.for_family("qwen3_vl"))
    assert (vcfg.sampling, vcfg.min_pixels, vcfg.max_pixels, vcfg.max_video_tokens) == ("qwen3", 4096, 25165824, 768)
    assert VideoConfig.from_dict(None, "qwen3_vl") == VideoConfig.for_family("qwen3_vl")


@pytest.mark.parametrize(("changes", "field"), [
    ({"num_frames": 16}, "num_frames"),
    ({"fps": -1}, "fps"),
    ({"fps": float("nan")}, "fps"),
    ({"fps": "2"}, "fps"),
    ({"min_frames": 0}, "min_frames"),
    ({"max_frames": 2.5}, "max_frames"),
    ({"min_frames": 10, "max_frames": 8}, "min_frames"),
    ({"max_video_tokens": True}, "max_video_tokens"),
    ({"cap_pixels_per_frame": "yes"}, "cap_pixels_per_frame"),
    ({"size": {"shortest_edge": 0, "longest_edge": 10}}, "min_pixels"),
    ({"size": [1, 2]}, "size"),
    ({"resample": 2}, "resample"),
    ({"do_resize": False}, "do_resize"),
    ({"rescale_factor": 1.0}, "rescale_factor"),
    ({"do_center_crop": True}, "do_center_crop"),
    ({"do_sample_frames": False, "fps": 1}, "do_sample_frames"),
    ({"patch_size": 14}, "patch_size"),
    ({"image_mean": CLIP_MEAN}, "image_mean"),
    ({"image_mean": ["a", 0.5, 0.5]}, "image_mean"),
    ({"image_std": [None, 0.5, 0.5]}, "image_std"),
    ({"min_pixels": 3136}, "min_pixels"),  # Qwen3VLVideoProcessor ignores the key
])
def test_from_dict_refuses_bad_fields(changes, field):
    with pytest.raises(ConfigError, match=field) as info:
        VideoConfig.from_dict({**QWEN3_SAVED_VIDEO, **changes}, "qwen3_vl", PreprocessConfig.for_family("qwen3_vl"))
    assert "\n" not in str(info.value)


@needs_video_processors
@pytest.mark.parametrize(("family", "cls"), [("qwen2_5_vl", Qwen2VLVideoProcessor),
                                            ("qwen3_vl", Qwen3VLVideoProcessor)])
def test_to_dict_loads_in_transformers_to_the_same_settings(family, cls):
    pre = PreprocessConfig.for_family(family)
    vcfg = VideoConfig(sampling=VideoConfig.for_family(family).sampling, min_pixels=5000, max_pixels=90000, fps=1.5,
                       min_frames=3, max_frames=40, cap_pixels_per_frame=False, max_video_tokens=321)
    d = json.loads(json.dumps(vcfg.to_dict(pre)))
    assert VideoConfig.from_dict(d, family, pre) == vcfg
    processor = cls.from_dict(d)
    assert type(processor) is cls
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (5000, 90000)
    assert (processor.fps, processor.min_frames, processor.max_frames) == (1.5, 3, 40)
    assert (processor.cap_pixels_per_frame, processor.max_video_tokens, processor.do_sample_frames) == (False, 321,
                                                                                                        True)
    assert (processor.patch_size, list(processor.image_mean)) == (pre.patch_size, list(pre.image_mean))
