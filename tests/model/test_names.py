"""Module tensor names <-> each family's checkpoint names (``qwenvl_vision.model.names``); that every family's
names and shapes are exactly transformers' is test_towers' strict load of our weights into its towers."""

from __future__ import annotations

import torch

from qwenvl_vision.model.names import checkpoint_names, to_checkpoint_state, to_module_names_
from tests.helpers import FAMILY_SMALL


def test_stacked_parts_are_concatenated_in_order_and_split_back():
    cfg = FAMILY_SMALL["qwen2_5_omni"]
    names = checkpoint_names(cfg, "blocks.0.attn.qkv.weight")
    assert names == ("blocks.0.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.attn.v.weight")
    parts = {name: torch.full((2, 3), float(i)) for i, name in enumerate(names)}
    state = to_module_names_(cfg, dict(parts), ["blocks.0.attn.qkv.weight"])
    assert state["blocks.0.attn.qkv.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    back = to_checkpoint_state(cfg, state)
    assert all(torch.equal(back[name], parts[name]) for name in parts)
