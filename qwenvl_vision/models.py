"""Build a vision tower from a config.json dict, a preset name or a VisionConfig."""

from __future__ import annotations

import os

import torch

from .config import QWEN2_5, QWEN3, VisionConfig, resolve_config
from .qwen2_5 import Qwen2_5VisionTransformer
from .qwen3 import Qwen3VisionTransformer
from .tower import VisionTower

DESIGNS: dict[str, type[VisionTower]] = {QWEN2_5: Qwen2_5VisionTransformer, QWEN3: Qwen3VisionTransformer}


def build_model(
    config: VisionConfig | dict | str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    cache_size: int = 1024,
    cache_bytes: int | None = 1 << 30,
    attn_impl: str = "auto",
) -> VisionTower:
    """An uninitialised tower (PyTorch's default init); ``device="meta"`` allocates nothing (the attention
    backend is then chosen for wherever the weights arrive: ``VisionTower.attention_backend``)."""
    cfg = resolve_config(config)
    with torch.device(device or "cpu"):
        model = DESIGNS[cfg.design](cfg, cache_size=cache_size, cache_bytes=cache_bytes, attn_impl=attn_impl)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval().requires_grad_(False)
