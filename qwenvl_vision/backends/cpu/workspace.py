"""The activation memory of one CPU inference call: two buffers every block of its forwards reuses.

Why: on the CPU a fresh tensor larger than glibc's mmap threshold (up to 32 MiB) is mapped from the OS and
page-faulted on first write; a block makes about thirty N x D tensors, and at tens of thousands of tokens their
faults cost a large share of the forward (docs/benchmarks.md). Here they are paid once per call, and the peak is
lower than the reference's: x, ``narrow`` (N x D) and ``wide`` (N x max(3D, MLP width)), plus the attention output.

The rule that makes reuse safe: every op writes into the buffer that does not hold its input (``take``), so no op
overwrites what it reads (but the residual add fused with the next norm, which writes it row by row over the
attention output it consumes), and a value lives until the op after next consumes it; in-place steps (rope,
activation, gate * up) change only their own value. The residual stream belongs to the forward and is updated in place.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Two activation buffers: ``rows`` x ``dim`` elements, and ``rows`` x ``wide`` for qkv or the hidden rows of an
    MLP of this shape (``mlp``: "gated" or "plain")."""

    def __init__(self, rows: int, dim: int, mlp: str, mlp_hidden: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        wide = max(3 * dim, mlp_hidden * (2 if mlp == "gated" else 1))
        self.buffers = (torch.empty(rows * dim, dtype=dtype, device=device),
                        torch.empty(rows * wide, dtype=dtype, device=device))

    def take(self, source: torch.Tensor, *shape: int) -> torch.Tensor:
        """A view of ``shape`` in a buffer that does not hold ``source`` and is large enough."""
        held, size = source.untyped_storage().data_ptr(), math.prod(shape)
        for buffer in self.buffers:
            if buffer.untyped_storage().data_ptr() != held and buffer.numel() >= size:
                return buffer[:size].view(shape)
        raise RuntimeError(f"no workspace buffer for a {shape} output")  # a bug: the sizes are fixed per tower
