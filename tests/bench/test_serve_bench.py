"""bench/serve.py end to end at a tiny size (in a child, as it is run): the server started as users start it answers
every request, stops cleanly, and its resident sets are read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ENV, REPO

pytest.importorskip("fastapi")


def test_serve_bench_smoke(tmp_path):
    numbers = tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, "-m", "bench.serve", "--requests", "6", "--clients", "2", "--images", "3",
                           "--rounds", "1", "--threads", "1", "--max-pixels", str(64 * 64), "--json", str(numbers)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(numbers.read_text())["serve"]
    assert served["failed"] == 0 and served["exit_status"] == 0, served["failures"]
    # after the first 100 requests: here all 6; the peak since the server was ready
    assert served["rss_after_100"] > 0 and served["rss_end"] > 0 and served["rss_peak"] > 0


def test_a_serve_bench_stopped_mid_run_leaves_no_server_and_no_files(tmp_path):
    """SIGTERM, as a job scheduler stops it: its server (a GiB of resident weights, a port) went on, orphaned, and
    its collection and the server's items stayed in the temporary folder."""
    bench = subprocess.Popen([sys.executable, "-m", "bench.serve", "--requests", "100000", "--clients", "1",
                              "--images", "1", "--rounds", "1", "--threads", "1", "--max-pixels", str(64 * 64)],
                             cwd=REPO, env={**ENV, "TMPDIR": str(tmp_path)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    server = None
    try:
        deadline = time.monotonic() + 600
        while not any(tmp_path.glob("*/ec/*/*.safetensors")):  # the server answers requests
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()[-3000:]
            time.sleep(0.2)
        (server,) = map(int, Path(f"/proc/{bench.pid}/task/{bench.pid}/children").read_text().split())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        assert not Path(f"/proc/{server}").exists() and list(tmp_path.iterdir()) == []
    finally:
        bench.kill()
        bench.wait()
        if server is not None and Path(f"/proc/{server}").exists():  # left running: not by this test
            os.kill(server, signal.SIGKILL)
