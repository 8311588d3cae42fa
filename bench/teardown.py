"""Teardown benchmark (issue 5), and the class-level-cache variant it measures against.

Run (same options either way; see ``qwenvl_vision/bench_cli.py`` for what is measured):

    qwenvl-vision bench teardown --preset qwen2.5-vl-3b --random-weights --cycles 20 --json teardown.json
    python bench/teardown.py --preset qwen3-vl-2b --cycles 5 --device cpu --plot teardown.png

This file is deliberately the only place in the repository where a tower method is memoised with
``functools.lru_cache``: that is the bug being measured (ruff B019; it kept 1.35 GB of GPU memory after
shutting Qwen2.5-VL-3B down in a serving engine). The package itself must contain no functools cache, so
``qwenvl_vision.bench_cli`` loads this file by path when the benchmark asks for the variant.

The variant is "the same model": after ``load_encoder`` the tower instance's class is swapped for a subclass
whose ``grid_plan`` goes through a class-level ``lru_cache`` keyed on ``(self, grid)`` (instead of the
instance's own ``shape_cache``). The cache lives on the class, so it keeps every instance that ever ran -
its weights, and its per-grid plans - reachable until ``cache_clear()`` or the end of the process.
"""

from __future__ import annotations

import functools
import sys

from qwenvl_vision import Qwen2_5VisionTransformer, Qwen3VisionTransformer

MAXSIZE = 1024  # what the serving engines used; far more than the benchmark's instances x grids


class _ClassLevelGridPlan:
    """Mixin: grid plans memoised on the class, keyed on (self, grid)."""

    @functools.lru_cache(maxsize=MAXSIZE)  # noqa: B019 - deliberately the bug under measurement
    def grid_plan(self, grid):
        return self._compute_grid_plan(grid)


class ClassCachedQwen2_5VisionTransformer(_ClassLevelGridPlan, Qwen2_5VisionTransformer):
    pass


class ClassCachedQwen3VisionTransformer(_ClassLevelGridPlan, Qwen3VisionTransformer):
    pass


_SWAP = {
    Qwen2_5VisionTransformer: ClassCachedQwen2_5VisionTransformer,
    Qwen3VisionTransformer: ClassCachedQwen3VisionTransformer,
}


def adopt(encoder):
    """Give a loaded encoder's tower the class-level cache (in place); returns the encoder."""
    model = encoder.model
    cls = type(model)
    if cls not in _SWAP:
        raise TypeError(f"no class-level-cache variant for {cls.__name__}")
    model.__class__ = _SWAP[cls]
    return encoder


def cache_entries() -> int:
    """Entries (instance, grid) held by the class-level cache right now."""
    return _ClassLevelGridPlan.grid_plan.cache_info().currsize


def cache_clear() -> None:
    """The only thing that lets the retained instances go."""
    _ClassLevelGridPlan.grid_plan.cache_clear()


def main(argv: list[str] | None = None) -> int:
    from qwenvl_vision.bench_cli import teardown_main

    return teardown_main(argv, class_level=sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
