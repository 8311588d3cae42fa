"""The CPU backend's choices for one machine: ``CpuPlan``, and what a tower asks of one (``PlanNeeds``).

A plan says which kernel runs each linear shape and dtype (torch's ``addmm`` or oneDNN's prepacked linear), which
attention path runs each segment length (SDPA, or two fp32 GEMMs per head), how many rows an MLP with both linears
packed runs at a time and, per tower block shape, how many bytes of output a packed linear computes per oneDNN call
(``linear_chunk``) and how large the fp32 scratch is through which norms and rope run on row chunks (``scratch``).
The two sizes are timed on a whole block, since what they trade (a chunk that stays in cache until the next step
reads it, against fewer and larger calls) depends on everything else the block keeps in cache. Each entry is a
timing on the machine at hand (``machine.machine_plan``), never a constant fitted to one CPU: the rates and cache
sizes differ by vendor, ISA (AVX-512, AMX), torch build and thread count, and so do the winners. Shapes a plan
holds no kernel entry for run torch's own kernels; sizes it holds none for take the defaults (``DEFAULT_*``).

A plan travels as a dict (``to_dict`` / ``from_dict``), so a resumed run, a rank or a Ray actor on another machine
runs the plan its run recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ... import devices
from ...devices import dtype_name
from ...errors import ConfigError
from .kernels import DEFAULT_CHUNK_BYTES, onednn_linear_available
from .workspace import DEFAULT_SCRATCH_ELEMENTS

PLAN_FORMAT = 3
PLAN_FIELDS = ("format", "machine", "linear", "attention", "mlp", "linear_chunk", "scratch")
# The probes' search spaces (``machine`` times each): an MLP's block rows (2048: one block of the probe), a packed
# linear's output bytes per call and the fp32 scratch, from well inside a core's private cache to beyond a small
# last-level cache share. Each holds its default.
MLP_ROW_CHOICES = (128, 256, 512, 1024, 2048)
CHUNK_CHOICES = (1 << 20, 2 << 20, 4 << 20, 8 << 20)
SCRATCH_CHOICES = (1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21)
LINEAR_KERNELS = ("addmm", "onednn")
ATTENTION_PATHS = ("sdpa", "gemm")
# The dtypes a plan times kernels for (float16 runs torch's own kernels).
DTYPES = {name: devices.DTYPES[name] for name in ("float32", "bfloat16")}
# Segment lengths the attention probe times; a segment takes the choice of the nearest one (in log2). Beyond
# MAX_GEMM_LENGTH a segment runs SDPA without asking: the GEMM path holds one head's L x L fp32 scores (256 MiB at
# 8,192 tokens), a memory bound, not a speed one.
PROBE_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
MAX_GEMM_LENGTH = 6144
# Rows of an MLP's block where a plan has no measurement (a recorded plan of another tower): a block's hidden
# activations should stay in the last-level cache between the two GEMMs, with enough rows for the GEMMs' full rate.
DEFAULT_MLP_ROWS = 512


def linear_key(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    return f"{in_features}x{out_features}:{dtype_name(dtype)}"


def attention_key(dtype: torch.dtype, heads: int, head_dim: int, length: int) -> str:
    return f"{dtype_name(dtype)}:{heads}x{head_dim}:{length}"


def mlp_key(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype) -> str:
    return f"{kind}:{dim}x{hidden}:{act}:{dtype_name(dtype)}"


def block_key(mlp: str, norm: str, dim: int, heads: int, hidden: int, act: str, dtype: torch.dtype) -> str:
    return f"{mlp}:{norm}:{dim}x{heads}:{hidden}:{act}:{dtype_name(dtype)}"


def nearest_probe(length: int) -> int:
    return min(PROBE_LENGTHS, key=lambda probe: abs(math.log2(probe) - math.log2(max(length, 1))))


@dataclass(frozen=True)
class PlanNeeds:
    """What a tower asks of a plan: its linear shapes, its attention shapes (heads, head_dim), its MLPs (kind,
    dim, hidden, activation) and its blocks (MLP kind, norm kind, dim, heads, MLP hidden, activation), per dtype."""

    linear: frozenset[tuple[int, int, torch.dtype]] = frozenset()
    attention: frozenset[tuple[torch.dtype, int, int]] = frozenset()
    mlp: frozenset[tuple[str, int, int, str, torch.dtype]] = frozenset()
    blocks: frozenset[tuple[str, str, int, int, int, str, torch.dtype]] = frozenset()

    def linear_keys(self) -> list[str]:
        return sorted(linear_key(i, o, d) for i, o, d in self.linear if dtype_name(d) in DTYPES)

    def attention_keys(self) -> list[str]:
        return sorted(attention_key(d, h, hd, n) for d, h, hd in self.attention if dtype_name(d) in DTYPES
                      for n in PROBE_LENGTHS)

    def mlp_keys(self) -> list[str]:
        return sorted(mlp_key(*need) for need in self.mlp if dtype_name(need[4]) in DTYPES)

    def block_keys(self) -> list[str]:
        return sorted(block_key(*need) for need in self.blocks if dtype_name(need[6]) in DTYPES)

    def empty(self) -> bool:
        return not (self.linear or self.attention or self.mlp or self.blocks)


@dataclass(frozen=True)
class CpuPlan:
    """One machine's measured choices (see the module docstring). Shapes it holds no kernel entry for run torch's
    own kernels (addmm, SDPA); sizes it holds none for take the defaults."""

    machine: str
    linear: Mapping[str, str] = field(default_factory=dict)
    attention: Mapping[str, str] = field(default_factory=dict)
    mlp: Mapping[str, int] = field(default_factory=dict)
    linear_chunk: Mapping[str, int] = field(default_factory=dict)
    scratch: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A plan given by a caller or recorded by a run must be one that can run: known kernels, sizes of at least one
        # row or byte (MLP rows of 0 divide by zero in the forward).
        for name, allowed in (("linear", LINEAR_KERNELS), ("attention", ATTENTION_PATHS)):
            bad = [(key, value) for key, value in getattr(self, name).items() if value not in allowed]
            if bad:
                raise ConfigError(f"CPU plan {name} entry {bad[0][0]!r}: {bad[0][1]!r} (allowed: {list(allowed)})")
        for name in ("mlp", "linear_chunk", "scratch"):
            bad = [(key, value) for key, value in getattr(self, name).items() if type(value) is not int or value < 1]
            if bad:
                raise ConfigError(f"CPU plan {name} entry {bad[0][0]!r}: {bad[0][1]!r} is not a positive integer")

    def linear_kernel(self, in_features: int, out_features: int, dtype: torch.dtype) -> str:
        return self.linear.get(linear_key(in_features, out_features, dtype), "addmm")

    def attention_path(self, dtype: torch.dtype, heads: int, head_dim: int, length: int) -> str:
        if length > MAX_GEMM_LENGTH:
            return "sdpa"
        return self.attention.get(attention_key(dtype, heads, head_dim, nearest_probe(length)), "sdpa")

    def mlp_rows(self, kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype) -> int:
        return self.mlp.get(mlp_key(kind, dim, hidden, act, dtype), DEFAULT_MLP_ROWS)

    def chunk_bytes(self, block: tuple) -> int:
        """Bytes of output per oneDNN call of a packed linear in a tower of this block shape (a ``PlanNeeds``
        block)."""
        return self.linear_chunk.get(block_key(*block), DEFAULT_CHUNK_BYTES)

    def scratch_elements(self, block: tuple) -> int:
        """fp32 elements per scratch buffer of a tower of this block shape."""
        return self.scratch.get(block_key(*block), DEFAULT_SCRATCH_ELEMENTS)

    def missing(self, needs: PlanNeeds) -> PlanNeeds:
        """The part of ``needs`` this plan holds no entry for."""
        linear = {need for need in needs.linear if dtype_name(need[2]) in DTYPES
                  and linear_key(*need) not in self.linear}
        attention = {need for need in needs.attention if dtype_name(need[0]) in DTYPES
                     and any(attention_key(*need, n) not in self.attention for n in PROBE_LENGTHS)}
        mlp = {need for need in needs.mlp if dtype_name(need[4]) in DTYPES and mlp_key(*need) not in self.mlp}
        blocks = {need for need in needs.blocks if dtype_name(need[6]) in DTYPES
                  and not (block_key(*need) in self.linear_chunk and block_key(*need) in self.scratch)}
        return PlanNeeds(frozenset(linear), frozenset(attention), frozenset(mlp), frozenset(blocks))

    def with_entries(self, other: CpuPlan) -> CpuPlan:
        """This plan with ``other``'s entries added where it has none (its own are kept: a choice a process has run
        with does not change under it)."""
        return CpuPlan(self.machine, *({**getattr(other, name), **getattr(self, name)} for name in PLAN_FIELDS[2:]))

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "machine": self.machine,
                **{name: dict(sorted(getattr(self, name).items())) for name in PLAN_FIELDS[2:]}}

    @classmethod
    def from_dict(cls, data: object) -> CpuPlan:
        """A plan from its dict form; ConfigError naming the culprit for one this version cannot run."""
        found = data.get("format") if isinstance(data, dict) else None
        if found != PLAN_FORMAT:
            raise ConfigError(f"CPU plan format {found!r} is not this version's ({PLAN_FORMAT})")
        try:
            plan = cls(data["machine"], *(dict(data[name]) for name in PLAN_FIELDS[2:]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"a CPU plan has the fields {', '.join(PLAN_FIELDS)} ({type(e).__name__}: {e})") \
                from None
        if ("onednn" in plan.linear.values() or "gemm" in plan.attention.values()) and not onednn_linear_available():
            raise ConfigError("the CPU plan runs oneDNN's linear (in its linears or its GEMM attention), which this "
                              "torch lacks (no mkldnn linear ops)")
        return plan
