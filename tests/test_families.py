"""Every supported model_type, loaded through ``load_encoder`` from a checkpoint in its released layout (nested
config, its prefix, other shards present), against transformers' tower of that family holding the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision import PreprocessError, load_encoder
from qwenvl_vision.cli import main
from qwenvl_vision.preprocess import PreprocessConfig
from tests.helpers import (
    FAMILY_SMALL,
    grids_for,
    hf_forward,
    hf_tower,
    inputs,
    non_vision_shards,
    rel_err,
    write_checkpoint,
)

FAMILIES = list(FAMILY_SMALL)


@pytest.fixture(scope="module", params=FAMILIES)
def released(request, tmp_path_factory):
    """(config, folder, reference tower, reference outputs on a packed mixed pack) per family."""
    cfg = FAMILY_SMALL[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    vision = write_checkpoint(folder, cfg, sharded=True, other_shards=2)
    ref = hf_tower(cfg, seed=None)
    ref.load_state_dict(vision, strict=True)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        expected = hf_forward(ref, pixel_values, grid_thw)
    return cfg, folder, (pixel_values, grid_thw), expected


def _check(result, expected, grid_thw, tol: float) -> None:
    merged, levels = expected
    assert rel_err(torch.cat(result.embeddings).float(), merged) <= tol
    sizes = (grid_thw.prod(1) // 4).tolist()
    assert [e.shape[0] for e in result.embeddings] == sizes
    assert all(len(item) == len(levels) for item in result.deepstack)
    for level, ref_level in enumerate(levels):
        assert rel_err(torch.cat([item[level] for item in result.deepstack]).float(), ref_level) <= tol


def test_loads_and_matches_the_reference_fp32(released):
    cfg, folder, (pixel_values, grid_thw), expected = released
    encoder = load_encoder(folder, device="cpu")
    assert encoder.family == cfg.family and encoder.config.replace(name="") == cfg
    _check(encoder.encode_patches(pixel_values, grid_thw), expected, grid_thw, 1e-5)


def test_loads_and_matches_the_reference_bf16(released):
    _, folder, (pixel_values, grid_thw), expected = released
    encoder = load_encoder(folder, device="cpu", dtype="bf16")
    result = encoder.encode_patches(pixel_values, grid_thw)
    assert result.embeddings[0].dtype == torch.bfloat16
    _check(result, expected, grid_thw, 3e-2)


def test_other_shards_are_never_opened(released, tmp_path):
    """Language model, audio tower, talker and token2wav/code2wav shards may be garbage: they are not read."""
    cfg, folder, (pixel_values, grid_thw), expected = released
    copy = tmp_path / "copy"
    copy.mkdir()
    others = {p.name for p in non_vision_shards(folder)}
    assert len(others) == 2
    for path in folder.iterdir():
        (copy / path.name).write_bytes(b"\x00garbage" * 10 if path.name in others else path.read_bytes())
    _check(load_encoder(copy, device="cpu").encode_patches(pixel_values, grid_thw), expected, grid_thw, 1e-5)


def test_extract_weights_and_inspect(released, tmp_path, capsys):
    cfg, folder, (pixel_values, grid_thw), expected = released
    out = tmp_path / "vision-only"
    assert main(["extract-weights", str(folder), "--out", str(out)]) == 0
    names = set(load_file(str(out / "model.safetensors")))
    assert not any(name.startswith(cfg.spec.prefixes) for name in names)
    assert names == {k for k in hf_tower(cfg, device="meta", seed=None).state_dict()}  # the family's own names
    extracted = load_encoder(out, device="cpu")
    _check(extracted.encode_patches(pixel_values, grid_thw), expected, grid_thw, 1e-5)
    capsys.readouterr()
    for source in (folder, out):
        assert main(["inspect", str(source), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["family"] == cfg.family and report["tensors"] == len(names)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_preprocessing_defaults_without_a_preprocessor_file(tmp_path, family):
    """No preprocessor_config.json: the family's released settings (patch, mean/std, pixel bounds)."""
    cfg = FAMILY_SMALL[family]
    write_checkpoint(tmp_path, cfg, sharded=False)
    (tmp_path / "preprocessor_config.json").unlink()
    encoder = load_encoder(tmp_path, device="cpu")
    assert encoder.preprocess_config == PreprocessConfig.for_family(family)
    assert encoder.preprocess_config.patch_size == cfg.patch_size
    assert encoder.preprocess_config.image_mean == cfg.spec.image_mean
    with pytest.raises(PreprocessError, match="image 0"):
        encoder.encode_images([torch.zeros(3, 0, 4, dtype=torch.uint8)])
