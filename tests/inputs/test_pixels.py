"""qwenvl_vision.inputs.pixels against transformers: the image ``smart_resize`` (the shared size rule), compared with
``image_processing_pil_qwen2_vl.smart_resize`` over random sizes and bounds. The other pixel steps are compared
pixel by pixel through ``preprocess_image`` (tests/inputs/test_images.py, tests/inputs/test_images_torch.py) and
the video pipelines (tests/inputs/test_video.py, tests/inputs/test_video_io.py), where the reference runs them end
to end.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwenvl_vision.inputs.pixels import smart_resize

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


@pytest.mark.parametrize("factor", [28, 32])
@pytest.mark.parametrize("bounds", [(3136, 12845056), (65536, 16777216), (3136, 100_000), (200_000, 400_000)])
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

