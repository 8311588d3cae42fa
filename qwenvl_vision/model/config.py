"""Vision-tower configuration: every Qwen vision family as data, one dataclass for a tower, named presets.

A *family* is what a checkpoint's top-level ``model_type`` means for its vision tower: which of the two tower
*designs* it uses, where its vision config and tensors sit, and the handful of ways it differs from the other
members of its design (norm, MLP, windows, DeepStack, tensor names). Everything below was read from
transformers 5.24's modules (docs/architecture.md lists them, with the file each fact was read from);
adding a family is one ``Family(...)`` entry.

The checkpoints disagree on spelling and transformers' class defaults are not the released values (its Qwen2.5
default hidden_size 3584 matches no release), so we never fall back to a library default for a size: every
released tower is a named preset here, and parsing reads the file's own numbers, checked before anything is
built (``VisionConfig.__post_init__``; bounds in ``LIMITS``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .layers import ACTIVATIONS

# The two tower designs (one file each): patch-14 blocks with optional windows, and the learned position grid.
QWEN2_5 = "qwen2_5"
QWEN3 = "qwen3"

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True, repr=False)
class Family:
    """One config ``model_type``: its tower design, its checkpoint layout and what differs, as data."""

    model_type: str
    label: str  # for people: "Qwen2.5-VL"
    design: str  # QWEN2_5 or QWEN3
    norm: str  # "rms" (fp32 statistics, no bias) or "layer" (LayerNorm with bias)
    mlp: str  # "gated": down(act(gate(x)) * up(x)); "plain": fc2(act(fc1(x)))
    hidden_act: str  # the default when the config omits it
    windows: bool = False  # window attention outside fullatt_block_indexes
    deepstack: bool = False  # DeepStack mergers after deepstack_visual_indexes
    patch_bias: bool = False
    vision_config_at: tuple[str, ...] = ("vision_config",)
    # Tensor name prefixes of the tower in a full checkpoint: the releases' first, then transformers' re-saves.
    prefixes: tuple[str, ...] = ("model.visual.", "visual.")
    # Which of names.RULE_SETS turn its module tensor names into its checkpoint names (stacks and renames).
    names: tuple[str, ...] = ()
    # Preprocessing when the checkpoint has no preprocessor_config.json: the releases' values (docs/architecture.md).
    patch_size: int = 14
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    min_pixels: int = 3136
    max_pixels: int = 12845056
    video_sampling: str = "qwen2"  # whose fps frame sampler: Qwen2VLVideoProcessor's or Qwen3VLVideoProcessor's
    # The image resize backend its released preprocessor_config.json names: "torch" for Qwen2VLImageProcessorFast
    # (transformers' torchvision processor), "pil" for Qwen2VLImageProcessor (the PIL processor).
    resize: str = "pil"
    # Its processor writes each temporal patch's time into the prompt ("<1.2 seconds>", Qwen3-VL's): a serving
    # engine given video embeddings needs those times with them (``handoff.to_vllm``'s ``timestamps``).
    prompt_timestamps: bool = False
    # Its language model reads each video's seconds per temporal patch (the Omni thinkers'
    # ``video_second_per_grid``): a serving engine given video embeddings needs it with them (``to_vllm``'s
    # ``second_per_grid_ts``).
    seconds_per_grid: bool = False

    def __repr__(self) -> str:  # a config's repr names its family, not every field of it
        return f"Family({self.model_type!r})"


QWEN2_5_VL = Family("qwen2_5_vl", "Qwen2.5-VL", QWEN2_5, norm="rms", mlp="gated", hidden_act="silu", windows=True,
                    prefixes=("visual.", "model.visual."), names=("fused_gate_up", "ln_q_merger"))
QWEN3_VL = Family("qwen3_vl", "Qwen3-VL", QWEN3, norm="layer", mlp="plain", hidden_act="gelu_pytorch_tanh",
                  deepstack=True, patch_bias=True, patch_size=16, image_mean=HALF, image_std=HALF, min_pixels=65536,
                  max_pixels=16777216, video_sampling="qwen3", resize="torch", prompt_timestamps=True)
OMNI = dict(vision_config_at=("thinker_config", "vision_config"), prefixes=("thinker.visual.", "thinker.model.visual."),
            seconds_per_grid=True)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2_vl", "Qwen2-VL", QWEN2_5, norm="layer", mlp="plain", hidden_act="quick_gelu",
           prefixes=("visual.", "model.visual."), names=("fc_mlp", "ln_q_merger")),
    QWEN2_5_VL,
    dataclasses.replace(QWEN2_5_VL, model_type="qwen2_5_omni", label="Qwen2.5-Omni",
                        names=("fused_gate_up", "split_qkv", "ln_q_merger"), **OMNI),
    QWEN3_VL,
    dataclasses.replace(QWEN3_VL, model_type="qwen3_vl_moe", label="Qwen3-VL-MoE"),
    dataclasses.replace(QWEN3_VL, model_type="qwen3_omni_moe", label="Qwen3-Omni",
                        names=("ln_q_merger", "ln_q_deepstack"), min_pixels=3136, max_pixels=12845056,
                        video_sampling="qwen2", resize="pil", prompt_timestamps=False, **OMNI),  # Qwen2VL's processors
    dataclasses.replace(QWEN3_VL, model_type="qwen3_5", label="Qwen3.5", deepstack=False),
    dataclasses.replace(QWEN3_VL, model_type="qwen3_5_moe", label="Qwen3.5-MoE", deepstack=False),
    dataclasses.replace(QWEN3_VL, model_type="qwen4_exp", label="Qwen4-Exp", deepstack=False),
)}


def tower_family(model_type: Any) -> str | None:
    """The family a vision config's own model_type names (transformers': "qwen2_5_vl_vision", "qwen3_vl_vision", the
    Omni models' "qwen2_5_omni_vision_encoder"), which a tower saved on its own has in its config.json; else None."""
    family = next((model_type.removesuffix(s) for s in ("_vision_encoder", "_vision")
                   if isinstance(model_type, str) and model_type.endswith(s)), None)
    return family if family in FAMILIES else None


