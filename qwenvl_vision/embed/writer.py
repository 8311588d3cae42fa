"""Durable writes of an embed run: each rank's shards and manifest part (``RankWriter``), the recovery of what a
stopped run left, and rank 0's merge of the parts into ``manifest.jsonl``.

Durability: a batch's shard is written to a temporary file, fsynced and renamed into place *before* its
manifest lines are appended (one write, flushed and fsynced). A run killed at any instant, or stopped by an
I/O fault (disk full, read-only folder), therefore leaves (a) complete shards, (b) a manifest whose complete
lines all point at complete shards, and at worst (c) one shard nobody references and one half-written last
line. Every shard also carries its own items' manifest records in its metadata (``RECORDS_KEY``), written with
its tensors in one file: so ``recover`` rolls forward from the shards whatever the manifest lacks (a shard
renamed but never recorded, a torn, truncated or damaged manifest), keeps every input recorded ok exactly once,
even inputs the resumed invocation does not list, and never reuses a shard name. Error records and damaged lines
whose input no shard holds are dropped: their inputs are redone.

Recovery deletes nothing but this run's own temporary files (its run id is in their names). A shard of this run
that no manifest line references and that carries no records (written by an older qwenvl-vision) cannot be
accounted for: the resume refuses with one line, the shard kept.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..errors import ManifestError, OutputFaultError
from ..inputs.urls import redacted_text
from ..outputs.durable import create_new, fsync_dir, open_no_follow, refuse_link, replace_atomically
from ..outputs.records import EmbeddingRecord
from .manifest import (
    MANIFEST,
    RECORDS_KEY,
    RUN_FILE,
    RUN_KEY,
    SHARD_NAME,
    parse_manifest,
    part_name,
    record_key,
    record_problem,
)

# OSErrors at the start that are the output folder's state (exit 3, like a fault mid-run), not a usage error.
OUTPUT_FAULTS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def output_fault(e: OSError, out: Path, recorded: int | None = None) -> OutputFaultError:
    """The one-line error for an OSError writing `out`: what failed, and that --resume finishes the run."""
    what = e.strerror or str(e)
    where = f" ({Path(e.filename).name})" if e.filename else ""
    done = f"; this process recorded {recorded} inputs before it" if recorded is not None else ""
    return OutputFaultError(f"cannot write to {out}: {what}{where}{done}; nothing recorded is lost: fix the "
                            f"output folder (free space, permissions) and run the same command with --resume")




def atomic_write_text(path: Path, text: str, tag: str) -> None:
    """Write `path` whole or not at all; the temporary file's name carries `tag` (the run id)."""
    replace_atomically(path, path.with_name(f"{path.name}.{tag}.tmp"), lambda f: f.write(text.encode()))


