"""CPU linear layers on the fastest kernel this machine has: oneDNN's prepacked weights where they beat addmm.

Why: on AMD CPUs torch's fp32 ``addmm`` goes to MKL, which runs at about half the cores' rate there, while
oneDNN's linear on a weight reordered once into its blocked layout reaches about twice that; in bf16 the gap is
smaller (docs/benchmarks.md has the measured rates). On a CPU where MKL runs at full speed the choice
falls back to addmm. So the kernel is chosen by measurement on the machine at hand, per (in, out, dtype), never by
vendor (``choose_kernel``).

Reference: the calls inductor's CPU freezing pass emits for a frozen ``nn.Linear``
(torch/_inductor/fx_passes/mkldnn_fusion.py): ``torch.ops.mkldnn._reorder_linear_weight(w, rows)`` once, then
``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`` per call. Its fp32 result is
fp32-accurate (relative error against float64 ~5e-7, addmm's ~2.5e-7), not addmm's bits. In bf16 torch's addmm
on the CPU is a oneDNN matmul itself: on CPUs where the plain and the packed weight take the same kernel the bits
are addmm's, on others (AMX machines, whose packed weights take another kernel) they differ within bf16 rounding.
The reorder's row count is only a hint for the blocking: any row count runs with one packed weight. Whether a
row's bits depend on the call's row count is the CPU's kernels' affair (on some they do); the tower runs each item
as its own forward, so an item's calls are the same wherever it is (``tower.VisionTower.packs``). Chunks are
balanced and never leave a short tail (a call of a few rows runs slowly).

``PackableLinear`` is an ``nn.Linear`` that owns this: ``pack_()`` replaces its weight by the packed tensor (one
copy, not two), ``state_dict`` hands out the plain tensor, a state dict loads into it (and it packs again), a move
to another device or dtype unpacks first and packs again where it still can (as ``nn.RNNBase._apply`` re-flattens
its weights), and calling it, autograd and autocast included, gives ``F.linear``'s result. ``copy.deepcopy`` of a
packed layer is not supported: unpack first.

Deviation from ``F.linear``: oneDNN has no ``out=`` form, so a call that must write into the forward's workspace
runs on row chunks whose fresh outputs stay in cache and below glibc's mmap threshold (reused heap memory, no
page faults) and copies each into place; where the forward consumes a result at once (rope on q and k after qkv,
the activation after a merger's first linear, the residual add after the last), it takes the chunks as they come
and nothing is copied (``layers.linear_chunks``). An MLP with both linears packed runs by row blocks instead
(``layers.add_by_row_blocks_``); one with a single packed linear hands its chunks to the activation too.

Deviation from the reference's rounding: ``packed_activated_linear`` computes an activation in oneDNN's GEMM
epilogue (``EPILOGUE_ACTIVATIONS``, used by the plain MLPs), on the fp32 accumulator: in bf16 the linear's result is
not rounded before the activation (one rounding fewer than transformers' Linear then activation: closer to float64,
not its bits); in fp32 oneDNN's activation is within an ulp or two of torch's (relative error under 1e-6).
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

KERNELS = ("addmm", "onednn")
POLICIES = ("auto", "addmm", "onednn")
PROBE_ROWS = 1024  # rows of the timing probe: the towers' packs hold thousands, and the rate flattens by here
PROBE_REPEATS = 3
# How much faster oneDNN's GEMM alone must be to be chosen (below 1: how much slower it may be). fp32: the two
# kernels round differently, so a choice must not flip between two processes on timing noise (on AMD the gap is 2x;
# on a CPU where MKL runs at full speed it is a tie, and addmm stays). bf16: the two agree within bf16 rounding
# (bitwise on some CPUs), and a packed layer hands its rows to the next step without a copy and
# lets an MLP run by row blocks with its activation in the GEMM (``layers``): worth more than a few percent of the
# GEMM (the Qwen3-VL-8B MLP ran ~10% faster so), so oneDNN is kept unless addmm is 5% faster. That also keeps the
# choice off the noise: on this project's AMD CPU oneDNN's bf16 lead is 0-10% per shape, and a 1.03 margin flipped
# between processes. A plain MLP's bits follow the choice (the epilogue rounds once fewer), so two processes on
# "auto" may still differ there, as in fp32: a run records its choices (``linear_kernels``) and reuses them.
MARGIN = {torch.float32: 1.25, torch.bfloat16: 0.95}
# Fresh output per oneDNN call on row chunks (into a workspace, or consumed at once by an epilogue): small enough to
# stay in the last-level cache until it is read again (tens of MiB on server CPUs), far under glibc's mmap threshold.
CHUNK_BYTES = 4 << 20
# Process-wide memo of measured choices, like cuDNN's benchmark cache: kernel names only (no tensor, no model),
# one entry per (in, out, dtype, threads) of the towers loaded, so every tower of a process makes the same choice
# for a shape and two encoders of one process give the same bits. The lock makes concurrent loads measure once.
DECISIONS: dict[tuple[int, int, torch.dtype, int], str] = {}
DECISIONS_LOCK = threading.Lock()


def return_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim``; nothing elsewhere). Packing a
    loaded tower frees each plain weight as its packed form arrives; weights under glibc's mmap threshold leave
    holes in the heap that stay resident, so without this a tower's packing would peak near twice its weights."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, rows: int = PROBE_ROWS) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque ``mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def balanced_chunks(rows: int, step: int) -> list[slice]:
    """Slices of at most ``step`` rows covering ``rows``, as equal as can be (no one-row tail)."""
    count = max(1, math.ceil(rows / step))
    size = math.ceil(rows / count)
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def chunk_rows(rows: int, out_features: int, element_size: int) -> list[slice]:
    """The row chunks of a (rows, out_features) oneDNN result computed CHUNK_BYTES at a time."""
    return balanced_chunks(rows, max(1, CHUNK_BYTES // (out_features * element_size)))


def packed_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> Iterator[tuple[slice, torch.Tensor]]:
    """``x @ weight.T + bias`` with a packed weight as (rows, fresh result of those rows) pairs, CHUNK_BYTES of
    output at a time, each computed when the caller asks for it (see the module docstring)."""
    for rows in chunk_rows(x.shape[0], weight.shape[0], x.element_size()):
        yield rows, torch.ops.mkldnn._linear_pointwise(x[rows], weight, bias, "none", [], "")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with a packed weight; into ``out`` by row chunks when given (see module docstring)."""
    if out is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    for rows, result in packed_chunks(x, weight, bias):
        out[rows].copy_(result)
    return out


