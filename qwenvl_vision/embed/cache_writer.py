"""``embed --format vllm-cache``: a rank's writer of vLLM encoder-cache items (``vllm_cache``'s layout) with the run's
manifest beside them: the same run as ``--format safetensors`` (``writer.RankWriter``: lock, run.json, manifest
parts, resume, ranks) with one file per item instead of shards.

An ok record's ``shard`` is its item's file (``{id}/encoder_cache.safetensors``), its ``key`` ``"ec_cache"``, and it
carries ``vllm_cache.entry``'s fields and ``levels`` (the DeepStack levels in the rows). An item's file carries its
record (with the run id) in its metadata and is renamed into place before the record is appended, so ``recover``
rolls forward an item written and not recorded, or whose line a damaged manifest lost. An input whose pixels match
an item already in place records that item without writing it again (if that line is lost, its input is redone and
finds the item). Items are written, recorded and recovered under the folder's cache lock
(``vllm_cache.cache_lock``); an item a ``cache prune`` removed is not done any more.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..devices import DTYPES
from ..errors import QwenVLVisionError
from ..inputs.item_ids import IDENTITY_FIELDS, is_sha256, item_id
from ..inputs.urls import redacted_text
from ..outputs.handoff import EncodedItems, vllm_items
from ..outputs.records import EmbeddingRecord
from ..outputs.vllm_cache import CACHE_FILE, CACHE_KEY, IDENTITY_FILE, cache_lock, entry, write_item
from .manifest import RECORDS_KEY, RUN_KEY
from .writer import RankWriter


class CacheRankWriter(RankWriter):
    """Writes one rank's encoder-cache items and manifest part; recovery as ``RankWriter``'s."""

    def __init__(self, out: Path, rank: int, world: int, run: dict) -> None:
        super().__init__(out, rank, world, run["run_id"])
        self.identity = {k: run[k] for k in IDENTITY_FIELDS}
        self.family = run["family"]
        self.dtype = DTYPES[run["dtype"]]
        self.tag = f"{self.run_id}-r{rank}"  # ranks that meet on one id write their own temporary files

    def temporary_files(self) -> list[str]:
        names = super().temporary_files() + [f"*/{CACHE_FILE}.{self.tag}.tmp"]
        return names + ([f"{IDENTITY_FILE}.{self.run_id}.tmp"] if self.rank == 0 else [])

    def stored_files(self) -> list[Path]:
        """Every item file of the folder (recovery keeps those whose metadata is this run's)."""
        return sorted(p / CACHE_FILE for p in self.out.iterdir()
                      if is_sha256(p.name) and not p.is_symlink() and (p / CACHE_FILE).is_file())

    def recover(self, listed: dict[str, str]) -> None:
        """``RankWriter.recover`` with the cache lock held: a prune removes no item while it is read."""
        with cache_lock(self.out):
            super().recover(listed)

    def store(self, records: list[EmbeddingRecord]) -> None:
        """``RankWriter.store`` with the cache lock held: a prune (``cache_prune``) sees an item found in place only
        once its line is recorded."""
        with cache_lock(self.out):
            super().store(records)

    def place(self, done: list[tuple[EmbeddingRecord, dict]]) -> None:
        """Each success's item file, in the run's dtype (Ray's rows come as float32: exact, they were made in it),
        renamed into place; its line (which the file also carries) says which. An item vLLM could not take is
        recorded failed, and the run goes on."""
        for r, line in done:
            modality = "image" if r.video is None else "video"
            levels = [level.to(self.dtype) for level in r.deepstack]
            try:
                (item,) = vllm_items(EncodedItems([r.embedding.to(self.dtype)], [r.grid_thw], [levels], modality,
                                                  self.family, [r.video]))
                name = item_id(self.identity, item.modality, item.grid_thw, r.pixels_sha256)
            except QwenVLVisionError as e:
                line.update(status="error", error=redacted_text(f"{r.path}: {e}"))
                continue
            line.update(entry(name, item), shard=f"{name}/{CACHE_FILE}", key=CACHE_KEY, levels=len(levels))
            write_item(self.out, name, item.rows, self.tag, {RUN_KEY: self.run_id, RECORDS_KEY: json.dumps([line])})
