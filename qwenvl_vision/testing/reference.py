"""transformers' own vision towers as the reference for every family, and how far our outputs are from them.

The reference for every family is transformers 5.24's vision tower. Its module names are the checkpoints' tensor
names, so a reference tower's state dict is a checkpoint in the released naming: ``ours_from`` reads it through
``qwenvl_vision.model.names``, which tests our name mapping against the reference itself. Used by the benchmarks (the
comparison rows) and by the tests (re-exported by ``tests.helpers``); needs transformers.
"""

from __future__ import annotations

import importlib

import torch

from qwenvl_vision import build_model
from qwenvl_vision.model.config import VisionConfig
from qwenvl_vision.model.random_init import spread_init_

# family (its transformers module's name too) -> (vision config class, vision tower class)
HF_TOWERS = {
    "qwen2_vl": ("Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen2_5_omni": ("Qwen2_5OmniVisionEncoderConfig", "Qwen2_5OmniVisionEncoder"),
    "qwen3_vl": ("Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_omni_moe": ("Qwen3OmniMoeVisionEncoderConfig", "Qwen3OmniMoeVisionEncoder"),
    "qwen3_5": ("Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
    "qwen4_exp": ("Qwen4ExpVisionConfig", "Qwen4ExpVisionModel"),
}


def hf_classes(cfg: VisionConfig) -> tuple[type, type]:
    """(vision config class, vision tower class) of cfg's family in the installed transformers."""
    module_name = cfg.model_type
    config_name, tower_name = HF_TOWERS[module_name]
    config_module = importlib.import_module(f"transformers.models.{module_name}.configuration_{module_name}")
    tower_module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return getattr(config_module, config_name), getattr(tower_module, tower_name)


def hf_vision_fields(cfg: VisionConfig) -> dict:
    """Our config (``to_vision_dict``) in the spelling of the family's transformers vision config."""
    fields = cfg.to_vision_dict()
    fields.pop("rope_theta", None)  # transformers' vision towers fix it at 10000, not from the config
    if cfg.model_type == "qwen2_vl":
        ratio = fields.pop("intermediate_size") // cfg.hidden_size
        assert cfg.hidden_size * ratio == cfg.intermediate_size, "Qwen2-VL's MLP width is an integer ratio"
        fields.update(embed_dim=fields.pop("hidden_size"), hidden_size=fields.pop("out_hidden_size"), mlp_ratio=ratio)
    return fields


def hf_tower(cfg: VisionConfig, attn_implementation: str = "sdpa", *, device=None, dtype=None, seed: int | None = 0
             ) -> torch.nn.Module:
    """transformers' tower for cfg; weights with real spread (``seed``), or its own init with seed=None.
    ``device="meta"`` builds it without memory (load weights with ``load_state_dict(..., assign=True)``)."""
    config_class, tower_class = hf_classes(cfg)
    hf_cfg = config_class(**hf_vision_fields(cfg))
    hf_cfg._attn_implementation = attn_implementation
    with torch.device(device or "cpu"):
        tower = tower_class._from_config(hf_cfg, dtype=dtype)
    if seed is not None and device != "meta":
        spread_init_(tower, seed)
    return tower.eval().requires_grad_(False)


def hf_forward(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(merged, deepstack levels) from transformers' tower, in the same shape as ours. Its outputs are read by name,
    so a transformers that names them otherwise fails here, never with an empty list read as our tower's error."""
    out = tower(pixel_values, grid_thw=grid_thw)
    deepstack = bool(getattr(tower.config, "deepstack_visual_indexes", None))
    return out.pooler_output, list(out.deepstack_features) if deepstack else []


def ours_from(ref: torch.nn.Module, cfg: VisionConfig, **options) -> torch.nn.Module:
    """Our tower carrying the reference tower's weights: its state dict loads as it is (the tower's load hook takes
    the checkpoint names transformers' towers use), into copies that share nothing with the reference."""
    ours = build_model(cfg, device="meta", **options)
    ours.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, strict=True, assign=True)
    ours.set_attention(ours.attn_impl)
    return ours.eval().requires_grad_(False)


def pair(cfg: VisionConfig, seed: int = 0):
    """(ours, reference) with the same spread weights."""
    ref = hf_tower(cfg, seed=seed)
    return ours_from(ref, cfg), ref


# ----------------------------------------------------------------------------- how far from the reference


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius relative error of a against reference b, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def item_errors(ours: torch.Tensor, ref: torch.Tensor, grid_thw, merge_size: int = 2) -> list[float]:
    """rel_err per item of a pack of merged outputs (rows split by t*h*w / merge**2): one norm over the whole pack
    would let a large error confined to the smallest image pass."""
    counts = [int(t * h * w) // merge_size**2 for t, h, w in torch.as_tensor(grid_thw).tolist()]
    assert ours.shape == ref.shape and sum(counts) == ref.shape[0], (tuple(ours.shape), tuple(ref.shape), counts)
    return [rel_err(a, b) for a, b in zip(ours.split(counts), ref.split(counts), strict=True)]
