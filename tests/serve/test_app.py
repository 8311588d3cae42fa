"""The app's routes, key, errors and metrics, served in this process (FastAPI's TestClient; tests/serve/conftest.py)."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import uuid

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load, load_file

from qwenvl_vision import load_encoder
from qwenvl_vision.errors import ForwardFaultError, InputError, NumericalError, PreprocessError
from qwenvl_vision.outputs.vllm_cache import write_item
from tests.helpers.serve import KEY, START_S, app_of, chat, data_url, error_of, media_server, part, until


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.name.endswith(".lock")}


def test_embeddings_are_the_encoder_s_pooled_vectors_as_float_and_base64(served, media, encoder3):
    client, _ = served
    paths = [media["a.png"], media["b.png"]]
    parts = [part(data_url(p)) for p in paths]
    for normalize in (False, True):
        expected = encoder3.encode_images(paths, pooled=True, normalize=normalize).pooled
        answer = client.post("/v1/embeddings", json=chat(*parts, normalize=normalize)).json()
        vllm_s = client.post("/v1/embeddings", json=chat(*parts, use_activation=normalize)).json()  # vLLM 0.33's
        assert vllm_s["data"] == answer["data"]
        floats = torch.tensor([d["embedding"] for d in answer["data"]])
        assert torch.equal(floats, expected.float()) and floats.dtype == torch.float32
        answer64 = client.post("/v1/embeddings", json=chat(*parts, normalize=normalize,
                                                          encoding_format="base64")).json()
        decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer64["data"]])
        assert torch.equal(torch.from_numpy(decoded), expected.float())
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["object"] == "list"
    # Whatever media type a data URL names, its content is decoded, as vLLM decodes it.
    octets = chat(*[part(data_url(p, "application/octet-stream")) for p in paths], normalize=True)
    assert torch.equal(torch.tensor([d["embedding"] for d in client.post("/v1/embeddings", json=octets).json()[
        "data"]]), expected.float())
    tokens = sum(e.shape[0] for e in encoder3.encode_images(paths).embeddings)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_return_tokens_answers_each_item_s_tokens_grid_and_deepstack_levels(served, media, encoder3):
    client, _ = served
    paths = [media["a.png"], media["c.png"]]
    response = client.post("/v1/embeddings", json=chat(*[part(data_url(p)) for p in paths], return_tokens=True))
    assert response.status_code == 200 and "safetensors" in response.headers["content-type"]
    tensors = load(response.content)
    expected = encoder3.encode_images(paths)
    assert expected.deepstack[0]  # the tower has DeepStack levels, all of them answered
    for i in range(2):
        assert torch.equal(tensors[f"{i}.embeddings"], expected.embeddings[i])
        assert tensors[f"{i}.embeddings"].dtype == expected.embeddings[i].dtype
        assert torch.equal(tensors[f"{i}.grid_thw"], expected.grid_thw[i])
        for level, values in enumerate(expected.deepstack[i]):
            assert torch.equal(tensors[f"{i}.deepstack.{level}"], values)


def test_images_are_resized_as_vllm_s_processor_resizes_them_whatever_the_checkpoint_names(checkpoint, media):
    """vLLM runs transformers' AutoImageProcessor, which takes the torchvision processor wherever torchvision is
    installed, whatever class a checkpoint's preprocessor_config.json names (Qwen2.5-VL's names the PIL one): the
    server's tokens are the tower's on that processor's pixels."""
    from fastapi.testclient import TestClient
    from PIL import Image
    from transformers import AutoImageProcessor

    encoder = load_encoder(checkpoint, device="cpu")
    assert encoder.preprocess_config.resize == "pil"  # the API's default for this file: the PIL processor's pixels
    pixels = AutoImageProcessor.from_pretrained(checkpoint)(images=[Image.open(media["c.png"])], return_tensors="pt")
    want = encoder.encode_patches(pixels["pixel_values"], pixels["image_grid_thw"].tolist())
    with TestClient(app_of(encoder)) as client:
        response = client.post("/v1/embeddings", json=chat(part(data_url(media["c.png"])), return_tokens=True))
    assert torch.equal(load(response.content)["0.embeddings"], want.embeddings[0])


