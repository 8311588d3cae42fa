"""qwenvl_vision.inputs.video against transformers: frame sampling, the video size rules, frames -> pixel values,
VideoConfig (video files: tests/inputs/test_video_io.py).

Sampling is compared with the video processors' ``sample_frames`` compiled straight from the installed source files,
and ``preprocess_video`` without a VideoConfig (``resize="pil"``) with every frame through the PIL image processor's
own steps then the video processors' ``patchify``: neither needs torchvision. The size rules and VideoConfig are
compared with the video processors themselves, which import torchvision (those tests skip without it). The reference
processors are configured from literal values (``tests.helpers.processors``), not from this package's configs.
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
    sample_frames_by_fps,
    sample_indices,
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
    pil_config,
    reference_video,
    video_processor,
    video_processor_class,
)

# transformers' video processors import torchvision: without it the tests that build one skip, the rest run.
needs_video_processors = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                            reason="transformers' video processors need torchvision")


def _frames(count: int, height: int = 120, width: int = 170) -> np.ndarray:
    return np.stack([content(height, width, 3, seed=100 + i) for i in range(count)])


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("count", [1, 4, 5])
def test_video_matches_reference(family, count):
    frames = _frames(count)
    ref_values, ref_grid = reference_video(image_processors()[family], family, list(frames))
    values, grid = preprocess_video(frames, pil_config(family), resize="pil")
    assert grid == ref_grid == (math.ceil(count / 2), ref_grid[1], ref_grid[2])
    assert values.dtype == torch.float32 and tuple(values.shape) == ref_values.shape
    assert float(np.abs(values.numpy() - ref_values).max()) <= PIXEL_TOL


def test_video_input_types_agree(tmp_path):
    frames = _frames(3, 90, 130)
    config = pil_config("qwen3_vl")
    expected, grid = preprocess_video(frames, config, resize="pil")
    paths = [tmp_path / f"frame{i}.png" for i in range(3)]
    for frame, path in zip(frames, paths):
        Image.fromarray(frame).save(path)
    for video in (list(frames), [Image.fromarray(f) for f in frames], paths,
                  torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(),
                  [torch.from_numpy(f).permute(2, 0, 1) for f in frames]):
        values, other_grid = preprocess_video(video, config, resize="pil")
        assert other_grid == grid and torch.equal(values, expected)


def test_video_frames_are_sized_as_the_first_frame_image():
    frame, other = content(100, 140), content(300, 200, seed=5)
    config = pil_config("qwen2_5_vl")
    assert torch.equal(preprocess_video([frame, frame], config, resize="pil")[0], preprocess_image(frame, config)[0])
    assert torch.equal(preprocess_video([frame], config, resize="pil")[0], preprocess_image(frame, config)[0])
    values, grid = preprocess_video([frame, other], config, max_pixels=50_000, resize="pil")
    assert grid == (1, *preprocess_image(frame, config, max_pixels=50_000)[1][1:])
    assert values.shape[0] == grid[1] * grid[2]


@pytest.mark.parametrize(("frames", "message"), [
    ([content(50, 50), "gone.png"], r"video 2 frame 'gone.png': file not found"),
    ([], "video 2: no frames"),
    (np.zeros((5, 10, 3), np.uint8), "video 2: .*4-D frame array"),
    ("gone.png", "video 2: expected a sequence of frames"),
    (np.zeros((3, 2, 900, 3), np.uint8), "video 2 frame 0: aspect ratio"),
])
def test_video_errors(frames, message):
    with pytest.raises(PreprocessError, match=message):
        preprocess_video(frames, pil_config("qwen2_5_vl"), index=2)


FRAME_COUNTS = [2, 3, 7, 10, 31, 60, 61, 299, 1001, 5000]
VIDEO_FPS = [1.0, 7.5, 24.0, 29.97, 30.0, 60.0]
TARGET_FPS = [0.5, 1.0, 2.0, 4.0]


def reference_sampler(sampling):
    """The video processor's own ``sample_frames`` of a sampling rule, compiled from the installed source."""
    namespace = {"torch": torch, "math": math, "np": np, "VideoMetadata": object, "logger": None}
    return hf_source_function(*VIDEO_FILES[sampling], "sample_frames", namespace)


