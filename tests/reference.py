"""Reference towers from transformers, shared by the tests; weights with real spread come from the package."""

from __future__ import annotations

import torch

from qwenvl_vision.bench_cli import hf_tower_classes, hf_vision_config  # noqa: F401 - shared builders
from qwenvl_vision.config import VisionConfig
from qwenvl_vision.init import spread_init_  # noqa: F401 - re-exported for the tests


def hf_tower(cfg: VisionConfig, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' tower for the same config (random init; load weights into it afterwards)."""
    classes = hf_tower_classes(cfg)
    return classes[1]._from_config(hf_vision_config(cfg, attn_implementation, classes)).eval()


def hf_forward(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(merged, deepstack levels) from transformers' tower, in the same shape as ours."""
    out = tower(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius relative error of a against reference b, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
