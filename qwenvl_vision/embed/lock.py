"""One writer per output folder: ``durable.file_lock`` on ``OUT/embed.lock`` (rank r > 0 of a torchrun job:
``OUT/embed.rank{r}.lock``), held from before a run looks at the folder until it exits.

The kernel drops the lock when the process dies, so SIGKILL leaves no stale lock. Another process on the same
folder, fresh or ``--resume``, gets no lock and stops at once, naming the holder its file names. The file is
removed on exit (``filelock`` takes a lock again whose file was removed meanwhile); a link planted at its name is an
``OutputLinkError`` naming it, and what it points to is untouched.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from ..errors import EmbedError
from ..outputs.durable import file_lock

# A prune's probe (cache_prune) holds a run's lock for an instant: an embed starting then is not turned away.
WAIT_S = 1.0


def lock_name(rank: int) -> str:
    """The lock file of a rank's part of the folder."""
    return "embed.lock" if rank == 0 else f"embed.rank{rank}.lock"


class FolderLock(contextlib.ExitStack):
    """``file_lock(path)`` taken by ``acquire`` (an ``EmbedError`` naming ``what`` and the holder where
    another process holds it), let go by ``release``, which removes the file."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__()
        self.path, self.what = path, what
        self.note = f"pid {os.getpid()} on {socket.gethostname()}\n"  # written into the file: who holds it

    def acquire(self) -> None:
        from filelock import Timeout

        try:
            self.enter_context(file_lock(self.path, WAIT_S, self.note))
        except Timeout:
            holder = ""
            with contextlib.suppress(OSError):
                holder = self.path.read_text(errors="replace")[:200].strip()
            raise EmbedError(f"{self.what} is in use by another embed run{f' ({holder})' if holder else ''}; "
                             f"wait for it to finish, or choose another --out") from None
        self.callback(self.path.unlink, missing_ok=True)  # runs first: the file goes while the lock is still held

    def release(self) -> None:
        with contextlib.suppress(OSError):  # read-only by now: the file is harmless, the lock goes with the process
            self.close()
