"""``qwenvl-vision bench teardown``: does shutting an encoder down give all of its memory back?

Each cycle, in one process: load an encoder (any checkpoint, repo id or preset), encode images of several sizes
(so every per-grid cache fills), tear it down, and measure before load / after load / after encode / (after
close) / after teardown / after a gc collection. Teardown is either ``del`` alone, or ``close()`` while the
caller still holds the encoder and its model, then ``del``. Measured:

- CPU: bytes of live tensor storages, a census over ``gc.get_objects()`` counting each untyped storage
  once by (device, data_ptr); meta tensors have no storage and count 0. Also the process RSS (after
  ``malloc_trim`` on glibc), for information: the allocator may keep freed pages.
- CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` after ``synchronize``, clearing the
  process-wide cuBLAS workspaces (allocated by the first matmul, not by any encoder) and ``empty_cache``
  (the census is recorded too); the allocator history is recorded, and on a failure dumped with
  ``torch.cuda.memory._dump_snapshot`` (view at https://pytorch.org/memory_viz).
- Whether the encoder, its model, every submodule and the shape cache were freed by reference counting
  alone: weak references checked right after the teardown with the cyclic gc disabled for the whole
  cycle, and again after ``gc.collect()``.

retained = (after teardown) - (before the first load of that run), so a cache that outlives its instances
shows as growth from cycle to cycle; the run's ``retained_bytes`` is the worst cycle. No warm-up by default:
the first encoder of a fresh process must be freed too (``--warmup N`` to exclude one-time effects).

The package measures its own encoder (variant ``per-instance``). The comparisons - the same model with a
class-level ``functools.lru_cache`` (the bug this package exists to avoid, so it may not live in the package),
and transformers' tower - and the plot are in the repository's ``bench/teardown.py``, which passes them in as
``extra_variants``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Any

PER_INSTANCE = "per-instance"
TEARDOWNS = ("del", "close")

# Merged-token (h, w) of the default images: several sizes, not all multiples of Qwen2.5's 4x4 window.
CPU_SIZES = ((1, 1), (1, 2), (2, 1), (2, 3))
CUDA_SIZES = ((4, 4), (6, 10), (16, 16), (24, 16), (13, 30))


# ---------------------------------------------------------------------- measuring


def live_tensor_storages() -> dict[tuple[str, int], tuple[int, str]]:
    """Every untyped storage reachable from a gc-tracked tensor: (device, data_ptr) -> (bytes, example).

    Tensors held only from C++ (autograd graphs, allocator caches) are invisible here; the RSS and the
    CUDA allocator counters cover those.
    """
    import torch

    objects = gc.get_objects()
    # type(), not isinstance(): no __class__ lookups on arbitrary objects (some warn or import on access);
    # the tensor types are found once per census and the scan runs at C speed.
    # FakeTensors (torch.compile's tracing values) have no data.
    tensor_types = {t for t in set(map(type, objects)) if issubclass(t, torch.Tensor) and t.__name__ != "FakeTensor"}
    tensors = list(compress(objects, map(tensor_types.__contains__, map(type, objects))))
    del objects
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    for obj in tensors:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            key = (str(storage.device), ptr)
        except Exception:  # noqa: BLE001 - sparse / nested / wrapper tensors without a plain storage
            continue
        if ptr == 0 and nbytes == 0:
            continue
        if key not in seen or nbytes > seen[key][0]:
            seen[key] = (nbytes, f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')} {obj.device}")
    return seen


def live_tensor_bytes() -> int:
    """Bytes of all live tensor storages, each counted once (see live_tensor_storages)."""
    return sum(n for n, _ in live_tensor_storages().values())


_LIBC: Any = None


def rss_bytes() -> int | None:
    """Resident set size, after asking glibc to return free heap pages (malloc_trim), or None."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def available_bytes(device: Any) -> int | None:
    """Memory a new instance could still use: CUDA free + cached, or MemAvailable on Linux."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(device: Any, storages: bool = False) -> dict[str, Any]:
    """One point: tensor census (+ RSS on CPU, allocator counters on CUDA). Never runs the cyclic gc."""
    import torch

    live = live_tensor_storages()
    point: dict[str, Any] = {"tensor_bytes": sum(n for n, _ in live.values())}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:  # process-wide cuBLAS workspaces, allocated on the first matmul
            clear_workspaces()
        torch.cuda.empty_cache()
        point["cuda_allocated"] = torch.cuda.memory_allocated(device)
        point["cuda_reserved"] = torch.cuda.memory_reserved(device)
    point["rss_bytes"] = rss_bytes()
    if storages:
        point["_storages"] = live
    return point


def _metric(point: dict[str, Any], device: Any) -> int:
    return point["cuda_allocated"] if device.type == "cuda" else point["tensor_bytes"]


# ---------------------------------------------------------------------- what is measured


@dataclass
class Inputs:
    """Created once before any baseline, held for the whole run (so they never count as retained)."""

    grids: list[tuple[int, int, int]]
    images: list[Any]  # HxWx3 uint8 arrays sized to give exactly `grids`
    min_pixels: int
    max_pixels: int
    pixel_values: Any  # random rows for encode_patches and the transformers tower
    grid_thw: Any
    mode: str = "images"  # images | patches (encode_patches with random rows) | auto (images if available)


def make_inputs(cfg: Any, device: Any, sizes: list[tuple[int, int]], mode: str, seed: int = 0) -> Inputs:
    import numpy as np
    import torch

    merge = cfg.spatial_merge_size
    factor = cfg.patch_size * merge
    grids = [(1, h * merge, w * merge) for h, w in sizes]
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h * factor, w * factor, 3), dtype=np.uint8) for h, w in sizes]
    rows = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(rows, cfg.patch_dim, generator=gen).to(device)
    grid_thw = torch.tensor(grids, dtype=torch.int64, device=device)
    max_pixels = max(h * w for h, w in sizes) * factor * factor
    return Inputs(grids, images, factor * factor, max_pixels, pixel_values, grid_thw, mode)


def encode(owner: Any, inputs: Inputs, log: Callable[[str], None] = print) -> str:
    """Run the owner once over all inputs and drop the outputs; returns the input mode actually used.

    inputs.mode "auto" tries encode_images and, if preprocessing is unavailable (ImportError,
    NotImplementedError, AttributeError), switches the whole run to encode_patches on random rows.
    """
    import torch

    from .encoder import VisionEncoder

    if not isinstance(owner, VisionEncoder):  # transformers' tower: preprocessed rows
        with torch.inference_mode():
            out = owner(inputs.pixel_values, grid_thw=inputs.grid_thw)
        del out
        return "patches"
    if inputs.mode in ("images", "auto"):
        try:
            result = owner.encode_images(inputs.images, min_pixels=inputs.min_pixels, max_pixels=inputs.max_pixels)
        except (ImportError, NotImplementedError, AttributeError) as e:
            if inputs.mode != "auto":
                raise
            log(f"note: encode_images unavailable ({type(e).__name__}: {e}); using encode_patches on random rows")
            inputs.mode = "patches"
        else:
            got = [tuple(g) for g in result.grid_thw.tolist()]
            del result
            if got != inputs.grids:
                raise RuntimeError(f"encode_images produced grids {got}, expected {inputs.grids}")
            inputs.mode = "images"
            return "images"
    result = owner.encode_patches(inputs.pixel_values, inputs.grids)
    del result
    return "patches"


def _tracked(owner: Any) -> list[tuple[str, weakref.ref]]:
    """Weak references to the encoder, its model, every submodule and the model's shape cache."""
    from .encoder import VisionEncoder

    refs: list[tuple[str, weakref.ref]] = []
    model = owner
    if isinstance(owner, VisionEncoder):
        refs.append(("encoder", weakref.ref(owner)))
        model = owner.model
    for name, module in model.named_modules():
        refs.append((f"model.{name}" if name else "model", weakref.ref(module)))
    cache = getattr(model, "shape_cache", None)
    if cache is not None:
        refs.append(("model.shape_cache", weakref.ref(cache)))
    return refs


