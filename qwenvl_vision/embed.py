"""``qwenvl-vision embed``: folders of images and videos -> safetensors shards + manifest.jsonl, resumable, multi-rank.

One writer per output folder: a run holds ``fcntl.flock`` on ``OUT/embed.lock`` (rank r > 0 of a torchrun job
on ``OUT/embed.rank{r}.lock``) from before it looks at the folder until it exits; the kernel drops the lock
when the process dies, so SIGKILL leaves no stale lock. Another process on the same folder, fresh or
``--resume``, gets no lock and stops at once. The lock file is removed on exit; taking a lock checks that the
file still is the one on disk, so that removal cannot let two processes in.

Run file: ``run.json`` records what the run's tensors depend on (model config and weights hashes, dtype,
pixel bounds, resize backend, video settings, pooling, world size) and identifies the run (``run_id``);
``--resume`` refuses other settings.
Every shard carries its run id in its metadata and temporary files carry it in their names: recovery deletes
only files of the run that holds the lock.

Durability: a batch's shard is written to a temporary file, fsynced and renamed into place *before* its
manifest lines are appended (one write, flushed and fsynced). A run killed at any instant, or stopped by an
I/O fault (disk full, read-only folder: exit code 3), therefore leaves (a) complete shards, (b) a manifest
whose complete lines all point at complete shards, and at worst (c) one shard nobody references and one
half-written last line. ``--resume`` drops (c), keeps every input recorded ok exactly once, retries the
rest, and never reuses a shard name. Damaged manifest lines (hand edits) are treated like a torn line: their
inputs are redone.

Inputs: files, folders (recursive, by image and video extension) and text files listing paths; deduplicated by
real path (the first spelling is the one recorded). A list that is not text is one failed input. A path with a
video extension (``video.VIDEO_EXTENSIONS``) is a video file: decoded with PyAV, sampled at the checkpoint's fps
(``--fps``), and its manifest record says which frames were used, the source fps and their timestamps.

Ranks: under ``torchrun`` (RANK / WORLD_SIZE set) inputs are split statically, rank r taking inputs
r, r+W, r+2W, ... (never padded with duplicates); each rank writes ``shard-r{rank}-*.safetensors`` and
``manifest.rank{rank}.jsonl``; the ranks agree (gloo) that every one of them got its lock and passed the
checks before anything is written, and after a barrier rank 0 merges the parts into ``manifest.jsonl``.

Exit codes: 0 every input embedded; 1 the run finished and some inputs failed (see the manifest); 2 usage or
setup error, nothing written; 3 the run stopped on an I/O fault writing the output, nothing recorded is lost
and ``--resume`` finishes it. Under torchrun a finished run exits 0 on every rank even when some inputs
failed (the summary line says how many): torchrun treats any other exit as a crash and kills the other ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from .attention import ATTN_IMPLS
from .devices import device_option, dtype_option
from .errors import (
    EmbedError,
    ManifestError,
    OutputFaultError,
    OutputInUseError,
    PeerFailedError,
    QwenVLVisionError,
    RunMismatchError,
    exit_code_of,
)
from .version import package_version
from .video import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
LIST_EXTENSIONS = {".txt", ".lst", ".list"}
MANIFEST = "manifest.jsonl"
RUN_FILE = "run.json"
RUN_FORMAT = 1
# The run.json fields a resumed run must share with the run it continues: everything the stored tensors
# depend on. Not compared: the model's spelling (a moved folder is the same model: the hashes decide), the
# revision (likewise), the package version, the device, batch size and compile (same tensors up to
# floating-point noise).
RUN_COMPARED = ("format", "config_sha256", "weights_sha256", "dtype", "min_pixels", "max_pixels", "resize",
                "video", "pooled", "world_size")
# What a compared field meant in run files written before it existed ("video": None, no videos were embedded,
# so any video settings continue such a run).
RUN_FIELD_DEFAULTS = {"resize": "pil", "video": None}
SHARD_NAME = re.compile(r"^shard-r(\d+)-(\d+)\.safetensors$")
# OSErrors at the start that are the output folder's state (exit 3, like a fault mid-run), not a usage error.
OUTPUT_FAULTS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


# ---------------------------------------------------------------------- errors


def _output_fault(e: OSError, out: Path, recorded: int | None = None) -> OutputFaultError:
    what = e.strerror or str(e)
    where = f" ({Path(e.filename).name})" if e.filename else ""
    done = f"; this process recorded {recorded} inputs before it" if recorded is not None else ""
    return OutputFaultError(f"cannot write to {out}: {what}{where}{done}; nothing recorded is lost: fix the "
                            f"output folder (free space, permissions) and run the same command with --resume")


# ---------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """Inputs in order, one per real file (first spelling kept); `errors` holds the ones already known bad."""

    paths: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # path -> real_key(path)
    _seen: set[str] = field(default_factory=set, repr=False)

    def add(self, path: str, error: str | None = None) -> None:
        key = real_key(path)
        if key in self._seen:  # the same file named twice (another spelling, a link) is embedded once
            return
        self._seen.add(key)
        self.paths.append(path)
        self.keys[path] = key
        if error is not None:
            self.errors[path] = error


def real_key(path: str, base: str | None = None) -> str:
    """The identity of an input: its resolved real path (relative paths taken from `base`, default the cwd)."""
    return os.path.realpath(os.path.join(base, path) if base else path)


def record_key(record: dict, base: str | None = None) -> str:
    """A manifest record's input identity: the real path recorded with it (written by every run since the
    field exists, so resuming from another working directory still matches), else its path resolved from
    `base`, the working directory of the run."""
    realpath = record.get("realpath")
    return realpath if isinstance(realpath, str) and realpath else real_key(record["path"], base)


def gather_inputs(inputs: list[str]) -> Inputs:
    """Image files as given, folders recursively by image extension (sorted), text files as path lists.

    A list file that cannot be read as text, or a folder that cannot be listed, is one failed input; a
    missing file is kept (recorded as an error later, not dropped).
    """
    found = Inputs()
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            try:
                files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in MEDIA_EXTENSIONS)
            except OSError as e:
                found.add(item, f"cannot list folder {item}: {e.strerror or e}")
                continue
            for f in files:
                found.add(str(f))
        elif p.suffix.lower() in LIST_EXTENSIONS and p.is_file():
            try:
                lines = _read_list(p)
            except (OSError, ValueError) as e:
                found.add(item, f"list file {item}: {e}")
                continue
            for line in lines:
                found.add(str(Path(line) if Path(line).is_absolute() else p.parent / line))
        else:
            found.add(str(p))
    return found


def _read_list(path: Path) -> list[str]:
    """Paths listed one per line ('#' comments, blank lines skipped), relative ones to the list's folder."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ValueError(f"not a text file (NUL byte at offset {data.index(bytes(1))})")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"not a UTF-8 text file (byte {e.start} is {data[e.start]:#04x})") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def shard_for_rank(paths: list[str], rank: int, world: int) -> list[str]:
    return paths[rank::world]


