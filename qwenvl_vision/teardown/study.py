"""``qwenvl-vision bench teardown``: does shutting an encoder down give all of its memory back? Results and the
comparisons: docs/benchmarks.md, "Teardown".

Each cycle, in one process: load an encoder (any checkpoint, repo id or preset), encode images of several sizes
(so every per-grid cache fills), tear it down, and measure before load / after load / after encode / (after
close) / after teardown / after a gc collection. Teardown is either ``del`` alone, or ``close()`` while the
caller still holds the encoder and its model, then ``del``. Measured:

- CPU: bytes of live tensor storages, each untyped storage counted once by (device, data_ptr); meta tensors count
  0. Also the process RSS (after ``malloc_trim`` on glibc), for information: the allocator may keep freed pages.
- CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` after ``synchronize``, clearing the process-wide
  cuBLAS workspaces (allocated by the first matmul, not by any encoder) and ``empty_cache``, the census's live
  tensors counted too. The allocator history is recorded, and on a failure dumped with
  ``torch.cuda.memory._dump_snapshot`` (view at https://pytorch.org/memory_viz).
- Whether the encoder, its model, every submodule and the shape cache were freed by reference counting alone (weak
  references, the cyclic gc disabled for the whole cycle), and again after ``gc.collect()``.

retained = (after teardown) - (before the run's first load), so a cache that outlives its instances grows from
cycle to cycle; a run's ``retained_bytes`` is its worst cycle. No warm-up: the first encoder of a fresh process
must be freed too. This command measures the package's own encoder (``per-instance``); ``bench/teardown.py`` passes
in the comparisons as ``extra_variants``. ``qwenvl_vision.teardown.cycles`` runs the cycles and gives the verdict,
``qwenvl_vision.teardown.census`` reads the memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..devices import device_option, dtype_name, dtype_option
from ..errors import ConfigError
from ..inputs.pixels import DEFAULT_MAX_INPUT_PIXELS
from .cycles import (
    CPU_SIZES,
    CUDA_SIZES,
    PER_INSTANCE,
    TEARDOWNS,
    Options,
    Variant,
    load_plain,
    make_inputs,
    mib,
    run_ok,
    run_variant,
)


def format_table(report: dict[str, Any]) -> str:
    cuda = report["device"].startswith("cuda")
    metric = "CUDA memory_allocated" if cuda else "live tensor bytes (gc census)"
    lines = [
        f"teardown benchmark: {report['model']} on {report['device']}, {report['dtype']}, "
        f"{report['cycles_requested']} cycles, inputs: {report['inputs']} {report['grids']}",
        f"metric: {metric}; MiB; retained = after teardown - baseline (before the first load), gc disabled",
        "freed by refcount: whether the encoder, its model and their modules are gone (close() frees the weights of "
        "objects something still holds)",
        "RSS growth: the process's resident memory after the last cycle minus before the first, for information: "
        "beyond any retained tensors, what no tensor holds (pages the allocator keeps, libraries' first-use state)",
    ]
    header = ["variant", "teardown", "cycles", "weights", "caches", "after close (held)", "retained (worst)",
              "after gc", "retained by cycle", "freed by refcount", "RSS growth"]
    if cuda:
        header.append("tensors retained (census, host+device)")
    rows = []
    for run in report["runs"]:
        done = run["cycles"]
        rss0 = run["baseline"].get("rss_bytes")
        rss1 = done[-1]["phases"]["after_gc"].get("rss_bytes")
        alive = sum(1 for c in done if c["alive_after_teardown"])
        freed = "yes" if run["freed_by_refcount"] else f"no ({alive}/{len(done)} cycles)"
        if not run["freed_by_refcount"]:
            left = done[-1]["alive_after_gc_count"]
            freed += ", after gc" if run["freed_after_gc"] else f", {left} objects alive even after gc"
        by_cycle = ", ".join(mib(n) for n in run["retained_by_cycle"])
        rows.append([
            run["variant"], run["teardown"], str(len(done)), mib(run["weights_bytes"]), mib(run["cache_bytes"]),
            mib(run.get("held_after_close_bytes")) if run["teardown"] == "close" else "-",
            mib(run["retained_bytes"]), mib(run["retained_bytes_after_gc"]), by_cycle, freed,
            mib(None if rss0 is None or rss1 is None else rss1 - rss0),
        ] + ([mib(run["retained_tensor_bytes"])] if cuda else []))
    widths = [max(map(len, column)) for column in zip(header, *rows)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    for run in report["runs"]:
        if "retained_after_cache_clear" in run:
            lines.append(f"{run['variant']}/{run['teardown']}: {mib(run['retained_after_cache_clear'])} MiB left "
                         f"after the class cache's cache_clear()")
        if run.get("stopped_early"):
            lines.append(f"{run['variant']}/{run['teardown']}: stopped early {run['stopped_early']}")
        for c in run["cycles"]:
            if c.get("new_storages") and run["variant"] == PER_INSTANCE:
                lines.append(f"{run['variant']}/{run['teardown']} cycle {c['cycle']} new storages: "
                             f"{c['new_storages']}; alive: {c['alive_after_teardown']}")
    for s in report["skipped"]:
        lines.append(f"skipped {s['variant']}: {s['reason']}")
    if report["ok"] is None:
        lines.append(f"{PER_INSTANCE} not run: no verdict")
    else:
        lines.append(f"{'PASS' if report['ok'] else 'FAIL'}: per-instance retains 0 bytes and is freed by reference "
                     f"counting alone{'' if report['ok'] else ' -- NOT met, see above'}")
    return "\n".join(lines)


def _parse_sizes(text: str, cfg: Any) -> list[tuple[int, int]]:
    """'448x336,224x224' in pixels -> merged-token (h, w), rounded to the model's factor (at least 1)."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    sizes = []
    for item in text.split(","):
        h, _, w = item.strip().lower().partition("x")
        try:
            sizes.append((max(1, round(int(h) / factor)), max(1, round(int(w) / factor))))
        except ValueError:
            raise ConfigError(f"--sizes: {item!r} is not HxW in pixels (e.g. 448x336)") from None
        if int(h) * int(w) > DEFAULT_MAX_INPUT_PIXELS:  # an image the encoder would refuse to decode
            raise ConfigError(f"--sizes: {item.strip()} is above {DEFAULT_MAX_INPUT_PIXELS:,} pixels")
    return sizes


