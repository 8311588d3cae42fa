"""bench/ray_overhead.py runs end to end at a tiny size (in a child: it starts and stops its own local Ray): both
engines embed every image and it reports both times and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ENV, REPO

pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_overhead_smoke(tmp_path):
    numbers = tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, "-m", "bench.ray_overhead", "--images", "3", "--workdir", str(tmp_path),
                           "--json", str(numbers)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(numbers.read_text())
    assert result["local_s"] > 0 and result["ray_s"] > 0
    assert result["ratio"] == pytest.approx(result["ray_s"] / result["local_s"])
    assert result["embedding_mib"] > 0 and result["tower_load_s"] > 0
    assert "embed (local)" in done.stdout and "embed --engine ray" in done.stdout and "ratio ray / local" in done.stdout
    assert len(list((tmp_path / "out-ray").glob("shard-*.parquet"))) >= 1
