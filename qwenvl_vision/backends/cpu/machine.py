"""This machine's CPU plan: measured on it once, kept in the user's cache folder, reused by every later process.

A plan is keyed by the machine (CPU model, ISA flags, architecture, torch version, torch threads, oneDNN) and the
probes' revision, and stored as ``{key}.json`` under ``$QWENVL_VISION_CACHE/cpu-plans`` (default
``$XDG_CACHE_HOME/qwenvl-vision`` or ``~/.cache/qwenvl-vision``). Every later process on that machine reuses it, so
two processes choose the same kernels and give the same bits. The file is only an optimisation: one that is corrupt,
truncated, foreign (another machine's key) or invalid is reported in one warning and measured again; two processes
tuning at once take turns on a lock file (the second reads what the first measured). A lock held longer than
``PLAN_LOCK_WAIT_S`` (a stopped process, a stale network-file-system lock) is given up on with one warning: the process
measures for itself and still saves its plan (each file is replaced whole, so the holder's and this process's saves
cannot mix). A folder that cannot be written, or a symbolic link at the lock's or a temporary file's name (never
followed, left as it is), still works: one warning, the plan measured for the process alone. Entries are added as
towers need them (``machine_plan``); an entry once recorded is never measured again. Each measurement is one INFO
line of the ``logging`` logger of this module, with its seconds (the command line shows it; a library's caller sees it
where it configures logging).

Each measurement times the kernels as the backend calls them, on random operands of the shape (the rate depends on
the shape, not on the values).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError, OutputLinkError
from ...model.attention import SegmentPlan
from ...model.layers import MLP, Block, GatedMLP, RMSNorm
from ...outputs.durable import file_lock, open_no_follow, replace_atomically
from .forward import CpuExecution
from .kernels import (
    DEFAULT_CHUNK_BYTES,
    best_seconds,
    gemm_attention,
    onednn_linear_available,
    onednn_packs,
    pack_weight,
    packed_chunks,
)
from .packing import PackedLinear
from .plan import (
    CHUNK_CHOICES,
    DEFAULT_MLP_ROWS,
    DTYPES,
    MLP_ROW_CHOICES,
    PROBE_LENGTHS,
    SCRATCH_CHOICES,
    CpuPlan,
    PlanNeeds,
    attention_key,
    block_key,
    dtype_name,
    linear_key,
    mlp_key,
)
from .workspace import DEFAULT_SCRATCH_ELEMENTS, Workspace

PROBE_TOKENS = 2048  # tokens per attention probe (segments of a length batched up to it): rates, not totals
LINEAR_PROBE_ROWS = 1024  # the towers' packs hold thousands of rows, and the rate flattens by here
MLP_PROBE_ROWS = 2048
BLOCK_PROBE_SEGMENTS = (1024,)  # one frame of a photo's size: on the CPU each item runs as its own forward
# How much faster oneDNN must time than addmm to be chosen, per dtype (for a lone linear, and for a whole MLP
# against its linears' lone choices). fp32: 10%, since oneDNN's rounding is not the reference's; bf16: 5% slower
# still wins, since both round alike there and a packed linear's chunks are consumed while in cache.
ONEDNN_FASTER_BY = {"float32": 1.10, "bfloat16": 0.95}
# Near the best, an MLP's block rows and a block's chunk and scratch sizes time alike within noise (the scratch
# changes no bit; the rows and the chunk may move a last fp32 bit, so a plan records them): a size other than the
# default is taken only where it ran this much faster.
SIZE_FASTER_BY = 1.05
# Raised whenever the probes would choose differently on the same machine (what they time, their margins): a cache
# file of older probes is then another machine key, and its machine is measured afresh. A recorded run's plan is
# not affected: it runs as recorded.
PROBE_REVISION = 2
# How long a load waits for another process tuning this machine before measuring for itself: far longer than any
# tower's measuring takes, far shorter than forever (a stopped holder, a stale network-file-system lock).
PLAN_LOCK_WAIT_S = 60.0
# A plan file is a few kilobytes: anything far larger is not one, and is not read into memory.
MAX_PLAN_FILE_BYTES = 1 << 24
LOG = logging.getLogger(__name__)  # the command line shows its INFO lines; a library's caller configures logging


def measure_linear(in_features: int, out_features: int, dtype: torch.dtype, repeats: int = 3) -> str:
    """The kernel for a (rows, in) x (in, out) product in ``dtype`` here: addmm into a reused output, or oneDNN's
    prepacked linear on row chunks the next step reads as they come (as the backend calls each)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(LINEAR_PROBE_ROWS, in_features, generator=generator).to(dtype)
    bias, out = torch.zeros(out_features, dtype=dtype), torch.empty(LINEAR_PROBE_ROWS, out_features, dtype=dtype)

    def onednn(packed: torch.Tensor) -> None:
        for _ in packed_chunks(x, packed, bias, DEFAULT_CHUNK_BYTES):
            pass

    addmm_s = best_seconds(lambda: torch.addmm(bias, x, weight.t(), out=out), repeats)
    try:
        packed = pack_weight(weight)
        onednn_s = best_seconds(lambda: onednn(packed), repeats)
    except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype: torch's own kernel runs
        warn(f"oneDNN's linear failed for {in_features}x{out_features} {dtype_name(dtype)} ({e}); using addmm")
        return "addmm"
    return "onednn" if onednn_s * ONEDNN_FASTER_BY[dtype_name(dtype)] < addmm_s else "addmm"


