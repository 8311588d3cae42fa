"""``qwenvl-vision cache prune DIR --max-gb N``: a vLLM encoder-cache folder (``vllm_cache``'s layout) kept under a
size bound, its oldest items (by last write) removed first, safely beside a running writer (docs/handoff.md, "Keep
the cache folder under a size bound": what is removed, what is kept, the exit statuses).

- Only whole items, as ``vllm_cache.ITEM_NAME`` takes their ids (embed's 64 hex digits, serve's uuids): regular
  files, never through a link, then their folder where it is left empty.
- ``vllm_cache.CACHE_LOCK`` is held while the folder is read and items removed, as writers hold it while they write
  and record items: an item found in place by a writer is recorded before a prune can see it.
- A running ``embed``'s items are those last written since its ``embed.lock`` was made, while a process holds it,
  but for the server's (whose metadata carries ``ENTRY_KEY``; their uuids may be 64 hex digits too; an item
  unread is kept as the embed's).
- Every removed item is appended to ``PRUNED`` before it goes (on a full disk, see ``remove_items``), so a manifest
  line whose item is gone is accounted for. Sizes count the folder's other files too, so the folder as a whole
  stays under the bound.
- An item's temporary file found with the lock held is a killed writer's (writers make them only while holding it):
  removed first, or it would count against the bound for ever and cost real items their place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheFolderError, OutputFaultError
from .durable import append_synced, fsync_dir, lock_held
from .vllm_cache import CACHE_FILE, ENTRY_KEY, IDENTITY_FILE, ITEM_NAME, cache_lock, item_metadata

PRUNED = "pruned.jsonl"  # the items a prune removed, one JSON line each
RUN_LOCKS = ("embed.lock", "embed.rank*.lock")  # a running embed's (embed.lock's lock_name)
LOCK_WAIT_S = 60  # a prune waits this long for the writers' current batches
FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Item:
    id: str
    path: Path
    bytes: int
    last_write: float


@dataclass
class PruneReport:
    removed: list[Item]
    kept: int  # items left
    kept_bytes: int  # the folder's bytes left
    held: int  # items kept because a running embed wrote them
    stale: int  # temporary files killed writers left, removed
    running: bool  # whether an embed was running into the folder (holding its lock)
    bound: int

    @property
    def done(self) -> bool:
        """Whether the prune did what was asked: the folder within the bound, or every item it may remove gone (the
        folder's own files, which a prune never removes, are then all that keeps it above)."""
        return self.kept_bytes <= self.bound or not self.held

    def line(self, dry_run: bool = False) -> str:
        gb = 1e9
        verb = "would remove" if dry_run else "removed"
        text = (f"{verb} {len(self.removed)} item(s), {sum(i.bytes for i in self.removed) / gb:.3f} GB; "
                f"{self.kept} left, {self.kept_bytes / gb:.3f} GB of {self.bound / gb:.3f} GB")
        if self.stale:
            text += f"; {verb} {self.stale} temporary file(s) killed writers left"
        if self.kept_bytes > self.bound:
            text += (f": still above the bound, {self.held} item(s) were written by a running embed" if self.held
                     else ": above the bound only by the folder's own files (manifest, run.json, pruned.jsonl), "
                          "which a prune never removes")
        return text


def items_of(folder: Path) -> list[Item]:
    """The folder's whole items (regular files, not links), oldest last write first."""
    found = []
    for entry in os.scandir(folder):
        if ITEM_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            path = Path(entry.path) / CACHE_FILE
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    found.append(Item(entry.name, path, st.st_size, st.st_mtime))
    return sorted(found, key=lambda i: (i.last_write, i.id))


def folder_bytes(folder: Path) -> int:
    """Every file's bytes in the folder and below it (items, manifest, run.json, temporary files; links as the link
    itself), counted so the folder as a whole keeps to its bound."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # a temporary file renamed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def running_embed_since(folder: Path) -> float | None:
    """When the embed running into this folder started (its lock file's last write, made as it took the lock; the
    earliest of its ranks'), None when no process holds such a lock."""
    times = []
    for pattern in RUN_LOCKS:
        for lock in folder.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                if lock_held(lock):
                    times.append(os.lstat(lock).st_mtime)
    return min(times, default=None)


def prune_cache(folder: str | os.PathLike, max_bytes: int, dry_run: bool = False) -> PruneReport:
    """Remove the oldest items of the encoder-cache ``folder`` until it holds at most ``max_bytes`` (see the
    module); what was removed and what is left."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CacheFolderError(f"{folder} is not a folder")
    if not (folder / IDENTITY_FILE).is_file():  # a link to the folder is followed, as writers follow it
        raise CacheFolderError(f"{folder} is not an encoder cache written by qwenvl-vision (no {IDENTITY_FILE}): "
                               f"nothing is removed from a folder whose files are not accounted for")
    # A dry run reads without the lock (it may be a folder it cannot write), so its count may be a moment old.
    with contextlib.nullcontext() if dry_run else cache_lock(folder, wait_s=LOCK_WAIT_S):
        items = items_of(folder)
        since = running_embed_since(folder)
        total, stale = folder_bytes(folder), 0
        for path in folder.glob(f"*/{CACHE_FILE}.*.tmp"):
            if ITEM_NAME.fullmatch(path.parent.name) and not path.parent.is_symlink() and not path.is_symlink():
                with contextlib.suppress(FileNotFoundError):  # a dry run's, unlocked: a writer may rename it
                    total -= path.stat().st_size
                    stale += 1
                    if not dry_run:
                        path.unlink()
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        removed, lines, held = [], [], 0
        for item in items:
            if total <= max_bytes:
                break
            if since is not None and item.last_write >= since and ENTRY_KEY not in (item_metadata(item.path) or {}):
                held += 1
                continue
            removed.append(item)
            lines.append(json.dumps({"id": item.id, "bytes": item.bytes, "last_write": item.last_write,
                                     "pruned": now}) + "\n")
            total -= item.bytes - len(lines[-1].encode())  # the item goes, its line in PRUNED comes
        if removed and not dry_run:
            remove_items(folder, removed, lines)
            total = folder_bytes(folder)
        return PruneReport(removed=removed, kept=len(items) - len(removed), kept_bytes=total, held=held,
                           stale=stale, running=since is not None, bound=max_bytes)


def remove_items(folder: Path, items: list[Item], lines: list[str]) -> None:
    """The items' ``lines`` in ``PRUNED`` first (so no item is gone unaccounted), then each file and its folder
    when left empty. On a full disk, when a prune is most needed, item by item: its line, or where even that finds
    no room, the item first (a kill before its line lands leaves it unlisted; so does one whose removal frees
    nothing, a file held open or kept by a snapshot, and the prune ends there)."""
    try:
        append_synced(folder / PRUNED, "".join(lines).encode())
    except OSError as e:
        if e.errno not in FULL:
            raise
        for item, line in zip(items, lines, strict=True):
            try:
                append_synced(folder / PRUNED, line.encode())
            except OSError as e:
                if e.errno not in FULL:
                    raise
                item.path.unlink(missing_ok=True)
                try:
                    append_synced(folder / PRUNED, line.encode())
                except OSError as e:
                    if e.errno not in FULL:
                        raise
                    raise OutputFaultError(f"{folder}: the disk is full, and removing item {item.id} freed no room "
                                           f"for its line in {PRUNED} (a file held open, or kept by a snapshot): it "
                                           f"is gone unlisted, and its run's readers call it unreadable; free space, "
                                           f"then prune again") from None
    for item in items:
        item.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty (a file not of this package's): kept
            item.path.parent.rmdir()
    fsync_dir(folder)
