"""``embed --engine ray``: the encoding of an embed run as a Ray Data pipeline, after the same setup as the local
engine (lock, run.json checks, resume recovery; ``job.EmbedJob``).

The pipeline: ``ray.data.from_items`` of the inputs still to do (their absolute paths: an actor's working folder
is not the driver's) -> ``map_batches(Embedder)`` on an ``ActorPoolStrategy`` of ``RayPlan.actors`` actors, each
loading the tower once and doing decode, preprocessing and the forward on its batches -> the driver, which writes
each block Ray hands back as one Parquet shard (``parquet_writer.ParquetRankWriter``).

Where each stage runs, and why: decoding and preprocessing run in the actors, next to the forward, with their
own decode threads: that scales with the actors, and what crosses the object store is a path in and the tensors
out (a decoded image's patches are 10-100x its file). The driver writes the shards rather than
``Dataset.write_parquet``: the folder keeps one format and one writer (the folder lock, run.json in every shard's
metadata, shards renamed into place whole, names never reused) whatever the cluster, and ``--out`` need only
be visible to the driver; the cost is that the embeddings travel to the driver.

Resume: the ids already in the output are skipped before the read (``ParquetRankWriter.recover`` then the
``todo`` list here), not ``ray.data.checkpoint.CheckpointConfig``: that (beta) checkpoints a read -> map ->
``write_*`` pipeline by an id column through Ray's own sink, which this driver-written layout does not use, and
its record would be a second truth next to the shards. Here the shards are the only record: an input has a row
or is done again, so a driver killed at any instant resumes with every input exactly once. An actor that dies
mid-batch is restarted by Ray and the batch retried (Ray Data's defaults); its rows come back once.

CPUs and GPUs (``RayPlan``): with ``--device cuda``, one actor per GPU of the cluster (``num_gpus=1``); on CPU,
``--ray-actors`` actors (default: the cluster's CPUs / threads) of ``--threads`` torch threads (default: the
cluster's CPUs / 4, at least 1), their CPU shares cut (``ray.actor_cpus``) so that the read tasks always get a
CPU (else the job hangs). The thread count goes into run.json: CPU results are bitwise those of
``encode_images`` under ``torch.set_num_threads(threads)`` (a resume keeps the recorded count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import EmbedError, OutputFaultError

UDF = None  # the map_batches class (None: qwenvl_vision.ray.Embedder); a test may put a subclass here
BATCH_ROWS = 16  # rows a map_batches batch (and a shard) holds


def driver_load_options(args) -> dict:
    """How the driver loads the tower for run.json (on its own CPU): in the actors' dtype, any attention."""
    import torch

    cuda = (args.device or "cpu").startswith("cuda")
    return {"dtype": args.dtype if args.dtype is not None else (torch.bfloat16 if cuda else None), "attn": "auto"}