@pytest.mark.parametrize("sampling", ["qwen2", "qwen3"])
def test_sample_indices_match_the_reference(sampling):
    sample = reference_sampler(sampling)
    for max_frames in (8, 768):  # the last is the class default, for the overrun below
        processor = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                                          max_frames=max_frames)
        for total in FRAME_COUNTS:
            for video_fps in VIDEO_FPS:
                for fps in TARGET_FPS:
                    metadata = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
                    expected = sample(processor, metadata, fps=fps).tolist()
                    ours = sample_indices(total, video_fps, VideoConfig(sampling, fps=fps, max_frames=max_frames), 2)
                    # The Qwen2 reference can step past the last frame (as below); we drop that index.
                    assert ours == [i for i in expected if i < total], (total, video_fps, fps, max_frames)
    if sampling == "qwen2":  # 1001 frames at 1 fps sampled at 0.5 fps: the float arange's 501st index is 1001
        overrun = sample(processor, types.SimpleNamespace(total_num_frames=1001, fps=1.0), fps=0.5).tolist()
        assert len(overrun) == 501 and overrun[-1] == 1001
        assert sample_indices(1001, 1.0, VideoConfig(fps=0.5), 2) == overrun[:-1]
        assert sample_indices(1001, 1.0, VideoConfig(fps=0.5), 2, clamp=True) == [*overrun[:-1], 1000]  # as vLLM
    assert sample_indices(1, 30.0, VideoConfig(sampling), 2) == [0]  # Qwen2's reference divides by zero here
    # Fewer frames asked than a temporal patch holds (the Qwen2 reference divides by zero): never every frame.
    assert len(sample_indices(120, 30.0, VideoConfig(sampling, fps=0.1, min_frames=1), 2)) == (2 if sampling ==
                                                                                                "qwen2" else 1)
    assert len(sample_indices(120, 30.0, VideoConfig(sampling, min_frames=1, max_frames=1), 2)) == (
        2 if sampling == "qwen2" else 1)
    assert sample_indices(100, 30.0, VideoConfig(sampling, fps=1e308), 2) == list(range(100))  # Qwen3's overflows


TARGET_SIZES = [(16, 24), (48, 64), (75, 100), (200, 40), (480, 640)]


@needs_video_processors
@pytest.mark.parametrize("family", list(VIDEO_SETTINGS))
@pytest.mark.parametrize("cap", [True, False])
def test_video_target_size_matches_processor_resize(family, cap):
    """Our size rule against the processors' own ``resize`` on blank clips, over sizes, frame counts and bounds."""
    from transformers.image_utils import SizeDict

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


