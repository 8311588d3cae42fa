"""``to_vllm``'s output through vLLM 0.33.0's own code (the contract tier: it runs in a venv with vLLM, see
.ci/run; the main suite skips it).

Tiny random full VLMs of each family that vLLM serves (tests.helpers.handoff, saved by transformers), encoded by
our encoder, handed over with ``to_vllm`` and fed to vLLM's functions, no copies of them:

- ``ModelConfig(model=folder, skip_tokenizer_init=True, enable_mm_embeds=True)`` and the family's processing info
  from vLLM's registry (``MULTIMODAL_REGISTRY.get_processing_info``), its data parser's ``parse_mm_data``;
- ``vllm.multimodal.utils.group_and_batch_mm_kwargs`` over the parsed items, then the model class's
  ``embed_multimodal`` on a stand-in (``model_stand_in``: an ``object.__new__`` of the class holding only what
  that method reads), which splits the pack back into items;
- ``Qwen3VLForConditionalGeneration._compute_deepstack_embeds`` on the same stand-in, for the DeepStack families;
- for the Qwen3-VL-family videos, ``Qwen3VLProcessingInfo._get_video_second_idx`` (the timestamps vLLM computes
  for the same frames) and ``get_video_repl`` (the prompt text they become).

The Omni thinkers' processing info builds transformers' Omni processor, which needs a tokenizer with the Omni
special tokens that the tiny models do not carry: their tests build the parser class that info builds
(``Qwen2_5OmniThinkerMultiModalDataParser``, both thinkers') themselves, with the model's merge size.

The encoder cache (``embed --format vllm-cache``): a consumer's ``VllmConfig`` (``ec_role`` ``ec_consumer``), its
parser taking ``vllm_request``'s grid-only items, and ``ECExampleConnector`` finding and loading each item.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the contract tier runs in a venv with vLLM 0.33.0 (bash .ci/contract)")
if vllm.__version__ != "0.33.0":
    pytest.skip(f"the contract is vLLM 0.33.0's; this is {vllm.__version__}", allow_module_level=True)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from PIL import Image  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402
from vllm.multimodal.utils import group_and_batch_mm_kwargs  # noqa: E402

from qwenvl_vision import load_encoder  # noqa: E402
from qwenvl_vision.model.config import FAMILIES  # noqa: E402
from tests.helpers import synthetic_photo  # noqa: E402
from tests.helpers.handoff import write_full_model  # noqa: E402

OMNI = ["qwen2_5_omni", "qwen3_omni_moe"]
SERVED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    """(family, model folder, vLLM's ModelConfig, its processing info) of one family."""
    family = request.param
    folder = write_full_model(tmp_path_factory.mktemp(family) / "model", family)
    config = ModelConfig(model=str(folder), skip_tokenizer_init=True, enable_mm_embeds=True)
    return family, folder, config, MULTIMODAL_REGISTRY.get_processing_info(config)


class Visual(torch.nn.Module):
    """What the model's ``_process_*_input`` reads of its vision tower: its dtype and merge size."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.spatial_merge_size = 2
        self.register_buffer("anchor", torch.zeros(1, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype


def model_stand_in(config: ModelConfig, dtype: torch.dtype, width: int, levels: int):
    """``object.__new__`` of the family's vLLM model class with only the attributes ``embed_multimodal`` and
    ``_compute_deepstack_embeds`` read: ``visual`` (dtype, merge size), ``is_multimodal_pruning_enabled``,
    ``use_data_parallel`` and, for DeepStack, ``visual_dim`` / ``multiscale_dim`` / ``deepstack_num_level``."""
    model_class = MULTIMODAL_REGISTRY._get_model_cls(config)
    model = object.__new__(model_class)
    torch.nn.Module.__init__(model)
    model.visual = Visual(dtype)
    model.is_multimodal_pruning_enabled = False
    model.use_data_parallel = False
    model.visual_dim, model.multiscale_dim, model.deepstack_num_level = width, width * levels, levels
    return model


def images() -> list[Image.Image]:
    return [Image.fromarray(synthetic_photo(70, 100, seed=1)), Image.fromarray(synthetic_photo(90, 60, seed=2))]


def write_video(path: Path, frames: int, rate: Fraction) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(synthetic_photo(48, 64, seed=i), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def two_videos(folder: Path, dtype: torch.dtype, tmp_path: Path):
    """Two video files of other lengths and frame rates (23 frames at 29.97 fps, 9 at 10), encoded at 3 fps."""
    encoder = load_encoder(folder, device="cpu", dtype=dtype)
    paths = [write_video(tmp_path / "a.mp4", 23, Fraction(30000, 1001)),
             write_video(tmp_path / "b.mp4", 9, Fraction(10))]
    return encoder.encode_videos([str(p) for p in paths], fps=3.0)


def through_vllm(config, parser, data: dict, modality: str, dtype: torch.dtype, width: int, levels: int):
    """The parsed items' own tensors, and the per-item embeddings vLLM's model makes of their batch."""
    parsed = parser.parse_mm_data({modality: data})[modality]
    items = [parsed.get(i) for i in range(parsed.get_count())]
    kwargs_items = [(modality, parsed._kwargs[modality][i]) for i in range(parsed.get_count())]
    batches = list(group_and_batch_mm_kwargs(kwargs_items))
    assert [(m, n) for m, n, _ in batches] == [(modality, len(items))]  # one batch of every item
    model = model_stand_in(config, dtype, width, levels)
    return items, model, model.embed_multimodal(**batches[0][2])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_images_parse_split_and_embed_per_item_bitwise(served, dtype):
    """Two images of different sizes: vLLM's parser finds two items with our grids and rows, its model splits
    the batch back into our items bit for bit (vLLM casts to its tower's dtype: ours already is), and for
    DeepStack families ``_compute_deepstack_embeds`` scatters every level where ours go."""
    family, folder, config, info = served
    encoder = load_encoder(folder, device="cpu", dtype=DTYPES[dtype])
    result = encoder.encode_images(images())
    levels = len(result.deepstack[0])
    width = result.embeddings[0].shape[1]
    data = result.to_vllm()["image"]
    items, model, embedded = through_vllm(config, info.get_data_parser(), data, "image", DTYPES[dtype], width, levels)
    assert len(items) == len(embedded) == 2
    for i, (item, out) in enumerate(zip(items, embedded, strict=True)):
        assert torch.equal(item["image_grid_thw"], result.grid_thw[i])
        whole = torch.cat([result.embeddings[i], *result.deepstack[i]], dim=-1)
        assert torch.equal(item["image_embeds"], whole) and torch.equal(out, whole)
    if not FAMILIES[family].deepstack:
        assert levels == 0
        return
    tokens = sum(len(e) for e in result.embeddings)
    placeholder = torch.zeros(3 + tokens + 2, dtype=torch.bool)  # text, then the images' tokens, then text
    placeholder[3:3 + tokens] = True
    inputs = torch.zeros(len(placeholder), width, dtype=DTYPES[dtype])
    scattered, main = model._compute_deepstack_embeds(inputs, embedded, placeholder)
    assert scattered.shape == (levels, len(placeholder), width)
    for level in range(levels):
        want = torch.cat([item[level] for item in result.deepstack])
        assert torch.equal(scattered[level, placeholder], want)
        assert not scattered[level, ~placeholder].any()
    assert all(torch.equal(m, e) for m, e in zip(main, result.embeddings, strict=True))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_videos_parse_and_embed_per_item_with_the_timestamps_vllm_computes(served, dtype, tmp_path, monkeypatch):
    """Two video files of other lengths and frame rates (one with an odd frame count, padded): vLLM's parser takes
    ``to_vllm``'s video data (the Qwen3-VL families' require ``timestamps``), splits it into our items bitwise,
    and the timestamps are the ones vLLM computes from the same frames and rate, and sampling itself at our fps;
    ``get_video_repl`` makes each of them a frame's ``<t seconds>`` before that frame's tokens."""
    family, folder, config, info = served
    result = two_videos(folder, DTYPES[dtype], tmp_path)
    data = result.to_vllm()["video"]
    if not FAMILIES[family].prompt_timestamps:
        assert "timestamps" not in data
    levels, width = len(result.deepstack[0]), result.embeddings[0].shape[1]
    items, _, embedded = through_vllm(config, info.get_data_parser(), data, "video", DTYPES[dtype], width, levels)
    for i, (item, out) in enumerate(zip(items, embedded, strict=True)):
        whole = torch.cat([result.embeddings[i], *result.deepstack[i]], dim=-1)
        assert torch.equal(item["video_grid_thw"], result.grid_thw[i]) and torch.equal(out, whole)
    if not FAMILIES[family].prompt_timestamps:
        return
    monkeypatch.setattr(info, "get_video_processor", lambda **_: VideoProcessor(folder))
    for i, video in enumerate(result.video_info):
        metadata = {"frames_indices": video.frame_indices, "fps": video.video_fps,
                    "total_num_frames": video.total_frames}
        assert items[i]["timestamps"] == info._get_video_second_idx(metadata, do_sample_frames=False)
        assert items[i]["timestamps"] == info._get_video_second_idx(metadata, do_sample_frames=True, sampled_fps=3.0)
        t, h, w = result.grid_thw[i].tolist()
        assert len(items[i]["timestamps"]) == t
        details = vllm_video_repl(items[i]["timestamps"], h * w // 4)
        assert details.full.count(0x110003) == t * h * w // 4  # every frame's tokens, after its time
        text = "".join(chr(token) for token in details.full if token < 0x110000)
        assert [f"<{stamp:.1f} seconds>" in text for stamp in items[i]["timestamps"]] == [True] * t


class VideoProcessor:
    """What ``_get_video_second_idx`` reads of transformers' video processor (built by vLLM from a tokenizer the
    tiny models lack): the folder's ``video_preprocessor_config.json`` values it names."""

    def __init__(self, folder: Path) -> None:
        saved = json.loads((folder / "video_preprocessor_config.json").read_text())
        self.temporal_patch_size, self.fps = saved["temporal_patch_size"], saved["fps"]
        self.min_frames, self.max_frames = saved["min_frames"], saved["max_frames"]


