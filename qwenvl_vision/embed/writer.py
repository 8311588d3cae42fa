"""Durable writes of an embed run: each rank's shards and manifest part (``RankWriter``), the recovery of what a
stopped run left, and rank 0's merge of the parts into ``manifest.jsonl``.

Durability: a batch's shard is written to a temporary file, fsynced and renamed into place *before* its
manifest lines are appended (one write, flushed and fsynced). A run killed at any instant, or stopped by an
I/O fault (disk full, read-only folder), therefore leaves (a) complete shards, (b) a manifest whose complete
lines all point at complete shards, and at worst (c) one shard nobody references and one half-written last
line. Every shard also carries its own items' manifest records in its metadata (``RECORDS_KEY``), written with
its tensors in one file: so ``recover`` rolls forward from the shards whatever the manifest lacks (a shard
renamed but never recorded, a torn, truncated or damaged manifest: a file's record from its newest shard), keeps
every input recorded exactly once, even inputs the resumed invocation does not list, and never reuses a shard
name. The records of the inputs this invocation embeds again are dropped (``redone``): a failure, or a file
replaced since it was recorded, so each file has one record, whichever rank wrote it; damaged lines whose input no
shard holds are dropped too.

Recovery deletes nothing but this run's own temporary files (its run id is in their names).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..errors import ManifestError, OutputFaultError
from ..inputs.urls import redacted_text
from ..outputs.durable import append_synced, refuse_link, replace_atomically
from ..outputs.records import EmbeddingRecord
from .inputs import file_of
from .manifest import MANIFEST, RECORDS_KEY, RUN_FILE, RUN_KEY, SHARD_NAME, part_name, read_manifest_lines

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
    append_synced(path, "".join(json.dumps(r) + "\n" for r in records).encode())


def save_shard(tensors: dict[str, torch.Tensor], path: Path, run_id: str, records: list[dict]) -> None:
    """The shard at ``path`` whole or not at all, its items' manifest records in its metadata. Serialised in memory,
    then written with Python's file I/O (``replace_atomically``): a full disk or a read-only folder is an OSError with
    its errno (safetensors' save_file reports them as its own error type), and the file gets the permissions the
    umask allows (save_file creates 0600 files)."""
    data = save(tensors, metadata={"format": "pt", RUN_KEY: run_id, RECORDS_KEY: json.dumps(records)})
    replace_atomically(path, path.with_name(f"{path.stem}.{run_id}.tmp"), lambda f: f.write(data))


def stored_records(path: Path) -> tuple[str | None, list | None]:
    """(run id, the records its metadata carries or None) of a shard or cache item; one ManifestError naming it
    where safetensors or JSON cannot read them."""
    try:
        metadata = safe_open(path, framework="pt").metadata() or {}
        return metadata.get(RUN_KEY), json.loads(metadata[RECORDS_KEY]) if RECORDS_KEY in metadata else None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a bad header
        raise ManifestError(f"{path} is unreadable ({e}): nothing was changed; move it out of {path.parent} (its "
                            f"inputs are then redone) and run the same command with --resume again") from None


def redone(key: str, ok: bool, listed: dict[str, str]) -> bool:
    """Whether a resume embeds the input of a record (its identity ``key``) again, dropping the record: the
    invocation lists its file (``listed``: file -> identity now, ``inputs.file_of``), and the record is a failure or
    of other bytes (a file replaced since). A record of an input not listed is kept as it is, and so is an ok one of
    a file whose bytes are not known now (it cannot be read for a moment: ``Writer.keep_unknown``)."""
    now = listed.get(file_of(key))
    return now is not None and (not ok or (now != key and file_of(now) != now))


class Writer:
    """A rank's writer, whatever the format (``RankWriter``: safetensors shards, ``cache_writer.CacheRankWriter``:
    vLLM encoder-cache items, both with manifest lines; ``parquet_writer.ParquetRankWriter``: Parquet shards). A
    batch's records go one way, ``write_records``; each format stores them its own (``store``)."""

    recorded = 0  # inputs recorded (ok or error) by this process

    def __init__(self) -> None:
        self.done: set[str] = set()  # identities of the inputs recorded ok by any rank (a resume skips them)
        self.replaced: set[str] = set()  # files (``file_of``) whose record a resume dropped: replaced since

    def recover(self, listed: dict[str, str]) -> None:
        """A resume, before any rank writes: what a stopped run left, made consistent, without the records of the
        inputs this invocation embeds again (``redone``)."""

    def finish_recovery(self) -> None:
        """A resume, after every rank has read the folder: the rewrites that had to wait."""

    def keep_unknown(self, listed: dict[str, str]) -> None:
        """An input whose bytes are not known now (it cannot be read for a moment) and whose file is recorded ok
        keeps that record (``redone``): done, not retried to fail beside it."""
        recorded = {file_of(key) for key in self.done}
        self.done |= {now for file, now in listed.items() if file_of(now) == now and file in recorded}

    def remove_temporary_files(self) -> None:
        """Those a kill may have left of this run (``temporary_files``: glob patterns in ``out``)."""
        for pattern in self.temporary_files():
            for tmp in self.out.glob(pattern):
                refuse_link(tmp)  # somebody's link at our temporary name: named, left as it is
                tmp.unlink()

    def write_records(self, records: list[EmbeddingRecord]) -> None:
        """One batch of records (the local engine's results, or Ray's rows), written durably."""
        if records:
            self.store(records)
        self.recorded += len(records)

    def store(self, records: list[EmbeddingRecord]) -> None:
        """The batch written durably, the format's way."""