def _cache_stats(owner: Any) -> dict[str, int] | None:
    from .encoder import VisionEncoder

    model = owner.model if isinstance(owner, VisionEncoder) else owner
    cache = getattr(model, "shape_cache", None)
    return None if cache is None else cache.stats()


def _alive(refs: list[tuple[str, weakref.ref]]) -> list[str]:
    return [name for name, ref in refs if ref() is not None]


@dataclass
class Variant:
    name: str
    load: Callable[[], Any]  # -> a VisionEncoder, or an nn.Module for transformers
    teardowns: tuple[str, ...]
    expect_free: bool
    note: str = ""
    cache_entries: Callable[[], int] | None = None
    cache_clear: Callable[[], None] | None = None
    prepare: Callable[[], None] | None = None  # once before its first run, outside the measured cycles


@dataclass
class Options:
    source: Any  # preset name, VisionConfig, or checkpoint folder / repo id
    random_weights: bool
    device: Any
    dtype: Any
    label: str
    config: Any  # VisionConfig
    extra: dict = field(default_factory=dict)


# A comparison variant: a factory from the run's options to a Variant, or to the reason it cannot run here.
VariantFactory = Callable[[Options], "Variant | str"]


def build_variants(opts: Options, wanted: list[str], extra: dict[str, VariantFactory]
                   ) -> tuple[list[Variant], list[dict[str, str]]]:
    variants: list[Variant] = []
    skipped: list[dict[str, str]] = []
    for name in wanted:
        if name == PER_INSTANCE:
            variants.append(Variant(name, lambda: _load_plain(opts), TEARDOWNS, expect_free=True,
                                    note="grid plans in the model's own bounded ShapeCache"))
            continue
        made = extra[name](opts)
        if isinstance(made, str):
            skipped.append({"variant": name, "reason": made})
        else:
            variants.append(made)
    return variants, skipped