# ---------------------------------------------------------------------- manifest


def part_name(rank: int, world: int) -> str:
    return MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl"


@dataclass
class ManifestLine:
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
        problem = _record_problem(record)
        parsed.append(ManifestLine(number, None if problem else record, problem))
    return parsed


def _record_problem(record: Any) -> str:
    """Why a manifest record cannot be used ('' when it can)."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    if not isinstance(record.get("path"), str) or not record["path"]:
        return "no 'path'"
    if "realpath" in record and not (isinstance(record["realpath"], str) and os.path.isabs(record["realpath"])):
        return f"realpath {record['realpath']!r} is not an absolute path"
    if record.get("status") not in ("ok", "error"):
        return f"status {record.get('status')!r} is neither 'ok' nor 'error'"
    if not isinstance(record.get("rank", 0), int):
        return f"rank {record.get('rank')!r} is not an integer"
    if record["status"] == "error":
        return ""
    shard = record.get("shard")
    if not isinstance(shard, str) or not SHARD_NAME.match(shard):
        return f"status ok but shard {shard!r} is not a shard file name of this folder" if shard is not None \
            else "status ok but no 'shard'"
    if not isinstance(record.get("key"), str) or not record["key"]:
        return "status ok but no 'key'"
    grid = record.get("grid_thw")
    if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and g > 0 for g in grid)):
        return f"grid_thw {grid!r} is not three positive integers"
    if not isinstance(record.get("tokens"), int) or record["tokens"] < 1:
        return f"tokens {record.get('tokens')!r} is not a positive integer"
    return _video_problem(record["video"]) if "video" in record else ""


def _video_problem(video: Any) -> str:
    """Why a record's ``video`` entry (frames used, timestamps, source fps) cannot be used ('' when it can)."""
    if not isinstance(video, dict):
        return "video is not a JSON object"
    frames, stamps, fps = video.get("frames"), video.get("timestamps"), video.get("fps")
    if not (isinstance(frames, list) and frames and all(isinstance(i, int) and i >= 0 for i in frames)):
        return f"video frames {frames!r} are not frame indices"
    if not (isinstance(stamps, list) and len(stamps) == len(frames)
            and all(isinstance(t, (int, float)) for t in stamps)):
        return "video timestamps are not one number per frame"
    if not (isinstance(fps, (int, float)) and fps > 0):
        return f"video fps {fps!r} is not a positive number"
    return ""


def read_manifest_lines(path: str | os.PathLike) -> list[dict]:
    """The records of a manifest, in order; a torn last line (a run killed mid-write) is left out.

    Raises ManifestError naming the file and line for any other damaged line (``--resume`` redoes its input).
    """
    path = Path(path)
    records = []
    for line in parse_manifest(path):
        if line.record is None:
            raise ManifestError(f"{path}, line {line.number}: damaged manifest line: {line.problem} "
                                f"(embed --resume on the folder redoes its input)")
        records.append(line.record)
    return records


def _fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (its entries are data too)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str, tag: str) -> None:
    """Write `path` whole or not at all; the temporary file's name carries `tag` (the run id)."""
    tmp = path.with_name(f"{path.name}.{tag}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _append_lines(path: Path, records: list[dict]) -> None:
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records)
    with open(path, "a") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_shard(tensors: dict[str, torch.Tensor], tmp: Path, run_id: str) -> None:
    """Serialise in memory, then write with Python's file I/O: a full disk or a read-only folder is an
    OSError with its errno (safetensors' save_file reports them as its own error type), and the file gets
    the permissions the umask allows (save_file creates 0600 files)."""
    data = save(tensors, metadata={"format": "pt", "qwenvl_vision_run": run_id})
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _shard_run_id(path: Path) -> str | None:
    """The run id a shard was written by (None: unreadable header, or not written by embed)."""
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get("qwenvl_vision_run")
    except Exception:  # noqa: BLE001 - safetensors raises its own error type for a bad header
        return None


