"""The in-place / out= forms of the shared layers give the reference's bits, and the buffers carry no state."""

from __future__ import annotations

import pytest
import torch

from qwenvl_vision import build_model
from qwenvl_vision.layers import RMSNorm, activation, activation_, apply_rope, apply_rope_, rope_cos_sin
from tests.reference import hf_forward, rel_err, spread_init_
from tests.test_towers import QWEN2_5_GRIDS, QWEN2_5_SMALL, QWEN3_GRIDS, QWEN3_SMALL_72, _inputs


def _rope_inputs(n=37, heads=3, hd=80, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(n, 3, heads, hd, generator=gen) * 4).to(dtype)
    positions = torch.randint(0, 90, (n, 2), generator=gen)
    cos, sin = rope_cos_sin(positions, hd)
    return qkv, cos, sin


def test_rope_in_place_is_bitwise_the_reference_on_a_strided_view():
    qkv, cos, sin = _rope_inputs()
    q = qkv[:, 0]  # a strided view, as inside attention
    expected = apply_rope(q, cos, sin)
    untouched = qkv[:, 1:].clone()
    apply_rope_(q, cos, sin, torch.empty(q.shape))
    assert torch.equal(q, expected)
    assert torch.equal(qkv[:, 1:], untouched)  # k and v were not written


def test_rope_in_place_bf16_computes_in_fp32_like_the_reference():
    qkv, cos, sin = _rope_inputs(dtype=torch.bfloat16)
    k = qkv[:, 1]
    expected = apply_rope(k, cos, sin)
    apply_rope_(k, cos, sin, torch.empty(k.shape, dtype=k.dtype))
    assert torch.equal(k, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_into_a_buffer_is_bitwise_the_plain_forward(dtype):
    norm = RMSNorm(96)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96) * 3)
    x = (torch.randn(50, 96) * 7).to(dtype)
    norm = norm.to(dtype)
    out = torch.full_like(x, float("nan"))
    assert norm(x, out=out) is out
    assert torch.equal(out, norm(x))


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_in_place_activations_match_the_modules(name):
    x = torch.randn(40, 33) * 5
    assert torch.equal(activation_(x.clone(), name), activation(name)(x))


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'relu6'"):
        activation_(torch.zeros(1), "relu6")


@pytest.mark.parametrize(("cfg", "grids"), [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)])
def test_reused_buffers_leave_inputs_alone_and_repeat_exactly(cfg, grids):
    """Buffers are per forward: a second forward after a different pack gives the same bits."""
    model = spread_init_(build_model(cfg))
    pixels, grid_thw = _inputs(cfg, grids)
    before = pixels.clone()
    with torch.no_grad():
        first, levels = model(pixels, grid_thw)
        model(*_inputs(cfg, grids[::-1], seed=5))
        again, levels_again = model(pixels, grid_thw)
    assert torch.equal(pixels, before)
    assert torch.equal(first, again)
    assert all(torch.equal(a, b) for a, b in zip(levels, levels_again))


@pytest.mark.parametrize(("cfg", "grids"), [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
def test_under_autograd_the_towers_run_out_of_place_and_gradients_match_transformers(cfg, grids):
    """Buffers and in-place ops would break backward: with grad recording the towers run out of place.
    Checked both ways: input gradients (saliency) and one block's weights trainable (adapters)."""
    from tests.test_towers import _pair

    ours, ref = _pair(cfg)
    pixels, grid_thw = _inputs(cfg, grids)
    grads = {}
    for name, tower in (("ours", ours), ("ref", ref)):
        x = pixels.clone().requires_grad_(True)
        merged, levels = (tower(x, grid_thw) if name == "ours" else hf_forward(tower, x, grid_thw))
        (merged.square().sum() + sum(level.sum() for level in levels)).backward()
        grads[name] = x.grad
    assert grads["ours"].abs().sum() > 0
    assert rel_err(grads["ours"], grads["ref"]) <= 1e-5

    ours.blocks[1].requires_grad_(True)
    ours(pixels, grid_thw)[0].sum().backward()
    assert ours.blocks[1].attn.qkv.weight.grad is not None
