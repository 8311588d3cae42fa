"""A bounded, thread-safe LRU owned by one module instance.

Why not ``functools.lru_cache``: on a method it keys on ``self`` and lives on the class, so every model that ever
ran stays reachable until the process ends (this retained 1.35 GB of GPU memory after shutting down Qwen2.5-VL-3B in
a serving engine). This cache is an ordinary attribute: it dies with its owner, holds at most ``maxsize`` entries and
``max_bytes`` of tensors, and can be cleared.

Concurrency: the first thread to miss a key computes it outside the lock while the others wait on its Future, so
each value is computed once and every caller receives the identical object. A failed computation is not cached.

Memory: every ``TRIM_EVERY_BYTES`` of evicted entries (and on ``clear``) the heap's free pages are handed back to the
OS. An entry is a few mid-sized host tensors allocated amid a forward's temporaries; once evicted, glibc keeps their
pages resident, so a churn of distinct grids grew the process by ~0.1 MB a call long after the cache was full.
"""

from __future__ import annotations

import contextlib
import ctypes
import numbers
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import ConfigError


def return_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim``; nothing elsewhere): freed holes
    otherwise stay resident, after a cache's evictions as after packing a tower's weights one by one."""
    with contextlib.suppress(OSError, AttributeError):  # no glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


TRIM_EVERY_BYTES = 64 << 20  # a trim costs milliseconds: one per this many evicted bytes is noise to the forwards


def tensor_bytes(value: Any) -> int:
    """Bytes held by the tensors inside value (tensors, and tuples/lists/objects of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # not .nbytes: a compiled tower traces this with symbolic sizes
    if isinstance(value, (tuple, list)):
        return sum(map(tensor_bytes, value))
    return sum(map(tensor_bytes, vars(value).values())) if hasattr(value, "__dict__") else 0


def check_cache_bounds(cache_size: int, cache_bytes: int | None) -> None:
    """Refuse bounds that bound nothing (a ConfigError naming the option): whole numbers >= 0 (cache_bytes None: no
    bound in bytes)."""
    for name, value in (("cache_size", cache_size), ("cache_bytes", 0 if cache_bytes is None else cache_bytes)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")


class ShapeCache:
    """LRU from a hashable key (a grid ``(t, h, w)``) to derived tensors, bounded by count and bytes."""

    def __init__(self, maxsize: int = 1024, max_bytes: int | None = 1 << 30) -> None:
        check_cache_bounds(maxsize, max_bytes)
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._pending: dict[Hashable, Future] = {}
        self._bytes = 0
        self._evicted = 0  # bytes evicted since the heap was last trimmed
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> ShapeCache:
        return ShapeCache(self.maxsize, self.max_bytes)  # a copied tower's cache is its own, and starts empty

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry[0]
            future = self._pending.get(key)
            owner = future is None
            if owner:
                future = self._pending[key] = Future()
        if not owner:
            return future.result()
        try:
            value = compute()
        except BaseException as error:
            with self._lock:
                del self._pending[key]
            future.set_exception(error)
            future = None  # it holds the error, whose traceback holds this frame: the two would wait for gc
            raise
        with self._lock:
            del self._pending[key]
            trim = self._store(key, value)
        future.set_result(value)
        if trim:
            return_freed_memory()
        return value

    def _store(self, key: Hashable, value: Any) -> bool:
        """Keep ``value`` under ``key``, evicting the least recently used; whether the heap is due a trim."""
        size = tensor_bytes(value)
        if self.maxsize == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return False  # too big to keep: the caller still gets it, nobody retains it
        self._entries[key] = (value, size)
        self._bytes += size
        while len(self._entries) > self.maxsize or (self.max_bytes is not None and self._bytes > self.max_bytes):
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted
            self._evicted += evicted
        if self._evicted < TRIM_EVERY_BYTES:
            return False
        self._evicted = 0
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = self._evicted = 0
        return_freed_memory()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
