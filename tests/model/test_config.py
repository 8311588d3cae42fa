"""Absurd or damaged configs are refused before anything is built, in milliseconds, with a ConfigError naming the
field. Each case edits one value of a real-layout checkpoint's config.json or preprocessor_config.json."""

from __future__ import annotations

import json
import time

import pytest

from qwenvl_vision import ConfigError, QwenVLVisionError, VisionConfig, load_encoder
from qwenvl_vision.model.config import LIMITS
from tests.helpers import QWEN2_5_SMALL, write_checkpoint


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("released")
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True)
    return folder


def _with_config(folder, tmp_path, change, file="config.json"):
    """A copy of the checkpoint (shards linked, not copied) with one edit to a JSON file."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():
        if path.name == file:
            (copy / file).write_text(json.dumps(change(json.loads(path.read_text()))))
        else:
            (copy / path.name).symlink_to(path)
    return copy


def _vision(**changes):
    def change(config):
        config["vision_config"].update(changes)
        return config
    return change


@pytest.mark.parametrize("change,pattern", [
    (_vision(depth=10**6), r"vision_config\.depth = 1000000 is outside the supported range 1\.\.256"),
    (_vision(depth=10**5), r"vision_config\.depth = 100000"),
    (_vision(num_heads=0), r"vision_config\.num_heads = 0 is outside"),
    (_vision(depth="abc"), r"vision_config\.depth must be an integer, got 'abc'"),
    (_vision(depth=4.0), r"vision_config\.depth must be an integer, got 4\.0"),
    (_vision(hidden_size=10**9), r"vision_config\.hidden_size = 1000000000 is outside"),
    (_vision(num_heads=3), r"hidden_size 160 is not divisible by num_heads 3"),
    (_vision(num_heads=32), r"head_dim 5 .* multiple of 4"),
    (_vision(fullatt_block_indexes=[1, 9]), r"fullatt_block_indexes \[1, 9\] has entries outside depth 4: \[9\]"),
    (_vision(fullatt_block_indexes="1,3"), r"fullatt_block_indexes must be a list"),
    (_vision(hidden_act="relu6"), r"hidden_act 'relu6' is not supported"),
    (_vision(hidden_act=["gelu"]), r"hidden_act \['gelu'\] is not supported"),
    (_vision(window_size=2), r"window_size 2 is smaller than one merged token"),
    (_vision(rope_theta=-1.0), r"rope_theta = -1\.0 is outside the supported range 1\.\.1e\+09"),
    (_vision(rope_theta=1e-300), r"rope_theta = 1e-300 is outside the supported range 1\.\.1e\+09"),
    (_vision(rope_theta=1e12), r"rope_theta = 1000000000000\.0 is outside the supported range"),
    (_vision(rope_theta="1e4"), r"rope_theta must be a number, got '1e4'"),
    (_vision(patch_size=10**4), r"patch_size = 10000 is outside"),
    (lambda config: [config], r"config\.json is not a JSON object \(found an array\)"),
    (lambda config: {**config, "model_type": "llava_next"}, r"unsupported model_type 'llava_next'"),
    (lambda config: {k: v for k, v in config.items() if k != "vision_config"}, r"no vision_config section"),
], ids=["depth-1e6", "depth-1e5", "heads-0", "depth-str", "depth-float", "hidden-1e9", "heads-not-dividing",
        "head-dim", "fullatt-outside", "fullatt-str", "act", "act-list", "window", "rope", "rope-tiny", "rope-huge",
        "rope-str", "patch", "list", "model-type",
        "no-vision"])
def test_bad_config_json_is_refused_fast_naming_the_field(released, tmp_path, change, pattern):
    folder = _with_config(released, tmp_path, change)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=pattern):
        load_encoder(folder, device="cpu")
    assert time.perf_counter() - start < 1.0  # before any tower is built or any shard read


def test_settings_a_config_leaves_out_or_gives_twice_are_read_as_transformers_reads_them():
    """A Qwen3-VL vision_config without deepstack_visual_indexes has transformers' default DeepStack levels, not
    none; given at the top and in rope_parameters, the rotary base is rope_parameters' (what the modules read)."""
    from transformers import Qwen3VLConfig

    from qwenvl_vision.model.config import from_config_json

    vision = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
              "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "num_position_embeddings": 2304,
              "rope_theta": 5000.0, "rope_parameters": {"rope_type": "axial", "rope_theta": 20000.0}}
    config = {"model_type": "qwen3_vl", "vision_config": vision, "text_config": {"hidden_size": 4096}}
    theirs = Qwen3VLConfig(**json.loads(json.dumps(config))).vision_config
    ours = from_config_json(config)
    assert list(ours.deepstack_visual_indexes) == list(theirs.deepstack_visual_indexes) == [8, 16, 24]
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 20000.0


def test_rope_theta_accepts_every_physical_base(released, tmp_path):
    """The range's ends and a language model's base (1e6) load; only what lies outside is refused."""
    for theta in (1, 1e6, 1e9):
        (tmp_path / str(theta)).mkdir()
        folder = _with_config(released, tmp_path / str(theta), _vision(rope_theta=theta))
        with load_encoder(folder, device="cpu") as encoder:
            assert encoder.config.rope_theta == theta


@pytest.mark.parametrize("change,pattern", [
    (lambda p: {**p, "max_pixels": -5}, r"PreprocessConfig\.max_pixels must be a positive int, got -5"),
    (lambda p: {**p, "min_pixels": "lots"}, r"PreprocessConfig\.min_pixels must be a positive int, got 'lots'"),
    (lambda p: {**p, "image_mean": "abc"}, r"PreprocessConfig\.image_mean must be 3 numbers"),
    (lambda p: {**p, "image_std": [0.5, 0.0, 0.5]}, r"image_std must be non-zero"),
    (lambda p: {**p, "rescale_factor": "1/255"}, r"rescale_factor='1/255' is not supported"),
    (lambda p: {**p, "size": [1, 2]}, r"size must be a dict"),
    (lambda p: [p], r"preprocessor_config\.json is not a JSON object \(found an array\)"),
], ids=["max-pixels", "min-pixels-str", "mean-str", "std-zero", "rescale-str", "size-list", "list"])
def test_bad_preprocessor_config_is_refused_naming_the_field(released, tmp_path, change, pattern):
    folder = _with_config(released, tmp_path, change, file="preprocessor_config.json")
    with pytest.raises(ConfigError, match=pattern):
        load_encoder(folder, device="cpu")


def test_every_config_error_is_a_project_error():
    with pytest.raises(QwenVLVisionError):
        VisionConfig(family="qwen2_5_vl", depth=0, hidden_size=160, intermediate_size=96, num_heads=2,
                     out_hidden_size=64, patch_size=14)


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_every_limit_is_enforced_at_both_ends(name):
    """Each size bound refuses the value just outside it, naming the field (a dropped check would pass silently
    here otherwise: the presets and the small towers all sit well inside)."""
    low, high = LIMITS[name]
    for value in (low - 1, high + 1):
        with pytest.raises(ConfigError, match=rf"vision_config\.{name} = {value} is outside the supported range"):
            QWEN2_5_SMALL.replace(**{name: value})