class RankWriter:
    """Writes one rank's shards and manifest part; on resume, recovers what a stopped run left."""

    def __init__(self, out: Path, rank: int, world: int, run_id: str, run_cwd: str | None = None) -> None:
        self.out, self.rank, self.world, self.run_id = out, rank, world, run_id
        self.run_cwd = run_cwd or os.getcwd()
        self.manifest = out / part_name(rank, world)
        self.own: dict[str, dict] = {}  # real key -> this rank's ok record
        self.done: set[str] = set()  # real keys recorded ok by any rank
        self.next_shard = 0
        self.recorded = 0  # inputs recorded (ok or error) by this process
        self.failed = 0  # of which failed

    def _own_shards(self) -> list[Path]:
        return sorted(p for p in self.out.glob(f"shard-r{self.rank}-*.safetensors") if SHARD_NAME.match(p.name))

    def _records(self, path: Path) -> list[dict]:
        """Usable records of one manifest file; damaged lines are dropped like a torn line."""
        return [line.record for line in parse_manifest(path) if line.record is not None]

    def recover(self) -> None:
        """Resume: keep this rank's ok records whose shard exists, once each; delete this run's orphans."""
        mine = self._records(self.manifest)
        if self.world > 1 and not mine:  # resuming a finished multi-rank run: the parts were merged
            mine = [r for r in self._records(self.out / MANIFEST) if r.get("rank", 0) == self.rank]
        for r in mine:
            if r["status"] == "ok" and r.get("rank", 0) == self.rank and (self.out / r["shard"]).is_file():
                self.own.setdefault(record_key(r, self.run_cwd), r)
        self.done = set(self.own) | self._done_by_other_ranks()
        referenced = {r["shard"] for r in self.own.values()}
        for shard in self._own_shards():  # renamed but never recorded: the run stopped between rename and append
            if shard.name not in referenced and _shard_run_id(shard) == self.run_id:
                shard.unlink()
        # Temporary files of this run left by a kill: this rank's shards and manifest part, and (rank 0) the
        # merged manifest and run.json being rewritten.
        names = [f"shard-r{self.rank}-*.{self.run_id}.tmp", f"{self.manifest.name}.{self.run_id}.tmp"]
        if self.rank == 0:
            names += [f"{MANIFEST}.{self.run_id}.tmp", f"{RUN_FILE}.{self.run_id}.tmp"]
        for pattern in names:
            for tmp in self.out.glob(pattern):
                tmp.unlink()
        numbers = [int(SHARD_NAME.match(s.name).group(2)) for s in self._own_shards()]
        self.next_shard = max(numbers, default=-1) + 1
        # Rewrite the part with each ok input once; errors and damaged lines are dropped so they are redone.
        _atomic_write_text(self.manifest, "".join(json.dumps(r) + "\n" for r in self.own.values()), self.run_id)

    def _done_by_other_ranks(self) -> set[str]:
        """Inputs other ranks recorded ok: not redone here even if the input list (and so the split) changed."""
        if self.world == 1:
            return set()
        files = [self.out / MANIFEST] + [self.out / part_name(r, self.world) for r in range(self.world)]
        return {record_key(r, self.run_cwd) for f in files if f != self.manifest for r in self._records(f)
                if r["status"] == "ok" and r.get("rank", 0) != self.rank and (self.out / r["shard"]).is_file()}

    def write_batch(self, results, pooled_only: bool) -> tuple[int, int]:
        """One shard for the batch's successes (renamed into place), then its manifest lines."""
        tensors: dict[str, torch.Tensor] = {}
        records = []
        shard_name = f"shard-r{self.rank}-{self.next_shard:06d}.safetensors"
        ok = failed = 0
        for r in results:
            record = {"path": r.path, "realpath": real_key(r.path), "status": "ok" if r.ok else "error",
                      "error": r.error, "rank": self.rank}
            if r.video_info is not None:
                info = r.video_info
                record["video"] = {"frames": info.frame_indices, "timestamps": info.timestamps,
                                   "fps": info.video_fps, "sampled_fps": info.sampled_fps,
                                   "total_frames": info.total_frames}
            if r.ok:
                key = f"{ok:06d}"
                if pooled_only:
                    tensors[key] = r.pooled.float().contiguous().cpu()
                else:
                    tensors[key] = r.embedding.contiguous().cpu()
                    for level, t in enumerate(r.deepstack or []):
                        tensors[f"{key}.deepstack.{level}"] = t.contiguous().cpu()
                record.update(shard=shard_name, key=key, grid_thw=list(r.grid_thw),
                              tokens=int(r.embedding.shape[0]))
                ok += 1
            else:
                failed += 1
            records.append(record)
        if tensors:
            tmp = self.out / f"{shard_name[: -len('.safetensors')]}.{self.run_id}.tmp"
            try:
                _save_shard(tensors, tmp, self.run_id)
                os.replace(tmp, self.out / shard_name)
            except OSError:
                tmp.unlink(missing_ok=True)  # frees the space on a full disk; recovery would remove it too
                raise
            _fsync_dir(self.out)
            self.next_shard += 1
        _append_lines(self.manifest, records)
        self.recorded += len(records)
        self.failed += failed
        return ok, failed


