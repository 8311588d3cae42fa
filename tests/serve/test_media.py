"""Media sources under the policy: http(s) only from the allowed domains (redirects too), file:// only under the
allowed folder, data: URLs by their media type (tests/serve/conftest.py serves 127.0.0.1 and root/local)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time

import pytest

from qwenvl_vision import load_encoder
from tests.helpers.serve import START_S, app_of, chat, data_url, error_of, held_answer, media_server, part, until
from tests.helpers.servers import http_folder


def pooled(client, url: str, kind: str = "image_url") -> list[float]:
    response = client.post("/v1/embeddings", json=chat(part(url, kind=kind)))
    assert response.status_code == 200, response.text
    return response.json()["data"][0]["embedding"]


def test_http_from_an_allowed_domain_and_redirects_within_it_give_the_data_url_s_item(served, media):
    client, _ = served
    folder = media["a.png"].parent
    with http_folder(folder, redirects={"moved.png": "/a.png"}) as base:
        assert pooled(client, f"{base}/a.png") == pooled(client, f"{base}/moved.png") == \
            pooled(client, data_url(media["a.png"]))
        assert pooled(client, f"{base}/clip.mp4", "video_url") == \
            pooled(client, data_url(media["clip.mp4"], "video/mp4"), "video_url")
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/missing.png"))), 400,
                 "messages[0].content[1]", "404")


def test_a_url_naming_characters_a_url_may_not_hold_is_fetched_percent_encoded(served, media, tmp_path):
    client, _ = served
    shutil.copy(media["a.png"], tmp_path / "\u00e9t\u00e9 1.png")
    with http_folder(tmp_path) as base:
        assert pooled(client, f"{base}/\u00e9t\u00e9 1.png") == pooled(client, data_url(media["a.png"]))


@pytest.mark.parametrize("target", ["file:///etc/hostname", "http://localhost:{port}/a.png", "ftp://127.0.0.1/a.png",
                                    "http://[x/a.png"])
def test_a_redirect_out_of_the_allowed_domains_is_the_item_s_error(served, media, target):
    client, _ = served
    redirects = {"away.png": target}  # the port filled in once the server has one
    with http_folder(media["a.png"].parent, redirects=redirects) as base:
        redirects["away.png"] = target.format(port=base.rsplit(":", 1)[1])
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/away.png"))), 400, "messages[0].content[1]",
                 "redirect", target.split(":")[0])


def test_local_files_only_under_the_allowed_folder_links_resolved(served, media, tmp_path):
    client, root = served
    local = root / "local"
    assert pooled(client, f"file://{local}/a.png") == pooled(client, data_url(media["a.png"]))
    link = local / f"link-{os.getpid()}.png"
    link.symlink_to(media["b.png"])  # inside the folder, pointing out of it
    try:
        for url in (f"file://{media['b.png']}", f"file://{link}", f"file://{local}/../../{media['b.png'].parent.name}/b.png"):
            error_of(client.post("/v1/embeddings", json=chat(part(url))), 400, "messages[0].content[1]",
                     "--allowed-local-media-path")
    finally:
        link.unlink()


def test_a_data_url_is_read_by_its_content_and_its_part_s_kind(served, media):
    client, _ = served
    # The decoder reads the content, as vLLM's: a subtype clients misspell (image/jpg) is still an image.
    assert pooled(client, data_url(media["a.png"], "image/jpg")) == pooled(client, data_url(media["a.png"]))
    mp4 = data_url(media["clip.mp4"], "video/mp4")
    error_of(client.post("/v1/embeddings", json=chat(part(mp4))), 400, "messages[0].content[1]", "not a recognised "
             "image")
    error_of(client.post("/v1/embeddings", json=chat(part(data_url(media["a.png"]), kind="video_url"))), 400,
             "messages[0].content[1]", "not a video")
    error_of(client.post("/v1/embeddings", json=chat(part(mp4.replace(";base64", ""), kind="video_url"))), 400,
             "messages[0].content[1]", "base64")


def test_a_slow_url_holds_only_its_own_request(served, media):
    client, _ = served
    arrived, release = threading.Event(), threading.Event()
    slow_answer: list = []
    with media_server(held_answer(media["a.png"].read_bytes(), arrived.set, release)) as base:
        thread = threading.Thread(target=lambda: slow_answer.append(pooled(client, f"{base}/a.png")))
        thread.start()
        try:
            assert arrived.wait(START_S)
            assert "qwenvl_vision_queue_items 1.0" in client.get("/metrics").text  # its room held while it loads
            assert pooled(client, data_url(media["b.png"])) and not slow_answer  # served while the URL is read
        finally:
            release.set()
            thread.join()
    assert slow_answer == [pooled(client, data_url(media["a.png"]))]


def trickled(handler) -> bool:
    """A byte every 0.1 s for a minute; whether the reader went away first."""
    try:
        for _ in range(600):
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(0.1)
    except OSError:
        return True
    return False


@pytest.mark.parametrize("slow_part", ["body", "headers", "redirect's body"])
def test_a_url_trickling_its_bytes_stops_at_the_decode_timeout_and_slow_urls_stall_no_other_request(checkpoint3,
                                                                                                    media, slow_part):
    from fastapi.testclient import TestClient

    timeout, arrived, stopped = 2, [], []

    def trickle(handler):  # a byte every 0.1 s: each socket read is quick, the whole body (or header) never comes
        arrived.append(time.monotonic())
        if slow_part == "redirect's body" and not handler.path.endswith("?moved"):
            handler.send_response(302)
            handler.send_header("Location", handler.path + "?moved")  # followed at once, the body left unread
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
        elif slow_part != "headers":
            handler.send_response(200)
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
        else:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        if trickled(handler):
            stopped.append(time.monotonic())

    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "127.0.0.1", "--decode-timeout",
                 timeout, "--max-items", 32, "--max-queue", 64)
    slow: list = []
    with media_server(trickle) as base, TestClient(app) as client:
        start = time.monotonic()
        # More slow URLs than the threads every request shares (at most 32): they wait in the media threads alone.
        thread = threading.Thread(target=lambda: slow.append(client.post("/v1/embeddings", json=chat(
            *[part(f"{base}/{i}.png") for i in range(32)]))))
        thread.start()
        try:
            until(lambda: len(arrived) >= 4, "the URLs fetched")
            assert pooled(client, data_url(media["b.png"])) and not slow  # served while the URLs trickle
        finally:
            thread.join()
        error_of(slow[0], 400, "messages[0].content[", "decode timeout")
        assert time.monotonic() - start < timeout + 3
        until(lambda: len(stopped) == len(arrived), "every fetch stopped")  # no thread left reading
        assert max(stopped) - start < timeout + 3


def test_a_read_its_request_no_longer_waits_for_is_cut_at_once(checkpoint3):
    """Answered without it (its sibling's URL failed), a read under way would hold a media thread (and the process's
    exit) until the decode timeout."""
    from fastapi.testclient import TestClient

    arrived, stopped = threading.Event(), threading.Event()

    def answer(handler):
        if handler.path == "/missing.png":
            arrived.wait(START_S)  # fails once the other read is under way
            handler.send_error(404)
            return
        handler.send_response(200)
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        arrived.set()
        if trickled(handler):
            stopped.set()

    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "127.0.0.1",
                 "--decode-timeout", 60)
    with media_server(answer) as base, TestClient(app) as client:
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/slow.png"), part(f"{base}/missing.png"))),
                 400, "HTTP 404")
        assert stopped.wait(5), "the read went on"


def test_a_connect_its_request_no_longer_waits_for_is_cut_at_once(checkpoint3, monkeypatch):
    """As a read: a host that drops SYNs would hold the media thread in its connect until the decode timeout."""
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve import media as media_module

    listener = socket.create_server(("127.0.0.1", 0), backlog=0)  # one connection fills its queue: later SYNs drop
    filler = socket.create_connection(listener.getsockname())
    resolve, fetch, ended = socket.getaddrinfo, media_module.fetch, []

    def dropped(host, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", listener.getsockname())] if host == "blackhole.test" \
            else resolve(host, *args, **kwargs)

    def timed(url, *args):
        try:
            return fetch(url, *args)
        finally:
            if "blackhole" in url:
                ended.append(time.monotonic())

    def answer(handler):
        time.sleep(1)  # the other fetch is connecting by now
        handler.send_error(404)

    monkeypatch.setattr(socket, "getaddrinfo", dropped)
    monkeypatch.setattr(media_module, "fetch", timed)
    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "blackhole.test", "127.0.0.1",
                 "--decode-timeout", 60)
    with listener, filler, media_server(answer) as base, TestClient(app) as client:
        error_of(client.post("/v1/embeddings", json=chat(part("http://blackhole.test/a.png"),
                                                         part(f"{base}/missing.png"))), 400, "HTTP 404")
        answered = time.monotonic()
        until(lambda: ended, "the connect cut")
        assert ended[0] - answered < 5


def test_a_host_whose_every_address_drops_connections_is_held_to_the_decode_timeout_as_a_whole(checkpoint3,
                                                                                                 monkeypatch):
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve import media as media_module

    listener = socket.create_server(("127.0.0.1", 0), backlog=0)  # one connection fills its queue: later SYNs drop
    filler = socket.create_connection(listener.getsockname())
    resolve = socket.getaddrinfo

    def three_addresses(host, *args, **kwargs):  # as a dual-stack host's, every one unanswered
        if host != "blackhole.test":
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", listener.getsockname())] * 3

    def timed(*args):  # the request is answered at the timeout: the media thread's fetch is what must end then
        try:
            return fetch(*args)
        finally:
            ended.append(time.monotonic())

    fetch, ended = media_module.fetch, []
    monkeypatch.setattr(socket, "getaddrinfo", three_addresses)
    monkeypatch.setattr(media_module, "fetch", timed)
    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "blackhole.test",
                 "--decode-timeout", 1)
    with listener, filler, TestClient(app) as client:
        start = time.monotonic()
        error_of(client.post("/v1/embeddings", json=chat(part("http://blackhole.test/a.png"))), 400,
                 "messages[0].content[1]", "decode timeout")
        until(lambda: ended, "the fetch ended")
        assert ended[0] - start < 2  # each address given the whole timeout held it 3 s


def test_an_address_of_a_family_the_machine_lacks_gives_way_to_the_next(checkpoint3, media, monkeypatch):
    from fastapi.testclient import TestClient

    resolve, make = socket.getaddrinfo, socket.socket

    def v6_then_v4(host, port, *args, **kwargs):  # as a dual-stack host's, its IPv6 address first
        if host != "dual.test":
            return resolve(host, port, *args, **kwargs)
        return resolve("::1", port, *args, **kwargs) + resolve("127.0.0.1", port, *args, **kwargs)

    class NoIPv6(make):  # a kernel booted without IPv6
        def __init__(self, family=socket.AF_INET, *args, **kwargs):
            if family == socket.AF_INET6:
                raise OSError(97, "Address family not supported by protocol")
            super().__init__(family, *args, **kwargs)

    with http_folder(media["a.png"].parent) as base, TestClient(app_of(
            load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "dual.test")) as client:
        monkeypatch.setattr(socket, "getaddrinfo", v6_then_v4)
        monkeypatch.setattr(socket, "socket", NoIPv6)
        assert pooled(client, base.replace("127.0.0.1", "dual.test") + "/a.png") == \
            pooled(client, data_url(media["a.png"]))


def test_a_size_announced_over_the_decode_budget_is_refused_before_its_bytes(served):
    client, _ = served

    def announced(handler):  # a body it never sends: refused on the announcement alone
        handler.send_response(200)
        handler.send_header("Content-Length", str(2 << 20))  # tests/serve/conftest.py: --decode-mib 1
        handler.end_headers()
        handler.wfile.write(b"x" * 10)

    with media_server(announced) as base:
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/a.png"))), 400, "messages[0].content[1]",
                 "2,097,152 bytes", "--decode-mib")


def test_a_url_s_endless_body_is_read_no_further_than_max_bodies_mib(checkpoint3):
    """A URL's bytes are charged to --max-bodies-mib once read: a read goes no further than that bound where the
    decode budget is larger, and the server reads and answers the next request as before."""
    from fastapi.testclient import TestClient

    sent = []

    def endless(handler):  # no Content-Length: only the bytes read can tell
        handler.send_response(200)
        handler.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(64):  # 64 MiB unless the reader stops
                handler.wfile.write(b"x" * (1 << 20))
                sent.append(1)

    options = ["--allowed-media-domains", "127.0.0.1", "--decode-mib", 64, "--max-bodies-mib", 1, "--max-body-mib", 1]
    with media_server(endless) as base, TestClient(app_of(load_encoder(checkpoint3, device="cpu"), *options)) as client:
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/a.png"))), 400, "messages[0].content[1]",
                 "more than 1,048,576 bytes", "--max-bodies-mib")
        assert len(sent) < 16  # the reader stopped at 1 MiB; the rest is what the sockets' buffers took
        assert client.get("/health").status_code == 200


def test_a_redirect_s_body_is_left_unread_and_a_body_cut_short_is_refused(served, media):
    client, _ = served
    image = media["a.png"].read_bytes()

    def answer(handler):
        if handler.path == "/moved.png":  # a redirect whose body trickles: followed at once, its body never read
            handler.send_response(302)
            handler.send_header("Location", "/a.png")
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(300):
                    handler.wfile.write(b"x")
                    handler.wfile.flush()
                    time.sleep(0.1)
            return
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(image)))
        handler.end_headers()
        handler.wfile.write(image if handler.path == "/a.png" else image[:10])  # /cut.png: closed after 10 bytes

    with media_server(answer) as base:
        start = time.monotonic()
        assert pooled(client, f"{base}/moved.png") == pooled(client, data_url(media["a.png"]))
        assert time.monotonic() - start < 5  # the decode timeout is 30 s
        error_of(client.post("/v1/embeddings", json=chat(part(f"{base}/cut.png"))), 400, "messages[0].content[1]",
                 f"ended after 10 of its {len(image):,} bytes")


def test_local_media_is_a_regular_file_named_without_nul(served):
    client, root = served
    fifo = root / "local" / f"fifo-{os.getpid()}.png"
    os.mkfifo(fifo)  # opened for reading, it would wait for a writer for good
    try:
        for url in (f"file://{root / 'local'}", f"file://{fifo}"):
            error_of(client.post("/v1/embeddings", json=chat(part(url))), 400, "messages[0].content[1]",
                     "not a regular file")
    finally:
        fifo.unlink()
    error_of(client.post("/v1/embeddings", json=chat(part(f"file://{root / 'local'}/a%00.png"))), 400,
             "messages[0].content[1]", "NUL")


def test_a_local_name_the_system_refuses_is_the_item_s_error(served):
    client, root = served
    name = "a" * 300 + ".png"  # over the file system's name length
    error_of(client.post("/v1/embeddings", json=chat(part(f"file://{root / 'local'}/{name}"))), 400,
             "messages[0].content[1]", "cannot read")


def test_a_link_loop_is_the_item_s_error_and_out_of_the_folder_tells_nothing_of_what_is_there(served, tmp_path):
    client, root = served
    inside, outside = root / "local" / f"loop-{os.getpid()}.png", tmp_path / "loop.png"
    for loop in (inside, outside):
        loop.symlink_to(loop.name)
    try:
        error_of(client.post("/v1/embeddings", json=chat(part(f"file://{inside}"))), 400, "messages[0].content[1]",
                 "cannot read")
        error_of(client.post("/v1/embeddings", json=chat(part(f"file://{outside}"))), 400, "messages[0].content[1]",
                 "--allowed-local-media-path")
    finally:
        inside.unlink()


def test_allowed_media_domains_match_whatever_their_case(checkpoint3, media):
    from fastapi.testclient import TestClient

    with http_folder(media["a.png"].parent) as base, TestClient(app_of(
            load_encoder(checkpoint3, device="cpu"), "--allowed-media-domains", "LocalHost")) as client:
        assert pooled(client, base.replace("127.0.0.1", "localhost") + "/a.png") == \
            pooled(client, data_url(media["a.png"]))


def test_a_read_still_waiting_for_a_media_thread_at_the_timeout_is_the_server_s_503_not_the_item_s(
        tmp_path, checkpoint3, media, monkeypatch):
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve import app as app_module
    from qwenvl_vision.serve import media as media_module

    (tmp_path / "local").mkdir()
    for name in ("slow.png", "a.png"):
        (tmp_path / "local" / name).write_bytes(media["a.png"].read_bytes())
    monkeypatch.setattr(app_module, "MEDIA_THREADS", 1)
    reading, release, read_local, reads = threading.Event(), threading.Event(), media_module.read_local, []

    def slow_disk(path, label, limit):  # the one media thread held by a file read that takes its time
        reads.append(path.name)
        if path.name == "slow.png":
            reading.set()
            release.wait(START_S)
        return read_local(path, label, limit)

    monkeypatch.setattr(media_module, "read_local", slow_disk)
    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-local-media-path", tmp_path / "local",
                 "--decode-timeout", 1)
    local = f"file://{tmp_path}/local"
    slow: list = []
    with TestClient(app) as client:
        thread = threading.Thread(target=lambda: slow.append(client.post("/v1/embeddings", json=chat(
            part(f"{local}/slow.png")))))
        thread.start()
        try:
            assert reading.wait(START_S)
            response = client.post("/v1/embeddings", json=chat(part(f"{local}/a.png")))
            error_of(response, 503, "messages[0].content[1]", "media thread")
            assert int(response.headers["retry-after"]) >= 1
        finally:
            release.set()
            thread.join()
        assert slow[0].status_code == 200  # a read under way is the item's own: a file's ends with the file
        assert reads == ["slow.png"]  # the refused request's read was dropped, never run after its answer
        assert pooled(client, f"{local}/a.png") == pooled(client, data_url(media["a.png"]))


def test_time_an_item_waited_for_a_media_thread_is_not_counted_against_its_read(tmp_path, checkpoint3, media,
                                                                                 monkeypatch):
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve import app as app_module
    from qwenvl_vision.serve import media as media_module

    timeout = 3
    (tmp_path / "local").mkdir()
    for name in ("held.png", "a.png"):
        (tmp_path / "local" / name).write_bytes(media["a.png"].read_bytes())
    monkeypatch.setattr(app_module, "MEDIA_THREADS", 1)
    reading, release, read_local = threading.Event(), threading.Event(), media_module.read_local

    def slow_disk(path, label, limit):
        if path.name == "held.png":  # the one media thread held until the test lets it go
            reading.set()
            release.wait(START_S)
        else:  # its own read within the timeout; with the time it waited for the thread, past it
            time.sleep(timeout * 5 / 6)
        return read_local(path, label, limit)

    monkeypatch.setattr(media_module, "read_local", slow_disk)
    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-local-media-path", tmp_path / "local",
                 "--decode-timeout", timeout)
    answers: dict = {}
    with TestClient(app) as client:
        threads = [threading.Thread(target=lambda name=name: answers.setdefault(name, client.post(
            "/v1/embeddings", json=chat(part(f"file://{tmp_path}/local/{name}"))))) for name in ("held.png", "a.png")]
        threads[0].start()
        try:
            assert reading.wait(START_S)
            threads[1].start()
            until(lambda: "qwenvl_vision_queue_items 2.0" in client.get("/metrics").text, "the second item queued")
            time.sleep(timeout / 3)  # waiting for the one media thread
        finally:
            release.set()
            for thread in threads:
                thread.join()
    assert [answers[name].status_code for name in ("held.png", "a.png")] == [200, 200], answers["a.png"].text


def test_a_request_s_own_reads_never_keep_its_items_waiting_into_a_503(tmp_path, checkpoint3, media, monkeypatch):
    """More items than media threads, each read taking most of the decode timeout: its last items wait behind its
    own first ones past the timeout, which a 503 would ask it to retry into the same wait."""
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve import app as app_module
    from qwenvl_vision.serve import media as media_module

    timeout = 2
    (tmp_path / "local").mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (tmp_path / "local" / name).write_bytes(media["a.png"].read_bytes())
    monkeypatch.setattr(app_module, "MEDIA_THREADS", 1)
    read_local = media_module.read_local

    def slow_disk(path, label, limit):
        time.sleep(timeout * 0.55)
        return read_local(path, label, limit)

    monkeypatch.setattr(media_module, "read_local", slow_disk)
    app = app_of(load_encoder(checkpoint3, device="cpu"), "--allowed-local-media-path", tmp_path / "local",
                 "--decode-timeout", timeout)
    with TestClient(app) as client:
        response = client.post("/v1/embeddings", json=chat(
            *[part(f"file://{tmp_path}/local/{name}") for name in ("a.png", "b.png", "c.png")]))
    assert response.status_code == 200, response.text