def bad_requests(media) -> dict[str, tuple]:
    """name -> (route, body or raw bytes, headers, status, what the line names)."""
    good = data_url(media["a.png"])
    return {
        "broken image": ("/v1/chat/completions", chat(part(data_url(media["broken.png"]), "u1")), {}, 400,
                         "messages[0].content[1]"),
        "another model": ("/v1/chat/completions", {**chat(part(good, "m1")), "model": "other/model"}, {}, 404,
                          "other/model"),
        "a stream": ("/v1/chat/completions", chat(part(good, "s1"), stream=True), {}, 400, "stream"),
        "a stream as 1": ("/v1/chat/completions", chat(part(good, "s2"), stream=1), {}, 400, "stream 1"),
        "a stream as a list": ("/v1/chat/completions", chat(part(good, "s3"), stream=[]), {}, 400, "stream []"),
        "embed_dtype float64": ("/v1/embeddings", chat(part(good), embed_dtype="float64"), {}, 400, "embed_dtype",
                                "'float64'"),
        "no item to embed": ("/v1/embeddings", chat(), {}, 400, "no image or video item"),
        "use_activation against normalize": ("/v1/embeddings", chat(part(good), normalize=True, use_activation=False),
                                             {}, 400, "'use_activation': False"),
        "use_activation as text": ("/v1/embeddings", chat(part(good), use_activation="yes"), {}, 400,
                                   "'use_activation': 'yes'"),
        **{f"{name} {value}": ("/v1/embeddings", chat(part(good), encoding_format="base64", **{name: value}), {}, 400,
                               name, "not served")
           for name, value in [("dimensions", 8), ("embed_dtype", "float16"), ("endianness", "big")]},
        "uuid ../x": ("/v1/chat/completions", chat(part(good, "../x")), {}, 400, "messages[0].content[1]", "../x"),
        "uuid of the folder's identity": ("/v1/chat/completions", chat(part(good, "qwenvl_vision_cache.json")), {},
                                          400, "messages[0].content[1]", "qwenvl_vision_cache.json"),
        "uuid of a prune's record": ("/v1/chat/completions", chat(part(good, "pruned.jsonl")), {}, 400,
                                     "messages[0].content[1]", "pruned.jsonl"),
        "one uuid on an image and a video": ("/v1/chat/completions", chat(part(good, "both"), part(data_url(
            media["clip.mp4"], "video/mp4"), "both", "video_url")), {}, 400, "messages[0].content[2]", "'both'"),
        "mm_processor_kwargs": ("/v1/chat/completions", chat(part(good, "k1"), mm_processor_kwargs={"fps": 1}), {},
                                400, "mm_processor_kwargs"),
        "return_tokens as text": ("/v1/embeddings", chat(part(good), return_tokens="false"), {}, 400, "return_tokens",
                                  "'false'"),
        "encoding_format as a number": ("/v1/embeddings", chat(part(good), encoding_format=0), {}, 400,
                                        "encoding_format"),
        "media_io_kwargs": ("/v1/embeddings", chat(part(good), media_io_kwargs={"video": {"num_frames": 2}}), {},
                            400, "media_io_kwargs"),
        "no uuid in the encoder role": ("/v1/chat/completions", chat(part(good)), {}, 400, "messages[0].content[1]",
                                        "uuid"),
        "a URL outside the allowed domains": ("/v1/embeddings", chat(part("http://example.com/a.png")), {}, 400,
                                              "messages[0].content[1]", "--allowed-media-domains"),
        "an http URL with credentials": ("/v1/embeddings", chat(part("http://me:secret@127.0.0.1/a.png")), {}, 400,
                                         "messages[0].content[1]", "me:***@127.0.0.1", "credentials"),
        "a malformed http URL": ("/v1/embeddings", chat(part("http://[x/a.png")), {}, 400, "messages[0].content[1]",
                                 "not a valid URL"),
        "a malformed file URL": ("/v1/embeddings", chat(part("file://[x/a")), {}, 400, "messages[0].content[1]",
                                 "not a valid URL"),
        "an http URL with a port that is no number": ("/v1/embeddings", chat(part("http://127.0.0.1:x/a.png")), {},
                                                      400, "messages[0].content[1]", "127.0.0.1:x"),
        "an unknown part type": ("/v1/embeddings", chat({"type": "input_audio", "input_audio": {}}), {}, 400,
                                 "messages[0].content[1]", "input_audio"),
        "a body over the limit": ("/v1/embeddings", chat(part("data:image/png;base64," + "A" * (1 << 20))), {}, 413,
                                  "--max-body-mib"),
        "a chunked body over the limit": ("/v1/embeddings", iter([b"[" * (1 << 19)] * 3), {}, 413, "--max-body-mib"),
        # Deeper than CPython's recursion limit, its lists' cost within --max-body-mib.
        "JSON nested deeper than the stack": ("/v1/embeddings", b"[" * 15_000 + b"]" * 15_000, {}, 400, "JSON"),
        "many small JSON values": ("/v1/embeddings", b"[" + b"{}," * 50_000 + b"{}]", {}, 413, "JSON values",
                                   "--max-body-mib"),
        "a character outside base64": ("/v1/embeddings", chat(part("data:image/png;base64,iVBORw0KGgo=\u00e9")), {},
                                       400, "messages[0].content[1]", "base64"),
        "a wrong key": ("/v1/embeddings", chat(part(good)), {"Authorization": "Bearer nope"}, 401, "API key"),
        "no key": ("/v1/models", None, {"Authorization": ""}, 401, "API key"),
        "not JSON": ("/v1/embeddings", b"{", {}, 400, "JSON"),
        "JSON sent as text/plain": ("/v1/chat/completions", json.dumps(chat(part(good, "csrf"))).encode(),
                                    {"Content-Type": "text/plain;charset=UTF-8"}, 415, "text/plain", "JSON"),
        "more items than --max-items": ("/v1/embeddings", chat(*[part(good)] * 5), {}, 400, "messages", "--max-items"),
        "content as one part": ("/v1/embeddings", {"messages": [{"role": "user", "content": part(good)}]}, {}, 400,
                                "messages[0].content", "a list of content parts"),
        # Shown short, however long or deep (a repr deeper than the event loop's stack failed).
        "encoding_format as a long text": ("/v1/embeddings", chat(encoding_format="x" * 500_000), {}, 400,
                                           "encoding_format 'xxx"),
        "a content type as a long text": ("/v1/embeddings", chat({"type": "x" * 5000, "image_url": {"url": good}}), {},
                                          400, "messages[0].content[1]", "content type 'xxx"),
        "encoding_format as deep lists": ("/v1/embeddings", b'{"messages": [], "encoding_format": ' + b"[" * 985 +
                                          b"]" * 985 + b"}", {}, 400, "encoding_format [["),
        # JSON's lone surrogate escapes: no host, file or message can hold one.
        **{f"a lone surrogate in {where}": ("/v1/embeddings", json.dumps(chat(part(url))).encode(), {}, 400,
                                            "messages[0].content[1]", "lone surrogate")
           for where, url in [("an allowed URL", "http://127.0.0.1:1/\ud800.png"),
                              ("another host's URL", "http://example.com/\ud800"),
                              ("a file URL", "file:///tmp/\ud800.png")]},
    }


