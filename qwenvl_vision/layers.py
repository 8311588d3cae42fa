"""Pieces shared by both towers: 2D rope, packed variable-length attention, norms, patch embedding.

Reference: transformers' ``modeling_qwen2_5_vl.py`` / ``modeling_qwen3_vl.py`` (v5.2x) vision classes.
Deviations, all numerically equivalent at fp32 rounding level:
- the Conv3d patch embedding (kernel == stride) runs as one matmul over the flattened row;
- attention over a packed sequence never loops over images in Python per layer: segments of equal
  length are batched into one SDPA call each (a view when they are contiguous, else a gather), and
  on CUDA in half precision one varlen flash call covers the whole pack. No N x N mask is ever built.
- every shape and boundary is computed once per forward into a ``SegmentPlan``; the block loop does
  no host syncs;
- activations are written into per-forward ``Scratch`` buffers (``out=`` and in-place ops) instead of
  fresh tensors, with the reference's operations and rounding order kept (fp32 results are bitwise the
  same as the out-of-place ops); under autograd and torch.compile the same code runs out of place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_CUDA_KERNELS: dict[str, object] = {}


def cuda_varlen_kernel():
    """flash-attn's varlen kernel when installed, else PyTorch's own, else None; imported on first CUDA use
    (importing torch.nn.attention.varlen pulls in torch._dynamo, seconds we don't pay on CPU)."""
    if "kernel" not in _CUDA_KERNELS:
        kernel = None
        try:
            from flash_attn import flash_attn_varlen_func

            def kernel(q, k, v, cu, max_len, scale):
                return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=False)
        except Exception:  # noqa: BLE001 - not installed or not built for this GPU
            try:
                from torch.nn.attention.varlen import varlen_attn

                def kernel(q, k, v, cu, max_len, scale):
                    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)
            except Exception:  # noqa: BLE001
                kernel = None
        _CUDA_KERNELS["kernel"] = kernel
    return _CUDA_KERNELS["kernel"]