@dataclass
class RayPlan:
    """The cluster this run uses and how its actors are laid out on it."""

    started: bool  # this process started the cluster (and stops it)
    device: str
    actors: int
    threads: int
    actor_cpus: float
    actor_gpus: float

    @classmethod
    def start(cls, args, world: int, recorded_threads: int | None, progress) -> RayPlan:
        if world > 1:
            raise EmbedError("--engine ray runs from one driver process, not under torchrun (WORLD_SIZE is set): "
                             "start it once, Ray spreads the work")
        if args.random_weights and (args.device or "").startswith("cuda"):
            raise EmbedError("--engine ray --random-weights --device cuda: the actors would draw other random weights "
                             "on their GPUs than the driver hashes on its CPU; use a checkpoint, or --device cpu")
        try:
            import ray
            import ray.data
        except ImportError:
            raise EmbedError("--engine ray needs Ray Data: pip install 'ray[data]'") from None
        from ..ray import actor_cpus

        started = not ray.is_initialized()
        if started:
            where = f"joining the Ray cluster at {args.ray_address}" if args.ray_address else \
                f"starting a local Ray ({os.cpu_count()} CPUs)"
            progress.note(where)
            try:
                if args.ray_address:
                    ray.init(address=args.ray_address, log_to_driver=not args.quiet, logging_level="warning")
                else:
                    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=not args.quiet,
                             logging_level="warning")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise EmbedError(f"--engine ray: cannot {where.split(' (')[0]}: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # embed's own progress says it
        context.print_on_execution_start = False
        resources = ray.cluster_resources()
        cpus, gpus = int(resources.get("CPU", 1)), int(resources.get("GPU", 0))
        device = args.device or "cpu"
        if device.startswith("cuda"):
            if gpus < 1:
                raise EmbedError("--device cuda: the Ray cluster has no GPU (ray.cluster_resources() lists none)")
            actors = args.ray_actors or gpus
            threads = args.threads or recorded_threads or max(1, (cpus - 1) // actors)
            return cls(started, "cuda", actors, threads, actor_cpus(actors, threads), 1.0)
        threads = args.threads or recorded_threads or max(1, cpus // 4)
        actors = args.ray_actors or max(1, cpus // threads)
        return cls(started, "cpu", actors, threads, actor_cpus(actors, threads), 0.0)

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


def encode_on_ray(job, writer) -> None:
    """Encode the job's inputs still to do on its RayPlan's actors, each block back a shard by `writer`."""
    import ray

    from ..parquet import EmbeddingRecord
    from ..ray import embed_dataset, records_from_batch

    args, plan, progress = job.args, job.ray, job.progress
    todo = [p for p in job.inputs.paths if job.inputs.keys[p] not in writer.done]
    known_bad = [EmbeddingRecord(p, job.inputs.keys[p], "error", job.inputs.errors[p])
                 for p in todo if p in job.inputs.errors]
    todo = [p for p in todo if p not in job.inputs.errors]
    progress.begin(len(todo) + len(known_bad))
    writer.write_records(known_bad)
    progress.update(len(known_bad), 0)
    if not todo:
        progress.close()
        return
    absolute = {p: os.path.abspath(p) for p in todo}
    items = [{"path": absolute[p], "given": p, "realpath": job.inputs.keys[p]} for p in todo]
    blocks = max(1, min(-(-len(items) // BATCH_ROWS), 4 * plan.actors))
    actors = min(plan.actors, blocks)  # an actor with no block to work on would only load the tower
    options: dict[str, Any] = dict(
        column="path", kind="path", min_pixels=args.min_pixels, max_pixels=args.max_pixels,
        resize=job.run["resize"], pooled=args.pooled_only, fps=args.fps, max_batch_tokens=args.batch_tokens,
        max_input_pixels=args.max_input_pixels, decode_bytes=args.decode_mib << 20,
        num_workers=max(1, min(4, plan.threads)), threads=plan.threads, weights_sha256=job.run["weights_sha256"],
        device=plan.device, dtype=job.run["dtype"], attn_impl=args.attn, compile=args.compile)
    if args.random_weights:
        options["random_weights"] = True
    source = job.folder or args.model
    extra = {"udf": UDF} if UDF is not None else {}
    ds = embed_dataset(ray.data.from_items(items, override_num_blocks=blocks), source, concurrency=actors,
                       batch_size=BATCH_ROWS, num_cpus=plan.actor_cpus, num_gpus=plan.actor_gpus or None,
                       **extra, **options)
    try:
        for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
            records = records_from_batch(batch, path_column="given")
            for r in records:  # the actors saw absolute paths; messages name the input as given
                if r.error and absolute[r.path] != r.path:
                    r.error = r.error.replace(repr(absolute[r.path]), repr(r.path))
            writer.write_records(records)
            progress.update(len(records), sum(r.tokens or 0 for r in records))
    except ray.exceptions.RayError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        # Exit 3 as for an output fault: the run stopped, every shard written is whole, --resume finishes it.
        raise OutputFaultError(f"--engine ray: the pipeline failed ({type(e).__name__}: {why}); what was written is "
                               f"kept: run the same command with --resume") from None
    progress.close()