@pytest.mark.parametrize("case", ["broken image", "another model", "a stream", "a stream as 1", "a stream as a list",
                                  "embed_dtype float64", "no item to embed",
                                  "use_activation against normalize", "use_activation as text", "dimensions 8",
                                  "embed_dtype float16", "endianness big", "uuid ../x",
                                  "uuid of the folder's identity",
                                  "uuid of a prune's record", "no uuid in the encoder role",
                                  "one uuid on an image and a video", "mm_processor_kwargs",
                                  "media_io_kwargs", "a URL outside the allowed domains",
                                  "an http URL with credentials", "a malformed http URL", "a malformed file URL",
                                  "an http URL with a port that is no number", "an unknown part type",
                                  "a body over the limit", "a chunked body over the limit",
                                  "JSON nested deeper than the stack", "many small JSON values",
                                  "a character outside base64", "a wrong key", "no key", "not JSON",
                                  "JSON sent as text/plain",
                                  "more items than --max-items", "return_tokens as text",
                                  "encoding_format as a number", "content as one part",
                                  "encoding_format as a long text", "encoding_format as deep lists",
                                  "a content type as a long text",
                                  "a lone surrogate in an allowed URL", "a lone surrogate in another host's URL",
                                  "a lone surrogate in a file URL"])
def test_bad_input_gets_its_status_and_one_line_and_the_next_request_is_served(served, media, case):
    client, root = served
    route, body, headers, status, *needles = bad_requests(media)[case]
    before = files_under(root)
    if body is None:
        response = client.get(route, headers=headers)
    elif not isinstance(body, dict):  # bytes, or an iterator of them (a chunked body)
        response = client.post(route, content=body, headers=headers)
    else:
        response = client.post(route, json=body, headers=headers)
    error_of(response, status, *needles)
    assert files_under(root) == before  # nothing written, in the shared folder or anywhere else
    fresh = uuid.uuid4().hex  # encoded, not found written by an earlier case
    assert client.post("/v1/chat/completions", json=chat(part(data_url(media["b.png"]), fresh))).status_code == 200


