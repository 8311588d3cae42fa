"""The run file, ``run.json``: what an embed run's tensors depend on (model config and weights hashes, dtype,
pixel bounds, resize backend, video settings, pooling, world size, file format, engine, torch threads, the CPU
linear kernels chosen) and which run it is (``run_id``).

``describe_run`` writes it for an invocation, ``compare_runs`` refuses a ``--resume`` with other settings,
``pixel_bounds`` says which image bounds the run's images are sized with. Reading it back is
``reader.read_run``; its fields are listed in ``manifest``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ..checkpoint.hub import COMMIT_HASH
from ..errors import EmbedError
from ..version import package_version
from .manifest import RUN_COMPARED, RUN_FILE, RUN_FORMAT


def pixel_bounds(args: argparse.Namespace, pre) -> tuple[int, int]:
    """(min, max) pixels the run's images are sized with: each option, else the checkpoint's bound, exactly as
    ``encode_images(min_pixels=..., max_pixels=...)`` and transformers' processor combine them.

    A bound given alone keeps the checkpoint's other one even when they cross (``--max-pixels 50176`` on a
    Qwen3-VL checkpoint whose min is 65536 runs at 65536..50176): smart_resize checks the max first, so an image
    above it shrinks to at most the max, and a smaller one grows to at least the min, past the max
    (``crossed_bounds_note`` says so). Both given with min > max is refused when the options are parsed.
    """
    low = args.min_pixels if args.min_pixels is not None else pre.min_pixels
    high = args.max_pixels if args.max_pixels is not None else pre.max_pixels
    return low, high


def crossed_bounds_note(args: argparse.Namespace, pre) -> str | None:
    """One line telling that an option crosses the checkpoint's other pixel bound, and what that does (None: not
    crossed)."""
    low, high = pixel_bounds(args, pre)
    if low <= high:
        return None
    if args.max_pixels is not None:
        what, fix = f"the checkpoint's min_pixels {low} is above --max-pixels {high}", "--min-pixels to lower the floor"
    else:
        what, fix = f"--min-pixels {low} is above the checkpoint's max_pixels {high}", "--max-pixels to raise the cap"
    return (f"{what}: as in encode_images and transformers' processor, images over {high} pixels shrink below it "
            f"and smaller ones are upscaled to at least {low} (add {fix})")


def describe_run(encoder, args: argparse.Namespace, folder: str | None, world: int, threads: int,
                 columns: dict[str, str]) -> dict:
    """run.json for this invocation: what its tensors depend on, plus where they came from. ``threads`` is the
    torch thread count of every forward (the local process's, or each Ray actor's); ``columns``: the table columns
    the outputs carry, with their types."""
    pre = encoder.preprocess_config
    min_pixels, max_pixels = pixel_bounds(args, pre)
    revision = args.revision
    if folder and COMMIT_HASH.match(Path(folder).name):  # a Hub snapshot folder is named after its commit
        revision = Path(folder).name
    return {
        "format": RUN_FORMAT,
        "run_id": uuid.uuid4().hex,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "package_version": package_version(),
        "model": args.model,
        "model_folder": folder,
        "revision": revision,
        "random_weights": bool(args.random_weights),
        **encoder.identity(),  # family, config_sha256, weights_sha256, dtype
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "resize": args.resize or pre.resize,
        # The video settings as a video_preprocessor_config.json (fps, frame bounds, pixel bounds, budget).
        "video": encoder.video_config.to_dict(),
        "pooled": bool(args.pooled_only),
        "normalize": bool(args.normalize),
        "columns": [[name, kind] for name, kind in columns.items()],
        "world_size": world,
        "file_format": args.format,
        "engine": args.engine,
        "threads": threads,
        "compile": bool(args.compile),
        # The CPU backend's plan as loaded (None off the CPU, compiled or on the reference kernels): not compared,
        # reused by every resume, rank and actor of the run.
        "cpu_plan": None if encoder.cpu_plan is None else encoder.cpu_plan.to_dict(),
        "cwd": os.getcwd(),
    }


def compare_runs(recorded: dict, now: dict, out: Path, holder: str | None = None) -> None:
    """Raise EmbedError listing every compared field that differs (another file format alone: its own line,
    since one folder holds one format). ``holder``: who runs ``recorded`` when it is not yet in ``out`` (a fresh
    run's rank 0)."""
    was, asked = recorded["file_format"], now["file_format"]
    if was != asked and holder is None:
        engine = " (--engine ray writes parquet)" if now.get("engine") == "ray" else ""
        raise EmbedError(f"{out} holds a --format {was} run; --resume with --format {asked}{engine} would mix "
                         f"two formats in one folder: resume it with --format {was}, or choose another --out")
    differ = [key for key in RUN_COMPARED if recorded[key] != now[key]]
    if not differ:
        return

    def show(key: str, value: Any) -> str:
        return f"{value[:12]}..." if key.endswith("sha256") else json.dumps(value)

    fields = ", ".join(f"{key} {show(key, recorded[key])} (now {show(key, now[key])})" for key in differ)
    hint = " (another model, or other weights)" if any(k.endswith("sha256") for k in differ) else ""
    if holder is not None:
        raise EmbedError(f"{holder} runs {out} with other settings than this process, refusing to mix them: "
                         f"{fields}{hint}; give every process the same options, checkpoint, package version and "
                         f"kind of device")
    raise EmbedError(f"{out} holds a run with other settings, refusing to mix them: {fields}{hint}; "
                     f"resume with the run's settings (see {out / RUN_FILE}) or choose another --out")