def merge_parts(out: Path, world: int, run_id: str) -> Path:
    """Rank 0, after all ranks finished: parts -> one manifest.jsonl (atomic), parts removed."""
    records = []
    for rank in range(world):
        records.extend(line.record for line in parse_manifest(out / part_name(rank, world)) if line.record)
    _atomic_write_text(out / MANIFEST, "".join(json.dumps(r) + "\n" for r in records), run_id)
    for rank in range(world):
        (out / part_name(rank, world)).unlink(missing_ok=True)
    return out / MANIFEST


# ---------------------------------------------------------------------- reading a run back


def read_run(out: str | os.PathLike) -> dict:
    """The run file (``DIR/run.json``) of an embed output: what produced its tensors.

    Keys: format, run_id, created, package_version, model (as given), model_folder, revision (a Hub
    commit, or null), random_weights, family, config_sha256 (vision + preprocessing config), weights_sha256
    (the vision tensors as loaded), dtype, min_pixels, max_pixels, resize ("pil" or "torch"; "pil" in files
    written before it was recorded), pooled, world_size, cwd (where the run
    started; each manifest record's ``path`` is as given to the invocation that recorded it, and its
    ``realpath`` the resolved file). Raises ManifestError if it is missing or damaged.
    """
    path = Path(out) / RUN_FILE
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist: not an embed output (or one written before run files)") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is damaged: {e}") from None
    if not isinstance(run, dict) or not isinstance(run.get("format"), int):
        raise ManifestError(f"{path} is damaged: no format version")
    if run["format"] > RUN_FORMAT:
        raise ManifestError(f"{path} has format {run['format']}; this qwenvl-vision reads format {RUN_FORMAT} "
                            f"(upgrade it)")
    missing = [key for key in RUN_COMPARED + ("run_id",) if key not in run and key not in RUN_FIELD_DEFAULTS]
    if missing:
        raise ManifestError(f"{path} is damaged: no {', '.join(missing)}")
    return {**RUN_FIELD_DEFAULTS, **run}