class CharTokenizer:
    """What ``get_video_repl`` reads of a tokenizer: ``encode(text, add_special_tokens=False)``, one id a
    character (the timestamps' text then reads back from the ids)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def vllm_video_repl(timestamps, tokens_per_frame: int):
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalProcessor

    return Qwen3VLMultiModalProcessor.get_video_repl(
        tokens_per_frame=[tokens_per_frame] * len(timestamps), timestamps=timestamps, tokenizer=CharTokenizer(),
        vision_start_token_id=0x110001, vision_end_token_id=0x110002, video_token_id=0x110003)


def test_a_qwen3_family_video_without_frame_timing_is_refused_naming_what_to_pass(served):
    """Frames given in memory carry no frame indices and rate: vLLM would refuse the data, so ``to_vllm`` refuses
    first, naming ``video_info``."""
    family, folder, _, _ = served
    encoder = load_encoder(folder, device="cpu")
    frames = np.stack([synthetic_photo(48, 64, seed=i) for i in range(4)])
    result = encoder.encode_videos([frames])
    if not FAMILIES[family].prompt_timestamps:
        assert "timestamps" not in result.to_vllm()["video"]
        return
    with pytest.raises(Exception, match="video_info"):
        result.to_vllm()


@pytest.fixture(scope="module", params=OMNI)
def omni(request, tmp_path_factory):
    """(family, model folder, vLLM's ModelConfig, the thinkers' data parser) of one Omni family."""
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerMultiModalDataParser

    family = request.param
    folder = write_full_model(tmp_path_factory.mktemp(family) / "model", family)
    config = ModelConfig(model=str(folder), skip_tokenizer_init=True, enable_mm_embeds=True)
    return family, folder, config, Qwen2_5OmniThinkerMultiModalDataParser(spatial_merge_size=2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_omni_videos_parse_with_the_seconds_per_temporal_patch_of_the_fps_asked(omni, dtype, tmp_path):
    """The Omni thinkers' parser takes ``second_per_grid_ts`` with video embeddings; ``to_vllm`` gives
    ``temporal_patch_size / fps`` of the fps asked for, as their processors compute it, and the model splits the
    batch back into our items bit for bit. Without it the parser still takes the data (vLLM then assumes its
    default timing, silently wrong at another fps): the items carry none."""
    family, folder, config, parser = omni
    result = two_videos(folder, DTYPES[dtype], tmp_path)
    data = result.to_vllm()["video"]
    levels, width = len(result.deepstack[0]), result.embeddings[0].shape[1]
    items, _, embedded = through_vllm(config, parser, data, "video", DTYPES[dtype], width, levels)
    assert len(items) == len(embedded) == 2
    for i, (item, out) in enumerate(zip(items, embedded, strict=True)):
        whole = torch.cat([result.embeddings[i], *result.deepstack[i]], dim=-1)
        assert torch.equal(item["video_grid_thw"], result.grid_thw[i]) and torch.equal(out, whole)
        assert item["second_per_grid_ts"].item() == pytest.approx(2 / 3.0)
    legacy = parser.parse_mm_data({"video": {k: v for k, v in data.items() if k != "second_per_grid_ts"}})["video"]
    assert "second_per_grid_ts" not in legacy.get(0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_omni_images_parse_split_and_embed_per_item_bitwise(omni, dtype):
    family, folder, config, parser = omni
    encoder = load_encoder(folder, device="cpu", dtype=DTYPES[dtype])
    result = encoder.encode_images(images())
    levels, width = len(result.deepstack[0]), result.embeddings[0].shape[1]
    items, _, embedded = through_vllm(config, parser, result.to_vllm()["image"], "image", DTYPES[dtype], width,
                                      levels)
    assert len(items) == len(embedded) == 2
    for i, out in enumerate(embedded):
        assert torch.equal(out, torch.cat([result.embeddings[i], *result.deepstack[i]], dim=-1))


HANDOFF = Path(__file__).resolve().parents[2] / "docs" / "handoff.md"
SECTION = "## Feed a vLLM encoder-cache consumer"


def readme_section() -> tuple[str, dict, str]:
    """docs/handoff.md's encoder-cache section: its producer command, its consumer's ``--ec-transfer-config`` and its
    Python block."""
    text = HANDOFF.read_text()
    section = text[text.index(SECTION):]
    end = section.find("\n## ", len(SECTION))
    section = section if end < 0 else section[:end]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    bash = next(code for language, code in blocks if language == "bash").splitlines()
    producer = next(line for line in bash if line.startswith("qwenvl-vision embed")).split("  #")[0]
    consumer = next(line for line in bash if line.startswith("vllm serve"))
    transfer = json.loads(re.search(r"--ec-transfer-config '(.*?)'", consumer).group(1))
    return producer, transfer, next(code for language, code in blocks if language == "python")


def consumer_config(folder: Path, transfer: dict, cache: Path):
    """The documented consumer as vLLM builds it: a real ``VllmConfig`` with its ``--ec-transfer-config``, the shared
    storage path moved to ``cache``."""
    from vllm.config import ECTransferConfig, VllmConfig

    transfer = {**transfer, "ec_connector_extra_config": {**transfer["ec_connector_extra_config"],
                                                          "shared_storage_path": str(cache)}}
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True)
    return VllmConfig(model_config=model, ec_transfer_config=ECTransferConfig(**transfer))


def loaded_by_the_connector(config, request: dict) -> dict[str, torch.Tensor]:
    """What ``ECExampleConnector`` does for a consumer: the scheduler's side finds each item, the worker's loads
    it into its encoder cache (the metadata bound as the scheduler's ``build_connector_meta`` makes it)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnector,
        ECExampleConnectorMetadata,
        MMMeta,
    )

    scheduler = ECExampleConnector(config, ECConnectorRole.SCHEDULER)
    worker = ECExampleConnector(config, ECConnectorRole.WORKER)
    ids = [i for modality in request["multi_modal_uuids"].values() for i in modality]
    assert all(scheduler.has_cache_item(i) for i in ids) and not scheduler.has_cache_item("0" * 64)
    metadata = ECExampleConnectorMetadata()
    for i in ids:
        metadata.add_mm_data(MMMeta.make_meta(i, 0))
    worker.bind_connector_metadata(metadata)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return cache


