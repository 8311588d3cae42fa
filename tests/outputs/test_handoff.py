"""qwenvl_vision.outputs.handoff proven through the whole VLM: for every family transformers 5.24 has a full model
for, a tiny random VLM written by transformers' ``save_pretrained`` feeds both our ``load_encoder`` and transformers'
model, and the language model gives the same logits and the same greedy tokens from our embeddings
(``mm_encoder_outputs=to_transformers(...)``) as from its own processor's ``pixel_values`` (the records of an
``embed`` run read back are bitwise the encoder's: tests/embed/test_reader.py).

The prompt: text, two images of different sizes, a 4-frame video (2 temporal patches), text; each item's
placeholders between vision start/end tokens (Qwen3-VL-style families: one block per temporal patch after a
timestamp token, as their processor writes it). From our encoder's embeddings the whole logits are within 1e-5
relative of the pixel path's (fp32); the model's own encoder outputs handed over through the same functions give
its logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from qwenvl_vision import load_encoder
from qwenvl_vision.errors import ConfigError, InputError
from qwenvl_vision.model.config import FAMILIES
from qwenvl_vision.outputs.handoff import (
    EncodedItems,
    mm_token_type_ids,
    split_vllm_deepstack,
    to_transformers,
    to_vllm,
)
from tests.helpers import FAMILY_SMALL, rel_err
from tests.helpers.handoff import (
    FULL_MODELS,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    load_full_model,
    prompt_ids,
    prompt_images,
    prompt_video,
    write_full_model,
)

pytest.importorskip("torchvision", reason="transformers' image and video processors (the pixel side) need it")

TOL = 1e-5
NEW_TOKENS = 4
# Every family's full model builds and runs on the CPU in transformers 5.24; none is skipped. A family's setup and
# each of its checks take well under 5 s (the whole file ~20 s on 2 cores), so all stay in the fast lane.
FAMILY_LIST = list(FULL_MODELS)


@dataclasses.dataclass
class Case:
    family: str
    model: torch.nn.Module
    input_ids: torch.Tensor
    pixels: dict  # the processor's outputs: pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
    common: dict  # what both paths pass besides the vision inputs (mm_token_type_ids; Omni: seconds per grid)
    images: object  # our EncodeResult for the two images
    video: object  # ... and for the video
    folder: object  # the one set of files both sides read


@pytest.fixture(scope="module", params=FAMILY_LIST)
def case(request, tmp_path_factory) -> Case:
    family = request.param
    from transformers import AutoImageProcessor, AutoVideoProcessor

    folder = write_full_model(tmp_path_factory.mktemp(family), family)
    model = load_full_model(folder, family)
    images, frames = prompt_images(), prompt_video()
    image_inputs = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
    video_inputs = AutoVideoProcessor.from_pretrained(folder)(videos=[frames], do_sample_frames=False,
                                                             return_tensors="pt")
    pixels = {"pixel_values": image_inputs["pixel_values"], "image_grid_thw": image_inputs["image_grid_thw"],
              "pixel_values_videos": video_inputs["pixel_values_videos"],
              "video_grid_thw": video_inputs["video_grid_thw"]}
    # resize="torch": transformers 5.x resizes with torchvision whatever the file names (docs/api.md, which pipeline).
    with load_encoder(str(folder), device="cpu", dtype="fp32") as encoder:
        assert encoder.family == family
        ours_images = encoder.encode_images(images, resize="torch")
        ours_video = encoder.encode_videos([frames])
    assert ours_images.grid_thw.tolist() == pixels["image_grid_thw"].tolist()
    assert ours_video.grid_thw.tolist() == pixels["video_grid_thw"].tolist()
    # The results say their modality and family themselves (the hand-off reads them); the prompt uses the tiny
    # vocabulary's ids.
    assert [(r.modality, r.family) for r in (ours_images, ours_video)] == [("image", family), ("video", family)]
    assert (model.config.image_token_id, model.config.video_token_id) == (IMAGE_TOKEN, VIDEO_TOKEN)
    input_ids = prompt_ids(family, pixels["image_grid_thw"].tolist(), pixels["video_grid_thw"].tolist())
    if FULL_MODELS[family].thinker:  # the Omni thinkers place items by their vision start token, videos in time
        common = {"video_second_per_grid": torch.tensor([1.0])}
    else:
        common = {"mm_token_type_ids": mm_token_type_ids(input_ids, image_token_id=model.config.image_token_id,
                                                         video_token_id=model.config.video_token_id)}
    return Case(family, model, input_ids, pixels, common, ours_images, ours_video, folder)


def logits(case: Case, **vision) -> torch.Tensor:
    with torch.no_grad():
        return case.model(input_ids=case.input_ids, **case.common, **vision).logits[0]


def position_errors(ours: torch.Tensor, ref: torch.Tensor) -> list[float]:
    return [rel_err(a, b) for a, b in zip(ours, ref, strict=True)]


def test_the_models_own_encoder_outputs_handed_over_give_bitwise_its_logits(case):
    """The layout alone, without the two towers' rounding: the model's own get_image_features / get_video_features
    outputs, read as stored records and handed back through to_transformers, give exactly the logits of its pixel
    path (a wrong item order, level order or grid would not)."""
    with torch.no_grad():
        own = {"image": case.model.get_image_features(case.pixels["pixel_values"], case.pixels["image_grid_thw"]),
               "video": case.model.get_video_features(case.pixels["pixel_values_videos"],
                                                      case.pixels["video_grid_thw"])}
    stored = []
    for modality, out in own.items():
        levels = list(getattr(out, "deepstack_features", None) or [])
        per_item = [[level[i] for level in levels] for i in range(len(out.pooler_output))]
        stored.append(EncodedItems(list(out.pooler_output), case.pixels[f"{modality}_grid_thw"].tolist(), per_item,
                                   modality, case.family))
    assert torch.equal(logits(case, **to_transformers(*stored)), logits(case, **case.pixels))


def test_logits_from_our_embeddings_equal_the_logits_from_pixels(case, record_property):
    """Whole-logits relative error within 1e-5 (fp32); the largest per-position error is reported beside it (the
    hybrid linear-attention models amplify the towers' ~1e-6 rounding differences to up to 5e-5 at a few positions).
    The comparison can fail: one image's embedding off by 1e-3 (or, with DeepStack, its levels zeroed) moves the
    logits well past the tolerance."""
    reference = logits(case, **case.pixels)
    handed = case.images.to_transformers(case.video, dtype=case.model.dtype, device=case.model.device)
    ours = logits(case, **handed)
    whole, per_position = rel_err(ours, reference), max(position_errors(ours, reference))
    record_property("logits_rel_err", whole)
    record_property("max_position_rel_err", per_position)
    print(f"\n{case.family}: logits relative error {whole:.2e}, largest per position {per_position:.2e}")
    assert whole <= TOL, f"{case.family}: whole-logits relative error {whole:.2e} over {TOL}"
    first, second = case.images.embeddings
    changed = [EncodedItems([first, second * 1.001], case.images.grid_thw, case.images.deepstack, "image", case.family)]
    if FAMILIES[case.family].deepstack:
        flat = [[torch.zeros_like(level) for level in levels] for levels in case.images.deepstack]
        changed.append(EncodedItems(case.images.embeddings, case.images.grid_thw, flat, "image", case.family))
    for images in changed:
        assert max(position_errors(logits(case, **to_transformers(images, case.video)), reference)) > 10 * TOL


def test_greedy_generate_gives_the_same_tokens(case):
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad():
        from_pixels = case.model.generate(input_ids=case.input_ids, **case.common, **case.pixels, **settings)
        from_ours = case.model.generate(input_ids=case.input_ids, **case.common,
                                        **to_transformers(case.images, case.video), **settings)
    assert from_pixels.shape[1] == case.input_ids.shape[1] + NEW_TOKENS
    assert from_ours.tolist() == from_pixels.tolist()


def test_pixels_and_embeddings_together_are_refused_by_transformers(case):
    with pytest.raises(ValueError, match="mm_encoder_outputs"):
        logits(case, **case.pixels, mm_encoder_outputs=to_transformers(case.images)["mm_encoder_outputs"])


def test_vllm_layout_splits_back_bitwise(case):
    """The layout split back as vLLM splits it (tests/contract/ runs vLLM's own code). The video's frames were
    given in memory, so its frame timing is given as the frames' own (the Qwen3-VL families' vLLM models need
    their timestamps, the Omni thinkers' the seconds per temporal patch; without it to_vllm refuses, naming
    video_info)."""
    video, family = case.video, FAMILIES[case.family]
    if family.prompt_timestamps or family.seconds_per_grid:
        with pytest.raises(InputError, match="video_info"):
            to_vllm(case.images, case.video)
        frames = 2 * int(video.grid_thw[0, 0])
        infinite = {"frames": list(range(frames)), "fps": math.inf, "requested_fps": math.inf}
        infinite = EncodedItems(video.embeddings, video.grid_thw, video.deepstack, "video", case.family,
                                video_info=[infinite])
        with pytest.raises(InputError, match="video_info"):  # no time per frame (it once gave 0 s per patch)
            to_vllm(infinite)
        video = EncodedItems(video.embeddings, video.grid_thw, video.deepstack, "video", case.family,
                             video_info=[{"frames": list(range(frames)), "fps": 4.0, "requested_fps": 4.0}])
    data = case.images.to_vllm(video)
    assert set(data) == {"image", "video"}
    # frames 0-3 at 4 fps: the mean time of each pair; 2 frames per temporal patch, asked at 4 fps
    assert data["video"].get("timestamps") == ([[0.125, 0.625]] if family.prompt_timestamps else None)
    seconds = data["video"].get("second_per_grid_ts")
    assert (None if seconds is None else seconds.tolist()) == ([0.5] if family.seconds_per_grid else None)
    for modality, result in [("image", case.images), ("video", case.video)]:
        embeds, grid = data[modality][f"{modality}_embeds"], data[modality][f"{modality}_grid_thw"]
        levels = len(result.deepstack[0])
        width = result.embeddings[0].shape[1]
        assert levels == len(FAMILY_SMALL[case.family].deepstack_visual_indexes)
        assert embeds.shape == (sum(e.shape[0] for e in result.embeddings), width * (1 + levels))
        assert torch.equal(grid, result.grid_thw.long())
        merged, split_levels = split_vllm_deepstack(embeds, levels)
        assert torch.equal(merged, torch.cat(list(result.embeddings)))
        assert len(split_levels) == levels
        for k, level in enumerate(split_levels):
            assert torch.equal(level, torch.cat([item[k] for item in result.deepstack])), k


def test_a_dtype_given_where_results_go_is_refused_naming_it(case):
    for hand_over in (case.images.to_transformers, case.images.to_vllm):
        with pytest.raises(InputError, match="result 1"):
            hand_over(torch.bfloat16)


# ----------------------------------------------------------------------------- without a model


def items(family="qwen3_vl", levels=2, grids=((1, 4, 6), (1, 2, 2)), width=8, modality="image"):
    gen = torch.Generator().manual_seed(0)
    counts = [t * h * w // 4 for t, h, w in grids]
    embeddings = [torch.randn(n, width, generator=gen) for n in counts]
    deepstack = [[torch.randn(n, width, generator=gen) for _ in range(levels)] for n in counts]
    return EncodedItems(embeddings, torch.tensor(grids), deepstack, modality, family)


def test_the_transformers_output_has_the_familys_shape_and_dtype_when_asked():
    handed = to_transformers(items(), dtype=torch.bfloat16, device="cpu")
    out = handed["mm_encoder_outputs"]["image"]
    assert type(out).__name__ == "BaseModelOutputWithDeepstackFeatures" and handed["image_grid_thw"].dtype == torch.long
    assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == 2
    assert len(out.deepstack_features) == 2 and all(len(level) == 2 for level in out.deepstack_features)
    assert all(t.dtype == torch.bfloat16 for t in [*out.pooler_output, *sum(out.deepstack_features, ())])
    plain = to_transformers(items("qwen3_5", levels=0))["mm_encoder_outputs"]["image"]
    assert type(plain).__name__ == "BaseModelOutputWithPooling" and not hasattr(plain, "deepstack_features")
    assert to_vllm(items(), dtype=torch.float16)["image"]["image_embeds"].dtype == torch.float16


def test_a_hand_off_takes_the_dtype_and_device_spellings_load_encoder_takes():
    assert to_vllm(items(), dtype="bf16")["image"]["image_embeds"].dtype == torch.bfloat16
    out = to_transformers(items(), dtype="float16", device="cpu")["mm_encoder_outputs"]["image"]
    assert all(t.dtype == torch.float16 for t in out.pooler_output)
    for hand_over in (to_transformers, to_vllm):
        for wrong, culprit in ((dict(dtype="bf8"), "dtype 'bf8'"), (dict(dtype=16), "dtype 16"),
                               (dict(device="gpu"), "device 'gpu'")):
            with pytest.raises(ConfigError, match=culprit):
                hand_over(items(), **wrong)


def test_results_of_one_modality_are_joined_in_order():
    a, b = items(grids=((1, 2, 2),)), items(grids=((1, 4, 4),))
    handed = to_transformers(a, b)
    assert handed["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    assert [t.shape[0] for t in handed["mm_encoder_outputs"]["image"].pooler_output] == [1, 4]


def test_an_empty_result_hands_over_a_grid_table_of_no_rows():
    empty = EncodedItems([], torch.zeros(0, 3, dtype=torch.long), [], "image", "qwen3_vl")
    assert to_transformers(empty)["image_grid_thw"].shape == to_vllm(empty)["image"]["image_grid_thw"].shape == (0, 3)


def grids(grid_thw):
    return lambda r: dataclasses.replace(r, grid_thw=grid_thw)


@pytest.mark.parametrize("broken, message", [
    (grids(torch.tensor([[1, 4, 6]])), "2 embeddings but 1 grids"),
    (grids(torch.tensor([[1, 4, 6], [1, 4, 4]])), "item 1"),
    (lambda r: dataclasses.replace(r, deepstack=None), "DeepStack levels for every item"),
    (lambda r: dataclasses.replace(r, family="qwen2_5_vl"), "no DeepStack levels"),
    (lambda r: dataclasses.replace(r, modality="audio"), "modality"),
    (lambda r: dataclasses.replace(r, family="qwen9"), "unknown family"),
    (lambda r: dataclasses.replace(r, deepstack=[r.deepstack[0], r.deepstack[1][:1]]), "levels per item"),
    (lambda r: SimpleNamespace(embeddings=r.embeddings, grid_thw=r.grid_thw), "not an encode result"),
    # Grids no tower makes: checked as the tower checks its own (model.execution.check_grids).
    (grids([[1, -2, -2], [1, 2, 2]]), r"item 0: grid \(1, -2, -2\) is not a tower's"),
    (grids([[1.9, 4, 6], [1, 2, 2]]), r"dtype torch.float32, not an \(n, 3\) table of integers"),
    (grids([1, 4, 6, 1, 2, 2]), r"grid_thw of shape \(6,\)"),
    (grids([[1, 4, 6], [1, 2]]), r"grid_thw is not an \(n, 3\) table of integers"),
    (grids([[1, 4, 6], [1, 2, 3]]), r"item 1: grid \(1, 2, 3\) is not a tower's"),
    (lambda r: dataclasses.replace(r, merge_size=0), "merge size 0 is not a positive integer"),
    # A level of another width would be split back (vLLM's _compute_deepstack_embeds) into other features.
    (lambda r: dataclasses.replace(r, deepstack=[r.deepstack[0], [r.deepstack[1][0], torch.zeros(1, 16)]]),
     r"item 1: DeepStack level 1 of shape \(1, 16\)"),
    (lambda r: dataclasses.replace(r, embeddings=[r.embeddings[0], torch.zeros(1)]), r"item 1: embedding of shape"),
    (lambda r: dataclasses.replace(r, video_info=[None]), "2 embeddings but 1 video_info entries"),
])
def test_inconsistent_items_are_named_in_one_line(broken, message):
    for handoff in (to_transformers, to_vllm):
        with pytest.raises(InputError, match=message) as caught:
            handoff(broken(items()))
        assert "\n" not in str(caught.value)


def test_an_odd_count_of_frames_is_padded_with_the_last_as_vllm_pads_it_and_frames_may_be_an_array():
    """vLLM's _calculate_timestamps: frames 0, 2, 4 at 2 fps, padded with 4, are the patches (0+1)/2 and (2+2)/2."""
    import numpy as np

    clip = items("qwen3_5", levels=0, grids=((2, 2, 2),), modality="video")
    for frames, fps in (([0, 2, 4], 2.0), (np.array([0, 2, 4]), np.float64(2.0)), (torch.tensor([0, 2, 4]),
                                                                                        torch.tensor(2.0))):
        handed = to_vllm(dataclasses.replace(clip, video_info=[{"frames": frames, "fps": fps}]))
        assert handed["video"]["timestamps"] == [[0.5, 2.0]]
    with pytest.raises(InputError, match="no frame indices"):
        to_vllm(dataclasses.replace(clip, video_info=[{"frames": np.int64(0), "fps": 2.0}]))


def test_results_of_two_families_are_refused_not_joined():
    """A family's output class and its video timing fields differ, even between towers of one layout."""
    for first, second in (("qwen3_vl", "qwen3_vl_moe"), ("qwen2_5_vl", "qwen2_5_omni")):
        levels = 2 if FAMILIES[first].deepstack else 0
        for handoff in (to_vllm, to_transformers):
            with pytest.raises(InputError, match="different families"):
                handoff(items(first, levels), items(second, levels))


def test_items_of_two_widths_or_dtypes_are_refused_not_joined():
    for other in (items(grids=((1, 2, 2),), width=16), EncodedItems(
            [e.to(torch.bfloat16) for e in items().embeddings], items().grid_thw,
            [[level.to(torch.bfloat16) for level in levels] for levels in items().deepstack], "image", "qwen3_vl")):
        for handoff in (to_vllm, to_transformers):
            with pytest.raises(InputError, match="differ in width, dtype or DeepStack levels"):
                handoff(items(), other)


def test_split_refuses_a_width_that_does_not_divide():
    with pytest.raises(InputError, match="feature blocks"):
        split_vllm_deepstack(torch.zeros(3, 10), 2)


def test_a_tower_of_another_merge_size_hands_over_its_own_token_counts():
    """A tower with spatial_merge_size 1 makes one token per patch: its result carries the merge size, and the
    hand-off holds the tokens to it (it assumed 2x2 and refused every item); results of two merge sizes are not
    joined."""
    import numpy as np

    cfg = FAMILY_SMALL["qwen3_vl"].replace(spatial_merge_size=1)
    pre = {"patch_size": cfg.patch_size, "merge_size": 1, "temporal_patch_size": cfg.temporal_patch_size,
           "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "min_pixels": 1024, "max_pixels": 96 * 96}
    encoder = load_encoder(cfg, random_weights=True, device="cpu", cpu_kernels="reference", preprocess_config=pre)
    result = encoder.encode_images([np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8)])
    (t, h, w), = result.grid_thw.tolist()
    assert result.merge_size == 1 and result.embeddings[0].shape[0] == t * h * w
    assert to_vllm(result)["image"]["image_embeds"].shape[0] == t * h * w
    assert [e.shape[0] for e in to_transformers(result)["mm_encoder_outputs"]["image"].pooler_output] == [t * h * w]
    with pytest.raises(InputError, match=r"different merge sizes: \[1, 2\]"):
        to_vllm(result, items(width=result.embeddings[0].shape[1]))


def test_each_video_s_timestamps_come_from_its_own_frames_and_must_fill_its_grid():
    """Videos in one result: each its own video_info's timestamps, in order; frames that make another count of
    temporal patches than its grid's t, or none at all, are refused naming the video (not vLLM's error later)."""
    clips = items("qwen3_5", levels=0, grids=((1, 2, 2), (2, 2, 2)), modality="video")
    infos = [{"frames": [0, 1], "fps": 2.0}, {"frames": [0, 2, 4, 6], "fps": 4.0}]
    assert to_vllm(dataclasses.replace(clips, video_info=infos))["video"]["timestamps"] == [[0.25], [0.25, 1.25]]
    for frames, message in (([0, 1, 2, 3, 4, 5], r"video 0: 6 sampled frames make 3 temporal patches, but its grid "
                                                 r"has t=1"),
                            ([], r"video 0: .*no frame indices")):
        with pytest.raises(InputError, match=message):
            to_vllm(dataclasses.replace(clips, video_info=[{"frames": frames, "fps": 2.0}, infos[1]]))


def test_an_omni_video_s_seconds_per_patch_come_from_the_fps_asked_not_the_source_rate():
    """The Omni thinkers' processors: temporal_patch_size / requested fps. A 10 fps file sampled at 2 fps is 1 s per
    patch; a video_info with only the source rate is refused, naming requested_fps."""
    clip = items("qwen2_5_omni", levels=0, grids=((2, 2, 2),), modality="video")
    info = {"frames": [0, 5, 10, 15], "fps": 10.0, "requested_fps": 2.0}
    assert to_vllm(dataclasses.replace(clip, video_info=[info]))["video"]["second_per_grid_ts"].tolist() == [1.0]
    with pytest.raises(InputError, match="no requested_fps"):
        to_vllm(dataclasses.replace(clip, video_info=[{"frames": [0, 5, 10, 15], "fps": 10.0}]))


def test_vllm_grids_are_long_and_wrong_devices_and_level_counts_are_named():
    assert to_vllm(items())["image"]["image_grid_thw"].dtype == torch.long
    for hand_over in (to_transformers, to_vllm):
        with pytest.raises(ConfigError, match="device 1.5"):
            hand_over(items(), device=1.5)
    for levels in (-1, -2):
        with pytest.raises(InputError, match="feature blocks"):
            split_vllm_deepstack(torch.zeros(3, 8), levels)
