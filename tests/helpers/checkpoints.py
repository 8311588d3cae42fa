"""Checkpoints written in each family's released on-disk layout: the nesting of its config.json, its
preprocessor files, the tensor prefix, shards split inside the tower and shards without vision tensors. The
weights are the reference tower's (``qwenvl_vision.testing.reference.hf_tower``, real spread), so loading one
through ``load_encoder`` tests our name mapping against transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwenvl_vision.model.config import QWEN2_5, VisionConfig
from qwenvl_vision.testing.reference import hf_tower, hf_vision_fields

# The shards a full checkpoint holds besides the tower, by where they are in each family's layout.
OTHER_TENSORS = {
    "qwen2_vl": ("model.layers.{i}.mlp.up_proj.weight", "lm_head.weight"),
    "qwen2_5_vl": ("model.layers.{i}.mlp.up_proj.weight", "lm_head.weight"),
    "qwen2_5_omni": ("thinker.model.layers.{i}.mlp.up_proj.weight", "thinker.audio_tower.layers.{i}.fc1.weight",
                     "talker.model.layers.{i}.mlp.up_proj.weight", "token2wav.code2wav_dit_model.proj_out.weight"),
    "qwen3_omni_moe": ("thinker.model.layers.{i}.mlp.gate.weight", "thinker.audio_tower.layers.{i}.fc1.weight",
                       "talker.model.layers.{i}.mlp.up_proj.weight", "code2wav.decoder.{i}.conv.weight"),
}
DEFAULT_OTHER = ("model.language_model.layers.{i}.mlp.up_proj.weight", "lm_head.weight")

PREPROCESSOR_FILES = {  # preprocessor_config.json as the families' releases write them
    QWEN2_5: {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"},
    "qwen3": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "image_processor_type": "Qwen2VLImageProcessorFast"},
}


# video_preprocessor_config.json in the Qwen3-VL releases' format: pixel bounds for the whole clip that differ from
# the image ones (4096..25165824 against 65536..16777216), so that mixing them up shows.
QWEN3_VIDEO_PREPROCESSOR_FILE = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_sample_frames": True,
    "fps": 2, "min_frames": 4, "max_frames": 768, "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def released_config_json(cfg: VisionConfig) -> dict:
    """config.json as the family's releases write it: its vision spelling, nested where the family nests it."""
    vision = hf_vision_fields(cfg)
    if cfg.design == QWEN2_5:  # the patch-14 releases write in_chans and spatial_patch_size
        vision["in_chans"] = vision.pop("in_channels")
        vision["spatial_patch_size"] = vision["patch_size"]
    vision["model_type"] = cfg.model_type
    text = {"hidden_size": cfg.out_hidden_size, "model_type": f"{cfg.model_type}_text"}
    if cfg.family.vision_config_at == ("vision_config",):
        return {"architectures": ["ForConditionalGeneration"], "model_type": cfg.model_type, "text_config": text,
                "vision_config": vision}
    thinker = {"model_type": f"{cfg.model_type}_thinker", "vision_config": vision, "text_config": text,
               "audio_config": {"d_model": 32}}
    return {"architectures": ["ForConditionalGeneration"], "model_type": cfg.model_type, "thinker_config": thinker,
            "talker_config": {"hidden_size": 32}}


def write_checkpoint(folder: Path, cfg: VisionConfig, *, prefix: str | None = None, sharded: bool = True,
                     dtype: torch.dtype = torch.float32, seed: int = 0, other_shards: int = 2
                     ) -> dict[str, torch.Tensor]:
    """A checkpoint in the family's released layout, weights from the reference tower with real spread; returns
    the reference's vision state dict (checkpoint names without prefix).

    Sharded: vision tensors split over the first two shards, the second also holding other tensors (as in the
    releases, where a shard boundary falls inside the tower), plus `other_shards` shards without vision tensors.
    """
    folder.mkdir(parents=True, exist_ok=True)
    prefix = cfg.family.prefixes[0] if prefix is None else prefix
    vision = {k: v.to(dtype).contiguous() for k, v in hf_tower(cfg, seed=seed).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    names = OTHER_TENSORS.get(cfg.model_type, DEFAULT_OTHER)

    def other(i: int) -> dict[str, torch.Tensor]:
        return {name.format(i=i): torch.randn(16, 8, generator=gen).to(dtype) for name in names}

    named = {prefix + k: v for k, v in vision.items()}
    (folder / "config.json").write_text(json.dumps(released_config_json(cfg)))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_FILES[cfg.design]))
    if cfg.family.video_sampling == "qwen3":  # Qwen3-VL's releases carry their own video settings
        (folder / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VIDEO_PREPROCESSOR_FILE))
    if not sharded:
        save_file({**named, **other(0)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return vision
    ordered = sorted(named)
    half = len(ordered) // 2
    shards = [{n: named[n] for n in ordered[:half]}, {**{n: named[n] for n in ordered[half:]}, **other(0)}]
    shards += [other(i + 1) for i in range(other_shards)]
    weight_map = {}
    for i, tensors in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in tensors})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return vision


def non_vision_shards(folder: Path) -> list[Path]:
    """The shards of a sharded checkpoint that hold no vision tensor."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for n, f in index.items() if "visual." in n}
    return sorted(folder / f for f in set(index.values()) - vision_files)