def measure_block_sizes(need: tuple, plan: CpuPlan, repeats: int = 3) -> tuple[int, int]:
    """(output bytes per packed linear call of CHUNK_CHOICES, scratch elements of SCRATCH_CHOICES) at which one of
    the tower's blocks ran fastest here, on ``plan``'s kernels, as the backend runs it: BLOCK_PROBE_SEGMENTS frames
    of random tokens through a block of random weights. The chunk is chosen first (on the default scratch; the
    default where no linear runs packed), then the scratch with it; each is the default unless another ran
    SIZE_FASTER_BY faster."""
    mlp, norm, dim, heads, hidden, act, dtype = need
    generator = torch.Generator().manual_seed(0)  # never the caller's random state
    with torch.device("meta"):
        block = Block(dim, heads, hidden, act, norm, mlp)
    block = block.to_empty(device="cpu").requires_grad_(False)
    for module in list(block.modules()):
        if isinstance(module, nn.Linear):
            weight = (torch.randn(module.weight.shape, generator=generator) / module.in_features**0.5).to(dtype)
            module.weight = nn.Parameter(weight, requires_grad=False)
            module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=dtype), requires_grad=False)
            if plan.linear_kernel(module.in_features, module.out_features, dtype) == "onednn":
                PackedLinear.pack_(module)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
            if getattr(module, "bias", None) is not None:
                module.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
    rows = sum(BLOCK_PROBE_SEGMENTS)
    start = torch.randn(rows, dim, generator=generator).to(dtype)
    x = torch.empty_like(start)
    angles = torch.rand(rows, dim // heads, generator=generator) * 6
    segments = SegmentPlan.from_lengths(list(BLOCK_PROBE_SEGMENTS), "cpu")

    def seconds(chunk: int, scratch: int) -> float:
        run = CpuExecution(plan, Workspace.for_blocks(rows, dim, mlp, hidden, dtype, "cpu", scratch), chunk)
        inputs = run.attention_inputs((angles.cos(), angles.sin()), segments)
        return best_seconds(lambda: run.block(block, x.copy_(start), inputs), repeats)

    packed = any(isinstance(m, PackedLinear) for m in block.modules())
    chunk = DEFAULT_CHUNK_BYTES
    if packed:
        chunk = fastest({c: seconds(c, DEFAULT_SCRATCH_ELEMENTS) for c in CHUNK_CHOICES}, DEFAULT_CHUNK_BYTES)
    return chunk, fastest({e: seconds(chunk, e) for e in SCRATCH_CHOICES}, DEFAULT_SCRATCH_ELEMENTS)


def fastest(seconds: dict[int, float], default: int) -> int:
    """The fastest choice, or ``default`` unless that one is SIZE_FASTER_BY faster."""
    best = min(seconds, key=seconds.get)
    return best if seconds[best] * SIZE_FASTER_BY < seconds.get(default, float("inf")) else default


def measure_attention(dtype: torch.dtype, heads: int, head_dim: int, repeats: int = 2) -> dict[str, str]:
    """The attention path per probe length for segments of (heads, head_dim) in ``dtype`` here: SDPA or the GEMM
    form, whichever ran faster on PROBE_TOKENS tokens of such segments."""
    generator = torch.Generator().manual_seed(0)
    choices = {}
    for length in PROBE_LENGTHS:
        count = max(1, PROBE_TOKENS // length)
        q, k, v = (torch.randn(count * length, heads, head_dim, generator=generator).to(dtype) for _ in range(3))
        try:
            sdpa_s, gemm_s = attention_seconds(q, k, v, count, repeats)
        except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype: SDPA runs
            warn(f"GEMM attention failed for {heads}x{head_dim} {dtype_name(dtype)} ({e}); using SDPA")
            sdpa_s, gemm_s = 0.0, float("inf")
        choices[attention_key(dtype, heads, head_dim, length)] = "gemm" if gemm_s < sdpa_s else "sdpa"
    return choices


def attention_seconds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, repeats: int
                      ) -> tuple[float, float]:
    """Seconds of ``count`` equal segments by SDPA (as ``attention.sdpa_batched`` calls it) and by the GEMM form."""
    out, scale = torch.empty_like(q), q.shape[-1] ** -0.5
    length, heads, head_dim = q.shape[0] // count, q.shape[1], q.shape[2]

    def sdpa() -> None:
        split = [x.view(count, length, heads, head_dim).transpose(1, 2) for x in (q, k, v)]
        out.view(count, length, heads, head_dim).transpose(1, 2).copy_(
            F.scaled_dot_product_attention(*split, scale=scale))

    return (best_seconds(sdpa, repeats),
            best_seconds(lambda: gemm_attention(q, k, v, count, scale, out), repeats))


def probe_mlp(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype, packs: tuple[bool, bool],
              generator: torch.Generator) -> nn.Module:
    """An MLP of random weights of this shape, its (first, second) linears packed as ``packs`` says."""
    with torch.device("meta"):
        mlp = (GatedMLP if kind == "gated" else MLP)(dim, hidden, act)
    mlp = mlp.to_empty(device="cpu").requires_grad_(False)
    for module, pack in zip([c for c in mlp.children() if isinstance(c, nn.Linear)], packs, strict=True):
        weight = (torch.randn(module.weight.shape, generator=generator) / module.in_features**0.5).to(dtype)
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=dtype), requires_grad=False)
        if pack:
            PackedLinear.pack_(module)
    return mlp


