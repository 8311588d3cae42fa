"""The native elementwise kernels (``backends/cpu/native.c``) against transformers' ops, towers on them against
transformers' towers, and the plan's choice of them where they cannot be built."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm, apply_rotary_pos_emb_vision

from qwenvl_vision import ConfigError
from qwenvl_vision.backends.cpu import machine
from qwenvl_vision.backends.cpu.backend import CpuBackend
from qwenvl_vision.backends.cpu.native import NativeKernels
from qwenvl_vision.model.layers import RMSNorm, rope_cos_sin
from tests.helpers import (
    FAMILY_SMALL,
    assert_matches_reference,
    forced_plan,
    grids_for,
    hf_forward,
    hf_tower,
    inputs,
    ours_from,
)

DTYPES = [torch.float32, torch.bfloat16]
ROWS = 301  # rows split unevenly over the threads


def native():
    kernels = machine.native_kernels()
    if kernels is None:
        pytest.skip("no C compiler builds the native CPU kernels here (the warning says why)")
    return kernels


def strided(rows: int, width: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """rows x width random values, rows of a wider buffer (a workspace's rows)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 7, generator=generator) * scale).to(dtype)[:, 3:3 + width]


def assert_within_a_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a few fp32 ulps (a sum's order, a vector expf's last bits) of each value or, where a LayerNorm's bias
    cancels the rest, of the largest; in bf16 those rarely survive the rounding: one bf16 ulp, under 1% of them."""
    rtol = {torch.float32: 2**-21, torch.bfloat16: 2**-7}[want.dtype]  # 4 fp32 ulps; 1 bf16 ulp
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())
    assert want.dtype == torch.float32 or (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_the_residual_add_is_bitwise_torch_s_and_the_norm_is_transformers_within_a_rounding(dtype, kind):
    kernels, dim = native(), 200
    x, update, out = strided(ROWS, dim, dtype, 3), strided(ROWS, dim, dtype, 3, 1), strided(ROWS, dim, dtype)
    ours, ref = (RMSNorm(dim), Qwen2_5_VLRMSNorm(dim)) if kind == "rms" else (torch.nn.LayerNorm(dim, eps=1e-6),) * 2
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim, generator=generator) * 2)
        ref.weight.copy_(ours.weight)
        if kind == "layer":
            ours.bias.copy_(torch.randn(dim, generator=generator))
        ours, ref = ours.to(dtype), ref.to(dtype)
        expected_x = x + update
        kernels.add_norm_(x, update, ours, out)
        assert torch.equal(x, expected_x)
        assert_within_a_rounding(out, ref(expected_x))
        kernels.add_norm_(x, update)  # the add alone
        assert torch.equal(x, expected_x + update)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_rope_on_q_and_k_is_bitwise_transformers_and_v_is_copied(dtype, in_place):
    kernels, heads, head_dim = native(), 3, 80
    qkv = strided(ROWS, 3 * heads * head_dim, dtype, 4)
    cos, sin = rope_cos_sin(torch.randint(0, 90, (ROWS, 2), generator=torch.Generator().manual_seed(0)), head_dim)
    split = qkv.reshape(ROWS, 3, heads, head_dim)
    expected_q, expected_k = apply_rotary_pos_emb_vision(split[:, 0], split[:, 1], cos, sin)
    v = split[:, 2].clone()
    out = qkv if in_place else strided(ROWS, qkv.shape[1], dtype).fill_(float("nan"))  # rows of a wider buffer
    kernels.rope(qkv, out, cos, sin, 2 * heads, head_dim)
    rotated = out.reshape(ROWS, 3, heads, head_dim)
    assert torch.equal(rotated[:, 0], expected_q.to(dtype)) and torch.equal(rotated[:, 1], expected_k.to(dtype))
    assert torch.equal(rotated[:, 2], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_silu_gate_times_up_is_transformers_within_a_rounding(dtype, in_place):
    kernels, width = native(), 300
    gate_up = strided(ROWS, 2 * width, dtype, 4)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up
    out = gate if in_place else strided(ROWS, width, dtype)
    kernels.activation(gate_up, out, gated=True)
    assert_within_a_rounding(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_gelu_tanh_is_transformers_within_a_rounding_and_the_exact_value_where_torch_s_cancels(dtype, in_place):
    kernels, x = native(), strided(ROWS, 300, dtype, 4)
    expected, wide = ACT2FN["gelu_pytorch_tanh"](x), x.double()
    exact = wide * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (wide + 0.044715 * wide**3))  # (1 + tanh u) / 2
    tail = x < -2  # torch's 0.5 * x * (1 + tanh(u)) loses its digits as tanh(u) nears -1 (its value goes to -0)
    out = x if in_place else strided(ROWS, 300, dtype)
    kernels.activation(x, out, gated=False)
    assert_within_a_rounding(out[~tail], expected[~tail])
    # there: within u's own roundings amplified by exp (relative: up to about 4|u| fp32 ulps) and the dtype's, or
    # under 1e-37 where exp(-2u) overflows fp32 (x below -10); and nearer the exact value than torch's over the tail
    u = (math.sqrt(2 / math.pi) * (wide + 0.044715 * wide**3))[tail]
    error, rtol = (out[tail].double() - exact[tail]).abs(), {torch.float32: 0.0, torch.bfloat16: 2**-8}[dtype]
    assert (error <= ((4 + 4 * u.abs()) * 2**-23 + rtol) * exact[tail].abs() + 1e-37).all()
    assert error.sum() < (expected[tail].double() - exact[tail]).abs().sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_of_special_values_is_torch_s(dtype):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30]]).to(dtype)
    out = torch.empty_like(x)
    native().activation(x, out, gated=False)
    expected = ACT2FN["gelu_pytorch_tanh"](x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out.signbit(), expected.signbit())


@pytest.mark.parametrize("family", list(FAMILY_SMALL))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("linear", ["addmm", "onednn"])
def test_towers_on_the_native_kernels_match_transformers_per_item(family, dtype, linear, monkeypatch):
    """Packed linears' rows handed to rope and to the add + norm in chunks of a few dozen rows, MLPs by row
    blocks: every pack crosses many of them."""
    called = set()
    for name in ("add_norm_", "rope", "activation"):
        real = getattr(NativeKernels, name)
        monkeypatch.setattr(NativeKernels, name, lambda *a, real=real, name=name, **k: called.add((name, *k.values()))
                            or real(*a, **k))
    cfg = FAMILY_SMALL[family]
    ref = hf_tower(cfg, seed=0)
    ours = ours_from(ref, cfg).to(dtype)
    CpuBackend(forced_plan(ours, linear, mlp_rows=24, chunk_bytes=16 << 10, elementwise="native")).attach(ours)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        got = ours(pixel_values.to(dtype), grid_thw)
        expected = hf_forward(ref, pixel_values, grid_thw)
    assert_matches_reference(got, expected, grid_thw, 1e-5 if dtype == torch.float32 else 3e-2)
    # norms and residual adds, and rope in every family; the SiLU gate in Qwen2.5's, GELU-tanh in Qwen3's
    activation = {"silu": {("activation", True)}, "gelu_pytorch_tanh": {("activation", False)}}.get(cfg.hidden_act)
    assert called == {("add_norm_",), ("rope",)} | (activation or set())


def test_where_they_cannot_be_built_one_warning_names_the_compiler_s_error_and_a_native_plan_is_refused(
        monkeypatch, tmp_path):
    compiler = tmp_path / "cc"  # a compiler that runs and fails, as one that cannot link libmvec
    compiler.write_text("#!/bin/sh\ncase \" $* \" in *\" --version \"*) echo 'fake 1.0'; exit 0;; esac\n"
                        "echo 'native.c: note: in a header' >&2; echo 'ld: error: cannot find -lmvec' >&2; exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", f"{compiler} -O0")  # a command line, as $CC may be
    monkeypatch.setenv("QWENVL_VISION_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "NATIVE", {})
    with pytest.warns(RuntimeWarning, match="cannot find -lmvec"):
        assert machine.native_kernels() is None
    assert not list((tmp_path / "cpu-native").iterdir())  # no partial library left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert machine.native_kernels() is None
    cfg = FAMILY_SMALL["qwen2_5_vl"]
    ours = ours_from(hf_tower(cfg, seed=0), cfg)
    plan = forced_plan(ours, "addmm")
    with pytest.raises(ConfigError, match="native"):  # refused when set, before any call
        CpuBackend(dataclasses.replace(plan, elementwise=dict.fromkeys(plan.elementwise, "native"))).attach(ours)
