"""The public encoder (qwenvl_vision.encoder): encode_images / encode_videos / encode_patches end to end against
transformers' processors + tower, for every family, and what their results say (modality, family, video_info).

Images: the PIL processor always, and the torchvision processor (``resize="torch"``) where torchvision imports.
How inputs become batches (token bound, decode budget, prefetch) is tests/test_batching.py's.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoVideoProcessor

from qwenvl_vision import EncoderClosedError, load_encoder
from qwenvl_vision.errors import ConfigError, InputError, PreprocessError
from qwenvl_vision.model.config import FAMILIES
from tests.helpers import (
    FAMILY_SMALL,
    assert_result_matches_reference,
    hf_forward,
    hf_tower,
    synthetic_photo,
    write_checkpoint,
    write_video,
)
from tests.helpers import make_image_folder as make_folder
from tests.helpers import sample_photo as sample

pytest.importorskip("matplotlib.cbook")  # its bundled sample photos are the real pictures here


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Real photos in many sizes and modes, as files, PIL images, numpy and torch arrays."""
    folder = tmp_path_factory.mktemp("photos")
    hopper = Image.open(sample("grace_hopper.jpg")).convert("RGB")
    tall = hopper.crop((100, 0, 260, 600))
    small = hopper.resize((40, 47), Image.BICUBIC)  # upscaled by min_pixels
    cmyk = hopper.resize((300, 256)).convert("CMYK")
    gray = hopper.convert("L").resize((333, 211))
    palette = hopper.convert("P", palette=Image.ADAPTIVE, colors=64).resize((256, 192))
    tall.save(folder / "tall.png")
    return {
        "photo.jpg": sample("grace_hopper.jpg"),
        "rgba.png": Image.open(sample("Minduka_Present_Blue_Pack.png")),
        "logo_rgba": Image.open(sample("logo2.png")).convert("RGBA"),
        "tall-file": str(folder / "tall.png"),
        "small": small,
        "cmyk": cmyk,
        "gray": gray,
        "palette": palette,
        "numpy": np.asarray(hopper.resize((200, 150))),
        "torch": torch.from_numpy(np.array(hopper.resize((150, 220)))).permute(2, 0, 1).contiguous(),
    }