@needs_video_processors
@pytest.mark.parametrize(("family", "like"), [("qwen2_5_vl", "qwen2_5_vl"), ("qwen2_vl", "qwen2_5_vl"),
                                             ("qwen3_omni_moe", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl"),
                                             ("qwen3_5", "qwen3_vl")])
def test_video_config_is_its_processor_class(family, like):
    """``for_family``: the class defaults of the family's transformers video processor; ``to_dict``: a file that
    class loads to the same settings."""
    vcfg, cls, pre = VideoConfig.for_family(family), video_processor_class(like), PreprocessConfig.for_family(family)
    assert vcfg.to_dict()["video_processor_type"] == cls.__name__
    assert (vcfg.min_pixels, vcfg.max_pixels) == (cls.size["shortest_edge"], cls.size["longest_edge"])
    assert (vcfg.min_frames, vcfg.max_frames, vcfg.max_video_tokens) == (cls.min_frames, cls.max_frames,
                                                                        cls.max_video_tokens)
    # transformers 5.24 reads an unset cap (the class default None) as "no cap".
    assert vcfg.fps == 2.0 and vcfg.cap_pixels_per_frame is bool(cls.cap_pixels_per_frame) is False
    vcfg = dataclasses.replace(vcfg, min_pixels=5000, max_pixels=90000, fps=1.5, min_frames=3, max_frames=40,
                               max_video_tokens=321)
    d = json.loads(json.dumps(vcfg.to_dict(pre)))
    assert VideoConfig.from_dict(d, family, pre) == vcfg
    processor = cls.from_dict(d)
    assert type(processor) is cls
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (5000, 90000)
    assert (processor.fps, processor.min_frames, processor.max_frames) == (1.5, 3, 40)
    assert (processor.cap_pixels_per_frame, processor.max_video_tokens, processor.do_sample_frames) == (False, 321,
                                                                                                        True)
    assert (processor.patch_size, list(processor.image_mean)) == (pre.patch_size, list(pre.image_mean))


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
    ({"size": {"longest_edge": 10**6}}, "lacks shortest_edge"),  # the reference's resize refuses it too
    ({"size": {"height": 224, "width": 224}}, "lacks shortest_edge"),
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


def test_qwen2_sampling_under_an_odd_max_frames_is_the_reference_s():
    """Qwen2's count is rounded down to the temporal patch under max_frames, never up past it."""
    sample = reference_sampler("qwen2")
    for max_frames in (5, 7, 9):
        processor = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4,
                                          max_frames=max_frames)
        for total, video_fps in ((60, 7.5), (299, 30.0)):
            expected = sample(processor, types.SimpleNamespace(total_num_frames=total, fps=video_fps), fps=4.0).tolist()
            ours = sample_indices(total, video_fps, VideoConfig("qwen2", fps=4.0, max_frames=max_frames), 2)
            assert ours == [i for i in expected if i < total] and len(ours) <= max_frames


def test_frames_given_with_their_rate_are_sampled_at_the_fps_asked():
    """Not at the config's fps; an int rate is a rate too; the record says which frames, at what rates."""
    frames = np.stack([content(32, 48, seed=i) for i in range(24)])  # 4 s at 6 fps
    vcfg = VideoConfig("qwen3", fps=2.0)
    keep = sample_indices(24, 6.0, VideoConfig("qwen3", fps=1.0), 2)
    assert keep != sample_indices(24, 6.0, vcfg, 2)
    for video, rate in ((frames, 6.0), (list(frames), 6)):
        [sampled], [info] = sample_frames_by_fps([video], 1.0, rate, vcfg, 2)
        assert np.array_equal(np.stack(sampled), frames[keep])
        assert (info.frame_indices, info.total_frames, info.video_fps, info.requested_fps) == (keep, 24, 6.0, 1.0)
        assert info.timestamps == [i / 6.0 for i in keep]


@pytest.mark.parametrize(("height", "width"), [(17, 43), (43, 17), (20, 300), (300, 20)])
def test_qwen3_target_size_of_a_clip_with_one_side_below_the_factor(height, width):
    pytest.importorskip("torchvision")
    from transformers.image_utils import SizeDict

    pre = PreprocessConfig.for_family("qwen3_vl")
    vcfg = dataclasses.replace(VideoConfig.for_family("qwen3_vl"), min_pixels=4096, max_pixels=400000)
    processor = video_processor("qwen3_vl")
    for frames in (2, 8):
        clip = torch.zeros((1, frames, 3, height, width), dtype=torch.uint8)
        expected = processor.resize(clip, size=SizeDict(shortest_edge=4096, longest_edge=400000), resample=3,
                                    factor=pre.factor, temporal_factor=2, cap_pixels_per_frame=False).shape[-2:]
        assert video_target_size(frames, height, width, pre, vcfg) == tuple(expected)


def test_frames_with_transparency_take_the_image_steps_without_a_video_config():
    frame = np.concatenate([content(60, 80), np.full((60, 80, 1), 128, np.uint8)], axis=2)
    config = pil_config("qwen2_5_vl")
    values, _ = preprocess_video([frame, frame], config, resize="pil")
    assert torch.equal(values, preprocess_image(frame, config)[0])


def test_video_config_refuses_a_zero_fps_and_takes_equal_bounds_given_twice():
    with pytest.raises(ConfigError, match="fps"):
        VideoConfig(fps=0)
    d = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "min_pixels": 4096, "max_pixels": 25165824}
    assert VideoConfig.from_dict(d, "qwen3_vl").min_pixels == 4096