def family_named(family: Family | str, error: type[Exception] = ConfigError) -> Family:
    """The Family itself, or the one a model_type names; another name is ``error`` listing the supported ones."""
    if isinstance(family, Family):
        return family
    if isinstance(family, str) and family in FAMILIES:
        return FAMILIES[family]
    raise error(f"unknown family {family!r}: not a supported model_type ({sorted(FAMILIES)})")


# Plausible bounds for every number, checked before anything is built: the largest released tower is 32 x 1280
# (patch 14/16, 48 x 48 positions, output 8192); these leave wide room and refuse absurd values in milliseconds.
# The rotary base: every released tower uses 10000 and language models go up to ~1e7; below 1 the rotation gets
# faster with the dimension instead of slower (near 1e-300 its tables overflow to inf/NaN), above 1e9 even the
# fastest frequency of a vision head hardly turns. An int bound takes an integer only, a float bound any number.
LIMITS = {
    "depth": (1, 256),
    "hidden_size": (4, 16384),
    "intermediate_size": (1, 131072),
    "num_heads": (1, 256),
    "out_hidden_size": (1, 65536),
    "patch_size": (1, 64),
    "in_channels": (1, 16),
    "temporal_patch_size": (1, 16),
    "spatial_merge_size": (1, 8),
    "window_size": (1, 4096),
    "num_position_embeddings": (1, 1 << 20),
    "rope_theta": (1.0, 1e9),
}


