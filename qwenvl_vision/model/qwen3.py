"""The learned-position-grid tower design: Qwen3-VL, Qwen3-VL-MoE, Qwen3-Omni (with DeepStack), Qwen3.5,
Qwen3.5-MoE and Qwen4-Exp (without).

Reference: transformers ``Qwen3VLVisionModel``, ``Qwen3OmniMoeVisionEncoder``, ``Qwen3_5VisionModel`` and
``vision_utils.get_vision_interpolation_indices_and_weights`` (v5.24).

Forward: patch embed (with bias) + the learned ``pos_embed`` grid (48x48 in every release) resampled bilinearly
(align_corners=True) to each image's (h, w), in merge-block order and repeated over t. Blocks are LayerNorm ->
full attention per frame; LayerNorm -> linear_fc2(gelu_tanh(linear_fc1)). After each block in
``deepstack_visual_indexes`` a DeepStack merger (LayerNorm over 4D after the 2x2 view) emits one more level;
the final merger normalises over D before the view.

Deviation from the reference (same numbers): the resampled position embedding is a 4-tap weighted sum
accumulated tap by tap in fp32 instead of materialising an (N, 4, D) gather.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VisionConfig
from .execution import Grid
from .layers import merge_block_positions
from .tower import ForwardPlan, GridPlan, VisionTower


def bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `size` target positions: 2 source taps into a `side` table and their weights.

    align_corners=True: position i maps to i * (side - 1) / (size - 1) (linspace(0, side-1, size)).
    """
    index = torch.arange(size, dtype=torch.float32)
    src = index * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_grid_taps(h: int, w: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h*w, 4) indices into the flattened side x side table and weights, patches in merge-block order."""
    h_taps, h_weights = bilinear_taps(h, side)
    w_taps, w_weights = bilinear_taps(w, side)
    rows, cols = merge_block_positions(h, w, merge).unbind(-1)
    indices = (h_taps[rows][:, :, None] * side + w_taps[cols][:, None, :]).reshape(-1, 4)
    weights = (h_weights[rows][:, :, None] * w_weights[cols][:, None, :]).reshape(-1, 4)
    return indices, weights


class Qwen3VisionTransformer(VisionTower):
    """Qwen3-VL-design towers: learned positions added after the patch embedding, every block over whole frames."""

    def __init__(self, config: VisionConfig, **options) -> None:
        super().__init__(config, **options)
        # _weight skips Embedding's normal_ init, which on the meta device costs seconds of imports.
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size,
                                      _weight=torch.empty(config.num_position_embeddings, config.hidden_size))
        if not self.pos_embed.weight.is_meta:
            nn.init.normal_(self.pos_embed.weight)  # nn.Embedding's own default

    def compute_grid_plan(self, grid: Grid) -> GridPlan:
        t, h, w = grid
        cfg = self.config
        positions = merge_block_positions(h, w, cfg.spatial_merge_size).repeat(t, 1)
        indices, weights = position_grid_taps(h, w, cfg.num_grid_per_side, cfg.spatial_merge_size)
        return GridPlan(positions, frame_lengths=[h * w] * t,
                        position_taps=(indices.repeat(t, 1), weights.repeat(t, 1)))

    def embed(self, pixel_values: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        x = super().embed(pixel_values, plan)
        return x + self.position_embedding(*plan.position_taps).to(x.dtype)

    def position_embedding(self, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Bilinearly resampled learned positions, (N, D) in fp32: sum over 4 taps of weight * table row."""
        table = self.pos_embed.weight
        out = table[indices[:, 0]].float() * weights[:, 0:1]
        for tap in range(1, 4):
            out += table[indices[:, tap]].float() * weights[:, tap : tap + 1]
        return out
