"""Qwen3-VL vision tower (learned position grid, 2D rope, DeepStack).

Reference: transformers ``Qwen3VLVisionModel`` and ``vision_utils.get_vision_interpolation_indices_and_weights``.
Module names equal the checkpoint's ``model.visual.*`` tensors without the prefix, so loading is strict.

Forward: patch embed (with bias) + the 48x48 learned ``pos_embed`` grid resampled bilinearly
(align_corners=True) to each image's (h, w), in merge-block order and repeated over t. Blocks are
LayerNorm -> full attention per frame; LayerNorm -> linear_fc2(gelu_tanh(linear_fc1)). After each block
in ``deepstack_visual_indexes`` a DeepStack merger (LayerNorm over 4D after the 2x2 view) emits one more
level; the final merger normalises over D before the view.

Deviations from the reference (same numbers): the resampled position embedding is a 4-tap weighted sum
accumulated tap by tap in fp32 instead of materialising an (N, 4, D) gather; interpolation taps and
weights, rope cos/sin and frame lengths are cached per grid in this instance's ``shape_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import VisionConfig
from .layers import (
    PatchEmbed,
    Scratch,
    SegmentPlan,
    VisionAttention,
    check_activation,
    linear_into,
    merge_block_positions,
    rope_cos_sin,
)
from .tower import Grid, VisionTower


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        check_activation(act)
        self.act = act

    def forward(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """x (N, D) -> fc2(act(fc1(x))) in scratch.narrow."""
        hidden = linear_into(x, self.linear_fc1, scratch.wide(x, self.linear_fc1.out_features))
        return linear_into(scratch.activation(hidden, self.act), self.linear_fc2, scratch.narrow)


class Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan,
                scratch: Scratch) -> torch.Tensor:
        """x += attn(norm1(x)); x += mlp(norm2(x)); in place on x (owned by the forward) when buffers are reused."""
        attended = self.attn(self.norm1(x), cos, sin, plan, scratch)
        x = scratch.add(x, attended)  # attention first: the compile graph break sits inside it
        return scratch.add(x, self.mlp(self.norm2(x), scratch))


class PatchMerger(nn.Module):
    """LayerNorm (over D before the 2x2 view, or over 4D after it for DeepStack) -> fc1 -> GELU -> fc2."""

    def __init__(self, config: VisionConfig, norm_after_view: bool) -> None:
        super().__init__()
        self.hidden = config.hidden_size * config.merge_unit
        self.norm_after_view = norm_after_view
        self.norm = nn.LayerNorm(self.hidden if norm_after_view else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, config.out_hidden_size)

    def forward(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """x (N, D) -> (N/4, out); fc1's (N/4, 4D) output goes into scratch.wide (N x D of it)."""
        if self.norm_after_view:
            x = self.norm(x.view(-1, self.hidden))
        else:
            x = self.norm(x).view(-1, self.hidden)
        hidden = linear_into(x, self.linear_fc1, scratch.wide_rows(x.shape[0], self.hidden))
        return self.linear_fc2(scratch.activation(hidden, "gelu"))


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


@dataclass
class GridPlan:
    """Everything derived from one grid (t, h, w); cached per instance."""

    position_ids: torch.Tensor  # (t*h*w, 2) (row, col) in merge-block order
    interp_indices: torch.Tensor  # (t*h*w, 4)
    interp_weights: torch.Tensor  # (t*h*w, 4) fp32
    cos: torch.Tensor  # (t*h*w, hd) fp32
    sin: torch.Tensor
    frame_lengths: list[int]


@dataclass
class ForwardPlan:
    interp_indices: torch.Tensor
    interp_weights: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    frames: SegmentPlan


class Qwen3VisionTransformer(VisionTower):
    def __init__(self, config: VisionConfig, cache_size: int = 1024, cache_bytes: int | None = 1 << 30) -> None:
        super().__init__(config, cache_size, cache_bytes)
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size, bias=True)
        # _weight skips Embedding's normal_ init, which on the meta device costs seconds of imports.
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size,
                                      _weight=torch.empty(config.num_position_embeddings, config.hidden_size))
        if not self.pos_embed.weight.is_meta:
            nn.init.normal_(self.pos_embed.weight)  # nn.Embedding's own default
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, norm_after_view=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, norm_after_view=True) for _ in config.deepstack_visual_indexes]
        )
        self.deepstack_level = {block: level for level, block in enumerate(config.deepstack_visual_indexes)}

    def grid_plan(self, grid: Grid) -> GridPlan:
        return self.shape_cache.get_or_compute(grid, lambda: self._compute_grid_plan(grid))

    def _compute_grid_plan(self, grid: Grid) -> GridPlan:
        t, h, w = grid
        cfg = self.config
        positions = merge_block_positions(h, w, cfg.spatial_merge_size)
        indices, weights = position_grid_taps(h, w, cfg.num_grid_per_side, cfg.spatial_merge_size)
        positions = positions.repeat(t, 1)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        return GridPlan(
            position_ids=positions,
            interp_indices=indices.repeat(t, 1),
            interp_weights=weights.repeat(t, 1),
            cos=cos,
            sin=sin,
            frame_lengths=[h * w] * t,
        )

    def prepare(self, grids: list[Grid], device: torch.device | str = "cpu") -> ForwardPlan:
        plans = [self.grid_plan(g) for g in grids]

        def packed(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in plans]).to(device, non_blocking=True)

        return ForwardPlan(
            interp_indices=packed("interp_indices"),
            interp_weights=packed("interp_weights"),
            cos=packed("cos"),
            sin=packed("sin"),
            frames=SegmentPlan.from_lengths([n for p in plans for n in p.frame_lengths], device),
        )

    def position_embedding(self, plan: ForwardPlan) -> torch.Tensor:
        """Bilinearly resampled learned positions, (N, D) in fp32: sum over 4 taps of weight * table row."""
        table = self.pos_embed.weight
        out = table[plan.interp_indices[:, 0]].float() * plan.interp_weights[:, 0:1]
        for tap in range(1, 4):
            out += table[plan.interp_indices[:, tap]].float() * plan.interp_weights[:, tap : tap + 1]
        return out

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values (sum t*h*w, C*T*P*P) in merge-block order -> (merged tokens, DeepStack levels)."""
        grids = self.grid_list(grid_thw)
        self.check_pixels(pixel_values, grids)
        device = self.patch_embed.proj.weight.device
        plan = self.prepare(grids, device)
        x = self.patch_embed(pixel_values.to(device, non_blocking=True))
        x = x + self.position_embedding(plan).to(x.dtype)
        scratch = self.scratch(x)
        levels = []
        with self.block_context():
            for i, block in enumerate(self.blocks):
                x = block(x, plan.cos, plan.sin, plan.frames, scratch)
                if i in self.deepstack_level:
                    levels.append(self.deepstack_merger_list[self.deepstack_level[i]](x, scratch))
        return self.merger(x, scratch), levels