def measure_mlp(kind: str, dim: int, hidden: int, act: str, dtype: torch.dtype, packs: tuple[bool, bool],
                repeats: int = 2) -> tuple[bool, int]:
    """(whether the MLP runs both linears packed, its rows per block of MLP_ROW_CHOICES: DEFAULT_MLP_ROWS unless
    another ran SIZE_FASTER_BY faster) as it ran fastest here, as the backend runs it. With ``packs`` (the lone
    linears' choices) not both packed, the MLP is timed that way and with both packed: a packed first linear computes
    the activation in its epilogue and lets the MLP run by row blocks, which a lone linear's timing does not see;
    both packed is taken by ONEDNN_FASTER_BY's preference."""
    generator = torch.Generator().manual_seed(0)  # never the caller's random state
    x = torch.randn(MLP_PROBE_ROWS, dim, generator=generator).to(dtype)
    residual = torch.zeros_like(x)
    workspace = Workspace.for_blocks(MLP_PROBE_ROWS, dim, kind, hidden, dtype, "cpu")
    key = mlp_key(kind, dim, hidden, act, dtype)

    def seconds(mlp: nn.Module, rows: int) -> float:
        run = CpuExecution(CpuPlan("probe", mlp={key: rows}), workspace, DEFAULT_CHUNK_BYTES)
        return best_seconds(lambda: run.mlp(mlp, x, residual), repeats)

    both = probe_mlp(kind, dim, hidden, act, dtype, (True, True), generator)
    if not all(packs):
        chosen_s = seconds(probe_mlp(kind, dim, hidden, act, dtype, packs, generator), DEFAULT_MLP_ROWS)
        if seconds(both, DEFAULT_MLP_ROWS) * ONEDNN_FASTER_BY[dtype_name(dtype)] >= chosen_s:
            return False, DEFAULT_MLP_ROWS
    return True, fastest({rows: seconds(both, rows) for rows in MLP_ROW_CHOICES}, DEFAULT_MLP_ROWS)


