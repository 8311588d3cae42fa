"""Loading released-layout checkpoints (``qwenvl_vision/checkpoint/weights.py`` through ``load_encoder``): outputs equal
transformers' tower holding the same weights, dtypes, strict errors, the attention backend (close(): tests/teardown).
The command line's extract-weights and inspect are in test_cli.py, the header rules in test_checkpoint_validation.py.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenvl_vision import CheckpointError, ConfigError, NumericalError, load_encoder
from qwenvl_vision.cli import main
from tests.helpers import (
    FAMILY_SMALL,
    LN_Q,
    PREPROCESSOR_FILES,
    QWEN2_5_SMALL,
    QWEN3_SMALL_72,
    assert_result_matches_reference,
    hf_forward,
    hf_tower,
    inputs,
    non_vision_shards,
    reference_outputs,
    rel_err,
    shard_of,
    synthetic_photo,
    write_checkpoint,
)

GRIDS = [(1, 6, 10), (2, 4, 4), (1, 2, 2)]


def _inputs(cfg):
    return inputs(cfg, GRIDS, seed=5)


@pytest.mark.parametrize("cfg,prefix,sharded,drop_llm", [
    (QWEN2_5_SMALL, "visual.", True, False),
    (QWEN2_5_SMALL, "visual.", True, True),
    (QWEN2_5_SMALL, "model.visual.", False, False),  # re-saved by transformers 4.52+
    (QWEN3_SMALL_72, "model.visual.", True, True),
    (QWEN3_SMALL_72, "model.visual.", False, False),
    (FAMILY_SMALL["qwen2_5_omni"], "thinker.model.visual.", False, False),  # transformers 5's module names
    (FAMILY_SMALL["qwen3_omni_moe"], "thinker.model.visual.", True, True),
], ids=["2.5-sharded", "2.5-sharded-no-llm", "2.5-single-new-prefix", "3-sharded-no-llm", "3-single",
        "2.5-omni-new-prefix", "3-omni-new-prefix"])
def test_load_matches_hf_tower(tmp_path, cfg, prefix, sharded, drop_llm):
    vision = write_checkpoint(tmp_path, cfg, prefix=prefix, sharded=sharded)
    if drop_llm:
        for shard in non_vision_shards(tmp_path):
            shard.unlink()
    encoder = load_encoder(tmp_path, device="cpu")
    assert encoder.dtype == torch.float32 and encoder.family == cfg.model_type
    pixel_values, grid_thw = _inputs(cfg)
    result = encoder.encode_patches(pixel_values, grid_thw)
    reference = reference_outputs(cfg, vision, pixel_values, grid_thw)
    assert [e.shape[0] for e in result.embeddings] == [t * h * w // 4 for t, h, w in GRIDS]
    assert result.grid_thw.tolist() == [list(g) for g in GRIDS]
    assert len(result.deepstack) == len(GRIDS)
    assert_result_matches_reference(result, reference, grid_thw, 1e-5)
    if not cfg.deepstack_visual_indexes:
        assert result.deepstack == [[] for _ in GRIDS]


@pytest.mark.parametrize("shards_left", [True, False], ids=["old-shards-kept", "old-shards-gone"])
def test_a_single_file_is_read_before_an_index_beside_it_as_transformers_does(tmp_path, shards_left):
    """save_pretrained rewriting a sharded folder as one file keeps the old index: transformers loads the single
    file (checked first), and so does load_encoder, never the index's stale shards."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=True, seed=1)
    old_shards = sorted(tmp_path.glob("model-*.safetensors"))
    vision = write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False, seed=2)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    if not shards_left:
        for shard in old_shards:
            shard.unlink()
    result = load_encoder(tmp_path, device="cpu").encode_patches(*_inputs(QWEN2_5_SMALL))
    pixel_values, grid_thw = _inputs(QWEN2_5_SMALL)
    assert_result_matches_reference(result, reference_outputs(QWEN2_5_SMALL, vision, pixel_values, grid_thw),
                                    grid_thw, 1e-5)