# ----------------------------------------------------------------------------- rope


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """hd/4 frequencies: 1 / theta ** (arange(0, hd/2, 2) / (hd/2)), in fp32 like the reference."""
    spatial_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (N, hd) in fp32 for (row, col) positions (N, 2): angles [row*f, col*f] repeated twice."""
    freqs = positions[..., None].float() * rope_inv_freq(head_dim, theta)  # (N, 2, hd/4)
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # (N, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (N, hd)
    return angles.cos(), angles.sin()


def merge_block_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """(h*w, 2) (row, col) of each patch listed in merge-block order (block_row, block_col, r, c)."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (N, H, hd) by per-token cos/sin (N, hd); computed in fp32 and cast back, as the reference."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x * cos + rotate_half(x) * sin).to(dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in place on x (N, H, hd), using tmp (N, H, hd) as scratch; the same result bit for bit.

    rotate_half(x) * sin is [-x2 * sin1, x1 * sin2] (negation is exact), then x * cos + that, in the
    reference's order. Half-precision inputs take the fp32 route and are copied back.
    """
    if x.dtype != torch.float32:
        return x.copy_(apply_rope(x, cos, sin))
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    torch.mul(x[..., half:], sin[..., :half], out=tmp[..., :half]).neg_()
    torch.mul(x[..., :half], sin[..., half:], out=tmp[..., half:])
    return x.mul_(cos).add_(tmp)


# ----------------------------------------------------------------------------- activation buffers


class Scratch:
    """Activation buffers for one forward, reused by every block, freed when the forward returns.

    Why: on CPU a fresh tensor larger than glibc's mmap threshold (32 MiB) is mapped from the OS and
    page-faulted on first write. At 30k tokens a block made ~30 such N x D tensors, and the faults cost
    ~27% of the forward (a write into a fresh 400 MB tensor took 8x as long as into a reused one).
    With these buffers the faults are paid once per forward. The peak also drops: live per block are x,
    ``narrow`` (N x D) and ``wide`` (N x max(3D, 2I)), plus the attention output.

    ``Scratch.functional()`` has no buffers: every method then returns None or a new tensor, and the same
    block code runs out of place. The towers use it under autograd (out= and in-place ops on saved
    tensors do not differentiate) and under ``torch.compile`` (inductor plans its own memory).
    """

    def __init__(self, rows: int, dim: int, wide: int, dtype: torch.dtype, device: torch.device) -> None:
        self.reuse = rows > 0
        # The (N, D) buffer for hidden states; None without buffers.
        self.narrow = torch.empty(rows, dim, dtype=dtype, device=device) if self.reuse else None
        self._wide = torch.empty(rows * wide, dtype=dtype, device=device) if self.reuse else None
        self._weights: torch.Tensor | None = None

    @classmethod
    def functional(cls) -> Scratch:
        return cls(0, 0, 0, torch.float32, torch.device("cpu"))

    def wide(self, x: torch.Tensor, cols: int, offset: int = 0) -> torch.Tensor | None:
        """A contiguous (N, cols) view for hidden states x (N, D), `offset` whole (N, cols) blocks in."""
        return self.wide_rows(x.shape[0], cols, offset)

    def wide_rows(self, rows: int, cols: int, offset: int = 0) -> torch.Tensor | None:
        if self._wide is None:
            return None
        start = offset * rows * cols
        return self._wide[start : start + rows * cols].view(rows, cols)

    def weights(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
        """A reusable (rows, cols) buffer for weights concatenated per block (one per forward, not per block)."""
        if not self.reuse:
            return None
        if self._weights is None or self._weights.numel() < rows * cols:
            self._weights = like.new_empty(rows * cols)
        return self._weights[: rows * cols].view(rows, cols)

    # The elementwise steps of a block: in place with buffers, out of place without.

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.add_(y) if self.reuse else x + y

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.mul_(y) if self.reuse else x * y

    def activation(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return activation_(x, name) if self.reuse else activation_fn(name)(x)


def linear_into(x: torch.Tensor, linear: nn.Linear, out: torch.Tensor | None) -> torch.Tensor:
    """``linear(x)``, written into out when given: the same addmm F.linear runs, so the same bits."""
    return linear_weights_into(x, linear.weight, linear.bias, out)


def linear_weights_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


# ----------------------------------------------------------------------------- attention plan


VIEW_MIN_TOKENS = 2048  # a run of equal segments this large runs in place; smaller ones may be gathered


@dataclass
class SegmentGroup:
    """Segments of one length L: a contiguous run [start, start + count*L) or gathered rows."""

    length: int
    count: int
    start: int | None = None
    index: torch.Tensor | None = None  # (count * L,) rows, when the segments are not contiguous


@dataclass
class SegmentPlan:
    """Attention boundaries for one packed forward, built once on the host and moved to the device once."""

    cu_seqlens: torch.Tensor  # (n + 1,) int32 on the device
    max_seqlen: int
    groups: list[SegmentGroup]
    total: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> SegmentPlan:
        """Runs of consecutive equal-length segments become views (no copy); small runs of one length
        scattered over the pack are gathered into one batched call so that many tiny images or windows
        do not cost one kernel launch each. Large runs are never gathered: the copy would cost memory."""
        lengths = [int(n) for n in lengths if n > 0]
        runs: list[tuple[int, int, int]] = []  # (length, start, count)
        start = 0
        for n in lengths:
            if runs and runs[-1][0] == n and runs[-1][1] + runs[-1][2] * n == start:
                runs[-1] = (n, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((n, start, 1))
            start += n
        groups: list[SegmentGroup] = []
        small_by_length: dict[int, list[tuple[int, int]]] = {}
        for n, run_start, count in runs:
            if n * count >= VIEW_MIN_TOKENS:
                groups.append(SegmentGroup(n, count, start=run_start))
            else:
                small_by_length.setdefault(n, []).append((run_start, count))
        for n, small in small_by_length.items():
            if len(small) == 1:
                groups.append(SegmentGroup(n, small[0][1], start=small[0][0]))
                continue
            starts = torch.tensor([s + i * n for s, count in small for i in range(count)])
            rows = (starts[:, None] + torch.arange(n)).flatten()
            groups.append(SegmentGroup(n, len(starts), index=rows.to(device, non_blocking=True)))
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(cu.to(device, non_blocking=True), max(lengths, default=0), groups, start)


def _sdpa_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, length: int, scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """count segments of `length` tokens, (count*L, H, hd) each -> (count*L, H, hd), into `out` if given."""
    heads, hd = q.shape[-2:]

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(count, length, heads, hd).transpose(1, 2)

    attended = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale).transpose(1, 2)
    if out is None:
        return attended.reshape(count * length, heads, hd)
    out.view(count, length, heads, hd).copy_(attended)
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan, scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Non-causal attention inside each segment of the plan; q, k, v: (N, H, hd).

    Written into `out` (N, H, hd, contiguous) when given, except by the fused CUDA kernel, which
    returns its own.
    """
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kernel = cuda_varlen_kernel()
        if kernel is not None:  # one fused call over the whole pack
            # v is a view into the qkv buffer (row stride 3D); q and k arrive packed from the rope.
            return kernel(q.contiguous(), k.contiguous(), v.contiguous(), plan.cu_seqlens, plan.max_seqlen, scale)
    if out is None:
        if len(plan.groups) == 1 and plan.groups[0].start == 0:  # one run of equal segments: no copy
            group = plan.groups[0]
            return _sdpa_batched(q, k, v, group.count, group.length, scale)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for group in plan.groups:
        if group.index is None:
            rows = slice(group.start, group.start + group.count * group.length)
            _sdpa_batched(q[rows], k[rows], v[rows], group.count, group.length, scale, out=out[rows])
        else:
            idx = group.index
            out[idx] = _sdpa_batched(q[idx], k[idx], v[idx], group.count, group.length, scale)
    return out


def attention_outside_graph(q, k, v, plan, scale, out=None):
    """``varlen_attention`` for compiled blocks (wrapped in torch.compiler.disable by compile_blocks):
    always a tensor of its own, never a view, so that dynamo's guards on the output do not change between
    packs (a one-segment pack returns a view of SDPA's output, others a new tensor)."""
    result = varlen_attention(q, k, v, plan, scale, out)
    return result if result._base is None else result.clone()


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm: statistics in fp32, weight applied after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised x, written into `out` when given."""
        if out is not None and x.dtype == torch.float32:
            # The same ops in the same order, written into out: x*x is what pow(2) computes.
            torch.mul(x, x, out=out)
            scale = out.mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return torch.mul(x, scale, out=out).mul_(self.weight)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * x32.to(dtype)
        return normed if out is None else out.copy_(normed)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride is a Linear over a (C, T, P, P) row; kept as Conv3d for names and shapes."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int, bias: bool) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=bias)
        self.dim = dim

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(self.dim, -1), self.proj.bias)


class VisionAttention(nn.Module):
    """Fused qkv (head-major [q | k | v]), 2D rope on q and k, varlen attention, output proj."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.attend = varlen_attention  # swapped for a torch.compiler.disable'd wrapper by compile_blocks()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan,
                scratch: Scratch) -> torch.Tensor:
        """x (N, D) -> (N, D) in scratch.wide. x may be scratch.narrow: it is dead after the qkv GEMM."""
        n, dim = x.shape
        qkv = linear_into(x, self.qkv, scratch.wide(x, 3 * dim))
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        buffer = scratch.narrow
        tmp = None if buffer is None else buffer.view(n, self.num_heads, self.head_dim)
        if tmp is not None and q.dtype == torch.float32:
            apply_rope_(q, cos, sin, tmp)
            apply_rope_(k, cos, sin, tmp)
        else:  # half precision rotates in fp32 anyway; its packed results also suit the fused CUDA kernel
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, plan, self.scale, out=tmp)  # tmp is free again after the rope
        # qkv is dead now: the projection reuses the front of the same buffer.
        return linear_into(out.flatten(1), self.proj, scratch.wide(x, dim))


def activation(name: str) -> nn.Module:
    """The module for config.hidden_act (kept for the merger's nn.Sequential and for name checks)."""
    check_activation(name)
    return ACTIVATIONS[name][0]()


def activation_fn(name: str):
    """The activation `name` as a function (out of place)."""
    check_activation(name)
    return ACTIVATIONS[name][1]


def activation_(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation `name` applied to x in place: the same kernels as the modules, without a new tensor."""
    check_activation(name)
    return ACTIVATIONS[name][2](x)


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {  # name -> (module factory, function, in-place function)
    "silu": (nn.SiLU, F.silu, lambda x: F.silu(x, inplace=True)),
    "swish": (nn.SiLU, F.silu, lambda x: F.silu(x, inplace=True)),
    "gelu": (nn.GELU, F.gelu, lambda x: torch.ops.aten.gelu_(x)),
    "gelu_pytorch_tanh": (lambda: nn.GELU(approximate="tanh"), _gelu_tanh,
                          lambda x: torch.ops.aten.gelu_(x, approximate="tanh")),
}
