"""``compile_blocks`` on a tower deeper than dynamo's recompile limit (the real towers have 24-32 blocks, the limit
is 8): every block's calls run compiled graphs, none falls back to eager, and the number of graphs does not grow
with depth. dynamo's own ``aot_eager`` path under a counting backend: no C++ compiler needed, and what is counted is
what dynamo hands a backend, which inductor would compile the same way."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.backends.debugging import aot_eager

from tests.helpers import QWEN2_5_GRIDS, QWEN2_5_SMALL, assert_matches_reference, hf_forward, inputs, pair


def graphs_and_runs(depth: int) -> tuple[int, int]:
    """(graphs compiled, graph runs) for two packs through a Qwen2.5 tower of ``depth`` blocks, every fourth one
    full attention, the rest windowed; each pack within 1e-5 of transformers."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(QWEN2_5_SMALL, depth=depth,
                              fullatt_block_indexes=tuple(i for i in range(depth) if i % 4 == 3))
    ours, ref = pair(cfg)
    graphs, runs = [], [0]

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        compiled = aot_eager(graph, example_inputs)

        def run(*args):
            runs[0] += 1
            return compiled(*args)

        return run

    ours.compile_blocks(backend=counting)
    with torch.no_grad():
        for grids in (QWEN2_5_GRIDS, QWEN2_5_GRIDS[1:]):
            pixel_values, grid_thw = inputs(cfg, grids)
            assert_matches_reference(ours(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                     grid_thw, 1e-5)
    return len(graphs), runs[0]


def test_blocks_past_the_recompile_limit_run_compiled_and_share_the_graphs():
    deep = torch._dynamo.config.recompile_limit + 4
    shallow_graphs, shallow_runs = graphs_and_runs(4)
    deep_graphs, deep_runs = graphs_and_runs(deep)
    assert deep_graphs == shallow_graphs > 0, (shallow_graphs, deep_graphs)
    assert deep_runs * 4 == shallow_runs * deep, f"graph runs per block: {shallow_runs / 4} at 4, {deep_runs / deep}"