def parsed_by_the_consumer(config, request: dict) -> dict:
    """The request's items as the consumer's own parser takes them (embeddings may be absent there), and the
    cache identity its processor gives each (``ProcessorInputs.get_mm_hashes``, as ``_get_mm_hashes`` calls it):
    with a uuid and no processor keyword arguments, the uuid itself, which the connector then looks up."""
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing.inputs import ProcessorInputs

    assert config.model_config.multimodal_config.allow_missing_mm_embeddings
    info = MULTIMODAL_REGISTRY.get_processing_info(config.model_config)
    parsed = info.get_data_parser().parse_mm_data(request["multi_modal_data"])
    inputs = ProcessorInputs([0], parsed, parse_mm_uuids(request["multi_modal_uuids"]))
    hashes = inputs.get_mm_hashes(info.model_id, info.ctx.get_mm_config().mm_hasher_algorithm)
    assert hashes == request["multi_modal_uuids"]
    return {modality: [items.get(i) for i in range(items.get_count())] for modality, items in parsed.items()}


def test_the_documented_producer_s_cache_loads_in_a_vllm_consumer_bitwise(served, tmp_path, monkeypatch):
    """The documented command (--format vllm-cache) over images and a video; the consumer built from its
    --ec-transfer-config line parses the request made from the manifest (the grids, a video's timestamps) and its
    connector loads every item equal to to_vllm()'s rows for it, bit for bit."""
    from qwenvl_vision.cli import main
    from qwenvl_vision.embed import read_manifest_lines
    from qwenvl_vision.outputs.vllm_cache import vllm_request

    family, folder, _, _ = served
    producer, transfer, _ = readme_section()
    media = tmp_path / "media"
    media.mkdir()
    photos = []
    for i, image in enumerate(images()):
        photos.append(media / f"photo{i}.png")
        image.save(photos[-1])
    clip = write_video(media / "clip.mp4", 9, Fraction(10))
    cache = tmp_path / "ec"
    argv = shlex.split(producer)[1:]
    argv[argv.index("examples/photos/")] = str(media)
    argv[argv.index("--model") + 1] = str(folder)
    argv[argv.index("--out") + 1] = str(cache)
    assert main(argv) == 0
    records = {Path(r["path"]).name: r for r in read_manifest_lines(cache / "manifest.jsonl")}
    order = [records["photo1.png"], records["clip.mp4"], records["photo0.png"]]
    request = vllm_request(order)
    config = consumer_config(folder, transfer, cache)
    parsed = parsed_by_the_consumer(config, request)
    assert [item["image_grid_thw"].tolist() for item in parsed["image"]] == [records["photo1.png"]["grid_thw"],
                                                                             records["photo0.png"]["grid_thw"]]
    assert parsed["video"][0]["video_grid_thw"].tolist() == records["clip.mp4"]["grid_thw"]
    assert all("image_embeds" not in item for item in parsed["image"])
    if FAMILIES[family].prompt_timestamps:
        assert parsed["video"][0]["timestamps"] == records["clip.mp4"]["timestamps"]
    loaded = loaded_by_the_connector(config, request)
    dtype = DTYPES[{"bfloat16": "bf16", "float32": "fp32"}[read_run_dtype(cache)]]
    encoder = load_encoder(folder, device="cpu", dtype=dtype)
    want_images = encoder.encode_images([str(photos[1]), str(photos[0])]).to_vllm()["image"]
    want_video = encoder.encode_videos([str(clip)]).to_vllm()["video"]
    rows = [r["tokens"] for r in (records["photo1.png"], records["photo0.png"])]
    for record, want in zip([records["photo1.png"], records["photo0.png"]],
                            want_images["image_embeds"].split(rows), strict=True):
        assert loaded[record["id"]].dtype == dtype and torch.equal(loaded[record["id"]], want)
    assert torch.equal(loaded[records["clip.mp4"]["id"]], want_video["video_embeds"])

    # Bounded by `cache prune` (docs/handoff.md): the oldest item goes; the consumer finds and loads every item
    # that remains, bit for bit, and no longer finds the removed one.
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    from qwenvl_vision.outputs.vllm_cache import CACHE_FILE

    oldest = records["photo0.png"]["id"]
    os.utime(cache / oldest / CACHE_FILE, (1, 1))
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert main(["cache", "prune", str(cache), "--max-gb", str((size - 1) / 1e9)]) == 0
    assert not (cache / oldest).exists()
    kept = [records["photo1.png"], records["clip.mp4"]]
    again = loaded_by_the_connector(config, vllm_request(kept))
    assert all(torch.equal(again[r["id"]], loaded[r["id"]]) for r in kept)
    assert not ECExampleConnector(config, ECConnectorRole.SCHEDULER).has_cache_item(oldest)


