"""The queue in front of the encoder: bounded, refused at once when full (tests/serve/conftest.py: --max-queue 4)."""

from __future__ import annotations

import threading

from tests.helpers.serve import chat, data_url, error_of, part


def test_a_full_queue_answers_503_with_retry_after_and_the_next_request_is_served(held, media):
    client, encoder = held
    url = data_url(media["a.png"])
    answers: list = []

    def post(n: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.append(client.post("/v1/embeddings", json=chat(
            *[part(url)] * n))))
        thread.start()
        return thread

    threads = [post(1)]
    encoder.entered.wait()  # the first item is taken: the encoder holds it
    threads.append(post(4))
    while "qwenvl_vision_queue_items 4.0" not in client.get("/metrics").text:  # the queue is full
        pass
    response = client.post("/v1/embeddings", json=chat(part(url)))
    error_of(response, 503, "--max-queue 4")
    assert int(response.headers["retry-after"]) >= 1
    encoder.go.set()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [200, 200]
    answer = client.post("/v1/embeddings", json=chat(*[part(url)] * 4)).json()
    assert len({str(d["embedding"]) for d in answer["data"]}) == 1  # the same image, the same vector

