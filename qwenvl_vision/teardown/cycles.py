"""One teardown measurement: load an encoder, encode, tear it down (``del``, or ``close()`` while still held), with
memory read at every phase and weak references telling what reference counting alone freed; a run of such cycles
per variant, and the per-instance verdict. What is measured and why is the command's help
(``qwenvl_vision.teardown.study``); the readings are ``qwenvl_vision.teardown.census``'s.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .census import available_bytes, measure, point_bytes

PER_INSTANCE = "per-instance"
TEARDOWNS = ("del", "close")

# Merged-token (h, w) of the default images: several sizes, not all multiples of Qwen2.5's 4x4 window.
CPU_SIZES = ((1, 1), (1, 2), (2, 1), (2, 3))
CUDA_SIZES = ((4, 4), (6, 10), (16, 16), (24, 16), (13, 30))


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

    from ..encoder import VisionEncoder

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
    from ..encoder import VisionEncoder

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
    from ..encoder import VisionEncoder

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
            variants.append(Variant(name, lambda: load_plain(opts), TEARDOWNS, expect_free=True,
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
    from ..errors import EncoderClosedError

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
        if point_bytes(after, device) > (baseline if baseline is not None else point_bytes(before, device)):
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
            baseline = point_bytes(phases["before_load"], device)
            tensor_baseline = phases["before_load"]["tensor_bytes"]
            run["baseline"] = phases["before_load"]
        instance_bytes = max(instance_bytes, point_bytes(phases["after_encode"], device)
                             - point_bytes(phases["before_load"], device))
        record["cycle"] = i + 1
        record["retained_bytes"] = point_bytes(phases["after_teardown"], device) - baseline
        record["retained_bytes_after_gc"] = point_bytes(phases["after_gc"], device) - baseline
        record["retained_tensor_bytes"] = phases["after_teardown"]["tensor_bytes"] - tensor_baseline
        record["alive_after_teardown_count"] = len(record["alive_after_teardown"])
        record["alive_after_gc_count"] = len(record["alive_after_gc"])
        record["alive_after_teardown"] = _short(record["alive_after_teardown"])
        record["alive_after_gc"] = _short(record["alive_after_gc"])
        run["cycles"].append(record)
        log(f"  {variant.name}/{teardown} cycle {i + 1}/{cycles}: retained {mib(record['retained_bytes'])} MiB, "
            f"objects alive after del {record['alive_after_teardown_count']}/{record['tracked_objects']}, "
            f"{record['cycle_s']:.1f}s")
    done = run["cycles"]
    first = done[0]["phases"]
    run["weights_bytes"] = point_bytes(first["after_load"], device) - point_bytes(first["before_load"], device)
    run["cache_bytes"] = point_bytes(first["after_encode"], device) - point_bytes(first["after_load"], device)
    run["retained_bytes"] = max(c["retained_bytes"] for c in done)
    run["retained_bytes_after_gc"] = max(c["retained_bytes_after_gc"] for c in done)
    run["retained_by_cycle"] = [c["retained_bytes"] for c in done]
    run["retained_tensor_bytes"] = max(c["retained_tensor_bytes"] for c in done)  # the census, also on CUDA
    run["freed_by_refcount"] = all(not c["alive_after_teardown"] for c in done)
    run["freed_after_gc"] = all(not c["alive_after_gc"] for c in done)
    if teardown == "close":
        run["held_after_close_bytes"] = max(point_bytes(c["phases"]["after_close"], device)
                                            - point_bytes(c["phases"]["before_load"], device) for c in done)
        run["close_raises"] = all(c.get("after_close_call", "").startswith("EncoderClosedError") for c in done)
    if variant.cache_clear is not None:
        variant.cache_clear()
        gc.collect()
        run["retained_after_cache_clear"] = point_bytes(measure(device), device) - baseline
    return run


def run_ok(run: dict[str, Any]) -> bool:
    """The per-instance goal: nothing retained, everything freed by refcount, close() frees while held."""
    ok = run["retained_bytes"] == 0 and run["retained_tensor_bytes"] == 0 and run["freed_by_refcount"]
    if run["teardown"] == "close":
        ok = ok and run["held_after_close_bytes"] == 0 and run["close_raises"]
    return ok


def mib(n: int | None) -> str:
    """Bytes as MiB for the tables and progress lines: "0" exactly when nothing is left, and an amount under 0.01
    MiB in two significant digits (rounded to "0.00" it would read as nothing left)."""
    if n is None:
        return "-"
    return "0" if n == 0 else f"{n / 2**20:.2f}" if abs(n) >= 2**20 / 100 else f"{n / 2**20:.2g}"


def load_plain(opts: Options) -> Any:
    """The package's own encoder for the run's options: the per-instance variant's load."""
    from ..loading import load_encoder

    return load_encoder(opts.source, device=opts.device, dtype=opts.dtype, random_weights=opts.random_weights)
