"""``qwenvl-vision serve`` as the encoder instance of vLLM's disaggregated encoding (EPD), against vLLM 0.33.0's own
code (the contract tier: bash .ci/contract): docs/handoff.md's encoder-tier commands, run as written for a tiny
Qwen2.5-VL and Qwen3-VL, get the requests vLLM's EPD proxy (``disagg_epd_proxy.py``) sends; vLLM's request and
response models take them and the answers, and a consumer's ``ECExampleConnector`` built from the section's
``--ec-transfer-config`` loads every item the server wrote bit for bit as it loads ``to_vllm_cache``'s.

vLLM's multimodal processor needs a tokenizer, which the tiny models lack: chat parsing gets the family's processor
built without one (``untokenized_processor``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import urllib.error
import urllib.request
import uuid
from fractions import Fraction
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the contract tier runs in a venv with vLLM 0.33.0 (bash .ci/contract)")
if vllm.__version__ != "0.33.0":
    pytest.skip(f"the contract is vLLM 0.33.0's; this is {vllm.__version__}", allow_module_level=True)

from vllm.config import ModelConfig  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from vllm.multimodal import MULTIMODAL_REGISTRY  # noqa: E402
from vllm.renderers.chat_utils import parse_chat_messages  # noqa: E402

from qwenvl_vision import load_encoder  # noqa: E402
from qwenvl_vision.devices import DTYPE_SPELLINGS  # noqa: E402
from qwenvl_vision.model.config import FAMILIES  # noqa: E402
from qwenvl_vision.outputs.vllm_cache import vllm_request  # noqa: E402
from tests.contract.test_vllm import (  # noqa: E402
    HANDOFF,
    consumer_config,
    images,
    loaded_by_the_connector,
    parsed_by_the_consumer,
    write_video,
)
from tests.helpers import REPO, synthetic_photo  # noqa: E402
from tests.helpers.handoff import write_full_model  # noqa: E402
from tests.helpers.serve import START_S, data_url, serving  # noqa: E402

SECTION = "## Encoder tier for vLLM's disaggregated encoding"
EMBEDS = {"image_url": "image_embeds", "video_url": "video_embeds"}  # the proxy's rewrite of each media part
PASSED_ON = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")  # the proxy copies these


def section() -> tuple[list[str], dict, str]:
    """The section's commands: the serve arguments (after ``qwenvl-vision serve``), the consumer's
    ``--ec-transfer-config`` and the ``/v1/embeddings`` curl line."""
    text = HANDOFF.read_text()
    text = text[text.index(SECTION):]
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text.split("\n## ")[0], re.S)
             for line in block.splitlines()]
    serve = shlex.split(next(line for line in lines if line.startswith("qwenvl-vision serve")))[2:]
    consumer = next(line for line in lines if line.startswith("vllm serve"))
    transfer = json.loads(re.search(r"--ec-transfer-config '(.*?)'", consumer).group(1))
    return serve, transfer, next(line for line in lines if line.startswith("curl"))


def item_uuid(part: dict) -> str:
    """The proxy's cache key of a media item: its own uuid, else the sha256 of its URL."""
    return part.get("uuid") or hashlib.sha256(part[part["type"]]["url"].encode()).hexdigest()


def proxy_requests(original: dict) -> list[tuple[dict, dict]]:
    """(body, headers) of each request the proxy sends its one encoder instance for ``original``: the images in one,
    each video in one of its own, text removed, each item under its key."""
    items = [part for message in original["messages"] if isinstance(message["content"], list)
             for part in message["content"] if part["type"] in EMBEDS]
    groups = [[i for i, part in enumerate(items) if part["type"] == "image_url"]]
    groups += [[i] for i, part in enumerate(items) if part["type"] == "video_url"]
    parent = uuid.uuid4().hex
    passed = {key: original[key] for key in PASSED_ON if key in original}
    return [({"model": original["model"], "stream": False, **passed,
              "messages": [{"role": "user", "content": [{**items[i], "uuid": item_uuid(items[i])} for i in group]}]},
             {"x-request-id": f"{parent}:{group[0]}:{uuid.uuid4().hex[:6]}", "Content-Type": "application/json"})
            for group in groups if group]