def read_run_dtype(cache: Path) -> str:
    return json.loads((cache / "run.json").read_text())["dtype"]


def test_the_documented_python_example_feeds_the_same_consumer(served, tmp_path, monkeypatch):
    """The documented Python block, with the family's tiny model for the repo id and a folder of its own for
    /tmp/ec: its request parses in the consumer and every id loads equal to to_vllm()'s rows."""
    family, folder, _, _ = served
    _, transfer, code = readme_section()
    cache = tmp_path / "ec"
    repo = REPO_ID.search(code).group(0)
    monkeypatch.chdir(HANDOFF.parents[1])  # the block names examples/photos/ as a checkout has it
    namespace: dict = {}
    exec(code.replace(f'"{repo}"', repr(str(folder))).replace('"/tmp/ec"', repr(str(cache))), namespace)
    request, items, enc = namespace["request"], namespace["items"], namespace["enc"]
    config = consumer_config(folder, transfer, cache)
    parsed = parsed_by_the_consumer(config, request)
    assert [item["image_grid_thw"].tolist() for item in parsed["image"]] == [item["grid_thw"] for item in items]
    loaded = loaded_by_the_connector(config, request)
    paths = ["examples/photos/hopper.jpg", "examples/photos/logo.png"]
    want = enc.encode_images(paths).to_vllm()["image"]["image_embeds"].split([item["tokens"] for item in items])
    assert all(torch.equal(loaded[item["id"]], rows) for item, rows in zip(items, want, strict=True))

    # With processor or media-IO keyword arguments vLLM names the items by its own hash of (model, uuid, kwargs):
    # its connector finds none of them (why docs/handoff.md says to send the request without them).
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing.inputs import ProcessorInputs

    info = MULTIMODAL_REGISTRY.get_processing_info(config.model_config)
    parsed_items = info.get_data_parser().parse_mm_data(request["multi_modal_data"])
    scheduler = ECExampleConnector(config, ECConnectorRole.SCHEDULER)
    for kwargs in ({"hf_processor_mm_kwargs": {"max_pixels": 256 * 256}},
                   {"media_io_kwargs": {"image": {"mode": "RGB"}}}):
        inputs = ProcessorInputs([0], parsed_items, parse_mm_uuids(request["multi_modal_uuids"]), **kwargs)
        hashes = inputs.get_mm_hashes(info.model_id, info.ctx.get_mm_config().mm_hasher_algorithm)["image"]
        assert hashes != request["multi_modal_uuids"]["image"] and not any(map(scheduler.has_cache_item, hashes))


