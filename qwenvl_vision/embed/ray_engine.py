"""``embed --engine ray``: the encoding of an embed run as a Ray Data pipeline, after the same setup as the local
engine (``job.EmbedJob``). docs/embed.md ("Many machines: Ray Data") says where each stage runs, how the actors are
laid out on the cluster (``RayPlan``) and what they load (``actor_source``).

``ray.data.from_items`` of the inputs still to do (absolute paths) -> ``map_batches(Embedder)`` -> the driver, which
records each block as the local engine records a batch (``EmbedJob.encode``). The driver writes rather than
``Dataset.write_parquet``: the folder keeps one format and one writer (the folder lock, run.json in every shard's
metadata, shards renamed into place whole, names never reused) whatever the cluster, and ``--out`` need only be
visible to the driver; the cost is that the embeddings travel to the driver. So a resume skips what the output holds
(``todo``): Ray's ``CheckpointConfig`` would be a second truth next to the shards.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.data
import torch

from ..devices import resolve_dtype
from ..errors import ConfigError, EmbedError, ForwardFaultError, OutputFaultError, first_line
from ..inputs.pixels import is_url
from ..model.attention import resolve_attn_impl
from ..outputs.records import EmbeddingRecord
from .ray import actor_cpus, embed_dataset, records_from_batch

BATCH_ROWS = 16  # rows a map_batches batch holds
TASK_BATCHES = 4  # a task's batches at most: its decoder reads ahead across them, the driver gets its rows at its end
CONNECT_TIMEOUT_S = 10.0  # a cluster's head answers a TCP connect in well under this, across regions too


def local_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, cgroup cpusets), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_reachable(address: str) -> None:
    """A head's ``host:port`` that nothing answers at is refused here: ``ray.init`` retries it without end.
    ``auto`` and ``ray://`` (Ray Client, which gives up on its own) are left to Ray, as is a form Ray refuses."""
    host, _, port = address.rpartition(":")
    if "://" in address or not (port.isascii() and port.isdigit()) or ":" in host and not host.startswith("["):
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise EmbedError(f"Ray address {address}: no Ray head answers there ({e.strerror or e})") from None


def check_attn(args, device: str) -> None:
    """--attn on the actors' device and dtype, refused before anything is written (else every actor fails to load
    the tower, and a resume again). Without a GPU here, a CUDA actor's backend is checked as far as the driver can:
    the fused kernels run in float16/bfloat16 only."""
    cuda = device.startswith("cuda")
    dtype = resolve_dtype(args.dtype, torch.device("cuda" if cuda else "cpu"))
    if not cuda or torch.cuda.is_available():
        resolve_attn_impl(args.attn, "cuda" if cuda else "cpu", dtype)
    elif args.attn not in ("auto", "sdpa") and dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"attn_impl {args.attn!r} is not available: it runs on CUDA in float16/bfloat16 only "
                          f"(the actors: cuda, {dtype})")


