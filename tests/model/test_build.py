"""Building towers from transformers' (``models.from_transformers``) and loading transformers' state dicts into ours
(the tower's ``load_state_dict`` pre-hook), for every family, against transformers' tower holding the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionConfig

from qwenvl_vision import ConfigError, build_model
from qwenvl_vision.model.build import from_transformers
from tests.helpers import FAMILY_SMALL, assert_matches_reference, forward_both, grids_for, hf_tower

FAMILY_IDS = list(FAMILY_SMALL)


def assert_matches(ours, ref, cfg, tol: float = 1e-5) -> None:
    assert_matches_reference(*forward_both(ours, ref, cfg, grids_for(cfg)), tol)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_from_transformers_reads_config_and_weights(family):
    """The config read from the reference's, the weights a copy loaded under transformers' names (split gate/up,
    Omni's q/k/v, fc1/fc2, ln_q/mlp.N mergers: stacked and renamed as they arrive, as every parity test's strict
    ``load_state_dict`` of the reference's state dict does)."""
    cfg = FAMILY_SMALL[family]
    ref = hf_tower(cfg, seed=5)
    ours = from_transformers(ref)
    assert ours.config == cfg
    assert not any(p.requires_grad for p in ours.parameters())
    source = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    assert not any(p.untyped_storage().data_ptr() in source for p in ours.parameters())  # a copy
    assert_matches(ours, ref, cfg)


# A tensor of each kind the pre-hook handles: a stacked part, a renamed MLP layer, a renamed merger, a plain one.
ONE_TENSOR = {"qwen2_5_omni": "blocks.0.attn.k.weight", "qwen2_5_vl": "blocks.2.mlp.up_proj.bias",
              "qwen2_vl": "blocks.0.mlp.fc1.weight", "qwen3_omni_moe": "merger_list.0.ln_q.bias",
              "qwen3_vl": "blocks.1.attn.qkv.weight"}


@pytest.mark.parametrize("family,part", ONE_TENSOR.items())
def test_a_missing_part_or_an_extra_tensor_still_fails_a_strict_load(family, part):
    cfg = FAMILY_SMALL[family]
    state = hf_tower(cfg, seed=None).state_dict()
    assert part in state
    with pytest.raises(RuntimeError, match="Missing key"):
        build_model(cfg).load_state_dict({k: v for k, v in state.items() if k != part}, strict=True)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"blocks.0.extra\""):
        build_model(cfg).load_state_dict({**state, "blocks.0.extra": torch.zeros(1)}, strict=True)


def test_stacked_parts_partly_there_are_reported_not_half_loaded():
    """Omni's q and v without k: qkv is missing, q and v are unexpected (none is silently dropped)."""
    cfg = FAMILY_SMALL["qwen2_5_omni"]
    state = {k: v for k, v in hf_tower(cfg, seed=None).state_dict().items() if k != "blocks.1.attn.k.bias"}
    result = build_model(cfg).load_state_dict(state, strict=False)
    assert result.missing_keys == ["blocks.1.attn.qkv.bias"]
    assert sorted(result.unexpected_keys) == ["blocks.1.attn.q.bias", "blocks.1.attn.v.bias"]


def test_module_names_still_load_and_nested_towers_take_checkpoint_names_under_their_prefix():
    cfg = FAMILY_SMALL["qwen2_5_vl"]
    ref = hf_tower(cfg, seed=6)
    ours = from_transformers(ref)
    again = build_model(cfg)
    again.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    parent = torch.nn.Module()
    parent.visual = build_model(cfg)
    parent.load_state_dict({"visual." + k: v for k, v in ref.state_dict().items()}, strict=True)
    assert_matches(parent.visual, ref, cfg)


def test_from_transformers_keeps_the_source_dtype():
    cfg = FAMILY_SMALL["qwen3_vl"]
    ref = hf_tower(cfg, seed=7)
    ours = from_transformers(ref.to(torch.bfloat16))
    assert ours.dtype == torch.bfloat16 and ours.attention == "sdpa"
    assert_matches(ours, ref.float(), cfg, tol=3e-2)


def test_from_transformers_refuses_what_it_cannot_serve():
    tower = torch.nn.Linear(2, 2)
    tower.config = CLIPVisionConfig()
    with pytest.raises(ConfigError, match=r"CLIPVisionConfig \(model_type 'clip_vision_model'\) is not the vision "):
        from_transformers(tower)
    with pytest.raises(ConfigError, match="is not the vision config"):
        from_transformers(torch.nn.Linear(2, 2))  # no config at all
    with pytest.raises(ConfigError, match="attn_impl 'flash' is not available"):
        from_transformers(hf_tower(FAMILY_SMALL["qwen2_5_vl"], seed=None), attn_impl="flash")
