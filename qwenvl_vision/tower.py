"""What both towers share outside the math: input validation and the per-instance shape cache."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .cache import ShapeCache
from .config import QWEN2_5, VisionConfig
from .errors import InputError
from .layers import Scratch, attention_outside_graph

Grid = tuple[int, int, int]




class VisionTower(nn.Module):
    """Base for the two families: owns ``config`` and a bounded per-instance ``shape_cache``."""

    def __init__(self, config: VisionConfig, cache_size: int = 1024, cache_bytes: int | None = 1 << 30) -> None:
        super().__init__()
        self.config = config
        # A plain attribute, not a module/buffer: it is not saved, moved by .to() or shared between instances.
        self.shape_cache = ShapeCache(cache_size, cache_bytes)
        self.compiled = False

    def grid_list(self, grid_thw: torch.Tensor | list) -> list[Grid]:
        """The grids as Python ints (one host read per forward), validated against the merge size."""
        if isinstance(grid_thw, torch.Tensor):
            if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
                raise InputError(f"grid_thw must have shape (n, 3), got {tuple(grid_thw.shape)}")
            if grid_thw.is_floating_point():
                raise InputError(f"grid_thw must be an integer tensor, got {grid_thw.dtype}")
            rows = grid_thw.tolist()
        else:
            rows = [list(g) for g in grid_thw]
        grids: list[Grid] = []
        merge = self.config.spatial_merge_size
        for i, row in enumerate(rows):
            if len(row) != 3:
                raise InputError(f"grid_thw[{i}] must be (t, h, w), got {row}")
            t, h, w = (int(v) for v in row)
            if t < 1 or h < 1 or w < 1:
                raise InputError(f"grid_thw[{i}] = {(t, h, w)} has a non-positive entry")
            if h % merge or w % merge:
                raise InputError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge size {merge}")
            grids.append((t, h, w))
        if not grids:
            raise InputError("grid_thw is empty: nothing to encode")
        return grids

    def check_pixels(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        expected_rows = sum(t * h * w for t, h, w in grids)
        width = self.config.patch_dim
        if pixel_values.ndim != 2 or pixel_values.shape != (expected_rows, width):
            raise InputError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({expected_rows}, {width}): "
                f"rows = sum(t*h*w) over grid_thw {grids}, width = C*T*P*P = "
                f"{self.config.in_channels}*{self.config.temporal_patch_size}*{self.config.patch_size}^2"
            )

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` every block with dynamic shapes: one graph pair serves every block, pack size and
        image mix.

        Attention runs outside the graphs (``torch.compiler.disable``): its segment plan is computed per
        forward on the host and only passed through. Compiled blocks run out of place (inductor plans its
        own memory). options go to torch.compile, e.g. mode="max-autotune-no-cudagraphs". The first forward
        pays the compile (seconds to minutes); dynamo's code cache is process-wide, and ``close()`` still
        frees the weights.
        """
        if options.get("fullgraph"):
            raise ValueError("compile_blocks: fullgraph=True is impossible: attention is kept out of the graph "
                             "on purpose (its per-forward segment plan would recompile every new image mix)")
        if options.get("mode") in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"compile_blocks: mode={options['mode']!r} records CUDA graphs, which need fixed "
                             "shapes; the token count varies per pack. Use 'max-autotune-no-cudagraphs' or 'default'")
        for block in self.blocks:
            block.attn.attend = torch.compiler.disable(attention_outside_graph)
            block.compile(**{"dynamic": True, **options})
        self.compiled = True

    def block_context(self):
        """Around the block loop. Compiled blocks: no duck sizing, so that a first pack whose token count
        equals a static size (e.g. N == hidden size) does not produce a graph specialised to N == D."""
        if not self.compiled:
            return contextlib.nullcontext()
        from torch.fx.experimental import _config as shape_config

        return shape_config.patch(use_duck_shape=False)

    def scratch(self, x: torch.Tensor) -> Scratch:
        """This forward's activation buffers for hidden states like x (N, D); see ``layers.Scratch``.

        ``Scratch.functional()`` (no buffers: out of place) for compiled blocks, inside a compiled graph, and
        when autograd is recording (out= ops and in-place updates of saved tensors cannot be differentiated)."""
        if self.compiled or torch.compiler.is_compiling() or self._recording_grad(x):
            return Scratch.functional()
        cfg = self.config
        mlp_width = 2 * cfg.intermediate_size if cfg.family == QWEN2_5 else cfg.intermediate_size
        return Scratch(x.shape[0], cfg.hidden_size, max(3 * cfg.hidden_size, mlp_width), x.dtype, x.device)

    def _recording_grad(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))

    def cache_stats(self) -> dict[str, int]:
        return self.shape_cache.stats()

    def clear_cache(self) -> None:
        self.shape_cache.clear()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