def _word_tokenizer():
    """The smallest tokenizer a Qwen processor takes (save_pretrained saves it beside the settings)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                               unk_token="<unk>")),
                                   unk_token="<unk>", extra_special_tokens={"image_token": words[1],
                                                                            "video_token": words[2]})


@pytest.mark.parametrize("release_file", [False, True], ids=["alone", "beside-the-release-file"])
def test_settings_a_transformers_5_processor_saved_are_read_where_transformers_reads_them(tmp_path, release_file):
    """transformers 5 saves a processor's settings nested in processor_config.json and reads them before
    preprocessor_config.json and video_preprocessor_config.json, naming its torchvision image processor
    ``Qwen2VLImageProcessor``: a fine-tune's own pixel bounds, image and video, and its image processor's pixels
    reach the tower, also where the release's preprocessor_config.json is still beside them."""
    pytest.importorskip("torchvision")
    from transformers import AutoImageProcessor, AutoVideoProcessor
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    vision = write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    if not release_file:
        (tmp_path / "preprocessor_config.json").unlink()
    norm = {key: PREPROCESSOR_FILES["qwen2_5"][key] for key in ("image_mean", "image_std")}
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(max_pixels=128 * 28 * 28, **norm),
                        video_processor=Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=36 * 28 * 28, **norm),
                        tokenizer=_word_tokenizer()).save_pretrained(tmp_path)
    assert not (tmp_path / "video_preprocessor_config.json").exists()
    image, frames = synthetic_photo(600, 800), np.stack([synthetic_photo(240, 320, seed=i) for i in range(4)])
    reference = hf_tower(QWEN2_5_SMALL, seed=None)
    reference.load_state_dict(vision, strict=True)
    with load_encoder(tmp_path, device="cpu") as encoder:
        assert encoder.preprocess_config.resize == "torch"  # transformers 5's processor, torchvision installed
        images, videos = encoder.encode_images([image]), encoder.encode_videos([frames])
    expected = AutoImageProcessor.from_pretrained(tmp_path)([image], return_tensors="pt")
    grid = expected["image_grid_thw"]
    assert images.grid_thw.tolist() == grid.tolist() == [[1, 18, 26]]  # the release's bounds give [1, 42, 58]
    assert_result_matches_reference(images, hf_forward(reference, expected["pixel_values"], grid), grid, 1e-4)
    expected = AutoVideoProcessor.from_pretrained(tmp_path)([frames], do_sample_frames=False, return_tensors="pt")
    grid = expected["video_grid_thw"]
    assert videos.grid_thw.tolist() == grid.tolist() == [[2, 10, 12]]  # the class defaults give [2, 18, 24]
    assert_result_matches_reference(videos, hf_forward(reference, expected["pixel_values_videos"], grid), grid, 1e-4)


def test_a_processor_config_entry_that_is_no_object_is_named(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": ["fps", 2]}))
    with pytest.raises(ConfigError, match=r"processor_config\.json: video_processor is not a JSON object"):
        load_encoder(tmp_path, device="cpu")


def test_fp16_warns_and_checks_finite(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_encoder(tmp_path, device="cpu", dtype="bf16")  # bf16 is safe: no warning
    with pytest.warns(UserWarning, match="float16"):
        encoder = load_encoder(tmp_path, device="cpu", dtype=torch.float16)
    with torch.no_grad():  # force an overflow: fp16 tops out at 65504
        encoder.model.blocks[0].mlp.down_proj.bias.fill_(60000)
        encoder.model.blocks[1].mlp.down_proj.bias.fill_(60000)
    with pytest.raises(NumericalError, match="float16"):  # a project error (and a FloatingPointError)
        encoder.encode_patches(*_inputs(QWEN2_5_SMALL))
    # A stream records the lost batch's inputs and goes on; encode_images raises the same error.
    images = [synthetic_photo(56, 84, i) for i in range(3)]
    (batch,) = list(encoder.iter_encode(images, max_batch_patches=1 << 14))
    assert [r.ok for r in batch] == [False] * 3 and all("float16" in r.error for r in batch)
    with pytest.raises(NumericalError, match="float16"):
        encoder.encode_images(images)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["as-stored", "converted"])
def test_loaded_weights_own_their_memory(tmp_path, dtype):
    """Nothing stays mapped to the files: overwriting every shard in place after a load changes no weight."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL)
    encoder = load_encoder(tmp_path, device="cpu", dtype=dtype)
    loaded = {name: tensor.clone() for name, tensor in encoder.model.state_dict().items()}
    for shard in tmp_path.glob("*.safetensors"):
        with open(shard, "r+b") as f:
            f.write(bytes(shard.stat().st_size))
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in encoder.model.state_dict().items())


def test_preprocessing_whose_patch_grid_is_not_the_towers_is_refused(tmp_path):
    write_checkpoint(tmp_path, QWEN3_SMALL_72, sharded=False)
    settings = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "merge_size": 4}))
    with pytest.raises(ConfigError, match="preprocessor config's merge_size is 4 but the vision tower's is 2"):
        load_encoder(tmp_path, device="cpu")


def test_autocast_runs_the_reference_path(tmp_path):
    """out= ops do not autocast: under torch.autocast the tower runs out of place, as the reference does."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    encoder = load_encoder(tmp_path, device="cpu")
    pixel_values, grid_thw = _inputs(QWEN2_5_SMALL)
    exact = torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings)
    assert mixed.dtype == torch.bfloat16 and rel_err(mixed, exact) <= 3e-2


