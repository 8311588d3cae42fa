"""Durable writes of a ``--format parquet`` embed run (``ParquetRankWriter``, the counterpart of
``writer.RankWriter``): each batch is one shard ``shard-r{rank}-{n:06d}.parquet`` of ``parquet``'s layout, written
atomically (``parquet.write_table_atomic``). The shards are the manifest (docs/embed.md, "Resume").

``recover`` (``--resume``) deletes this rank's temporary files and takes every ok row of the folder (any rank's) as
done but for the inputs this invocation embeds again (``writer.redone``); once every rank has read (a barrier under
torchrun), ``finish_recovery`` rewrites each of this rank's shards holding rows of those inputs without them
(atomically; a shard left with none is removed), so an input is never recorded twice nor lost. A shard that cannot
be read is refused naming it, never dropped. Shard numbers are never reused. ``unstorable`` makes an input whose name
is not UTF-8 an error row (docs/embed.md, "File names").
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from ..outputs.durable import fsync_dir
from ..outputs.parquet import ParquetLayout, needs_escape, results_table, shard_name, text, write_table_atomic
from ..outputs.parquet_reader import read_parquet_index, read_parquet_table
from .inputs import file_of
from .manifest import PARQUET_SHARD_NAME, RUN_FILE, parquet_shards
from .writer import Writer, redone


def statuses(out: Path) -> list[tuple[str, str]]:
    """(realpath, status) of every row of the folder's shards, in shard order (the summary's source)."""
    return [row for shard in parquet_shards(out) for row in zip(*read_parquet_index(shard))]


class ParquetRankWriter(Writer):
    """Writes one rank's Parquet shards; on resume, recovers what a stopped run left (see the module)."""

    def __init__(self, out: Path, rank: int, run: dict, layout: ParquetLayout) -> None:
        super().__init__()
        self.out, self.rank, self.run, self.layout = out, rank, run, layout
        self.next_shard = 0
        # This rank's shards holding rows redone, with their identities (recover -> finish_recovery).
        self.to_rewrite: dict[Path, set[str]] = {}

    def recover(self, listed: dict[str, str]) -> None:
        """Resume, first step (reads only; the module docstring says why): delete this rank's temporary files
        (rank 0: run.json's too), take every ok row of the folder as done but those redone, and note which of this
        rank's shards hold rows redone. Only the footer and the realpath / status columns of a shard are read."""
        self.remove_temporary_files()
        listed = {text(file): text(key) for file, key in listed.items()}  # as the rows spell them
        own = set(parquet_shards(self.out, self.rank))
        for shard in parquet_shards(self.out):
            rows = [(key, state == "ok") for key, state in zip(*read_parquet_index(shard))]
            dropped = {key: ok for key, ok in rows if redone(key, ok, listed)}
            self.done.update(key for key, ok in rows if ok and key not in dropped)
            self.replaced.update(file_of(key) for key, ok in dropped.items() if ok)
            if dropped and shard in own:
                self.to_rewrite[shard] = set(dropped)
        self.keep_unknown(listed)
        self.next_shard = max((int(PARQUET_SHARD_NAME.match(s.name).group(2)) for s in own), default=-1) + 1

    def temporary_files(self) -> list[str]:
        """A shard's write the kill interrupted, and (rank 0) run.json being written (a fresh run, or its CPU plan
        recorded)."""
        return [f".shard-r{self.rank}-*.tmp"] + ([f"{RUN_FILE}.{self.run['run_id']}.tmp"] if self.rank == 0 else [])

    def finish_recovery(self) -> None:
        """Resume, second step: rewrite each of this rank's shards that hold rows redone without them
        (atomically; a shard left with none is removed), so that those inputs are recorded once. Each is read and
        checked whole (``read_parquet_table``) first."""
        for shard, dropped in self.to_rewrite.items():
            table, _, _ = read_parquet_table(shard)  # ManifestError naming the shard if damaged
            kept = table.filter(pa.array([key not in dropped for key in table.column("realpath").to_pylist()]))
            if kept.num_rows:
                write_table_atomic(kept, shard)
            else:
                shard.unlink()
        fsync_dir(self.out)  # the removals as durable as the rewrites' renames
        self.to_rewrite = {}

    def store(self, records: list) -> None:
        """One shard of ``records.EmbeddingRecord``s, renamed into place whole."""
        path = self.out / shard_name(self.rank, self.next_shard)
        write_table_atomic(results_table(records, self.layout, self.run), path)
        self.next_shard += 1


def unstorable(path: str, key: str) -> str | None:
    """Why an input cannot be an ok row of a Parquet shard (its name is not valid UTF-8), or None."""
    if not (needs_escape(path) or needs_escape(key)):
        return None
    return (f"file name {path!r} is not valid UTF-8, which Parquet's text columns need: rename the file, "
            f"or use --format safetensors")
