"""Attention over a packed plan of segments (qwenvl_vision.model.attention): views, gathered groups and single calls,
each segment against float64 SDPA of that segment alone, and gradients."""

from __future__ import annotations

import pytest
import torch

from qwenvl_vision.model.attention import (
    GATHER_MIN_RUNS,
    VIEW_MIN_TOKENS,
    SegmentPlan,
    resolve_attn_impl,
    sdpa_attention,
    torch_varlen_missing,
)
from tests.helpers import rel_err, segment_reference

HEADS, HEAD_DIM = 4, 72


def test_scattered_segments_are_gathered_and_every_segment_attends_alone():
    """Six 520-token images between 8-token ones: one gathered group of each length (``out[index] = ...``)."""
    lengths = [520, 8] * 6
    n, scale = sum(lengths), HEAD_DIM**-0.5
    q, k, v = (torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(i)) for i in range(3))
    plan = SegmentPlan.from_lengths(lengths)
    assert {group.length for group in plan.groups if group.index is not None} == {520, 8}
    assert rel_err(sdpa_attention(q, k, v, plan, scale), segment_reference(q, k, v, lengths, scale)) < 1e-6


def test_runs_of_equal_segments_are_views_into_a_strided_output():
    lengths = [64] * 40 + [600, 600]
    n, scale = sum(lengths), HEAD_DIM**-0.5
    qkv = torch.randn(n, 3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    q, k, v = qkv.unbind(1)
    plan = SegmentPlan.from_lengths(lengths)
    assert all(group.index is None for group in plan.groups) and len(plan.groups) == 2
    out = torch.full((n, 2, HEADS, HEAD_DIM), float("nan"))[:, 0]
    attended = sdpa_attention(q, k, v, plan, scale, out=out)
    assert attended.data_ptr() == out.data_ptr()
    assert rel_err(attended, segment_reference(q, k, v, lengths, scale)) < 1e-6


def test_gradients_flow_through_segments():
    q, k, v = (torch.randn(600, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))
    sdpa_attention(q, k, v, SegmentPlan.from_lengths([300, 300]), HEAD_DIM**-0.5).square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("grouped", [True, False], ids=["sdpa", "fused"])
def test_a_plan_s_boundaries_and_longest_segment(grouped):
    """cu_seqlens and max_seqlen are what CUDA's varlen kernels read (an empty segment included)."""
    plan = SegmentPlan.from_lengths([3, 7, 0, 5], grouped=grouped)
    assert plan.cu_seqlens.tolist() == [0, 3, 10, 15]
    assert plan.max_seqlen == 7 and plan.total == 15


def test_a_large_run_runs_in_place_and_only_more_small_runs_than_the_threshold_are_gathered():
    half = VIEW_MIN_TOKENS // 2
    plan = SegmentPlan.from_lengths([half, half, 8] * (GATHER_MIN_RUNS + 1))
    assert all(g.index is None and g.count == 2 for g in plan.groups if g.length == half)
    assert [g.count for g in plan.groups if g.length == 8 and g.index is not None] == [GATHER_MIN_RUNS + 1]
    plan = SegmentPlan.from_lengths([520, 8] * GATHER_MIN_RUNS)
    assert all(g.index is None for g in plan.groups) and len(plan.groups) == 2 * GATHER_MIN_RUNS


def test_auto_runs_a_fused_varlen_kernel_where_one_can_run_else_sdpa():
    if torch_varlen_missing() is not None:
        pytest.skip(torch_varlen_missing())
    assert resolve_attn_impl("auto", "meta", torch.bfloat16) == "torch_varlen"
    assert resolve_attn_impl("auto", "meta", torch.float32) == "sdpa"
    assert resolve_attn_impl("auto", "cpu", torch.bfloat16) == "sdpa"
