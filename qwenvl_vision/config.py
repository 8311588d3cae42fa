"""Vision-tower configuration: one dataclass for both families, parsed from a checkpoint's config.json.

The checkpoints disagree on spelling (Qwen2.5-VL writes ``in_chans`` and an unhelpful nested
``model_type``; Qwen3-VL writes ``in_channels`` and ``model_type: "qwen3_vl"``; the MoE releases say
``qwen3_vl_moe``), and transformers' class defaults are not the released values (its Qwen2.5 default
hidden_size 3584 matches no release). So we never fall back to a library default for a size: every
released tower is a named preset here, and parsing reads the file's own numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

QWEN2_5 = "qwen2_5_vl"
QWEN3 = "qwen3_vl"
FAMILIES = (QWEN2_5, QWEN3)

# Top-level model_type of a checkpoint's config.json -> tower family.
MODEL_TYPE_TO_FAMILY = {
    "qwen2_5_vl": QWEN2_5,
    "qwen3_vl": QWEN3,
    "qwen3_vl_moe": QWEN3,
}




@dataclass(frozen=True)
class VisionConfig:
    """Everything needed to build one vision tower, with the released checkpoints' meaning."""

    family: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    in_channels: int = 3
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = ""
    rope_theta: float = 10000.0
    # Qwen2.5-VL only
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    # Qwen3-VL only
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    # Where it came from, for messages and for writing it back out.
    model_type: str = ""
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown vision family {self.family!r}; expected one of {FAMILIES}")
        if not self.hidden_act:
            default_act = "silu" if self.family == QWEN2_5 else "gelu_pytorch_tanh"
            object.__setattr__(self, "hidden_act", default_act)
        if not self.model_type:
            object.__setattr__(self, "model_type", self.family)
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"head_dim {self.head_dim} must be a multiple of 4 for the 2D rotary embedding")
        for name, indexes in (("fullatt_block_indexes", self.fullatt_block_indexes),
                              ("deepstack_visual_indexes", self.deepstack_visual_indexes)):
            bad = [i for i in indexes if not 0 <= i < self.depth]
            if bad:
                raise ConfigError(f"{name} {list(indexes)} has entries outside depth {self.depth}: {bad}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Width of one row of pixel_values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_merged(self) -> int:
        """Qwen2.5 window side in merged tokens: 112 // 2 // 14 = 4."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    def to_vision_dict(self) -> dict:
        """The vision_config as a released checkpoint would write it (our spelling: in_channels)."""
        d = {
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "out_hidden_size": self.out_hidden_size,
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "hidden_act": self.hidden_act,
        }
        if self.family == QWEN2_5:
            d.update(window_size=self.window_size, fullatt_block_indexes=list(self.fullatt_block_indexes))
        else:
            d.update(num_position_embeddings=self.num_position_embeddings,
                     deepstack_visual_indexes=list(self.deepstack_visual_indexes))
        if self.rope_theta != 10000.0:
            d["rope_theta"] = self.rope_theta
        return d

    def to_config_json(self) -> dict:
        """A self-contained config.json for a vision-only checkpoint; from_config_json reads it back."""
        return {"model_type": self.model_type, "family": self.family, "name": self.name,
                "vision_config": self.to_vision_dict()}

    def replace(self, **changes: Any) -> VisionConfig:
        return dataclasses.replace(self, **changes)


def _family_of(config_json: dict) -> tuple[str, str]:
    model_type = config_json.get("model_type") or ""
    family = config_json.get("family")
    if family in FAMILIES:
        return family, model_type or family
    if model_type in MODEL_TYPE_TO_FAMILY:
        return MODEL_TYPE_TO_FAMILY[model_type], model_type
    vision_type = (config_json.get("vision_config") or {}).get("model_type", "")
    if vision_type in MODEL_TYPE_TO_FAMILY:  # a bare vision_config dict from Qwen3
        return MODEL_TYPE_TO_FAMILY[vision_type], vision_type
    raise ConfigError(
        f"unsupported model_type {model_type or '(missing)'!r}; supported: {sorted(MODEL_TYPE_TO_FAMILY)}"
    )


def _out_hidden_size(vision: dict, config_json: dict) -> int:
    if "out_hidden_size" in vision:
        return int(vision["out_hidden_size"])
    # Older exports omit it; the merger projects to the language model's width.
    text = config_json.get("text_config") or config_json
    if "hidden_size" in text and text is not vision:
        return int(text["hidden_size"])
    raise ConfigError("vision_config has no out_hidden_size and no text hidden_size to take it from")


def from_config_json(config_json: dict, *, name: str = "") -> VisionConfig:
    """Parse a checkpoint's whole config.json (or our vision-only one) into a VisionConfig."""
    if not isinstance(config_json, dict):
        raise ConfigError(f"config must be a dict, got {type(config_json).__name__}")
    family, model_type = _family_of(config_json)
    vision = config_json.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"config (model_type {model_type!r}) has no vision_config section")
    required = ("depth", "hidden_size", "intermediate_size", "num_heads")
    missing = [k for k in required if k not in vision]
    if missing:
        raise ConfigError(f"vision_config of {model_type!r} lacks {missing}")
    rope = vision.get("rope_parameters") or {}
    common = dict(
        family=family,
        model_type=model_type,
        name=name or config_json.get("name", ""),
        depth=int(vision["depth"]),
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_heads=int(vision["num_heads"]),
        out_hidden_size=_out_hidden_size(vision, config_json),
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        hidden_act=vision.get("hidden_act", ""),
        rope_theta=float(vision.get("rope_theta", rope.get("rope_theta", 10000.0))),
    )
    if family == QWEN2_5:
        return VisionConfig(
            **common,
            patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        )
    return VisionConfig(
        **common,
        patch_size=int(vision.get("patch_size", 16)),
        num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", ())),
    )