def check_number(name: str, value: Any, low: float, high: float) -> None:
    """A ConfigError naming ``vision_config.<name>`` unless ``value`` lies in low..high (an integer for int bounds)."""
    integer = isinstance(low, int)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ConfigError(f"vision_config.{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not low <= value <= high:  # NaN fails both comparisons
        bounds = f"{low}..{high}" if integer else f"{low:g}..{high:g}"
        raise ConfigError(f"vision_config.{name} = {value!r} is outside the supported range {bounds}")


@dataclass(frozen=True)
class VisionConfig:
    """Everything needed to build one vision tower, with the released checkpoints' meaning.

    ``family`` is the tower's ``Family`` (given as one or by its model_type, a key of FAMILIES). Sizes are
    validated on construction.
    """

    family: Family
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    in_channels: int = 3
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = ""  # "": the family's
    rope_theta: float = 10000.0
    # Windowed families only
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    # Position-grid (Qwen3) families only
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    # For messages and for writing it back out
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", family_named(self.family))
        object.__setattr__(self, "hidden_act", self.hidden_act or self.family.hidden_act)
        for name, (low, high) in LIMITS.items():
            check_number(name, getattr(self, name), low, high)
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            value = getattr(self, name)  # null is no list: transformers fails on it too
            if not isinstance(value, (list, tuple)) or any(type(i) is not int for i in value):  # bool is no index
                raise ConfigError(f"vision_config.{name} must be a list of block indexes, got {value!r}")
            if len(set(value)) != len(value) or not all(0 <= i < self.depth for i in value):
                raise ConfigError(f"vision_config.{name} {list(value)} must be distinct blocks below {self.depth}")
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not supported; "
                              f"supported: {list(ACTIVATIONS)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.hidden_size {self.hidden_size} is not divisible by "
                              f"num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"head_dim {self.head_dim} (hidden_size / num_heads) must be a multiple of 4 "
                              "for the 2D rotary embedding")
        if self.family.windows and self.window_merged < 1:
            raise ConfigError(f"vision_config.window_size {self.window_size} is smaller than one merged token "
                              f"(patch_size {self.patch_size} x spatial_merge_size {self.spatial_merge_size})")
        if self.design == QWEN3 and self.num_grid_per_side**2 != self.num_position_embeddings:
            raise ConfigError(f"vision_config.num_position_embeddings {self.num_position_embeddings} is not a "
                              "square (the learned positions are a square grid)")
        if self.deepstack_visual_indexes and not self.family.deepstack:
            raise ConfigError(f"{self.family.label} towers have no DeepStack, but deepstack_visual_indexes is "
                              f"{list(self.deepstack_visual_indexes)}")

    @property
    def design(self) -> str:
        return self.family.design

    @property
    def model_type(self) -> str:
        return self.family.model_type

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
        """Window side in merged tokens: 112 // 2 // 14 = 4 for Qwen2.5-VL."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def full_attention_blocks(self) -> frozenset[int]:
        """Blocks attending over whole frames: all of them in families without windows."""
        return frozenset(self.fullatt_block_indexes if self.family.windows else range(self.depth))

    def to_vision_dict(self) -> dict:
        """The vision_config in our spelling (in_channels, hidden_size = width); from_config_json reads it back."""
        d = {k: getattr(self, k) for k in fields_of(self.family) if k != "rope_theta" or self.rope_theta != 10000.0}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def to_config_json(self) -> dict:
        """A self-contained config.json for a vision-only checkpoint; from_config_json reads it back."""
        return {"model_type": self.model_type, "name": self.name, "vision_config": self.to_vision_dict()}

    def replace(self, **changes: Any) -> VisionConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- parsing config.json


def fields_of(family: Family) -> list[str]:
    """The vision_config fields a family's towers use, in our spelling: what parsing reads and to_vision_dict writes."""
    return ["depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size", "in_channels",
            "temporal_patch_size", "spatial_merge_size", "hidden_act",
            *(["window_size", "fullatt_block_indexes"] if family.windows else []),
            *(["num_position_embeddings"] if family.design == QWEN3 else []),
            *(["deepstack_visual_indexes"] if family.deepstack else []), "rope_theta"]