def read_embeddings(out: str | os.PathLike, *, deepstack: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every input recorded ok in DIR/manifest.jsonl, in manifest order.

    With deepstack=True yields (path, (embedding, [levels...])) for Qwen3-VL runs. What produced the tensors
    (model, dtype, pixel bounds, pooling): ``read_run(DIR)``. A damaged manifest line, a missing shard or
    key raises ManifestError naming the line.
    """
    out = Path(out)
    manifest = out / MANIFEST
    if not manifest.exists() and any(out.glob("manifest.rank*.jsonl")):
        raise ManifestError(f"{out} holds the ranks' manifest parts but no {MANIFEST}: the run stopped before "
                            f"merging them; embed --resume on the folder finishes and merges it")
    lines = parse_manifest(manifest)
    open_shard, handle = None, None
    try:
        for line in lines:
            r = line.record
            if r is None:
                raise ManifestError(f"{manifest}, line {line.number}: damaged manifest line: {line.problem} "
                                    f"(embed --resume on the folder redoes its input)")
            if r["status"] != "ok":
                continue
            if r["shard"] != open_shard:
                if handle is not None:
                    handle.__exit__(None, None, None)
                    handle = None
                handle = _open_shard(out, r["shard"], manifest, line.number)
                open_shard = r["shard"]
            if r["key"] not in handle.keys():
                raise ManifestError(f"{manifest}, line {line.number}: {r['shard']} has no tensor {r['key']!r}")
            tensor = handle.get_tensor(r["key"])
            if deepstack:
                names = sorted(k for k in handle.keys() if k.startswith(r["key"] + ".deepstack."))
                yield r["path"], (tensor, [handle.get_tensor(k) for k in names])
            else:
                yield r["path"], tensor
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def _open_shard(out: Path, name: str, manifest: Path, number: int):
    path = out / name
    if not path.is_file():
        raise ManifestError(f"{manifest}, line {number}: shard {name} does not exist")
    try:
        handle = safe_open(path, framework="pt")
        handle.__enter__()
    except Exception as e:  # noqa: BLE001 - safetensors' own error type for a damaged file
        raise ManifestError(f"{manifest}, line {number}: shard {name} is unreadable ({e})") from None
    return handle


# ---------------------------------------------------------------------- locking


def lock_name(rank: int, world: int) -> str:
    return "embed.lock" if rank == 0 else f"embed.rank{rank}.lock"


class FolderLock:
    """An exclusive ``fcntl.flock`` on a lock file; the kernel releases it when the process dies.

    ``release`` removes the file while still holding the lock. A process that opened the file just before
    and takes the lock just after would hold a lock on a removed file, so ``acquire`` checks that the file
    it locked still is the one at the path, and starts again if not.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                os.close(fd)
                raise OutputInUseError(f"{self.what} is in use by another embed run"
                                       f"{f' ({holder})' if holder else ''}; wait for it to finish, "
                                       f"or choose another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        try:  # who holds it, for the message another process prints; best effort (the disk may be full)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:  # read-only by now: the stale file is harmless, the lock goes with the descriptor
            pass
        os.close(self.fd)
        self.fd = None


def _make_dirs(out: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, deepest last (removed again if setup fails)."""
    missing = []
    folder = out.absolute()
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    out.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _holds_run(out: Path) -> bool:
    return (out / RUN_FILE).exists() or (out / MANIFEST).exists() or any(out.glob("manifest.rank*.jsonl")) \
        or any(out.glob("shard-r*.safetensors"))


# ---------------------------------------------------------------------- run file


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _weights_sha256(model: torch.nn.Module) -> str:
    """A hash of the vision tensors as loaded (names, dtypes, shapes, bytes).

    Stronger than hashing the checkpoint's index: a fine-tune keeps its base model's tensor names and
    index. ~1 s per GB.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}:{data.dtype}:{tuple(tensor.shape)}\n".encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def pixel_bounds(args: argparse.Namespace, pre) -> tuple[int, int]:
    """(min, max) pixels of the run: the options, else the checkpoint's.

    A bound given alone wins over the checkpoint's other one (``--max-pixels 4096`` on a checkpoint whose
    min is 65536 runs at 4096..4096): smart_resize with min > max would upscale small images past the max.
    Both given with min > max is refused when the options are parsed.
    """
    low = args.min_pixels if args.min_pixels is not None else pre.min_pixels
    high = args.max_pixels if args.max_pixels is not None else pre.max_pixels
    if low > high:
        low, high = (low, low) if args.min_pixels is not None else (high, high)
    return low, high


def describe_run(encoder, args: argparse.Namespace, folder: str | None, world: int) -> dict:
    """run.json for this invocation: what its tensors depend on, plus where they came from."""
    from .hub import COMMIT_HASH

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
        "family": encoder.family,
        "config_sha256": _sha256_json({"vision": encoder.config.to_vision_dict(), "preprocess": pre.to_dict()}),
        "weights_sha256": _weights_sha256(encoder.model),
        "dtype": str(encoder.dtype).removeprefix("torch."),
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "resize": args.resize or pre.resize,
        # The video settings as a video_preprocessor_config.json (fps, frame bounds, pixel bounds, budget).
        "video": encoder.video_config.to_dict(),
        "pooled": bool(args.pooled_only),
        "world_size": world,
        "cwd": os.getcwd(),
    }


def compare_runs(recorded: dict, now: dict, out: Path) -> None:
    """Raise RunMismatchError listing every compared field that differs."""
    differ = [key for key in RUN_COMPARED if recorded.get(key) != now.get(key)
              and not (key in RUN_FIELD_DEFAULTS and recorded.get(key) is None)]
    if not differ:
        return

    def show(key: str, value: Any) -> str:
        return f"{value[:12]}..." if key.endswith("sha256") and isinstance(value, str) else json.dumps(value)

    fields = ", ".join(f"{key} {show(key, recorded.get(key))} (now {show(key, now.get(key))})" for key in differ)
    hint = " (another model, or other weights)" if any(k.endswith("sha256") for k in differ) else ""
    raise RunMismatchError(f"{out} holds a run with other settings, refusing to mix them: {fields}{hint}; "
                           f"resume with the run's settings (see {out / RUN_FILE}) or choose another --out")


# ---------------------------------------------------------------------- ranks


class _Group:
    """The torchrun process group (gloo), or nothing for a single process."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        if world > 1:
            import torch.distributed as dist

            # A rank that finishes its part early waits for the slowest at the barrier: gloo's default 30 min
            # timeout is too short for hours-long jobs. A rank that dies closes its sockets, which the others
            # notice at once, so the long timeout does not make them hang.
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed; a failing rank raises its own error, the others stop quietly."""
        code = 0 if error is None else exit_code_of(error)
        if self.world > 1:
            import torch.distributed as dist

            flag = torch.tensor([code])
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except RuntimeError as e:  # a rank died (torch.distributed reports it as a RuntimeError)
                raise OutputFaultError(f"rank {self.rank}: another rank stopped ({e})") from None
            if error is None and flag.item():
                raise PeerFailedError(int(flag.item()))
        if error is not None:
            raise error

    def barrier(self) -> None:
        self.agree(None)

    def share(self, value: Any) -> Any:
        """Rank 0's value, on every rank (a fresh run's run.json: one run id for every rank's shards)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


# ---------------------------------------------------------------------- the job


class _PathResult:
    """An ItemResult with the input's path attached (the manifest's key)."""

    def __init__(self, item, path: str) -> None:
        self.path = path
        self.ok = item.ok
        self.error = item.error
        self.embedding = item.embedding
        self.grid_thw = item.grid_thw
        self.deepstack = item.deepstack
        self.pooled = item.pooled
        self.video_info = item.video_info


class _Failed:
    """An input known bad before encoding (an unreadable list file), shaped like a failed _PathResult."""

    ok = False
    video_info = None

    def __init__(self, path: str, error: str) -> None:
        self.path, self.error = path, error


PROGRESS_EVERY_S = 5.0  # without a terminal: one progress line at most this often


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Progress:
    """What a long run shows on stderr: a tqdm bar on a terminal; elsewhere (a log file, a job scheduler) a
    line at most every PROGRESS_EVERY_S seconds with done/total, images/s, tokens/s and ETA, and one when the
    run ends; nothing with --quiet. ``note`` prints a one-off line (loading, ...) unless quiet.

    An image counts as done once it is decoded and resized (or has failed), so the count moves image by image
    even when a whole small job is one forward; the batch it joins is written at most one batch (and the
    prefetch depth) later."""

    def __init__(self, rank: int, quiet: bool, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.label = f"embed[rank {rank}]" if rank else "embed"
        self.terminal = not quiet and self.stream.isatty()
        self.bar = None
        self.total = self.done = self.tokens = 0
        self.start = self.last_line = 0.0

    def note(self, message: str) -> None:
        if not self.quiet:
            print(f"{self.label}: {message}", file=self.stream, flush=True)

    def begin(self, total: int) -> None:
        self.total, self.start = total, time.perf_counter()
        self.last_line = self.start
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", desc=self.label, dynamic_ncols=True, file=self.stream)
        else:
            self.note(f"{total} image{'s' if total != 1 else ''} to embed")

    def update(self, images: int, tokens: int) -> None:
        """`images` more done, giving `tokens` embedding rows."""
        self.done += images
        self.tokens += tokens
        now = time.perf_counter()
        if self.bar is not None:
            elapsed = max(now - self.start, 1e-9)
            self.bar.update(images)
            self.bar.set_postfix(img_s=f"{self.done / elapsed:.1f}", tok_s=f"{self.tokens / elapsed:.0f}")
        elif now - self.last_line >= PROGRESS_EVERY_S and self.done < self.total:  # close() prints the last
            self._line(now)

    def _line(self, now: float) -> None:
        self.last_line = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        self.note(f"{self.done}/{self.total} images ({100 * self.done / max(self.total, 1):.0f}%), "
                  f"{rate:.1f} img/s, {self.tokens / elapsed:.0f} tok/s, ETA {eta}")

    def close(self) -> None:
        """The run's work is written: close the bar, or print the last line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.total:
            self._line(time.perf_counter())


