"""Qwen2.5-VL vision tower (windowed attention).

Reference: transformers ``Qwen2_5_VisionTransformerPretrainedModel`` and ``vision_utils.get_vision_window_index``.
Module names equal the checkpoint's ``visual.*`` tensors without the prefix, so loading is strict.

Per block: x += attn(RMSNorm(x)); x += down(silu(gate(x)) * up(x)). Blocks in ``fullatt_block_indexes``
attend over each whole frame; all others attend inside 8x8-patch windows (4x4 merged tokens). Tokens
are put in window order once, before the first block, and restored after the merger.

Deviations from the reference (same numbers):
- the window permutation is applied to pixel_values rows before the patch embedding rather than to its
  output (the embedding is per-row, so the result is identical and the gather is narrower);
- window order, inverse order, rope cos/sin in window order and the segment lengths are computed once per
  grid (t, h, w) and kept in this instance's bounded ``shape_cache``; per forward they are concatenated for
  the pack and moved to the device once;
- inside each frame, windows are ordered longest first (stable) instead of raster order, so that all full
  windows of a frame form one contiguous run that attention processes in place; a window's own tokens
  keep their order, so every output is unchanged (``frame_window_order`` is the reference's order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .layers import (
    PatchEmbed,
    RMSNorm,
    Scratch,
    SegmentPlan,
    VisionAttention,
    check_activation,
    linear_into,
    linear_weights_into,
    merge_block_positions,
    rope_cos_sin,
)
from .tower import Grid, VisionTower

FUSED_GATE_UP_MIN_ROWS = 256  # below this the weight concatenation costs more than it saves


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        check_activation(act)
        self.act = act

    def forward(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """x (N, D) -> down(act(gate(x)) * up(x)) in scratch.narrow (x may be scratch.narrow: dead after gate/up)."""
        rows, dim = x.shape
        inter = self.up_proj.out_features
        if scratch.reuse and x.device.type == "cpu" and rows >= FUSED_GATE_UP_MIN_ROWS:
            # One GEMM over [gate; up]: on CPU (MKL) an N=3420 GEMM runs well below the rate of the fused
            # N=6840 one; concatenating the weights per block costs ~1% of the GEMMs it speeds up.
            weight = torch.cat([self.gate_proj.weight, self.up_proj.weight],
                               out=scratch.weights(2 * inter, dim, self.up_proj.weight))
            bias = torch.cat([self.gate_proj.bias, self.up_proj.bias])
            gate, up = linear_weights_into(x, weight, bias, scratch.wide(x, 2 * inter)).chunk(2, dim=-1)
        else:
            gate = linear_into(x, self.gate_proj, scratch.wide(x, inter, offset=0))
            up = linear_into(x, self.up_proj, scratch.wide(x, inter, offset=1))
        hidden = scratch.mul(scratch.activation(gate, self.act), up)
        return linear_into(hidden, self.down_proj, scratch.narrow)


class Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size)
        self.norm2 = RMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan,
                scratch: Scratch) -> torch.Tensor:
        """x += attn(norm1(x)); x += mlp(norm2(x)); in place on x (owned by the forward) when buffers are reused."""
        attended = self.attn(self.norm1(x, out=scratch.narrow), cos, sin, plan, scratch)
        x = scratch.add(x, attended)  # attention first: the compile graph break sits inside it
        return scratch.add(x, self.mlp(self.norm2(x, out=scratch.narrow), scratch))


class PatchMerger(nn.Module):
    """RMSNorm over D, then 2x2 neighbours (4 consecutive rows) -> Linear(4D,4D) -> GELU -> Linear(4D,out)."""

    def __init__(self, dim: int, out: int, merge_unit: int) -> None:
        super().__init__()
        self.hidden = dim * merge_unit
        self.ln_q = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out))

    def forward(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        normed = self.ln_q(x, out=scratch.narrow).view(-1, self.hidden)
        fc1, _, fc2 = self.mlp  # the nn.GELU in the middle runs in place via scratch.activation
        hidden = linear_into(normed, fc1, scratch.wide_rows(normed.shape[0], self.hidden))
        return fc2(scratch.activation(hidden, "gelu"))


def frame_window_order(merged_h: int, merged_w: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged-token indices of one frame in window order, and each window's length in merged tokens.

    The merged grid is padded bottom/right by ``window - n % window`` (a whole empty window when n
    divides, which has length 0 and is dropped), cut into windows in raster order, row-major inside.
    """
    index = torch.arange(merged_h * merged_w).view(merged_h, merged_w)
    pad_h, pad_w = window - merged_h % window, window - merged_w % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    n_h, n_w = (merged_h + pad_h) // window, (merged_w + pad_w) // window
    windows = padded.view(n_h, window, n_w, window).permute(0, 2, 1, 3).reshape(n_h * n_w, window * window)
    valid = windows >= 0
    lengths = [n for n in valid.sum(1).tolist() if n > 0]
    return windows[valid], lengths


