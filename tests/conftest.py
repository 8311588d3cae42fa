"""Fixtures several test modules share: checkpoints written once per session in the released layout, and the
stand-in Hub."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The CPU plans the suite measures go to a folder of its own (not the user's cache), shared by the session's
# processes: set before tests.helpers is imported, whose ENV copies the environment for the subprocesses (a child on
# the user's cache ran that cache's plan, not the session's, and gave other bits than the test process).
PLAN_CACHE = tempfile.mkdtemp(prefix="qwenvl-vision-test-cache-")
os.environ["QWENVL_VISION_CACHE"] = PLAN_CACHE

from tests.helpers import QWEN2_5_SMALL, QWEN3_SMALL_72, serve_hub, write_checkpoint  # noqa: E402


def pytest_unconfigure(config):
    """Also when no test ran (all deselected or skipped), where a session fixture's teardown never comes."""
    shutil.rmtree(PLAN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A sharded Qwen2.5-VL checkpoint with spread weights."""
    folder = tmp_path_factory.mktemp("ckpt25")
    write_checkpoint(folder, QWEN2_5_SMALL)
    return folder


@pytest.fixture(scope="session")
def checkpoint3(tmp_path_factory) -> Path:
    """A sharded Qwen3-VL checkpoint (DeepStack) with spread weights."""
    folder = tmp_path_factory.mktemp("ckpt3")
    write_checkpoint(folder, QWEN3_SMALL_72)
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running stand-in Hub (tests.helpers.serve_hub) for one test, with an empty cache under tmp_path."""
    with serve_hub(tmp_path, monkeypatch) as fake:
        yield fake