def append_lines(path: Path, records: list[dict]) -> None:
    """Append `records` as JSON lines in one write, fsynced: a kill leaves at most one torn last line."""
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records)
    # Never through a link: somebody's link at the manifest's name would make us append to the file it points to.
    with os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_shard(tensors: dict[str, torch.Tensor], tmp: Path, run_id: str, records: list[dict] | None = None) -> None:
    """Serialise in memory, then write with Python's file I/O: a full disk or a read-only folder is an
    OSError with its errno (safetensors' save_file reports them as its own error type), and the file gets
    the permissions the umask allows (save_file creates 0600 files). ``tmp`` is created exclusively, never
    through a link. ``records``: the manifest records of the shard's items, stored in its metadata."""
    metadata = {"format": "pt", RUN_KEY: run_id}
    if records is not None:
        metadata[RECORDS_KEY] = json.dumps(records)
    data = save(tensors, metadata=metadata)
    with create_new(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def stored_records(path: Path) -> tuple[str | None, list | None, set[str]]:
    """(run id, the records its metadata carries or None, its tensor names) of a shard or cache item; a
    ManifestError naming it if its header is unreadable or its records are not a JSON list."""
    try:
        with safe_open(path, framework="pt") as f:
            metadata, keys = f.metadata() or {}, set(f.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad header
        raise ManifestError(f"{path} is unreadable ({e})") from None
    raw = metadata.get(RECORDS_KEY)
    if raw is None:
        return metadata.get(RUN_KEY), None, keys
    try:
        found = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: its {RECORDS_KEY} metadata is damaged ({e})") from None
    if not isinstance(found, list):
        raise ManifestError(f"{path}: its {RECORDS_KEY} metadata is not a list of records")
    return metadata.get(RUN_KEY), found, keys


class Writer(Protocol):
    """What an embed run asks of a rank's writer, whatever the format (``RankWriter``: safetensors shards,
    ``parquet_writer.ParquetRankWriter``, ``cache_writer.CacheRankWriter``: vLLM encoder-cache items)."""

    done: set[str]  # real keys of the inputs already recorded ok (a resume skips them)
    recorded: int  # inputs recorded (ok or error) by this process
    failed: int  # of which failed

    def recover(self) -> None:
        """A resume, before any rank writes: what a stopped run left, made consistent."""

    def finish_recovery(self) -> None:
        """A resume, after every rank has read the folder: the rewrites that had to wait."""

    def write_records(self, records: list[EmbeddingRecord]) -> tuple[int, int]:
        """One batch of records (the local engine's results, or Ray's rows), written durably; (ok, failed)."""


class RankWriter:
    """Writes one rank's shards and manifest part; on resume, recovers what a stopped run left. ``pooled``: store
    each input's mean vector (float32) instead of its tokens."""

    def __init__(self, out: Path, rank: int, world: int, run_id: str, run_cwd: str | None = None,
                 pooled: bool = False) -> None:
        self.out, self.rank, self.world, self.run_id = out, rank, world, run_id
        self.pooled = pooled
        self.run_cwd = run_cwd or os.getcwd()
        self.manifest = out / part_name(rank, world)
        self.own: dict[str, dict] = {}  # real key -> this rank's ok record
        self.done: set[str] = set()  # real keys recorded ok by any rank
        self.next_shard = 0
        self.recorded = 0  # inputs recorded (ok or error) by this process
        self.failed = 0  # of which failed

    def _own_shards(self) -> list[Path]:
        return sorted(p for p in self.out.glob(f"shard-r{self.rank}-*.safetensors") if SHARD_NAME.match(p.name))

    def stored_files(self) -> list[Path]:
        """The files whose metadata records may hold this rank's items: its shards."""
        return self._own_shards()

    def folder_files(self) -> list[Path]:
        """The files whose metadata records may hold any rank's items: every rank's shards."""
        return sorted(p for p in self.out.glob("shard-r*-*.safetensors") if SHARD_NAME.match(p.name))

    def unaccounted(self, path: Path, why: str) -> ManifestError:
        """The error for a shard of this run that recovery can neither read nor match to a record: kept, named."""
        return ManifestError(f"{path} {why}, and no manifest line records it: nothing was changed; move it out of "
                             f"{self.out} (its inputs are then redone) and run the same command with --resume again")

    def _records(self, path: Path) -> list[dict]:
        """Usable records of one manifest file; damaged lines are dropped like a torn line."""
        return [line.record for line in parse_manifest(path) if line.record is not None]

    def recover(self) -> None:
        """Resume: keep this rank's ok records whose shard exists, once each, then roll forward every record its
        shards carry that no line holds (see the module). Deletes only this run's temporary files."""
        mine = self._records(self.manifest)
        if self.world > 1 and not mine:  # resuming a finished multi-rank run: the parts were merged
            mine = [r for r in self._records(self.out / MANIFEST) if r.get("rank", 0) == self.rank]
        for r in mine:
            if r["status"] == "ok" and r.get("rank", 0) == self.rank and (self.out / r["shard"]).is_file():
                self.own.setdefault(record_key(r, self.run_cwd), r)
        others = self._done_by_other_ranks()
        carried = self._carried_by_other_ranks()
        # An input another rank's file carries (its lines lost too) is that rank's to roll forward when the rank is
        # lower, else this one's: one owner whichever rank recovers first. Done for every rank either way.
        self._roll_forward(others | {key for key, rank in carried.items() if rank < self.rank})
        self.done = set(self.own) | others | set(carried)
        for pattern in self.temporary_files():
            for tmp in self.out.glob(pattern):
                refuse_link(tmp)  # somebody's link at our temporary name: named, left as it is
                tmp.unlink()
        numbers = [int(SHARD_NAME.match(s.name).group(2)) for s in self._own_shards()]
        self.next_shard = max(numbers, default=-1) + 1
        # Rewrite the part with each ok input once; errors and damaged lines are dropped so they are redone.
        atomic_write_text(self.manifest, "".join(json.dumps(r) + "\n" for r in self.own.values()), self.run_id)

    def _roll_forward(self, others: set[str]) -> None:
        """Add the records of this rank's stored files (this run's) that no manifest line holds: a shard renamed
        but never recorded, or lines a damaged manifest lost. An input recorded already (here, or ok by another
        rank) keeps its first record."""
        referenced = {r["shard"] for r in self.own.values()}
        for path in self.stored_files():
            name = path.relative_to(self.out).as_posix()
            try:
                run_id, found, keys = stored_records(path)
            except ManifestError as e:
                if name in referenced or not SHARD_NAME.match(name):
                    continue  # a recorded shard is read (and refused, named) by its readers; an item is rewritten
                raise self.unaccounted(path, f"cannot be read ({e})") from None
            if run_id != self.run_id:
                continue  # another run's file: not this run's to take, nor to remove
            if found is None:
                if name not in referenced and SHARD_NAME.match(name):
                    raise self.unaccounted(path, "carries no records of its items (an older qwenvl-vision wrote it)")
                continue
            for record in found:
                problem = record_problem(record)
                if problem or record.get("rank", 0) != self.rank or record["status"] != "ok":
                    if problem:
                        raise self.unaccounted(path, f"carries a damaged record ({problem})")
                    continue
                if record["shard"] != name or record["key"] not in keys:
                    raise self.unaccounted(path, f"carries a record of {record['shard']} {record['key']!r}, "
                                                 f"not one of its own tensors")
                key = record_key(record, self.run_cwd)
                if key not in others:
                    self.own.setdefault(key, record)

    def finish_recovery(self) -> None:
        """Nothing waits here: ``recover`` rewrites only this rank's own part."""

    def temporary_files(self) -> list[str]:
        """Glob patterns of the temporary files a kill may have left of this run: this rank's shards and manifest
        part, and (rank 0) the merged manifest and run.json being rewritten."""
        names = [f"shard-r{self.rank}-*.{self.run_id}.tmp", f"{self.manifest.name}.{self.run_id}.tmp"]
        if self.rank == 0:
            names += [f"{MANIFEST}.{self.run_id}.tmp", f"{RUN_FILE}.{self.run_id}.tmp"]
        return names

    def _done_by_other_ranks(self) -> set[str]:
        """Inputs other ranks recorded ok: not redone here even if the input list (and so the split) changed."""
        if self.world == 1:
            return set()
        files = [self.out / MANIFEST] + [self.out / part_name(r, self.world) for r in range(self.world)]
        return {record_key(r, self.run_cwd) for f in files if f != self.manifest for r in self._records(f)
                if r["status"] == "ok" and r.get("rank", 0) != self.rank and (self.out / r["shard"]).is_file()}

    def _carried_by_other_ranks(self) -> dict[str, int]:
        """Inputs recorded ok in the metadata of other ranks' files of this run (each with the lowest such rank):
        a rank whose manifest lines were lost rolls them forward, so no other rank may embed them again, even where
        a changed input list now assigns them elsewhere."""
        if self.world == 1:
            return {}
        carried: dict[str, int] = {}
        for path in self.folder_files():
            name = path.relative_to(self.out).as_posix()
            try:
                run_id, found, _ = stored_records(path)
            except ManifestError:
                continue  # unreadable: its own rank refuses it, named
            if run_id != self.run_id or not found:
                continue
            for record in found:
                if record_problem(record) or record["status"] != "ok" or record["shard"] != name:
                    continue
                rank = record.get("rank", 0)
                if rank != self.rank:
                    key = record_key(record, self.run_cwd)
                    carried[key] = min(rank, carried.get(key, rank))
        return carried

    def base_record(self, r: EmbeddingRecord) -> dict:
        """The manifest fields every record of an input has: its path, status, error, rank, and a video's frames."""
        record = {"path": redacted_text(r.path), "realpath": redacted_text(r.realpath), "status": r.status,
                  "error": redacted_text(r.error), "rank": self.rank}
        if r.video is not None:
            record["video"] = r.video
        if r.columns is not None:
            record["columns"] = r.columns
        return record

    def finish_batch(self, records: list[dict], failed: int) -> None:
        """Append a batch's records (after its tensors are in place) and count them."""
        append_lines(self.manifest, records)
        self.recorded += len(records)
        self.failed += failed

    def write_records(self, records: list[EmbeddingRecord]) -> tuple[int, int]:
        """One shard for the batch's successes (renamed into place), then its manifest lines."""
        tensors: dict[str, torch.Tensor] = {}
        lines = []
        shard_name = f"shard-r{self.rank}-{self.next_shard:06d}.safetensors"
        ok = failed = 0
        for r in records:
            record = self.base_record(r)
            if r.ok:
                key = f"{ok:06d}"
                if self.pooled:
                    tensors[key] = r.pooled.float().contiguous().cpu()
                else:
                    tensors[key] = r.embedding.contiguous().cpu()
                    for level, t in enumerate(r.deepstack or []):
                        tensors[f"{key}.deepstack.{level}"] = t.contiguous().cpu()
                record.update(shard=shard_name, key=key, grid_thw=list(r.grid_thw), tokens=int(r.tokens))
                ok += 1
            else:
                failed += 1
            lines.append(record)
        if tensors:
            tmp = self.out / f"{shard_name[: -len('.safetensors')]}.{self.run_id}.tmp"
            try:
                save_shard(tensors, tmp, self.run_id, [line for line in lines if line["status"] == "ok"])
                os.replace(tmp, self.out / shard_name)
            except OSError:
                tmp.unlink(missing_ok=True)  # frees the space on a full disk; recovery would remove it too
                raise
            fsync_dir(self.out)
            self.next_shard += 1
        self.finish_batch(lines, failed)
        return ok, failed


def merge_parts(out: Path, world: int, run_id: str) -> Path:
    """Rank 0, after all ranks finished: parts -> one manifest.jsonl (atomic), parts removed."""
    records = []
    for rank in range(world):
        records.extend(line.record for line in parse_manifest(out / part_name(rank, world)) if line.record)
    atomic_write_text(out / MANIFEST, "".join(json.dumps(r) + "\n" for r in records), run_id)
    for rank in range(world):
        (out / part_name(rank, world)).unlink(missing_ok=True)
    return out / MANIFEST