def measure(needs: PlanNeeds, machine: str, known: CpuPlan | None = None) -> CpuPlan:
    """A plan of ``needs`` measured now, keeping ``known``'s choices (a process may have run with them).

    Linears and attention are timed alone, then each MLP whole, since packing both its linears lets it run by row
    blocks, which a lone linear's timing cannot see; a block's chunk and scratch sizes come last, because they
    depend on the kernels chosen before. Without oneDNN's linear the kernels are torch's, untimed."""
    known = known or CpuPlan(machine)
    with torch.inference_mode(False), torch.no_grad():
        if not onednn_linear_available():
            plan = CpuPlan(machine, dict.fromkeys(needs.linear_keys(), "addmm"),
                           dict.fromkeys(needs.attention_keys(), "sdpa"),
                           dict.fromkeys(needs.mlp_keys(), DEFAULT_MLP_ROWS))
        else:
            # A dtype this CPU's oneDNN cannot pack runs torch's kernels, chosen without a probe or a warning.
            packs_here = {d: onednn_packs(d) for *_, d in needs.linear if dtype_name(d) in DTYPES}
            linear = {linear_key(i, o, d): measure_linear(i, o, d) if packs_here[d] else "addmm"
                      for i, o, d in sorted(needs.linear, key=str) if dtype_name(d) in DTYPES}
            attention = {}
            for d, h, hd in sorted(needs.attention, key=str):
                if dtype_name(d) in DTYPES:
                    attention.update(measure_attention(d, h, hd))
            kernels = CpuPlan(machine, linear).with_entries(known)
            mlp = {}
            for kind, dim, hidden, act, d in sorted(needs.mlp, key=str):
                if dtype_name(d) not in DTYPES:
                    continue
                if not packs_here.get(d, False):
                    mlp[mlp_key(kind, dim, hidden, act, d)] = DEFAULT_MLP_ROWS
                    continue
                shapes = ((dim, 2 * hidden if kind == "gated" else hidden, d), (hidden, dim, d))
                packs = tuple(kernels.linear_kernel(*shape) == "onednn" for shape in shapes)
                rows = DEFAULT_MLP_ROWS  # no row blocks without both linears packed
                both_packed = False
                # A shape recorded before keeps its kernel (a process ran with it). One recorded as addmm keeps
                # the MLP's linears as they are: packing the other would make a mix that was never timed whole.
                kept_unpacked = any(known.linear.get(linear_key(*shape)) == "addmm" for shape in shapes)
                if all(packs) or not kept_unpacked:
                    try:
                        both_packed, rows = measure_mlp(kind, dim, hidden, act, d, packs)
                    except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype
                        warn(f"the {kind} MLP {dim}x{hidden} {dtype_name(d)} failed on oneDNN ({e}); {rows} rows")
                if both_packed and not all(packs):  # the whole MLP ran faster packed: so do its shapes
                    linear.update({linear_key(*shape): "onednn" for shape in shapes})
                    kernels = CpuPlan(machine, linear).with_entries(known)
                mlp[mlp_key(kind, dim, hidden, act, d)] = rows
            plan = CpuPlan(machine, linear, attention, mlp)
        chunks, scratch = {}, {}
        for need in sorted(needs.blocks, key=str):
            if dtype_name(need[6]) not in DTYPES:
                continue
            key = block_key(*need)
            try:
                chunks[key], scratch[key] = measure_block_sizes(need, plan.with_entries(known))
            except RuntimeError as e:  # a oneDNN kernel this CPU cannot run in this dtype
                warn(f"the block {key} failed ({e}); the default chunk and scratch sizes")
                chunks[key], scratch[key] = DEFAULT_CHUNK_BYTES, DEFAULT_SCRATCH_ELEMENTS
    return CpuPlan(machine, plan.linear, plan.attention, plan.mlp, chunks, scratch)


# ----------------------------------------------------------------------------- the machine and its cache file


def machine_identity() -> dict:
    """What a plan's measurements depend on: the CPU (model name and ISA flags), torch, its threads, oneDNN, and
    the probes' revision."""
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
            "isa_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16], "torch": torch.__version__,
            "threads": torch.get_num_threads(), "onednn": onednn_linear_available(), "probes": PROBE_REVISION}


def machine_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def plan_folder() -> Path:
    root = os.environ.get("QWENVL_VISION_CACHE")
    if root:
        return Path(root) / "cpu-plans"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwenvl-vision" / "cpu-plans"


def warn(message: str) -> None:
    warnings.warn(f"qwenvl-vision: {message}", RuntimeWarning, stacklevel=3)


