"""The path a CUDA forward takes, proven on this CPU: the real-size towers run on the ``meta`` device (shapes only,
no data), as one pack with the varlen attention backend, the way ``forwards_on`` runs a pack off the CPU.

What a GPU would show as stalls shows here as a failure: a host sync (``.item()``, ``.tolist()`` or any read of a
device tensor's value), an op mixing host and device tensors, or a host-to-device copy after the blocks began.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qwenvl_vision import build_model
from qwenvl_vision.model.attention import torch_varlen_missing

VARLEN_OP = "_varlen_attn"  # the op torch.nn.attention.varlen.varlen_attn dispatches to


class DeviceDiscipline(TorchDispatchMode):
    """Fails on a host sync of a device tensor or an op mixing host and device tensors; records every
    host-to-device copy (by op count) and the op count at which the first block began."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.copies, self.first_block, self.names = 0, [], None, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        self.names.add(name)
        if name == "_local_scalar_dense" and tensors[0].device.type != "cpu":
            raise AssertionError(f"host sync: {func} on a {tensors[0].device} tensor")
        if name == "_to_copy" and tensors[0].device.type == "cpu" and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type != "cpu":
            self.copies.append(self.ops)
        elif name == "copy_" and tensors[0].device.type != "cpu" and tensors[1].device.type == "cpu":
            self.copies.append(self.ops)
        elif len({t.device.type for t in tensors}) > 1:
            raise AssertionError(f"{func} mixes devices: {[(t.device.type, tuple(t.shape)) for t in tensors]}")
        return func(*args, **kwargs)


class TensorsMadeOnTheDevice(TorchFunctionMode):
    """Tensors made from host data straight on a device (``torch.tensor(..., device=)`` and the like send no op
    through a dispatch mode): each is a host-to-device copy, recorded in ``discipline``."""

    MAKERS = {torch.tensor, torch.as_tensor, torch.asarray}

    def __init__(self, discipline: DeviceDiscipline) -> None:
        super().__init__()
        self.discipline = discipline

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.MAKERS and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            self.discipline.copies.append(self.discipline.ops)
        return func(*args, **kwargs)


def copies_and_outputs(preset: str, grids: list[tuple[int, int, int]]) -> tuple[list[int], int, tuple]:
    tower = build_model(preset, device="meta", dtype=torch.bfloat16, attn_impl="torch_varlen")
    assert tower.describe()["items"] == "one forward per pack"
    rows = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.empty(rows, tower.config.patch_dim, dtype=torch.bfloat16)  # on the host, as handed over
    discipline = DeviceDiscipline()
    tower.blocks[0].register_forward_pre_hook(lambda *_: setattr(discipline, "first_block", discipline.ops))
    with torch.no_grad(), TensorsMadeOnTheDevice(discipline), discipline:
        merged, levels = tower(pixel_values, grids)
    assert merged.device.type == "meta" and merged.shape == (rows // 4, tower.config.out_hidden_size)
    assert len(levels) == len(tower.config.deepstack_visual_indexes)
    assert VARLEN_OP in discipline.names and "_scaled_dot_product_flash_attention_for_cpu" not in discipline.names
    assert discipline.first_block is not None and all(op < discipline.first_block for op in discipline.copies), \
        f"host-to-device copies at ops {discipline.copies}, the first block at {discipline.first_block}"
    return discipline.copies, discipline.first_block, merged.shape


@pytest.mark.parametrize("preset", ["qwen2.5-vl-3b", "qwen3-vl-8b"])
def test_a_real_size_tower_runs_one_pack_without_host_syncs_and_copies_only_before_the_blocks(preset):
    """A pack of photos, a 2-frame video and a grid larger than Qwen3's position table: no host sync, no mixed
    devices, every host-to-device copy before the first block, and as many copies for one item as for four or
    sixteen (the per-grid plans are concatenated on the host and moved once; rope is computed on the device from
    integer positions)."""
    if torch_varlen_missing() is not None:
        pytest.skip(torch_varlen_missing())
    pack = [(1, 32, 32), (1, 34, 28), (2, 20, 16), (1, 100, 100)]
    copies, _, _ = copies_and_outputs(preset, pack)
    alone, _, _ = copies_and_outputs(preset, pack[:1])
    assert 0 < len(copies) == len(alone) <= 7, (copies, alone)
    # Many small images: the sdpa backend would gather their frames and windows (index copies); the fused kernel
    # reads cu_seqlens only, so the pack copies no more than one image does.
    many, _, _ = copies_and_outputs(preset, [(1, 6, 10), (1, 4, 4)] * 8)
    assert len(many) == len(alone), (many, alone)
