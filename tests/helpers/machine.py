"""Probes of the machine at hand, for tests whose bitwise claims hold on some CPUs' kernels and not on others.

A test that compares two kernels asserts the reference's tolerance per item everywhere, and bits only where the
probe here shows this machine's kernels give them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwenvl_vision.backends.cpu.kernels import balanced_chunks, onednn_packs, pack_weight, packed_linear
from qwenvl_vision.backends.cpu.machine import native_kernels
from qwenvl_vision.backends.cpu.packing import linear_layers, plan_needs
from qwenvl_vision.backends.cpu.plan import CpuPlan


def packed_gives_addmm_bits(shapes: list[tuple[int, int]], dtype: torch.dtype, rows: list[int],
                            steps: list[int]) -> bool:
    """Whether oneDNN's prepacked linear, on balanced row chunks of each of ``steps`` rows (and whole), gives
    bitwise what one addmm gives, for calls of each of ``rows`` rows, for every (in, out) of ``shapes`` in
    ``dtype``, on random operands: in bf16 true on CPUs where both run one oneDNN kernel, false where the plain and
    the packed weight take different ones."""
    generator = torch.Generator().manual_seed(0)
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype) / in_features**0.5
        bias = torch.randn(out_features, generator=generator).to(dtype)
        packed = pack_weight(weight)
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            whole = torch.addmm(bias, x, weight.t())
            for step in (*steps, count):
                if not all(torch.equal(packed_linear(x[chunk], packed, bias), whole[chunk])
                           for chunk in balanced_chunks(count, step)):
                    return False
    return True


def skip_unless_onednn_runs(dtype: torch.dtype) -> None:
    """Skip the test, saying why, where this CPU's oneDNN cannot pack a linear in ``dtype`` (bf16 needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT: an AVX2-only CPU has neither); its claims are about oneDNN's kernels, which do not run here."""
    if not onednn_packs(dtype):
        pytest.skip(f"this CPU's oneDNN cannot pack a {str(dtype).removeprefix('torch.')} linear (an AVX2-only CPU "
                    f"cannot in bf16): the claim is about oneDNN's kernels")


def forced_plan(model: torch.nn.Module, linear: str = "addmm", attention: str = "sdpa",
                mlp_rows: int = 512, chunk_bytes: int | None = None, elementwise: str = "aten") -> CpuPlan:
    """A CPU plan that runs every linear of ``model`` on ``linear``, every attention segment on ``attention``, every
    MLP with both linears packed ``mlp_rows`` rows at a time and, where given, every packed linear ``chunk_bytes``
    of output per call, its elementwise steps on ``elementwise`` ("native": skipped where they cannot be built),
    whatever this machine would
    measure: for tests of one kernel's numbers. A test forcing oneDNN where this CPU cannot run it in the model's dtype
    is skipped (``skip_unless_onednn_runs``)."""
    if linear == "onednn":
        skip_unless_onednn_runs(next(model.parameters()).dtype)
    if elementwise == "native" and native_kernels() is None:
        pytest.skip("no C compiler builds the native CPU kernels here (the warning says why)")
    needs = plan_needs(model)
    return CpuPlan("forced", dict.fromkeys(needs.keys("linear"), linear),
                   dict.fromkeys(needs.keys("attention"), attention), dict.fromkeys(needs.keys("mlp"), mlp_rows),
                   {} if chunk_bytes is None else dict.fromkeys(needs.keys("blocks"), chunk_bytes),
                   dict.fromkeys(needs.keys("blocks"), elementwise))


def addmm_ignores_row_stride(model: torch.nn.Module, rows: int, dtype: torch.dtype) -> bool:
    """Whether this machine's addmm gives the same bits for every linear of ``model`` on an input whose rows are a
    strided view (as the CPU backend hands a gated MLP's hidden rows, and q/k/v, to the next op) as on the same rows
    contiguous: on most CPUs' GEMM kernels the operand's stride does not change the arithmetic."""
    generator = torch.Generator().manual_seed(0)
    for _, layer in linear_layers(model):
        wide = torch.randn(rows, 2 * layer.in_features, generator=generator).to(dtype)
        x = wide[:, : layer.in_features]
        weight = layer.weight.detach().to(dtype)
        bias = None if layer.bias is None else layer.bias.detach().to(dtype)
        if not torch.equal(F.linear(x, weight, bias), F.linear(x.contiguous(), weight, bias)):
            return False
    return True