def test_without_shared_storage_the_encoder_role_says_how_to_start_it(checkpoint3, media):
    from fastapi.testclient import TestClient

    from qwenvl_vision import load_encoder

    with TestClient(app_of(load_encoder(checkpoint3, device="cpu"))) as client:
        error_of(client.post("/v1/chat/completions", json=chat(part(data_url(media["a.png"]), "u"))), 400,
                 "--ec-shared-storage")
        assert client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))).status_code == 200


def test_an_item_over_max_item_tokens_is_refused_naming_it(checkpoint3, media):
    from fastapi.testclient import TestClient

    from qwenvl_vision import load_encoder

    with TestClient(app_of(load_encoder(checkpoint3, device="cpu"), "--max-item-tokens", 1)) as client:
        error_of(client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))), 400,
                 "messages[0].content[1]", "tokens, more than the bound of 1", "--max-item-tokens")


def test_health_models_and_metrics_the_key_guarding_v1_alone(served, media):
    client, _ = served
    assert client.get("/health", headers={"Authorization": ""}).json() == {}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "its-alias"]
    for name in ("its-alias", ""):  # an alias, or no name: as vLLM's chat takes them
        answer = client.post("/v1/chat/completions", json=chat(part(data_url(media["c.png"]), "named"), model=name))
        assert answer.status_code == 200 and answer.json()["model"] == "tiny", answer.text
    for value in ("false", "no", 0, None):  # what vLLM's model reads as no stream
        answer = client.post("/v1/chat/completions", json=chat(part(data_url(media["c.png"]), "named"), stream=value))
        assert answer.status_code == 200, (value, answer.text)
    # vLLM's embeddings check neither the name nor stream.
    answer = client.post("/v1/embeddings", json=chat(part(data_url(media["c.png"])), model="another", stream=True))
    assert answer.status_code == 200 and answer.json()["model"] == "tiny", answer.text
    # vLLM's names for base64's bytes, which the float form does not use.
    answer = client.post("/v1/embeddings", json=chat(part(data_url(media["c.png"])), embed_dtype="float16",
                                                     endianness="big"))
    assert answer.status_code == 200, answer.text
    error_of(client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"}), 401)
    client.get("/nowhere")
    response = client.get("/metrics", headers={"Authorization": ""})  # a scraper set up for vLLM has no key
    assert response.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    assert samples[("qwenvl_vision_requests_total", (("route", "/v1/embeddings"), ("status", "200")))] >= 1
    assert samples[("qwenvl_vision_requests_total", (("route", "/v1/models"), ("status", "401")))] >= 1
    assert samples[("qwenvl_vision_requests_total", (("route", "other"), ("status", "404")))] >= 1
    assert samples[("qwenvl_vision_items_encoded_total", ())] >= 1
    assert samples[("qwenvl_vision_request_seconds_count", (("route", "/v1/embeddings"),))] >= 1
    assert samples[("qwenvl_vision_queue_items", ())] == 0


def test_an_item_sent_twice_under_one_uuid_is_written_once_and_named_at_both_places(served, media):
    client, root = served
    url = data_url(media["c.png"])
    answer = client.post("/v1/chat/completions", json=chat(part(url, "twice"), part(url, "twice"))).json()
    assert answer["ec_transfer_params"]["twice"]["item_indices"] == [0, 1]
    assert [p.name for p in (root / "shared" / "twice").iterdir()] == ["encoder_cache.safetensors"]


def test_an_item_found_written_is_touched_for_a_prune_s_oldest_first(served, media):
    client, root = served
    request = chat(part(data_url(media["a.png"]), "touched"))
    assert client.post("/v1/chat/completions", json=request).status_code == 200
    path = root / "shared" / "touched" / "encoder_cache.safetensors"
    os.utime(path, (0, 0))  # as old as can be
    assert client.post("/v1/chat/completions", json=request).status_code == 200
    assert path.stat().st_mtime > 0


def test_a_link_at_an_item_s_folder_is_the_folder_s_fault_never_read_through(served, media, tmp_path):
    client, root = served
    (root / "shared" / "linked").symlink_to(tmp_path, target_is_directory=True)
    error_of(client.post("/v1/chat/completions", json=chat(part(data_url(media["a.png"]), "linked"))), 500,
             "shared/linked", "symbolic link")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("other", ["item", "file"])
def test_an_item_another_writer_left_at_a_uuid_is_a_409_naming_it(served, media, other):
    client, root = served
    name = f"foreign-{other}"
    if other == "item":
        write_item(root / "shared", name, torch.zeros(4, 8), "t")  # as embed or vLLM's producer writes one
    else:
        (root / "shared" / name).write_text("not a folder")
    before = files_under(root)
    error_of(client.post("/v1/chat/completions", json=chat(part(data_url(media["a.png"]), name))), 409,
             "messages[0].content[1]", name, "did not write" if other == "item" else "is a file")
    assert files_under(root) == before


def test_a_uuid_written_as_an_image_is_a_409_for_a_video(served, media):
    client, root = served
    assert client.post("/v1/chat/completions", json=chat(part(data_url(media["a.png"]), "kind"))).status_code == 200
    before = files_under(root)
    error_of(client.post("/v1/chat/completions", json=chat(part(data_url(media["clip.mp4"], "video/mp4"), "kind",
                                                                   "video_url"))), 409, "messages[0].content[1]",
             "'kind'", "image")
    assert files_under(root) == before


def post_in_thread(client, route: str, body: dict) -> tuple[threading.Thread, list]:
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(client.post(route, json=body)))
    thread.start()
    return thread, answers


