"""Build a vision tower from a config.json dict, a preset name or a VisionConfig."""

from __future__ import annotations

import os

import torch

from .config import QWEN2_5, VisionConfig, resolve_config
from .qwen2_5 import Qwen2_5VisionTransformer
from .qwen3 import Qwen3VisionTransformer
from .tower import VisionTower


def build_model(
    config: VisionConfig | dict | str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    cache_size: int = 1024,
    cache_bytes: int | None = 1 << 30,
) -> VisionTower:
    """An uninitialised tower (PyTorch's default init); ``device="meta"`` allocates nothing."""
    cfg = resolve_config(config)
    cls = Qwen2_5VisionTransformer if cfg.family == QWEN2_5 else Qwen3VisionTransformer
    with torch.device(device or "cpu"):
        model = cls(cfg, cache_size=cache_size, cache_bytes=cache_bytes)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval().requires_grad_(False)
