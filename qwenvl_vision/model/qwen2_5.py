"""The patch-14 tower design: Qwen2-VL (every block attends over whole frames), Qwen2.5-VL and Qwen2.5-Omni
(window attention outside ``fullatt_block_indexes``).

Reference: transformers ``Qwen2VisionTransformerPretrainedModel``, ``Qwen2_5_VisionTransformerPretrainedModel``,
``Qwen2_5OmniVisionEncoder`` and ``vision_utils.get_vision_window_index`` (v5.24).

Per block: x += attn(norm1(x)); x += mlp(norm2(x)), with the family's norm and MLP (config.FAMILIES). Windowed
families cut each frame into 8x8-patch windows (4x4 merged tokens); tokens are put in window order once, before
the first block, and restored after the merger.

Deviations from the reference (same numbers):
- the window permutation is applied to pixel_values rows before the patch embedding rather than to its output
  (the embedding is per row, so the result is identical and the gather is narrower);
- inside each frame, windows are ordered longest first (stable) instead of raster order, so that all full
  windows of a frame form one contiguous run that attention processes in place; a window's own tokens keep
  their order, so every output is unchanged (``frame_window_order`` is the reference's order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .execution import Grid
from .layers import merge_block_positions
from .tower import GridPlan, VisionTower


def frame_window_order(merged_h: int, merged_w: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged-token indices of one frame in window order, and each window's length in merged tokens.

    The merged grid is padded bottom/right by ``window - n % window`` (a whole empty window when n
    divides, which has length 0 and is dropped), cut into windows in raster order, row-major inside.
    """
    index = torch.arange(merged_h * merged_w).view(merged_h, merged_w)
    pad_h, pad_w = window - merged_h % window, window - merged_w % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    windows = rearrange(padded, "(nh wh) (nw ww) -> (nh nw) (wh ww)", wh=window, ww=window)
    valid = windows >= 0
    lengths = [n for n in valid.sum(1).tolist() if n > 0]
    return windows[valid], lengths


def length_sorted(order: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The same windows, longest first (stable): equal windows become one contiguous run per frame (see the module:
    attention inside a window does not depend on where it sits, and the merger's groups of four are untouched)."""
    windows = list(order.split(lengths))
    ranked = sorted(range(len(windows)), key=lambda i: -lengths[i])
    return torch.cat([windows[i] for i in ranked]), [lengths[i] for i in ranked]


class Qwen2_5VisionTransformer(VisionTower):
    """Qwen2-VL, Qwen2.5-VL and Qwen2.5-Omni towers: no learned positions; windows where the family has them."""

    def compute_grid_plan(self, grid: Grid) -> GridPlan:
        t, h, w = grid
        cfg = self.config
        merge = cfg.spatial_merge_size
        positions = merge_block_positions(h, w, merge).repeat(t, 1)
        if not cfg.family.windows:
            return GridPlan(positions, frame_lengths=[h * w] * t)
        merged_h, merged_w = h // merge, w // merge
        frame_order, frame_windows = length_sorted(*frame_window_order(merged_h, merged_w, cfg.window_merged))
        order = torch.cat([frame_order + f * merged_h * merged_w for f in range(t)])
        positions = positions.view(-1, cfg.merge_unit, 2)[order].view(-1, 2)
        window_lengths = [n * cfg.merge_unit for n in frame_windows] * t
        return GridPlan(positions, frame_lengths=[h * w] * t, window_lengths=window_lengths, order=order)
