"""The probes that choose this machine's CPU plan: each times the kernels as the backend calls them, on random
operands of the shape (the rate depends on the shape, not on the values), and keeps the default unless another
choice ran clearly faster. ``measure`` turns what towers need into plan entries; ``machine`` stores them.
"""

from __future__ import annotations

import functools
import warnings
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from ...model.attention import SegmentPlan, sdpa_batched
from ...model.layers import MLP, Block, GatedMLP, RMSNorm
from .forward import CpuExecution
from .kernels import (
    DEFAULT_CHUNK_BYTES,
    best_seconds,
    gemm_attention,
    onednn_linear_available,
    onednn_packs,
    pack_weight,
    packed_chunks,
)
from .native import NativeKernels
from .packing import PackedLinear
from .plan import DEFAULT_MLP_ROWS, PROBE_LENGTHS, CpuPlan, PlanNeeds, dtype_name, plan_key, timed
from .workspace import Workspace

PROBE_TOKENS = 2048  # tokens per attention probe (segments of a length batched up to it): rates, not totals
# Photo-sized items (each runs as its own forward), of no particular row count: oneDNN's rate for a shape at some
# counts (1,024 among them) is far from its rate at those around them. An MLP is timed through distinct layers, each
# read from memory once per pass as a tower's are where the last-level cache holds fewer (one stays in cache).
LINEAR_PROBE_ROWS, MLP_PROBE_ROWS, MLP_PROBE_LAYERS, BLOCK_PROBE_SEGMENTS = (600, 800, 1000), 1000, 4, (1000,)
# The search spaces of the sizes, each holding its default: an MLP's block rows (1024: one block of an item) and a
# packed linear's output bytes per call, from well inside a core's private cache to beyond a small last-level cache.
MLP_ROW_CHOICES = (128, 256, 512, 1024)
CHUNK_CHOICES = (1 << 20, 2 << 20, 4 << 20, 8 << 20)
# How much faster oneDNN must time than addmm to be chosen, per dtype (for a lone linear, and for a whole MLP
# against its linears' lone choices). fp32: 10%, since oneDNN's rounding is not the reference's; bf16: 5% slower
# still wins, since both round alike there and a packed linear's chunks are consumed while in cache.
ONEDNN_FASTER_BY = {"float32": 1.10, "bfloat16": 0.95}
# Near the best, an MLP's block rows, a block's chunk size and elementwise steps time alike within noise (they may
# move a last fp32 bit, so a plan records them): a choice other than the default only where it ran this much faster.
SIZE_FASTER_BY = 1.05
# Raised whenever the probes would choose differently on the same machine (what they time, their margins): a cache
# file of older probes is then another machine key, measured afresh (a recorded run's plan runs as recorded).
PROBE_REVISION = 5


def warn(message: str) -> None:
    warnings.warn(f"qwenvl-vision: {message}", RuntimeWarning, stacklevel=3)