# What a released config.json may leave out, as transformers' config classes default it (the released values), the
# older spellings it may use where ours is absent, and the config classes' attribute_map, whose names win over ours.
DEFAULTS = {"fullatt_block_indexes": (7, 15, 23, 31), "deepstack_visual_indexes": (8, 16, 24)}
SPELLINGS = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}
ATTRIBUTE_MAP = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
# Qwen2-VL releases write a minimal vision_config (2B: hidden_size, in_chans, model_type, spatial_patch_size) and
# rely on transformers' Qwen2VLVisionConfig class defaults for everything else; the reference builds the tower
# from those defaults, so we must too (they are the released 32 x 1280 tower). The 7B file omits hidden_size too.
QWEN2_VL_DEFAULTS = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "hidden_size": 3584}


def _section(config_json: dict, path: tuple[str, ...]) -> dict | None:
    node: Any = config_json
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def from_config_json(config_json: dict, *, name: str = "") -> VisionConfig:
    """Parse a checkpoint's whole config.json (or our vision-only one) into a VisionConfig.

    Every value is checked (types, ranges, heads dividing the width) before anything is built; a bad one is a
    ConfigError naming the field.
    """
    if not isinstance(config_json, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(config_json).__name__}")
    if (family_type := tower_family(config_json.get("model_type"))) is not None:  # a tower saved on its own
        config_json = {"model_type": family_type, "vision_config": config_json}
    family = family_named(config_json.get("model_type"))
    # Our vision-only files keep the tower at the top level, whatever the family's nesting.
    vision = _section(config_json, family.vision_config_at) or _section(config_json, ("vision_config",))
    if vision is None:
        raise ConfigError(f"config.json has no {'.'.join(family.vision_config_at)} section")
    # Before Qwen2-VL's class defaults would fill our fields.
    vision = {**{ours: vision[theirs] for theirs, ours in SPELLINGS.items() if theirs in vision}, **vision,
              **{ours: vision[theirs] for theirs, ours in ATTRIBUTE_MAP.items() if theirs in vision}}
    if family.model_type == "qwen2_vl" and "intermediate_size" not in vision:  # our own files say intermediate_size
        # Qwen2-VL spells the width embed_dim, the MLP width as a ratio, and the output width hidden_size.
        vision = {**QWEN2_VL_DEFAULTS, **vision}
        check_number("embed_dim", vision["embed_dim"], *LIMITS["hidden_size"])  # before it multiplies: None * 4
        check_number("mlp_ratio", vision["mlp_ratio"], 1, 64)  # an int, as transformers' Qwen2VLVisionConfig requires
        vision.update(hidden_size=vision["embed_dim"], out_hidden_size=vision["hidden_size"],
                      intermediate_size=vision["embed_dim"] * vision["mlp_ratio"])
    rope = vision.get("rope_parameters") or {}  # where transformers reads the rotary base first
    if not isinstance(rope, dict):
        raise ConfigError(f"vision_config.rope_parameters must be an object, got {rope!r}")
    given = {**DEFAULTS, "patch_size": family.patch_size}
    given.update(vision, **{k: v for k, v in rope.items() if k == "rope_theta"})
    # Older exports omit out_hidden_size: the merger projects to the language model's width.
    for text in (_section(config_json, (*family.vision_config_at[:-1], "text_config")),
                 _section(config_json, ("text_config",)), config_json):
        if text and "hidden_size" in text:
            given.setdefault("out_hidden_size", text["hidden_size"])
    missing = [k for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
               if k not in given]
    if missing:
        raise ConfigError(f"vision_config of {family.model_type!r} lacks {missing}")
    name = name or config_json.get("name")
    return VisionConfig(family=family, name=name if isinstance(name, str) else "",
                        **{k: given[k] for k in fields_of(family) if k in given})


# ----------------------------------------------------------------------------- presets


