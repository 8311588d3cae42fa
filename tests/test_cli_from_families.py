"""``qwenvl-vision extract-weights`` and ``inspect`` on a checkpoint of every family in its released layout (to be
merged into tests/test_cli.py): the vision-only file holds exactly the family's tensor names, without prefix, and
loads into a tower that matches transformers' tower holding the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision import load_encoder
from qwenvl_vision.cli import main
from tests.helpers import (
    FAMILY_SMALL,
    assert_matches_reference,
    grids_for,
    hf_forward,
    hf_tower,
    inputs,
    write_checkpoint,
)


@pytest.mark.parametrize("family", list(FAMILY_SMALL))
def test_extract_weights_and_inspect(tmp_path, capsys, family):
    cfg = FAMILY_SMALL[family]
    folder = tmp_path / "released"
    vision = write_checkpoint(folder, cfg, sharded=True, other_shards=2)
    ref = hf_tower(cfg, seed=None)
    ref.load_state_dict(vision, strict=True)
    out = tmp_path / "vision-only"
    assert main(["extract-weights", str(folder), "--out", str(out)]) == 0
    names = set(load_file(str(out / "model.safetensors")))
    assert not any(name.startswith(cfg.spec.prefixes) for name in names)
    assert names == set(vision)  # the family's own names, as transformers' tower names its modules
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    result = load_encoder(out, device="cpu").encode_patches(pixel_values, grid_thw)
    with torch.no_grad():
        expected = hf_forward(ref, pixel_values, grid_thw)
    levels = [torch.cat([item[level] for item in result.deepstack]) for level in range(len(expected[1]))]
    assert_matches_reference((torch.cat(result.embeddings), levels), expected, grid_thw, 1e-5)
    capsys.readouterr()
    for source in (folder, out):
        assert main(["inspect", str(source), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["family"] == cfg.family and report["tensors"] == len(names)
