"""This machine's CPU plan: measured on it once, kept in the user's cache folder, reused by every later process.

A plan is keyed by the machine (CPU model, ISA flags, architecture, torch version, torch threads, oneDNN, whether the
native kernels build) and the probes' revision, and stored as ``{key}.json`` under ``$QWENVL_VISION_CACHE/cpu-plans``
(default ``$XDG_CACHE_HOME/qwenvl-vision`` or ``~/.cache/qwenvl-vision``), so two processes on a machine choose the same
kernels and give the same bits. The file is only an optimisation: one that does not parse or is another machine's is one
warning and measured again. Two processes tuning at once take turns on a lock file; one held longer than
``PLAN_LOCK_WAIT_S`` (a stopped process) is given up on with one warning, each file being replaced whole; so is a file
system that refuses locks. A folder that cannot be written, or a link at a name it writes (never followed), is one
warning and a plan for the process alone. Entries are added as towers need them (``machine_plan``), measured by
``probes``; an entry once recorded is never measured again. Each measurement is one INFO line of this module's
``logging`` logger.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ...errors import ConfigError, OutputLinkError
from ...outputs.durable import file_lock, open_no_follow, replace_atomically
from .kernels import onednn_linear_available
from .native import NativeKernels, build
from .plan import CpuPlan, PlanNeeds
from .probes import PROBE_REVISION, measure, warn

# How long a load waits for another process tuning this machine before measuring for itself: far longer than any
# tower's measuring takes, far shorter than forever (a stopped holder, a stale network-file-system lock).
PLAN_LOCK_WAIT_S = 60.0
LOG = logging.getLogger(__name__)  # the command line shows its INFO lines; a library's caller configures logging


def machine_identity() -> dict:
    """What a plan's measurements depend on: the CPU, torch, its threads, oneDNN, whether the native kernels build
    here, and the probes' revision."""
    return {**cpu_identity(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "onednn": onednn_linear_available(), "native": native_kernels() is not None, "probes": PROBE_REVISION}


def cpu_identity() -> dict:
    """The CPU: its model name, architecture and ISA flags."""
    name, flags = "", ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:  # the first processor's lines describe the CPU: later ones repeat them
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    return {"cpu": name or platform.processor() or platform.machine(), "arch": platform.machine(),
            "isa_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def machine_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def plan_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("QWENVL_VISION_CACHE") or os.path.join(base, "qwenvl-vision")) / "cpu-plans"


def read_plan_file(path: Path, identity: dict, quiet: bool = False) -> CpuPlan | None:
    """The plan stored at ``path`` for this machine, or None: missing silently, else (a link, never followed, a
    damaged file or another machine's) one warning unless ``quiet``."""
    try:
        with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as f:
            data = json.loads(f.read())
        if not isinstance(data, dict) or data.pop("identity", None) != identity:
            raise ConfigError("it was measured on another machine, torch or thread count")
        return CpuPlan.from_dict(data)
    except (FileNotFoundError, NotADirectoryError):  # never measured here, or no folder to hold it
        return None
    except (OSError, ValueError, OutputLinkError, ConfigError) as e:  # json's errors are ValueErrors
        if not quiet:
            warn(f"ignoring the CPU plan {path} ({e}); measuring this machine again")
        return None


@contextlib.contextmanager
def plan_lock(folder: Path, key: str) -> Iterator[str | None]:
    """Hold ``{key}.lock`` (one process tunes at a time), waiting at most PLAN_LOCK_WAIT_S for another holder (then
    one warning naming the lock, and on without it). Yields None where the plan may be saved, else why not: the
    folder cannot be made or written, or a symbolic link sits at the lock's name (never followed, left as it is)."""
    from filelock import Timeout

    lock = folder / f"{key}.lock"
    with contextlib.ExitStack() as held:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held.enter_context(file_lock(lock, PLAN_LOCK_WAIT_S))
        except Timeout:  # a TimeoutError, so an OSError: caught first
            warn(f"the CPU plan cache's lock {lock} is still held by another process after {PLAN_LOCK_WAIT_S:g} s (a "
                 f"stopped process, or a stale network-file-system lock): going on without it, measuring what the "
                 f"cache lacks here")
        except (OSError, NotImplementedError, OutputLinkError) as e:
            if folder.is_dir() and not isinstance(e, OutputLinkError) and getattr(e, "errno", None) not in (
                    errno.EACCES, errno.EPERM, errno.EROFS):
                # Some network file systems (Lustre without flock, NFS without lockd) refuse locks: tune unlocked,
                # and still save, each file written whole.
                warn(f"cannot lock the CPU plan cache {folder} ({e}): a process tuning beside this one may measure "
                     f"too")
                yield None
                return
            yield (f"cannot use the CPU plan cache {folder} ({getattr(e, 'strerror', None) or e}): this machine's "
                   f"plan is measured for this process only (set QWENVL_VISION_CACHE to a writable folder to keep it)")
            return
        yield None


# Process-wide memo of plans by machine key: strings only (no tensor, no model), so every tower of a process runs
# one plan; the lock makes concurrent loads measure once.
PLANS: dict[str, CpuPlan] = {}
PLANS_LOCK = threading.Lock()


def machine_plan(needs: PlanNeeds) -> CpuPlan:
    """This machine's plan, holding an entry for every need: read from the cache file, what it lacks measured now
    and saved (see the module docstring)."""
    identity = machine_identity()
    key = machine_key(identity)
    with PLANS_LOCK:
        plan = PLANS.get(key, CpuPlan(key))
        if plan.missing(needs).empty():
            return plan
        folder = plan_folder()
        path = folder / f"{key}.json"
        # A file that holds every need is read without the lock (files are replaced whole, so a reader beside a
        # writer sees one of them): loads do not queue behind a process that tunes another tower.
        stored = read_plan_file(path, identity, quiet=True)
        if stored is not None and plan.with_entries(stored).missing(needs).empty():
            PLANS[key] = plan = plan.with_entries(stored)
            return plan
        with plan_lock(folder, key) as unsaved:
            stored = read_plan_file(path, identity)
            if stored is not None:
                plan = plan.with_entries(stored)
            missing = plan.missing(needs)
            if not missing.empty():
                start = time.perf_counter()
                measured = measure(missing, key, plan, native_kernels())
                # Without the lock another process may have saved meanwhile: its entries win, so every process on
                # the machine runs one plan (and ours, timed beside its measuring, do not replace them).
                plan = plan.with_entries(read_plan_file(path, identity, quiet=True) or CpuPlan(key))
                plan = plan.with_entries(measured)
                if unsaved is None:
                    save_plan(path, plan, identity)
                else:
                    warn(unsaved)
                # A load that measures takes seconds longer than every later one: said once, where it happens.
                LOG.info(f"measured this machine's CPU kernels in {time.perf_counter() - start:.1f} s, once: "
                         + (f"later loads read them from {path}" if unsaved is None else "for this process only"))
        PLANS[key] = plan
        return plan


# Process-wide: the native kernels once built and loaded (a library handle, no tensor), or None where they cannot be.
NATIVE: dict[str, NativeKernels | None] = {}
NATIVE_LOCK = threading.Lock()


def native_kernels() -> NativeKernels | None:
    """This CPU's ``native`` kernels, built into the cache folder's ``cpu-native`` once; None (said once) where they
    cannot be built or loaded here."""
    with NATIVE_LOCK:
        if "kernels" in NATIVE:
            return NATIVE["kernels"]
        NATIVE["kernels"] = None  # before the warning: one made an error is not retried
        try:
            NATIVE["kernels"] = build(plan_folder().parent / "cpu-native", machine_key(cpu_identity()))
        except (OSError, ValueError, AttributeError, subprocess.SubprocessError) as e:
            said = (getattr(e, "stderr", None) or b"").decode(errors="replace").splitlines()
            cause = next((line for line in said if "error" in line), said[-1] if said else e)
            warn(f"cannot build the native CPU kernels ({cause}): the modules' own ops run instead")
        return NATIVE["kernels"]


def save_plan(path: Path, plan: CpuPlan, identity: dict) -> None:
    """``path`` replaced whole by ``plan`` (never through a link); a failure is one warning."""
    data = json.dumps({**plan.to_dict(), "identity": identity}, indent=1).encode()
    try:
        replace_atomically(path, path.with_name(f"{path.name}.{os.getpid()}.tmp"), lambda f: f.write(data))
    except (OSError, OutputLinkError) as e:
        warn(f"cannot save the CPU plan {path} ({e}): it is measured for this process only")