def _pick_device(args: argparse.Namespace, rank: int, world: int) -> str | None:
    device = args.device
    if device is None and torch.cuda.is_available():
        device = "cuda"
    if device and device.startswith("cuda") and world > 1:  # one GPU per local rank
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % max(torch.cuda.device_count(), 1)}"
    return device


def _load(args: argparse.Namespace, device: str | None, progress: Progress):
    """The encoder, and the checkpoint folder it came from (None for random weights); says what it does."""
    from .attention import resolve_attn_impl
    from .devices import resolve_device, resolve_dtype
    from .encoder import load_encoder
    from .hub import looks_like_repo_id, resolve_folder

    where = str(resolve_device(device))
    resolve_attn_impl(args.attn, where, resolve_dtype(args.dtype, torch.device(where)))  # before any fetch or read
    start = time.perf_counter()
    if args.random_weights:
        progress.note(f"building {args.model} with random weights on {where}")
        encoder = load_encoder(args.model, device=device, dtype=args.dtype, random_weights=True,
                               compile=args.compile, attn_impl=args.attn)
        folder = None
    else:
        if looks_like_repo_id(args.model):
            progress.note(f"fetching config, index and vision shards of {args.model} from the Hugging Face Hub "
                          f"(or its local cache)")
        resolved = resolve_folder(args.model, args.revision, args.local_files_only, None, None)
        shards, size = _vision_shards(resolved)
        progress.note(f"reading {shards} shard{'s' if shards != 1 else ''} with the vision tensors "
                      f"({_size(size)}) from {resolved} onto {where}")
        encoder = load_encoder(resolved, device=device, dtype=args.dtype, compile=args.compile, attn_impl=args.attn)
        folder = str(resolved.absolute())
    progress.note(f"loaded the {encoder.family} tower ({str(encoder.dtype).removeprefix('torch.')}) in "
                  f"{time.perf_counter() - start:.1f} s")
    return encoder, folder


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _vision_shards(folder: Path) -> tuple[int, int]:
    """(files holding vision tensors, their vision bytes), from the headers only."""
    from .weights import open_checkpoint, read_header

    checkpoint = open_checkpoint(folder)
    headers = {path: read_header(path)[0] for path in checkpoint.shard_files}
    size = 0
    for source in checkpoint.tensors.values():
        begin, end = headers[source.file][source.name]["data_offsets"]
        size += end - begin
    return len({source.file for source in checkpoint.tensors.values()}), size


def _let_pil_return_memory() -> None:
    """Make Pillow allocate images in 64 MiB blocks instead of 16 MiB.

    glibc serves allocations under 32 MiB from per-thread arenas and keeps what they freed: after decoding
    large images on 4 worker threads, each thread's arena held its own peak (4.2 GB RSS for six 89 MP
    images). Blocks above 32 MiB are mmapped and go back to the system when freed. Only if the user did
    not choose a size (PILLOW_BLOCK_SIZE).
    """
    import PIL.Image

    if "PILLOW_BLOCK_SIZE" not in os.environ:
        PIL.Image.core.set_block_size(64 << 20)


