"""``qwenvl-vision serve`` under concurrent clients against the batch job's encode loop: same machine, inputs and
settings, one run.

    python -m bench.serve                                  # 8 clients, 500 requests, qwen3.5-0.8b random weights
    python -m bench.serve --requests 1000 --route embeddings --json serve.json

The server starts as users start it (``qwenvl-vision serve --model PRESET --random-weights ...``, a child process,
uvicorn on a free loopback port) and is ready when ``/health`` answers. ``--clients`` threads, each on one kept-alive
connection, send ``--requests`` requests of one image each, going round the collection (bench.tar_inputs' JPEG
photos of several sizes, as data URLs): to ``/v1/chat/completions`` as vLLM's EPD proxy sends an encoder instance
(an ``x-request-id``, a fresh ``uuid``, so that every request is encoded and written), or to ``/v1/embeddings``;
one untimed round over the collection first, as the batch side is warmed up. The batch side is ``embed``'s encode
loop (bench.tar_inputs.encode) over the same files with the same preset, device, dtype, pixel bound and threads, in
this process before the server starts (median of ``--rounds``). Printed: images/s of both (the server's: requests
answered 200) and their ratio, p50/p99 latency of the answered requests, failed requests (an error status or a
broken connection), and the server's resident set after the first 100 timed requests, at the end, and its peak
since it was ready. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import signal
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
from qwenvl_vision.embed.args import positive_option

START_S = 600  # loading a real-size tower from random weights takes a while on a slow machine
ROUTES = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


def resident(pid: int, field: str = "VmRSS") -> int:
    """The process's resident set (or its peak, ``VmHWM``) in bytes, from Linux's /proc."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def start_server(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "qwenvl_vision.cli", "serve", "--model", args.preset, "--random-weights",
           "--device", args.device, "--dtype", args.dtype, "--max-pixels", str(args.max_pixels),
           "--threads", str(args.threads), "--ec-shared-storage", str(tmp / "ec"), "--port", str(port)]
    with open(tmp / "serve.log", "wb") as log:  # uvicorn's start-up lines and any error, shown if it fails to start
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_S
    try:
        while server.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            except OSError:
                time.sleep(0.2)
                continue
            with open(f"/proc/{server.pid}/clear_refs", "w") as f:  # "5" resets the peak (VmHWM): not loading's
                f.write("5")
            return server, port
    except BaseException:  # stopped while it starts (Ctrl-C, SIGTERM): the server is not left running
        server.kill()
        server.wait()
        raise
    server.kill()
    raise SystemExit(f"serve did not answer /health (exit status {server.wait()}): {' '.join(cmd)}\n"
                     f"{(tmp / 'serve.log').read_text(errors='replace')[-3000:]}")


