"""Attention over a packed plan of segments (qwenvl_vision.attention): the CPU's two-GEMM path for frame-sized
segments against float64, inside a plan that mixes it with SDPA, and in towers against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenvl_vision import attention
from qwenvl_vision.attention import GEMM_ATTENTION_LENGTHS, SegmentPlan, gemm_attention_runs, sdpa_attention
from qwenvl_vision.cpu_linear import onednn_linear_available
from tests.helpers import QWEN2_5_SMALL, QWEN3_SMALL_72, assert_matches_reference, forward_both, pair

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear ops")
HEADS, HEAD_DIM = 4, 72


def segment_reference(q, k, v, lengths, scale):
    """Each segment attended alone by float64 SDPA."""
    pieces, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        split = [x[rows].double().transpose(0, 1)[None] for x in (q, k, v)]
        pieces.append(F.scaled_dot_product_attention(*split, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(pieces)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frame_segments_take_the_gemm_path_and_are_as_exact_as_sdpa(dtype, monkeypatch):
    """A plan of windows (SDPA), two 600-token frames (two GEMMs per head) and one frame longer than the GEMM
    range (SDPA), on strided q/k/v views of one fused qkv, into a strided output: each segment within fp32
    accuracy of float64, and in bf16 no further from it than SDPA itself on the same frames."""
    lengths = [64] * 3 + [600, 600, GEMM_ATTENTION_LENGTHS[1] + 4]
    n, scale = sum(lengths), HEAD_DIM**-0.5
    qkv = torch.randn(n, 3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, v = qkv.unbind(1)
    assert [gemm_attention_runs(q, length) for length in (64, 600, lengths[-1])] == [False, True, False]
    out = torch.full((n, 2, HEADS, HEAD_DIM), float("nan"), dtype=dtype)[:, 0]
    counts = []  # the GEMM path runs once, for the run of two 600-token frames
    monkeypatch.setattr(attention, "gemm_batched",
                        lambda q, k, v, count, *rest, run=attention.gemm_batched: counts.append(count) or run(
                            q, k, v, count, *rest))
    attended = sdpa_attention(q, k, v, SegmentPlan.from_lengths(lengths), scale, out=out)
    assert counts == [2]
    assert attended.data_ptr() == out.data_ptr()
    expected = segment_reference(q, k, v, lengths, scale)
    frames = slice(3 * 64, 3 * 64 + 1200)
    if dtype == torch.float32:
        assert rel(attended, expected) < 1e-6
    else:
        sdpa = F.scaled_dot_product_attention(*[x[frames].unflatten(0, (2, 600)).transpose(1, 2) for x in (q, k, v)],
                                              scale=scale).transpose(1, 2).flatten(0, 1)
        assert rel(attended[frames], expected[frames]) < rel(sdpa, expected[frames])
        assert rel(attended, expected) < 4e-3


@needs_onednn
def test_many_scattered_frames_are_gathered_onto_the_gemm_path():
    """Six 520-token images between 8-token ones: one gathered group of the six (``out[index] = ...``)."""
    lengths = [520, 8] * 6
    n, scale = sum(lengths), HEAD_DIM**-0.5
    q, k, v = (torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(i)) for i in range(3))
    plan = SegmentPlan.from_lengths(lengths)
    assert any(group.index is not None and group.length == 520 for group in plan.groups)
    assert rel(sdpa_attention(q, k, v, plan, scale), segment_reference(q, k, v, lengths, scale)) < 1e-6


def test_half_precision_stays_on_sdpa():
    assert not gemm_attention_runs(torch.zeros(600, HEADS, HEAD_DIM, dtype=torch.float16), 600)


@needs_onednn
def test_under_autograd_frames_run_sdpa_and_gradients_flow():
    q, k, v = (torch.randn(600, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))
    assert not gemm_attention_runs(q, 600)
    sdpa_attention(q, k, v, SegmentPlan.from_lengths([600]), HEAD_DIM**-0.5).square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@needs_onednn
@pytest.mark.parametrize("cfg", [QWEN2_5_SMALL, QWEN3_SMALL_72], ids=["qwen2.5", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_towers_with_frames_on_the_gemm_path_match_transformers(cfg, dtype):
    """A 576-token image and a 2-frame video of 512-token frames (Qwen2.5's full-attention blocks, every Qwen3
    block attend them by two GEMMs per head) and a small image, against transformers' fp32 tower per item."""
    ours, ref = pair(cfg)
    grids = [(1, 24, 24), (2, 16, 32), (1, 4, 6)]
    (merged, levels), expected, grid_thw = forward_both(ours.to(dtype), ref, cfg, grids)
    assert_matches_reference((merged, levels), expected, grid_thw, 1e-5 if dtype == torch.float32 else 3e-2)
