"""How a tower's call runs: the seam between the tower and what executes it.

``VisionTower.forward`` asks its ``Backend`` once per call for an ``Execution``: the forwards the call's items run as,
and how each forward's blocks and mergers run. ``ReferenceBackend`` (a tower no backend was attached to) runs the
modules' own forward; the package's builders attach the CPU backend (``qwenvl_vision.backends.cpu``) to a tower on
the CPU, which this module does not know. Every backend runs a call's items as ``forwards_on`` says, so an item's
bits on the CPU never depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import InputError
from .attention import SegmentPlan
from .layers import AttentionInputs, Block, PatchMerger

# A tower is a ``tower.VisionTower``, typed here as the module it is: tower.py imports this module.
Tower = nn.Module

Grid = tuple[int, int, int]


def check_grids(grid_thw: Any, merge: int, what: str) -> list[Grid]:
    """An ``(n, 3)`` table of patch grids (a tensor or lists) as a tower makes them: positive integers, h and w
    whole merged tokens; ``what``: where they came from, for the one-line InputError."""
    if not isinstance(merge, int) or merge < 1:  # a hand-built EncodedItems' merge_size
        raise InputError(f"{what}: merge size {merge!r} is not a positive integer")
    try:
        table = torch.as_tensor(grid_thw)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"{what}: grid_thw is not an (n, 3) table of integers ({e})") from None
    if table.numel() and (table.dim() != 2 or table.shape[1] != 3 or table.is_floating_point() or table.is_complex()
                          or table.dtype == torch.bool):
        raise InputError(f"{what}: grid_thw of shape {tuple(table.shape)} and dtype {table.dtype}, not an (n, 3) "
                         f"table of integers")
    grids = [tuple(row) for row in table.reshape(-1, 3).tolist()]
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise InputError(f"{what}, item {i}: grid {(t, h, w)} is not a tower's (positive, h and w multiples of "
                             f"the merge size {merge})")
    return grids


def one_forward(pixel_values: torch.Tensor, grids: list[Grid]) -> list[tuple[torch.Tensor, list[Grid]]]:
    """The pack as one forward (on CUDA: a pack of small images alone would be launch-bound; an item agrees across
    batchings within its dtype's rounding)."""
    return [(pixel_values, grids)]


def one_forward_per_item(pixel_values: torch.Tensor, grids: list[Grid]) -> list[tuple[torch.Tensor, list[Grid]]]:
    """Each item's rows as its own forward, contiguous and 64-byte aligned (copied only where they are not).

    Why one forward per item: an item's result must not depend on the items beside it (every output path, resume,
    rank and Ray actor batches differently and promises the same tensors). On some CPUs a GEMM row's bits depend on
    the call's row count or on the row's place in it (and a threaded elementwise kernel's vector/scalar split falls
    where the call's length puts it), so each item runs alone: the same calls on the same rows whatever its
    neighbours, at a given thread count and kernel choice. Its GEMMs are one item's rows instead of the pack's,
    which costs little at the towers' sizes (docs/benchmarks.md). Why aligned: an item's rows cut from a pack start
    where its neighbours end, and some CPU kernels round by the address of their input (MKL without its
    reproducibility mode)."""
    rows = pixel_values.split([t * h * w for t, h, w in grids])
    return [(item if item.is_contiguous() and item.data_ptr() % 64 == 0
             else item.clone(memory_format=torch.contiguous_format), [grid]) for item, grid in zip(rows, grids)]


def forwards_on(device: torch.device) -> Callable:
    """How a call's items run where the weights are: on the CPU one forward each, elsewhere the pack as one."""
    return one_forward_per_item if device.type == "cpu" else one_forward


class Execution(Protocol):
    """How one call runs: the forwards its items run as ((rows, grids) each, in input order), and each forward's
    blocks and mergers."""

    name: str
    forwards: list[tuple[torch.Tensor, list[Grid]]]

    def attention_inputs(self, rope: tuple[torch.Tensor, torch.Tensor], segments: SegmentPlan) -> AttentionInputs: ...
    def block(self, block: Block, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor: ...
    def merger(self, merger: PatchMerger, x: torch.Tensor) -> torch.Tensor: ...


class Backend(Protocol):
    """What runs one tower's calls: ``execution`` once per call, ``forwards`` how a call's items run (a backend that
    runs them otherwise than ``forwards_on`` says gives up the per-item bits on the CPU), ``describe`` how calls
    run from the same state (the keys ``ReferenceBackend.describe`` gives), and ``release`` the modules back as the
    model defines them (before compiling, another backend, freeing)."""

    def execution(self, tower: Tower, pixel_values: torch.Tensor, grids: list[Grid]) -> Execution: ...
    def forwards(self, tower: Tower) -> Callable: ...
    def release(self, tower: Tower) -> None: ...
    def describe(self, tower: Tower) -> dict: ...


class ReferenceExecution:
    """The modules' own forward (``layers.py``, the math) with the tower's attention backend, over ``forwards``."""

    name = "reference"

    def __init__(self, attend: Callable, forwards: list[tuple[torch.Tensor, list[Grid]]]) -> None:
        self.attend = attend
        self.forwards = forwards

    def attention_inputs(self, rope: tuple[torch.Tensor, torch.Tensor], segments: SegmentPlan) -> AttentionInputs:
        return AttentionInputs(rope, segments, self.attend)

    def block(self, block: Block, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        return block(x, inputs)

    def merger(self, merger: PatchMerger, x: torch.Tensor) -> torch.Tensor:
        return merger(x)


class ReferenceBackend:
    """Every call on the modules' own forward, its items as ``forwards_on`` says: a tower no backend was attached
    to. ``describe`` gives the keys every backend gives."""

    def execution(self, tower: Tower, pixel_values: torch.Tensor, grids: list[Grid]) -> ReferenceExecution:
        return ReferenceExecution(tower.attention_backend(), self.forwards(tower)(pixel_values, grids))

    def forwards(self, tower: Tower) -> Callable:
        return forwards_on(tower.patch_embed.proj.weight.device)

    def release(self, tower: Tower) -> None:
        pass

    def describe(self, tower: Tower) -> dict:
        return {"items": items_name(self.forwards(tower)), "execution": "reference", "cpu_plan": None,
                "linear_kernels": {"addmm": sum(isinstance(m, nn.Linear) for m in tower.modules()), "onednn": 0}}


def items_name(forwards: Callable) -> str:
    """``describe``'s words for how a call's items run."""
    return "one forward each" if forwards is one_forward_per_item else "one forward per pack"
