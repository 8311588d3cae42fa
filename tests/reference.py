"""Reference towers from transformers, shared by the tests; weights with real spread come from the package."""

from __future__ import annotations

import torch

from qwenvl_vision.config import QWEN2_5, VisionConfig
from qwenvl_vision.init import spread_init_  # noqa: F401 - re-exported for the tests


def hf_vision_config(cfg: VisionConfig, attn_implementation: str = "sdpa"):
    if cfg.family == QWEN2_5:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        extra = dict(window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_block_indexes))
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        extra = dict(num_position_embeddings=cfg.num_position_embeddings,
                     deepstack_visual_indexes=list(cfg.deepstack_visual_indexes))
    hf = Config(depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size, patch_size=cfg.patch_size,
                in_channels=cfg.in_channels, temporal_patch_size=cfg.temporal_patch_size,
                spatial_merge_size=cfg.spatial_merge_size, hidden_act=cfg.hidden_act, **extra)
    hf._attn_implementation = attn_implementation
    return hf


def hf_tower(cfg: VisionConfig, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """transformers' tower for the same config (random init; load weights into it afterwards)."""
    hf_cfg = hf_vision_config(cfg, attn_implementation)
    if cfg.family == QWEN2_5:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    return Tower._from_config(hf_cfg).eval()


def hf_forward(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(merged, deepstack levels) from transformers' tower, in the same shape as ours."""
    out = tower(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius relative error of a against reference b, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
