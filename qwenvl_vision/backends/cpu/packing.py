"""A tower's linear weights in the layout the machine's plan chose: oneDNN's prepacked tensor, or plain.

A packed weight replaces the plain one in its ``nn.Linear`` (one copy, not two: the load peak stays one layer above
the tower). The modules never see it: only ``forward.CpuExecution`` runs a packed tower, and the tower unpacks before
running the modules' own forward (autograd, autocast, compile). The tower's hooks keep the rest of torch's module
contract: ``state_dict`` gives plain tensors (``dense_state_dict``, on every linear), ``load_state_dict`` and
``.to()`` unpack first and pack again where the plan still applies. Packing and unpacking replace a layer's
Parameter object (an optimizer built before holds the old one); a weight keeps its ``requires_grad``. A submodule of
a packed tower called on its own (``tower.blocks[0](...)``) is not supported: call the tower.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ...errors import ConfigError
from ...model.layers import MLP, Block, GatedMLP, RMSNorm, VisionAttention
from .kernels import pack_weight, return_freed_memory
from .plan import DTYPES, CpuPlan, PlanNeeds, dtype_name

# Packing and unpacking of every tower take turns (no tensor or model is held by it).
PACKING_LOCK = threading.RLock()


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def block_need(block: Block) -> tuple[str, str, int, int, int, str, torch.dtype]:
    """A block's shape as ``PlanNeeds.blocks`` holds it: (MLP kind, norm kind, dim, heads, MLP hidden, activation,
    dtype)."""
    gated = isinstance(block.mlp, GatedMLP)
    second = block.mlp.down_proj if gated else block.mlp.linear_fc2
    return ("gated" if gated else "plain", "rms" if isinstance(block.norm1, RMSNorm) else "layer",
            second.out_features, block.attn.num_heads, second.in_features, block.mlp.act, second.weight.dtype)


def plan_needs(module: nn.Module) -> PlanNeeds:
    """The linear shapes, attention shapes, MLPs and blocks of a module's layers, in its dtype."""
    linear = {(m.in_features, m.out_features, m.weight.dtype) for _, m in linear_layers(module)}
    attention = {(m.qkv.weight.dtype, m.num_heads, m.head_dim) for m in module.modules()
                 if isinstance(m, VisionAttention)}
    mlp = {("gated", m.down_proj.out_features, m.down_proj.in_features, m.act, m.down_proj.weight.dtype)
           if isinstance(m, GatedMLP) else
           ("plain", m.linear_fc2.out_features, m.linear_fc2.in_features, m.act, m.linear_fc2.weight.dtype)
           for m in module.modules() if isinstance(m, (GatedMLP, MLP))}
    blocks = {block_need(m) for m in module.modules() if isinstance(m, Block)}
    return PlanNeeds(frozenset(linear), frozenset(attention), frozenset(mlp), frozenset(blocks))


def pack_linears_(module: nn.Module, plan: CpuPlan) -> dict[str, int]:
    """Each linear's weight packed where the plan runs oneDNN for its shape, plain elsewhere; returns the count of
    layers per kernel. Weights off the CPU, in other dtypes or trainable stay plain."""
    counts = {"addmm": 0, "onednn": 0}
    for _, layer in linear_layers(module):
        weight = layer.weight
        runs_here = (weight.device.type == "cpu" and dtype_name(weight.dtype) in DTYPES and not weight.requires_grad
                     and not weight.is_meta)
        kernel = plan.linear_kernel(layer.in_features, layer.out_features, weight.dtype) if runs_here else "addmm"
        if kernel == "onednn" and not weight.is_mkldnn:
            try:
                packed = pack_weight(weight)
            except RuntimeError as e:  # a plan recorded on another CPU: oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT
                raise ConfigError(
                    f"the CPU plan of {plan.machine} runs {layer.in_features}x{layer.out_features} "
                    f"{dtype_name(weight.dtype)} linears on oneDNN, which this CPU cannot run "
                    f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}): load with "
                    f"cpu_kernels='auto' (this machine's plan), or resume the run on the kind of machine that "
                    f"recorded it") from e
            layer.weight = nn.Parameter(packed, requires_grad=False)
            del weight  # the plain tensor goes with its Parameter: the peak stays one layer above the tower
            return_freed_memory()
        elif kernel == "addmm" and weight.is_mkldnn:
            layer.weight = nn.Parameter(weight.to_dense(), requires_grad=weight.requires_grad)
        counts[kernel] += 1
    return counts


def unpack_linears_(module: nn.Module) -> bool:
    """Every packed weight plain again; returns whether there was one."""
    found = False
    for _, layer in linear_layers(module):
        weight = layer.weight
        if weight.is_mkldnn:
            layer.weight = nn.Parameter(weight.to_dense(), requires_grad=weight.requires_grad)
            found = True
    return found


def drop_packed_(module: nn.Module) -> None:
    """Each packed weight replaced by a storage-less meta tensor of its shape (freeing, not converting: unpacking
    first would allocate a copy just to drop it)."""
    for _, layer in linear_layers(module):
        weight = layer.weight
        if weight.is_mkldnn:
            layer.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                        requires_grad=False)


def dense_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A linear's ``state_dict`` post-hook: a packed weight handed out plain, as checkpoints and every other reader
    expect."""
    value = state_dict.get(prefix + "weight")
    if value is not None and value.is_mkldnn:
        state_dict[prefix + "weight"] = value.detach().to_dense()