REPO_ID = re.compile(r"Qwen/[\w.-]+")


def test_an_omni_consumer_takes_the_cache_with_the_seconds_per_temporal_patch(omni, tmp_path):
    """The Omni thinkers as encoder-cache consumers: their parser (built as their processing info builds it, for a
    consumer: embeddings may be absent) takes the grid-only request with ``second_per_grid_ts``, and the connector
    of a consumer ``VllmConfig`` loads the items equal to ``to_vllm()``'s rows."""
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerMultiModalDataParser

    from qwenvl_vision.cli import main
    from qwenvl_vision.embed import read_manifest_lines
    from qwenvl_vision.outputs.vllm_cache import vllm_request

    family, folder, _, _ = omni
    _, transfer, _ = readme_section()
    media = tmp_path / "media"
    media.mkdir()
    images()[0].save(media / "photo.png")
    clip = write_video(media / "clip.mp4", 9, Fraction(10))
    cache = tmp_path / "ec"
    assert main(["embed", str(media), "--model", str(folder), "--out", str(cache), "--format", "vllm-cache",
                 "--fps", "2.5"]) == 0
    records = {Path(r["path"]).name: r for r in read_manifest_lines(cache / "manifest.jsonl")}
    request = vllm_request([records["photo.png"], records["clip.mp4"]])
    config = consumer_config(folder, transfer, cache)
    consumer = config.model_config.multimodal_config.allow_missing_mm_embeddings
    assert consumer
    parser = Qwen2_5OmniThinkerMultiModalDataParser(spatial_merge_size=2, allow_missing_mm_embeddings=consumer)
    parsed = parser.parse_mm_data(request["multi_modal_data"])
    (video,) = [parsed["video"].get(i) for i in range(parsed["video"].get_count())]
    assert "video_embeds" not in video and video["second_per_grid_ts"].item() == pytest.approx(2 / 2.5)
    loaded = loaded_by_the_connector(config, request)
    encoder = load_encoder(folder, device="cpu")
    assert torch.equal(loaded[records["photo.png"]["id"]],
                       encoder.encode_images([str(media / "photo.png")]).to_vllm()["image"]["image_embeds"])
    assert torch.equal(loaded[records["clip.mp4"]["id"]],
                       encoder.encode_videos([str(clip)], fps=2.5).to_vllm()["video"]["video_embeds"])
