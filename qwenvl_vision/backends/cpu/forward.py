"""The CPU inference forward of a tower's blocks and mergers: the modules' math, run on the machine's plan.

The modules (``layers.py``) stay the math; this reads their parameters and runs the same operations with what the
CPU rewards: activations in the call's ``Workspace`` instead of fresh tensors, each linear on the kernel the
machine's ``CpuPlan`` chose (a packed weight's rows computed in chunks of the plan's size and handed on as they
come), norms with the residual add before them, rope, the SiLU gate and GELU-tanh each in one pass of the ``native``
kernels where the plan chose them (else the modules' own ops), MLPs by row blocks where both their linears are
packed, attention per segment length on the plan's path. It runs only in inference (no autograd, no compile, never
on CUDA): ``backend.CpuBackend`` picks it once per call.

Numbers against the reference's ops: a linear on addmm and the modules' ops are the reference's bits; oneDNN's
kernels round as ``kernels`` says; the native rope and residual add are the reference's bits, their norms and
activations within a few fp32 ulps (GELU-tanh's tail nearer the exact value: ``native.c``). A transcendental
activation on row chunks may differ in the last bit of a few fp32 elements from one call over all rows (a thread's
share ending mid-row takes the scalar kernel); an item's chunks are the same wherever it is, since on the CPU each
item runs as its own forward."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...model.attention import SegmentPlan, sdpa_attention, sdpa_batched
from ...model.execution import Grid
from ...model.layers import AttentionInputs, GatedMLP, PatchMerger, VisionAttention, apply_rope
from .kernels import DEFAULT_CHUNK_BYTES, balanced_chunks, gemm_attention, packed_chunks, packed_linear
from .native import NativeKernels
from .packing import PackedLinear
from .plan import CpuPlan
from .workspace import Workspace


@dataclass(frozen=True)
class Activation:
    """The backend's forms of one of the model's activations (``layers.ACTIVATIONS``): in place, as oneDNN's
    GEMM-epilogue post-op (``kernels.packed_linear``'s epilogue) where it has one, whether ``native`` runs it alone."""

    in_place: Callable[[torch.Tensor], torch.Tensor]
    epilogue: tuple[str, str] | None = None
    native: bool = False


SILU = Activation(lambda x: F.silu(x, inplace=True), ("swish", ""))
ACTIVATIONS: dict[str, Activation] = {
    "silu": SILU,
    "swish": SILU,
    "gelu": Activation(lambda x: torch.ops.aten.gelu_(x), ("gelu", "none")),
    "gelu_pytorch_tanh": Activation(lambda x: torch.ops.aten.gelu_(x, approximate="tanh"), ("gelu", "tanh"), True),
    # In place but for its sigmoid temporary (the same ops as layers.quick_gelu); no epilogue: oneDNN's swish
    # post-op takes no alpha through this call.
    "quick_gelu": Activation(lambda x: x.mul_(torch.sigmoid(1.702 * x))),
}


def packed(layer: nn.Linear) -> bool:
    """Whether the plan put this layer's weight in oneDNN's layout (``packing.PackedLinear``)."""
    return isinstance(layer, PackedLinear)


class CpuExecution:
    """One inference call's execution of blocks and mergers (see the module docstring)."""

    name = "cpu"

    def __init__(self, plan: CpuPlan, workspace: Workspace, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 forwards: list[tuple[torch.Tensor, list[Grid]]] | None = None,
                 native: NativeKernels | None = None) -> None:
        self.plan = plan
        self.workspace = workspace
        self.chunk_bytes = chunk_bytes  # output per oneDNN call of a packed linear (the plan's for the tower)
        self.forwards = forwards or []  # a call's (rows, grids) per forward (``execution.Execution``)
        self.native = native  # the fused elementwise steps where the plan chose them for the tower

    # ------------------------------------------------------------------ what the tower calls (execution.Execution)

    def attention_inputs(self, rope: tuple[torch.Tensor, torch.Tensor], segments: SegmentPlan) -> AttentionInputs:
        return AttentionInputs(rope, segments, self.attend)

    def block(self, block: nn.Module, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        normed = self.attention(block.attn, self.norm(block.norm1, x), inputs, residual=x, norm=block.norm2)
        return self.mlp(block.mlp, normed, residual=x)

    def merger(self, merger: PatchMerger, x: torch.Tensor) -> torch.Tensor:
        """x (N, D) -> (N/4, out), a fresh tensor (it leaves the forward)."""
        if merger.norm_after_view:
            grouped = self.norm(merger.norm, x.view(-1, merger.hidden))
        else:
            grouped = self.norm(merger.norm, x).view(-1, merger.hidden)
        hidden = self.activated(grouped, merger.linear_fc1, "gelu")
        fc2 = merger.linear_fc2
        return packed_linear(hidden, fc2.weight, fc2.bias) if packed(fc2) else F.linear(hidden, fc2.weight, fc2.bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: SegmentPlan, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return sdpa_attention(q, k, v, segments, scale, out, batched=self.batched)

    def batched(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` equal segments on the plan's path for their length."""
        if self.plan.attention_path(q.dtype, q.shape[1], q.shape[2], q.shape[0] // count) == "gemm":
            return gemm_attention(q, k, v, count, scale, out)
        return sdpa_batched(q, k, v, count, scale, out)

    # ------------------------------------------------------------------ modules

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` (RMSNorm or nn.LayerNorm): in one native pass into the workspace, else the module's ops."""
        if self.native is None:
            return module(x)
        self.native.add_norm_(x, None, module, out := self.workspace.take(x, *x.shape))
        return out

    def attention(self, attn: VisionAttention, x: torch.Tensor, inputs: AttentionInputs,
                  residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """``residual += attn(x)``, and ``norm(residual)`` returned."""
        q, k, v = self.rotated_qkv(attn, x, inputs)  # v is in the qkv buffer always; q and k, rotated natively
        attended = inputs.attend(q, k, v, inputs.segments, attn.scale, out=self.workspace.take(v, *q.shape))
        return self.add_linear_(residual, attended.flatten(1), attn.proj, norm)

    def rotated_qkv(self, attn: VisionAttention, x: torch.Tensor, inputs: AttentionInputs
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (N, H, hd) of x, 2D rope on q and k: natively on the one result in place, or from each fresh chunk
        of a packed qkv into the workspace (v copied); else the reference's ``apply_rope`` on q and k."""
        (cos, sin), heads = inputs.rope, 2 * attn.num_heads
        if not packed(attn.qkv):
            qkv = self.linear_into(x, attn.qkv)
            if self.native is not None:
                self.native.rope(qkv, qkv, cos, sin, heads, attn.head_dim)
        else:
            qkv = self.workspace.take(x, x.shape[0], attn.qkv.out_features)
            for rows, chunk in self.packed_chunks(x, attn.qkv):
                if self.native is not None:
                    self.native.rope(chunk, qkv[rows], cos[rows], sin[rows], heads, attn.head_dim)
                else:
                    qkv[rows].copy_(chunk)
        q, k, v = attn.split_heads(qkv)
        if self.native is None:  # q and k at once: the reference's bits, half its calls
            q, k = apply_rope(qkv.view(x.shape[0], -1, attn.head_dim)[:, :heads], cos, sin).chunk(2, dim=1)
        return q, k, v

    def mlp(self, mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += mlp(x)``: by row blocks where both linears are packed (each block's hidden activations
        computed, consumed and dropped while in cache; the plan's rows per block), else through the workspace."""
        gated = isinstance(mlp, GatedMLP)
        first, second = (mlp.gate_up_proj, mlp.down_proj) if gated else (mlp.linear_fc1, mlp.linear_fc2)
        if packed(first) and packed(second):
            block = self.plan.mlp_rows("gated" if gated else "plain", first.in_features, second.in_features, mlp.act,
                                       x.dtype)
            for rows in balanced_chunks(x.shape[0], block):
                self.add_linear_(residual[rows], self.hidden_block(mlp, x[rows], gated), second)
            return residual
        hidden = self.activated(x, first, mlp.act, gated)
        return self.add_linear_(residual, hidden, second)

    def hidden_block(self, mlp: nn.Module, x: torch.Tensor, gated: bool) -> torch.Tensor:
        """A block of rows' hidden activations, both linears packed: gate * up into the workspace, or a plain MLP's
        activation on its fresh result, in oneDNN's epilogue where it has one and ``native`` does not run it."""
        if gated:
            hidden = self.workspace.take(x, x.shape[0], mlp.down_proj.in_features)
            gate_up = packed_linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
            return self.gate_times_up(gate_up, mlp.act, out=hidden)
        fc1, activation = mlp.linear_fc1, ACTIVATIONS[mlp.act]
        if activation.epilogue is None or (self.native is not None and activation.native):
            return self.activate(packed_linear(x, fc1.weight, fc1.bias), mlp.act)
        return packed_linear(x, fc1.weight, fc1.bias, activation.epilogue)

    # ------------------------------------------------------------------ linears

    def packed_chunks(self, x: torch.Tensor, layer: nn.Linear) -> Iterator[tuple[slice, torch.Tensor]]:
        """A packed layer's ``layer(x)`` as (rows, fresh result) pairs of ``chunk_bytes`` each."""
        return packed_chunks(x, layer.weight, layer.bias, self.chunk_bytes)

    def linear_into(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """``layer(x)`` of a plain layer in the workspace, by addmm (the reference's kernel)."""
        out = self.workspace.take(x, x.shape[0], layer.out_features)
        if layer.bias is None:
            return torch.mm(x, layer.weight.t(), out=out)
        return torch.addmm(layer.bias, x, layer.weight.t(), out=out)

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, layer: nn.Linear, norm: nn.Module | None = None
                    ) -> torch.Tensor:
        """``residual += layer(x)`` in place: from a packed layer's fresh chunks as they come (never copied), else
        from one result in the workspace; with ``norm``, ``norm(residual)`` returned, natively in the add's pass (its
        output may share x's buffer: each chunk's rows of x are read before those rows of it are written)."""
        updates = self.packed_chunks(x, layer) if packed(layer) else [(slice(None), self.linear_into(x, layer))]
        out = None if norm is None or self.native is None else self.workspace.take(residual, *residual.shape)
        for rows, update in updates:
            if self.native is None:
                residual[rows].add_(update)
            else:
                self.native.add_norm_(residual[rows], update, norm, None if out is None else out[rows])
        if out is not None:
            return out
        return residual if norm is None else self.norm(norm, residual)

    def activated(self, x: torch.Tensor, layer: nn.Linear, act: str, gated: bool = False) -> torch.Tensor:
        """``act(layer(x))``, or where ``gated`` ``act(gate) * up`` of ``layer(x) = [gate | up]``, in the workspace:
        in place on the one result, or from each fresh chunk into it."""
        if not packed(layer):
            y = self.linear_into(x, layer)
            return self.gate_times_up(y, act) if gated else self.activate(y, act)
        hidden = self.workspace.take(x, x.shape[0], layer.out_features // (2 if gated else 1))
        for rows, y in self.packed_chunks(x, layer):
            if gated:
                self.gate_times_up(y, act, out=hidden[rows])
            else:
                self.activate(y, act, out=hidden[rows])
        return hidden

    def gate_times_up(self, gate_up: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``act(gate) * up`` of ``[gate | up]`` rows into ``out`` (or in place on gate): SiLU's in one native pass
        where they run, else the activation in place on gate and the product."""
        gate, up = gate_up.chunk(2, dim=-1)
        out = gate if out is None else out
        if self.native is not None and ACTIVATIONS[act] is SILU:
            self.native.activation(gate_up, out, gated=True)
            return out
        return torch.mul(self.activate(gate, act), up, out=out)

    def activate(self, x: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x)`` into ``out`` (or in place): GELU-tanh in one native pass where they run, else the op in place
        (on a copy in ``out``)."""
        if self.native is not None and ACTIVATIONS[act].native:
            self.native.activation(x, out := x if out is None else out, gated=False)
            return out
        return ACTIVATIONS[act].in_place(x if out is None else out.copy_(x))
