"""The tests' shared helpers, one import away: ``from tests.helpers import NAME`` for every name below.

Each lives in one home, re-exported here:

- ``bench.workloads``: the small config of every family (``FAMILY_SMALL``, ``QWEN2_5_SMALL``, ...), packs of
  grids and random inputs, photos;
- ``bench.reference``: transformers' towers as the reference (``hf_tower``, ``pair``, ...) and relative errors,
  per item of a pack (``item_errors``);
- ``tests.helpers.reference``: the per-item assertion against the reference, transformers' video preprocessing;
- ``tests.helpers.checkpoints``: checkpoints in each family's released on-disk layout;
- ``tests.helpers.media``: video files and image folders;
- ``tests.helpers.memory``: the live-tensor census;
- ``tests.helpers.fake_hub``: a stand-in of the Hugging Face Hub (loopback HTTP only).
"""

from __future__ import annotations

from pathlib import Path

from bench.reference import (
    HF_TOWERS,
    hf_classes,
    hf_forward,
    hf_tower,
    hf_vision_config,
    hf_vision_fields,
    item_errors,
    ours_from,
    pair,
    rel_err,
)
from bench.workloads import (
    FAMILY_SMALL,
    QWEN2_5_GRIDS,
    QWEN2_5_SMALL,
    QWEN3_GRIDS,
    QWEN3_SMALL_64,
    QWEN3_SMALL_72,
    grids_for,
    inputs,
    photo,
    sample_photo,
    synthetic_photo,
)
from tests.helpers.checkpoints import (
    DEFAULT_OTHER,
    OTHER_TENSORS,
    PREPROCESSOR_FILES,
    QWEN3_VIDEO_PREPROCESSOR_FILE,
    non_vision_shards,
    released_config_json,
    write_checkpoint,
)
from tests.helpers.fake_hub import FakeHub, Revision, serve_hub, use_endpoint
from tests.helpers.media import make_image_folder, write_video
from tests.helpers.memory import census, live_tensor_bytes, rss_bytes
from tests.helpers.reference import VIDEO_FILES, assert_matches_reference, hf_source_function, reference_video

REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "DEFAULT_OTHER", "FAMILY_SMALL", "HF_TOWERS", "OTHER_TENSORS", "PREPROCESSOR_FILES", "QWEN2_5_GRIDS",
    "QWEN2_5_SMALL", "QWEN3_GRIDS", "QWEN3_SMALL_64", "QWEN3_SMALL_72", "QWEN3_VIDEO_PREPROCESSOR_FILE", "REPO",
    "VIDEO_FILES", "FakeHub", "Revision", "assert_matches_reference", "census", "grids_for", "hf_classes",
    "hf_forward", "hf_source_function", "hf_tower", "hf_vision_config", "hf_vision_fields", "inputs",
    "item_errors", "live_tensor_bytes", "make_image_folder", "non_vision_shards", "ours_from", "pair", "photo",
    "reference_video", "released_config_json", "rel_err", "rss_bytes", "sample_photo", "serve_hub",
    "synthetic_photo", "use_endpoint", "write_checkpoint", "write_video",
]
