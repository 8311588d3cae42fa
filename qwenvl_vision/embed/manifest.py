"""What an embed output folder holds and what its files must say: the file names, the run.json fields a
resume compares, and the manifest records' schema, with a parse that tells each damaged line apart.

A folder holds ``run.json`` (what produced the tensors), ``manifest.jsonl`` (one JSON record a line per input,
``status`` "ok" with its shard, key, grid and token count, or "error" with why; a video's record also says which
frames were used), the shards ``shard-r{rank}-{n:06d}.safetensors`` and, while a multi-rank run is going, the
ranks' parts ``manifest.rank{rank}.jsonl``. A ``--format parquet`` folder holds ``run.json`` and the shards
``shard-r{rank}-{n:06d}.parquet`` only: each row is an input's record (``parquet``'s layout), so the shards are
the manifest. A ``--format vllm-cache`` folder holds run.json, the manifest and, instead of shards, one
``{id}/encoder_cache.safetensors`` per item (``vllm_cache``'s layout: an ok record's shard is its item's file).
A record's ``realpath`` is its input's identity, what ``--resume`` matches: a local file's real path with its size
and modification time (``file_identity``: a file replaced since is embedded again, and readers take a file's latest
record), a URL's with its version or ETag (``remote``), a shard member's the shard's real path and its name.
A last line without its newline is a torn write (a run killed mid-append) and is left out; any other line that
is not a valid record is damaged (a hand edit).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..devices import DTYPES
from ..inputs.pixels import is_url
from .inputs import real_key
from .tables import COLUMN_TYPES

MANIFEST = "manifest.jsonl"
RUN_FILE = "run.json"
# What records' identities mean (``file_identity``): a resume of another format is refused, since it would embed
# its files again beside their records.
RUN_FORMAT = 2
# The run.json fields a resumed run must share with the run it continues: everything the stored tensors
# depend on. Not compared: the model's spelling (a moved folder is the same model: the hashes decide), the
# revision (likewise), the package version, the device, compile (same tensors up to floating-point noise) and the
# batch size (on the CPU each item runs as its own forward: the same bits; on CUDA up to floating-point noise).
# file_format (safetensors / parquet / vllm-cache: one folder holds one), engine (local / ray) and threads (torch
# threads of each forward: CPU results are bitwise equal only at the same count; a --resume takes the run's by
# default) are compared too.
RUN_COMPARED = ("format", "config_sha256", "weights_sha256", "dtype", "min_pixels", "max_pixels", "resize",
                "video", "pooled", "normalize", "columns", "world_size", "file_format", "engine", "threads")
# Recorded, not compared: "cpu_plan", the CPU backend's measured kernel choices (cpu.plan; the bits differ by kernel
# at fp32 rounding level, and in bf16 where a plain MLP's activation moves into the GEMM's epilogue), reused by every
# later forward of the run; None for a run started off the CPU, until the first resume on a CPU records its own.
# Every field of ``RUN_FIELD_CHECKS`` is required: a run file without one is damaged.
SHARD_NAME = re.compile(r"^shard-r(\d+)-(\d+)\.safetensors$")
# A run id is part of file names and glob patterns (temporary files, shard metadata): a plain token only.
RUN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# Shard metadata: the run that wrote a shard (or encoder-cache item), and its items' manifest records (a JSON list),
# from which a resume restores what a damaged manifest lost.
RUN_KEY = "qwenvl_vision_run"
RECORDS_KEY = "qwenvl_vision_records"
TENSOR_KEY = re.compile(r"\d{1,12}")  # an item's tensor in a shard, as RankWriter names them
PARQUET_SHARD_NAME = re.compile(r"^shard-r(\d+)-(\d+)\.parquet$")


def part_name(rank: int, world: int) -> str:
    """The manifest file a rank appends to: the manifest itself for one process, else the rank's part."""
    return MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl"


def record_key(record: dict, base: str | None = None) -> str:
    """A manifest record's input identity: the real path recorded with it (written by every run since the
    field exists, so resuming from another working directory still matches), else its path resolved from
    `base`, the working directory of the run."""
    realpath = record.get("realpath")
    return realpath if isinstance(realpath, str) and realpath else real_key(record["path"], base)


