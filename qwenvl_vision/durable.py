"""Durable file-system steps shared by every writer of outputs (the embed job's shards and manifest, Parquet)."""

from __future__ import annotations

import errno
import os


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
