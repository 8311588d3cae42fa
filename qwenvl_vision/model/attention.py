"""Attention over a packed sequence of independent segments (frames or windows), and its backends.

Reference: transformers' vision attention, which splits q/k/v at ``cu_seqlens`` and runs one SDPA call per
segment (or one flash varlen call). Attention never crosses a segment, and no N x N mask is ever built.

Backends, chosen once per tower (``attn_impl``; timm's ``fused_attn`` / vLLM's ``attn_backend_override``):

- ``"sdpa"``: segments of equal length batched into one ``scaled_dot_product_attention`` call each (a view
  when they are contiguous, a gather otherwise). Runs on every device and dtype. The CPU inference backend
  (``cpu/``) runs this grouping with its own per-length kernel choice.
- ``"flash"``: flash-attn's ``flash_attn_varlen_func``, one call per layer over the whole pack (CUDA, fp16/bf16).
- ``"torch_varlen"``: PyTorch's ``torch.nn.attention.varlen.varlen_attn``, the same (CUDA, fp16/bf16).
- ``"auto"``: flash, else torch_varlen, where they can run; else sdpa.

A backend is a plain callable ``(q, k, v, plan, scale, out) -> (N, H, hd)``. It is the tower's one compile
boundary: compiled blocks call it through ``torch.compiler.disable``, because its per-forward plan is host data.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from ..devices import upload
from ..errors import ConfigError

VIEW_MIN_TOKENS = 2048  # a run of equal segments this large runs in place; smaller ones may be gathered
GATHER_MIN_RUNS = 5  # small runs of one length are gathered into one call only when there are more
ATTN_IMPLS = ("auto", "sdpa", "flash", "torch_varlen")
FUSED = ("flash", "torch_varlen")  # one varlen call over the whole pack: they read cu_seqlens, never the groups


@dataclass
class SegmentGroup:
    """Segments of one length L: a contiguous run [start, start + count*L) or gathered rows."""

    length: int
    count: int
    start: int | None = None
    index: torch.Tensor | None = None  # (count * L,) rows, when the segments are not contiguous


@dataclass
class SegmentPlan:
    """Attention boundaries for one packed forward, built once on the host and moved to the device once."""

    cu_seqlens: torch.Tensor  # (n + 1,) int32 on the device
    max_seqlen: int
    groups: list[SegmentGroup]
    total: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu", grouped: bool = True
                     ) -> SegmentPlan:
        """Runs of consecutive equal-length segments become views (no copy); many small runs of one length
        scattered over the pack are gathered into one batched call so that many tiny images or windows
        do not cost one kernel launch each. Large runs, and a few small ones, are never gathered: the copies
        would cost more than the calls. ``grouped=False`` (the fused backends): ``cu_seqlens`` only, no groups."""
        lengths = [int(n) for n in lengths if n > 0]
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        if not grouped:
            return cls(upload([cu], device), max(lengths, default=0), [], int(cu[-1]))
        runs: list[tuple[int, int, int]] = []  # (length, start, count)
        start = 0
        for n in lengths:
            if runs and runs[-1][0] == n and runs[-1][1] + runs[-1][2] * n == start:
                runs[-1] = (n, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((n, start, 1))
            start += n
        groups: list[SegmentGroup] = []
        small_by_length: dict[int, list[tuple[int, int]]] = {}
        for n, run_start, count in runs:
            if n * count >= VIEW_MIN_TOKENS:
                groups.append(SegmentGroup(n, count, start=run_start))
            else:
                small_by_length.setdefault(n, []).append((run_start, count))
        for n, small in small_by_length.items():
            if len(small) <= GATHER_MIN_RUNS:  # a few calls on views beat copying q, k, v and the output
                groups += [SegmentGroup(n, count, start=run_start) for run_start, count in small]
                continue
            starts = torch.tensor([s + i * n for s, count in small for i in range(count)])
            rows = (starts[:, None] + torch.arange(n)).flatten()
            groups.append(SegmentGroup(n, len(starts), index=upload([rows], device)))
        return cls(upload([cu], device), max(lengths, default=0), groups, start)


def sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """count equal segments packed as (count*L, H, hd) -> (count*L, H, hd), into `out` if given."""
    def split(x: torch.Tensor) -> torch.Tensor:
        return rearrange(x, "(b l) h d -> b h l d", b=count)

    attended = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale)
    if out is None:
        return rearrange(attended, "b h l d -> (b l) h d")
    rearrange(out, "(b l) h d -> b h l d", b=count).copy_(attended)
    return out


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan, scale: float,
                   out: torch.Tensor | None = None, batched: Callable = sdpa_batched) -> torch.Tensor:
    """Non-causal attention inside each segment of the plan; q, k, v: (N, H, hd); into `out` when given.
    ``batched`` runs each group of equal segments (``sdpa_batched``'s signature; the CPU backend passes its own)."""
    if out is None:
        if len(plan.groups) == 1 and plan.groups[0].start == 0:  # one run of equal segments: no copy
            group = plan.groups[0]
            return batched(q, k, v, group.count, scale)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for group in plan.groups:
        if group.index is None:
            rows = slice(group.start, group.start + group.count * group.length)
            batched(q[rows], k[rows], v[rows], group.count, scale, out=out[rows])
        else:
            idx = group.index
            out[idx] = batched(q[idx], k[idx], v[idx], group.count, scale)
    return out


def last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """What the varlen kernels need (head-dim stride 1), copied only where it is not so: v, a slice of the fused
    qkv output, has strided rows but a contiguous head dimension, and a full ``contiguous()`` would copy it."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def flash_attention(q, k, v, plan: SegmentPlan, scale: float, out=None) -> torch.Tensor:
    """flash-attn's varlen kernel over the whole pack (returns its own tensor)."""
    from flash_attn import flash_attn_varlen_func

    cu, n = plan.cu_seqlens, plan.max_seqlen
    return flash_attn_varlen_func(*last_dim_contiguous(q, k, v), cu, cu, n, n,
                                  softmax_scale=scale, causal=False)


def torch_varlen_attention(q, k, v, plan: SegmentPlan, scale: float, out=None) -> torch.Tensor:
    """PyTorch's varlen kernel over the whole pack (returns its own tensor)."""
    from torch.nn.attention.varlen import varlen_attn

    cu, n = plan.cu_seqlens, plan.max_seqlen
    return varlen_attn(*last_dim_contiguous(q, k, v), cu, cu, n, n, scale=scale)


BACKENDS: dict[str, Callable] = {
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "torch_varlen": torch_varlen_attention,
}


def unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why backend `name` cannot run for a tower on device/dtype, or None if it can."""
    device = torch.device(device)
    if name == "sdpa":
        return None
    # On meta (shapes only: a CUDA forward's path checked without a GPU) torch's varlen kernel runs (it has a meta
    # implementation) and the device has nothing to check; flash-attn's may have none.
    if device.type == "meta" and name == "flash":
        return "flash-attn's kernel is not run on meta here"
    if device.type not in ("cuda", "meta") or dtype not in (torch.float16, torch.bfloat16):
        return f"it runs on CUDA in float16/bfloat16 only (this tower: {device.type}, {dtype})"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (8, 0)
    if capability < (8, 0):
        return (f"its kernels need compute capability 8.0 (Ampere) or newer; {torch.cuda.get_device_name(device)} "
                f"has {capability[0]}.{capability[1]}")
    if name == "flash":
        try:
            from flash_attn import flash_attn_varlen_func  # noqa: F401 - a build that does not match torch fails here
        except Exception as e:  # noqa: BLE001 - not installed, or built for another torch / CUDA
            return f"flash-attn cannot be imported ({type(e).__name__}: {e})"
    if name == "torch_varlen":
        return torch_varlen_missing()
    return None


def torch_varlen_missing() -> str | None:
    """Why this PyTorch's varlen_attn cannot serve us, or None. The API is recent and its first form took no
    ``scale`` keyword (added in pytorch#171199, Dec 2025); a version without it is reported unavailable here
    ("auto" then falls back to sdpa) instead of failing with a TypeError in the first forward."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"this PyTorch ({torch.__version__}) has no torch.nn.attention.varlen"
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "scale" not in inspect.signature(varlen_attn).parameters:
        return f"this PyTorch's ({torch.__version__}) varlen_attn takes no scale argument"
    return None


def resolve_attn_impl(attn_impl: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend that runs: ``attn_impl`` itself, or for "auto" the fastest one available; a backend that
    cannot run for this device and dtype is a ConfigError saying why."""
    if attn_impl not in ATTN_IMPLS:
        raise ConfigError(f"attn_impl {attn_impl!r} is not one of {list(ATTN_IMPLS)}")
    if attn_impl == "auto":
        return next(name for name in ("flash", "torch_varlen", "sdpa")
                    if unavailable_reason(name, device, dtype) is None)
    reason = unavailable_reason(attn_impl, device, dtype)
    if reason is not None:
        raise ConfigError(f"attn_impl {attn_impl!r} is not available: {reason}")
    return attn_impl
