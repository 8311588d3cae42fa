"""The CPU backend's choices for one machine: ``CpuPlan``, and what a tower asks of one (``PlanNeeds``).

A plan says which kernel runs each linear shape and dtype (torch's ``addmm`` or oneDNN's prepacked linear), which
attention path runs each segment length (SDPA, or two fp32 GEMMs per head), how many rows an MLP with both linears
packed runs at a time and, per tower block shape, how many bytes of output a packed linear computes per oneDNN call
(``linear_chunk``) and whether its elementwise steps run the modules' own ops or the fused ``native`` kernels
(``elementwise``). Each entry is a timing on the machine at hand (``probes``, kept per machine by ``machine``), never
a constant fitted to one CPU: the rates and cache sizes differ by vendor, ISA (AVX-512, AMX), torch build and thread
count, and so do the winners. Shapes a plan holds no kernel entry for run torch's own kernels; sizes it holds none
for take the defaults.

A plan travels as a dict (``to_dict`` / ``from_dict``), so a resumed run, a rank or a Ray actor on another machine
runs the plan its run recorded."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ... import devices
from ...devices import dtype_name
from ...errors import ConfigError
from .kernels import DEFAULT_CHUNK_BYTES, onednn_linear_available

PLAN_FORMAT = 5
PLAN_FIELDS = ("format", "machine", "linear", "attention", "mlp", "linear_chunk", "elementwise")
KERNELS = {"linear": ("addmm", "onednn"), "attention": ("sdpa", "gemm"), "elementwise": ("aten", "native")}
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
# Each kind of entry's key: its need's parts (an attention need's with a probe length), dtypes by name.
KEY_FORMATS = {"linear": "{}x{}:{}", "attention": "{}:{}x{}:{}", "mlp": "{}:{}x{}:{}:{}",
               "blocks": "{}:{}:{}x{}:{}:{}:{}"}


def plan_key(kind: str, *need) -> str:
    return KEY_FORMATS[kind].format(*(dtype_name(part) if isinstance(part, torch.dtype) else part for part in need))


def need_keys(kind: str, need: tuple) -> list[str]:
    """The plan's keys of one need (an attention need's one per probe length)."""
    return [plan_key(kind, *need, n) for n in PROBE_LENGTHS] if kind == "attention" else [plan_key(kind, *need)]


def timed(needs: frozenset[tuple]) -> list[tuple]:
    """The needs in a dtype a plan times kernels for, in a fixed order."""
    return sorted((need for need in needs if any(part in DTYPES.values() for part in need)), key=str)


@dataclass(frozen=True)
class PlanNeeds:
    """What a tower asks of a plan, per dtype: its linear shapes (in, out), its attention shapes (heads, head_dim),
    its MLPs (kind, dim, hidden, activation) and its blocks (MLP kind, norm kind, dim, heads, MLP hidden,
    activation)."""

    linear: frozenset[tuple[int, int, torch.dtype]] = frozenset()
    attention: frozenset[tuple[torch.dtype, int, int]] = frozenset()
    mlp: frozenset[tuple[str, int, int, str, torch.dtype]] = frozenset()
    blocks: frozenset[tuple[str, str, int, int, int, str, torch.dtype]] = frozenset()

    def keys(self, kind: str) -> list[str]:
        """The plan's keys of this kind of need ("linear", "attention", "mlp" or "blocks")."""
        return sorted(key for need in timed(getattr(self, kind)) for key in need_keys(kind, need))

    def empty(self) -> bool:
        return not (self.linear or self.attention or self.mlp or self.blocks)


@dataclass(frozen=True)
class CpuPlan:
    """One machine's measured choices (see the module docstring)."""

    machine: str
    linear: Mapping[str, str] = field(default_factory=dict)
    attention: Mapping[str, str] = field(default_factory=dict)
    mlp: Mapping[str, int] = field(default_factory=dict)
    linear_chunk: Mapping[str, int] = field(default_factory=dict)
    elementwise: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A plan given by a caller or recorded by a run must run here: known kernels (oneDNN's only where this torch
        # has them; the native kernels are checked where they run), sizes of at least one row or byte (MLP rows of 0
        # divide by zero in the forward).
        for name in PLAN_FIELDS[2:]:
            for key, value in getattr(self, name).items():
                if name not in KERNELS:
                    runs = type(value) is int and value > 0
                else:
                    runs = value == KERNELS[name][0] or value == KERNELS[name][1] and (
                        name == "elementwise" or onednn_linear_available())
                if not runs:
                    raise ConfigError(f"CPU plan {name} entry {key!r}: {value!r} cannot run (kernels: "
                                      f"{KERNELS}, oneDNN's where this torch has its linear; sizes: positive integers)")

    def linear_kernel(self, in_features: int, out_features: int, dtype: torch.dtype) -> str:
        return self.linear.get(plan_key("linear", in_features, out_features, dtype), "addmm")

    def attention_path(self, dtype: torch.dtype, heads: int, head_dim: int, length: int) -> str:
        if length > MAX_GEMM_LENGTH:
            return "sdpa"
        nearest = min(PROBE_LENGTHS, key=lambda probe: abs(math.log2(probe) - math.log2(max(length, 1))))
        return self.attention.get(plan_key("attention", dtype, heads, head_dim, nearest), "sdpa")

    def mlp_rows(self, kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype) -> int:
        return self.mlp.get(plan_key("mlp", kind, dim, hidden, act, dtype), DEFAULT_MLP_ROWS)

    def chunk_bytes(self, block: tuple) -> int:
        """Bytes of output per oneDNN call of a packed linear in a tower of this block shape (a ``PlanNeeds``
        block)."""
        return self.linear_chunk.get(plan_key("blocks", *block), DEFAULT_CHUNK_BYTES)

    def elementwise_kernels(self, block: tuple) -> str:
        """"aten" or "native" for the elementwise steps of a tower of this block shape."""
        return self.elementwise.get(plan_key("blocks", *block), "aten")

    def missing(self, needs: PlanNeeds) -> PlanNeeds:
        """The part of ``needs`` this plan holds no entry for."""
        held = {"linear": self.linear.keys(), "attention": self.attention.keys(), "mlp": self.mlp.keys(),
                "blocks": self.linear_chunk.keys() & self.elementwise.keys()}
        return PlanNeeds(**{kind: frozenset(need for need in timed(getattr(needs, kind))
                                            if not set(need_keys(kind, need)) <= entries)
                            for kind, entries in held.items()})

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
            fields = data["machine"], *(dict(data[name]) for name in PLAN_FIELDS[2:])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"a CPU plan has the fields {', '.join(PLAN_FIELDS)} ({type(e).__name__}: {e})") \
                from None
        return cls(*fields)
