"""The in-place forms of the shared layers against transformers' own functions, and buffers that carry no state."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm, apply_rotary_pos_emb_vision

from qwenvl_vision import config
from qwenvl_vision.layers import (
    ACTIVATIONS,
    SCRATCH_ELEMENTS,
    LayerNorm,
    RMSNorm,
    Workspace,
    rope_cos_sin,
    rotate_qk_into,
    signed_sin,
)
from qwenvl_vision.names import to_checkpoint_state
from tests.helpers import QWEN2_5_GRIDS, QWEN2_5_SMALL, QWEN3_GRIDS, QWEN3_SMALL_72, hf_forward, inputs, pair, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [True, False])
def test_rope_in_a_workspace_is_bitwise_the_reference_on_strided_views(dtype, in_place):
    """q and k rotated together inside the qkv rows (in place, or from a fresh chunk into a buffer), by row chunks
    through fp32 scratch with the signs folded into the sin table: the reference's bits, v untouched. Bits on any
    CPU: the reference's multiplies and adds in its order, each IEEE-rounded, whatever the rows' chunking."""
    gen = torch.Generator().manual_seed(0)
    rows = 2 * (SCRATCH_ELEMENTS // (2 * 3 * 80)) + 37  # three chunks, the last one partial
    qkv = (torch.randn(rows, 3, 3, 80, generator=gen) * 4).to(dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 90, (rows, 2), generator=gen), 80)
    expected_q, expected_k = apply_rotary_pos_emb_vision(qkv[:, 0].clone(), qkv[:, 1].clone(), cos, sin)
    untouched = qkv[:, 2].clone()
    out = qkv if in_place else torch.full_like(qkv, float("nan"))
    with Workspace(rows, 240, 720, dtype, torch.device("cpu")).active():
        rotate_qk_into(qkv.view(rows, 9, 80)[:, :6], out.view(rows, 9, 80)[:, :6], cos, signed_sin(sin))
    assert torch.equal(out[:, 0], expected_q.to(dtype)) and torch.equal(out[:, 1], expected_k.to(dtype))
    assert torch.equal(qkv[:, 2], untouched)  # v was not written
    assert in_place or out[:, 2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_into_a_workspace_buffer_is_bitwise_the_reference(dtype):
    """Bits on any CPU: the reference's ops in its order, and aten reduces each row alone (a chunk of rows is
    reduced as the whole tensor's rows are)."""
    ours, ref = RMSNorm(96), Qwen2_5_VLRMSNorm(96)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(96) * 3)
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(3 * SCRATCH_ELEMENTS // 96 + 5, 96) * 7).to(dtype)  # several chunks
    with torch.no_grad(), Workspace(x.shape[0], 96, 96 * 3, dtype, torch.device("cpu")).active() as workspace:
        out = ours(x)
        assert out.untyped_storage().data_ptr() == workspace.buffers[0].untyped_storage().data_ptr()
        assert torch.equal(out, ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_into_a_workspace_buffer_is_bitwise_torch(dtype):
    """Bits on any CPU: the same aten kernel, which normalises each row alone, on chunks of the rows."""
    ours, ref = LayerNorm(96, eps=1e-6), torch.nn.LayerNorm(96, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
        ref.load_state_dict(ours.state_dict())
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(3 * SCRATCH_ELEMENTS // 96 + 5, 96) * 7).to(dtype)
    with torch.no_grad(), Workspace(x.shape[0], 96, 96 * 3, dtype, torch.device("cpu")).active() as workspace:
        out = ours(x)
        assert out.untyped_storage().data_ptr() == workspace.buffers[0].untyped_storage().data_ptr()
        assert torch.equal(out, ref(x))


def test_every_activation_a_config_may_name_is_implemented():
    assert set(ACTIVATIONS) == set(config.ACTIVATIONS)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_in_place_activations_are_bitwise_transformers_activations(name):
    """Bits on any CPU: the same aten kernel over the same iteration (in place on a contiguous tensor, into a
    strided destination from the same strided rows)."""
    x = torch.randn(2 * SCRATCH_ELEMENTS // 33 + 40, 33) * 5  # chunked ones cover every row
    _, in_place, into = ACTIVATIONS[name]
    assert torch.equal(in_place(x.clone()), ACT2FN[name](x))
    out = torch.full_like(x, float("nan"))[:, 1:]  # a strided destination: a workspace's rows of a wider buffer
    assert torch.equal(into(x[:, 1:], out), ACT2FN[name](x[:, 1:]))


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
