"""Durable writes of a ``--format parquet`` embed run (``ParquetRankWriter``, the counterpart of
``writer.RankWriter``): each batch is one shard ``shard-r{rank}-{n:06d}.parquet`` of ``parquet``'s layout, one row
per input (ok rows with their tensors, error rows with why), run.json in its schema metadata.

The shards are the manifest: a shard is written to a temporary file, fsynced and renamed into place
(``parquet.write_table_atomic``), so a run killed at any instant (even SIGKILL) leaves whole shards, each row an
input recorded exactly once, and at worst one temporary file. ``recover`` (``--resume``) deletes this rank's
temporary files, takes every ok row of the folder (any rank's) as done, and rewrites each of this rank's shards
that hold error rows without them (atomically; a shard left with none is removed), so that the retried inputs are
recorded once: never an input twice, never one lost. A shard that cannot be read (a hand edit, a bad disk) is
refused naming it, never dropped silently. Shard numbers are never reused.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ManifestError
from ..parquet import (
    ParquetLayout,
    read_parquet_table,
    record_from_result,
    results_table,
    shard_name,
    write_table_atomic,
)
from .inputs import real_key
from .manifest import PARQUET_SHARD_NAME


def parquet_shards(out: Path, rank: int | None = None) -> list[Path]:
    """The folder's Parquet shards (one rank's with ``rank``), by name: ranks in order, then batches."""
    def sort_key(p: Path) -> tuple[int, int]:
        m = PARQUET_SHARD_NAME.match(p.name)
        return int(m.group(1)), int(m.group(2))

    shards = [p for p in out.glob("shard-r*-*.parquet") if PARQUET_SHARD_NAME.match(p.name) and p.is_file()]
    if rank is not None:
        shards = [p for p in shards if sort_key(p)[0] == rank]
    return sorted(shards, key=sort_key)


def statuses(out: Path) -> list[tuple[str, str]]:
    """(realpath, status) of every row of the folder's shards, in shard order (the summary's source)."""
    rows: list[tuple[str, str]] = []
    for shard in parquet_shards(out):
        table = pq.read_table(shard, columns=["realpath", "status"])
        rows += zip(table.column("realpath").to_pylist(), table.column("status").to_pylist())
    return rows


class ParquetRankWriter:
    """Writes one rank's Parquet shards; on resume, recovers what a stopped run left (see the module)."""

    def __init__(self, out: Path, rank: int, run: dict, layout: ParquetLayout) -> None:
        self.out, self.rank, self.run, self.layout = out, rank, run, layout
        self.done: set[str] = set()  # real keys recorded ok by any rank
        self.next_shard = 0
        self.recorded = 0  # inputs recorded (ok or error) by this process
        self.failed = 0

    def _read(self, shard: Path) -> pa.Table:
        table, layout, run = read_parquet_table(shard)  # ManifestError naming the shard (and row) if damaged
        if run.get("run_id") != self.run["run_id"] or layout != self.layout:
            raise ManifestError(f"{shard}: written by another run or with another layout than {self.out / 'run.json'}"
                                f" (move it away; --resume then redoes its inputs)")
        return table

    def recover(self) -> None:
        for tmp in self.out.glob(f".shard-r{self.rank}-*.tmp"):  # a write the kill interrupted
            tmp.unlink()
        own = parquet_shards(self.out, self.rank)
        for shard in parquet_shards(self.out):
            table = self._read(shard)
            ok = pc.equal(table.column("status"), "ok")
            self.done.update(table.filter(ok).column("realpath").to_pylist())
            if shard in own and not pc.all(ok).as_py():
                kept = table.filter(ok)  # the error rows go: their inputs are retried and recorded once more
                if kept.num_rows:
                    write_table_atomic(kept, shard)
                else:
                    shard.unlink()
        numbers = [int(PARQUET_SHARD_NAME.match(s.name).group(2)) for s in own]
        self.next_shard = max(numbers, default=-1) + 1

    def write_records(self, records: list) -> tuple[int, int]:
        """One shard of ``parquet.EmbeddingRecord``s, renamed into place whole."""
        if not records:
            return 0, 0
        table = results_table(records, self.layout, self.run)
        write_table_atomic(table, self.out / shard_name(self.rank, self.next_shard))
        self.next_shard += 1
        failed = sum(not r.ok for r in records)
        self.recorded += len(records)
        self.failed += failed
        return len(records) - failed, failed

    def write_batch(self, results, pooled_only: bool) -> tuple[int, int]:
        """``RankWriter.write_batch``'s interface: results with a ``path`` (ok ones with their tensors)."""
        del pooled_only  # the layout says which tensor columns there are
        return self.write_records([record_from_result(r, r.path, real_key(r.path)) for r in results])


def layout_for(encoder, pooled_only: bool) -> ParquetLayout:
    """The layout of a run: the tokens (and DeepStack levels), or with ``--pooled-only`` the mean vector only."""
    return ParquetLayout.for_encoder(encoder, tokens=not pooled_only, pooled=pooled_only)

