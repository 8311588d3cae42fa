"""The queue in front of the encoder: bounded, refused at once when full (tests/serve/conftest.py: --max-queue 4)."""

from __future__ import annotations

from tests.helpers.serve import chat, data_url, error_of, part


def test_a_full_queue_answers_503_with_retry_after_and_the_next_request_is_served(served, media):
    client, _ = served
    url = data_url(media["a.png"])
    response = client.post("/v1/embeddings", json=chat(*[part(url)] * 5))  # more items than the queue holds
    error_of(response, 503, "--max-queue 4")
    assert int(response.headers["retry-after"]) >= 1
    answer = client.post("/v1/embeddings", json=chat(*[part(url)] * 4)).json()
    assert len({str(d["embedding"]) for d in answer["data"]}) == 1  # the same image, the same vector