# Activations oneDNN computes in its GEMM's epilogue, as (attr, algorithm) of ``_linear_pointwise``: on the fp32
# accumulator, before the result is rounded to its dtype (one rounding fewer than the linear then the activation: in
# bf16 closer to float64, in fp32 within an ulp or two of torch's activation). quick_gelu, x * sigmoid(1.702 x), has
# none: the swish post-op takes no alpha through this call (it computes silu whatever the scalar).
EPILOGUE_ACTIVATIONS = {"silu": ("swish", ""), "swish": ("swish", ""), "gelu": ("gelu", "none"),
                        "gelu_pytorch_tanh": ("gelu", "tanh")}


def packed_activated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            activation: str) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` with a packed weight, the activation in the GEMM's epilogue
    (EPILOGUE_ACTIVATIONS); a fresh result."""
    attr, algorithm = EPILOGUE_ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)


def consume_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``packed_chunks``, each result dropped as the next arrives: what the kernel costs when the forward's next
    step reads every chunk as it comes (for timing)."""
    for _ in packed_chunks(x, weight, bias):
        pass


def best_seconds(fn, repeats: int) -> float:
    """The best of ``repeats`` timed calls after one untimed warm-up (the benchmarks time kernels the same way)."""
    fn()  # warm-up: first-call dispatch and the kernel's own setup
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_kernels(weight: torch.Tensor, packed: torch.Tensor | None = None, *, rows: int = PROBE_ROWS,
                    repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Seconds of a (rows, in) x weight.T product + bias by each kernel, the way the forward calls them: addmm
    into a reused output; oneDNN on row chunks of fresh outputs that the next step reads as they come
    (``layers.linear_chunks``: no copy). On the layer's own weight (and its packed form, when made already: no
    second copy for the probe). Random inputs: the rate depends on the shape, not on the values."""
    out_features, in_features = weight.shape
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    bias = torch.zeros(out_features, dtype=weight.dtype)
    out = torch.empty(rows, out_features, dtype=weight.dtype)
    packed = pack_weight(weight, rows) if packed is None else packed
    return {"addmm": best_seconds(lambda: torch.addmm(bias, x, weight.t(), out=out), repeats),
            "onednn": best_seconds(lambda: consume_chunks(x, packed, bias), repeats)}


def choose_kernel(weight: torch.Tensor, packed: torch.Tensor | None = None) -> str:
    """"onednn" where its prepacked linear beats addmm by MARGIN on this machine for this weight's shape, else
    "addmm"; measured once per shape, dtype and thread count in a process (DECISIONS)."""
    if not onednn_linear_available() or weight.dtype not in MARGIN:
        return "addmm"
    key = (weight.shape[1], weight.shape[0], weight.dtype, torch.get_num_threads())
    with DECISIONS_LOCK:
        if key not in DECISIONS:
            seconds = measure_kernels(weight, packed)
            DECISIONS[key] = "onednn" if seconds["onednn"] * MARGIN[weight.dtype] < seconds["addmm"] else "addmm"
        return DECISIONS[key]


def check_policy(policy: str | dict[str, str]) -> str | dict[str, str]:
    """A policy is "auto", "addmm", "onednn", or a kernel per layer name (a tower's ``linear_kernels``, as a run
    recorded it: the same choices again in another process, so the same bits)."""
    kernels, allowed = (list(policy.values()), KERNELS) if isinstance(policy, dict) else ([policy], POLICIES)
    for kernel in kernels:
        if kernel not in allowed:
            raise ConfigError(f"linear_kernel {kernel!r} is not one of {list(allowed)}")
    if "onednn" in kernels and not onednn_linear_available():
        raise ConfigError("linear_kernel 'onednn' is not available: this torch has no oneDNN (mkldnn) linear ops")
    return policy


def _needs_dense(layer: nn.Linear, x: torch.Tensor) -> bool:
    """The packed kernel has no autograd and no autocast: those calls take the plain weight."""
    if torch.is_autocast_enabled(x.device.type):
        return True
    return torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad
                                        or (layer.bias is not None and layer.bias.requires_grad))


class PackableLinear(nn.Linear):
    """``nn.Linear`` whose weight may live in oneDNN's prepacked layout on the CPU (see the module docstring)."""

    pack_policy = "auto"  # the policy it was packed with: a move to another dtype packs again by it

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def pack_(self, policy: str = "auto") -> str:
        """Pack the weight where the policy picks oneDNN for this shape on this machine; returns the kernel."""
        if self.weight.is_mkldnn:
            if policy != "addmm":
                return "onednn"
            self.unpack_()  # asked for addmm (a recorded choice): plain again
        weight = self.weight
        runs_here = (weight.device.type == "cpu" and weight.dtype in MARGIN and onednn_linear_available()
                     and not weight.requires_grad)  # a trainable weight stays plain: the packed kernel has no grad
        if not runs_here or policy == "addmm":
            return "addmm"
        known = DECISIONS.get((self.in_features, self.out_features, weight.dtype, torch.get_num_threads()))
        if policy == "auto" and known == "addmm":
            return "addmm"  # measured already: no packed copy made just to be dropped
        packed = pack_weight(weight)
        kernel = "onednn" if policy == "onednn" else choose_kernel(weight, packed)
        if kernel == "onednn":
            self.weight = nn.Parameter(packed, requires_grad=False)  # the plain weight goes with the old Parameter
            self.pack_policy = policy
        return kernel

    def unpack_(self) -> None:
        if self.weight.is_mkldnn:
            self.weight = nn.Parameter(self.weight.to_dense(), requires_grad=False)

    def drop_(self) -> None:
        """A packed weight replaced by a storage-less meta tensor of its shape (freeing, not converting: unpacking
        first would allocate a copy just to drop it)."""
        weight = self.weight
        if weight.is_mkldnn:
            self.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                       requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def runs_packed(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs oneDNN's prepacked kernel (a fresh output per call, no ``out=``)."""
        return self.weight.is_mkldnn and not _needs_dense(self, x)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, into ``out`` when given (the forward's workspace)."""
        if self.runs_packed(x):
            return packed_linear(x, self.weight, self.bias, out)
        weight = self.weight.to_dense() if self.weight.is_mkldnn else self.weight
        if out is None:
            return F.linear(x, weight, self.bias)
        if self.bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(self.bias, x, weight.t(), out=out)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_mkldnn:  # what checkpoints and every other reader expect
            destination[prefix + "weight"] = self.weight.detach().to_dense()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        was_packed = self.weight.is_mkldnn
        self.unpack_()  # a packed tensor cannot be copied into
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if was_packed:
            self.pack_(self.pack_policy)

    def _apply(self, fn, recurse=True):
        # Packed tensors support no conversion: move the plain weight, then pack again where it still runs.
        was_packed = self.weight.is_mkldnn
        self.unpack_()
        result = super()._apply(fn, recurse)
        if was_packed and not self.weight.is_meta:
            self.pack_(self.pack_policy)
        return result
