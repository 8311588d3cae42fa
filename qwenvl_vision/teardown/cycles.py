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
from dataclasses import dataclass
from typing import Any

from .census import available_bytes, measure, point_bytes

PER_INSTANCE = "per-instance"
TEARDOWNS = ("del", "close")

# Merged-token (h, w) of the default images: several sizes, not all multiples of Qwen2.5's 4x4 window.
CPU_SIZES = ((1, 1), (1, 2), (2, 1), (2, 3))
CUDA_SIZES = ((4, 4), (6, 10), (16, 16), (24, 16), (13, 30))


@dataclass
class Inputs:
    """Created once before any baseline, held for the whole run (so they never count as retained)."""

    grids: list[tuple[int, int, int]]
    images: list[Any]  # HxWx3 uint8 arrays sized to give exactly `grids`
    min_pixels: int
    max_pixels: int
    pixel_values: Any  # random rows for encode_patches and the transformers tower
    grid_thw: Any
    mode: str = "images"  # images (encode_images) | patches (encode_patches with random rows)


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


def encode(owner: Any, inputs: Inputs) -> None:
    """Run the owner once over all inputs and drop the outputs."""
    import torch

    from ..encoder import VisionEncoder

    if not isinstance(owner, VisionEncoder):  # transformers' tower: preprocessed rows
        with torch.inference_mode():
            owner(inputs.pixel_values, grid_thw=inputs.grid_thw)
    elif inputs.mode == "images":
        owner.encode_images(inputs.images, min_pixels=inputs.min_pixels, max_pixels=inputs.max_pixels)
    else:
        owner.encode_patches(inputs.pixel_values, inputs.grids)


def tracked(owner: Any) -> weakref.WeakValueDictionary:
    """Weak references by name to the encoder, its model, every submodule and the model's shape cache: what is
    still alive is what the dictionary still holds."""
    from ..encoder import VisionEncoder

    model = owner.model if isinstance(owner, VisionEncoder) else owner
    refs = weakref.WeakValueDictionary({"encoder": owner} if model is not owner else {})
    refs.update((f"model.{name}" if name else "model", module) for name, module in model.named_modules())
    if getattr(model, "shape_cache", None) is not None:
        refs["model.shape_cache"] = model.shape_cache
    return refs


@dataclass
class Variant:
    name: str
    load: Callable[[], Any]  # -> a VisionEncoder, or an nn.Module for transformers
    teardowns: tuple[str, ...]
    expect_free: bool
    note: str = ""
    cache_clear: Callable[[], None] | None = None
    prepare: Callable[[], None] | None = None  # once before its first run, outside the measured cycles


@dataclass
class Options:
    source: Any  # preset name, VisionConfig, or checkpoint folder / repo id
    random_weights: bool
    device: Any
    dtype: Any
    config: Any  # VisionConfig


def run_cycle(variant: Variant, teardown: str, inputs: Inputs, device: Any, baseline: int | None) -> dict[str, Any]:
    """load -> encode -> teardown -> gc, measured at each step; gc is disabled until after the teardown check."""
    from ..errors import EncoderClosedError

    record: dict[str, Any] = {"phases": {}}
    phases = record["phases"]
    t0 = time.perf_counter()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        known: dict = {}
        before = phases["before_load"] = measure(device, known)
        box = [variant.load()]
        phases["after_load"] = measure(device)
        encode(box[0], inputs)
        phases["after_encode"] = measure(device)
        refs = tracked(box[0])
        if teardown == "close":
            held, held_model = box[0], box[0].model  # the caller keeps both references
            held.close()
            phases["after_close"] = measure(device)
            try:
                held.encode_patches(inputs.pixel_values, inputs.grids)
                record["close_raises"] = False
            except EncoderClosedError:
                record["close_raises"] = True
            del held, held_model
        box.clear()
        live: dict = {}
        after = phases["after_teardown"] = measure(device, live)
        record["alive_after_teardown"] = list(refs)
        if point_bytes(after, device) > (baseline if baseline is not None else point_bytes(before, device)):
            new = sorted(((n, desc) for key, (n, desc) in live.items() if key not in known), reverse=True)
            record["new_storages"] = [f"{n} B {desc}" for n, desc in new[:10]]
        del live, known
    finally:
        gc.collect()
        if was_enabled:
            gc.enable()
    phases["after_gc"] = measure(device)
    record["alive_after_gc"] = list(refs)
    record["cycle_s"] = round(time.perf_counter() - t0, 3)
    for when in ("after_teardown", "after_gc"):  # the names, the first few of them shown
        alive = record[f"alive_{when}"]
        record[f"alive_{when}_count"] = len(alive)
        record[f"alive_{when}"] = alive if len(alive) <= 6 else alive[:5] + [f"... {len(alive) - 5} more"]
    return record