def _qwen2_5(name: str, intermediate: int, out: int) -> VisionConfig:
    return VisionConfig(
        family=QWEN2_5, name=name, model_type="qwen2_5_vl", depth=32, hidden_size=1280,
        intermediate_size=intermediate, num_heads=16, out_hidden_size=out, patch_size=14,
        window_size=112, fullatt_block_indexes=(7, 15, 23, 31), hidden_act="silu",
    )


def _qwen3(name: str, depth: int, hidden: int, intermediate: int, out: int, deepstack: tuple[int, ...],
           model_type: str = "qwen3_vl") -> VisionConfig:
    return VisionConfig(
        family=QWEN3, name=name, model_type=model_type, depth=depth, hidden_size=hidden,
        intermediate_size=intermediate, num_heads=16, out_hidden_size=out, patch_size=16,
        num_position_embeddings=2304, deepstack_visual_indexes=deepstack, hidden_act="gelu_pytorch_tanh",
    )


# The ten released towers (see REFERENCE.md, "Released vision configs").
PRESETS: dict[str, VisionConfig] = {
    c.name: c
    for c in (
        _qwen2_5("qwen2.5-vl-3b", 3420, 2048),
        _qwen2_5("qwen2.5-vl-7b", 3420, 3584),
        _qwen2_5("qwen2.5-vl-32b", 3456, 5120),
        _qwen2_5("qwen2.5-vl-72b", 3456, 8192),
        _qwen3("qwen3-vl-2b", 24, 1024, 4096, 2048, (5, 11, 17)),
        _qwen3("qwen3-vl-4b", 24, 1024, 4096, 2560, (5, 11, 17)),
        _qwen3("qwen3-vl-8b", 27, 1152, 4304, 4096, (8, 16, 24)),
        _qwen3("qwen3-vl-32b", 27, 1152, 4304, 5120, (8, 16, 24)),
        _qwen3("qwen3-vl-30b-a3b", 27, 1152, 4304, 2048, (8, 16, 24), "qwen3_vl_moe"),
        _qwen3("qwen3-vl-235b-a22b", 27, 1152, 4304, 4096, (8, 16, 24), "qwen3_vl_moe"),
    )
}


def preset(name: str) -> VisionConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[key]


def resolve_config(config: VisionConfig | dict | str | os.PathLike) -> VisionConfig:
    """A VisionConfig from the dataclass itself, a parsed config.json dict, a preset name or a config.json path."""
    if isinstance(config, VisionConfig):
        return config
    if isinstance(config, dict):
        return from_config_json(config)
    if isinstance(config, str) and config.lower() in PRESETS:
        return PRESETS[config.lower()]
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            return from_config_json(json.load(f))
    if isinstance(config, str):
        raise ConfigError(f"{config!r} is neither a preset ({sorted(PRESETS)}) nor a config.json file")
    raise ConfigError(f"cannot build a vision config from {type(config).__name__}")
