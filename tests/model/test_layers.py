"""The shared layers (the math) against transformers' own functions; repeated forwards; autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

from qwenvl_vision import ConfigError
from qwenvl_vision.model.layers import ACTIVATIONS, RMSNorm
from qwenvl_vision.model.names import to_checkpoint_state
from tests.helpers import (
    FAMILY_SMALL,
    QWEN2_5_GRIDS,
    QWEN2_5_SMALL,
    QWEN3_GRIDS,
    QWEN3_SMALL_72,
    hf_forward,
    inputs,
    pair,
    rel_err,
)


def test_a_config_may_name_exactly_the_model_s_activations_each_as_transformers_computes_it():
    x = torch.randn(500, 33) * 5
    for name, function in ACTIVATIONS.items():
        assert dataclasses.replace(QWEN2_5_SMALL, hidden_act=name).hidden_act == name
        assert torch.equal(function(x), ACT2FN[name](x)), name
    with pytest.raises(ConfigError, match="hidden_act 'relu' is not supported"):
        dataclasses.replace(QWEN2_5_SMALL, hidden_act="relu")


def test_rms_norm_is_bitwise_transformers():
    ours, ref = RMSNorm(96), Qwen2_5_VLRMSNorm(96)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(96) * 3)
        ref.weight.copy_(ours.weight)
    x = (torch.randn(300, 96) * 7).bfloat16()
    assert torch.equal(ours.bfloat16()(x), ref.bfloat16()(x))


@pytest.mark.parametrize(("cfg", "grids"), [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)])
def test_reused_buffers_leave_inputs_alone_and_repeat_exactly(cfg, grids):
    """Buffers are per forward: a second forward after a different pack gives the same bits."""
    model, _ = pair(cfg)
    pixels, grid_thw = inputs(cfg, grids)
    before = pixels.clone()
    with torch.no_grad():
        first, levels = model(pixels, grid_thw)
        model(*inputs(cfg, grids[::-1], seed=5))
        again, levels_again = model(pixels, grid_thw)
    assert torch.equal(pixels, before)
    assert torch.equal(first, again)
    assert all(torch.equal(a, b) for a, b in zip(levels, levels_again))


@pytest.mark.parametrize(("cfg", "grids"), [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
def test_under_autograd_the_towers_run_out_of_place_and_gradients_match_transformers(cfg, grids):
    """Buffers and in-place ops would break backward: with grad recording the towers run out of place.
    Checked both ways: input gradients (saliency) and one block's weights trainable (adapters)."""
    ours, ref = pair(cfg)
    pixels, grid_thw = inputs(cfg, grids)
    grads = {}
    for name, tower in (("ours", ours), ("ref", ref)):
        x = pixels.clone().requires_grad_(True)
        merged, levels = (tower(x, grid_thw) if name == "ours" else hf_forward(tower, x, grid_thw))
        (merged.square().sum() + sum(level.sum() for level in levels)).backward()
        grads[name] = x.grad
    assert grads["ours"].abs().sum() > 0
    assert rel_err(grads["ours"], grads["ref"]) <= 1e-5

    # One block trainable in both: its weight gradients, under the checkpoint names, match the reference's.
    ours.blocks[1].requires_grad_(True)
    ref.blocks[1].requires_grad_(True)
    ours(pixels, grid_thw)[0].square().sum().backward()
    hf_forward(ref, pixels, grid_thw)[0].square().sum().backward()
    ours_grads = to_checkpoint_state(cfg, {f"blocks.1.{name}": p.grad for name, p in ours.blocks[1].named_parameters()})
    ref_grads = {f"blocks.1.{name}": p.grad for name, p in ref.blocks[1].named_parameters()}
    assert set(ours_grads) == set(ref_grads)
    for name, grad in ours_grads.items():
        assert grad.abs().sum() > 0, name
        assert rel_err(grad, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_layer_norms_are_transformers_on_small_activations(family):
    """The LayerNorm families' norms (eps 1e-6 as the reference's): on small activations, where eps weighs, the
    block's and the merger's norms give the reference's bits."""
    cfg = FAMILY_SMALL[family]
    ours, ref = pair(cfg)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 1e-3
    ref_merger_norm = ref.merger.ln_q if family == "qwen2_vl" else ref.merger.norm
    with torch.no_grad():
        for name in ("norm1", "norm2"):
            assert torch.equal(getattr(ours.blocks[0], name)(x), getattr(ref.blocks[0], name)(x)), name
        assert torch.equal(ours.merger.norm(x), ref_merger_norm(x))