@pytest.fixture(scope="module", params=list(FAMILY_SMALL))
def setup(request, tmp_path_factory):
    cfg = FAMILY_SMALL[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    vision = write_checkpoint(folder, cfg, sharded=False)
    ref = hf_tower(cfg, seed=None)
    ref.load_state_dict(vision, strict=True)
    return load_encoder(folder, device="cpu"), ref, image_processor(folder, "pil"), cfg


def image_processor(folder, backend: str):
    """transformers' image processor of the checkpoint folder, loaded as transformers loads it: PIL or torchvision."""
    if backend == "torch":
        pytest.importorskip("torchvision")
    return AutoImageProcessor.from_pretrained(folder, backend="pil" if backend == "pil" else "torchvision")


def _reference_images(processor, images, **kwargs):
    """Reference inputs: processor on the images as transformers receives them (paths opened by it)."""
    out = processor(list(images), return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


_reference = torch.no_grad()(hf_forward)  # transformers' tower on a pack: (merged, [DeepStack levels])


@pytest.mark.parametrize("backend", ["pil", "torch"])
def test_encode_images_matches_processor_and_tower(setup, photos, backend):
    encoder, ref, _, cfg = setup
    processor = image_processor(encoder.source, backend)
    names = list(photos)
    images = [photos[n] for n in names]
    result = encoder.encode_images(images, max_batch_patches=4096, pooled=True, resize=backend)
    pixel_values, grid_thw = _reference_images(processor, images)
    assert torch.equal(result.grid_thw, grid_thw.to(torch.int64))
    assert (result.modality, result.family) == ("image", cfg.model_type)
    reference = _reference(ref, pixel_values, grid_thw)
    assert_result_matches_reference(result, reference, grid_thw, 1e-4)  # every item, every DeepStack level
    expected = reference[0].split((grid_thw.prod(1) // 4).tolist())
    for i, name in enumerate(names):
        assert result.embeddings[i].shape == expected[i].shape, name
        assert torch.allclose(result.pooled[i], expected[i].mean(0), atol=1e-5, rtol=1e-4), name
        assert len(result.deepstack[i]) == len(cfg.deepstack_visual_indexes) == len(reference[1])
    # normalize: the same vectors at unit length, as sentence-transformers' normalize_embeddings would give them
    unit = encoder.encode_images(images, max_batch_patches=4096, pooled=True, normalize=True, resize=backend).pooled
    expected_unit = torch.nn.functional.normalize(torch.stack([e.double().mean(0) for e in expected]), dim=-1)
    assert torch.allclose(unit.double(), expected_unit, atol=1e-6, rtol=1e-5)
    assert torch.allclose(unit.double().norm(dim=-1), torch.ones(len(names), dtype=torch.float64), atol=1e-6)


def test_pixel_bounds_override_per_call(setup, photos):
    encoder, ref, processor, _ = setup
    image = photos["photo.jpg"]
    bounds = {"min_pixels": 128 * 128, "max_pixels": 200 * 200}
    result = encoder.encode_images([image], resize="pil", **bounds)
    pixel_values, grid_thw = _reference_images(processor, [image], size={"shortest_edge": bounds["min_pixels"],
                                                                         "longest_edge": bounds["max_pixels"]})
    assert result.grid_thw.tolist() == grid_thw.tolist()
    assert_result_matches_reference(result, _reference(ref, pixel_values, grid_thw), grid_thw, 1e-4)


def video_processor(encoder):
    """transformers' video processor of the checkpoint folder, loaded as transformers loads it (from its
    video_preprocessor_config.json, else its preprocessor_config.json)."""
    pytest.importorskip("torchvision")
    return AutoVideoProcessor.from_pretrained(encoder.source)


def test_video_frames_match_video_processor_and_tower(setup):
    encoder, ref, _, cfg = setup
    processor = video_processor(encoder)
    hopper = np.asarray(Image.open(sample("grace_hopper.jpg")).convert("RGB").resize((160, 128)))
    frames = np.stack([np.roll(hopper, 9 * i, axis=1) for i in range(5)])  # odd: the last frame is repeated
    result = encoder.encode_videos([frames])
    out = processor([frames], do_sample_frames=False, return_tensors="pt")
    grid = out["video_grid_thw"]
    assert grid[0, 0] == 3 and result.grid_thw.tolist() == grid.tolist()
    assert_result_matches_reference(result, _reference(ref, out["pixel_values_videos"], grid), grid, 1e-4)
    assert result.video_info == [None]  # frames in memory: nothing was read
    assert (result.modality, result.family) == ("video", cfg.model_type)


def test_video_file_matches_load_video_processor_and_tower(setup, tmp_path):
    """A video file end to end: transformers' pyav reader + the family's video processor (sampling at the
    checkpoint's fps, the pixel budget) + the tower, against encode_videos on the path."""
    pytest.importorskip("av")
    from transformers.video_utils import load_video

    encoder, ref, *_ = setup
    processor = video_processor(encoder)
    path = tmp_path / "clip.mp4"
    write_video(path, 23, 96, 64, 10)  # 2.3 s at 10 fps: sampled at 2 fps
    result = encoder.encode_videos([str(path)], pooled=True)
    frames, metadata = load_video(str(path), backend="pyav")
    # Sampling on at 2 fps (Qwen2VLVideoProcessor samples nothing unless asked; ours always samples, at 2 by
    # default); everything else as the processor reads the checkpoint's files.
    out = processor([frames], video_metadata=[metadata], do_sample_frames=True, fps=2, return_tensors="pt",
                    return_metadata=True)
    grid = out["video_grid_thw"]
    assert result.grid_thw.tolist() == grid.tolist()
    assert_result_matches_reference(result, _reference(ref, out["pixel_values_videos"], grid), grid, 1e-4)
    info, sampled = result.video_info[0], out["video_metadata"][0]
    assert info.frame_indices == np.asarray(sampled.frames_indices).tolist()
    assert info.timestamps == sampled.timestamps and info.video_fps == sampled.fps == 10


def test_bad_input_raises_before_any_compute_naming_it(setup, photos, tmp_path):
    encoder, *_ = setup
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    encoder.model.shape_cache.clear()
    cases = [
        ([photos["photo.jpg"], str(empty)], r"^image '.*empty\.jpg': file is empty"),
        ([photos["small"], str(tmp_path / "nope.png")], r"^image '.*nope\.png': file not found"),
        ([np.zeros((0, 10, 3), np.uint8)], r"image 0.*zero-size"),
        ([photos["photo.jpg"], Image.new("RGB", (1000, 4))], r"image 1.*aspect ratio"),
        # A URL is no file here, and its secrets stay out of the message (messages end up in logs).
        ([photos["photo.jpg"], "https://b.s3.amazonaws.com/a.jpg?X-Amz-Signature=SECRET"],
         r"^image 'https://b\.s3\.amazonaws\.com/a\.jpg\?X-Amz-Signature=\*\*\*': a URL, not a file"),
    ]
    for images, pattern in cases:
        with pytest.raises(PreprocessError, match=pattern):
            encoder.encode_images(images)
    assert len(encoder.model.shape_cache) == 0  # nothing reached the tower


def test_video_sampled_by_fps_equals_the_sampled_frames(setup):
    encoder, _, _, cfg = setup
    from qwenvl_vision.inputs.video import sample_indices

    rng = np.random.default_rng(0)
    clip = rng.integers(0, 256, (12, 64, 96, 3), dtype=np.uint8)  # 12 frames at 6 fps, sampled at 2 fps
    sampled = encoder.encode_videos([clip], fps=2.0, video_fps=6.0)
    keep = sample_indices(12, 6.0, encoder.video_config, cfg.temporal_patch_size)
    assert len(keep) == 4
    direct = encoder.encode_videos([clip[keep]])
    assert torch.equal(sampled.embeddings[0], direct.embeddings[0])
    # Their timing known as a file's is (kept as given, it is not), so vLLM's video fields need no video_info=.
    info = sampled.video_info[0]
    assert (info.frame_indices, info.total_frames, info.video_fps, info.requested_fps) == (keep, 12, 6.0, 2.0)
    assert direct.video_info == [None]
    family = FAMILIES[encoder.family]
    video = sampled.to_vllm()["video"]
    if family.prompt_timestamps:  # each temporal patch's first and last frame's mean time, at 6 fps
        assert video["timestamps"] == [[(keep[0] + keep[1]) / 12, (keep[2] + keep[3]) / 12]]
    if family.seconds_per_grid:  # 2 frames per temporal patch asked at 2 fps
        assert video["second_per_grid_ts"].tolist() == [1.0]
    # Their own rate alone: sampled at the checkpoint's fps (2, as above), as a file of that rate is, not kept whole.
    assert encoder.video_config.fps == 2.0
    assert torch.equal(encoder.encode_videos([clip], video_fps=6.0).embeddings[0], direct.embeddings[0])
    generated = encoder.encode_videos(v for v in [clip[keep]])  # any iterable of videos
    assert torch.equal(generated.embeddings[0], direct.embeddings[0])
    with pytest.raises(InputError, match="video_fps 'junk'"):
        encoder.encode_videos([clip], video_fps="junk")
    with pytest.raises(ValueError, match="video_fps"):
        encoder.encode_videos([clip], fps=2.0)
    for fps, video_fps, message in [(2.0, "30", "video_fps '30' is neither"), (2.0, [None], "video 0, None, is not"),
                                    (2.0, torch.tensor(30.0), "video_fps tensor"), ("2", 6.0, "fps '2' is not"),
                                    (2.0, [6.0, 6.0], "2 entries for 1 videos"), (0.0, 6.0, "fps 0.0 is not"),
                                    (float("nan"), 6.0, "fps nan is not")]:
        with pytest.raises(InputError, match=re.escape(message)):
            encoder.encode_videos([clip], fps=fps, video_fps=video_fps)


def test_a_video_that_is_not_frames_is_named(setup, photos):
    encoder, *_ = setup
    for video in (5, None, photos["small"]):
        for options in ({}, {"fps": 2.0, "video_fps": 6.0}):
            with pytest.raises(PreprocessError, match=r"^video 1: expected a sequence of frames"):
                encoder.encode_videos([np.zeros((2, 64, 64, 3), np.uint8), video], **options)


def test_one_path_where_a_sequence_of_inputs_belongs_is_named(setup, photos):
    """A str is a sequence of characters: given alone, each would be read as a file of one letter."""
    encoder, *_ = setup
    for one in (str(photos["photo.jpg"]), Path(photos["photo.jpg"])):
        for encode in (encoder.encode_images, encoder.encode_videos):
            with pytest.raises(InputError, match=r"got one path \('.*grace_hopper\.jpg'\): pass \[it\]"):
                encode(one)
    with pytest.raises(InputError, match=r"got one image .*: pass \[it\]"):
        encoder.encode_images(photos["small"])
    # An array is a sequence of its rows: one image (HWC, HW, CHW) would be read as one grayscale image per row.
    array = np.asarray(photos["small"])
    for one in (array, array[..., 0], torch.from_numpy(array).permute(2, 0, 1)):
        with pytest.raises(InputError, match=re.escape(f"got one image array (shape {tuple(one.shape)}): pass [it]")):
            list(encoder.iter_encode(one))
    with pytest.raises(InputError, match=r"got one video array \(shape \(2, 64, 64, 3\)\): pass \[it\]"):
        encoder.encode_videos(np.zeros((2, 64, 64, 3), np.uint8))
    assert len(encoder.encode_images(array[None]).embeddings) == 1  # a batch array: each item one image
    assert len(encoder.encode_images(np.stack([array[..., 0]] * 5)).embeddings) == 5  # a stack of grayscale images
    for nothing in (None, 5):
        with pytest.raises(InputError, match=f"got {type(nothing).__name__}$"):
            encoder.encode_images(nothing)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_pixels": 0}, "^max_pixels must be a positive integer, got 0$"),
    ({"min_pixels": -5}, "^min_pixels must be a positive integer, got -5$"),
    ({"max_pixels": 1e6}, "^max_pixels must be a positive integer, got 1000000.0$"),
    ({"min_pixels": 9000, "max_pixels": 4000}, "^min_pixels 9000 is above max_pixels 4000$"),
    ({"normalize": True}, "normalize=True .* pass pooled=True too$"),
    ({"num_workers": -1}, "^num_workers must be an integer of at least 0, got -1$"),
    ({"num_workers": "2"}, "^num_workers must be an integer of at least 0, got '2'$"),
])
def test_bad_options_are_one_line_of_one_project_error_on_every_path(setup, photos, options, message):
    encoder, *_ = setup
    frames = np.zeros((2, 64, 64, 3), np.uint8)
    calls = [lambda: encoder.encode_images([photos["small"]], **options),
             lambda: encoder.encode_videos([frames], **options),
             lambda: list(encoder.iter_encode([photos["small"]], **options))]
    if "normalize" in options:  # encode_patches takes no pixel bounds
        calls.append(lambda: encoder.encode_patches(torch.zeros(16, encoder.config.patch_dim), [(1, 4, 4)], **options))
    for call in calls:
        with pytest.raises(ConfigError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_min_pixels_alone_above_the_videos_max_is_refused_naming_both(setup, photos):
    """A video's bound is per frame (Qwen2) or per clip, far below an image's: an image's min_pixels given alone to
    encode_videos would resize every frame up past the videos' max_pixels (gigabytes for a larger one). Images keep
    transformers' rule, where the lower bound wins."""
    encoder, *_ = setup
    frames = np.zeros((2, 64, 64, 3), np.uint8)
    most = encoder.video_config.max_pixels
    with pytest.raises(ConfigError, match=f"^min_pixels {most + 1} is above the videos' max_pixels {most}$"):
        encoder.encode_videos([frames], min_pixels=most + 1)
    least = encoder.preprocess_config.min_pixels
    assert encoder.encode_images([photos["small"]], max_pixels=least - 1).embeddings


def test_a_device_torch_knows_that_the_towers_do_not_run_on_is_refused_before_loading():
    for device in ("mps", "xpu"):
        with pytest.raises(ConfigError, match=f"device '{device}' is not supported; use cpu, cuda"):
            load_encoder("/nonexistent", device=device)  # refused before the folder is looked at


def test_patches_holding_nan_are_named_as_the_fault_not_the_checkpoint(setup):
    encoder, *_ = setup
    patches = torch.zeros(16, encoder.config.patch_dim)
    patches[3, 5] = float("nan")
    with pytest.raises(InputError, match="pixel_values hold inf/nan"):  # the input, not the checkpoint, at fault
        encoder.encode_patches(patches, [(1, 4, 4)])


def test_edges_of_the_api_are_one_line_before_any_forward_or_the_empty_shape(setup):
    encoder, *_ = setup
    patches, grid, digest = torch.zeros(16, encoder.config.patch_dim), [(1, 4, 4)], "0" * 64
    encoder.model.shape_cache.clear()
    for hashes in (["not-a-hash"], [digest, digest], 5):
        with pytest.raises(InputError, match="pixels_sha256 must be one 64-hex-digit hash"):
            encoder.encode_patches(patches, grid, pixels_sha256=hashes)
    with pytest.raises(InputError, match="pixel_values must be a floating-point torch.Tensor, got torch.int64"):
        encoder.encode_patches(patches.long(), grid)
    with pytest.raises(InputError, match="pixel_values must be a floating-point torch.Tensor, got ndarray"):
        encoder.encode_patches(patches.numpy(), grid)
    with pytest.raises(InputError, match="video_fps 'abc'"):  # checked, though files take their own rate
        encoder.encode_videos(["clip.mp4"], video_fps="abc")
    assert len(encoder.model.shape_cache) == 0  # nothing reached the tower
    for hashes in (iter([digest]), digest):  # any iterable; one item's hash alone
        assert encoder.encode_patches(patches, grid, pixels_sha256=hashes).pixels_sha256 == [digest]
    empty = encoder.encode_images([], pooled=True)
    assert empty.pooled.shape == (0, encoder.config.out_hidden_size) and empty.grid_thw.shape == (0, 3)
    assert empty == empty and empty != encoder.encode_images([], pooled=True)  # no tensor's truth value asked


def test_encode_patches_matches_the_tower_with_one_video_info_per_item(setup, photos):
    encoder, ref, processor, cfg = setup
    pixel_values, grid_thw = _reference_images(processor, [photos["small"], photos["numpy"], photos["gray"]])
    out = encoder.encode_patches(pixel_values, grid_thw)
    assert_result_matches_reference(out, _reference(ref, pixel_values, grid_thw), grid_thw, 1e-4)
    assert out.video_info == [None, None, None]  # out.video_info[i] exists for every item, as on every path
    assert (out.modality, out.family) == ("image", cfg.model_type)
    as_video = encoder.encode_patches(pixel_values, grid_thw, modality="video")
    assert as_video.modality == "video" and len(as_video.video_info) == len(as_video) == 3
    with pytest.raises(InputError, match='modality must be "image" or "video", got \'audio\''):
        encoder.encode_patches(pixel_values, grid_thw, modality="audio")


def test_iter_encode_reports_every_input_as_it_is_prepared(tmp_path, checkpoint):
    """Per image, in input order, before the one batch they form is encoded: what embed's progress counts."""
    paths = make_folder(tmp_path / "imgs", 5, bad=False)
    inputs = [*map(str, paths[:3]), str(tmp_path / "missing.jpg"), *map(str, paths[3:])]
    reported: list[tuple[int, int]] = []
    seen_before_batch = []
    with load_encoder(checkpoint, device="cpu") as encoder:
        for batch in encoder.iter_encode(inputs, on_prepared=lambda index, tokens: reported.append((index, tokens))):
            seen_before_batch.append(len(reported))
            results = batch
    assert seen_before_batch == [6]  # a single batch, reported input by input before it ran
    assert [index for index, _ in reported] == list(range(6))
    assert [tokens for _, tokens in reported] == [0 if r.error else r.embedding.shape[0] for r in results]
    assert reported[3][1] == 0 and results[3].error


def test_an_input_over_max_item_tokens_yields_its_error_instead_of_its_forward(setup, photos):
    """Checked once an input is resized (its rows known), before its forward; the other inputs get the tensors of a
    call without the bound."""
    encoder, *_ = setup
    items = [photos["small"], photos["photo.jpg"], photos["gray"]]
    free = [r for batch in encoder.iter_encode(items) for r in batch]
    rows = [r.embedding.shape[0] for r in free]
    bound = max(rows[0], rows[2])
    assert rows[1] > bound
    bounded = [r for batch in encoder.iter_encode(items, max_item_tokens=bound) for r in batch]
    assert bounded[1].error.startswith(f"{free[1].name}: {rows[1]:,} tokens, ")  # the input's name: its path
    assert "max_item_tokens" in bounded[1].error and bounded[1].embedding is None
    for i in (0, 2):
        assert torch.equal(bounded[i].embedding, free[i].embedding)
    frames = np.zeros((4, 64, 64, 3), np.uint8)
    [video] = next(encoder.iter_encode([frames], video=True, max_item_tokens=1))
    assert video.error.startswith("video 0: ") and "max_item_tokens" in video.error
    with pytest.raises(ConfigError, match="max_item_tokens"):
        list(encoder.iter_encode(items, max_item_tokens=0))


@pytest.mark.parametrize("call", ["images", "videos sampled by fps"])
def test_close_while_other_threads_encode(checkpoint, call):
    encoder = load_encoder(checkpoint, device="cpu")
    images = [synthetic_photo(56 + 28 * (i % 3), 84, i) for i in range(4)]
    if call == "images":
        def encode():
            return encoder.encode_images(images, max_batch_patches=64)
    else:  # per-call video settings (fps) must not escape close() either
        def encode():
            return encoder.encode_videos([np.stack(images[:1] * 6)], fps=2.0, video_fps=4.0, max_batch_patches=64)
    finished, ended = [], []  # list.append is atomic: the threads need no lock
    started, one_done = threading.Barrier(5), threading.Event()

    def work() -> None:
        started.wait()
        while True:
            try:
                out = encode()
            except BaseException as e:  # noqa: BLE001 - what the issue saw: RuntimeError about a meta tensor
                ended.append(e)
                return
            finished.append(all(torch.isfinite(e).all() for e in out.embeddings))
            one_done.set()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    assert one_done.wait(timeout=120)  # encodes complete, and every thread keeps starting new ones
    encoder.close()
    for t in threads:
        t.join(timeout=60)
    assert len(ended) == 4 and all(isinstance(e, EncoderClosedError) for e in ended), ended
    assert finished and all(finished)
    with pytest.raises(EncoderClosedError):
        encoder.encode_images(images)


def test_close_while_another_thread_switches_cpu_plans_frees_every_weight(checkpoint):
    """A switch packs and unpacks the weights: close() waits for one in flight, as for a forward."""
    encoder = load_encoder(checkpoint, device="cpu")
    plan = encoder.cpu_plan.to_dict()
    plan["linear"] = dict.fromkeys(plan["linear"], "onednn")  # every linear packed, then plain again
    model, ended, switched = encoder.model, [], threading.Event()

    def switch() -> None:
        try:
            while True:
                encoder.set_cpu_kernels("reference")
                encoder.set_cpu_kernels(plan)
                switched.set()
        except BaseException as e:  # noqa: BLE001 - the test reads what ended it
            ended.append(e)

    thread = threading.Thread(target=switch)
    thread.start()
    assert switched.wait(timeout=120)
    encoder.close()
    thread.join(timeout=60)
    assert [type(e) for e in ended] == [EncoderClosedError]
    assert [name for name, p in model.named_parameters() if not p.is_meta] == []


def test_decode_budget_is_released_when_the_caller_stops_early(checkpoint, tmp_path):
    paths = [str(p) for p in make_folder(tmp_path / "imgs", 12, bad=False)]
    encoder = load_encoder(checkpoint, device="cpu")
    for _ in encoder.iter_encode(paths, max_batch_patches=1, num_workers=4, decode_bytes=1):
        break  # the workers still waiting for budget are woken and the pool shuts down
    assert len([r for b in encoder.iter_encode(paths, num_workers=4, decode_bytes=1) for r in b]) == 12
