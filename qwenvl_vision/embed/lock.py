"""One writer per output folder: an exclusive ``fcntl.flock`` held from before a run looks at the folder until
it exits.

Rank 0 locks ``OUT/embed.lock``, rank r > 0 of a torchrun job ``OUT/embed.rank{r}.lock``. The kernel drops the
lock when the process dies, so SIGKILL leaves no stale lock. Another process on the same folder, fresh or
``--resume``, gets no lock and stops at once. The lock file is removed on exit; taking a lock checks that the
file still is the one on disk, so that removal cannot let two processes in. The lock file is opened without
following links: a link planted at its name is an ``OutputLinkError`` naming it, and what it points to is untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from ..errors import OutputInUseError
from ..outputs.durable import open_no_follow


def holder_line() -> str:
    """Who holds a lock: the process, its host, and (where Linux says) the boot and the pid namespace the process
    id means something in."""
    boot, namespace = "-", "-"
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip() or "-"
    with contextlib.suppress(OSError):
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    return f"pid {os.getpid()} on {socket.gethostname()} boot {boot} pidns {namespace}"


def lock_name(rank: int, world: int) -> str:
    """The lock file of a rank's part of the folder."""
    return "embed.lock" if rank == 0 else f"embed.rank{rank}.lock"


class FolderLock:
    """An exclusive ``fcntl.flock`` on a lock file; the kernel releases it when the process dies.

    ``release`` removes the file while still holding the lock. A process that opened the file just before
    and takes the lock just after would hold a lock on a removed file, so ``acquire`` checks that the file
    it locked still is the one at the path, and starts again if not.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip().split(" boot ")[0]
                os.close(fd)
                raise OutputInUseError(f"{self.what} is in use by another embed run"
                                       f"{f' ({holder})' if holder else ''}; wait for it to finish, "
                                       f"or choose another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        try:  # who holds it, for the message another process prints and for a prune (``cache_prune``) to tell a
            # lock file its process left behind; best effort (the disk may be full)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder_line()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:  # read-only by now: the stale file is harmless, the lock goes with the descriptor
            pass
        os.close(self.fd)
        self.fd = None
