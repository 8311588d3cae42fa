"""transformers' image and video processors as the preprocessing tests' reference, configured from literal values
(the released checkpoints' settings), not from this package's configs, so that a bug in ``PreprocessConfig`` or
``VideoConfig`` cannot leak into the reference; and the video preprocessor files as transformers saves them.

transformers is imported when a processor is built: its video processors need torchvision (tests that build one skip
without it), and importing ``tests.helpers`` stays cheap.
"""

from __future__ import annotations

import copy
import dataclasses

from qwenvl_vision.inputs.images import PreprocessConfig

REFERENCE_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # one of each design's released settings
PIXEL_TOL = 1e-6  # largest absolute difference from the reference's pixel values
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

IMAGE_SETTINGS = {  # family -> its released preprocessor_config.json values, as the image processors' arguments
    "qwen2_5_vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD},
    "qwen3_vl": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
}
VIDEO_SETTINGS = {  # family -> its video processor's settings as the family's checkpoints write them
    "qwen2_5_vl": {"patch_size": 14, "image_mean": CLIP_MEAN, "image_std": CLIP_STD},
    "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
}

QWEN2_5_SAVED_VIDEO = {  # video_preprocessor_config.json as transformers saves a Qwen2.5-VL processor
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "do_sample_frames": False,
    "fps": None, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "input_data_format": None, "max_frames": 768,
    "max_pixels": 12845056, "merge_size": 2, "min_frames": 4, "min_pixels": 3136, "num_frames": None,
    "patch_size": 14, "processor_class": "Qwen2_5_VLProcessor", "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 12845056, "shortest_edge": 3136},
    "size_divisor": None, "temporal_patch_size": 2, "video_metadata": None,
    "video_processor_type": "Qwen2VLVideoProcessor",
}
QWEN3_SAVED_VIDEO = {  # ... and a Qwen3-VL one
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "do_sample_frames": True,
    "fps": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "max_frames": 768, "merge_size": 2, "min_frames": 4,
    "patch_size": 16, "resample": 3, "rescale_factor": 0.00392156862745098, "return_metadata": False,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "temporal_patch_size": 2,
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def pil_config(family: str) -> PreprocessConfig:
    """The family's released settings with the PIL backend, the one the PIL image processor is the reference of
    (Qwen3-VL's files name the torchvision processor; test_preprocess_torch.py compares that backend)."""
    return dataclasses.replace(PreprocessConfig.for_family(family), resize="pil")


def image_processors() -> dict:
    """family -> transformers' PIL image processor (``Qwen2VLImageProcessorPil``) with IMAGE_SETTINGS."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return {family: Qwen2VLImageProcessorPil(**copy.deepcopy(settings)) for family, settings in IMAGE_SETTINGS.items()}


def image_reference(processor, image, min_pixels=None, max_pixels=None):
    """The reference's (pixel_values, grid) for one image; per-call bounds go in as its ``size`` argument."""
    kwargs = {}
    if min_pixels is not None or max_pixels is not None:
        kwargs["size"] = {
            "shortest_edge": processor.size.shortest_edge if min_pixels is None else min_pixels,
            "longest_edge": processor.size.longest_edge if max_pixels is None else max_pixels,
        }
    out = processor(image, return_tensors="np", **kwargs)
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def video_processor_class(family: str):
    """transformers' video processor class of a family of VIDEO_SETTINGS (its module imports torchvision)."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return {"qwen2_5_vl": Qwen2VLVideoProcessor, "qwen3_vl": Qwen3VLVideoProcessor}[family]


def video_processor(family: str, **changes):
    """The family's video processor with VIDEO_SETTINGS, and `changes` on top."""
    return video_processor_class(family)(**copy.deepcopy(VIDEO_SETTINGS[family]), **changes)
