"""The modules both tower designs are made of: 2D rope, norms, MLPs, attention, patch embedding and merger.

Reference: the vision classes of transformers' ``modeling_qwen2_vl.py``, ``modeling_qwen2_5_vl.py`` and
``modeling_qwen3_vl.py`` (v5.24). Deviations, all numerically equivalent at fp32 rounding level:

- the Conv3d patch embedding (kernel == stride) runs as one matmul over the flattened row;
- the gated MLP's gate and up projections are one fused ``gate_up_proj`` (stacked at load time, see
  ``names.RULE_SETS``), and a Qwen2.5-Omni tower's separate q/k/v are one ``qkv``;
- attention runs through the tower's backend (``attention.py``) on a per-forward segment plan;
- in eager inference, activations are written into the forward's two ``Workspace`` buffers instead of fresh
  tensors (the same operations in the reference's order: results are bitwise those of the same ops out of place,
  but where a packed linear's rows come in chunks or an MLP runs by row blocks: see ``linear_chunks``);
- on the CPU the linears may run oneDNN's prepacked kernel where it is faster (``cpu_linear.PackableLinear``):
  in fp32 it rounds differently from addmm (both within ~5e-7 of float64), in bf16 it agrees within bf16 rounding
  (bitwise on CPUs where both weights take one oneDNN kernel);
- a packed plain (non-gated) MLP computes its activation in oneDNN's GEMM epilogue (``epilogue_activated``): in
  bf16 one rounding fewer than the reference's Linear then activation (closer to float64, not its bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .attention import SegmentPlan
from .cpu_linear import EPILOGUE_ACTIVATIONS, PackableLinear, balanced_chunks, packed_activated_linear, packed_chunks

# ----------------------------------------------------------------------------- activation buffers

_ACTIVE: ContextVar[Workspace | None] = ContextVar("qwenvl_vision_workspace", default=None)


class Workspace:
    """The activation memory of an eager call: two buffers that every block of its forwards reuses (one forward
    per item on the CPU, ``tower.VisionTower.packs``), freed with the call.

    Why: on CPU a fresh tensor larger than glibc's mmap threshold (up to 32 MiB) is mapped from the OS and
    page-faulted on first write; at 30k tokens a block made ~30 such N x D tensors and the faults cost ~27% of
    the forward (a write into a fresh 400 MB tensor took 8x as long as into a reused one). Here they are paid
    once per forward, and the peak is lower than the reference's: x, ``narrow`` (N x D) and ``wide``
    (N x max(3D, MLP width)), plus the attention output.

    Math the reference does in fp32 on half-precision activations (norm statistics, rope) runs on row chunks
    through two small fp32 ``scratch`` buffers (``fp32_chunks``): the same operations in the same order, so the
    same bits, without an N x D fp32 copy per step (in bf16 those copies, not the arithmetic, were the cost).

    The rule that makes reuse safe: every op writes into the buffer that does not hold its input
    (``take``), so no op overwrites what it reads, and a value lives until the op after next consumes it;
    in-place steps (rope, activation, gate * up) change only their own value. The residual stream x belongs to
    the forward and is updated in place (``add_linear_``). Results that leave the forward (mergers) are fresh.
    A packed linear's fresh row chunks (``linear_chunks``) are read by the step after it as they come, so they
    belong to no buffer; the step writes its result into the buffer not holding the linear's input.

    Modules reach the active workspace through ``output_buffer`` (a context variable, like autocast's state),
    so their ``forward`` reads as the math. Without one (under autograd, which cannot differentiate ``out=``
    and in-place ops on saved tensors; inside torch.compile, which plans its own memory; or a module called on
    its own) every op runs out of place.
    """

    def __init__(self, rows: int, dim: int, wide: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffers = (torch.empty(rows * dim, dtype=dtype, device=device),
                        torch.empty(rows * wide, dtype=dtype, device=device))
        self.scratch = torch.empty(2, SCRATCH_ELEMENTS, dtype=torch.float32, device=device)

    def take(self, source: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of `shape` in a buffer that does not hold `source` and is large enough."""
        held, size = source.untyped_storage().data_ptr(), math.prod(shape)
        for buffer in self.buffers:
            if buffer.untyped_storage().data_ptr() != held and buffer.numel() >= size:
                return buffer[:size].view(shape)
        raise RuntimeError(f"no workspace buffer for a {shape} output")  # a bug: the sizes are fixed per tower

    @contextmanager
    def active(self) -> Iterator[Workspace]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def output_buffer(source: torch.Tensor, *shape: int) -> torch.Tensor | None:
    """Where an op reading `source` writes its result of `shape`: a workspace buffer, or None (out of place)."""
    if torch.compiler.is_compiling():
        return None
    workspace = _ACTIVE.get()
    return None if workspace is None else workspace.take(source, shape)


def buffered() -> bool:
    return not torch.compiler.is_compiling() and _ACTIVE.get() is not None


# 2 MiB of fp32 per scratch buffer: a chunk's temporaries stay in the last-level cache, and the chunks are few
# enough that dispatch is not the cost (1 MiB chunks ran a 3,848 x 1,280 bf16 RMSNorm ~20% slower).
SCRATCH_ELEMENTS = 1 << 19


def row_chunks(rows: int, width: int) -> list[slice]:
    """Slices of at most SCRATCH_ELEMENTS // width rows covering `rows`."""
    step = max(1, SCRATCH_ELEMENTS // width)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def fp32_chunks(x: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(rows slice, those rows of x in fp32, an fp32 scratch view of their shape) over x's rows, through the active
    workspace's scratch: the reference's ``x.float()`` chunk by chunk. An fp32 x's rows are x's own (``float()``
    returns them: never write into them), any other dtype's are widened into the first scratch buffer."""
    scratch, shape = _ACTIVE.get().scratch, x.shape[1:]
    for chunk in row_chunks(x.shape[0], math.prod(shape)):
        size = (chunk.stop - chunk.start) * math.prod(shape)
        x32 = x[chunk] if x.dtype == torch.float32 else scratch[0, :size].view(-1, *shape).copy_(x[chunk])
        yield chunk, x32, scratch[1, :size].view(-1, *shape)


def linear(x: torch.Tensor, layer: PackableLinear) -> torch.Tensor:
    """``layer(x)``, written into a workspace buffer when one is active: the same kernel as the layer's own call
    (addmm, or oneDNN's prepacked linear where ``cpu_linear`` packed the layer), so the same bits."""
    return layer.linear(x, output_buffer(x, x.shape[0], layer.out_features))


def in_chunks(x: torch.Tensor, layer: PackableLinear) -> bool:
    """Whether ``linear_chunks(x, layer)`` hands out fresh row chunks (else one result in the workspace)."""
    return buffered() and layer.runs_packed(x)


def linear_chunks(x: torch.Tensor, layer: PackableLinear) -> Iterator[tuple[slice, torch.Tensor]]:
    """``layer(x)`` as (rows, those rows of the result) pairs, for a caller that consumes each at once (an
    activation, a residual add).

    oneDNN's prepacked kernel has no ``out=``: writing its result into the workspace costs a copy of it. Here,
    when ``in_chunks``, each chunk is a fresh output of ``cpu_linear.CHUNK_BYTES`` (still in cache when the caller
    reads it) and is never copied; otherwise there is one pair, ``linear(x, layer)``. The linear's rows are the
    same bits either way where the CPU's kernel gives a row the same bits in calls of any row count (on some it
    does not: then they agree within the dtype's rounding); the residual add, gate * up and rope are exact. A
    transcendental activation on chunks may differ in the last bit of a few fp32 elements: where a thread's share
    of a call ends mid-row, that row's tail takes the scalar kernel instead of the vector one (in bf16 the ulp
    vanishes in the rounding). Either way an item's chunks are the same wherever it is (``VisionTower.packs``).
    """
    if not in_chunks(x, layer):
        yield slice(None), linear(x, layer)
        return
    yield from packed_chunks(x, layer.weight, layer.bias)


def add_linear_(residual: torch.Tensor | None, x: torch.Tensor, layer: PackableLinear) -> torch.Tensor:
    """``residual + layer(x)`` (``layer(x)`` without a residual): in place on the residual, chunk by chunk as the
    rows come (``linear_chunks``), when the forward's workspace is active, else out of place."""
    if residual is None:
        return linear(x, layer)
    if not buffered():
        return residual + layer(x)
    for rows, update in linear_chunks(x, layer):
        residual[rows].add_(update)
    return residual


def activated_linear(x: torch.Tensor, layer: PackableLinear, act: str) -> torch.Tensor:
    """``act(layer(x))``: from each fresh chunk of the rows straight into a workspace buffer, or in place on the
    one result (``linear_chunks``)."""
    hidden = output_buffer(x, x.shape[0], layer.out_features) if in_chunks(x, layer) else None
    for rows, y in linear_chunks(x, layer):
        activated = activate_(y, act) if hidden is None else activate_into(y, act, hidden[rows])
    return activated if hidden is None else hidden


def gated_linear(x: torch.Tensor, layer: PackableLinear, act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``layer(x) = [gate | up]``: from each fresh chunk of the rows straight into a
    workspace buffer, or in place on the one result (``linear_chunks``)."""
    hidden = output_buffer(x, x.shape[0], layer.out_features // 2) if in_chunks(x, layer) else None
    for rows, gate_up in linear_chunks(x, layer):
        gated = gate_times_up(gate_up, act, out=None if hidden is None else hidden[rows])
    return gated if hidden is None else hidden


def gate_times_up(gate_up: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up`` of ``[gate | up]`` rows: the activation in place on gate, the product into ``out``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return multiply_(activate_(gate, act), up, out=out)


# Rows of an MLP's block (``add_by_row_blocks_``): a block's hidden activations (512 x hidden, 3.5-14 MB) stay in
# the last-level cache between the two GEMMs, and 512 rows run the GEMMs at their full rate (256 ran the
# Qwen3-VL-8B MLP ~8% slower). A block's fresh results may exceed cpu_linear.CHUNK_BYTES; at these sizes glibc
# serves them from the heap once the first is freed (its mmap threshold follows the largest freed chunk).
MLP_BLOCK_ROWS = 512


def by_row_blocks(residual: torch.Tensor | None, x: torch.Tensor, *layers: PackableLinear) -> bool:
    """Whether an MLP runs by row blocks: the forward's workspace active, a residual to add into, every linear on
    oneDNN's prepacked kernel."""
    return residual is not None and buffered() and all(layer.runs_packed(x) for layer in layers)


def add_by_row_blocks_(residual: torch.Tensor, x: torch.Tensor, hidden_of: Callable[[torch.Tensor], torch.Tensor],
                       second: PackableLinear) -> torch.Tensor:
    """``residual += second(hidden_of(x))`` in place, MLP_BLOCK_ROWS rows at a time (balanced): each block's hidden
    activations are computed, consumed and dropped while in cache, instead of an N x hidden tensor written to memory
    and read back. In bf16 the same bits as one pass where the CPU's kernel gives a row the same bits in calls of
    any row count; in fp32 a transcendental activation on other splits may differ by an ulp (``linear_chunks``)."""
    for rows in balanced_chunks(x.shape[0], MLP_BLOCK_ROWS):
        add_linear_(residual[rows], hidden_of(x[rows]), second)
    return residual


def epilogue_activated(x: torch.Tensor, layer: PackableLinear, act: str) -> torch.Tensor:
    """``act(layer(x))`` for a packed layer, a fresh result: the activation in oneDNN's GEMM epilogue where it has
    it (``cpu_linear.EPILOGUE_ACTIVATIONS``), else in place on the result."""
    if act in EPILOGUE_ACTIVATIONS:
        return packed_activated_linear(x, layer.weight, layer.bias, act)
    return activate_(layer.linear(x), act)


# The trailing underscore is torch's mark of an in-place op. These are in place when the forward's workspace is
# active (x is then a workspace value, a fresh chunk or the forward's own residual stream), else out of place:
# under autograd, inside torch.compile and for a module called on its own, where in-place writes would be wrong or
# unplanned (``add_linear_`` above follows the same rule).


def multiply_(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * y: into ``out`` when given, else in place on x when the forward's workspace is active, else out of
    place."""
    if out is not None:
        return torch.mul(x, y, out=out)
    return x.mul_(y) if buffered() else x * y


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
    grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)  # (h, w, 2)
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


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (N, hd) with rotate_half's signs folded in, [-sin1, sin2]: rotate_half(x) * sin is then
    [x2 * signed1, x1 * signed2], bit for bit (a negation is exact and commutes with a product's rounding)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_qk_into(qk: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` on q and k at once, written into out (qk itself for in place): qk (N, 2H, hd) is q's heads
    then k's, as they lie side by side in a row of qkv; cos and ``signed_sin`` (N, hd) fp32.

    The reference's ops in its order, x * cos + rotate_half(x) * sin in fp32 rounded once to the dtype, on row
    chunks through the active workspace's fp32 scratch (each chunk is read before its rows are written): the same
    bits. An fp32 qk is rotated straight into out (``fp32_chunks``).
    One pass for q and k together, with the signs in the table, is half the ops of rotating each alone: at
    3,848 tokens that was ~1,000 ops a block, and their dispatch cost more than their arithmetic.
    """
    half = qk.shape[-1] // 2
    for rows, x, tmp in fp32_chunks(qk):
        c, s = cos[rows].unsqueeze(-2), signed[rows].unsqueeze(-2)
        torch.mul(x[..., half:], s[..., :half], out=tmp[..., :half])
        torch.mul(x[..., :half], s[..., half:], out=tmp[..., half:])
        if qk.dtype == torch.float32:
            torch.mul(x, c, out=out[rows]).add_(tmp)
        else:
            out[rows].copy_(x.mul_(c).add_(tmp))
    return out


# ----------------------------------------------------------------------------- activations


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # transformers' QuickGELUActivation



# name -> (function, in-place function, function into out)
ACTIVATIONS: dict[str, tuple[Callable, Callable, Callable]] = {
    "silu": (F.silu, lambda x: F.silu(x, inplace=True), lambda x, out: torch.ops.aten.silu.out(x, out=out)),
    "swish": (F.silu, lambda x: F.silu(x, inplace=True), lambda x, out: torch.ops.aten.silu.out(x, out=out)),
    "gelu": (F.gelu, lambda x: torch.ops.aten.gelu_(x), lambda x, out: torch.ops.aten.gelu.out(x, out=out)),
    "gelu_pytorch_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                          lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
                          lambda x, out: torch.ops.aten.gelu.out(x, approximate="tanh", out=out)),
    # In place but for its sigmoid temporary.
    "quick_gelu": (_quick_gelu, lambda x: x.mul_(torch.sigmoid(1.702 * x)),
                   lambda x, out: torch.mul(x, torch.sigmoid(1.702 * x), out=out)),
}


def activate_(x: torch.Tensor, name: str) -> torch.Tensor:
    """The activation `name` on x: in place when the forward's workspace is active, else out of place."""
    function, in_place, _ = ACTIVATIONS[name]
    return in_place(x) if buffered() else function(x)


def activate_into(x: torch.Tensor, name: str, out: torch.Tensor) -> torch.Tensor:
    """The activation `name` on x, written into ``out`` (the same elementwise kernel as ``activate_``)."""
    return ACTIVATIONS[name][2](x, out)


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Qwen2.5's RMSNorm: statistics in fp32, weight applied after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = output_buffer(x, *x.shape)
        if out is None:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)
        # The same ops in the same order on row chunks (x*x is what pow(2) computes), written into the buffer.
        for rows, x32, squares in fp32_chunks(x):
            scale = torch.mul(x32, x32, out=squares).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            if x.dtype == torch.float32 or x.device.type != "cpu":
                torch.mul(x32, scale, out=out[rows]).mul_(self.weight)  # the fp32 product, rounded once into out
            else:  # on the CPU a mixed-dtype out= allocates an fp32 temporary: scale in the scratch, then round
                out[rows].copy_(x32.mul_(scale)).mul_(self.weight)
        return out


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and numbers), written into a workspace buffer by row chunks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = output_buffer(x, *x.shape)
        if out is None:
            return super().forward(x)
        # Row chunks: aten has no true out= layer norm (its .out form computes a full fresh result and copies it),
        # so each chunk's fresh result stays small and in cache; per-row statistics: chunks change no bit.
        for rows in row_chunks(x.shape[0], x.shape[1]):
            out[rows].copy_(F.layer_norm(x[rows], self.normalized_shape, self.weight, self.bias, self.eps))
        return out


def norm_layer(kind: str, dim: int) -> nn.Module:
    """The family's norm: "rms" (Qwen2.5) or "layer" (Qwen2-VL, Qwen3), eps 1e-6 in every released tower."""
    return RMSNorm(dim) if kind == "rms" else LayerNorm(dim, eps=1e-6)


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


@dataclass
class AttentionInputs:
    """What every block's attention needs besides x: rope tables, segments, and the backend that runs them."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (N, hd) fp32, in the forward's token order
    segments: SegmentPlan
    attend: Callable  # an attention backend, see attention.py
    signed_sin: torch.Tensor | None = None  # sin with rotate_half's signs (rotate_qk_into); made when not given

    def __post_init__(self) -> None:
        if self.signed_sin is None:
            self.signed_sin = signed_sin(self.rope[1])


class VisionAttention(nn.Module):
    """Fused qkv (head-major [q | k | v]), 2D rope on q and k, attention inside segments, output projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = PackableLinear(dim, 3 * dim, bias=True)
        self.proj = PackableLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output for x, added to ``residual`` when given (``add_linear_``)."""
        q, k, v = self.rotated_qkv(x, inputs)
        attended = inputs.attend(q, k, v, inputs.segments, self.scale, out=output_buffer(q, *q.shape))
        return add_linear_(residual, attended.flatten(1), self.proj)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rearrange(qkv, "n (qkv h d) -> qkv n h d", qkv=3, h=self.num_heads)

    def rotated_qkv(self, x: torch.Tensor, inputs: AttentionInputs
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (N, H, hd) of x, 2D rope on q and k. With the forward's workspace active: when qkv's rows come
        in fresh chunks, each chunk's q and k are rotated (and its v copied) straight into a workspace buffer,
        else q and k are rotated in place on the one result (``rotate_qk_into``); without it, out of place."""
        cos, sin = inputs.rope
        if not buffered():
            q, k, v = self.split_heads(self.qkv(x))
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        qk = slice(0, 2 * self.num_heads)  # the heads of q and k in a row of qkv, (3H, hd)
        if not in_chunks(x, self.qkv):
            qkv = linear(x, self.qkv)
            heads = qkv.view(x.shape[0], -1, self.head_dim)
            rotate_qk_into(heads[:, qk], heads[:, qk], cos, inputs.signed_sin)
            return self.split_heads(qkv)
        qkv = output_buffer(x, x.shape[0], self.qkv.out_features)
        heads = qkv.view(x.shape[0], -1, self.head_dim)
        for rows, chunk in linear_chunks(x, self.qkv):
            fresh = chunk.view(chunk.shape[0], -1, self.head_dim)
            rotate_qk_into(fresh[:, qk], heads[rows, qk], cos[rows], inputs.signed_sin[rows])
            heads[rows, qk.stop:].copy_(fresh[:, qk.stop:])
        return self.split_heads(qkv)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up as one ``gate_up_proj`` [gate; up] (fused at load time)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = PackableLinear(dim, 2 * hidden, bias=True)
        self.down_proj = PackableLinear(hidden, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output for x, added to ``residual`` when given (``add_linear_``); by row blocks where both
        linears run packed (``add_by_row_blocks_``)."""
        if by_row_blocks(residual, x, self.gate_up_proj, self.down_proj):
            return add_by_row_blocks_(residual, x, self.gated_block, self.down_proj)
        return add_linear_(residual, gated_linear(x, self.gate_up_proj, self.act), self.down_proj)

    def gated_block(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of a block of rows, into the workspace (one block's worth, reused by every block)."""
        hidden = output_buffer(x, x.shape[0], self.down_proj.in_features)
        return gate_times_up(self.gate_up_proj.linear(x), self.act, out=hidden)


class MLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))) (Qwen2-VL names them fc1 / fc2: renamed at load time)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = PackableLinear(dim, hidden, bias=True)
        self.linear_fc2 = PackableLinear(hidden, dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output for x, added to ``residual`` when given (``add_linear_``); by row blocks where both
        linears run packed, the activation then in the first GEMM's epilogue (``add_by_row_blocks_``,
        ``epilogue_activated``: one rounding fewer in bf16)."""
        if by_row_blocks(residual, x, self.linear_fc1, self.linear_fc2):
            return add_by_row_blocks_(residual, x, self.activated_block, self.linear_fc2)
        return add_linear_(residual, activated_linear(x, self.linear_fc1, self.act), self.linear_fc2)

    def activated_block(self, x: torch.Tensor) -> torch.Tensor:
        return epilogue_activated(x, self.linear_fc1, self.act)


class Block(nn.Module):
    """Pre-norm transformer block; the norm and MLP kinds are the family's (config.Family)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, norm: str, mlp: str) -> None:
        super().__init__()
        self.norm1 = norm_layer(norm, dim)
        self.norm2 = norm_layer(norm, dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = (GatedMLP if mlp == "gated" else MLP)(dim, mlp_hidden, act)

    def forward(self, x: torch.Tensor, attention: AttentionInputs) -> torch.Tensor:
        x = self.attn(self.norm1(x), attention, residual=x)
        return self.mlp(self.norm2(x), residual=x)


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
        self.linear_fc1 = PackableLinear(self.hidden, self.hidden)
        self.linear_fc2 = PackableLinear(self.hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, D) -> (N/4, out), a fresh tensor (it leaves the forward)."""
        grouped = self.norm(x.view(-1, self.hidden)) if self.norm_after_view else self.norm(x).view(-1, self.hidden)
        hidden = activated_linear(grouped, self.linear_fc1, "gelu")
        return self.linear_fc2(hidden)
