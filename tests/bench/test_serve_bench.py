"""bench/serve.py end to end at a tiny size (in a child, as it is run): the server started as users start it answers
every request, stops cleanly, and its resident sets are read."""

from __future__ import annotations

import json
import subprocess
import sys

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
