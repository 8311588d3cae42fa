"""Every supported model_type, loaded through ``load_encoder`` from a checkpoint in its released layout (nested
config, its prefix, other shards present), against transformers' tower of that family holding the same weights.
"""

from __future__ import annotations

import pytest
import torch

from qwenvl_vision import PreprocessError, load_encoder
from tests.helpers import (
    FAMILY_SMALL,
    assert_result_matches_reference,
    grids_for,
    hf_tower,
    inputs,
    non_vision_shards,
    reference_outputs,
    write_checkpoint,
)

FAMILIES = list(FAMILY_SMALL)

# The releases' preprocessor_config.json values (docs/architecture.md, "Preprocessing defaults"), written out here so
# that the defaults are checked against the releases rather than against the table they are read from.
CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
QWEN2_PREPROCESSING = (14, *CLIP, 3136, 12845056, "pil")
QWEN3_PREPROCESSING = (16, *HALF, 65536, 16777216, "torch")
RELEASED_PREPROCESSING = {
    "qwen2_vl": QWEN2_PREPROCESSING, "qwen2_5_vl": QWEN2_PREPROCESSING, "qwen2_5_omni": QWEN2_PREPROCESSING,
    "qwen3_vl": QWEN3_PREPROCESSING, "qwen3_vl_moe": QWEN3_PREPROCESSING,
    "qwen3_omni_moe": (16, *HALF, 3136, 12845056, "pil"),  # its processors are Qwen2-VL's
    "qwen3_5": QWEN3_PREPROCESSING, "qwen3_5_moe": QWEN3_PREPROCESSING, "qwen4_exp": QWEN3_PREPROCESSING,
}


@pytest.fixture(scope="module", params=FAMILIES)
def released(request, tmp_path_factory):
    """(config, folder, a packed mixed pack, the reference tower's outputs on it) per family."""
    cfg = FAMILY_SMALL[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    vision = write_checkpoint(folder, cfg, sharded=True, other_shards=2)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    return cfg, folder, (pixel_values, grid_thw), reference_outputs(cfg, vision, pixel_values, grid_thw)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_loads_and_matches_the_reference(released, dtype, tol):
    cfg, folder, (pixel_values, grid_thw), expected = released
    encoder = load_encoder(folder, device="cpu", dtype=dtype)
    assert encoder.family == cfg.model_type and encoder.config.replace(name="") == cfg
    result = encoder.encode_patches(pixel_values, grid_thw)
    assert result.embeddings[0].dtype == dtype
    assert_result_matches_reference(result, expected, grid_thw, tol)


def test_other_shards_are_never_opened(released, tmp_path):
    """Language model, audio tower, talker and token2wav/code2wav shards may be garbage: they are not read."""
    cfg, folder, (pixel_values, grid_thw), expected = released
    copy = tmp_path / "copy"
    copy.mkdir()
    others = {p.name for p in non_vision_shards(folder)}
    assert len(others) == 2
    for path in folder.iterdir():
        (copy / path.name).write_bytes(b"\x00garbage" * 10 if path.name in others else path.read_bytes())
    result = load_encoder(copy, device="cpu").encode_patches(pixel_values, grid_thw)
    assert_result_matches_reference(result, expected, grid_thw, 1e-5)


def test_a_tower_transformers_saved_on_its_own_loads(released, tmp_path):
    """``model.visual.save_pretrained(folder)``: the vision config at the top, named for its family
    ("qwen2_5_vl_vision"), its tensors without a prefix."""
    cfg, _, (pixel_values, grid_thw), expected = released
    hf_tower(cfg).save_pretrained(tmp_path)  # seed 0: write_checkpoint's weights
    result = load_encoder(tmp_path, device="cpu").encode_patches(pixel_values, grid_thw)
    assert_result_matches_reference(result, expected, grid_thw, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_preprocessing_defaults_without_a_preprocessor_file(tmp_path, family):
    """No preprocessor_config.json: the family's released settings (patch, mean/std, pixel bounds)."""
    cfg = FAMILY_SMALL[family]
    write_checkpoint(tmp_path, cfg, sharded=False)
    (tmp_path / "preprocessor_config.json").unlink()
    encoder = load_encoder(tmp_path, device="cpu")
    settings = encoder.preprocess_config
    patch, mean, std, min_pixels, max_pixels, resize = RELEASED_PREPROCESSING[family]
    assert (settings.patch_size, settings.merge_size, settings.temporal_patch_size) == (patch, 2, 2)
    assert (settings.image_mean, settings.image_std) == (mean, std)
    assert (settings.min_pixels, settings.max_pixels, settings.resize) == (min_pixels, max_pixels, resize)
    with pytest.raises(PreprocessError, match="image 0"):
        encoder.encode_images([torch.zeros(3, 0, 4, dtype=torch.uint8)])