def decoder_request(original: dict, answers: list[ChatCompletionResponse]) -> dict:
    """The proxy's rewrite of ``original`` for the decoder: each media part a metadata-only ``*_embeds`` part under
    its key, holding the metadata the encoder reported for it (each value's lists flattened, as the proxy does), and
    every reported entry in the request's ``ec_transfer_params``."""
    reported = {key: value for answer in answers for key, value in answer.ec_transfer_params.items()}
    messages = []
    for message in original["messages"]:
        content = []
        for part in message["content"]:
            if part["type"] not in EMBEDS:
                content.append(part)
                continue
            key, kind = item_uuid(part), EMBEDS[part["type"]]
            metadata = {name: [x for item in value for x in (item if isinstance(item, list) else [item])]
                        for name, value in reported[key]["metadata"].items()}
            content.append({"type": kind, kind: metadata, "uuid": key})
        messages.append({**message, "content": content})
    return {**original, "messages": messages,
            "ec_transfer_params": {**(original.get("ec_transfer_params") or {}), **reported}}


def untokenized_processor(config: ModelConfig, **_):
    """The family's vLLM multimodal processor, built without the tokenizer its constructor asks for."""
    factories = MULTIMODAL_REGISTRY._get_model_cls(config)._processor_factory
    info = MULTIMODAL_REGISTRY.get_processing_info(config)
    return type("Untokenized", (factories.processor,), {"requires_tokenizer": False})(info,
                                                                                      factories.dummy_inputs(info))


def chat_items(body: dict, config: ModelConfig) -> tuple[dict, dict]:
    """(multi_modal_data, multi_modal_uuids) vLLM's request model and chat parsing make of ``body``."""
    _, data, uuids = parse_chat_messages(ChatCompletionRequest.model_validate(body).messages, config, "openai")
    return data, uuids


def post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=START_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def encoded(url: str, requests: list[tuple[dict, dict]]) -> list[ChatCompletionResponse]:
    """The server's answers to the proxy's requests, each as vLLM's own response model takes it."""
    answers = []
    for body, headers in requests:
        status, answer = post(f"{url}/v1/chat/completions", body, headers)
        assert status == 200, answer
        answers.append(ChatCompletionResponse.model_validate(answer))
    return answers


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, write_full_model(tmp_path_factory.mktemp(family) / "model", family)


