"""Memory readings for tests: the census of live tensor storages that the teardown benchmark makes
(``qwenvl_vision.teardown.census``), under the short name the tests use."""

from __future__ import annotations

from qwenvl_vision.teardown.census import live_tensor_bytes, rss_bytes

__all__ = ["census", "live_tensor_bytes", "rss_bytes"]


def census() -> int:
    """Bytes of live tensor storages reachable from Python, each storage counted once (meta: none)."""
    return live_tensor_bytes()
