"""``qwenvl-vision serve`` as users run it: the real server (uvicorn, a child process) on a loopback port, sent what
vLLM's disaggregated-encoder proxy sends, stopped by SIGTERM."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision.cli import main
from qwenvl_vision.outputs.vllm_cache import CACHE_FILE, CACHE_KEY, write_vllm_cache
from tests.helpers import ENV
from tests.helpers.serve import START_S, chat, data_url, free_port, held_answer, media_server, part, serving, until

AS_TINY = ["--served-model-name", "tiny", "--device", "cpu"]  # the name chat() asks for


def items_encoded(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith("qwenvl_vision_items_encoded_total")).split()[-1])


def test_the_proxy_s_request_writes_write_vllm_cache_s_items_under_their_uuids_once(tmp_path, checkpoint3, media,
                                                                                   encoder3):
    pytest.importorskip("av")
    shared, reference = tmp_path / "shared", tmp_path / "reference"
    images, video = [media["a.png"], media["b.png"]], media["clip.mp4"]
    urls = [data_url(p) for p in images] + [data_url(video, "video/mp4")]
    uuids = [hashlib.sha256(url.encode()).hexdigest() for url in urls]  # what the proxy names each item
    parts = [part(urls[0], uuids[0]), part(urls[1], uuids[1]), part(urls[2], uuids[2], "video_url")]
    request = chat(*parts, max_tokens=1, stream=False, model=str(checkpoint3))  # served as --model names it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's (ENV: one thread), for the same bits
    try:
        entries = write_vllm_cache(encoder3.encode_images(images), reference) + \
            write_vllm_cache(encoder3.encode_videos([video]), reference)
    finally:
        torch.set_num_threads(threads)
    with serving(["--model", checkpoint3, "--device", "cpu", "--ec-shared-storage", shared],
                 {**ENV, "QWENVL_VISION_API_KEY": "k"}) as url:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == str(checkpoint3)
            response = client.post("/v1/chat/completions", json=request, headers={"x-request-id": "req-1"})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-req-1"
            files = [shared / u / CACHE_FILE for u in uuids]
            for i, (uuid, e, path) in enumerate(zip(uuids, entries, files)):
                expected = load_file(reference / e["id"] / CACHE_FILE)[CACHE_KEY]
                got = load_file(path)[CACHE_KEY]
                assert torch.equal(got, expected) and got.dtype == expected.dtype  # bitwise, dtype included
                assert answer["ec_transfer_params"][uuid] == {
                    "modality": e["modality"], "metadata": {f"{e['modality']}_grid_thw": e["grid_thw"],
                                                            **({"timestamps": e["timestamps"]} if i == 2 else {})},
                    "item_indices": [i]}  # vLLM's producer's shape, the fields that size the item's placeholders
            assert entries[2]["timestamps"]  # Qwen3-VL's videos carry their timing
            assert answer["usage"]["prompt_tokens"] == sum(e["tokens"] for e in entries)
            written, encoded = [p.read_bytes() for p in files], items_encoded(client)
            again = client.post("/v1/chat/completions", json=request, headers={"x-request-id": "req-2"})
            assert again.json()["ec_transfer_params"] == answer["ec_transfer_params"]
            assert items_encoded(client) == encoded == 3  # found in place: not encoded again, nor written (touched)
            assert [p.read_bytes() for p in files] == written
            text_only = client.post("/v1/chat/completions", json=chat(model=str(checkpoint3)))
            assert text_only.status_code == 200 and text_only.json()["ec_transfer_params"] == {}
            assert httpx.get(f"{url}/v1/models").status_code == 401  # the key from the environment
    assert url.process.returncode == 0  # SIGTERM: stopped after what was in flight, the encoder closed
    assert sorted(p.name for p in shared.iterdir()) == sorted(uuids + ["qwenvl_vision_cache.json",
                                                                       "qwenvl_vision_cache.lock"])


def test_sigterm_while_the_tower_loads_is_serve_s_normal_stop(checkpoint3, monkeypatch, capsys):
    """A scheduler stopping a server that is still loading stops it as one that serves: exit 0."""
    import os

    import qwenvl_vision.loading

    def load_encoder(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal's handler raises within

    monkeypatch.setattr(qwenvl_vision.loading, "load_encoder", load_encoder)
    assert main(["serve", "--model", str(checkpoint3), "--port", str(free_port())]) == 0


def test_serve_refuses_a_preset_without_random_weights_in_one_line(capsys):
    assert main(["serve", "--model", "qwen2.5-vl-3b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--random-weights" in err


@pytest.mark.parametrize("one, all_", [(("--max-items", "5"), ("--max-queue", "4")),
                                       (("--max-body-mib", "64"), ("--max-bodies-mib", "32"))])
def test_serve_refuses_a_request_s_limit_over_what_the_server_holds_at_once(capsys, one, all_):
    assert main(["serve", "--model", "m", *one, *all_]) == 2
    err = capsys.readouterr().err
    assert " ".join(one) in err and " ".join(all_) in err


def test_serve_without_its_extra_says_how_to_install_it(capsys, monkeypatch, checkpoint3):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert main(["serve", "--model", str(checkpoint3), "--device", "cpu"]) == 2
    assert "pip install 'qwenvl-vision[serve]'" in capsys.readouterr().err


def test_a_port_in_use_is_a_setup_error_naming_it(capsys, checkpoint3):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", str(checkpoint3), "--device", "cpu", "--port", port]) == 2
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_a_port_out_of_range_is_a_usage_error_naming_it(capsys):
    assert main(["serve", "--model", "m", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--port" in err and "70000" in err


def test_a_client_hanging_up_mid_body_is_the_request_s_400_not_a_server_error(checkpoint3):
    with serving(["--model", checkpoint3, *AS_TINY]) as url:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as client:
            client.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100000\r\n\r\n{\"messages\": [")
        answered = 'qwenvl_vision_requests_total{route="/v1/embeddings",status='
        until(lambda: answered in httpx.get(f"{url}/metrics").text, "the request counted")
        assert f'{answered}"400"}} 1.0' in httpx.get(f"{url}/metrics").text
        assert "Traceback" not in url.log()


def test_a_client_silent_mid_body_is_answered_408_and_sigterm_does_not_wait_for_one(checkpoint3):
    """Stalled mid-body, a client would hold its bytes of --max-bodies-mib and a SIGTERM's wait for as long as it
    liked: after --body-timeout it is answered 408, and the server stops (exit 0) with another one still stalled."""
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{\"messages\": [")
    with serving(["--model", checkpoint3, *AS_TINY, "--body-timeout", 1]) as url:
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with socket.create_connection(address, timeout=START_S) as client, \
                socket.create_connection(address, timeout=START_S) as stalled:
            client.sendall(head)
            assert client.recv(4096).startswith(b"HTTP/1.1 408 ")
            stalled.sendall(head)
            url.process.send_signal(signal.SIGTERM)  # serving() then asserts the exit 0
            url.process.wait(START_S)
        assert "Traceback" not in url.log()


def test_requests_beyond_twice_max_queue_at_once_are_answered_503(checkpoint3, media):
    arrived, release = threading.Semaphore(0), threading.Event()
    answers: list = []
    with media_server(held_answer(media["a.png"].read_bytes(), arrived.release, release)) as base:
        try:
            with serving(["--model", checkpoint3, *AS_TINY, "--allowed-media-domains", "127.0.0.1",
                          "--max-queue", "2", "--max-items", "1"]) as url:
                body = chat(part(f"{base}/a.png"))
                clients = [threading.Thread(target=lambda: answers.append(httpx.post(
                    f"{url}/v1/embeddings", json=body, timeout=120))) for _ in range(2)]
                for client in clients:
                    client.start()
                for _ in clients:
                    assert arrived.acquire(timeout=START_S), url.log()  # in flight, within the limit of 4
                port = int(url.rsplit(":", 1)[1])
                with socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port)):
                    assert httpx.get(f"{url}/v1/models").status_code == 503  # a fifth connection
                release.set()
                for client in clients:
                    client.join()
        finally:
            release.set()
    assert [a.status_code for a in answers] == [200] * 2


def test_neither_the_package_nor_the_serve_command_line_loads_the_server_s_libraries():
    code = ("import json, sys, qwenvl_vision; core = sorted(sys.modules); from qwenvl_vision.cli import build_parser; "
            "build_parser().parse_args(['serve', '--model', 'm']); print(json.dumps([core, sorted(sys.modules)]))")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    core, parser = json.loads(done.stdout)
    assert not [m for m in core if m.startswith("qwenvl_vision.serve")]
    assert not [m for m in parser if m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "prometheus_client")]


def test_sigterm_stops_accepting_finishes_the_request_in_flight_and_exits_0(tmp_path, checkpoint3, media):
    arrived, release = threading.Event(), threading.Event()  # the request stays in flight until the test lets it go
    answers = []
    with media_server(held_answer(media["a.png"].read_bytes(), arrived.set, release)) as base:
        try:
            with serving(["--model", checkpoint3, *AS_TINY, "--allowed-media-domains", "127.0.0.1"]) as url:
                body = chat(part(f"{base}/a.png"))
                client = threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/v1/embeddings", json=body,
                                                                                    timeout=120)))
                client.start()
                assert arrived.wait(START_S), url.log()  # the server is fetching the item
                url.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + START_S  # a bound: a server that goes on accepting fails, not hangs
                while time.monotonic() < deadline:  # stopped accepting: new connections refused, the request in flight
                    try:
                        httpx.get(f"{url}/health", timeout=5)
                    except httpx.TransportError:
                        break
                else:
                    raise AssertionError(f"serve still accepts connections {START_S} s after SIGTERM")
                release.set()
                client.join()
        finally:
            release.set()
    assert answers[0].status_code == 200 and len(answers[0].json()["data"]) == 1
    assert url.process.returncode == 0