# ---------------------------------------------------------------------- one cycle, one run


def run_cycle(variant: Variant, teardown: str, inputs: Inputs, device: Any, baseline: int | None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """load -> encode -> teardown -> gc, measured at each step; gc is disabled until after the teardown check."""
    from .errors import EncoderClosedError

    record: dict[str, Any] = {"phases": {}}
    phases = record["phases"]
    t0 = time.perf_counter()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = measure(device, storages=True)
        known = before.pop("_storages")
        phases["before_load"] = before
        t_load = time.perf_counter()
        box = [variant.load()]
        record["load_s"] = round(time.perf_counter() - t_load, 3)
        phases["after_load"] = measure(device)
        t1 = time.perf_counter()
        record["inputs"] = encode(box[0], inputs, log)
        record["encode_s"] = round(time.perf_counter() - t1, 3)
        phases["after_encode"] = measure(device)
        refs = _tracked(box[0])
        record["tracked_objects"] = len(refs)
        stats = _cache_stats(box[0])
        if stats is not None:
            record["shape_cache"] = stats
        if variant.cache_entries is not None:
            record["class_cache_entries"] = variant.cache_entries()
        if teardown == "close":
            held, held_model = box[0], box[0].model  # the caller keeps both references
            held.close()
            phases["after_close"] = measure(device)
            try:
                held.encode_patches(inputs.pixel_values, inputs.grids)
            except EncoderClosedError as e:
                record["after_close_call"] = f"{type(e).__name__}: {e}"
            else:
                record["after_close_call"] = "no error (expected EncoderClosedError)"
            record["model_params_meta"] = all(p.is_meta for p in held_model.parameters())
            del held, held_model
        box.clear()
        after = measure(device, storages=True)
        live = after.pop("_storages")
        phases["after_teardown"] = after
        record["alive_after_teardown"] = _alive(refs)
        if _metric(after, device) > (baseline if baseline is not None else _metric(before, device)):
            new = sorted(((n, desc) for key, (n, desc) in live.items() if key not in known), reverse=True)
            record["new_storages"] = [f"{n} B {desc}" for n, desc in new[:10]]
        del live, known
    finally:
        gc.collect()
        if was_enabled:
            gc.enable()
    phases["after_gc"] = measure(device)
    record["alive_after_gc"] = _alive(refs)
    if variant.cache_entries is not None:
        record["class_cache_entries_after_teardown"] = variant.cache_entries()
    record["cycle_s"] = round(time.perf_counter() - t0, 3)
    return record


def _short(names: list[str]) -> list[str]:
    return names if len(names) <= 6 else names[:5] + [f"... {len(names) - 5} more"]


def run_variant(variant: Variant, teardown: str, inputs: Inputs, device: Any, cycles: int,
                log: Callable[[str], None]) -> dict[str, Any]:
    run: dict[str, Any] = {"variant": variant.name, "teardown": teardown, "note": variant.note, "cycles": []}
    baseline = None
    tensor_baseline = 0
    instance_bytes = 0
    for i in range(cycles):
        if i and instance_bytes:
            avail = available_bytes(device)
            if avail is not None and avail < 1.25 * instance_bytes + (256 << 20):
                run["stopped_early"] = (f"after {i} cycles: another instance needs ~{instance_bytes / 2**30:.2f} GiB, "
                                        f"{avail / 2**30:.2f} GiB available")
                log(f"  {variant.name}/{teardown}: stopping early, {run['stopped_early']}")
                break
        record = run_cycle(variant, teardown, inputs, device, baseline, log)
        phases = record["phases"]
        if baseline is None:
            baseline = _metric(phases["before_load"], device)
            tensor_baseline = phases["before_load"]["tensor_bytes"]
            run["baseline"] = phases["before_load"]
        instance_bytes = max(instance_bytes, _metric(phases["after_encode"], device)
                             - _metric(phases["before_load"], device))
        record["cycle"] = i + 1
        record["retained_bytes"] = _metric(phases["after_teardown"], device) - baseline
        record["retained_bytes_after_gc"] = _metric(phases["after_gc"], device) - baseline
        record["retained_tensor_bytes"] = phases["after_teardown"]["tensor_bytes"] - tensor_baseline
        record["alive_after_teardown_count"] = len(record["alive_after_teardown"])
        record["alive_after_gc_count"] = len(record["alive_after_gc"])
        record["alive_after_teardown"] = _short(record["alive_after_teardown"])
        record["alive_after_gc"] = _short(record["alive_after_gc"])
        run["cycles"].append(record)
        log(f"  {variant.name}/{teardown} cycle {i + 1}/{cycles}: retained {_mib(record['retained_bytes'])} MiB, "
            f"objects alive after del {record['alive_after_teardown_count']}/{record['tracked_objects']}, "
            f"{record['cycle_s']:.1f}s")
    done = run["cycles"]
    first = done[0]["phases"]
    run["weights_bytes"] = _metric(first["after_load"], device) - _metric(first["before_load"], device)
    run["cache_bytes"] = _metric(first["after_encode"], device) - _metric(first["after_load"], device)
    run["retained_bytes"] = max(c["retained_bytes"] for c in done)
    run["retained_bytes_after_gc"] = max(c["retained_bytes_after_gc"] for c in done)
    run["retained_by_cycle"] = [c["retained_bytes"] for c in done]
    run["retained_tensor_bytes"] = max(c["retained_tensor_bytes"] for c in done)  # the census, also on CUDA
    run["freed_by_refcount"] = all(not c["alive_after_teardown"] for c in done)
    run["freed_after_gc"] = all(not c["alive_after_gc"] for c in done)
    if teardown == "close":
        run["held_after_close_bytes"] = max(
            _metric(c["phases"]["after_close"], device) - _metric(c["phases"]["before_load"], device) for c in done)
        run["close_raises"] = all(c.get("after_close_call", "").startswith("EncoderClosedError") for c in done)
    if variant.cache_clear is not None:
        variant.cache_clear()
        gc.collect()
        run["retained_after_cache_clear"] = _metric(measure(device), device) - baseline
    return run


def run_ok(run: dict[str, Any]) -> bool:
    """The per-instance goal: nothing retained, everything freed by refcount, close() frees while held."""
    ok = run["retained_bytes"] == 0 and run["retained_tensor_bytes"] == 0 and run["freed_by_refcount"]
    if run["teardown"] == "close":
        ok = ok and run["held_after_close_bytes"] == 0 and run["close_raises"]
    return ok


# ---------------------------------------------------------------------- reporting


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return "0" if n == 0 else f"{n / 2**20:.2f}"


def format_table(report: dict[str, Any]) -> str:
    metric = "CUDA memory_allocated" if report["device"].startswith("cuda") else "live tensor bytes (gc census)"
    lines = [
        f"teardown benchmark: {report['model']} on {report['device']}, {report['dtype']}, "
        f"{report['cycles_requested']} cycles, inputs: {report['inputs']} {report['grids']}",
        f"metric: {metric}; MiB; retained = after teardown - baseline (before the first load), gc disabled",
    ]
    cuda = report["device"].startswith("cuda")
    header = ["variant", "teardown", "cycles", "weights", "caches", "after close (held)", "retained (worst)",
              "after gc", "retained by cycle", "freed by refcount", "RSS delta"]
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
            freed += ", after gc" if run["freed_after_gc"] else ", not even after gc"
        by_cycle = ", ".join(_mib(n) for n in run["retained_by_cycle"])
        rows.append([
            run["variant"], run["teardown"], str(len(done)), _mib(run["weights_bytes"]), _mib(run["cache_bytes"]),
            _mib(run.get("held_after_close_bytes")) if run["teardown"] == "close" else "-",
            _mib(run["retained_bytes"]), _mib(run["retained_bytes_after_gc"]), by_cycle, freed,
            _mib(None if rss0 is None or rss1 is None else rss1 - rss0),
        ] + ([_mib(run["retained_tensor_bytes"])] if cuda else []))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    for run in report["runs"]:
        if "retained_after_cache_clear" in run:
            lines.append(f"{run['variant']}/{run['teardown']}: {_mib(run['retained_after_cache_clear'])} MiB left "
                         f"after the class cache's cache_clear() (it held "
                         f"{run['cycles'][-1].get('class_cache_entries_after_teardown', '?')} entries)")
        if run.get("stopped_early"):
            lines.append(f"{run['variant']}/{run['teardown']}: stopped early {run['stopped_early']}")
        for c in run["cycles"]:
            if c.get("new_storages") and run["variant"] == PER_INSTANCE:
                lines.append(f"{run['variant']}/{run['teardown']} cycle {c['cycle']} new storages: "
                             f"{c['new_storages']}; alive: {c['alive_after_teardown']}")
    for s in report["skipped"]:
        lines.append(f"skipped {s['variant']}: {s['reason']}")
    verdict = "PASS" if report["ok"] else "FAIL"
    lines.append(f"{verdict}: per-instance retains 0 bytes and is freed by reference counting alone"
                 + ("" if report["ok"] else " -- NOT met, see above"))
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry points


def _parse_sizes(text: str, cfg: Any) -> list[tuple[int, int]]:
    """'448x336,224x224' in pixels -> merged-token (h, w), rounded to the model's factor (at least 1)."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    sizes = []
    for item in text.split(","):
        h, _, w = item.strip().lower().partition("x")
        try:
            sizes.append((max(1, round(int(h) / factor)), max(1, round(int(w) / factor))))
        except ValueError:
            raise SystemExit(f"--sizes: {item!r} is not HxW in pixels (e.g. 448x336)") from None
    return sizes


def add_teardown_arguments(p: argparse.ArgumentParser, variants: tuple[str, ...] = (PER_INSTANCE,)) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="checkpoint folder or Hugging Face repo id (real weights)")
    src.add_argument("--model", dest="model_option", help=argparse.SUPPRESS)  # the older spelling
    src.add_argument("--preset", help="a released tower's name (random weights at its real size), e.g. "
                                      "qwen2.5-vl-3b; see README for the list")
    src.add_argument("--config", help="a config.json (a checkpoint's or ours) to build with random weights, "
                                      "e.g. a tiny one for a smoke test")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights instead of the checkpoint's (implied by --preset / --config)")
    p.add_argument("--cycles", type=int, default=20, help="load/encode/teardown cycles per variant (default 20)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", help="bf16, fp32, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    if len(variants) > 1:
        p.add_argument("--variants", help=f"comma-separated subset of {','.join(variants)} (default: all)")
    p.add_argument("--teardown", default=",".join(TEARDOWNS),
                   help="comma-separated subset of del,close (default: both; comparison variants may be del only)")
    p.add_argument("--inputs", choices=("auto", "images", "patches"), default="auto",
                   help="encode_images on uint8 arrays, or encode_patches on random rows "
                        "(auto: images, falling back to patches if preprocessing is unavailable)")
    p.add_argument("--sizes", help="image sizes in pixels, HxW comma-separated (rounded to the model's "
                                   "patch*merge factor); default: a few small sizes on CPU, larger on CUDA")
    p.add_argument("--warmup", type=int, default=0,
                   help="unmeasured cycles before the runs, so one-time process-wide state is not counted "
                        "(default 0: the first cycle of a fresh process is part of the test)")
    p.add_argument("--json", help="write the full results here")
    p.add_argument("--snapshot-dir", default=".",
                   help="CUDA: where to dump torch.cuda.memory._dump_snapshot on a per-instance failure")
    p.add_argument("--quiet", action="store_true", help="no per-cycle progress lines")


def cmd_teardown(args: argparse.Namespace, extra_variants: dict[str, VariantFactory] | None = None,
                 after: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Run the benchmark; ``extra_variants`` adds comparisons (bench/teardown.py), ``after`` sees the report."""
    import torch

    from .config import resolve_config
    from .devices import resolve_device, resolve_dtype

    extra = extra_variants or {}
    known = (PER_INSTANCE, *extra)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    wanted = [v.strip() for v in (getattr(args, "variants", None) or ",".join(known)).split(",") if v.strip()]
    bad = [v for v in wanted if v not in known]
    teardowns = [t.strip() for t in args.teardown.split(",") if t.strip()]
    bad += [t for t in teardowns if t not in TEARDOWNS]
    if bad or not wanted or not teardowns:
        print(f"bench teardown: unknown variant/teardown {bad}; variants: {list(known)}, teardowns: {TEARDOWNS}",
              file=sys.stderr)
        return 2
    if args.cycles < 1:
        print("bench teardown: --cycles must be >= 1", file=sys.stderr)
        return 2

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = args.model or getattr(args, "model_option", None)
    if model:
        config = _checkpoint_config(model)
        # --random-weights with a checkpoint: its config at its size, without reading the weights
        source, random_weights = (config, True) if args.random_weights else (model, False)
        label = model + (" (random weights)" if args.random_weights else "")
    else:
        source = resolve_config(args.preset or args.config)
        random_weights = True
        config = source
        label = args.preset or (source.name or f"{source.family} config {args.config}")
    opts = Options(source, random_weights, device, dtype, label, config)
    sizes = _parse_sizes(args.sizes, config) if args.sizes else list(CUDA_SIZES if device.type == "cuda" else CPU_SIZES)
    inputs = make_inputs(config, device, sizes, args.inputs)
    variants, skipped = build_variants(opts, wanted, extra)
    recording = False
    if device.type == "cuda" and hasattr(torch.cuda.memory, "_record_memory_history"):
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        recording = True

    warmup = args.warmup
    warm = Variant("warmup", lambda: _load_plain(opts), ("del",), True)
    for i in range(warmup):
        log(f"warmup cycle {i + 1}/{warmup}")
        run_cycle(warm, "del", inputs, device, None, log)

    report: dict[str, Any] = {
        "device": str(device), "model": label, "dtype": str(dtype).replace("torch.", ""),
        "metric": "cuda_allocated" if device.type == "cuda" else "tensor_census",
        "inputs": None, "grids": [list(g) for g in inputs.grids], "cycles_requested": args.cycles,
        "warmup": warmup, "torch": torch.__version__, "runs": [], "skipped": skipped, "snapshots": [],
    }
    for variant in variants:
        if variant.prepare is not None:
            try:
                variant.prepare()
            except ImportError as e:
                report["skipped"].append({"variant": variant.name, "reason": f"import failed: {e}"})
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
    report["inputs"] = inputs.mode
    checked = [r for r in report["runs"] if r["variant"] == PER_INSTANCE]
    report["ok"] = bool(checked) and all(run_ok(r) for r in checked)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if after is not None:
        after(report)
    return 0 if report["ok"] or not checked else 1


def _load_plain(opts: Options) -> Any:
    from .encoder import load_encoder

    return load_encoder(opts.source, device=opts.device, dtype=opts.dtype, random_weights=opts.random_weights)


def _checkpoint_config(source: str) -> Any:
    from .hub import resolve_folder
    from .weights import open_checkpoint

    return open_checkpoint(resolve_folder(source, None, False, None, None)).config


def add_bench_parser(sub: Any) -> None:
    """``qwenvl-vision bench <name>``; today: teardown."""
    p = sub.add_parser("bench", help="benchmarks (teardown: is every byte given back?)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    t = bench_sub.add_parser("teardown", help="memory retained after tearing an encoder down (del and close)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_teardown_arguments(t)
    t.set_defaults(func=cmd_teardown)
