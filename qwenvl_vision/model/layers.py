"""The modules both tower designs are made of: 2D rope, norms, MLPs, attention, patch embedding and merger.

This is the math, one path per module, used by autograd, ``torch.compile``, CUDA and ``cpu_kernels="reference"``;
the CPU inference backend (``cpu/``) runs the same operations on these modules' parameters.

Reference: the vision classes of transformers' ``modeling_qwen2_vl.py``, ``modeling_qwen2_5_vl.py`` and
``modeling_qwen3_vl.py`` (v5.24). Deviations, all numerically equivalent at fp32 rounding level:

- the Conv3d patch embedding (kernel == stride) runs as one matmul over the flattened row;
- the gated MLP's gate and up projections are one fused ``gate_up_proj`` (stacked at load time, see
  ``names.RULE_SETS``), and a Qwen2.5-Omni tower's separate q/k/v are one ``qkv``;
- attention runs through the tower's backend (``attention.py``) on a per-forward segment plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..devices import upload
from .attention import SegmentPlan

# ----------------------------------------------------------------------------- rope


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (N, hd) in fp32 for (row, col) positions (N, 2): angles [row*f, col*f] repeated twice."""
    spatial_dim = head_dim // 2  # hd/4 frequencies in fp32, made on the host as the reference's buffer, then moved
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
    if positions.device.type != "cpu":
        inv_freq = upload([inv_freq], positions.device)
    freqs = positions[..., None].float() * inv_freq  # (N, 2, hd/4)
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # (N, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (N, hd)
    return angles.cos(), angles.sin()


def merge_block_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """(h*w, 2) (row, col) of each patch listed in merge-block order (block_row, block_col, r, c)."""
    rows, cols = torch.arange(h, dtype=torch.int32), torch.arange(w, dtype=torch.int32)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1)  # (h, w, 2)
    return rearrange(grid, "(bh m1) (bw m2) rc -> (bh bw m1 m2) rc", m1=merge, m2=merge)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (N, H, hd) by per-token cos/sin (N, hd); computed in fp32 and cast back, as the reference."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x * cos + rotate_half(x) * sin).to(dtype)


# ----------------------------------------------------------------------------- activations


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # transformers' QuickGELUActivation


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "quick_gelu": quick_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm: statistics in fp32, weight applied after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def norm_layer(kind: str, dim: int) -> nn.Module:
    """The family's norm: "rms" (Qwen2.5) or "layer" (Qwen2-VL, Qwen3), eps 1e-6 in every released tower."""
    return RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim, eps=1e-6)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride is a Linear over a (C, T, P, P) row; kept as Conv3d for names and shapes."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int, bias: bool) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


@dataclass
class AttentionInputs:
    """What every block's attention needs besides x: rope tables, segments, and the backend that runs them."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (N, hd) fp32, in the forward's token order
    segments: SegmentPlan
    attend: Callable  # an attention backend, see attention.py


class VisionAttention(nn.Module):
    """Fused qkv (head-major [q | k | v]), 2D rope on q and k, attention inside segments, output projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv(x))
        cos, sin = inputs.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.proj(inputs.attend(q, k, v, inputs.segments, self.scale).flatten(1))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rearrange(qkv, "n (qkv h d) -> qkv n h d", qkv=3, h=self.num_heads)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one ``gate_up_proj`` [gate; up] (fused at load time)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class MLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))) (Qwen2-VL names them fc1 / fc2: renamed at load time)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(ACTIVATIONS[self.act](self.linear_fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block; the norm and MLP kinds are the family's (config.Family)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, norm: str, mlp: str) -> None:
        super().__init__()
        self.norm1 = norm_layer(norm, dim)
        self.norm2 = norm_layer(norm, dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = (GatedMLP if mlp == "gated" else MLP)(dim, mlp_hidden, act)

    def forward(self, x: torch.Tensor, attention: AttentionInputs) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attention)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 neighbours (4 consecutive rows) -> norm -> Linear(4D, 4D) -> exact GELU -> Linear(4D, out).

    The norm is over D before the 2x2 view (final mergers), or over 4D after it (Qwen3's DeepStack mergers).
    Qwen2-VL / Qwen2.5-VL / Qwen3-Omni checkpoints name these ln_q / mlp.0 / mlp.2 (renamed at load time).
    """

    def __init__(self, dim: int, out: int, merge_unit: int, norm: str, norm_after_view: bool = False) -> None:
        super().__init__()
        self.hidden = dim * merge_unit
        self.norm_after_view = norm_after_view
        self.norm = norm_layer(norm, self.hidden if norm_after_view else dim)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, D) -> (N/4, out)."""
        grouped = self.norm(x.view(-1, self.hidden)) if self.norm_after_view else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(grouped)))
