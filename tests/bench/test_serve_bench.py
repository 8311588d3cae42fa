"""bench/serve.py end to end at a tiny size (in a child, as it is run): the server started as users start it answers
every request, stops cleanly, and its resident sets are read."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

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
    log = tmp_path / "bench.log"
    with open(log, "wb") as out:  # its own group, the server's too: whatever happens here, none is left running
        bench = subprocess.Popen([sys.executable, "-m", "bench.serve", "--requests", "100000", "--clients", "1",
                                  "--images", "1", "--rounds", "1", "--threads", "1", "--max-pixels", str(64 * 64)],
                                 cwd=REPO, env={**ENV, "TMPDIR": str(tmp_path / "tmp")}, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    (tmp_path / "tmp").mkdir()
    try:
        deadline = time.monotonic() + 600
        while not any(tmp_path.glob("tmp/*/ec/*/*.safetensors")):  # the server answers requests
            assert bench.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        bench.send_signal(signal.SIGTERM)  # the bench alone, as a scheduler's stop or `kill PID`
        assert bench.wait(120) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # the server stopped and reaped with it
            os.killpg(bench.pid, 0)
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
