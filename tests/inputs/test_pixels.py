"""qwenvl_vision.inputs.pixels against transformers: the image ``smart_resize`` (the shared size rule), compared with
``image_processing_pil_qwen2_vl.smart_resize`` over random sizes and bounds. The other pixel steps are compared
pixel by pixel through ``preprocess_image`` (tests/inputs/test_images.py, tests/inputs/test_images_torch.py) and
the video pipelines (tests/inputs/test_video.py, tests/inputs/test_video_io.py), where the reference runs them end
to end; here, a clip's size rule and the limits at their edges.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from qwenvl_vision.errors import ConfigError, PreprocessError
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image
from qwenvl_vision.inputs.pixels import smart_resize

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
hf_clip = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")


@pytest.mark.parametrize("factor", [28, 32])
@pytest.mark.parametrize("bounds", [(3136, 12845056), (65536, 16777216), (3136, 100_000), (200_000, 400_000),
                                    (100_000, 100_000)])
def test_smart_resize_matches_reference(factor, bounds):
    rng = np.random.default_rng(factor)
    sizes = rng.integers(1, 6000, size=(400, 2)).tolist() + [[14, 14], [42, 70], [2, 400], [400, 2], [1, 1]]
    for height, width in sizes:
        if max(height, width) / min(height, width) > 200:
            continue
        expected = hf_pil.smart_resize(height, width, factor, *bounds)
        assert smart_resize(height, width, factor, *bounds) == expected, (height, width)


def test_smart_resize_rounds_half_to_even():
    big = 10**9
    assert smart_resize(70, 98, 28, 1, big) == (56, 112)  # 2.5 -> 2, 3.5 -> 4
    assert smart_resize(42, 126, 28, 1, big) == (56, 112)  # 1.5 -> 2, 4.5 -> 4
    assert smart_resize(80, 112, 32, 1, big) == (64, 128)  # 2.5 -> 2, 3.5 -> 4
    assert smart_resize(80, 112, 32, 1, big) == hf_pil.smart_resize(80, 112, 32, 1, big)


def test_smart_resize_at_the_aspect_ratio_limit():
    assert smart_resize(10, 2000, 28, 3136, 12845056) == hf_pil.smart_resize(10, 2000, 28, 3136, 12845056)



def test_a_clip_s_size_matches_the_qwen3_video_reference_for_odd_frame_counts():
    """The clip's bound counts its frames rounded to the temporal patch (``t_bar``), its scale the count itself."""
    rng = np.random.default_rng(3)
    for _ in range(400):
        frames, height, width = int(rng.integers(2, 40)), *rng.integers(32, 2000, size=2).tolist()
        bounds = sorted(rng.integers(4096, 4_000_000, size=2).tolist())
        expected = hf_clip.smart_resize(frames, height, width, 2, 32, *bounds)
        assert smart_resize(height, width, 32, *bounds, num_frames=frames, temporal_factor=2) == expected, frames
    # 5 frames round to 4, whose 4 x 56 x 56 fit; 5 x 56 x 56 would not.
    assert smart_resize(56, 56, 28, 1, 14000, num_frames=5, temporal_factor=2) == (56, 56)


def test_the_limits_themselves_are_accepted_as_transformers_accepts_them(tmp_path):
    config = PreprocessConfig(min_pixels=100_352, max_pixels=100_352)  # one fixed budget
    assert preprocess_image(np.zeros((300, 500, 3), np.uint8), config)[1] == \
        (1, *(side // 14 for side in hf_pil.smart_resize(300, 500, 28, 100_352, 100_352)))
    with pytest.raises(ConfigError, match="min_pixels 100353 is above"):
        PreprocessConfig(min_pixels=100_353, max_pixels=100_352)
    preprocess_image(np.zeros((2, 400, 3), np.uint8), config)  # an aspect ratio of 200 exactly
    with pytest.raises(PreprocessError, match="aspect ratio 200.5"):
        preprocess_image(np.zeros((2, 401, 3), np.uint8), config)
    Image.new("RGB", (100, 50)).save(tmp_path / "a.png")
    preprocess_image(tmp_path / "a.png", config, max_input_pixels=5000)  # as many pixels as the limit
    with pytest.raises(PreprocessError, match="above the input limit of 4,999"):
        preprocess_image(tmp_path / "a.png", config, max_input_pixels=4999)