# A local file's identity: its real path, and its size and modification time (what make and rsync go by: one stat,
# where a hash would read every input again on each resume); a shard member's is its shard's, then its name.
FILE_STATE = re.compile(r"#size=\d+,mtime_ns=-?\d+")  # a file dated before 1970: negative


def file_identity(realpath: str) -> str:
    """``realpath`` with what the file's bytes are now (``FILE_STATE``); a file that cannot be read keeps its bare
    path (its input fails, and a resume tries it again)."""
    try:
        stat = os.stat(realpath)
    except OSError:
        return realpath
    return f"{realpath}#size={stat.st_size},mtime_ns={stat.st_mtime_ns}"


def file_of(key: str) -> str | None:
    """What a local file's or shard member's identity names, without what the bytes were (``file_identity``), else
    None (a URL)."""
    named = FILE_STATE.sub("", key, count=1)
    return named if named != key else None


@dataclass
class ManifestLine:
    """One complete line of a manifest file: its record, or why it is damaged."""

    number: int  # 1-based line number in its file
    record: dict | None  # None: damaged
    problem: str = ""


def parse_manifest(path: Path) -> list[ManifestLine]:
    """Every complete line of a manifest, each either a valid record or damaged (with why).

    A last line without its newline is a torn write (the run was killed or stopped mid-append) and is
    left out; blank lines are skipped.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")[:-1]  # the piece after the last newline is empty or torn
    parsed = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            parsed.append(ManifestLine(number, None, f"not a JSON line ({e})"))
            continue
        problem = record_problem(record)
        parsed.append(ManifestLine(number, None if problem else record, problem))
    return parsed


def _count(value: Any, least: int) -> bool:
    """An integer of at least `least` (JSON's true is not one)."""
    return type(value) is int and value >= least


def record_problem(record: Any) -> str:
    """Why a manifest record (a line, or one a shard carries) cannot be used ('' when it can)."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    if not isinstance(record.get("path"), str) or not record["path"]:
        return "no 'path'"
    if "realpath" in record and not (isinstance(record["realpath"], str) and (
            os.path.isabs(record["realpath"]) or is_url(record["realpath"]))):
        return f"realpath {record['realpath']!r} is not an absolute path or a URL"
    if record.get("status") not in ("ok", "error"):
        return f"status {record.get('status')!r} is neither 'ok' nor 'error'"
    if not _count(record.get("rank", 0), 0):
        return f"rank {record.get('rank')!r} is not a non-negative integer"
    if record.get("error") is not None and not isinstance(record["error"], str):
        return f"error {record['error']!r} is not text"
    if "columns" in record and not isinstance(record["columns"], dict):
        return f"columns {json.dumps(record['columns'])[:80]} is not a JSON object"
    if record["status"] == "error":
        return ""
    # The encoder-cache layout is vllm_cache's; imported here so that reading another format's run loads no writer.
    from ..outputs.vllm_cache import CACHE_KEY, ITEM_FILE

    shard = record.get("shard")
    item = ITEM_FILE.fullmatch(shard) if isinstance(shard, str) else None
    if not isinstance(shard, str) or not (SHARD_NAME.match(shard) or item):
        return f"status ok but shard {shard!r} is not a shard file name of this folder" if shard is not None \
            else "status ok but no 'shard'"
    if not isinstance(record.get("key"), str) or not record["key"]:
        return "status ok but no 'key'"
    if not item and not TENSOR_KEY.fullmatch(record["key"]):
        return f"key {record['key']!r} is not a tensor name of a shard"
    if item and (record.get("id") != item.group(1) or record["key"] != CACHE_KEY):
        return f"encoder-cache item {shard!r} recorded with id {record.get('id')!r} and key {record['key']!r}"
    if item and not _count(record.get("levels"), 0):
        return f"encoder-cache item {shard!r} with levels {record.get('levels')!r}, not a count"
    grid = record.get("grid_thw")
    if not (isinstance(grid, list) and len(grid) == 3 and all(_count(g, 1) for g in grid)):
        return f"grid_thw {grid!r} is not three positive integers"
    if not _count(record.get("tokens"), 1):
        return f"tokens {record.get('tokens')!r} is not a positive integer"
    return _video_problem(record["video"]) if "video" in record else ""


def _video_problem(video: Any) -> str:
    """Why a record's ``video`` entry (frames used, timestamps, source fps) cannot be used ('' when it can)."""
    if not isinstance(video, dict):
        return "video is not a JSON object"
    frames, stamps, fps = video.get("frames"), video.get("timestamps"), video.get("fps")
    if not (isinstance(frames, list) and frames and all(_count(i, 0) for i in frames)):
        return f"video frames {frames!r} are not frame indices"
    if not (isinstance(stamps, list) and len(stamps) == len(frames)
            and all(isinstance(t, (int, float)) for t in stamps)):
        return "video timestamps are not one number per frame"
    if not (isinstance(fps, (int, float)) and fps > 0):
        return f"video fps {fps!r} is not a positive number"
    requested = video.get("requested_fps")
    if requested is not None and not (isinstance(requested, (int, float)) and requested > 0):
        return f"video requested_fps {requested!r} is not a positive number"
    return ""




def _text(value: Any) -> bool:
    return isinstance(value, str)


def _optional(check):
    return lambda value: value is None or check(value)


def _hex64(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


# Each run.json field this version reads: (check, what a valid value is). Every one is required (read_run refuses a
# file without it), and each must pass, so that nothing downstream meets a wrong type.
RUN_FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "format": (lambda v: _count(v, 1), "an integer of at least 1"),
    "run_id": (lambda v: isinstance(v, str) and RUN_ID.fullmatch(v) is not None,
               "1 to 64 letters, digits, '_' or '-'"),
    "created": (_text, "text"),
    "package_version": (_text, "text"),
    "model": (_text, "text"),
    "model_folder": (_optional(_text), "text or null"),
    "revision": (_optional(_text), "text or null"),
    "random_weights": (lambda v: type(v) is bool, "true or false"),
    "family": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-z_]{1,64}", v) is not None,
               "a model family's name"),
    "config_sha256": (_hex64, "64 lowercase hex digits"),
    "weights_sha256": (_hex64, "64 lowercase hex digits"),
    "dtype": (lambda v: v in DTYPES, ", ".join(DTYPES)),
    "min_pixels": (lambda v: _count(v, 1), "a positive integer"),
    "max_pixels": (lambda v: _count(v, 1), "a positive integer"),
    "resize": (lambda v: v in ("pil", "torch"), "pil or torch"),
    "video": (lambda v: isinstance(v, dict), "a JSON object"),
    "pooled": (lambda v: type(v) is bool, "true or false"),
    "normalize": (lambda v: type(v) is bool, "true or false"),
    "columns": (lambda v: isinstance(v, list) and all(
        isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and c[1] in COLUMN_TYPES for c in v),
        "a list of [name, type] pairs"),
    "world_size": (lambda v: _count(v, 1) and v <= 1 << 20, "a positive integer"),
    "file_format": (lambda v: v in ("safetensors", "parquet", "vllm-cache"), "safetensors, parquet or vllm-cache"),
    "engine": (lambda v: v in ("local", "ray"), "local or ray"),
    "threads": (lambda v: _count(v, 1) and v <= 1 << 16, "a positive integer"),
    "cpu_plan": (_optional(lambda v: isinstance(v, dict)), "a JSON object or null"),
    "cwd": (_optional(lambda v: isinstance(v, str) and os.path.isabs(v)), "an absolute path or null"),
}


RUN_FIELDS = tuple(RUN_FIELD_CHECKS)


def run_problem(run: dict) -> str:
    """Why a run record's fields cannot be used ('' when they can): the first field of the wrong type or range,
    named with its value and what it must be."""
    for name, (check, what) in RUN_FIELD_CHECKS.items():
        if name in run and not check(run[name]):
            return f"field {name!r} is {json.dumps(run[name])[:80]}, not {what}"
    return ""
