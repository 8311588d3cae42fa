"""CPU linear layers on the fastest kernel this machine has: oneDNN's prepacked weights where they beat addmm.

Why: on AMD CPUs torch's fp32 ``addmm`` goes to MKL, which runs at about half the cores' rate there (~200 GFLOP/s
on the towers' shapes on a 2-vCPU Zen 5), while oneDNN's linear on a weight reordered once into its blocked layout
reaches ~400; in bf16 the gap is ~10%. On a CPU where MKL runs at full speed the choice falls back to addmm. So the
kernel is chosen by measurement on the machine at hand, per (in, out, dtype), never by vendor (``choose_kernel``).

Reference: the calls inductor's CPU freezing pass emits for a frozen ``nn.Linear``
(torch/_inductor/fx_passes/mkldnn_fusion.py): ``torch.ops.mkldnn._reorder_linear_weight(w, rows)`` once, then
``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`` per call. Its fp32 result is
fp32-accurate (relative error against float64 ~5e-7, addmm's ~2.5e-7); its bf16 result is addmm's bit for bit.
The reorder's row count is only a hint for the blocking: any row count runs, and each row's result does not
depend on the others (checked for 7 to 3,740 rows), so packs of any size use one packed weight.

Memory: the packed weight *replaces* the plain one (the Linear's ``weight`` parameter becomes the packed tensor:
one copy). ``state_dict`` hands out plain tensors (``dense_state_dict_``), loading into a packed tower unpacks
first and packs again after, and a packed tower is unpacked before it is compiled (``VisionTower`` does these);
``unpack_`` restores plain parameters before a move to another device or dtype, which packed tensors do not
support.

Deviation from ``F.linear``: oneDNN has no ``out=`` form, so a call that must write into the forward's workspace
runs on row chunks whose fresh outputs stay below glibc's mmap threshold (reused heap memory, no page faults)
and copies each into place.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from .errors import ConfigError

KERNELS = ("addmm", "onednn")
POLICIES = ("auto", "addmm", "onednn")
PROBE_ROWS = 1024  # rows of the timing probe: the towers' packs hold thousands, and the rate flattens by here
PROBE_REPEATS = 3
# How much faster oneDNN must be to be chosen. fp32: the two kernels round differently, so a choice must not flip
# between two processes on timing noise (on AMD the gap is 2x; on a CPU where MKL runs at full speed it is a tie,
# and addmm stays). bf16: torch's bf16 addmm on the CPU is itself a oneDNN matmul and the results are bitwise
# equal (checked on every released tower shape), so any gain counts.
MARGIN = {torch.float32: 1.25, torch.bfloat16: 1.03}
CHUNK_BYTES = 16 << 20  # fresh output per oneDNN call when writing into a workspace: under glibc's 32 MiB threshold
# Process-wide memo of measured choices, like cuDNN's benchmark cache: kernel names only (no tensor, no model),
# one entry per (in, out, dtype, threads) of the towers loaded, so every tower of a process makes the same choice
# for a shape, and two encoders of one process give the same bits.
DECISIONS: dict[tuple[int, int, torch.dtype, int], str] = {}


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, rows: int = PROBE_ROWS) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque ``mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with a packed weight; into ``out`` by row chunks when given (see module docstring)."""
    if out is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    step = max(1, CHUNK_BYTES // (out.shape[1] * out.element_size()))
    for start in range(0, x.shape[0], step):
        rows = slice(start, start + step)
        out[rows].copy_(torch.ops.mkldnn._linear_pointwise(x[rows], weight, bias, "none", [], ""))
    return out


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call dispatch and the kernel's own setup
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_kernels(in_features: int, out_features: int, dtype: torch.dtype, *, rows: int = PROBE_ROWS,
                    repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Seconds of a (rows, in) x (in, out) product + bias into a reused output, by each kernel, the way the
    forward calls them. Random data: the rate depends on the shape, not on the values."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.zeros(out_features, dtype=dtype)
    out = torch.empty(rows, out_features, dtype=dtype)
    packed = pack_weight(weight, rows)
    return {"addmm": _best_seconds(lambda: torch.addmm(bias, x, weight.t(), out=out), repeats),
            "onednn": _best_seconds(lambda: packed_linear(x, packed, bias, out), repeats)}


def choose_kernel(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    """"onednn" where its prepacked linear beats addmm by MARGIN on this machine, else "addmm"; measured once
    per shape, dtype and thread count in a process (DECISIONS)."""
    if not onednn_linear_available() or dtype not in MARGIN:
        return "addmm"
    key = (in_features, out_features, dtype, torch.get_num_threads())
    if key not in DECISIONS:
        seconds = measure_kernels(in_features, out_features, dtype)
        DECISIONS[key] = "onednn" if seconds["onednn"] * MARGIN[dtype] < seconds["addmm"] else "addmm"
    return DECISIONS[key]


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ConfigError(f"linear_kernel {policy!r} is not one of {list(POLICIES)}")
    if policy == "onednn" and not onednn_linear_available():
        raise ConfigError("linear_kernel 'onednn' is not available: this torch has no oneDNN (mkldnn) linear ops")
    return policy


def pack_(layers: Iterable[tuple[str, nn.Linear]], policy: str = "auto") -> dict[str, str]:
    """Replace each CPU layer's weight by its oneDNN-packed form where the policy picks oneDNN, in place; the
    packed tensor is the layer's ``weight`` from then on (one copy). Returns the kernel per layer name.

    policy: "auto" (measured per shape: ``choose_kernel``), "onednn" (wherever it runs), "addmm" (no packing)."""
    check_policy(policy)
    kernels: dict[str, str] = {}
    for name, layer in layers:
        weight = layer.weight
        if weight.is_mkldnn:
            kernels[name] = "onednn"
            continue
        runs_here = weight.device.type == "cpu" and weight.dtype in MARGIN and onednn_linear_available()
        if not runs_here or policy == "addmm":
            kernels[name] = "addmm"
            continue
        kernel = "onednn" if policy == "onednn" else choose_kernel(layer.in_features, layer.out_features, weight.dtype)
        if kernel == "onednn":
            layer.weight = nn.Parameter(pack_weight(weight), requires_grad=False)
        kernels[name] = kernel
    return kernels


def unpack_(layers: Iterable[tuple[str, nn.Linear]]) -> None:
    """Plain weights again (before a move to another device or dtype, or autograd, which packed tensors lack)."""
    for _, layer in layers:
        if layer.weight.is_mkldnn:
            layer.weight = nn.Parameter(layer.weight.to_dense(), requires_grad=False)


def drop_(layers: Iterable[tuple[str, nn.Linear]]) -> None:
    """Packed weights replaced by storage-less meta tensors of their shape (freeing, not converting: a packed
    tensor cannot move to the meta device, and unpacking first would allocate a copy just to drop it)."""
    for _, layer in layers:
        weight = layer.weight
        if weight.is_mkldnn:
            layer.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                        requires_grad=False)


def dense_state_dict_(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """A state_dict post-hook: packed weights leave as plain tensors (what checkpoints and other code expect)."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_mkldnn:
            state[name] = value.to_dense()
