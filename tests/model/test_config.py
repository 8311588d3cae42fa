"""Config parsing (``qwenvl_vision.model.config``): the released config.json files read as transformers reads them,
and absurd or damaged configs refused before anything is built, with a ConfigError naming the field. Each bad case
edits one value of a real-layout checkpoint's config.json or preprocessor_config.json."""

from __future__ import annotations

import json

import pytest

from qwenvl_vision import PRESETS, ConfigError, build_model, from_config_json, load_encoder, preset
from qwenvl_vision.model.config import LIMITS
from tests.helpers import QWEN2_5_SMALL, write_checkpoint


def _edited(folder, change, file="config.json"):
    """A checkpoint in its released layout with one edit to one of its JSON files."""
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True)
    (folder / file).write_text(json.dumps(change(json.loads((folder / file).read_text()))))
    return folder


def _vision(**changes):
    def change(config):
        config["vision_config"].update(changes)
        return config
    return change


BAD_CONFIG_JSON = {
    "depth-1e6": (_vision(depth=10**6), r"vision_config\.depth = 1000000 is outside the supported range 1\.\.256"),
    "depth-1e5": (_vision(depth=10**5), r"vision_config\.depth = 100000"),
    "heads-0": (_vision(num_heads=0), r"vision_config\.num_heads = 0 is outside"),
    "depth-str": (_vision(depth="abc"), r"vision_config\.depth must be an integer, got 'abc'"),
    "depth-float": (_vision(depth=4.0), r"vision_config\.depth must be an integer, got 4\.0"),
    "depth-bool": (_vision(depth=True), r"vision_config\.depth must be an integer, got True"),
    "hidden-1e9": (_vision(hidden_size=10**9), r"vision_config\.hidden_size = 1000000000 is outside"),
    "heads-not-dividing": (_vision(num_heads=3), r"hidden_size 160 is not divisible by num_heads 3"),
    "head-dim": (_vision(num_heads=32), r"head_dim 5 .* multiple of 4"),
    "head-dim-even": (_vision(num_heads=16), r"head_dim 10 .* multiple of 4"),
    "fullatt-outside": (_vision(fullatt_block_indexes=[1, 9]), r"fullatt_block_indexes \[1, 9\]"),
    "fullatt-at-depth": (_vision(fullatt_block_indexes=[0, QWEN2_5_SMALL.depth]), r"must be distinct blocks below"),
    "fullatt-twice": (_vision(fullatt_block_indexes=[1, 1]), r"must be distinct blocks below"),
    "fullatt-str": (_vision(fullatt_block_indexes="1,3"), r"fullatt_block_indexes must be a list"),
    "fullatt-null": (_vision(fullatt_block_indexes=None), r"fullatt_block_indexes must be a list"),  # not "none"
    "act": (_vision(hidden_act="relu6"), r"hidden_act 'relu6' is not supported"),
    "act-list": (_vision(hidden_act=["gelu"]), r"hidden_act \['gelu'\] is not supported"),
    "window": (_vision(window_size=2), r"window_size 2 is smaller than one merged token"),
    "rope": (_vision(rope_theta=-1.0), r"rope_theta = -1\.0 is outside the supported range 1\.\.1e\+09"),
    "rope-tiny": (_vision(rope_theta=1e-300), r"rope_theta = 1e-300 is outside the supported range 1\.\.1e\+09"),
    "rope-huge": (_vision(rope_theta=1e12), r"rope_theta = 1000000000000\.0 is outside the supported range"),
    "rope-str": (_vision(rope_theta="1e4"), r"rope_theta must be a number, got '1e4'"),
    "patch": (_vision(patch_size=10**4), r"patch_size = 10000 is outside"),
    "list": (lambda config: [config], r"config\.json is not a JSON object \(found list\)"),
    "model-type": (lambda config: {**config, "model_type": "llava_next"}, r"'llava_next'"),
    "no-vision": (lambda config: {k: v for k, v in config.items() if k != "vision_config"}, r"no vision_config"),
}


