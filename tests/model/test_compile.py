"""The optional torch.compile path (``compile_blocks`` / ``load_encoder(compile=True)``).

Compiled blocks must keep the parity tolerance against transformers, take new pack sizes and image
mixes without recompiling (dynamic token count; attention and its plan stay outside the graphs), and
``close()`` must still give the weights back although dynamo's code cache is process-wide.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

from qwenvl_vision import load_encoder
from tests.helpers import (
    QWEN2_5_GRIDS,
    QWEN2_5_SMALL,
    QWEN3_GRIDS,
    QWEN3_SMALL_72,
    assert_matches_reference,
    census,
    hf_forward,
    inputs,
    pair,
)

pytestmark = [pytest.mark.slow,  # every test here compiles with inductor (tens of seconds each)
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="inductor on CPU needs a C++ compiler")]


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("cfg,grids", [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
def test_compiled_blocks_match_transformers_and_do_not_recompile_for_new_packs(cfg, grids):
    ours, ref = pair(cfg)
    ours.compile_blocks()
    # First a pack whose token count equals the hidden size (duck sizing would tie N to D and recompile),
    # then new token counts and new mixes of frame sizes.
    side = cfg.hidden_size // 8
    packs = [[(1, 8, side)], grids, grids[::-1][1:], grids[1:3]]
    graphs = []
    with torch.no_grad():
        for pack in packs:
            pixel_values, grid_thw = inputs(cfg, pack)
            assert_matches_reference(ours(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                     grid_thw, 1e-5)
            graphs.append(_graphs_compiled())
    assert graphs[0] > 0
    assert len(set(graphs)) == 1, f"recompiled for a new pack: graphs after each pack {graphs}"


def test_dynamo_s_debugging_backends_run_the_blocks_too():
    """backend="eager" (dynamo's tracing alone, for finding graph breaks) on a pack whose token count equals the
    hidden size, then another: the rope tables share the token count with x, which a hard dynamic mark refused."""
    ours, ref = pair(QWEN2_5_SMALL)
    ours.compile_blocks(backend="eager")
    with torch.no_grad():
        for pack in ([(1, 8, QWEN2_5_SMALL.hidden_size // 8)], QWEN2_5_GRIDS):
            pixel_values, grid_thw = inputs(QWEN2_5_SMALL, pack)
            assert_matches_reference(ours(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                     grid_thw, 1e-5)


def test_compiling_the_whole_tower_works_too():
    """torch.compile(tower) (not compile_blocks): the blocks trace the out-of-place path, and a 576-token frame
    SDPA (the CPU's per-head GEMM attention stays out of a compiled graph)."""
    ours, ref = pair(QWEN2_5_SMALL)
    compiled = torch.compile(ours)
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, [*QWEN2_5_GRIDS, (1, 24, 24)])
    with torch.no_grad():
        assert_matches_reference(compiled(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                 grid_thw, 1e-5)


@pytest.mark.parametrize("options", [{"fullgraph": True}, {"mode": "reduce-overhead"}])
def test_compile_options_that_cannot_work_are_refused(options):
    ours, _ = pair(QWEN2_5_SMALL)
    with pytest.raises(ValueError, match="compile_blocks"):
        ours.compile_blocks(**options)
    assert not ours.compiled


@pytest.mark.parametrize("end", ["close", "del"])
def test_close_or_del_frees_the_weights_of_a_compiled_encoder_at_once(end):
    """With no garbage collection: no block holds a compiled call bound to itself (a cycle)."""
    gc.collect()
    before = census()
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, compile=True)
    weights = sum(p.nbytes for p in encoder.model.parameters())
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, QWEN2_5_GRIDS[:2])
    encoder.encode_patches(pixel_values, grid_thw)
    del pixel_values, grid_thw
    assert census() - before >= weights
    gc.disable()
    try:
        if end == "close":
            encoder.close()
        else:
            del encoder
        assert census() - before < weights // 10
    finally:
        gc.enable()
