"""``qwenvl-vision serve`` under concurrent clients against the batch job's encode loop: same machine, inputs and
settings, one run.

    python -m bench.serve                                  # 8 clients, 500 requests, qwen3.5-0.8b random weights
    python -m bench.serve --requests 1000 --route embeddings --json serve.json

The server starts as users start it (``qwenvl-vision serve --model PRESET --random-weights ...``, a child process,
uvicorn on a free loopback port) and is ready when ``/health`` answers. ``--clients`` threads, each on one kept-alive
connection, send ``--requests`` requests of one image each, going round the collection (bench.tar_inputs' JPEG
photos of several sizes, as data URLs): to ``/v1/chat/completions`` as vLLM's EPD proxy sends an encoder instance
(``max_tokens`` 1, an ``x-request-id``, a fresh ``uuid``, so that every request is encoded and written), or to
``/v1/embeddings``. The batch side is ``embed``'s encode loop (bench.tar_inputs.encode) over the same files with the
same preset, dtype, pixel bound and threads, in this process before the server starts (median of ``--rounds``).
Printed: images/s of both and their ratio, p50/p99 request latency, failed requests, and the server's resident set
after the first 100 requests and at the end (and its high-water mark). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.tar_inputs import encode, write_collection
from qwenvl_vision import load_encoder

START_S = 600  # loading a real-size tower from random weights takes a while on a slow machine


def resident(pid: int, field: str = "VmRSS") -> int | None:
    """The process's resident set (or another /proc status field) in bytes; psutil where /proc is absent."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process(pid).memory_info().rss if field == "VmRSS" else None


def start_server(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "qwenvl_vision.cli", "serve", "--model", args.preset, "--random-weights",
           "--dtype", args.dtype, "--max-pixels", str(args.max_pixels), "--threads", str(args.threads),
           "--ec-shared-storage", str(tmp / "ec"), "--port", str(port)]
    with open(tmp / "serve.log", "wb") as log:  # uvicorn's access log: a line per request
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_S
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server, port
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"serve did not answer /health (exit status {server.wait()}): {' '.join(cmd)}\n"
                     f"{(tmp / 'serve.log').read_text(errors='replace')[-3000:]}")


def request_body(route: str, url: str, model: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if route == "chat":
        return {"model": model, "max_tokens": 1, "stream": False,
                "messages": [{"role": "user", "content": [{**part, "uuid": uuid.uuid4().hex}]}]}
    return {"model": model, "messages": [{"role": "user", "content": [part]}]}


def load_test(args: argparse.Namespace, port: int, pid: int, urls: list[str]) -> dict:
    """Every request once, ``args.clients`` at a time: wall time, latencies, failures, resident sets."""
    path = "/v1/chat/completions" if args.route == "chat" else "/v1/embeddings"
    lock, done, latencies, failures, rss = threading.Lock(), [0], [], [], {}
    local = threading.local()

    def one(i: int) -> None:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=START_S)
        body = json.dumps(request_body(args.route, urls[i % len(urls)], args.preset))
        start = time.perf_counter()
        local.connection.request("POST", path, body, {"Content-Type": "application/json",
                                                      "x-request-id": f"bench-{i}"})
        response = local.connection.getresponse()
        answer = response.read()
        seconds = time.perf_counter() - start
        with lock:
            latencies.append(seconds)
            if response.status != 200:
                failures.append(f"{response.status} {answer[:200]!r}")
            done[0] += 1
            if done[0] == min(100, args.requests):
                rss["after_100"] = resident(pid)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(args.requests)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {"wall_s": wall, "images_per_s": args.requests / wall, "failed": len(failures), "failures": failures[:5],
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1,
                                                                          int(0.99 * len(latencies)))],
            "rss_after_100": rss.get("after_100"), "rss_end": resident(pid), "rss_peak": resident(pid, "VmHWM")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--route", choices=("chat", "embeddings"), default="chat")
    parser.add_argument("--images", type=int, default=48, help="photos in the collection the requests go round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of the batch loop")
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--max-pixels", type=int, default=224 * 224)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of both sides")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder, _ = write_collection(Path(tmp), args.images)
        with load_encoder(args.preset, device="cpu", random_weights=True, dtype=args.dtype) as enc:
            encode(enc, folder, args.max_pixels)  # warm-up: the CPU plan, the shape cache, the page cache
            batch = [encode(enc, folder, args.max_pixels)[0] for _ in range(args.rounds)]
        urls = [f"data:image/jpeg;base64,{base64.b64encode(p.read_bytes()).decode()}"
                for p in sorted(folder.glob("*.jpg"))]
        server, port = start_server(args, Path(tmp))
        try:
            served = load_test(args, port, server.pid, urls)
        finally:
            server.terminate()
            status = server.wait(START_S)
        served["exit_status"] = status  # 0: it finished what it had and closed on SIGTERM
    batch_rate = args.images / statistics.median(batch)
    result = {"preset": args.preset, "dtype": args.dtype, "max_pixels": args.max_pixels, "threads": args.threads,
              "clients": args.clients, "requests": args.requests, "route": args.route, "cpus": os.cpu_count(),
              "batch_times_s": batch, "batch_images_per_s": batch_rate, "serve": served,
              "serve_vs_batch": served["images_per_s"] / batch_rate}
    mib = [f"{v / 2**20:.0f} MiB" if v is not None else "unknown" for v in
           (served["rss_after_100"], served["rss_end"], served["rss_peak"])]
    print(f"{args.preset} (random weights), {args.dtype}, max_pixels {args.max_pixels}, {args.threads} threads; "
          f"{args.requests} requests to /v1/{'chat/completions' if args.route == 'chat' else 'embeddings'} from "
          f"{args.clients} clients, {args.images} photos")
    print(f"  batch job's encode loop {batch_rate:8.1f} img/s  (median of {args.rounds})")
    print(f"  serve                   {served['images_per_s']:8.1f} img/s  p50 {served['p50_s'] * 1e3:.0f} ms  "
          f"p99 {served['p99_s'] * 1e3:.0f} ms  failed {served['failed']}")
    print(f"  serve / batch           {result['serve_vs_batch']:8.3f}")
    print(f"  server RSS: after {min(100, args.requests)} requests {mib[0]}, at the end {mib[1]}, peak {mib[2]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