@pytest.mark.parametrize("change,pattern", BAD_CONFIG_JSON.values(), ids=BAD_CONFIG_JSON)
def test_bad_config_json_is_refused_naming_the_field(tmp_path, change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_encoder(_edited(tmp_path, change), device="cpu")


@pytest.mark.parametrize("theta", [1, 1e6, 1e9])
def test_rope_theta_accepts_every_physical_base(tmp_path, theta):
    """The range's ends and a language model's base (1e6) load; only what lies outside is refused."""
    with load_encoder(_edited(tmp_path, _vision(rope_theta=theta)), device="cpu") as encoder:
        assert encoder.config.rope_theta == theta


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_every_limit_is_enforced_at_both_ends(name):
    """Each bound refuses the value just outside it, naming the field (a dropped check would pass silently here
    otherwise: the presets and the small towers all sit well inside)."""
    low, high = LIMITS[name]
    for value in (low - 1, high + 1):
        with pytest.raises(ConfigError, match=rf"vision_config\.{name} = {value} is outside the supported range"):
            QWEN2_5_SMALL.replace(**{name: value})


@pytest.mark.parametrize("change,pattern", [
    (lambda p: {**p, "max_pixels": -5}, r"PreprocessConfig\.max_pixels .*-5"),
    (lambda p: {**p, "min_pixels": "lots"}, r"PreprocessConfig\.min_pixels .*'lots'"),
    (lambda p: {**p, "image_mean": "abc"}, r"PreprocessConfig\.image_mean must be 3 numbers"),
    (lambda p: {**p, "image_std": [0.5, 0.0, 0.5]}, r"image_std must be non-zero"),
    (lambda p: {**p, "rescale_factor": "1/255"}, r"rescale_factor='1/255' is not supported"),
    (lambda p: {**p, "size": [1, 2]}, r"size must be a dict"),
    (lambda p: [p], r"preprocessor_config\.json is not a JSON object \(found list\)"),
], ids=["max-pixels", "min-pixels-str", "mean-str", "std-zero", "rescale-str", "size-list", "list"])
def test_bad_preprocessor_config_is_refused_naming_the_field(tmp_path, change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_encoder(_edited(tmp_path, change, file="preprocessor_config.json"), device="cpu")


# config.json excerpts as the released checkpoints write them
QWEN2_VL_2B_JSON = {  # the whole vision_config of Qwen2-VL-2B-Instruct: the rest are transformers' class defaults
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
    "vision_config": {"hidden_size": 1536, "in_chans": 3, "model_type": "qwen2_vl", "spatial_patch_size": 14},
}
QWEN2_5_3B_JSON = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
QWEN3_2B_JSON = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "text_config": {"hidden_size": 2048, "model_type": "qwen3_vl_text"},
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
QWEN3_MOE_JSON = {
    "model_type": "qwen3_vl_moe", "text_config": {"hidden_size": 2048, "model_type": "qwen3_vl_moe_text"},
    "vision_config": {**QWEN3_2B_JSON["vision_config"], "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "deepstack_visual_indexes": [8, 16, 24], "model_type": "qwen3_vl_moe"},
}
QWEN3_OMNI_JSON = {
    "model_type": "qwen3_omni_moe",
    "thinker_config": {"model_type": "qwen3_omni_moe_thinker", "text_config": {"hidden_size": 2048},
                       "vision_config": {**QWEN3_MOE_JSON["vision_config"], "image_size": 768,
                                         "apply_vit_abs_pos_embed": True, "out_hidden_size": 2048,
                                         "model_type": "qwen3_omni_moe_vision_encoder"}},
    "talker_config": {"model_type": "qwen3_omni_moe_talker"},
}
QWEN3_5_4B_JSON = {
    "model_type": "qwen3_5", "text_config": {"hidden_size": 2560, "model_type": "qwen3_5_text"},
    "vision_config": {"deepstack_visual_indexes": [], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "model_type": "qwen3_5",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}
RELEASED_JSON = {"qwen2-vl-2b": QWEN2_VL_2B_JSON, "qwen2.5-vl-3b": QWEN2_5_3B_JSON, "qwen3-vl-2b": QWEN3_2B_JSON,
                 "qwen3-vl-30b-a3b": QWEN3_MOE_JSON, "qwen3-omni-30b-a3b": QWEN3_OMNI_JSON,
                 "qwen3.5-4b": QWEN3_5_4B_JSON}


def test_released_config_json_is_its_preset_and_ours_round_trips():
    for name, config_json in RELEASED_JSON.items():
        assert from_config_json(config_json).replace(name=name) == preset(name), name
    # Older exports omit out_hidden_size: the text model's width.
    vision = {k: v for k, v in QWEN3_MOE_JSON["vision_config"].items() if k != "out_hidden_size"}
    assert from_config_json({**QWEN3_MOE_JSON, "vision_config": vision}).out_hidden_size == 2048
    for cfg in PRESETS.values():
        assert from_config_json(cfg.to_config_json()) == cfg


def test_settings_a_config_leaves_out_or_gives_twice_are_read_as_transformers_reads_them():
    """A Qwen3-VL vision_config without deepstack_visual_indexes has transformers' default DeepStack levels, not
    none; given at the top and in rope_parameters, the rotary base is rope_parameters' (what the modules read)."""
    from transformers import Qwen3VLConfig

    vision = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
              "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "num_position_embeddings": 2304,
              "rope_theta": 5000.0, "rope_parameters": {"rope_type": "axial", "rope_theta": 20000.0}}
    config = {"model_type": "qwen3_vl", "vision_config": vision, "text_config": {"hidden_size": 4096}}
    theirs = Qwen3VLConfig(**json.loads(json.dumps(config))).vision_config
    ours = from_config_json(config)
    assert list(ours.deepstack_visual_indexes) == list(theirs.deepstack_visual_indexes) == [8, 16, 24]
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 20000.0
    # The config classes' other names for heads and depth (attribute_map), also where Qwen2-VL's defaults apply; they
    # win over ours.
    from transformers import Qwen2VLConfig

    for cls, released in ((Qwen3VLConfig, config), (Qwen2VLConfig, QWEN2_VL_2B_JSON)):
        vision = {**released["vision_config"], "num_heads": 16, "depth": 30}
        aliased = {**released, "vision_config": {**vision, "num_attention_heads": 8, "num_hidden_layers": 28}}
        theirs = cls(**json.loads(json.dumps(aliased))).vision_config
        ours = from_config_json(aliased)
        assert (ours.num_heads, ours.depth) == (theirs.num_heads, theirs.depth) == (8, 28), cls.__name__


def test_build_model_takes_dict_preset_and_dataclass_and_names_what_it_cannot():
    for source in (QWEN3_2B_JSON, "qwen3-vl-2b", preset("qwen3-vl-2b")):
        assert build_model(source, device="meta").config.hidden_size == 1024
    with pytest.raises(ConfigError, match="qwen9"):
        build_model("qwen9-vl-1b")


def test_deepstack_levels_on_a_family_without_deepstack_are_refused():
    with pytest.raises(ConfigError, match="have no DeepStack"):
        preset("qwen3.5-4b").replace(deepstack_visual_indexes=(1,))