class EmbedJob:
    """One process's part of an embed run: setup (nothing written), then write, then merge."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.out = Path(args.out)
        self.lock: FolderLock | None = None
        self.created: list[Path] = []
        self.encoder = None
        self.run: dict | None = None
        self.fresh = True
        self.filled: list[str] = []  # run.json fields an older run file lacked, filled in on resume
        self.inputs = Inputs()
        self.progress = Progress(rank, args.quiet)

    # -- setup: every check before the first write; on failure the folder is left as it was

    def setup(self) -> None:
        args, out = self.args, self.out
        what = str(out) if self.rank == 0 else f"part {self.rank} of {out}"
        try:
            self.created = _make_dirs(out)
            self.lock = FolderLock(out / lock_name(self.rank, self.world), what)
            self.lock.acquire()
        except OSError as e:
            if e.errno in OUTPUT_FAULTS:  # nothing written; the same command runs once the folder is fixed
                raise _output_fault(e, out) from e
            raise
        recorded = None
        if (out / RUN_FILE).exists():
            recorded = read_run(out)
        if _holds_run(out):
            if not args.resume:
                raise EmbedError(f"{out} already holds a run; add --resume to continue it, or choose another --out")
            if recorded is None:
                raise EmbedError(f"{out} holds a run without {RUN_FILE} (an older qwenvl-vision), so its settings "
                                 f"cannot be checked; finish it with that version, or choose another --out")
        self.inputs = gather_inputs(args.inputs)
        if not self.inputs.paths:
            raise EmbedError(f"no inputs: {', '.join(args.inputs)} hold no image or video files (by extension: "
                             f"{' '.join(sorted(MEDIA_EXTENSIONS))}) and list no paths")
        self.encoder, folder = _load(args, _pick_device(args, self.rank, self.world), self.progress)
        if args.fps is not None:
            self.encoder.video_config = dataclasses.replace(self.encoder.video_config, fps=args.fps)
        now = describe_run(self.encoder, args, folder, self.world)
        if recorded is not None:
            compare_runs(recorded, now, out)
            self.run, self.fresh = recorded, False
            # A run file from before a field existed: it now records this invocation's value, so that later
            # resumes are held to it (an old run that goes on to embed videos keeps one video setting).
            self.filled = [key for key in RUN_FIELD_DEFAULTS if recorded.get(key) is None]
            self.run.update({key: now[key] for key in self.filled})
        else:
            self.run = now

    def undo_setup(self) -> None:
        """Nothing was written: remove the lock file and the folders setup created."""
        if self.encoder is not None:
            self.encoder.close()
        self.release()
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                break

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- the run

    def start_writing(self) -> RankWriter:
        if (self.fresh or self.filled) and self.rank == 0:
            _atomic_write_text(self.out / RUN_FILE, json.dumps(self.run, indent=2) + "\n", self.run["run_id"])
        writer = RankWriter(self.out, self.rank, self.world, self.run["run_id"], self.run.get("cwd"))
        if not self.fresh:
            writer.recover()
        return writer

    def encode(self, writer: RankWriter) -> None:
        args = self.args
        mine = shard_for_rank(self.inputs.paths, self.rank, self.world)
        todo = [p for p in mine if self.inputs.keys[p] not in writer.done]
        known_bad = [_Failed(p, self.inputs.errors[p]) for p in todo if p in self.inputs.errors]
        todo = [p for p in todo if p not in self.inputs.errors]
        progress = self.progress
        progress.begin(len(todo) + len(known_bad))
        with self.encoder:
            if known_bad:
                writer.write_batch(known_bad, args.pooled_only)
                progress.update(len(known_bad), 0)
            batches = self.encoder.iter_encode(
                todo, video=None, min_pixels=self.run["min_pixels"], max_pixels=self.run["max_pixels"],
                max_batch_tokens=args.batch_tokens, resize=self.run["resize"],
                pooled=args.pooled_only, max_input_pixels=args.max_input_pixels,
                decode_bytes=args.decode_mib << 20,
                on_prepared=lambda index, tokens: progress.update(1, tokens))
            for batch in batches:
                writer.write_batch([_PathResult(r, todo[r.index]) for r in batch], args.pooled_only)
        progress.close()

    def summary(self) -> tuple[int, int]:
        """(ok, failed) over this run's inputs, each counted once, from the merged manifest (rank 0)."""
        status: dict[str, str] = {}
        for r in read_manifest_lines(self.out / MANIFEST):
            status.setdefault(record_key(r, self.run.get("cwd")), r["status"])
        keys = [self.inputs.keys[p] for p in self.inputs.paths]
        ok = sum(1 for k in keys if status.get(k) == "ok")
        return ok, len(keys) - ok


