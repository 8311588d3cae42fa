"""The queue in front of the encoder: bounded, refused at once when full (tests/serve/conftest.py: --max-queue 4)."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from qwenvl_vision import load_encoder
from tests.helpers.serve import (
    KEY,
    START_S,
    Held,
    app_of,
    chat,
    data_url,
    error_of,
    free_port,
    part,
    server_options,
    until,
)
from tests.helpers.servers import http_folder


def test_a_full_queue_answers_503_with_retry_after_before_reading_media_and_the_next_request_is_served(held, media):
    client, encoder = held
    url = data_url(media["a.png"])
    answers: list = []

    def post(n: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.append(client.post("/v1/embeddings", json=chat(
            *[part(url)] * n))))
        thread.start()
        return thread

    threads = [post(1)]
    assert encoder.entered.wait(START_S)  # the first item is taken: the encoder holds it, counted until answered
    threads.append(post(3))
    until(lambda: "qwenvl_vision_queue_items 4.0" in client.get("/metrics").text, "4 items queued or encoded")
    fetched: list = []
    with http_folder(media["a.png"].parent, requests=fetched) as base:
        response = client.post("/v1/embeddings", json=chat(part(f"{base}/a.png")))
    error_of(response, 503, "--max-queue 4")
    assert int(response.headers["retry-after"]) >= 1 and fetched == []  # refused before its media was read
    encoder.go.set()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [200, 200]
    answer = client.post("/v1/embeddings", json=chat(*[part(url)] * 4)).json()
    assert len({str(d["embedding"]) for d in answer["data"]}) == 1  # the same image, the same vector


def test_a_request_whose_media_fail_to_load_gives_its_room_in_the_queue_back(served, media):
    client, _ = served
    with http_folder(media["a.png"].parent) as base:
        for _ in range(2):  # each request fills the queue's room (--max-queue 4): one kept would refuse the next
            error_of(client.post("/v1/embeddings", json=chat(*[part(f"{base}/missing.png")] * 4)), 400, "404")
    assert "qwenvl_vision_queue_items 0.0" in client.get("/metrics").text
    assert client.post("/v1/embeddings", json=chat(*[part(data_url(media["a.png"]))] * 4)).status_code == 200


def test_bodies_over_max_bodies_mib_at_once_answer_503_and_each_answer_gives_its_body_s_room_back(held, media):
    client, encoder = held
    request = chat(part(data_url(media["a.png"])))
    request["messages"][0]["content"].append({"type": "text", "text": "x" * (600 << 10)})  # 0.6 of the 1 MiB in all
    answers: list = []
    first = threading.Thread(target=lambda: answers.append(client.post("/v1/embeddings", json=request)))
    first.start()
    assert encoder.entered.wait(START_S)  # the first request's body is held until it is answered
    second: list = []
    refused = threading.Thread(target=lambda: second.append(client.post("/v1/embeddings", json=request)), daemon=True)
    refused.start()
    refused.join(START_S)
    assert second, "a body over --max-bodies-mib was queued, not refused"
    response = second[0]
    error_of(response, 503, "--max-bodies-mib 1")
    assert int(response.headers["retry-after"]) >= 1
    encoder.go.set()
    first.join()
    assert answers[0].status_code == 200
    broken = chat(part(data_url(media["broken.png"])))
    broken["messages"][0]["content"].append(request["messages"][0]["content"][-1])
    error_of(client.post("/v1/embeddings", json=broken), 400, "messages[0].content[1]")  # a failed request too
    assert client.post("/v1/embeddings", json=request).status_code == 200


def test_a_request_refused_for_the_bodies_bound_gives_back_what_it_held_at_once():
    """Three bodies arriving at once where two fit: the one refused holds nothing the other two need."""
    from types import SimpleNamespace

    from qwenvl_vision.serve.app import BodyBudget
    from qwenvl_vision.serve.media import RequestError

    budget = BodyBudget(limit=1000)
    a, b, c = (SimpleNamespace(state=SimpleNamespace()) for _ in range(3))
    for request in (a, b, c):
        budget.charge(request, 300)
    with pytest.raises(RequestError, match="--max-bodies-mib") as refused:
        budget.charge(c, 300)
    assert refused.value.status == 503 and budget.held == 600
    budget.charge(a, 200)
    budget.charge(b, 200)  # held by the refused request, these bytes would be refused too
    budget.release(c)  # its answer, later: nothing more given back
    assert budget.held == 1000


def test_a_client_that_hangs_up_has_its_queued_items_skipped_and_their_room_given_back(tmp_path, checkpoint3, media):
    """Under uvicorn, as users serve: a client that gave up (its timeout) while its items waited would otherwise
    have them encoded for nobody, ahead of the requests still waiting."""
    import uvicorn

    (tmp_path / "local").mkdir()
    encoder = Held(load_encoder(checkpoint3, device="cpu"))
    port, auth = free_port(), {"Authorization": f"Bearer {KEY}"}
    server = uvicorn.Server(uvicorn.Config(app_of(encoder, *server_options(tmp_path)), port=port, log_level="error"))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: server.started, "serving")
        first: list = []
        sent = threading.Thread(target=lambda: first.append(httpx.post(
            f"{url}/v1/embeddings", json=chat(part(data_url(media["a.png"]))), headers=auth, timeout=START_S)))
        sent.start()
        assert encoder.entered.wait(START_S)  # the encoder holds the first request's item
        body = json.dumps(chat(*[part(data_url(media["b.png"]))] * 3)).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            until(lambda: "qwenvl_vision_queue_items 4.0" in httpx.get(f"{url}/metrics").text, "4 items held")
        until(lambda: 'route="/v1/embeddings",status="400"} 1.0' in httpx.get(f"{url}/metrics").text,
              "the request that hung up answered")
        encoder.go.set()
        sent.join()
        assert first[0].status_code == 200
        until(lambda: "qwenvl_vision_queue_items 0.0" in httpx.get(f"{url}/metrics").text, "the queue empty")
        assert "qwenvl_vision_items_encoded_total 1.0" in httpx.get(f"{url}/metrics").text  # the first's alone
    finally:
        encoder.go.set()
        server.should_exit = True
        thread.join()
