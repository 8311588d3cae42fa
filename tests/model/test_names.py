"""Module tensor names <-> each family's checkpoint names (``qwenvl_vision.model.names``), against transformers' towers:
their module names are the released checkpoints' tensor names (without the prefix)."""

from __future__ import annotations

import pytest
import torch

from qwenvl_vision import build_model
from qwenvl_vision.model.config import FAMILIES
from qwenvl_vision.model.names import RULE_SETS, checkpoint_names, to_checkpoint_state, to_module_state
from tests.helpers import FAMILY_SMALL, hf_tower


def test_every_family_names_only_known_rule_sets():
    for family in FAMILIES.values():
        unknown = [name for name in family.names if name not in RULE_SETS]
        assert not unknown, (family.model_type, unknown)


@pytest.mark.parametrize("family", list(FAMILY_SMALL))
def test_module_names_map_onto_exactly_the_reference_names_and_shapes(family):
    cfg = FAMILY_SMALL[family]
    ours = build_model(cfg, device="meta").state_dict()
    reference = hf_tower(cfg, device="meta", seed=None).state_dict()
    mapped = to_checkpoint_state(cfg, ours)
    assert set(mapped) == set(reference)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in reference.items()}


def test_stacked_parts_are_concatenated_in_order_and_split_back():
    cfg = FAMILY_SMALL["qwen2_5_omni"]
    names = checkpoint_names(cfg, "blocks.0.attn.qkv.weight")
    assert names == ("blocks.0.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.attn.v.weight")
    parts = {name: torch.full((2, 3), float(i)) for i, name in enumerate(names)}
    state = to_module_state(cfg, dict(parts), ["blocks.0.attn.qkv.weight"])
    assert state["blocks.0.attn.qkv.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    back = to_checkpoint_state(cfg, state)
    assert all(torch.equal(back[name], parts[name]) for name in parts)
