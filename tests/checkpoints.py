"""Random-weight checkpoints written in the released on-disk layouts (no network, no real weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwenvl_vision import build_model
from qwenvl_vision.config import QWEN2_5, VisionConfig
from qwenvl_vision.init import spread_init_

QWEN2_5_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
QWEN3_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}


def released_config_json(cfg: VisionConfig) -> dict:
    """config.json as the releases write it: Qwen2.5 says in_chans and no useful vision model_type."""
    vision = cfg.to_vision_dict()
    if cfg.family == QWEN2_5:
        vision["in_chans"] = vision.pop("in_channels")
        vision["spatial_patch_size"] = vision["patch_size"]
        vision["tokens_per_second"] = 2
        return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                "hidden_size": cfg.out_hidden_size, "vision_config": vision}
    vision["model_type"] = cfg.model_type
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": cfg.model_type,
            "text_config": {"hidden_size": cfg.out_hidden_size}, "vision_config": vision}


def write_checkpoint(folder: Path, cfg: VisionConfig, *, prefix: str | None = None, sharded: bool = True,
                     dtype: torch.dtype = torch.float32, seed: int = 0, llm_shards: int = 2) -> dict[str, torch.Tensor]:
    """Write a checkpoint in the released layout; return the vision state dict (prefix-free) it holds.

    Sharded: vision tensors split over the first two shards, the second also holds LLM tensors (as in
    the releases, where a shard boundary falls inside the tower), plus `llm_shards` LLM-only shards.
    """
    folder.mkdir(parents=True, exist_ok=True)
    prefix = prefix if prefix is not None else ("visual." if cfg.family == QWEN2_5 else "model.visual.")
    vision = {k: v.to(dtype).contiguous() for k, v in spread_init_(build_model(cfg), seed).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def llm(i: int) -> dict[str, torch.Tensor]:
        return {f"model.language_model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=gen).to(dtype),
                f"model.language_model.layers.{i}.input_layernorm.weight": torch.ones(32, dtype=dtype)}

    named = {prefix + k: v for k, v in vision.items()}
    (folder / "config.json").write_text(json.dumps(released_config_json(cfg)))
    pre = QWEN2_5_PREPROCESSOR if cfg.family == QWEN2_5 else QWEN3_PREPROCESSOR
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    if not sharded:
        save_file({**named, **llm(0)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return vision
    names = sorted(named)
    half = len(names) // 2
    shards = [{n: named[n] for n in names[:half]}, {**{n: named[n] for n in names[half:]}, **llm(0)}]
    shards += [llm(i + 1) for i in range(llm_shards)]
    total = len(shards)
    weight_map = {}
    for i, tensors in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in tensors})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return vision


def llm_only_shards(folder: Path) -> list[Path]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for n, f in index.items() if "visual." in n}
    return sorted(folder / f for f in set(index.values()) - vision_files)