class RankWriter(Writer):
    """Writes one rank's shards and manifest part; on resume, recovers what a stopped run left. ``pooled``: store
    each input's mean vector (float32) instead of its tokens."""

    def __init__(self, out: Path, rank: int, world: int, run_id: str, pooled: bool = False) -> None:
        super().__init__()
        self.out, self.rank, self.world, self.run_id = out, rank, world, run_id
        self.pooled = pooled
        self.manifest = out / part_name(rank, world)
        self.own: dict[str, dict] = {}  # identity -> this rank's ok record
        self.rewrite: list[dict] | None = None  # a resume's lines of this rank's part (recover -> finish_recovery)
        self.next_shard = 0

    def stored_files(self) -> list[Path]:
        """The files whose metadata records may hold any rank's items: every rank's shards."""
        return sorted(p for p in self.out.glob("shard-r*-*.safetensors") if SHARD_NAME.match(p.name))

    def recover(self, listed: dict[str, str]) -> None:
        """Resume: keep the records whose input is not redone (``redone``) and, of an ok one, whose file exists,
        once each (this rank's as its own), and roll forward the records this rank's files carry of files no line
        holds (see the module); one owner of an input two ranks' files carry, the lower rank, whichever rank
        recovers first. Reads only, but for this run's temporary files (deleted): the part is rewritten by
        ``finish_recovery``, once every rank has read every part."""
        # Each rank's records as its part holds them (it is rewritten whole before the rank adds a line), else as
        # the merged manifest does: a resume stopped before merging leaves the manifest behind its parts.
        merged = [] if self.world == 1 else read_manifest_lines(self.out / MANIFEST, strict=False)
        lines = [r for rank in range(self.world) for part in [self.out / part_name(rank, self.world)]
                 for r in (read_manifest_lines(part, strict=False) if part.exists()  # damaged lines: rolled forward
                           else [r for r in merged if r.get("rank", 0) == rank])]
        # identity -> (its record as the lowest rank's files carry it, when and where that file was written)
        carried: dict[str, tuple[dict, tuple[int, str]]] = {}
        unreadable = set()  # cache items: their inputs are redone, the items rewritten
        for path in self.stored_files():
            name = path.relative_to(self.out).as_posix()
            try:
                run_id, found = stored_records(path)
            except ManifestError:
                if SHARD_NAME.match(name):
                    raise
                unreadable.add(name)
                continue
            if run_id != self.run_id:
                continue  # another run's file: not this run's to take, nor to remove
            when = path.stat().st_mtime_ns, name  # a file is renamed into place whole
            for r in found or ():
                key, rank = r["realpath"], r.get("rank", 0)
                if r["status"] == "ok" and (key not in carried or rank < carried[key][0].get("rank", 0)):
                    carried[key] = r, when
        lines = [r for r in lines if r["status"] != "ok" or (r["shard"] not in unreadable
                                                              and (self.out / r["shard"]).is_file())]
        # A file's latest record is its line (ok or failed), else the one its newest shard or item carries.
        latest = {file_of(r["realpath"]) for r in lines}
        newest: dict[str, tuple[dict, tuple[int, str]]] = {}
        for r, when in carried.values():
            file = file_of(r["realpath"])
            if file not in latest and (file not in newest or when > newest[file][1]):
                newest[file] = r, when
        others, failed = set(), {}  # others: inputs other ranks recorded ok, not redone here even if the split changed
        for r in [*lines, *(r for r, _ in newest.values())]:  # lines by rank: an input's lowest rank keeps it
            key, ok, mine = r["realpath"], r["status"] == "ok", r.get("rank", 0) == self.rank
            if redone(key, ok, listed):
                if ok:
                    self.replaced.add(file_of(key))
            elif not mine:
                if ok:
                    others.add(key)
            elif not ok:
                failed.setdefault(key, r)
            elif key not in others:
                self.own.setdefault(key, r)
        self.done = set(self.own) | others
        failed = {key: r for key, r in failed.items() if key not in self.done}
        self.keep_unknown(listed)
        self.remove_temporary_files()
        numbers = [int(m.group(2)) for p in self.out.glob(f"shard-r{self.rank}-*") if (m := SHARD_NAME.match(p.name))]
        self.next_shard = max(numbers, default=-1) + 1
        self.rewrite = [*self.own.values(), *failed.values()]  # each of this rank's inputs once

    def finish_recovery(self) -> None:
        """The part rewritten as ``recover`` found it, once every rank has read every part (a barrier between)."""
        if self.rewrite is not None:
            atomic_write_text(self.manifest, "".join(json.dumps(r) + "\n" for r in self.rewrite), self.run_id)
            self.rewrite = None

    def temporary_files(self) -> list[str]:
        """This rank's shards and manifest part, and (rank 0) the merged manifest and run.json being rewritten."""
        names = [f"shard-r{self.rank}-*.{self.run_id}.tmp", f"{self.manifest.name}.{self.run_id}.tmp"]
        if self.rank == 0:
            names += [f"{MANIFEST}.{self.run_id}.tmp", f"{RUN_FILE}.{self.run_id}.tmp"]
        return names

    def store(self, records: list[EmbeddingRecord]) -> None:
        """The files of the batch's successes in place (``place``), then the batch's manifest lines."""
        lines = []
        for r in records:
            line = {"path": redacted_text(r.path), "realpath": redacted_text(r.realpath), "status": r.status,
                    "error": redacted_text(r.error), "rank": self.rank}
            lines.append(line | {k: v for k, v in (("video", r.video), ("columns", r.columns)) if v is not None})
        self.place([(r, line) for r, line in zip(records, lines, strict=True) if r.ok])
        append_lines(self.manifest, lines)

    def place(self, done: list[tuple[EmbeddingRecord, dict]]) -> None:
        """One shard of the successes' tensors, renamed into place; each one's manifest line says where."""
        if not done:
            return
        name, tensors = f"shard-r{self.rank}-{self.next_shard:06d}.safetensors", {}
        for ordinal, (r, line) in enumerate(done):
            key = f"{ordinal:06d}"
            if self.pooled:
                tensors[key] = r.pooled.float().contiguous().cpu()
            else:
                tensors[key] = r.embedding.contiguous().cpu()
                for level, t in enumerate(r.deepstack or []):
                    tensors[f"{key}.deepstack.{level}"] = t.contiguous().cpu()
            line.update(shard=name, key=key, grid_thw=list(r.grid_thw), tokens=int(r.tokens))
        save_shard(tensors, self.out / name, self.run_id, [line for _, line in done])
        self.next_shard += 1


def merge_parts(out: Path, world: int, run_id: str) -> None:
    """Rank 0, after all ranks finished: parts -> one manifest.jsonl (atomic), parts removed."""
    records = [r for rank in range(world) for r in read_manifest_lines(out / part_name(rank, world), strict=False)]
    atomic_write_text(out / MANIFEST, "".join(json.dumps(r) + "\n" for r in records), run_id)
    for rank in range(world):
        (out / part_name(rank, world)).unlink(missing_ok=True)
