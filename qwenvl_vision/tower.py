"""What both towers share outside the math: input validation and the per-instance shape cache."""

from __future__ import annotations

import torch
from torch import nn

from .cache import ShapeCache
from .config import QWEN2_5, VisionConfig
from .layers import Scratch, varlen_attention

Grid = tuple[int, int, int]


class InputError(ValueError):
    """pixel_values / grid_thw that do not describe a valid packed batch."""


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
        """``torch.compile`` every block, with a dynamic token count: one graph serves every pack size.

        Attention runs outside the graphs (``torch.compiler.disable``): its segment plan is computed per
        forward on the host and only passed through, so a new mix of image sizes does not recompile.
        Compiled blocks take fresh buffers (inductor plans its own memory). options go to torch.compile
        (e.g. mode="max-autotune-no-cudagraphs"). Compiling the first forward of a new shape class takes
        seconds to minutes; dynamo's code cache is process-wide, so ``close()`` is what frees the weights.
        """
        for block in self.blocks:
            block.attn.attend = torch.compiler.disable(varlen_attention)
            block.compile(dynamic=True, **options)
        self.compiled = True

    def scratch(self, x: torch.Tensor) -> Scratch:
        """This forward's activation buffers for hidden states like x (N, D); see ``layers.Scratch``."""
        if self.compiled:
            return Scratch.fresh()
        cfg = self.config
        mlp_width = 2 * cfg.intermediate_size if cfg.family == QWEN2_5 else cfg.intermediate_size
        return Scratch(x.shape[0], cfg.hidden_size, max(3 * cfg.hidden_size, mlp_width), x.dtype, x.device)

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