def read_plan_file(path: Path, identity: dict, key: str, quiet: bool = False) -> CpuPlan | None:
    """The plan stored at ``path`` for this machine, or None: missing silently; a symbolic link (never followed),
    not a regular file, unreadable, larger than any plan, corrupt, truncated, foreign or invalid with one warning
    unless ``quiet`` (it is measured again and the file replaced)."""
    try:
        # O_NONBLOCK: a FIFO planted at the name must not block the load; a regular file ignores it.
        fd = open_no_follow(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError("it is not a regular file")
            data = f.read(MAX_PLAN_FILE_BYTES + 1)
        if len(data) > MAX_PLAN_FILE_BYTES:
            raise ConfigError(f"it is larger than any plan ({MAX_PLAN_FILE_BYTES} bytes)")
        text = data.decode()
    except (FileNotFoundError, NotADirectoryError):  # never measured here, or no folder to hold it
        return None
    except (OSError, UnicodeDecodeError, OutputLinkError, ConfigError) as e:
        if not quiet:
            warn(f"cannot read the CPU plan {path} ({e}); measuring this machine again")
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("identity") != identity:
            raise ConfigError("it was measured on another machine, torch or thread count")
        plan = CpuPlan.from_dict({name: value for name, value in data.items() if name != "identity"})
        if plan.machine != key:
            raise ConfigError(f"its key {plan.machine!r} is not this machine's {key!r}")
        # Entries this CPU cannot run (a damaged or edited file): every load would fail on them. (from_dict has
        # refused oneDNN entries where torch has no oneDNN at all.)
        onednn_dtypes = {k.rsplit(":", 1)[1] for k, kernel in plan.linear.items() if kernel == "onednn"}
        cannot = [name for name in sorted(onednn_dtypes) if not onednn_packs(DTYPES[name])]
        if cannot:
            raise ConfigError(f"it runs {cannot[0]} linears on oneDNN, which cannot pack that dtype here")
        return plan
    except (ValueError, RecursionError, ConfigError) as e:  # json's errors are ValueErrors; deep nesting recurses
        if not quiet:
            warn(f"ignoring the CPU plan {path}: {e}; measuring this machine again")
        return None


@contextlib.contextmanager
def plan_lock(folder: Path, key: str) -> Iterator[str | None]:
    """Hold ``{key}.lock`` (one process tunes at a time), waiting at most PLAN_LOCK_WAIT_S for another holder (then
    one warning naming the lock, and on without it). Yields None where the plan may be saved, else why not: the
    folder cannot be made, or a symbolic link sits at the lock's name (never followed, left as it is)."""
    from filelock import Timeout

    lock = folder / f"{key}.lock"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        yield (f"cannot write the CPU plan cache {folder} ({e.strerror or e}): this machine's plan is measured for "
               f"this process only (set QWENVL_VISION_CACHE to a writable folder to keep it)")
        return
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(file_lock(lock, PLAN_LOCK_WAIT_S))
        except OutputLinkError:
            yield (f"{lock} is a symbolic link (not followed, left as it is): this machine's plan is measured for "
                   f"this process only (remove the link, or set QWENVL_VISION_CACHE to another folder, to keep it)")
            return
        except Timeout:
            warn(f"the CPU plan cache's lock {lock} is still held by another process after {PLAN_LOCK_WAIT_S:g} s (a "
                 f"stopped process, or a stale network-file-system lock): going on without it, measuring what the "
                 f"cache lacks here")
        except OSError as e:  # some network file systems refuse locks: tune unlocked, each file still written whole
            warn(f"cannot lock the CPU plan cache {folder} ({e}): a process tuning beside this one may measure too")
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
        stored = read_plan_file(path, identity, key, quiet=True)
        if stored is not None and plan.with_entries(stored).missing(needs).empty():
            PLANS[key] = plan = plan.with_entries(stored)
            return plan
        with plan_lock(folder, key) as unsaved:
            stored = read_plan_file(path, identity, key)
            if stored is not None:
                plan = plan.with_entries(stored)
            missing = plan.missing(needs)
            if not missing.empty():
                start = time.perf_counter()
                measured = measure(missing, key, plan)
                # Without the lock another process may have saved meanwhile: its entries win, so every process on
                # the machine runs one plan (and ours, timed beside its measuring, do not replace them).
                latest = read_plan_file(path, identity, key, quiet=True)
                plan = plan.with_entries(latest).with_entries(measured) if latest is not None else \
                    plan.with_entries(measured)
                if unsaved is None:
                    save_plan(path, plan, identity)
                else:
                    warn(unsaved)
                # A load that measures takes seconds longer than every later one: said once, where it happens.
                LOG.info(f"measured this machine's CPU kernels in {time.perf_counter() - start:.1f} s, once: "
                         + (f"later loads read them from {path}" if unsaved is None else "for this process only"))
        PLANS[key] = plan
        return plan


def save_plan(path: Path, plan: CpuPlan, identity: dict) -> None:
    """``path`` replaced whole by ``plan`` (never through a link at it or at the temporary file's name); a failure
    is one warning."""
    data = json.dumps({**plan.to_dict(), "identity": identity}, indent=1).encode()
    try:
        replace_atomically(path, path.with_name(f"{path.name}.{os.getpid()}.tmp"), lambda f: f.write(data))
    except (OSError, OutputLinkError) as e:
        warn(f"cannot save the CPU plan {path} ({e}): it is measured for this process only")