def request_body(route: str, url: str, model: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if route == "chat":
        return {"model": model, "stream": False,
                "messages": [{"role": "user", "content": [{**part, "uuid": uuid.uuid4().hex}]}]}
    return {"model": model, "messages": [{"role": "user", "content": [part]}]}


def load_test(args: argparse.Namespace, port: int, pid: int, urls: list[str], requests: int) -> dict:
    """``requests`` requests, ``args.clients`` at a time: wall time, latencies, failures, resident sets."""
    lock, done, latencies, failures, rss = threading.Lock(), [0], [], [], {}
    local = threading.local()

    def one(i: int) -> None:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=START_S)
        body = json.dumps(request_body(args.route, urls[i % len(urls)], args.preset))
        start = time.perf_counter()
        try:
            local.connection.request("POST", ROUTES[args.route], body, {"Content-Type": "application/json",
                                                          "x-request-id": f"bench-{i}"})
            response = local.connection.getresponse()
            answer = response.read()
            failure = None if response.status == 200 else f"{response.status} {answer[:200]!r}"
        except (OSError, http.client.HTTPException) as e:  # a broken connection is a failed request; reconnect
            local.connection.close()
            del local.connection
            failure = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        with lock:
            if failure is None:
                latencies.append(seconds)
            else:
                failures.append(failure)
            done[0] += 1
            if done[0] == min(100, requests):
                rss["after_100"] = resident(pid)

    start = time.perf_counter()
    pool = ThreadPoolExecutor(args.clients)
    try:
        list(pool.map(one, range(requests)))
    finally:  # stopped (SIGTERM, Ctrl-C): the requests not sent yet are dropped, not sent before the server stops
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [math.nan] * 99
    return {"wall_s": wall, "images_per_s": len(latencies) / wall, "failed": len(failures), "failures": failures[:5],
            "p50_s": q[49], "p99_s": q[98], "rss_after_100": rss.get("after_100"), "rss_end": resident(pid),
            "rss_peak": resident(pid, "VmHWM")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=positive_option(int, "--clients"), default=8)
    parser.add_argument("--requests", type=positive_option(int, "--requests"), default=500)
    parser.add_argument("--route", choices=("chat", "embeddings"), default="chat")
    parser.add_argument("--images", type=positive_option(int, "--images"), default=48,
                        help="photos in the collection the requests go round")
    parser.add_argument("--rounds", type=positive_option(int, "--rounds"), default=3,
                        help="timed rounds of the batch loop")
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--device", default="cpu", help="of both sides")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--max-pixels", type=int, default=224 * 224)
    parser.add_argument("--threads", type=positive_option(int, "--threads"), default=torch.get_num_threads(),
                        help="torch threads of both sides")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder, _ = write_collection(Path(tmp), args.images)
        with load_encoder(args.preset, device=args.device, random_weights=True, dtype=args.dtype) as enc:
            encode(enc, folder, args.max_pixels)  # warm-up: the CPU plan, the shape cache, the page cache
            batch = [encode(enc, folder, args.max_pixels)[0] for _ in range(args.rounds)]
        urls = [f"data:image/jpeg;base64,{base64.b64encode(p.read_bytes()).decode()}"
                for p in sorted(folder.glob("*.jpg"))]
        server, port = start_server(args, Path(tmp))
        try:
            load_test(args, port, server.pid, urls, len(urls))  # warm-up, as the batch side's
            served = load_test(args, port, server.pid, urls, args.requests)
        finally:
            server.terminate()
            status = server.wait(START_S)
        served["exit_status"] = status  # 0: it finished what it had and closed on SIGTERM
    batch_rate = args.images / statistics.median(batch)
    result = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "max_pixels": args.max_pixels,
              "threads": args.threads, "clients": args.clients, "requests": args.requests, "route": args.route,
              "cpus": os.cpu_count(), "batch_times_s": batch, "batch_images_per_s": batch_rate, "serve": served,
              "serve_vs_batch": served["images_per_s"] / batch_rate}
    mib = [f"{served[k] / 2**20:.0f} MiB" for k in ("rss_after_100", "rss_end", "rss_peak")]
    route = ROUTES[args.route]
    print(f"{args.preset} (random weights), {args.device}, {args.dtype}, max_pixels {args.max_pixels}, "
          f"{args.threads} threads; {args.requests} requests to {route} from {args.clients} clients, "
          f"{args.images} photos")
    print(f"  batch job's encode loop {batch_rate:8.1f} img/s  (median of {args.rounds})")
    print(f"  serve                   {served['images_per_s']:8.1f} img/s  p50 {served['p50_s'] * 1e3:.0f} ms  "
          f"p99 {served['p99_s'] * 1e3:.0f} ms  failed {served['failed']}")
    print(f"  serve / batch           {result['serve_vs_batch']:8.3f}  ({route})")
    print(f"  server RSS: after {min(100, args.requests)} requests {mib[0]}, at the end {mib[1]}, peak since ready "
          f"{mib[2]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the server and files go, as on Ctrl-C
    main()
