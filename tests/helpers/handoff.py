"""Tiny random full VLMs of every family, written with transformers' own ``save_pretrained``, and prompts for them.

One folder feeds both sides of tests/outputs/test_handoff.py: transformers loads the whole model from it, our
``load_encoder`` reads its vision tensors, and both image (and video) processors read its preprocessor files.
The tower is the family's small test tower (tests.helpers.FAMILY_SMALL) with ``out_hidden_size`` = the text
width; the language model is 2 layers of width 64 over a 128-token vocabulary. Every weight has real spread
(``spread_init_``): with transformers' 0.02 init every position's logits look alike and a wrong embedding or a
misplaced DeepStack level would barely show.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qwenvl_vision.model.config import FAMILIES, QWEN2_5
from qwenvl_vision.model.random_init import spread_init_
from tests.helpers import (
    FAMILY_SMALL,
    PREPROCESSOR_FILES,
    QWEN3_VIDEO_PREPROCESSOR_FILE,
    hf_vision_fields,
    photo,
    synthetic_photo,
)

TEXT_WIDTH = 64
TEXT = dict(vocab_size=128, hidden_size=TEXT_WIDTH, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
# Placeholder ids inside the tiny vocabulary (the releases' 151655... or 248056... would not fit).
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 100, 101, 102, 103
AUDIO_TOKEN, AUDIO_START, AUDIO_END = 104, 105, 106
TOKEN_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                 vision_end_token_id=VISION_END)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# M-RoPE sections sum to half the rotary width: head_dim 16 -> 8 (Qwen3.5 / Qwen4-Exp rotate half of it: 4).
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
MROPE_INTERLEAVED = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4,
              rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                               "partial_rotary_factor": 0.5})
QWEN4_EXP = dict(HYBRID, **MOE, shared_expert_intermediate_size=32,
                 layer_types=["linear_attention", "indexed_attention"], hc_count=2, hc_lowrank=8,
                 indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64,
                 indexer_compress_ratio=4)


@dataclass(frozen=True)
class FullModel:
    """A family's full transformers model: its config and model classes and the text config's extra fields."""

    config_class: str
    model_class: str
    text: dict
    thinker: bool = False  # an Omni model: the language model is ``model.thinker``, the config nests it

    def classes(self, family: str) -> tuple[type, type]:
        config_module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        model_module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return getattr(config_module, self.config_class), getattr(model_module, self.model_class)


FULL_MODELS: dict[str, FullModel] = {
    "qwen2_vl": FullModel("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(rope_parameters=MROPE)),
    "qwen2_5_vl": FullModel("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(rope_parameters=MROPE)),
    "qwen2_5_omni": FullModel("Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration",
                              dict(rope_parameters=MROPE), thinker=True),
    "qwen3_vl": FullModel("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                          dict(rope_parameters=MROPE_INTERLEAVED)),
    "qwen3_vl_moe": FullModel("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                              dict(MOE, rope_parameters=MROPE_INTERLEAVED)),
    "qwen3_omni_moe": FullModel("Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration",
                                dict(MOE, rope_parameters=MROPE_INTERLEAVED), thinker=True),
    "qwen3_5": FullModel("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", HYBRID),
    "qwen3_5_moe": FullModel("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                             dict(HYBRID, **MOE, shared_expert_intermediate_size=32)),
    "qwen4_exp": FullModel("Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration", QWEN4_EXP),
}
assert set(FULL_MODELS) == set(FAMILIES)


def full_config(family: str):
    """The tiny full config: the family's small test tower feeding a 2-layer language model of width 64."""
    full = FULL_MODELS[family]
    config_class, _ = full.classes(family)
    vision = hf_vision_fields(FAMILY_SMALL[family].replace(out_hidden_size=TEXT_WIDTH))
    text = dict(TEXT, **full.text)
    if not full.thinker:
        return config_class(text_config=text, vision_config=vision, **TOKEN_IDS)
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=TEXT_WIDTH)
    if family == "qwen2_5_omni":  # this thinker config spells the placeholder ids ..._index
        ids = dict(image_token_index=IMAGE_TOKEN, video_token_index=VIDEO_TOKEN, audio_token_index=AUDIO_TOKEN,
                   audio_end_token_id=AUDIO_END)
    else:
        ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, audio_token_id=AUDIO_TOKEN)
        audio["downsample_hidden_size"] = 8
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, audio_start_token_id=AUDIO_START,
                   vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, **ids)
    return config_class(thinker_config=thinker, enable_audio_output=False)