def test_chat_requests_waiting_for_the_cache_lock_leave_the_other_routes_served(served, media):
    """A writer holding the encoder role's folder (a suspended embed) holds the chat requests, not the threads
    every request parses in: more of them than asyncio's default threads leave /v1/embeddings answered."""
    import time

    from qwenvl_vision.outputs.vllm_cache import cache_lock

    client, root = served
    waiting = min(32, (os.cpu_count() or 1) + 4) + 1
    with cache_lock(root / "shared"):
        chats = [post_in_thread(client, "/v1/chat/completions", chat(part(data_url(media["a.png"]), f"locked{i}")))
                 for i in range(waiting)]
        time.sleep(1)  # each parsed and waiting for the lock
        embeddings = post_in_thread(client, "/v1/embeddings", chat(part(data_url(media["a.png"]))))
        embeddings[0].join(START_S)
        assert embeddings[1] and embeddings[1][0].status_code == 200
        assert not any(answers for _, answers in chats)
    for thread, answers in chats:
        thread.join(START_S)
        assert answers[0].status_code in (200, 503)  # encoded and written, or beyond --max-queue 4 once let go


def test_two_requests_racing_for_one_uuid_both_answer_the_file_written(held, media, tmp_path):
    client, encoder = held
    first = post_in_thread(client, "/v1/chat/completions", chat(part(data_url(media["a.png"]), "raced")))
    assert encoder.entered.wait(START_S)  # the first is being encoded, the second finds no file either
    second = post_in_thread(client, "/v1/chat/completions", chat(part(data_url(media["c.png"]), "raced")))
    until(lambda: "qwenvl_vision_queue_items 2.0" in client.get("/metrics").text, "the second request queued")
    encoder.go.set()
    answers = []
    for thread, answer in (first, second):
        thread.join()
        answers.append(answer[0].json())
    rows = load_file(tmp_path / "shared" / "raced" / "encoder_cache.safetensors")["ec_cache"].shape[0]
    assert [a["usage"]["prompt_tokens"] for a in answers] == [rows, rows]  # the file's, not the second encode's
    assert answers[0]["ec_transfer_params"] == answers[1]["ec_transfer_params"]


def test_a_failed_forward_is_a_500_in_vllm_s_shape(held, media):
    client, encoder = held
    encoder.fail = RuntimeError("a forward's bug")
    encoder.go.set()
    response = client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"]))))
    error_of(response, 500, "internal error", "RuntimeError")
    assert response.json()["error"]["type"] == "InternalServerError"
    assert client.get("/health").status_code == 200  # one request's failure: the device works


@pytest.mark.parametrize("error_class, status", [(PreprocessError, 400), (InputError, 400), (NumericalError, 500),
                                                 (ForwardFaultError, 500)])
def test_an_item_s_failure_answers_the_status_of_its_class(held, media, error_class, status):
    client, encoder = held
    encoder.item_error = error_class
    encoder.go.set()
    error_of(client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))), status, "messages[0].content[1]")