def test_the_proxy_s_requests_reach_a_vllm_consumer_bitwise(model, tmp_path, monkeypatch):
    family, folder = model
    serve, transfer, curl = section()
    media = tmp_path / "media"
    media.mkdir()
    photos = [media / f"photo{i}.png" for i in range(2)]
    for image, path in zip(images(), photos):
        image.save(path)
    clip = write_video(media / "clip.mp4", 9, Fraction(10))
    parts = [{"type": "image_url", "image_url": {"url": data_url(photos[0])}},
             {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
             {"type": "image_url", "image_url": {"url": data_url(photos[1])}, "uuid": "photo-1"}]  # a client's own
    original = {"model": str(folder), "max_tokens": 64,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What differs?"}, *parts]}]}
    requests = proxy_requests(original)
    monkeypatch.setattr(MULTIMODAL_REGISTRY, "create_processor", untokenized_processor)
    encoder_side = ModelConfig(model=str(folder), skip_tokenizer_init=True)
    for body, _ in requests:  # vLLM takes each request as the proxy sends it, items in order under their uuids
        _, uuids = chat_items(body, encoder_side)
        assert [key for keys in uuids.values() for key in keys] == [p["uuid"] for p in body["messages"][0]["content"]]

    storage = tmp_path / "ec"
    dtype = DTYPE_SPELLINGS[serve[serve.index("--dtype") + 1]]
    # The section's line, on this model and folder, on the CPU the reference runs on (argparse keeps the last value).
    argv = [*serve, "--model", str(folder), "--ec-shared-storage", str(storage), "--device", "cpu", "--threads", "1"]
    with serving(argv) as url:
        answers = encoded(url, requests)
        # Processor options would make vLLM name the items by another hash than their uuids: refused, naming them.
        (body, headers), *_ = proxy_requests({**original, "mm_processor_kwargs": {"max_pixels": 64 * 64}})
        status, refused = post(f"{url}/v1/chat/completions", body, headers)
        assert status == 400 and "mm_processor_kwargs" in refused["error"]["message"], refused
        # The proxy sends them again when the decoder fails (it re-encodes, then retries): the same answers.
        again = encoded(url, requests)
        assert [a.ec_transfer_params for a in again] == [a.ec_transfer_params for a in answers]
        example = re.sub(r"http://127\.0\.0\.1:\d+", url, curl).replace(json.dumps(serve[serve.index("--model") + 1]),
                                                                        json.dumps(str(folder)))
        done = subprocess.run(["bash", "-c", example], cwd=REPO, capture_output=True, text=True, timeout=START_S)
    parser = MULTIMODAL_REGISTRY.get_processing_info(encoder_side).get_data_parser()
    for (body, _), answer in zip(requests, answers, strict=True):
        sent = body["messages"][0]["content"]
        reported = answer.ec_transfer_params
        # The proxy matches each reported item to its part by these positions (it refuses missing or repeated ones),
        # and hands the decoder the metadata as the item's fields: those a vLLM encoder instance reports, the ones
        # the consumer's parser sizes the placeholders by (``placeholder_metadata_fields``).
        assert {key: value["item_indices"] for key, value in reported.items()} == {
            part["uuid"]: [i] for i, part in enumerate(sent)}
        for part in sent:
            fields = parser.placeholder_metadata_fields(EMBEDS[part["type"]].split("_")[0])
            assert set(reported[part["uuid"]]["metadata"]) == fields, reported[part["uuid"]]

    encoder = load_encoder(folder, device="cpu", dtype=dtype)
    reference = tmp_path / "reference"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's --threads: how many threads split a forward can change its bits
    try:
        # The server loads and resizes as vLLM does, with torchvision's resize, whatever the checkpoint names.
        pictures = encoder.encode_images([str(p) for p in photos], resize="vllm").to_vllm_cache(reference)
        (video,) = encoder.encode_videos([str(clip)]).to_vllm_cache(reference)
        hopper = encoder.encode_images([str(REPO / "examples" / "photos" / "hopper.jpg")], pooled=True,
                                       resize="vllm").pooled[0]
    finally:
        torch.set_num_threads(threads)
    entries = [pictures[0], video, pictures[1]]  # in the order of ``parts``
    consumer = consumer_config(folder, transfer, storage)
    data, uuids = chat_items(decoder_request(original, answers), consumer.model_config)
    request = {"multi_modal_data": data, "multi_modal_uuids": uuids}
    parsed = parsed_by_the_consumer(consumer, request)  # the uuids are the consumer's names of the items
    assert uuids == {"image": [item_uuid(parts[0]), "photo-1"], "video": [item_uuid(parts[1])]}
    assert [item["image_grid_thw"].tolist() for item in parsed["image"]] == [pictures[0]["grid_thw"],
                                                                             pictures[1]["grid_thw"]]
    assert parsed["video"][0]["video_grid_thw"].tolist() == video["grid_thw"]
    if FAMILIES[family].prompt_timestamps:
        assert list(map(float, parsed["video"][0]["timestamps"])) == video["timestamps"]
    loaded = loaded_by_the_connector(consumer, request)
    want = loaded_by_the_connector(consumer_config(folder, transfer, reference), vllm_request(entries))
    for part, entry in zip(parts, entries, strict=True):
        got = loaded[item_uuid(part)]
        assert got.dtype == consumer.model_config.dtype and torch.equal(got, want[entry["id"]]), entry

    # The section's /v1/embeddings example: one pooled vector, the encoder's own for the same file.
    assert done.returncode == 0, done.stderr
    (embedding,) = json.loads(done.stdout)["data"]
    assert torch.equal(torch.tensor(embedding["embedding"], dtype=torch.float64), hopper.double())


def transparent_and_turned(folder: Path) -> list[Path]:
    """Files whose loading differs between pipelines: transparency of each kind PNG and WebP hold (an alpha band, a
    grey alpha, a palette's tRNS, an RGB tRNS colour) and an EXIF orientation."""
    from PIL import Image

    base = Image.fromarray(synthetic_photo(60, 84, seed=3))
    alpha = Image.linear_gradient("L").resize(base.size)  # fully transparent to opaque
    rgba = base.convert("RGBA")
    rgba.putalpha(alpha)
    grey = base.convert("LA")
    grey.putalpha(alpha)
    palette = base.convert("P", palette=Image.ADAPTIVE, colors=16)
    files = {"rgba.png": (rgba, {}), "la.png": (grey, {}), "rgba.webp": (rgba, {"lossless": True}),
             "trns.png": (palette, {"transparency": 3}),
             "rgb-trns.png": (base, {"transparency": base.getpixel((0, 0))})}
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated 90 degrees
    files["turned.jpg"] = (base, {"exif": exif, "quality": 95})
    for name, (image, options) in files.items():
        image.save(folder / name, **options)
    return [folder / name for name in files]


def test_resize_vllm_gives_the_pixels_vllm_s_image_loading_gives(model, tmp_path):
    """``resize="vllm"`` (the server's default) on a file equals ``"torch"`` on the RGB image vLLM's own
    ``ImageMediaIO`` makes of its bytes (EXIF, transparency onto white), which its processor then resizes."""
    from vllm.multimodal.media import ImageMediaIO

    files = transparent_and_turned(tmp_path)
    loaded = [ImageMediaIO().load_bytes(path.read_bytes()).media for path in files]
    assert {image.mode for image in loaded} == {"RGB"}
    _, folder = model
    with load_encoder(folder, device="cpu") as encoder:
        ours = encoder.encode_images([str(path) for path in files], resize="vllm")
        theirs = encoder.encode_images(loaded, resize="torch")
        plain = encoder.encode_images([str(path) for path in files], resize="torch")
    for path, mine, want, other in zip(files, ours.embeddings, theirs.embeddings, plain.embeddings, strict=True):
        assert torch.equal(mine, want), path.name
        # Transparency tells the two pipelines apart (torchvision's decode applies EXIF orientation too).
        assert torch.equal(other, want) == path.name.startswith("turned"), path.name


def test_resize_vllm_turns_a_video_file_upright_as_vllm_s_reader_does(model, tmp_path):
    """A phone video's rotation metadata: vLLM's video reader (OpenCV) turns the frames upright, transformers' keeps
    them as stored. ``resize="vllm"`` on the file equals the frames vLLM's own reader samples, encoded as given."""
    import av
    from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend

    family, folder = model
    reader = {"qwen2_5_vl": Qwen2VLVideoBackend, "qwen3_vl": Qwen3VLVideoBackend}[family]
    paths = []
    for angle in (0, 90, -90, 180):  # counter-clockwise degrees
        paths.append(tmp_path / f"turned{angle}.mp4")
        with av.open(str(paths[-1]), "w") as container:
            stream = container.add_stream("mpeg4", rate=10)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            if angle:
                stream.set_display_rotation(angle)
            for i in range(9):
                frame = av.VideoFrame.from_ndarray(synthetic_photo(48, 64, seed=i), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
    theirs = [reader.load_bytes(path.read_bytes(), fps=2)[0] for path in paths]
    with load_encoder(folder, device="cpu") as encoder:
        assert encoder.video_config.fps == 2
        ours = encoder.encode_videos([str(path) for path in paths], resize="vllm").embeddings
        want = encoder.encode_videos(theirs).embeddings
        stored = encoder.encode_videos([str(path) for path in paths], resize="torch").embeddings
    for path, mine, wanted, plain in zip(paths, ours, want, stored, strict=True):
        assert torch.equal(mine, wanted), path.name
        assert torch.equal(plain, wanted) == (path.name == "turned0.mp4"), path.name


def test_as_vllm_a_file_s_frames_are_the_ones_vllm_s_samplers_pick():
    """Qwen2's float32 step can run one index past the last frame (0.7% of lengths at 24 fps): vLLM clamps it to the
    last frame where transformers' reader drops it, which changes the video's temporal patches."""
    from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend
    from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata

    from qwenvl_vision.inputs.video import VideoConfig, sample_indices

    differ = 0
    for reader, sampling in ((Qwen2VLVideoBackend, "qwen2"), (Qwen3VLVideoBackend, "qwen3")):
        for rate in (1.0, 24.0, 29.97):
            for total in range(2, 1200):  # one frame: both divide by zero, where this keeps the frame
                source = VideoSourceMetadata(total, rate, total / rate)
                want = reader.compute_frames_index_to_sample(source, VideoTargetMetadata(-1, 2.0, 300))
                assert sample_indices(total, rate, VideoConfig(sampling), 2, clamp=True) == want, (sampling, rate)
                differ += sample_indices(total, rate, VideoConfig(sampling), 2) != want
    assert differ > 0  # the clamp is what tells vLLM's picks from transformers'
