"""Build a vision tower: from a config.json dict, a preset name or a VisionConfig (``build_model``), or from a
transformers vision tower of any supported family, weights included (``from_transformers``).

These are the model's towers, running the modules' own forward; the package's ``qwenvl_vision.build_model`` and
``qwenvl_vision.from_transformers`` (``loading.py``) are these with the CPU backend attached on the CPU."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import ConfigError
from .config import FAMILIES, QWEN2_5, QWEN3, VisionConfig, from_config_json, resolve_config, tower_family
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


def from_transformers(visual_module: nn.Module, *, attn_impl: str = "auto", cache_size: int = 1024,
                      cache_bytes: int | None = 1 << 30) -> VisionTower:
    """Our tower for a transformers vision tower (``model.visual`` of any supported family, or the tower built on
    its own): the config read from ``visual_module.config`` as a released config.json's vision_config is read
    (``config.from_config_json``, every value checked), the weights copied onto the device and dtype they are on
    (the two modules share no storage), loaded strictly under the family's checkpoint names."""
    vision_config = getattr(visual_module, "config", None)
    model_type = getattr(vision_config, "model_type", None)
    if tower_family(model_type) is None:
        raise ConfigError(f"{type(vision_config).__name__} (model_type {model_type!r}) is not the vision config of a "
                          f"supported family; supported: {sorted(FAMILIES)}")
    config = from_config_json(vision_config.to_dict())
    weights = next(visual_module.parameters())
    model = build_model(config, device="meta", dtype=weights.dtype, cache_size=cache_size, cache_bytes=cache_bytes,
                        attn_impl=attn_impl)
    model = model.to_empty(device=weights.device)
    model.load_state_dict(visual_module.state_dict(), strict=True)
    model.set_attention(attn_impl)  # now that the weights are placed: a ConfigError if it cannot run there
    return model.eval().requires_grad_(False)
