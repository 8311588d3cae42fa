"""CUDA paths: bf16 with the fused varlen kernel, parity with the CPU fp32 reference, memory teardown.

Skipped where no GPU is present; run on a lent device with `python -m pytest -q -m cuda tests/backends/test_cuda.py`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from qwenvl_vision import load_encoder
from qwenvl_vision.devices import upload
from qwenvl_vision.model.attention import (
    BACKENDS,
    SegmentPlan,
    resolve_attn_impl,
    sdpa_batched,
    unavailable_reason,
)
from qwenvl_vision.teardown.census import measure
from tests.helpers import (
    QWEN2_5_GRIDS,
    QWEN2_5_SMALL,
    QWEN3_GRIDS,
    QWEN3_SMALL_72,
    assert_matches_reference,
    hf_forward,
    inputs,
    pair,
    rel_err,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cfg,grids", [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cuda_against_cpu_fp32_reference(cfg, grids, dtype, tol):
    ours, ref = pair(cfg)
    pixel_values, grid_thw = inputs(cfg, grids)
    with torch.no_grad():
        expected = hf_forward(ref, pixel_values, grid_thw)
        model = ours.to("cuda", dtype)
        merged, levels = model(pixel_values.cuda(), grid_thw)
    assert merged.is_cuda and merged.dtype == dtype
    if dtype != torch.float32:  # moved and cast: the tower now runs the fused kernel where one can run
        assert model.attention == resolve_attn_impl("auto", "cuda", dtype)
    assert_matches_reference((merged, levels), expected, grid_thw, tol)


def test_fused_varlen_kernel_equals_grouped_sdpa():
    fused_name = resolve_attn_impl("auto", "cuda", torch.bfloat16)
    if fused_name == "sdpa":  # e.g. no flash-attn, and a torch whose varlen_attn takes no scale
        pytest.skip(f"no fused varlen kernel here: flash: {unavailable_reason('flash', 'cuda', torch.bfloat16)}; "
                    f"torch_varlen: {unavailable_reason('torch_varlen', 'cuda', torch.bfloat16)}")
    lengths = [64, 48, 64, 16, 12, 1024, 64]
    plan = SegmentPlan.from_lengths(lengths, "cuda", grouped=False)  # what the tower builds for a fused backend
    n = sum(lengths)
    # As the blocks hand them over: slices of one fused qkv output, rows strided, the head dimension contiguous.
    q, k, v = torch.randn(n, 3, 16, 80, device="cuda", dtype=torch.bfloat16).unbind(1)
    assert not v.is_contiguous()
    fused = BACKENDS[fused_name](q, k, v, plan, 80**-0.5)
    start, pieces = 0, []
    for length in lengths:
        sl = slice(start, start + length)
        pieces.append(sdpa_batched(q[sl].float(), k[sl].float(), v[sl].float(), 1, 80**-0.5))
        start += length
    assert rel_err(fused.float(), torch.cat(pieces)) <= 1e-2


def test_upload_stages_host_tensors_in_one_pinned_buffer(monkeypatch):
    """The batch's pixels and the plan reach the GPU from pinned memory, so the non-blocking copy is asynchronous."""
    staged = []
    cat = torch.cat

    def recording_cat(tensors, *args, out=None, **kwargs):
        staged.append(out)
        return cat(tensors, *args, out=out, **kwargs)

    monkeypatch.setattr(torch, "cat", recording_cat)
    parts = [torch.randn(5, 7), torch.randn(3, 7)]
    moved = upload(parts, "cuda")
    monkeypatch.undo()
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), torch.cat(parts))
    assert len(staged) == 1 and staged[0] is not None and staged[0].is_pinned()


def allocated() -> int:
    """memory_allocated after a synchronize, without the process-wide cuBLAS workspaces (created by the process's
    first matmul, owned by no encoder): the teardown benchmark's own reading, so the test holds when run alone."""
    return measure(torch.device("cuda"))["cuda_allocated"]


@pytest.mark.slow  # a released-size tower
def test_cuda_encoder_teardown_leaves_zero_bytes():
    gc.collect()
    baseline = allocated()
    encoder = load_encoder("qwen2.5-vl-3b", random_weights=True, device="cuda", dtype="bf16")
    pixel_values, grid_thw = inputs(encoder.config, [(1, 16, 16), (2, 8, 12), (1, 6, 10)])
    encoder.encode_patches(pixel_values, grid_thw)
    assert allocated() > baseline
    del encoder
    assert allocated() == baseline


@pytest.mark.parametrize("cfg,grids", [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
@pytest.mark.slow  # compiles with inductor
def test_cuda_compiled_bf16_close_to_cpu_fp32_reference(cfg, grids):
    ours, ref = pair(cfg)
    model = ours.to("cuda", torch.bfloat16)
    model.compile_blocks()
    with torch.no_grad():
        for pack in (grids, grids[::-1][1:]):  # a second pack size runs the same graphs
            pixel_values, grid_thw = inputs(cfg, pack)
            assert_matches_reference(model(pixel_values.cuda(), grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                     grid_thw, 3e-2)
