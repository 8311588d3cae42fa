"""Durable file-system steps shared by every writer of outputs (the embed job's shards and manifest, Parquet)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames in ``folder`` durable (its entries are data too)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def replace_atomically(path: Path, tmp: Path, write: Callable[[BinaryIO], object]) -> None:
    """``path`` written whole or not at all: ``write(file)`` into ``tmp`` (same folder: a rename across file systems
    would not be atomic), fsynced, renamed into place, the folder fsynced. Any failure leaves no ``tmp`` behind.
    The caller names ``tmp``: each writer's recovery knows its own temporary files by name."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
