"""The app's routes, key, errors and metrics, served in this process (FastAPI's TestClient; tests/serve/conftest.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from safetensors.torch import load

from tests.helpers.serve import KEY, chat, data_url, error_of, part


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.name.endswith(".lock")}


def test_embeddings_are_the_encoder_s_pooled_vectors_as_float_and_base64(served, media, encoder3):
    client, _ = served
    paths = [media["a.png"], media["b.png"]]
    parts = [part(data_url(p)) for p in paths]
    for normalize in (False, True):
        expected = encoder3.encode_images(paths, pooled=True, normalize=normalize).pooled
        answer = client.post("/v1/embeddings", json=chat(*parts, normalize=normalize)).json()
        floats = torch.tensor([d["embedding"] for d in answer["data"]])
        assert torch.equal(floats, expected.float())
        answer64 = client.post("/v1/embeddings", json=chat(*parts, normalize=normalize,
                                                          encoding_format="base64")).json()
        decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer64["data"]])
        assert torch.equal(torch.from_numpy(decoded), expected.float())
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["object"] == "list"
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
        assert torch.equal(tensors[f"{i}.grid_thw"], expected.grid_thw[i])
        for level, values in enumerate(expected.deepstack[i]):
            assert torch.equal(tensors[f"{i}.deepstack.{level}"], values)


def bad_requests(media) -> dict[str, tuple]:
    """name -> (route, body or raw bytes, headers, status, what the line names)."""
    good = data_url(media["a.png"])
    return {
        "broken image": ("/v1/chat/completions", chat(part(data_url(media["broken.png"]), "u1")), {}, 400,
                         "messages[0].content[1]"),
        "unknown content type": ("/v1/chat/completions", chat(part(good.replace("image/png", "application/pdf"), "u2")),
                                 {}, 415, "messages[0].content[1]", "application/pdf"),
        "uuid ../x": ("/v1/chat/completions", chat(part(good, "../x")), {}, 400, "messages[0].content[1]", "../x"),
        "no uuid in the encoder role": ("/v1/chat/completions", chat(part(good)), {}, 400, "messages[0].content[1]",
                                        "uuid"),
        "a URL outside the allowed domains": ("/v1/embeddings", chat(part("http://example.com/a.png")), {}, 400,
                                              "messages[0].content[1]", "--allowed-media-domains"),
        "an unknown part type": ("/v1/embeddings", chat({"type": "input_audio", "input_audio": {}}), {}, 400,
                                 "messages[0].content[1]", "input_audio"),
        "a body over the limit": ("/v1/embeddings", chat(part("data:image/png;base64," + "A" * (1 << 20))), {}, 413,
                                  "--max-body-mib"),
        "a wrong key": ("/v1/embeddings", chat(part(good)), {"Authorization": "Bearer nope"}, 401, "API key"),
        "no key": ("/v1/models", None, {"Authorization": ""}, 401, "API key"),
        "not JSON": ("/v1/embeddings", b"{", {}, 400, "JSON"),
        "more items than --max-items": ("/v1/embeddings", chat(*[part(good)] * 7), {}, 400, "messages", "--max-items"),
    }


@pytest.mark.parametrize("case", ["broken image", "unknown content type", "uuid ../x", "no uuid in the encoder role",
                                  "a URL outside the allowed domains", "an unknown part type", "a body over the limit",
                                  "a wrong key", "no key", "not JSON", "more items than --max-items"])
def test_bad_input_gets_its_status_and_one_line_and_the_next_request_is_served(served, media, case):
    client, root = served
    route, body, headers, status, *needles = bad_requests(media)[case]
    before = files_under(root)
    if body is None:
        response = client.get(route, headers=headers)
    elif isinstance(body, bytes):
        response = client.post(route, content=body, headers=headers)
    else:
        response = client.post(route, json=body, headers=headers)
    error_of(response, status, *needles)
    assert files_under(root) == before  # nothing written, in the shared folder or anywhere else
    assert client.post("/v1/chat/completions", json=chat(part(data_url(media["b.png"]), "next"))).status_code == 200


def test_without_shared_storage_the_encoder_role_says_how_to_start_it(checkpoint3, media):
    from fastapi.testclient import TestClient

    from qwenvl_vision import load_encoder
    from qwenvl_vision.serve.app import ServeSettings, build_app

    with TestClient(build_app(load_encoder(checkpoint3, device="cpu"), ServeSettings("tiny"))) as client:
        error_of(client.post("/v1/chat/completions", json=chat(part(data_url(media["a.png"]), "u"))), 400,
                 "--ec-shared-storage")
        assert client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"])))).status_code == 200


def test_health_models_and_metrics(served, media):
    client, _ = served
    assert client.get("/health", headers={"Authorization": ""}).json() == {}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    client.post("/v1/embeddings", json=chat(part(data_url(media["c.png"]))))
    error_of(client.get("/metrics", headers={"Authorization": f"Bearer {KEY}x"}), 401)
    text = client.get("/metrics").text
    for needle in ('qwenvl_vision_requests_total{route="/v1/embeddings",status="200"}',
                   'qwenvl_vision_requests_total{route="/metrics",status="401"}', "qwenvl_vision_items_encoded_total",
                   'qwenvl_vision_request_seconds_bucket{le="0.005",route="/v1/embeddings"}',
                   "qwenvl_vision_queue_items 0.0"):
        assert needle in text, text


def test_an_item_sent_twice_under_one_uuid_is_written_once_and_named_at_both_places(served, media):
    client, root = served
    url = data_url(media["c.png"])
    answer = client.post("/v1/chat/completions", json=chat(part(url, "twice"), part(url, "twice"))).json()
    assert answer["ec_transfer_params"]["twice"]["item_indices"] == [0, 1]
    assert [p.name for p in (root / "shared" / "twice").iterdir()] == ["encoder_cache.safetensors"]