def run_embed(args: argparse.Namespace) -> int:
    rank, world = rank_and_world()
    _let_pil_return_memory()
    if args.max_input_pixels:  # our own header check replaces PIL's bomb limit (and its warning)
        import PIL.Image

        PIL.Image.MAX_IMAGE_PIXELS = max(PIL.Image.MAX_IMAGE_PIXELS or 0, args.max_input_pixels)
    group = _Group(rank, world)
    job = EmbedJob(args, rank, world)
    try:
        error = None
        try:
            job.setup()
        except (QwenVLVisionError, OSError) as e:
            error = e
        try:
            group.agree(error)  # every rank holds its lock and passed the checks; nothing written yet
            job.run = group.share(job.run)  # rank 0's run id tags every rank's shards
        except BaseException:
            job.undo_setup()
            raise
        # From here on the output is written; an OSError stops the run with exit code 3.
        writer = None
        try:
            writer = job.start_writing()
        except OSError as e:
            error = _output_fault(e, job.out)
        group.agree(error)  # run.json is on disk (and parts recovered) before any rank adds a shard
        try:
            job.encode(writer)
        except OSError as e:
            error = _output_fault(e, job.out, writer.recorded)
        group.agree(error)  # every rank finished writing its part
        if rank == 0 and world > 1:
            try:
                merge_parts(job.out, world, job.run["run_id"])
            except OSError as e:
                error = _output_fault(e, job.out)
        group.agree(error)  # the merged manifest is complete
        failed = 0
        if rank == 0:
            ok, failed = job.summary()
            print(f"embedded {ok} of {ok + failed} inputs into {job.out} ({failed} failed; see "
                  f"{job.out / MANIFEST})", file=sys.stderr)
        if world > 1:
            # A finished run exits 0 on every rank, failed inputs or not: torchrun reports any other exit as a
            # crash and stops the other ranks. The summary line and the manifest tell the failures.
            return 0
        return 1 if failed else 0
    finally:
        if job.encoder is not None:
            job.encoder.close()
        job.release()
        group.close()


# ---------------------------------------------------------------------- command line


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text}")
        return value

    return parse


def validate_embed_args(args: argparse.Namespace) -> None:
    """Checks across options, right after parsing (argparse checks each option alone)."""
    from .errors import ConfigError

    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise ConfigError(f"--min-pixels {args.min_pixels} is above --max-pixels {args.max_pixels}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if args.random_weights and args.revision:
        raise ConfigError("--revision means a Hub checkpoint; --random-weights takes a preset")
    from .config import PRESETS

    if args.model.lower() in PRESETS and not args.random_weights and not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model} is a preset (no weights): add --random-weights for random weights "
                          f"at its size, or give a checkpoint folder or repo id")


def add_embed_parser(sub, parents=()) -> None:
    from .preprocess import DEFAULT_MAX_INPUT_PIXELS, RESIZE_BACKENDS

    p = sub.add_parser("embed", help="embed images into safetensors shards with a manifest", parents=list(parents))
    p.add_argument("inputs", nargs="+", help="image files, folders (recursive), or .txt files listing paths")
    p.add_argument("--model", required=True, help="checkpoint folder, vision-only folder, repo id, or preset")
    p.add_argument("--out", required=True, help="output folder for shards, manifest.jsonl and run.json")
    p.add_argument("--revision", help="Hub branch, tag or commit of --model (default: main)")
    p.add_argument("--local-files-only", action="store_true",
                   help="take a repo id --model from the Hugging Face cache only, never the network (as "
                        "HF_HUB_OFFLINE=1)")
    p.add_argument("--device", type=device_option,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu; under torchrun each rank "
                        "takes cuda:LOCAL_RANK)")
    p.add_argument("--dtype", type=dtype_option,
                   help="fp32/float32, bf16/bfloat16, fp16/float16/half (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--min-pixels", type=_positive_int("--min-pixels"),
                   help="smallest image area after resizing (default: the checkpoint's, e.g. 3136 for "
                        "Qwen2.5-VL, 65536 for Qwen3-VL)")
    p.add_argument("--max-pixels", type=_positive_int("--max-pixels"),
                   help="largest image area after resizing (default: the checkpoint's, e.g. 12845056 for "
                        "Qwen2.5-VL, 16777216 for Qwen3-VL)")
    p.add_argument("--resize", choices=RESIZE_BACKENDS,
                   help="whose resize the pixels match: pil = transformers' PIL image processor (transformers "
                        "without torchvision), torch = its torchvision processor (with torchvision; vLLM); default: "
                        "what the checkpoint's preprocessor_config.json names (...Fast: torch)")
    p.add_argument("--fps", type=_positive_float("--fps"),
                   help="frames per second sampled from video files (default: the checkpoint's "
                        "video_preprocessor_config.json, else 2)")
    p.add_argument("--max-input-pixels", type=_positive_int("--max-input-pixels"), default=DEFAULT_MAX_INPUT_PIXELS,
                   help="refuse (record as failed) files whose header declares more pixels, before decoding "
                        "(default %(default)s)")
    p.add_argument("--decode-mib", type=_positive_int("--decode-mib"), default=1024,
                   help="memory images being decoded or waiting for their batch may hold at once, in MiB "
                        "(an image needing more is decoded alone; default %(default)s)")
    p.add_argument("--batch-tokens", type=_positive_int("--batch-tokens"), default=16384,
                   help="patches per forward (an item above runs alone; default %(default)s)")
    p.add_argument("--pooled-only", action="store_true", help="store one mean vector per image")
    p.add_argument("--resume", action="store_true", help="continue a killed or failed run in --out")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (bar on a terminal, else a line every few seconds) and no loading lines; "
                        "errors and the final summary still print")
    p.add_argument("--random-weights", action="store_true", help="with a preset --model: random weights, offline")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the blocks (pays off on CUDA for long jobs; slower on CPU, see README)")
    p.add_argument("--attn", default="auto", choices=ATTN_IMPLS,
                   help="attention backend (default auto: flash-attn, else torch varlen on CUDA in bf16/fp16, "
                        "else sdpa); one that cannot run on the device and dtype is refused")
    p.set_defaults(func=run_embed, validate=validate_embed_args)