def measure_linear(in_features: int, out_features: int, dtype: torch.dtype, repeats: int = 3) -> str:
    """The kernel for a (rows, in) x (in, out) product in ``dtype`` here: addmm into a reused output, or oneDNN's
    prepacked linear on row chunks the next step reads as they come (as the backend calls each)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(max(LINEAR_PROBE_ROWS), in_features, generator=generator).to(dtype)
    bias, out = torch.zeros(out_features, dtype=dtype), torch.empty(max(LINEAR_PROBE_ROWS), out_features, dtype=dtype)

    def seconds(linear: Callable[[torch.Tensor, torch.Tensor], object]) -> float:  # summed over the row counts
        return sum(best_seconds(lambda r=r: linear(x[:r], out[:r]), repeats) for r in LINEAR_PROBE_ROWS)

    addmm_s = seconds(lambda x, out: torch.addmm(bias, x, weight.t(), out=out))
    try:
        packed = pack_weight(weight)
        onednn_s = seconds(lambda x, _: deque(packed_chunks(x, packed, bias, DEFAULT_CHUNK_BYTES), maxlen=0))
    except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype: torch's own kernel runs
        warn(f"oneDNN's linear failed for {in_features}x{out_features} {dtype_name(dtype)} ({e}); using addmm")
        return "addmm"
    return "onednn" if onednn_s * ONEDNN_FASTER_BY[dtype_name(dtype)] < addmm_s else "addmm"


def measure_block(need: tuple, plan: CpuPlan, native: NativeKernels | None, repeats: int = 3) -> tuple[int, str]:
    """(output bytes per packed linear call of CHUNK_CHOICES, "aten" or "native" elementwise steps) with which one
    of the tower's blocks ran fastest here, on ``plan``'s kernels, as the backend runs it: BLOCK_PROBE_SEGMENTS
    frames of random tokens through a block of random weights. The elementwise steps are chosen first, at the default
    chunk by ``fastest``, native (one pass a step) by default, the modules' ops where they do not build; then the
    chunk by ``fastest`` (the default where no linear runs packed)."""
    mlp, norm, dim, heads, hidden, act, dtype = need
    generator = torch.Generator().manual_seed(0)  # never the caller's random state
    with torch.device("meta"):
        block = Block(dim, heads, hidden, act, norm, mlp)
    block = random_module(block, dtype, generator,
                          lambda linear: plan.linear_kernel(linear.in_features, linear.out_features, dtype) == "onednn")
    rows = sum(BLOCK_PROBE_SEGMENTS)
    start = torch.randn(rows, dim, generator=generator).to(dtype)
    x = torch.empty_like(start)
    angles = torch.rand(rows, dim // heads, generator=generator) * 6
    segments = SegmentPlan.from_lengths(list(BLOCK_PROBE_SEGMENTS), "cpu")

    def seconds(chunk: int, kernels: str) -> float:
        run = CpuExecution(plan, Workspace(rows, dim, mlp, hidden, dtype, "cpu"), chunk,
                           native=native if kernels == "native" else None)
        inputs = run.attention_inputs((angles.cos(), angles.sin()), segments)
        return best_seconds(lambda: run.block(block, x.copy_(start), inputs), repeats)

    kernels = fastest({k: seconds(DEFAULT_CHUNK_BYTES, k) for k in ("aten", "native")}, "native") if native else "aten"
    chunk = fastest({c: seconds(c, kernels) for c in CHUNK_CHOICES}, DEFAULT_CHUNK_BYTES) \
        if any(isinstance(m, PackedLinear) for m in block.modules()) else DEFAULT_CHUNK_BYTES
    return chunk, kernels


def fastest(seconds: dict[int | str, float], default: int | str) -> int | str:
    """The fastest choice, or ``default`` unless that one is SIZE_FASTER_BY faster."""
    best = min(seconds, key=seconds.get)
    return best if seconds[best] * SIZE_FASTER_BY < seconds.get(default, float("inf")) else default


def measure_attention(dtype: torch.dtype, heads: int, head_dim: int, repeats: int = 2) -> dict[str, str]:
    """The attention path per probe length for segments of (heads, head_dim) in ``dtype`` here: SDPA or the GEMM
    form, whichever ran faster on PROBE_TOKENS tokens of such segments."""
    generator = torch.Generator().manual_seed(0)
    choices = {}
    for length in PROBE_LENGTHS:
        count = max(1, PROBE_TOKENS // length)
        q, k, v = (torch.randn(count * length, heads, head_dim, generator=generator).to(dtype) for _ in range(3))
        operands = (q, k, v, count, head_dim**-0.5, torch.empty_like(q))
        try:
            sdpa_s = best_seconds(functools.partial(sdpa_batched, *operands), repeats)
            gemm_s = best_seconds(functools.partial(gemm_attention, *operands), repeats)
        except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype: SDPA runs
            warn(f"GEMM attention failed for {heads}x{head_dim} {dtype_name(dtype)} ({e}); using SDPA")
            sdpa_s, gemm_s = 0.0, float("inf")
        choices[plan_key("attention", dtype, heads, head_dim, length)] = "gemm" if gemm_s < sdpa_s else "sdpa"
    return choices


def probe_mlps(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype, packs: tuple[bool, bool],
               generator: torch.Generator) -> list[nn.Module]:
    """MLP_PROBE_LAYERS MLPs of random weights of this shape, their (first, second) linears packed as ``packs`` says."""
    with torch.device("meta"):
        mlps = [(GatedMLP if kind == "gated" else MLP)(dim, hidden, act) for _ in range(MLP_PROBE_LAYERS)]
    return [random_module(mlp, dtype, generator, dict(zip(mlp.children(), packs, strict=True)).get) for mlp in mlps]


def random_module(module: nn.Module, dtype: torch.dtype, generator: torch.Generator,
                  packed: Callable[[nn.Linear], bool]) -> nn.Module:
    """``module`` (made on the meta device) on the CPU in ``dtype``: its linears of random weights (scaled as trained
    ones are) and zero biases, packed for oneDNN where ``packed`` says, its norms the identity."""
    module = module.to_empty(device="cpu").requires_grad_(False)
    for layer in list(module.modules()):
        if isinstance(layer, nn.Linear):
            weight = (torch.randn(layer.weight.shape, generator=generator) / layer.in_features**0.5).to(dtype)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.bias = nn.Parameter(torch.zeros(layer.out_features, dtype=dtype), requires_grad=False)
            if packed(layer):
                PackedLinear.pack_(layer)
        elif isinstance(layer, (RMSNorm, nn.LayerNorm)):
            layer.weight = nn.Parameter(torch.ones(layer.weight.shape, dtype=dtype), requires_grad=False)
            if getattr(layer, "bias", None) is not None:
                layer.bias = nn.Parameter(torch.zeros(layer.bias.shape, dtype=dtype), requires_grad=False)
    return module


def measure_mlp(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype, packs: tuple[bool, bool],
                native: NativeKernels | None = None, repeats: int = 2) -> tuple[bool, int]:
    """(whether the MLP runs both linears packed, its rows per block of MLP_ROW_CHOICES by ``fastest``) as it ran
    fastest here, as the backend runs it. With ``packs`` (the lone linears' choices) not both packed, it is timed that
    way and with both packed (which lets the MLP run by row blocks, unseen by a lone linear's timing), both packed
    taken by ONEDNN_FASTER_BY's preference. The activation runs on the ``native`` kernels where they build (as the
    block's probe then almost always chooses)."""
    generator = torch.Generator().manual_seed(0)  # never the caller's random state
    x = torch.randn(MLP_PROBE_ROWS, dim, generator=generator).to(dtype)
    residual = torch.zeros_like(x)
    workspace = Workspace(MLP_PROBE_ROWS, dim, kind, hidden, dtype, "cpu")
    shape = kind, dim, hidden, act, dtype
    key = plan_key("mlp", *shape)

    def seconds(mlps: list[nn.Module], rows: int) -> float:
        run = CpuExecution(CpuPlan("probe", mlp={key: rows}), workspace, DEFAULT_CHUNK_BYTES, native=native)
        return best_seconds(lambda: [run.mlp(mlp, x, residual) for mlp in mlps], repeats)

    chosen_s = None if all(packs) else seconds(probe_mlps(*shape, packs, generator), DEFAULT_MLP_ROWS)  # freed first
    both = probe_mlps(*shape, (True, True), generator)
    if chosen_s is not None and seconds(both, DEFAULT_MLP_ROWS) * ONEDNN_FASTER_BY[dtype_name(dtype)] >= chosen_s:
        return False, DEFAULT_MLP_ROWS
    return True, fastest({rows: seconds(both, rows) for rows in MLP_ROW_CHOICES}, DEFAULT_MLP_ROWS)


def measure(needs: PlanNeeds, machine: str, known: CpuPlan | None = None, native: NativeKernels | None = None
            ) -> CpuPlan:
    """A plan of ``needs`` measured now, keeping ``known``'s choices (a process may have run with them): linears and
    attention timed alone, then each MLP whole (``measure_mlp``), then each block's sizes on the kernels chosen
    before. Without oneDNN's linear the kernels are torch's, untimed."""
    known = known or CpuPlan(machine)
    with torch.inference_mode(False), torch.no_grad():
        # Without oneDNN's linear, or in a dtype its oneDNN cannot pack, torch's kernels run (no probe, no warning).
        onednn = onednn_linear_available()
        packs_here = {d: onednn and onednn_packs(d) for *_, d in timed(needs.linear)}
        linear = {plan_key("linear", i, o, d): measure_linear(i, o, d) if packs_here[d] else "addmm"
                  for i, o, d in timed(needs.linear)}
        attention = dict.fromkeys(needs.keys("attention"), "sdpa")
        for d, h, hd in timed(needs.attention) if onednn else ():
            attention.update(measure_attention(d, h, hd))
        kernels = CpuPlan(machine, linear).with_entries(known)
        mlp = {}
        for kind, dim, hidden, act, d in timed(needs.mlp):
            if not packs_here.get(d, False):
                mlp[plan_key("mlp", kind, dim, hidden, act, d)] = DEFAULT_MLP_ROWS
                continue
            shapes = ((dim, 2 * hidden if kind == "gated" else hidden, d), (hidden, dim, d))
            packs = tuple(kernels.linear_kernel(*shape) == "onednn" for shape in shapes)
            both_packed, rows = False, DEFAULT_MLP_ROWS  # no row blocks without both linears packed
            # A shape recorded before keeps its kernel (a process ran with it). One recorded as addmm keeps
            # the MLP's linears as they are: packing the other would make a mix that was never timed whole.
            kept_unpacked = any(known.linear.get(plan_key("linear", *shape)) == "addmm" for shape in shapes)
            if all(packs) or not kept_unpacked:
                try:
                    both_packed, rows = measure_mlp(kind, dim, hidden, act, d, packs, native)
                except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype
                    warn(f"the {kind} MLP {dim}x{hidden} {dtype_name(d)} failed on oneDNN ({e}); {rows} rows")
            if both_packed and not all(packs):  # the whole MLP ran faster packed: so do its shapes
                linear.update({plan_key("linear", *shape): "onednn" for shape in shapes})
                kernels = CpuPlan(machine, linear).with_entries(known)
            mlp[plan_key("mlp", kind, dim, hidden, act, d)] = rows
        plan = CpuPlan(machine, linear, attention, mlp)
        chunks, elementwise = {}, {}
        for need in timed(needs.blocks):
            key = plan_key("blocks", *need)
            try:
                chunks[key], elementwise[key] = measure_block(need, plan.with_entries(known), native)
            except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype
                warn(f"the block {key} failed ({e}); the default chunk size, the modules' elementwise ops")
                chunks[key], elementwise[key] = DEFAULT_CHUNK_BYTES, "aten"
    return CpuPlan(machine, plan.linear, plan.attention, plan.mlp, chunks, elementwise)
