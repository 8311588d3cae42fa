"""Memory under a long churn: one encoder fed thousands of distinct grids stays flat once its shape cache is full."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

CHURN = """
import json, os, random
import torch
import qwenvl_vision as qv
from qwenvl_vision.testing.workloads import QWEN3_SMALL_72 as cfg

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

sides = range(2, 122, 2)
grids = sorted({(t, h, w) for t in range(1, 6) for h in sides for w in sides if t * h * w <= 1600})
random.Random(0).shuffle(grids)
grids = grids[:CALLS]
encoder = qv.load_encoder(cfg, random_weights=True, device="cpu", dtype="float32", cache_size=CACHE)
generator = torch.Generator().manual_seed(0)
seen = {}
for i, grid in enumerate(grids, 1):
    pixels = torch.randn(grid[0] * grid[1] * grid[2], cfg.patch_dim, generator=generator)
    encoder.encode_patches(pixels, [grid], pixels_sha256=["0" * 64])
    if i in (len(grids) // 2, len(grids)):
        seen[i] = (rss_mib(), encoder.model.cache_stats()["entries"])
print(json.dumps(list(seen.values())))
"""
CALLS, CACHE = 2000, 512
TOLERANCE = 0.04  # of RSS, between the churn's half and its end (before: +8% from call 1,500 to 3,000)


@pytest.mark.slow
def test_rss_is_flat_under_a_churn_of_distinct_grids_once_the_cache_is_full():
    """2,000 distinct grids (about 760 tokens each) through a tiny Qwen3-VL tower in fp32 on the CPU, its shape cache
    bounded at 512 entries: RSS at the 1,000th and the 2,000th call agree within TOLERANCE. Two torch threads, as a
    server's intra-op pool runs (the oneDNN kernels and their per-shape caches are the threaded path's)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RSS is read from /proc (Linux)")
    script = CHURN.replace("CALLS", str(CALLS)).replace("CACHE", str(CACHE))
    # PASSIVE: on a shared machine spinning OpenMP threads would make the churn many times slower, not different.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    (half, half_entries), (end, end_entries) = json.loads(done.stdout.splitlines()[-1])
    assert half_entries == end_entries == CACHE  # full at both points
    assert end <= half * (1 + TOLERANCE), f"RSS grew from {half:.0f} MiB to {end:.0f} MiB"
