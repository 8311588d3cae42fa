"""The queue in front of the encoder: bounded, refused at once when full (tests/serve/conftest.py: --max-queue 4)."""

from __future__ import annotations

import threading

from tests.helpers.serve import START_S, chat, data_url, error_of, part, until
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
    assert encoder.entered.wait(START_S)  # the first item is taken: the encoder holds it
    threads.append(post(4))
    until(lambda: "qwenvl_vision_queue_items 4.0" in client.get("/metrics").text, "4 items queued")
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
    assert client.post("/v1/embeddings", json=chat(*[part(data_url(media["a.png"]))] * 4)).status_code == 200
