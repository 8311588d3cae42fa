"""The CPU kernels the backend chooses between: oneDNN's prepacked linear, and attention by two fp32 GEMMs.

Reference: the calls inductor's CPU freezing pass emits for a frozen ``nn.Linear``
(torch/_inductor/fx_passes/mkldnn_fusion.py): ``torch.ops.mkldnn._reorder_linear_weight(w, rows)`` once (the rows
are a blocking hint: any row count runs), then ``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [],
"")`` per call. Its fp32 result is fp32-accurate (relative error against float64 ~5e-7, addmm's ~2.5e-7), not
addmm's bits; in bf16 torch's addmm is a oneDNN matmul itself, with addmm's bits where the plain and the packed
weight take the same kernel, else within bf16 rounding.

oneDNN has no ``out=`` form: a result that must land in the workspace is computed on balanced row chunks (no short
tail: a call of a few rows runs slowly) whose fresh outputs stay in cache and below glibc's mmap threshold
(``packed_chunks``), each consumed or copied as it comes.

``packed_linear``'s epilogue computes an activation on the GEMM's fp32 accumulator: in bf16 the linear's result
is not rounded before the activation (one rounding fewer than transformers' Linear then activation: closer to
float64, not its bits); in fp32 oneDNN's activation is within an ulp or two of torch's.
"""

from __future__ import annotations

import math
import timeit
from collections.abc import Callable, Iterator

import torch

# Fresh output per oneDNN call on row chunks where the machine's plan has no measurement for a tower's block shape
# (a recorded plan of another tower): small enough to stay in a server CPU's last-level cache until it is read
# again and far under glibc's mmap threshold (no page faults on reused heap memory).
DEFAULT_CHUNK_BYTES = 4 << 20


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs a linear in ``dtype`` at all (bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT:
    an AVX2-only CPU has neither); a reorder of a tiny weight tells, in microseconds."""
    try:
        pack_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque ``mkldnn`` tensor); ``rows`` is a blocking hint."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def balanced_chunks(rows: int, step: int) -> list[slice]:
    """Slices of at most ``step`` rows covering ``rows``, as equal as can be (no one-row tail)."""
    count = max(1, math.ceil(rows / step))
    size = math.ceil(rows / count)
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def packed_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_bytes: int
                  ) -> Iterator[tuple[slice, torch.Tensor]]:
    """``x @ weight.T + bias`` with a packed weight as (rows, fresh result of those rows) pairs, ``chunk_bytes`` of
    output at a time, each computed when the caller asks for it (``forward.add_linear_`` relies on it)."""
    step = max(1, chunk_bytes // (weight.shape[0] * x.element_size()))
    for rows in balanced_chunks(x.shape[0], step):
        yield rows, packed_linear(x[rows], weight, bias)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  epilogue: tuple[str, str] = ("none", "")) -> torch.Tensor:
    """``x @ weight.T + bias`` with a packed weight, a fresh result; with an ``epilogue`` (``_linear_pointwise``'s
    attr and algorithm, ``forward.ACTIVATIONS``) the activation of it, computed in the GEMM's epilogue."""
    attr, algorithm = epilogue
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``attention.sdpa_batched``'s result, one (segment, head) at a time by two fp32 GEMMs and a softmax in place.

    Where one head's L x L fp32 scores stay in cache between the GEMMs and the softmax, and oneDNN's GEMM runs
    well above the CPU's SDPA kernel, this is faster; the plan measures where (``plan.CpuPlan``). Everything is
    computed in fp32 (bf16 inputs are widened exactly) and rounded once into the output, so in bf16 it is closer to
    float64 than SDPA, whose probabilities are rounded to bf16. Deviation: the scale multiplies q before the
    product, not the scores after. Memory: one head's scores at a time (L^2 fp32).
    """
    length = q.shape[0] // count
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    for segment in range(count):
        rows = slice(segment * length, (segment + 1) * length)
        for head in range(q.shape[1]):
            # Contiguous fp32 operands: oneDNN's linear on a strided weight is orders of magnitude slower.
            q32 = q[rows, head].float() * scale
            k32 = k[rows, head].float().contiguous()
            v32_t = v[rows, head].t().float().contiguous()
            scores = torch.ops.mkldnn._linear_pointwise(q32, k32, None, "none", [], "")  # q32 @ k32.T
            torch.ops.aten._softmax.out(scores, -1, False, out=scores)
            out[rows, head] = torch.ops.mkldnn._linear_pointwise(scores, v32_t, None, "none", [], "")
    return out


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best of ``repeats`` timed calls after one untimed warm-up (the benchmarks time kernels the same way)."""
    fn()
    return min(timeit.repeat(fn, repeat=repeats, number=1))
