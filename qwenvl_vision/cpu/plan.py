"""The CPU backend's choices for one machine: ``CpuPlan``, and what a tower asks of one (``PlanNeeds``).

A plan says which kernel runs each linear shape and dtype (torch's ``addmm`` or oneDNN's prepacked linear), which
attention path runs each segment length (SDPA, or two fp32 GEMMs per head) and how many rows an MLP with both
linears packed runs at a time. Each entry is a timing on the machine at hand (``machine.machine_plan``), never a
constant fitted to one CPU: the rates differ by vendor, ISA (AVX-512, AMX), torch build and thread count, and so do
the winners. Shapes a plan holds no entry for run torch's own kernels.

A plan travels as a dict (``to_dict`` / ``from_dict``, validated strictly), so a resumed run, a rank or a Ray actor
on another machine runs the plan its run recorded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .kernels import onednn_linear_available

PLAN_FORMAT = 2
PLAN_FIELDS = ("format", "machine", "linear", "attention", "mlp")
LINEAR_KERNELS = ("addmm", "onednn")
ATTENTION_PATHS = ("sdpa", "gemm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Segment lengths the attention probe times; a segment takes the choice of the nearest one (in log2). Beyond
# MAX_GEMM_LENGTH a segment runs SDPA without asking: the GEMM path holds one head's L x L fp32 scores (256 MiB at
# 8,192 tokens), a memory bound, not a speed one.
PROBE_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
MAX_GEMM_LENGTH = 6144
# Rows of an MLP's block where a plan has no measurement (a recorded plan of another tower): a block's hidden
# activations should stay in the last-level cache between the two GEMMs, with enough rows for the GEMMs' full rate.
DEFAULT_MLP_ROWS = 512

LINEAR_KEY = re.compile(r"(\d+)x(\d+):(float32|bfloat16)")
ATTENTION_KEY = re.compile(r"(float32|bfloat16):(\d+)x(\d+):(\d+)")
MLP_KEY = re.compile(r"(gated|plain):(\d+)x(\d+):([a-z_]+):(float32|bfloat16)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def linear_key(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    return f"{in_features}x{out_features}:{dtype_name(dtype)}"


def attention_key(dtype: torch.dtype, heads: int, head_dim: int, length: int) -> str:
    return f"{dtype_name(dtype)}:{heads}x{head_dim}:{length}"


def mlp_key(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype) -> str:
    return f"{kind}:{dim}x{hidden}:{act}:{dtype_name(dtype)}"


def nearest_probe(length: int) -> int:
    return min(PROBE_LENGTHS, key=lambda probe: abs(math.log2(probe) - math.log2(max(length, 1))))


@dataclass(frozen=True)
class PlanNeeds:
    """What a tower asks of a plan: its linear shapes, its attention shapes (heads, head_dim) and its MLPs (kind,
    dim, hidden, activation), per dtype."""

    linear: frozenset[tuple[int, int, torch.dtype]] = frozenset()
    attention: frozenset[tuple[torch.dtype, int, int]] = frozenset()
    mlp: frozenset[tuple[str, int, int, str, torch.dtype]] = frozenset()

    def linear_keys(self) -> list[str]:
        return sorted(linear_key(i, o, d) for i, o, d in self.linear if dtype_name(d) in DTYPES)

    def attention_keys(self) -> list[str]:
        return sorted(attention_key(d, h, hd, n) for d, h, hd in self.attention if dtype_name(d) in DTYPES
                      for n in PROBE_LENGTHS)

    def mlp_keys(self) -> list[str]:
        return sorted(mlp_key(*need) for need in self.mlp if dtype_name(need[4]) in DTYPES)

    def empty(self) -> bool:
        return not (self.linear or self.attention or self.mlp)


@dataclass(frozen=True)
class CpuPlan:
    """One machine's measured choices (see the module docstring). Shapes it holds no entry for run torch's own
    kernels (addmm, SDPA)."""

    machine: str
    linear: Mapping[str, str] = field(default_factory=dict)
    attention: Mapping[str, str] = field(default_factory=dict)
    mlp: Mapping[str, int] = field(default_factory=dict)

    def linear_kernel(self, in_features: int, out_features: int, dtype: torch.dtype) -> str:
        return self.linear.get(linear_key(in_features, out_features, dtype), "addmm")

    def attention_path(self, dtype: torch.dtype, heads: int, head_dim: int, length: int) -> str:
        if length > MAX_GEMM_LENGTH:
            return "sdpa"
        return self.attention.get(attention_key(dtype, heads, head_dim, nearest_probe(length)), "sdpa")

    def mlp_rows(self, kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype) -> int:
        return self.mlp.get(mlp_key(kind, dim, hidden, act, dtype), DEFAULT_MLP_ROWS)

    def missing(self, needs: PlanNeeds) -> PlanNeeds:
        """The part of ``needs`` this plan holds no entry for."""
        linear = {need for need in needs.linear if dtype_name(need[2]) in DTYPES
                  and linear_key(*need) not in self.linear}
        attention = {need for need in needs.attention if dtype_name(need[0]) in DTYPES
                     and any(attention_key(*need, n) not in self.attention for n in PROBE_LENGTHS)}
        mlp = {need for need in needs.mlp if dtype_name(need[4]) in DTYPES and mlp_key(*need) not in self.mlp}
        return PlanNeeds(frozenset(linear), frozenset(attention), frozenset(mlp))

    def with_entries(self, other: CpuPlan) -> CpuPlan:
        """This plan with ``other``'s entries added where it has none (its own are kept: a choice a process has run
        with does not change under it)."""
        return CpuPlan(self.machine, {**other.linear, **self.linear}, {**other.attention, **self.attention},
                       {**other.mlp, **self.mlp})

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "machine": self.machine, "linear": dict(sorted(self.linear.items())),
                "attention": dict(sorted(self.attention.items())), "mlp": dict(sorted(self.mlp.items()))}

    @classmethod
    def from_dict(cls, data: object) -> CpuPlan:
        """A plan from its dict form, refused (ConfigError naming the culprit) unless every field and entry is one
        this version writes."""
        if not isinstance(data, dict):
            raise ConfigError(f"a CPU plan must be a JSON object, got {type(data).__name__}")
        if set(data) != set(PLAN_FIELDS):
            raise ConfigError(f"a CPU plan has the fields {', '.join(PLAN_FIELDS)}; got {sorted(data)}")
        if data["format"] != PLAN_FORMAT:
            raise ConfigError(f"CPU plan format {data['format']!r} is not {PLAN_FORMAT}")
        if not isinstance(data["machine"], str):
            raise ConfigError("a CPU plan's machine must be a string")
        for name, pattern, allowed in (("linear", LINEAR_KEY, LINEAR_KERNELS),
                                       ("attention", ATTENTION_KEY, ATTENTION_PATHS)):
            entries = data[name]
            if not isinstance(entries, dict):
                raise ConfigError(f"a CPU plan's {name} must be an object")
            for key, value in entries.items():
                if not isinstance(key, str) or not pattern.fullmatch(key) or value not in allowed:
                    raise ConfigError(f"CPU plan {name} entry {key!r}: {value!r} (allowed: {list(allowed)})")
        if not isinstance(data["mlp"], dict):
            raise ConfigError("a CPU plan's mlp must be an object")
        for key, rows in data["mlp"].items():
            if not isinstance(key, str) or not MLP_KEY.fullmatch(key) or type(rows) is not int or rows < 1:
                raise ConfigError(f"CPU plan mlp entry {key!r}: {rows!r} (rows of a block, a positive integer)")
        if ("onednn" in data["linear"].values() or "gemm" in data["attention"].values()) \
                and not onednn_linear_available():
            raise ConfigError("the CPU plan runs oneDNN's linear (in its linears or its GEMM attention), which this "
                              "torch lacks (no mkldnn linear ops)")
        return cls(data["machine"], dict(data["linear"]), dict(data["attention"]), dict(data["mlp"]))
