"""The activation memory of one CPU inference call: two buffers every block of its forwards reuses.

Why: on the CPU a fresh tensor larger than glibc's mmap threshold (up to 32 MiB) is mapped from the OS and
page-faulted on first write; a block makes about thirty N x D tensors, and at tens of thousands of tokens their
faults cost a large share of the forward (docs/benchmarks.md). Here they are paid once per call, and the peak is
lower than the reference's: x, ``narrow`` (N x D) and ``wide`` (N x max(3D, MLP width)), plus the attention output.

Math the reference does in fp32 on half-precision activations (norm statistics, rope) runs on row chunks through
two small fp32 ``scratch`` buffers (``fp32_chunks``): the same operations in the same order, so the same bits,
without an N x D fp32 copy per step.

The rule that makes reuse safe: every op writes into the buffer that does not hold its input (``take``), so no op
overwrites what it reads, and a value lives until the op after next consumes it; in-place steps (rope, activation,
gate * up) change only their own value. The residual stream belongs to the forward and is updated in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

# fp32 elements per scratch buffer (2 MiB) where the machine's plan has no measurement (a recorded plan of another
# tower): a chunk's temporaries stay in a server CPU's last-level cache, and the chunks are few enough that dispatch
# is not the cost. The plan measures each tower's own.
DEFAULT_SCRATCH_ELEMENTS = 1 << 19


class Workspace:
    """Two activation buffers of ``rows`` x ``dim`` and ``rows`` x ``wide`` elements, and two fp32 scratch buffers
    of ``scratch_elements`` each (at least the widest row that passes through them)."""

    def __init__(self, rows: int, dim: int, wide: int, dtype: torch.dtype, device: torch.device | str,
                 scratch_elements: int = DEFAULT_SCRATCH_ELEMENTS) -> None:
        self.buffers = (torch.empty(rows * dim, dtype=dtype, device=device),
                        torch.empty(rows * wide, dtype=dtype, device=device))
        self.scratch = torch.empty(2, scratch_elements, dtype=torch.float32, device=device)

    @classmethod
    def for_blocks(cls, rows: int, dim: int, mlp: str, mlp_hidden: int, dtype: torch.dtype,
                   device: torch.device | str, scratch_elements: int = DEFAULT_SCRATCH_ELEMENTS,
                   merge_unit: int = 1) -> Workspace:
        """The workspace of ``rows`` hidden states through blocks of this shape (``mlp``: "gated" or "plain") and,
        with ``merge_unit``, their mergers: ``wide`` holds qkv or the MLP's hidden rows, and the scratch at least
        the widest row that passes through it (rope's q and k, a merger's grouped rows)."""
        wide = max(3 * dim, mlp_hidden * (2 if mlp == "gated" else 1))
        return cls(rows, dim, wide, dtype, device, max(scratch_elements, 2 * dim, merge_unit * dim))

    def take(self, source: torch.Tensor, *shape: int) -> torch.Tensor:
        """A view of ``shape`` in a buffer that does not hold ``source`` and is large enough."""
        held, size = source.untyped_storage().data_ptr(), math.prod(shape)
        for buffer in self.buffers:
            if buffer.untyped_storage().data_ptr() != held and buffer.numel() >= size:
                return buffer[:size].view(shape)
        raise RuntimeError(f"no workspace buffer for a {shape} output")  # a bug: the sizes are fixed per tower

    def fp32_chunks(self, x: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """(rows, those rows of x in fp32, an fp32 scratch view of their shape) over x's rows: the reference's
        ``x.float()`` chunk by chunk. An fp32 x's rows are x's own (never write into them); any other dtype's are
        widened into the first scratch buffer."""
        shape = x.shape[1:]
        for chunk in self.row_chunks(x.shape[0], math.prod(shape)):
            size = (chunk.stop - chunk.start) * math.prod(shape)
            x32 = x[chunk] if x.dtype == torch.float32 else self.scratch[0, :size].view(-1, *shape).copy_(x[chunk])
            yield chunk, x32, self.scratch[1, :size].view(-1, *shape)

    def row_chunks(self, rows: int, width: int) -> list[slice]:
        """Slices of ``rows`` rows of ``width`` elements, each of which fits a scratch buffer."""
        step = max(1, self.scratch.shape[1] // width)
        return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