def _released(name: str, family: str, depth: int, width: int, mlp: int, out: int, more: dict | None = None
              ) -> VisionConfig:
    """A released tower: its config.json's sizes, the rest read as from_config_json reads a file that omits them."""
    vision = dict(depth=depth, hidden_size=width, intermediate_size=mlp, num_heads=16, out_hidden_size=out)
    return from_config_json({"model_type": family, "vision_config": {**vision, **(more or {})}}, name=name)


# Released towers, from the releases' public config.json files (docs/architecture.md, "Released vision towers";
# docs/api.md's table of presets says which file each one was read from): name, family, depth, width, MLP width,
# output width, what else differs. Qwen3.5 / 3.6 / 3.8 share three tower sizes.
PRESETS: dict[str, VisionConfig] = {row[0]: _released(*row) for row in (
    ("qwen2-vl-2b", "qwen2_vl", 32, 1280, 5120, 1536),
    ("qwen2-vl-7b", "qwen2_vl", 32, 1280, 5120, 3584),
    ("qwen2-vl-72b", "qwen2_vl", 32, 1280, 5120, 8192),
    ("qwen2.5-vl-3b", "qwen2_5_vl", 32, 1280, 3420, 2048),
    ("qwen2.5-vl-7b", "qwen2_5_vl", 32, 1280, 3420, 3584),
    ("qwen2.5-vl-32b", "qwen2_5_vl", 32, 1280, 3456, 5120),
    ("qwen2.5-vl-72b", "qwen2_5_vl", 32, 1280, 3456, 8192),
    ("qwen2.5-omni-3b", "qwen2_5_omni", 32, 1280, 3420, 2048),
    ("qwen2.5-omni-7b", "qwen2_5_omni", 32, 1280, 3420, 3584),
    ("qwen3-vl-2b", "qwen3_vl", 24, 1024, 4096, 2048, {"deepstack_visual_indexes": (5, 11, 17)}),
    ("qwen3-vl-4b", "qwen3_vl", 24, 1024, 4096, 2560, {"deepstack_visual_indexes": (5, 11, 17)}),
    ("qwen3-vl-8b", "qwen3_vl", 27, 1152, 4304, 4096),
    ("qwen3-vl-32b", "qwen3_vl", 27, 1152, 4304, 5120),
    ("qwen3-vl-30b-a3b", "qwen3_vl_moe", 27, 1152, 4304, 2048),
    ("qwen3-vl-235b-a22b", "qwen3_vl_moe", 27, 1152, 4304, 4096),
    ("qwen3-omni-30b-a3b", "qwen3_omni_moe", 27, 1152, 4304, 2048),
    ("qwen3.5-0.8b", "qwen3_5", 12, 768, 3072, 1024, {"num_heads": 12}),
    ("qwen3.5-4b", "qwen3_5", 24, 1024, 4096, 2560),
    ("qwen3.5-9b", "qwen3_5", 27, 1152, 4304, 4096),
    ("qwen3.5-27b", "qwen3_5", 27, 1152, 4304, 5120),
    ("qwen3.5-35b-a3b", "qwen3_5_moe", 27, 1152, 4304, 2048),
    ("qwen3.5-122b-a10b", "qwen3_5_moe", 27, 1152, 4304, 3072),
    ("qwen3.5-397b-a17b", "qwen3_5_moe", 27, 1152, 4304, 4096),
    ("qwen3.6-27b", "qwen3_5", 27, 1152, 4304, 5120),
    ("qwen3.8-27b", "qwen3_5", 27, 1152, 4304, 5120),
    ("qwen3.8-flash-next", "qwen4_exp", 27, 1152, 4304, 2560),
)}


def is_preset(source: str) -> bool:
    """Whether ``source`` names a preset (a size, no weights), not a folder of that name."""
    return source.lower() in PRESETS and not Path(source).is_dir()


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
        try:
            data = json.loads(Path(config).read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read config {os.fspath(config)}: {e}") from e
        return from_config_json(data)
    raise ConfigError(f"{config!r} is neither a preset ({sorted(PRESETS)}) nor a config.json file")
