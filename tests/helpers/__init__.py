"""The tests' shared helpers, one import away: ``from tests.helpers import NAME`` for every name below.

Each lives in one home, re-exported here:

- ``qwenvl_vision.testing.workloads``: the small config of every family (``FAMILY_SMALL``, ``QWEN2_5_SMALL``,
  ...), packs of grids and random inputs, photos;
- ``qwenvl_vision.testing.reference``: transformers' towers as the reference (``hf_tower``, ``pair``, ...) and
  relative errors, per item of a pack (``item_errors``);
- ``tests.helpers.reference``: the reference tower's outputs on a pack, the per-item assertions against them (of
  a tower's outputs or an ``EncodeResult``), transformers' video preprocessing;
- ``tests.helpers.processors``: transformers' image and video processors with the released settings, the saved
  video preprocessor files;
- ``tests.helpers.checkpoints``: checkpoints in each family's released on-disk layout;
- ``tests.helpers.safetensors_files``: editing a written checkpoint's index and shard headers in place;
- ``tests.helpers.media``: generated image content, video files and image folders;
- ``tests.helpers.machine``: probes of this machine's kernels, for claims that hold on some CPUs only;
- ``tests.helpers.memory``: the live-tensor census;
- ``tests.helpers.fake_hub``: a stand-in of the Hugging Face Hub (loopback HTTP only).
"""

from __future__ import annotations

import os
from pathlib import Path

from qwenvl_vision.testing.reference import (
    HF_TOWERS,
    hf_classes,
    hf_forward,
    hf_tower,
    hf_vision_fields,
    item_errors,
    ours_from,
    pair,
    rel_err,
)
from qwenvl_vision.testing.workloads import (
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
from tests.helpers.machine import (
    addmm_ignores_row_stride,
    forced_plan,
    packed_gives_addmm_bits,
    skip_unless_onednn_runs,
)
from tests.helpers.media import content, make_image_folder, write_video
from tests.helpers.memory import census, live_tensor_bytes, rss_bytes
from tests.helpers.processors import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE_SETTINGS,
    PIXEL_TOL,
    QWEN2_5_SAVED_VIDEO,
    QWEN3_SAVED_VIDEO,
    REFERENCE_FAMILIES,
    VIDEO_SETTINGS,
    image_processors,
    image_reference,
    pil_config,
    video_processor,
    video_processor_class,
)
from tests.helpers.reference import (
    VIDEO_FILES,
    assert_matches_reference,
    assert_result_matches_reference,
    forward_both,
    hf_source_function,
    packed,
    reference_outputs,
    reference_video,
    segment_reference,
)
from tests.helpers.safetensors_files import (
    INDEX_FILE,
    LN_Q,
    edit_header,
    join_shard,
    offsets_of,
    read_index,
    same_size_pair,
    set_entry,
    shard_of,
    split_shard,
    write_index,
)

REPO = Path(__file__).resolve().parents[2]
# Children import this checkout's package, single-threaded (a 2-core machine runs several processes at once).
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

__all__ = [
    "CLIP_MEAN", "CLIP_STD", "DEFAULT_OTHER", "ENV", "FAMILY_SMALL", "HF_TOWERS", "IMAGE_SETTINGS", "INDEX_FILE",
    "LN_Q", "OTHER_TENSORS", "PIXEL_TOL", "PREPROCESSOR_FILES", "QWEN2_5_GRIDS", "QWEN2_5_SAVED_VIDEO", "QWEN2_5_SMALL",
    "QWEN3_GRIDS", "QWEN3_SAVED_VIDEO", "QWEN3_SMALL_64", "QWEN3_SMALL_72", "QWEN3_VIDEO_PREPROCESSOR_FILE",
    "REFERENCE_FAMILIES", "REPO", "VIDEO_FILES", "VIDEO_SETTINGS", "FakeHub", "Revision", "assert_matches_reference",
    "assert_result_matches_reference", "census", "content", "edit_header", "forward_both", "grids_for", "hf_classes",
    "hf_forward", "hf_source_function", "hf_tower", "hf_vision_fields", "image_processors",
    "image_reference", "inputs", "item_errors", "join_shard", "live_tensor_bytes", "make_image_folder",
    "non_vision_shards", "offsets_of", "ours_from", "packed", "addmm_ignores_row_stride", "forced_plan",
    "packed_gives_addmm_bits", "skip_unless_onednn_runs", "pair", "photo", "pil_config", "read_index",
    "reference_outputs", "reference_video", "rel_err", "released_config_json", "rss_bytes", "same_size_pair",
    "segment_reference",
    "sample_photo", "serve_hub", "set_entry", "shard_of", "split_shard", "synthetic_photo", "use_endpoint",
    "video_processor", "video_processor_class", "write_checkpoint", "write_index", "write_video",
]