def test_non_contiguous_pixel_values_are_read_as_they_are(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    encoder = load_encoder(tmp_path, device="cpu")
    pixel_values, grid_thw = _inputs(QWEN2_5_SMALL)
    strided = pixel_values.t().contiguous().t()
    assert not strided.is_contiguous()
    a, b = (torch.cat(encoder.encode_patches(x, grid_thw).embeddings) for x in (pixel_values, strided))
    assert torch.equal(a, b)


def test_defaults_on_cpu_machine(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL)
    encoder = load_encoder(tmp_path)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert encoder.device.type == expected
    assert encoder.dtype == (torch.bfloat16 if expected == "cuda" else torch.float32)


@pytest.mark.slow  # a released-size tower (on the meta device)
def test_random_weights_preset_allocates_on_target_dtype():
    encoder = load_encoder("qwen3-vl-2b", random_weights=True, device="meta", dtype="bf16")
    assert encoder.config.name == "qwen3-vl-2b"
    assert {p.dtype for p in encoder.model.parameters()} == {torch.bfloat16}
    with pytest.raises(CheckpointError, match="random_weights=True"):
        load_encoder("qwen3-vl-2b")


# ----------------------------------------------------------------------------- strict errors


@pytest.mark.parametrize("change,message", [  # named as the files spell them
    (lambda t: t.pop("visual.blocks.2.attn.qkv.bias"), r"missing 1 tensor\(s\): visual\.blocks\.2\.attn\.qkv\.bias"),
    (lambda t: t.update({"visual.extra.weight": torch.zeros(2)}), r"unexpected 1 tensor\(s\): visual\.extra\.weight"),
    (lambda t: t.update({LN_Q: torch.zeros(159)}), r"merger\.ln_q\.weight.*\(159,\), expected \(160,\)"),
], ids=["missing", "surplus", "wrong-shape"])
def test_a_tensor_missing_surplus_or_of_the_wrong_shape_is_named(tmp_path, change, message):
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_encoder(tmp_path, device="cpu")


@pytest.mark.parametrize("damage,message", [
    (lambda shard: shard.write_bytes(shard.read_bytes()[:-1000]), "truncated"),
    (lambda shard: shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"), "corrupt"),
    (lambda shard: shard.unlink(), "missing"),
], ids=["truncated", "corrupt", "missing"])
def test_a_truncated_corrupt_or_missing_shard_is_named(tmp_path, damage, message):
    write_checkpoint(tmp_path, QWEN2_5_SMALL)
    shard = shard_of(tmp_path, LN_Q)
    damage(shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*{message}"):
        load_encoder(tmp_path, device="cpu")


def test_processor_settings_are_refused_before_the_weights_are_read(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[LN_Q].fill_(float("nan"))  # what only reading the weights finds
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "do_pad": True}))
    with pytest.raises(ConfigError, match="do_pad"):
        load_encoder(tmp_path, device="cpu")


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        load_encoder(tmp_path / "nowhere", device="cpu")


# ----------------------------------------------------------------------------- attention backend


@pytest.mark.parametrize("attn_impl", ["flash", "torch_varlen"])
def test_a_fused_backend_that_cannot_run_here_is_refused(tmp_path, attn_impl, capsys):
    write_checkpoint(tmp_path, QWEN3_SMALL_72)
    with pytest.raises(ConfigError, match=rf"attn_impl '{attn_impl}' is not available: it runs on CUDA"):
        load_encoder(tmp_path, device="cpu", attn_impl=attn_impl)
    assert main(["embed", str(tmp_path / "config.json"), "--model", str(tmp_path), "--out", str(tmp_path / "out"),
                 "--attn", attn_impl]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qwenvl-vision embed: error: attn_impl '{attn_impl}' is not available: it runs on CUDA in "
                   "float16/bfloat16 only (this tower: cpu, torch.float32)"]  # refused before any shard is read


def test_auto_backend_is_chosen_once_and_shown(tmp_path):
    write_checkpoint(tmp_path, QWEN2_5_SMALL)
    encoder = load_encoder(tmp_path, device="cpu", dtype="bf16")
    assert encoder.describe()["attn_impl"] == "auto" and encoder.describe()["attention"] == "sdpa"
    with pytest.raises(ConfigError, match="not one of"):
        load_encoder(tmp_path, device="cpu", attn_impl="xformers")
