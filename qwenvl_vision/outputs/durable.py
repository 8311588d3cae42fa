"""Durable, link-safe file-system steps shared by every writer of outputs (the embed job's shards and manifest,
Parquet, the vLLM cache, extract-weights, the CPU plan cache), and the one file lock they all take (``file_lock``).

A name this package writes is never followed if it is a symbolic link: somebody else's link at a lock or
temporary file's name could otherwise make us truncate and write the file it points to (a Hugging Face cache
blob, another user's data). Such a link is an error naming it, and is left where it is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import OutputLinkError


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames in ``folder`` durable (its entries are data too)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_link(path: str | os.PathLike) -> None:
    """Raise ``OutputLinkError`` if ``path`` is a symbolic link (dangling or not)."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise OutputLinkError(f"{path} is a symbolic link where this program writes a file of its own; "
                                  f"it was left as it is: remove it (or choose another folder) and run again")
    except FileNotFoundError:
        pass


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``; a link at ``path`` is an ``OutputLinkError`` naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a link
            refuse_link(path)
        raise


def create_new(path: str | os.PathLike, mode: int = 0o644) -> BinaryIO:
    """A new file at ``path`` opened for writing, created exclusively (never through a link, never another
    process's file). A leftover regular file of that name (a killed writer's temporary file: the caller names it)
    is replaced; a link there is an ``OutputLinkError``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = open_no_follow(path, flags, mode)
    except FileExistsError:
        refuse_link(path)
        os.unlink(path)
        fd = open_no_follow(path, flags, mode)
    return os.fdopen(fd, "wb")


def append_synced(path: str | os.PathLike, data: bytes) -> None:
    """Append ``data``, fsynced (a kill leaves at most a torn last line, which the next append ends first, so that
    the lines it brings are read whole; a write cut short by a full disk is taken back), never through a link (one at
    the name would make us append to the file it points to)."""
    fd = open_no_follow(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        end = os.fstat(fd).st_size
        if end and os.pread(fd, 1, end - 1) != b"\n":
            data = b"\n" + data
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, end)  # needs no room
            raise
    finally:
        os.close(fd)


def replace_atomically(path: Path, tmp: Path, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """``path`` written whole or not at all: ``write(file)`` into ``tmp`` (same folder: a rename across file systems
    would not be atomic), fsynced, renamed into place, the folder fsynced. Any failure leaves no ``tmp`` behind.
    The caller names ``tmp``: each writer's recovery knows its own temporary files by name. ``tmp`` is created
    exclusively and never through a link; the rename replaces a link at ``path`` itself, never what it points to."""
    try:
        with create_new(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OutputLinkError:
        raise  # the link is somebody else's: left as it is
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, wait_s: float | None = None, note: str = "") -> Iterator[None]:
    """Hold ``path``'s lock (``filelock``: ``flock`` on Unix, which the kernel drops when its process dies, so no lock
    is ever stale); ``filelock.Timeout`` after ``wait_s`` seconds (None: as long as it takes), the ``OSError`` of a
    file system that refuses locks. ``note`` is written into the file once held (who holds it, for the process it
    turns away). A link at ``path`` is an ``OutputLinkError`` naming it, never followed."""
    from filelock import FileLock

    def write_note(fd: int) -> None:
        with contextlib.suppress(OSError):  # only a message: a full disk must not refuse the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
            os.fsync(fd)  # a network file system's other clients read it (embed's ranks on other nodes)

    # No soft fallback where flock is missing: a marker file would need a guess at its staleness.
    lock = FileLock(path, timeout=-1 if wait_s is None else wait_s, fallback_to_soft=False,
                    on_acquired=write_note if note else None)
    try:
        lock.acquire()
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a link
            refuse_link(path)
        raise
    try:
        yield
    finally:
        lock.release()


def lock_held(path: str | os.PathLike) -> bool:
    """Whether a process holds ``file_lock(path)`` now; read only (never creates the file), the probe's own hold
    lasts an instant."""
    from filelock import lock_descriptor

    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return not lock_descriptor(fd, blocking=False)
    finally:
        os.close(fd)  # releases the probe's hold