def add_teardown_arguments(p: argparse.ArgumentParser, variants: tuple[str, ...] = (PER_INSTANCE,)) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="checkpoint folder or Hugging Face repo id (real weights)")
    src.add_argument("--preset", help="a released tower's name (random weights at its real size), e.g. "
                                      "qwen2.5-vl-3b; docs/api.md lists them")
    src.add_argument("--config", help="a config.json (a checkpoint's or ours) to build with random weights, "
                                      "e.g. a tiny one for a smoke test")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights instead of the checkpoint's (implied by --preset / --config)")
    p.add_argument("--cycles", type=int, default=20, help="load/encode/teardown cycles per variant (default 20)")
    p.add_argument("--device", type=device_option, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", type=dtype_option, help="bf16, fp32, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    if len(variants) > 1:
        p.add_argument("--variants", help=f"comma-separated subset of {','.join(variants)} (default: all)")
    p.add_argument("--teardown", default=",".join(TEARDOWNS),
                   help="comma-separated subset of del,close (default: both; comparison variants may be del only)")
    p.add_argument("--inputs", choices=("images", "patches"), default="images",
                   help="encode_images on uint8 arrays (default), or encode_patches on random rows")
    p.add_argument("--sizes", help="image sizes in pixels, HxW comma-separated (rounded to the model's "
                                   "patch*merge factor); default: a few small sizes on CPU, larger on CUDA")
    p.add_argument("--json", help="write the full results here")
    p.add_argument("--snapshot-dir", default=".",
                   help="CUDA: where to dump torch.cuda.memory._dump_snapshot on a per-instance failure")
    p.add_argument("--quiet", action="store_true", help="no per-cycle progress lines")


def check_writable(path: str, option: str) -> None:
    """A file the run writes at its end, opened for writing before it (a bad path would lose the whole run);
    one made here is removed again."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        made = not Path(path).exists()
        open(path, "a").close()
        if made:
            Path(path).unlink()
    except OSError as e:
        raise ConfigError(f"{option} {path} cannot be written ({e.strerror or e})") from None


def cmd_teardown(args: argparse.Namespace, extra_variants: dict[str, Callable[[Options], Variant | str]] | None = None,
                 after: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Run the benchmark; ``extra_variants`` adds comparisons (bench/teardown.py: a factory from the run's options to
    a Variant, or to the reason it cannot run here), ``after`` sees the report."""
    import torch

    from ..checkpoint.hub import resolve_folder
    from ..checkpoint.weights import open_checkpoint
    from ..devices import resolve_device, resolve_dtype
    from ..model.config import resolve_config

    factories = {PER_INSTANCE: lambda opts: Variant(PER_INSTANCE, lambda: load_plain(opts), TEARDOWNS, True,
                                                    note="grid plans in the model's own bounded ShapeCache"),
                 **(extra_variants or {})}
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    wanted = [v.strip() for v in (getattr(args, "variants", None) or ",".join(factories)).split(",") if v.strip()]
    teardowns = [t.strip() for t in args.teardown.split(",") if t.strip()]
    bad = [v for v in wanted if v not in factories] + [t for t in teardowns if t not in TEARDOWNS]
    if bad or not wanted or not teardowns:
        raise ConfigError(f"unknown variant/teardown {bad}; variants: {list(factories)}, teardowns: {TEARDOWNS}")
    if args.cycles < 1:
        raise ConfigError(f"--cycles {args.cycles} is below 1")
    if args.json:
        check_writable(args.json, "--json")

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model:
        config = open_checkpoint(resolve_folder(args.model, None, False, None, None)).config
        # --random-weights with a checkpoint: its config at its size, without reading the weights
        source, random_weights = (config, True) if args.random_weights else (args.model, False)
        label = args.model + (" (random weights)" if args.random_weights else "")
    else:
        source = config = resolve_config(args.preset or args.config)
        random_weights = True
        label = args.preset or (source.name or f"{source.model_type} config {args.config}")
    opts = Options(source, random_weights, device, dtype, config)
    sizes = _parse_sizes(args.sizes, config) if args.sizes else list(CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    inputs = make_inputs(config, device, sizes, args.inputs)
    recording = device.type == "cuda"
    if recording:
        torch.cuda.memory._record_memory_history(max_entries=200_000)

    report: dict[str, Any] = {
        "device": str(device), "model": label, "dtype": dtype_name(dtype),
        "metric": "cuda_allocated" if device.type == "cuda" else "tensor_census",
        "inputs": inputs.mode, "grids": [list(g) for g in inputs.grids], "cycles_requested": args.cycles,
        "torch": torch.__version__, "runs": [], "skipped": [], "snapshots": [],
    }
    for name in wanted:
        variant = factories[name](opts)
        if isinstance(variant, str):  # why it cannot run here
            report["skipped"].append({"variant": name, "reason": variant})
            continue
        if variant.prepare is not None:
            try:
                variant.prepare()
            except ImportError as e:
                report["skipped"].append({"variant": name, "reason": f"import failed: {e}"})
                continue
        for teardown in (t for t in teardowns if t in variant.teardowns):
            log(f"{variant.name} / {teardown}:")
            run = run_variant(variant, teardown, inputs, device, args.cycles, log)
            report["runs"].append(run)
            if variant.expect_free and not run_ok(run) and recording:
                path = Path(args.snapshot_dir) / f"teardown-snapshot-{variant.name}-{teardown}.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
                run["snapshot"] = str(path)
                report["snapshots"].append(str(path))
    if recording:
        torch.cuda.memory._record_memory_history(enabled=None)
    checked = [r for r in report["runs"] if r["variant"] == PER_INSTANCE]
    report["ok"] = all(run_ok(r) for r in checked) if checked else None  # None: per-instance not run
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    if after is not None:
        after(report)
    return 1 if report["ok"] is False else 0


def add_bench_parser(sub: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """``qwenvl-vision bench <name>``; today: teardown. ``parents``: the options every command takes."""
    p = sub.add_parser("bench", help="benchmarks (teardown: is every byte given back?)", parents=list(parents))
    bench_sub = p.add_subparsers(dest="bench", required=True)
    t = bench_sub.add_parser("teardown", help="memory retained after tearing an encoder down (del and close)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                             parents=list(parents))
    add_teardown_arguments(t)
    t.set_defaults(func=cmd_teardown)
