"""What an embed output folder holds and what its files must say: the file names, the run.json fields a
resume compares, the manifest records' schema, and the manifest's parse.

A folder holds ``run.json`` (what produced the tensors), ``manifest.jsonl`` (one JSON record a line per input,
``status`` "ok" with its shard, key, grid and token count, or "error" with why; a video's record also says which
frames were used), the shards ``shard-r{rank}-{n:06d}.safetensors`` and, while a multi-rank run is going, the
ranks' parts ``manifest.rank{rank}.jsonl``. A ``--format parquet`` folder holds ``run.json`` and the shards
``shard-r{rank}-{n:06d}.parquet`` only: each row is an input's record (``parquet``'s layout), so the shards are
the manifest. A ``--format vllm-cache`` folder holds run.json, the manifest and, instead of shards, one
``{id}/encoder_cache.safetensors`` per item (``vllm_cache``'s layout: an ok record's shard is its item's file).
A record's ``realpath`` is its input's identity, what ``--resume`` matches: a local file's real path with its size
and modification time (``inputs.file_identity``: a file replaced since is embedded again, its old record dropped),
a URL's with its version or ETag (``remote``), a shard member's the shard's real path and its name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import ManifestError

MANIFEST = "manifest.jsonl"
RUN_FILE = "run.json"
# What records' identities mean (``inputs.file_identity``): a resume of another format is refused, since it would
# embed its files again beside their records.
RUN_FORMAT = 2
# The run.json fields a resumed run must share with the run it continues: everything the stored tensors
# depend on. Not compared: the model's spelling (a moved folder is the same model: the hashes decide), the
# revision (likewise), the device and the batch size (on the CPU each item runs as its own forward: the same bits;
# on CUDA up to floating-point noise). file_format (safetensors / parquet / vllm-cache: one folder holds one),
# engine (local / ray), threads (torch threads of each forward: CPU results are bitwise equal only at the same
# count; a --resume takes the run's by default) and compile (other kernels, other bits) are compared too.
# The package version too: a release may change what a setting computes (how a video is read, a column's text).
RUN_COMPARED = ("format", "package_version", "config_sha256", "weights_sha256", "dtype", "min_pixels", "max_pixels",
                "resize", "video", "pooled", "normalize", "columns", "world_size", "file_format", "engine", "threads",
                "compile")
# Recorded, not compared: "cpu_plan", the CPU backend's measured kernel choices (cpu.plan; the bits differ by kernel
# at fp32 rounding level, and in bf16 where a plain MLP's activation moves into the GEMM's epilogue), reused by every
# later forward of the run; None for a run started off the CPU, until the first resume on a CPU records its own.
SHARD_NAME = re.compile(r"^shard-r(\d+)-(\d+)\.safetensors$")
# Shard metadata: the run that wrote a shard (or encoder-cache item), and its items' manifest records (a JSON list),
# from which a resume restores what a damaged manifest lost.
RUN_KEY = "qwenvl_vision_run"
RECORDS_KEY = "qwenvl_vision_records"
PARQUET_SHARD_NAME = re.compile(r"^shard-r(\d+)-(\d+)\.parquet$")


def parquet_shards(out: Path, rank: int | None = None) -> list[Path]:
    """The folder's Parquet shards (one rank's with ``rank``), by name: ranks in order, then batches."""
    found = {tuple(map(int, m.groups())): p for p in out.glob("shard-r*-*.parquet")
             if (m := PARQUET_SHARD_NAME.match(p.name)) and p.is_file()}
    return [found[number] for number in sorted(found) if rank in (None, number[0])]


def part_name(rank: int, world: int) -> str:
    """The manifest file a rank appends to: the manifest itself for one process, else the rank's part."""
    return MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl"


def read_manifest_lines(path: str | os.PathLike, strict: bool = True) -> list[dict]:
    """The records of a manifest file, in order. A last line without its newline is a torn write (a run killed
    mid-append) and is left out; any other line that is not JSON is a ManifestError naming it, or with ``strict``
    False skipped (a resume rolls its record forward from the shard that carries it)."""
    try:
        lines = Path(path).read_bytes().split(b"\n")[:-1]  # the piece after the last newline is empty or torn
    except FileNotFoundError:
        return []
    records = []
    for number, raw in enumerate(lines, 1):
        try:
            records += [json.loads(raw)] if raw.strip() else []
        except ValueError as e:  # not UTF-8, or not JSON
            if strict:
                raise ManifestError(f"{path}, line {number}: damaged manifest line ({e}); embed --resume on the "
                                    f"folder restores its record from its shard") from None
    return records


# The run.json fields this version reads: a run file without one is damaged.
RUN_FIELDS = ("format", "run_id", "created", "package_version", "model", "model_folder", "revision", "random_weights",
              "family", "config_sha256", "weights_sha256", "dtype", "min_pixels", "max_pixels", "resize", "video",
              "pooled", "normalize", "columns", "world_size", "file_format", "engine", "threads", "compile", "cpu_plan",
              "cwd")