def run_variant(variant: Variant, teardown: str, inputs: Inputs, device: Any, cycles: int,
                log: Callable[[str], None]) -> dict[str, Any]:
    run: dict[str, Any] = {"variant": variant.name, "teardown": teardown, "note": variant.note, "cycles": []}
    done = run["cycles"]
    instance_bytes = 0
    for i in range(cycles):
        avail = available_bytes(device) if instance_bytes else None
        if avail is not None and avail < 1.25 * instance_bytes + (256 << 20):  # another instance would not fit
            run["stopped_early"] = (f"after {i} cycles: another instance needs ~{instance_bytes / 2**30:.2f} GiB, "
                                    f"{avail / 2**30:.2f} GiB available")
            log(f"  {variant.name}/{teardown}: stopping early, {run['stopped_early']}")
            break
        record = run_cycle(variant, teardown, inputs, device, point_bytes(run["baseline"], device) if done else None)
        phases = record["phases"]
        run.setdefault("baseline", phases["before_load"])
        base = point_bytes(run["baseline"], device)
        instance_bytes = max(instance_bytes, point_bytes(phases["after_encode"], device)
                             - point_bytes(phases["before_load"], device))
        record["cycle"] = i + 1
        record["retained_bytes"] = point_bytes(phases["after_teardown"], device) - base
        record["retained_bytes_after_gc"] = point_bytes(phases["after_gc"], device) - base
        record["retained_tensor_bytes"] = phases["after_teardown"]["tensor_bytes"] - run["baseline"]["tensor_bytes"]
        done.append(record)
        log(f"  {variant.name}/{teardown} cycle {i + 1}/{cycles}: retained {mib(record['retained_bytes'])} MiB, "
            f"objects alive after del {record['alive_after_teardown_count']}, "
            f"{record['cycle_s']:.1f}s")
    first = done[0]["phases"]
    run["weights_bytes"] = point_bytes(first["after_load"], device) - point_bytes(first["before_load"], device)
    run["cache_bytes"] = point_bytes(first["after_encode"], device) - point_bytes(first["after_load"], device)
    for key in ("retained_bytes", "retained_bytes_after_gc", "retained_tensor_bytes"):  # the worst cycle
        run[key] = max(c[key] for c in done)
    run["retained_by_cycle"] = [c["retained_bytes"] for c in done]
    run["freed_by_refcount"] = all(not c["alive_after_teardown"] for c in done)
    run["freed_after_gc"] = all(not c["alive_after_gc"] for c in done)
    if teardown == "close":
        run["held_after_close_bytes"] = max(point_bytes(c["phases"]["after_close"], device)
                                            - point_bytes(c["phases"]["before_load"], device) for c in done)
        run["close_raises"] = all(c["close_raises"] for c in done)
    if variant.cache_clear is not None:
        variant.cache_clear()
        gc.collect()
        run["retained_after_cache_clear"] = point_bytes(measure(device), device) - point_bytes(run["baseline"], device)
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