def length_sorted(order: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The same windows, longest first (stable): equal windows become one contiguous run per frame.

    Attention inside a window does not depend on where the window sits in the sequence, and the merger's
    groups of four are untouched, so this changes no number; it lets the attention run every full window
    of a frame as one view instead of gathering them.
    """
    windows = list(order.split(lengths))
    ranked = sorted(range(len(windows)), key=lambda i: -lengths[i])
    return torch.cat([windows[i] for i in ranked]), [lengths[i] for i in ranked]


@dataclass
class GridPlan:
    """Everything derived from one grid (t, h, w); cached per instance."""

    window_index: torch.Tensor  # (t*h*w/4,) merged-token order into windows
    reverse_index: torch.Tensor  # its inverse
    cos: torch.Tensor  # (t*h*w, hd) fp32, in window order
    sin: torch.Tensor
    window_lengths: list[int]  # in patches
    frame_lengths: list[int]  # in patches


@dataclass
class ForwardPlan:
    """One packed forward's indices and boundaries, on the device."""

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    windows: SegmentPlan
    frames: SegmentPlan


class Qwen2_5VisionTransformer(VisionTower):
    def __init__(self, config: VisionConfig, cache_size: int = 1024, cache_bytes: int | None = 1 << 30) -> None:
        super().__init__(config, cache_size, cache_bytes)
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size, bias=False)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.out_hidden_size, config.merge_unit)
        self.full_attention_blocks = frozenset(config.fullatt_block_indexes)

    def grid_plan(self, grid: Grid) -> GridPlan:
        return self.shape_cache.get_or_compute(grid, lambda: self._compute_grid_plan(grid))

    def _compute_grid_plan(self, grid: Grid) -> GridPlan:
        t, h, w = grid
        cfg = self.config
        merge, unit = cfg.spatial_merge_size, cfg.merge_unit
        merged_h, merged_w = h // merge, w // merge
        per_frame = merged_h * merged_w
        frame_order, frame_windows = length_sorted(*frame_window_order(merged_h, merged_w, cfg.window_merged))
        window_index = torch.cat([frame_order + f * per_frame for f in range(t)])
        positions = merge_block_positions(h, w, merge).repeat(t, 1)
        positions = positions.view(-1, unit, 2)[window_index].view(-1, 2)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        return GridPlan(
            window_index=window_index,
            reverse_index=torch.argsort(window_index),
            cos=cos,
            sin=sin,
            window_lengths=[n * unit for n in frame_windows] * t,
            frame_lengths=[h * w] * t,
        )

    def prepare(self, grids: list[Grid], device: torch.device | str = "cpu") -> ForwardPlan:
        """Concatenate the cached per-grid plans for a pack, with offsets, and move them to the device once."""
        plans = [self.grid_plan(g) for g in grids]
        offsets, offset = [], 0
        for t, h, w in grids:
            offsets.append(offset)
            offset += t * h * w // self.config.merge_unit
        window_index = torch.cat([p.window_index + o for p, o in zip(plans, offsets)])
        reverse_index = torch.cat([p.reverse_index + o for p, o in zip(plans, offsets)])
        return ForwardPlan(
            window_index=window_index.to(device, non_blocking=True),
            reverse_index=reverse_index.to(device, non_blocking=True),
            cos=torch.cat([p.cos for p in plans]).to(device, non_blocking=True),
            sin=torch.cat([p.sin for p in plans]).to(device, non_blocking=True),
            windows=SegmentPlan.from_lengths([n for p in plans for n in p.window_lengths], device),
            frames=SegmentPlan.from_lengths([n for p in plans for n in p.frame_lengths], device),
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values (sum t*h*w, C*T*P*P) in merge-block order -> (merged tokens in input order, [])."""
        grids = self.grid_list(grid_thw)
        self.check_pixels(pixel_values, grids)
        device = self.patch_embed.proj.weight.device
        pixel_values = pixel_values.to(device, non_blocking=True)
        plan = self.prepare(grids, device)
        unit = self.config.merge_unit
        rows = pixel_values.view(-1, unit, pixel_values.shape[-1])[plan.window_index].view(-1, pixel_values.shape[-1])
        x = self.patch_embed(rows)
        scratch = self.scratch(x)
        with self.block_context():
            for i, block in enumerate(self.blocks):
                segments = plan.frames if i in self.full_attention_blocks else plan.windows
                x = block(x, plan.cos, plan.sin, segments, scratch)
        merged = self.merger(x, scratch)
        return merged[plan.reverse_index], []
