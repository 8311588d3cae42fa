"""Teardown benchmark with its comparisons: our per-instance caches against a class-level ``functools.lru_cache``
(the bug this package exists to avoid) and against transformers' tower.

    python -m bench.teardown --preset qwen2.5-vl-3b --cycles 20 --json bench/results/teardown.json --plot t.png
    qwenvl-vision bench teardown --preset qwen3-vl-2b   # the package's own part: per-instance only

What is measured, and how, is ``qwenvl_vision.teardown.study`` (the same options). This file adds:

- ``class-level-cache``: the same model, with ``grid_plan`` memoised by a class-level ``lru_cache`` keyed on
  ``(self, grid)`` as serving engines had it (ruff B019; it kept 1.35 GB of GPU memory after shutting
  Qwen2.5-VL-3B down). The cache lives on the class, so it keeps every instance that ever ran - its weights and
  its per-grid plans - reachable until ``cache_clear()``. The package must contain no functools cache (a test
  scans it), so the variant lives only here.
- ``transformers``: transformers' tower of the same config, random init, ``del`` only.
- ``--plot``: memory at every phase of every cycle, one panel per variant.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from typing import Any

from qwenvl_vision.errors import QwenVLVisionError
from qwenvl_vision.teardown.cycles import PER_INSTANCE, Options, Variant, load_plain
from qwenvl_vision.teardown.study import add_teardown_arguments, check_writable, cmd_teardown

CLASS_LEVEL = "class-level-cache"
TRANSFORMERS = "transformers"
MAXSIZE = 1024  # what the serving engines used; far more than the benchmark's instances x grids


class ClassLevelGridPlan:
    """Mixin: grid plans memoised on the class, keyed on (self, grid)."""

    @functools.lru_cache(maxsize=MAXSIZE)  # noqa: B019 - deliberately the bug under measurement
    def grid_plan(self, grid):
        return self.compute_grid_plan(grid)


_SWAPPED: dict[type, type] = {}


def adopt(encoder):
    """Give a loaded encoder's tower the class-level cache (in place); returns the encoder."""
    model = encoder.model
    cls = type(model)
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"ClassCached{cls.__name__}", (ClassLevelGridPlan, cls), {})
    model.__class__ = _SWAPPED[cls]
    return encoder


def cache_entries() -> int:
    """Entries (instance, grid) held by the class-level cache right now."""
    return ClassLevelGridPlan.grid_plan.cache_info().currsize


def cache_clear() -> None:
    """The only thing that lets the retained instances go."""
    ClassLevelGridPlan.grid_plan.cache_clear()


def class_level_variant(opts: Options) -> Variant:
    return Variant(CLASS_LEVEL, lambda: adopt(load_plain(opts)), ("del", "close"), expect_free=False,
                   note="grid_plan memoised by a class-level functools.lru_cache keyed on (self, grid)",
                   cache_clear=cache_clear)


def transformers_variant(opts: Options) -> Variant | str:
    """transformers' tower, imported only when its run starts (after ours, outside any measured cycle): importing
    it imports torch._dynamo, which would hide first-use effects from the other variants."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"

    def prepare() -> None:
        import transformers

        from qwenvl_vision.testing.reference import hf_classes

        hf_classes(opts.config)  # the import happens here, not inside the first measured cycle
        variant.note = f"transformers {transformers.__version__} tower, random init, del only"

    def load() -> Any:
        from qwenvl_vision.testing.reference import hf_tower

        return hf_tower(opts.config, device=opts.device, dtype=opts.dtype, seed=None)

    variant = Variant(TRANSFORMERS, load, ("del",), expect_free=False, note="transformers tower, random init",
                      prepare=prepare)
    return variant


PHASES = ("before_load", "after_load", "after_encode", "after_close", "after_teardown", "after_gc")


def plot_report(report: dict[str, Any], path: str) -> None:
    """Memory above the baseline at each phase of each cycle: one panel per variant, del and close side by side
    (a del cycle has no close point, so its close slot stays empty instead of being bridged by a line). The two are
    drawn a few points apart: where their values are equal (0 after every teardown) neither hides the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import offset_copy

    cuda = report["device"].startswith("cuda")
    key = "cuda_allocated" if cuda else "tensor_bytes"
    variants = list(dict.fromkeys(run["variant"] for run in report["runs"]))
    cycles = max((len(run["cycles"]) for run in report["runs"]), default=1)
    fig, axes = plt.subplots(len(variants), 1, sharex=True, squeeze=False,
                             figsize=(max(8.0, 0.3 * len(PHASES) * cycles), 2.6 * len(variants)))
    styles = {"del": dict(color="tab:blue", marker="o", linestyle="-"),
              "close": dict(color="tab:orange", marker="s", linestyle="--")}
    points_up = {"del": -1.5, "close": 1.5}
    for ax, name in zip(axes[:, 0], variants):
        for run in (r for r in report["runs"] if r["variant"] == name):
            base = run["baseline"][key]
            xs, ys = [], []
            for c in run["cycles"]:
                for slot, phase in enumerate(PHASES):
                    x = (c["cycle"] - 1) * len(PHASES) + slot
                    point = c["phases"].get(phase)
                    xs.append(x)
                    ys.append(float("nan") if point is None else (point[key] - base) / 2**20)
            shifted = offset_copy(ax.transData, fig=fig, y=points_up[run["teardown"]], units="points")
            ax.plot(xs, ys, markersize=4, linewidth=1.6, label=run["teardown"], transform=shifted,
                    **styles[run["teardown"]])
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylabel("MiB above baseline", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    names = [p.replace("after_", "").replace("before_", "pre-") for p in PHASES]
    axes[-1, 0].set_xticks(range(len(PHASES) * cycles))
    axes[-1, 0].set_xticklabels([f"{i // len(PHASES) + 1}:{names[i % len(PHASES)]}"
                                 for i in range(len(PHASES) * cycles)], rotation=90, fontsize=7)
    axes[-1, 0].set_xlabel("cycle:phase")
    metric = "CUDA allocated" if cuda else "live tensor storage"
    fig.suptitle(f"teardown: {report['model']} on {report['device']}, {report['dtype']} ({metric})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.teardown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_teardown_arguments(parser, variants=(PER_INSTANCE, CLASS_LEVEL, TRANSFORMERS))
    parser.add_argument("--plot", help="draw memory over the cycle phases per variant to this image "
                                       "(needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("bench.teardown: --plot needs matplotlib; rerun without --plot for the table and --json",
                  file=sys.stderr)
            return 2
    after = None
    if args.plot:
        def after(report: dict[str, Any]) -> None:
            plot_report(report, args.plot)
            print(f"wrote {args.plot}")
    extra = {CLASS_LEVEL: class_level_variant, TRANSFORMERS: transformers_variant}
    try:
        if args.plot:
            check_writable(args.plot, "--plot")
        return cmd_teardown(args, extra_variants=extra, after=after)
    except QwenVLVisionError as e:  # a bad option or model: one line, as the package's CLI gives it
        print(f"bench.teardown: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
