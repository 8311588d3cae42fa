"""bench/serve.py end to end at a tiny size (in a child, as it is run): the server started as users start it answers
every request, and the batch loop's and the server's images/s, latencies and resident sets are reported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.embed import ENV

pytest.importorskip("fastapi")


def test_serve_bench_smoke(tmp_path):
    numbers = tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, "-m", "bench.serve", "--requests", "6", "--clients", "2", "--images", "3",
                           "--rounds", "1", "--threads", "1", "--max-pixels", str(64 * 64), "--json", str(numbers)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(numbers.read_text())
    served = result["serve"]
    assert served["failed"] == 0 and served["exit_status"] == 0
    assert result["batch_images_per_s"] > 0 and served["images_per_s"] > 0
    assert result["serve_vs_batch"] == pytest.approx(served["images_per_s"] / result["batch_images_per_s"])
    assert 0 < served["p50_s"] <= served["p99_s"]
    assert served["rss_after_100"] > 0 and served["rss_end"] > 0  # after the first 100 requests: here all 6
    assert "serve / batch" in done.stdout and "server RSS" in done.stdout