def language_model(model: torch.nn.Module, family: str) -> torch.nn.Module:
    """The module that takes input_ids and vision inputs and gives logits (an Omni model's thinker)."""
    return model.thinker if FULL_MODELS[family].thinker else model


def write_full_model(folder: Path, family: str, seed: int = 0) -> Path:
    """A tiny full VLM of ``family`` saved by transformers in ``folder``, with the preprocessor files its release
    carries (and our loader and transformers' processors read)."""
    _, model_class = FULL_MODELS[family].classes(family)
    config = full_config(family)
    with torch.device("cpu"):
        model = model_class._from_config(config, dtype=torch.float32)
    spread_init_(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    cfg = FAMILY_SMALL[family]
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_FILES[cfg.design]))
    if FAMILIES[family].video_sampling == "qwen3":
        (folder / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VIDEO_PREPROCESSOR_FILE))
    if family == "qwen2_5_omni":  # its from_pretrained requires the release's speaker file, even without a talker
        torch.save({}, folder / "spk_dict.pt")
    return folder


def load_full_model(folder: Path, family: str) -> torch.nn.Module:
    _, model_class = FULL_MODELS[family].classes(family)
    model = model_class.from_pretrained(folder, dtype=torch.float32)
    return language_model(model, family).eval().requires_grad_(False)


def prompt_images() -> list:
    """Two photos of different sizes and aspect ratios (PIL, as a user hands them to either processor)."""
    from PIL import Image

    return [Image.fromarray(photo(70, 100)), Image.fromarray(photo(90, 60, seed=1))]


def prompt_video() -> np.ndarray:
    """Four distinct frames (F, H, W, C) uint8: two temporal patches."""
    return np.stack([synthetic_photo(64, 80, seed=10 + i, noise=20.0) for i in range(4)])


def tokens_of(grid, merge_size: int = 2) -> int:
    t, h, w = (int(v) for v in grid)
    return t * h * w // merge_size**2


def frame_split_video(family: str) -> bool:
    """Whether the family's M-RoPE reads a video as one (1, h, w) item per temporal patch, each frame between its
    own vision start/end tokens after a timestamp (Qwen3-VL's processor; get_rope_index repeats the grid)."""
    return FAMILIES[family].design != QWEN2_5 and family != "qwen3_omni_moe"


def prompt_ids(family: str, image_grids, video_grids=()) -> torch.Tensor:
    """(1, L) input_ids: text, each image's placeholders between vision start/end, then each video's, then text.
    Text ids are small numbers away from the special ones (a timestamp stands before each Qwen3-VL frame)."""
    ids = [2, 3, 4]
    for i, grid in enumerate(image_grids):
        ids += [VISION_START] + [IMAGE_TOKEN] * tokens_of(grid) + [VISION_END] + [5 + i]
    for grid in video_grids:
        t, h, w = (int(v) for v in grid)
        if frame_split_video(family):
            for frame in range(t):
                ids += [20 + frame] + [VISION_START] + [VIDEO_TOKEN] * tokens_of((1, h, w)) + [VISION_END]
        else:
            ids += [VISION_START] + [VIDEO_TOKEN] * tokens_of(grid) + [VISION_END]
    ids += [7, 8, 9]
    return torch.tensor([ids])