@dataclass
class RayPlan:
    """The cluster this run uses and how its actors are laid out on it."""

    started: bool  # this process called ray.init (and shuts Ray down)
    local: bool  # a Ray this process started on this machine: the actors see the driver's folders
    device: str
    actors: int
    threads: int
    actor_cpus: float
    actor_gpus: float

    @classmethod
    def start(cls, args, world: int, recorded_threads: int | None, progress) -> RayPlan:
        """Join or start Ray and lay the actors out; a Ray this call started is shut down again if the plan
        cannot be made (no GPU in the cluster, say)."""
        if world > 1:
            raise EmbedError("--engine ray runs from one driver process, not under torchrun (WORLD_SIZE is set): "
                             "start it once, Ray spreads the work")
        if args.random_weights and args.device == "cuda":
            raise EmbedError("--engine ray --random-weights --device cuda: the actors would draw other random weights "
                             "on their GPUs than the driver hashes on its CPU; use a checkpoint, or --device cpu")
        # Ray Data's console: its notices unless --quiet (its log files keep everything). A failed pipeline's stack
        # trace, which it logs before raising, is left out but with --debug: the failure is the command's one line.
        for handler in logging.getLogger("ray.data").handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                if args.quiet:
                    handler.setLevel(logging.ERROR)
                (handler.removeFilter if getattr(args, "debug", False) else handler.addFilter)(below_error)
        started = not ray.is_initialized()
        # ray.init joins RAY_ADDRESS (which `ray job submit` sets) when given "auto" or no address: so does the check.
        # No address (or "local") is passed as "local": ray.init would otherwise join a `ray start` of this machine.
        address = (args.ray_address in (None, "auto") and os.environ.get("RAY_ADDRESS")) or args.ray_address
        joined = address not in (None, "local")
        if started:
            where = f"joining the Ray cluster at {address}" if joined else \
                f"starting a local Ray ({local_cpus()} CPUs)"
            progress.note(where)
            # ray.init installs its own SIGTERM handler (it exits with status 15, without a word): the command's
            # own (qwenvl_vision.cli: stopped as Ctrl-C stops it, exit 143) is put back once Ray is up.
            main_thread = threading.current_thread() is threading.main_thread()
            on_sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
            logs = dict(log_to_driver=not args.quiet, logging_level="error" if args.quiet else "warning")
            try:
                if joined:
                    check_reachable(address)
                    ray.init(address=address, **logs)
                else:
                    ray.init(address="local", num_cpus=local_cpus(), include_dashboard=False, **logs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise EmbedError(f"--engine ray, {where.split(' (')[0]}: {first_line(e)}") from None
            finally:
                if on_sigterm is not None:
                    signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return cls._plan(args, started, started and not joined, recorded_threads, progress.note)
        except BaseException:
            if started:
                ray.shutdown()
            raise

    @classmethod
    def _plan(cls, args, started: bool, local: bool, recorded_threads: int | None, note) -> RayPlan:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # embed's own progress says it
        context.print_on_execution_start = False
        resources = ray.cluster_resources()
        cpus, gpus = int(resources.get("CPU", 1)), int(resources.get("GPU", 0))
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]] or [resources]  # an actor runs on one of them
        # No --device: cuda where the cluster has GPUs, as the local engine takes cuda where there is one (random
        # weights stay on the CPU: the actors' GPUs would draw other weights than the driver hashes).
        device = args.device or ("cuda" if gpus and not args.random_weights else "cpu")
        check_attn(args, device)
        if device.startswith("cuda"):
            if gpus < 1:
                raise EmbedError("--device cuda: the Ray cluster has no GPU (ray.cluster_resources() lists none)")
            if args.ray_actors and args.ray_actors > gpus:
                raise EmbedError(f"--ray-actors {args.ray_actors}: the Ray cluster has {gpus} GPU"
                                 f"{'s' if gpus != 1 else ''} and each actor takes one (the rest would wait forever)")
            actors = args.ray_actors or gpus
            per_gpu = min((n.get("CPU", 0) // min(n["GPU"], actors) for n in nodes if n.get("GPU", 0) >= 1),
                          default=cpus)  # a GPU node's CPUs, shared by the actors it holds
            threads = args.threads or recorded_threads or max(1, min((cpus - 1) // actors, int(per_gpu)))
            return cls(started, local, "cuda", actors, threads, placed(actors, threads, 1.0, nodes, local, note), 1.0)
        threads = args.threads or recorded_threads or max(1, min(cpus // 4, int(max(n.get("CPU", 0) for n in nodes))))
        actors = args.ray_actors or max(1, sum(int(n.get("CPU", 0) // threads) for n in nodes))
        return cls(started, local, "cpu", actors, threads, placed(actors, threads, 0.0, nodes, local, note), 0.0)

    def stop(self) -> None:
        if self.started:
            ray.shutdown()
            self.started = False


def below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def placed(actors: int, threads: int, gpus: float, nodes: list[dict], local: bool, note) -> float:
    """The CPUs each actor asks for (``actor_cpus``), beside ``gpus``. Ray places an actor on one node that has all
    it asks for, and Ray Data waits for every actor without end: actors the nodes cannot hold are refused on a local
    Ray, and said on a cluster, whose autoscaler may add nodes."""
    cpus = actor_cpus(actors, threads)
    room = sum(min(int(n.get("CPU", 0) / cpus + 1e-9), int(n.get("GPU", 0) // gpus) if gpus else actors)
               for n in nodes)
    if room < actors:
        sizes = ", ".join(f"{n.get('CPU', 0):g}" + (f"+{n.get('GPU', 0):g} GPU" if gpus else "") for n in nodes[:8])
        line = (f"{actors} Ray actors of {cpus:g} CPUs{' and a GPU' if gpus else ''} each do not fit on the "
                f"cluster's nodes (CPUs: {sizes}{', ...' if len(nodes) > 8 else ''})")
        if local:
            raise EmbedError(f"{line}, and Ray would wait for them forever: use fewer --ray-actors or --threads")
        note(f"{line} now: they wait for nodes an autoscaler adds, or forever")
    return cpus


def encode_on_ray(job, todo: list[str]) -> Iterator[list[EmbeddingRecord]]:
    """The records of ``todo`` (inputs of the job), encoded on its RayPlan's actors, as Ray hands their rows back.

    Errors: a failure of the pipeline itself (an actor that cannot load the tower, Ray's timeouts, a lost node) is
    one line: ``EmbedError`` (exit 2) when an actor's constructor raised (another checkpoint, a model folder or
    a module missing on a node: it would fail again), ``ForwardFaultError`` (exit 4) when an
    actor's device failed a forward, else ``OutputFaultError`` (exit 3, ``--resume``)."""
    if not todo:
        return
    args, plan = job.settings, job.ray
    # Joined, never normalised: a shard member's name is found in its shard as written (./x), and a file's path
    # resolves as the OS resolves it (a/../b through a linked a).
    absolute = {p: p if is_url(p) or os.path.isabs(p) else os.path.join(os.getcwd(), p) for p in todo}
    items = [{"path": absolute[p], "given": p, "realpath": job.inputs.keys[p]} for p in todo]
    # Four tasks an actor, of at most TASK_BATCHES batches: Ray hands a task's rows on in blocks of up to 128 MiB, so
    # a larger task's would reach the driver (progress, shards, what a killed driver keeps) only once thousands of
    # pooled vectors were encoded; a task a batch would start each batch with a cold decoder (bench.ray_overhead).
    blocks = max(1, min(-(-len(items) // BATCH_ROWS), 4 * plan.actors), -(-len(items) // (BATCH_ROWS * TASK_BATCHES)))
    actors = min(plan.actors, blocks)  # an actor with no block to work on would only load the tower
    options: dict[str, Any] = dict(
        column="path", kind="path", identity_column="realpath", **job.encode_options(), fps=args.fps,
        num_workers=max(1, min(4, plan.threads)), threads=plan.threads, weights_sha256=job.run["weights_sha256"],
        package_version=job.run["package_version"], device=plan.device, dtype=job.run["dtype"], attn_impl=args.attn,
        compile=args.compile)
    if plan.device == "cpu" and job.run.get("cpu_plan"):
        options["cpu_kernels"] = job.run["cpu_plan"]  # the run's CPU plan: its very bits on every actor
    if args.random_weights:
        options["random_weights"] = True
    source = actor_source(job, options)
    ds = embed_dataset(ray.data.from_items(items, override_num_blocks=blocks), source, concurrency=actors,
                       batch_size=BATCH_ROWS, num_cpus=plan.actor_cpus, num_gpus=plan.actor_gpus or None,
                       **options)
    video_fps = job.run["video"]["fps"]  # run.json always records it
    # Ray skips a retried task's outputs by their place among its blocks, which a block's size decides: rows that
    # come out otherwise on the retry (a fetch that fails this time) may come back twice, or not at all.
    left = set(todo)
    batches = iter(ds.iter_batches(batch_format="pyarrow", batch_size=None))
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001 - Ray's own errors, an actor's, ExecutionTimeoutError: one line each
            raise pipeline_error(e) from e  # --debug shows the cause
        if batch is None:
            break
        records = [r for r in records_from_batch(batch, path_column="given") if r.path in left]
        left.difference_update(r.path for r in records)
        for r in records:  # the actors saw absolute paths; messages name the input as given
            if r.error and absolute[r.path] != r.path:
                r.error = r.error.replace(repr(absolute[r.path]), repr(r.path)).replace(absolute[r.path], r.path)
            # Ray's rows carry the Parquet video struct, which has no requested_fps: the actors sampled at the
            # run's fps, which the local engine records (and an Omni model's hand-off needs).
            if r.video is not None:
                r.video.setdefault("requested_fps", video_fps)
            r.columns = job.inputs.columns.get(r.path)  # the table row's columns stay with the driver
        job.progress.update(len(records), sum(r.tokens or 0 for r in records))
        yield records
    lost = [EmbeddingRecord(p, job.inputs.keys[p], "error", error=f"{p}: its row was lost in Ray's retry of a task "
                            f"whose actor died; --resume encodes it", columns=job.inputs.columns.get(p))
            for p in todo if p in left]
    if lost:
        job.progress.update(len(lost), 0)
        yield lost


def actor_source(job, options: dict) -> str:
    """What the actors load: the driver's checkpoint folder on a local Ray this process started, else,
    for a checkpoint from the Hub, its repo id pinned to the run's revision (another machine has no such folder,
    or another snapshot in its cache), with --local-files-only passed on."""
    args = job.settings
    if job.folder is None:
        return args.model
    if job.ray.local:
        return job.folder
    from ..checkpoint.hub import looks_like_repo_id

    if looks_like_repo_id(args.model):
        options["revision"] = job.run.get("revision") or args.revision
        options["local_files_only"] = bool(args.local_files_only)
        return args.model
    return job.folder  # a local folder: every node must see it at this path


# What an actor's constructor raises the package's way (load_encoder's errors, the weights-hash check), as Ray's
# message quotes it (the exception Ray raises is its own, wrapping the actor's traceback).
_SETUP_ERRORS = re.compile(r"\b(ConfigError|CheckpointError): (.+)")
_DEVICE_FAULT = re.compile(r"\bForwardFaultError: (.+)")  # a forward that failed for the machine's reasons


def pipeline_error(e: BaseException) -> EmbedError | ForwardFaultError:
    """The one-line error for a failed pipeline (see ``encode_on_ray``)."""
    text = str(e)
    if fault := list(_DEVICE_FAULT.finditer(text)):  # as the local engine stops (exit 4)
        return ForwardFaultError(f"--engine ray, on an actor: {fault[-1].group(1).strip()[:300]}")
    why = (text.strip().splitlines() or [type(e).__name__])[-1][:300]
    if own := list(_SETUP_ERRORS.finditer(text)):  # the package's way, whatever Ray's text around it
        why = f"{own[-1].group(1)}: {own[-1].group(2).strip()[:300]}"
    if own or "creation task" in text:  # an actor's constructor raised: the same would happen on every try
        return EmbedError(f"--engine ray: an actor could not start ({why}); fix that, then run the same command "
                          f"with --resume (what was written is kept)")
    # Exit 3 as for an output fault: the run stopped, every shard written is whole, --resume finishes it.
    return OutputFaultError(f"--engine ray: the pipeline failed ({type(e).__name__}: {why}); what was written is "
                            f"kept: run the same command with --resume")
