"""A tower's linears in the layout the machine's plan chose: oneDNN's prepacked weight (``PackedLinear``), or plain.

Packing swaps a layer's class in place (as ``torch.nn.utils.parametrize`` does) and drops the plain weight (one
copy, not two: the load peak stays one layer above the tower); the module object stays, with its hooks, its bias
and every reference to it. ``PackedLinear`` keeps torch's module contract on its own class, as torch's packed
modules (``torch.ao.nn.quantized.Linear``) do: ``state_dict`` gives the plain weight, and a load or a conversion
that changes the weight (``.to()`` another dtype or device, ``to_empty``) makes it a plain ``nn.Linear`` first, which
the backend packs again at its next call where its plan says so; one that changes nothing keeps it packed. A weight
keeps its ``requires_grad``; packing replaces its Parameter object (an optimizer built before holds the old one)."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from ...errors import ConfigError, first_line
from ...model.cache import return_freed_memory
from ...model.layers import MLP, Block, GatedMLP, RMSNorm, VisionAttention
from .kernels import pack_weight, packed_linear
from .plan import DTYPES, CpuPlan, PlanNeeds, dtype_name

# Packing and unpacking of every tower take turns (no tensor or model is held by it).
PACKING_LOCK = threading.RLock()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is in oneDNN's blocked layout (``kernels.pack_weight``), for inference: made by
    ``pack_`` from a plain layer, never constructed (see the module docstring)."""

    @staticmethod
    def pack_(layer: nn.Linear) -> PackedLinear:
        """``layer`` itself, its weight packed and its plain weight dropped."""
        packed = pack_weight(layer.weight)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.__class__ = PackedLinear
        return layer

    def unpack_(self, weight: torch.Tensor | None = None) -> nn.Linear:
        """This layer as a plain ``nn.Linear`` again, on its weight made dense (or on ``weight``)."""
        packed = self.weight
        plain = packed.to_dense() if weight is None else weight
        self.weight = nn.Parameter(plain, requires_grad=packed.requires_grad)
        self.__class__ = nn.Linear
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight.detach().to_dense()  # checkpoints and readers expect plain

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        # A packed tensor cannot be copied into: the layer loads as the plain layer it packs.
        self.unpack_()._load_from_state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        # oneDNN's tensor cannot be deep-copied: the copy is the plain layer (its tower's backend packs it again).
        weight = self.weight
        memo[id(weight)] = nn.Parameter(weight.detach().to_dense(), requires_grad=weight.requires_grad)
        clone = memo[id(self)] = nn.Linear.__new__(nn.Linear)
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _apply(self, fn, recurse: bool = True):
        # oneDNN's layout supports no conversion: one that returns a tensor as it is (``.to()`` of the same device and
        # dtype, ``share_memory_``) keeps the weight packed, as it is (not shared), and still applies to the bias; one
        # to meta frees the weight without making it dense first; any other (``to_empty`` too) converts the plain
        # weight it packs.
        probe = torch.empty(0, dtype=self.weight.dtype)
        target = fn(probe)
        if target is probe:
            if self.bias is not None:  # in place (``share_memory_``), as torch's _apply does: no new Parameter
                self.bias.data = fn(self.bias)
            return self
        if target.is_meta:
            layer = self.unpack_(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"))
        else:
            layer = self.unpack_()
        return nn.Linear._apply(layer, fn, recurse)


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def mlp_need(mlp: MLP | GatedMLP) -> tuple[str, int, int, str, torch.dtype]:
    """An MLP's shape as ``PlanNeeds.mlp`` holds it: (kind, dim, hidden, activation, dtype)."""
    gated = isinstance(mlp, GatedMLP)
    second = mlp.down_proj if gated else mlp.linear_fc2
    return "gated" if gated else "plain", second.out_features, second.in_features, mlp.act, second.weight.dtype


def block_need(block: Block) -> tuple[str, str, int, int, int, str, torch.dtype]:
    """A block's shape as ``PlanNeeds.blocks`` holds it: (MLP kind, norm kind, dim, heads, MLP hidden, activation,
    dtype)."""
    kind, dim, hidden, act, dtype = mlp_need(block.mlp)
    return kind, "rms" if isinstance(block.norm1, RMSNorm) else "layer", dim, block.attn.num_heads, hidden, act, dtype


def plan_needs(module: nn.Module) -> PlanNeeds:
    """The linear shapes, attention shapes, MLPs and blocks of a module's layers, in its dtype."""
    linear = {(m.in_features, m.out_features, m.weight.dtype) for _, m in linear_layers(module)}
    attention = {(m.qkv.weight.dtype, m.num_heads, m.head_dim) for m in module.modules()
                 if isinstance(m, VisionAttention)}
    mlp = {mlp_need(m) for m in module.modules() if isinstance(m, (GatedMLP, MLP))}
    blocks = {block_need(m) for m in module.modules() if isinstance(m, Block)}
    return PlanNeeds(frozenset(linear), frozenset(attention), frozenset(mlp), frozenset(blocks))


def pack_linears_(module: nn.Module, plan: CpuPlan) -> list[PackedLinear]:
    """Each linear packed where the plan runs oneDNN for its shape, plain elsewhere; returns the packed ones.
    Weights off the CPU, in other dtypes or trainable stay plain."""
    packed = []
    for _, layer in linear_layers(module):
        weight = layer.weight
        runs_here = (weight.device.type == "cpu" and dtype_name(weight.dtype) in DTYPES and not weight.requires_grad
                     and not weight.is_meta)
        kernel = plan.linear_kernel(layer.in_features, layer.out_features, weight.dtype) if runs_here else "addmm"
        if kernel == "onednn" and not isinstance(layer, PackedLinear):
            try:
                PackedLinear.pack_(layer)
            except RuntimeError as e:  # a plan recorded on another CPU: oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT
                raise ConfigError(
                    f"the CPU plan of {plan.machine} runs {layer.in_features}x{layer.out_features} "
                    f"{dtype_name(weight.dtype)} linears on oneDNN, which this CPU cannot run "
                    f"({first_line(e)}): load with "
                    f"cpu_kernels='auto' (this machine's plan), or resume the run on the kind of machine that "
                    f"recorded it") from e
            del weight  # the plain tensor goes with its Parameter: the peak stays one layer above the tower
            return_freed_memory()
        elif kernel == "addmm" and isinstance(layer, PackedLinear):
            layer.unpack_()
        if isinstance(layer, PackedLinear):
            packed.append(layer)
    return packed


def unpack_linears_(module: nn.Module) -> None:
    """Every packed layer a plain ``nn.Linear`` again."""
    for _, layer in linear_layers(module):
        if isinstance(layer, PackedLinear):
            layer.unpack_()