def test_a_broken_device_fails_health_and_every_later_request(held, media):
    client, encoder = held
    encoder.fail = ForwardFaultError("the forward of a batch of 1 input failed: RuntimeError: an illegal address")
    request = chat(part(data_url(media["a.png"])))
    answers: dict = {}
    threads = [threading.Thread(target=lambda name=name: answers.setdefault(name, client.post(
        "/v1/embeddings", json=request))) for name in ("failing", "queued")]
    threads[0].start()
    assert encoder.entered.wait(START_S)  # the first request's forward is under way
    threads[1].start()
    until(lambda: "qwenvl_vision_queue_items 2.0" in client.get("/metrics").text, "the second request queued")
    encoder.go.set()
    for thread in threads:
        thread.join()
    error_of(answers["failing"], 500, "an illegal address")
    error_of(answers["queued"], 503, "device", "an illegal address")  # queued before the fault: no forward
    error_of(client.get("/health"), 503, "device", "an illegal address")
    encoder.entered.clear()
    error_of(client.post("/v1/embeddings", json=request), 503, "device", "an illegal address")
    assert not encoder.entered.is_set()  # refused without a forward on the broken device


def test_the_app_s_end_closes_the_encoder_leaving_no_tensor(checkpoint3, media):
    from fastapi.testclient import TestClient

    from qwenvl_vision import load_encoder
    from qwenvl_vision.teardown.census import live_tensor_bytes

    before = live_tensor_bytes()
    encoder = load_encoder(checkpoint3, device="cpu")
    with TestClient(app_of(encoder)) as client:
        assert client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))).status_code == 200
    assert encoder.closed and live_tensor_bytes() == before  # 0 bytes left, as the teardown benchmark reads it


@pytest.mark.parametrize("serve", [False, True], ids=["never-served", "served"])
def test_a_dropped_app_leaves_its_encoder_to_the_collector(checkpoint3, media, serve):
    """FastAPI keeps every route's callable in process-wide caches: the app's routes must not hold its encoder."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    from qwenvl_vision.teardown.census import live_tensor_bytes

    gc.collect()  # what earlier tests left in cycles is not counted against the app
    before = live_tensor_bytes()
    encoder = load_encoder(checkpoint3, device="cpu")
    app, gone = app_of(encoder), weakref.ref(encoder)
    if serve:
        with TestClient(app) as client:
            assert client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))).status_code == 200
        del client
    del app, encoder
    gc.collect()
    assert gone() is None and live_tensor_bytes() == before


def test_a_request_after_the_app_s_end_is_answered_503_not_held(checkpoint3, media):
    """Its encoder closed and its thread ended: nothing would ever encode the request."""
    from fastapi.testclient import TestClient

    app = app_of(load_encoder(checkpoint3, device="cpu"))
    with TestClient(app):
        pass
    client = TestClient(app)
    thread, answers = post_in_thread(client, "/v1/embeddings", chat(part(data_url(media["a.png"]))))
    thread.join(START_S)
    assert answers, "the request is held"
    error_of(answers[0], 503, "shutting down")
    error_of(client.get("/health"), 503, "shutting down")


def test_media_read_count_against_max_bodies_mib_until_their_answer(held):
    from PIL import Image

    client, encoder = held
    noise = np.random.default_rng(0).integers(0, 255, (400, 500, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, "PNG")  # ~600 KB: one fits --max-bodies-mib 1 (conftest), two do not
    image = buffer.getvalue()

    def answer(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(image)))
        handler.end_headers()
        handler.wfile.write(image)

    with media_server(answer) as base:
        request = chat(part(f"{base}/noise.png"))
        first = post_in_thread(client, "/v1/embeddings", request)
        assert encoder.entered.wait(START_S)  # its image read, held until its answer
        second = post_in_thread(client, "/v1/embeddings", request)
        until(lambda: second[1], "the second request answered")  # by its read's charge, before any forward
        encoder.go.set()
        for thread, _ in (first, second):
            thread.join()
        assert first[1][0].status_code == 200
        error_of(second[1][0], 503, "--max-bodies-mib")  # the server's load: a retry may be served
        assert int(second[1][0].headers["retry-after"]) >= 1
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/a.png"), part(f"{base}/b.png"))), 413,
                 "--max-bodies-mib")  # more than the server ever holds: no retry would be served
