"""One embed run, start to end: ``run_embed`` (what ``qwenvl-vision embed`` calls) and ``EmbedJob``, one
process's part of it: check everything and take the folder's lock (nothing written), load the encoder, write
run.json, encode this rank's inputs batch by batch through the format's ``writer.Writer``, merge the ranks' parts.

Formats: ``--format safetensors`` writes through ``writer.RankWriter`` (shards + manifest), ``--format parquet``
through ``parquet_writer.ParquetRankWriter`` (shards that are their own manifest), ``--format vllm-cache`` through
``cache_writer.CacheRankWriter`` (a vLLM encoder-cache folder + manifest); the lock, the run.json checks,
resume, ranks and exit codes are the same. ``--engine ray`` runs the encoding as a Ray Data pipeline
(``ray_engine.encode_on_ray``) after the same setup, the driver writing Parquet shards (or encoder-cache items) as
rows come back.

Threads: run.json records the torch threads of every forward (``threads``): ``--threads``, else a resumed run's,
else torch's default here (the Ray engine: each actor's). CPU results are bitwise equal only at the same count,
so ``encode_images`` under ``torch.set_num_threads(run["threads"])`` gives a run's very tensors.

Ranks: under ``torchrun`` each rank writes ``shard-r{rank}-*.safetensors`` and ``manifest.rank{rank}.jsonl``
(its share of rank 0's list of the inputs: ``inputs.shard_for_rank``; a rank's own listing may differ, e.g. a file
that arrived while the ranks started, and would split the inputs otherwise); the ranks agree (gloo) that every one
of them got its lock and passed the checks before anything is written, and after a barrier rank 0 merges the parts
into ``manifest.jsonl``.

Exit codes: 0 every input embedded; 1 the run finished and some inputs failed (see the manifest); 2 usage or
setup error, nothing written; 3 the run stopped on an I/O fault writing the output, nothing recorded is lost
and ``--resume`` finishes it; 4 the run stopped because a forward failed for the machine's reasons (a probe of
the device failed too; otherwise, and on out of memory, the batch is retried item by item and an input that fails
alone is a failed input), nothing recorded is lost and ``--resume`` goes on. Under torchrun a finished run exits 0
on every rank even when some inputs failed (the summary line says how many): torchrun treats any other exit as a
crash and kills the other ranks.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    EmbedError,
    ForwardFaultError,
    OutputFaultError,
    PeerFailedError,
    QwenVLVisionError,
    exit_code_of,
)
from ..inputs.item_ids import IDENTITY_FIELDS
from ..outputs.durable import refuse_link
from ..outputs.records import EmbeddingRecord, record_from_result
from ..outputs.vllm_cache import check_cache_folder, claim_cache_folder
from .args import EmbedSettings
from .inputs import MEDIA_EXTENSIONS, Inputs, gather_inputs, rank_and_world, shard_for_rank
from .lock import FolderLock, lock_name
from .manifest import MANIFEST, PARQUET_SHARD_NAME, RUN_FILE, file_identity, file_of, part_name, record_key
from .progress import Progress
from .reader import older_plan, read_manifest_lines, read_run
from .run_record import compare_runs, crossed_bounds_note, describe_run
from .shards import items_of
from .writer import OUTPUT_FAULTS, RankWriter, Writer, atomic_write_text, merge_parts, output_fault


def _make_dirs(out: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, deepest last (removed again if setup fails)."""
    missing = []
    folder = out.absolute()
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    out.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _holds_run(out: Path) -> bool:
    """Whether `out` holds (part of) a run: a fresh run there would mix two runs' files."""
    return (out / RUN_FILE).exists() or (out / MANIFEST).exists() or any(out.glob("manifest.rank*.jsonl")) \
        or any(out.glob("shard-r*.safetensors")) \
        or any(PARQUET_SHARD_NAME.match(p.name) for p in out.glob("shard-r*.parquet"))


class _Group:
    """The torchrun process group (gloo), or nothing for a single process."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        if world > 1:
            import torch.distributed as dist

            # A rank that finishes its part early waits for the slowest at the barrier: gloo's default 30 min
            # timeout is too short for hours-long jobs. A rank that dies closes its sockets, which the others
            # notice at once, so the long timeout does not make them hang.
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed; a failing rank raises its own error, the others stop quietly."""
        code = 0 if error is None else exit_code_of(error)
        if self.world > 1:
            import torch.distributed as dist

            flag = torch.tensor([code])
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except RuntimeError as e:  # a rank died (torch.distributed reports it as a RuntimeError)
                raise OutputFaultError(f"rank {self.rank}: another rank stopped ({e})") from None
            if error is None and flag.item():
                raise PeerFailedError(int(flag.item()))
        if error is not None:
            raise error

    def barrier(self) -> None:
        self.agree(None)

    def share(self, value: Any) -> Any:
        """Rank 0's value, on every rank (a fresh run's run.json: one run id for every rank's shards)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _pick_device(args: EmbedSettings, rank: int, world: int) -> str | None:
    """--device, else cuda when there is one (None: the encoder's default); under torchrun cuda:LOCAL_RANK."""
    device = args.device
    if device is None and torch.cuda.is_available():
        device = "cuda"
    if device and device.startswith("cuda") and world > 1:  # one GPU per local rank
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % max(torch.cuda.device_count(), 1)}"
    return device


def _load(args: EmbedSettings, device: str | None, progress: Progress, dtype=None, attn: str | None = None,
          cpu_plan: dict | str | None = None):
    """The encoder, and the checkpoint folder it came from (None for random weights); says what it does.
    ``dtype`` and ``attn`` default to the options (the Ray driver loads on its CPU in the actors' dtype);
    ``cpu_plan`` is a resumed run's recorded CPU plan (its very bits) or "reference" (a Ray driver whose actors run
    on GPUs: no CPU plan to measure), else this machine's runs."""
    from ..checkpoint.hub import looks_like_repo_id, resolve_folder
    from ..devices import resolve_device, resolve_dtype
    from ..loading import load_encoder
    from ..model.attention import resolve_attn_impl

    dtype = args.dtype if dtype is None else dtype
    attn = args.attn if attn is None else attn
    where = str(resolve_device(device))
    resolve_attn_impl(attn, where, resolve_dtype(dtype, torch.device(where)))  # before any fetch or read
    start = time.perf_counter()
    if args.random_weights:
        progress.note(f"building {args.model} with random weights on {where}")
        encoder = load_encoder(args.model, device=device, dtype=dtype, random_weights=True,
                               compile=args.compile, attn_impl=attn, cpu_kernels=cpu_plan or "auto")
        folder = None
    else:
        if looks_like_repo_id(args.model):
            progress.note(f"fetching config, index and vision shards of {args.model} from the Hugging Face Hub "
                          f"(or its local cache)")
        resolved = resolve_folder(args.model, args.revision, args.local_files_only, None, None)
        shards, size = _vision_shards(resolved)
        progress.note(f"reading {shards} shard{'s' if shards != 1 else ''} with the vision tensors "
                      f"({_size(size)}) from {resolved} onto {where}")
        encoder = load_encoder(resolved, device=device, dtype=dtype, compile=args.compile, attn_impl=attn,
                               cpu_kernels=cpu_plan or "auto")
        folder = str(resolved.absolute())
    progress.note(f"loaded the {encoder.family} tower ({str(encoder.dtype).removeprefix('torch.')}) in "
                  f"{time.perf_counter() - start:.1f} s")
    return encoder, folder


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _vision_shards(folder: Path) -> tuple[int, int]:
    """(files holding vision tensors, their vision bytes), from the headers only."""
    from ..checkpoint.weights import open_checkpoint, vision_entries

    checkpoint = open_checkpoint(folder)
    return len(checkpoint.shard_files), sum(entry["bytes"] for entry in vision_entries(checkpoint).values())


def _let_pil_return_memory() -> None:
    """Make Pillow allocate images in 64 MiB blocks instead of 16 MiB.

    glibc serves allocations under 32 MiB from per-thread arenas and keeps what they freed: after decoding
    large images on 4 worker threads, each thread's arena held its own peak (4.2 GB RSS for six 89 MP
    images). Blocks above 32 MiB are mmapped and go back to the system when freed. Only if the user did
    not choose a size (PILLOW_BLOCK_SIZE).
    """
    import PIL.Image

    if "PILLOW_BLOCK_SIZE" not in os.environ:
        PIL.Image.core.set_block_size(64 << 20)


class EmbedJob:
    """One process's part of an embed run: setup (nothing written), then write, then merge."""

    def __init__(self, args: EmbedSettings, rank: int, world: int) -> None:
        self.settings, self.rank, self.world = args, rank, world
        self.out = Path(args.out)
        self.lock: FolderLock | None = None
        self.created: list[Path] = []
        self.encoder = None
        self.run: dict | None = None
        self.fresh = True
        self.plan_recorded = False  # a resume on a CPU of a run started elsewhere: run.json now records its plan
        self.inputs = Inputs()
        self.progress = Progress(rank, args.quiet)
        self.folder: str | None = None  # the checkpoint folder (the Ray actors load it again)
        self.layout = None  # a Parquet run's layout
        self.threads: int | None = None  # torch threads of each forward
        self.ray = None  # --engine ray: the cluster and the actors' plan (ray_engine.RayPlan)
        self.changed = 0  # inputs recorded ok whose file has changed since: embedded again

    # -- setup: every check before the first write; on failure the folder is left as it was

    def setup(self) -> None:
        args, out = self.settings, self.out
        what = str(out) if self.rank == 0 else f"part {self.rank} of {out}"
        try:
            self.created = _make_dirs(out)
            self.lock = FolderLock(out / lock_name(self.rank, self.world), what)
            self.lock.acquire()
        except OSError as e:
            if e.errno in OUTPUT_FAULTS:  # nothing written; the same command runs once the folder is fixed
                raise output_fault(e, out) from e
            raise
        for name in (RUN_FILE, MANIFEST, part_name(self.rank, self.world)):  # refused before anything is written
            refuse_link(out / name)
        recorded = None
        if (out / RUN_FILE).exists():
            recorded = read_run(out)
        if _holds_run(out):
            if not args.resume:
                raise EmbedError(f"{out} already holds a run; add --resume to continue it, or choose another --out")
            if recorded is None:
                raise EmbedError(f"{out} holds a run without {RUN_FILE} (an older qwenvl-vision), so its settings "
                                 f"cannot be checked; finish it with that version, or choose another --out")
            if older_plan(recorded) is not None:
                raise EmbedError(f"{out / RUN_FILE} records a CPU plan of format {older_plan(recorded)}, which this "
                                 f"version runs no longer: its embeddings read as they are; finish the run with the "
                                 f"version that started it, or choose another --out")
        if recorded is not None and not args.format_given:  # --resume continues the folder's format unless told
            self.settings = args = dataclasses.replace(args, format=recorded["file_format"])
        self.inputs = gather_inputs(args.inputs, args.path_column, args.keep_columns)
        if not self.inputs.paths:
            raise EmbedError(f"no inputs: {', '.join(args.inputs)} hold no image or video files (by extension: "
                             f"{' '.join(sorted(MEDIA_EXTENSIONS))}) and list no paths")
        recorded_plan = (recorded or {}).get("cpu_plan")  # a resumed run's CPU plan: its very bits
        if args.engine == "ray":
            from .ray_engine import RayPlan, driver_load_options

            # Ray is up before the model loads (the plan needs the cluster's CPUs and GPUs); nothing is written.
            self.ray = RayPlan.start(args, self.world, (recorded or {}).get("threads"), self.progress)
            self.threads = self.ray.threads
            torch.set_num_threads(self.threads)  # the CPU plan is the machine's at the actors' thread count
            self.encoder, folder = _load(args, "cpu", self.progress, **driver_load_options(args, self.ray.device),
                                         cpu_plan=recorded_plan if self.ray.device == "cpu" else "reference")
        else:
            self.threads = args.threads or (recorded or {}).get("threads") or torch.get_num_threads()
            torch.set_num_threads(self.threads)
            self.encoder, folder = _load(args, _pick_device(args, self.rank, self.world), self.progress,
                                         cpu_plan=recorded_plan)
        self.folder = folder
        if args.fps is not None:
            self.encoder.video_config = dataclasses.replace(self.encoder.video_config, fps=args.fps)
        if args.format == "parquet":
            from .parquet_writer import layout_for

            self.layout = layout_for(self.encoder, args.pooled_only, self.inputs.column_types)
        now = describe_run(self.encoder, args, folder, self.world, self.threads, self.inputs.column_types)
        if args.format == "vllm-cache":  # another model's items in the folder: refused before anything is written
            check_cache_folder(out, self.encoder.identity())
        if self.ray is not None and self.ray.device != "cpu":
            now["cpu_plan"] = None  # the driver's CPU plan; the actors' GPUs have none
        note = crossed_bounds_note(args, self.encoder.preprocess_config)
        if note is not None and self.rank == 0:  # what the stored tensors are: printed even with --quiet
            print(f"embed: note: {note}", file=sys.stderr, flush=True)
        if recorded is not None:
            compare_runs(recorded, now, out)
            self.run, self.fresh = recorded, False
            # A run started off the CPU has no plan: its first resume on a CPU records this one, which every later
            # forward of the run then uses.
            self.plan_recorded = recorded["cpu_plan"] is None and now["cpu_plan"] is not None
            if self.plan_recorded:
                self.run["cpu_plan"] = now["cpu_plan"]
        else:
            self.run = now

    def adopt_run(self) -> None:
        """After ``_Group.share``: run as the run records (rank 0's choices under torchrun, where another node's
        own could differ): its torch threads and its CPU plan, so that every rank's tensors are bitwise one run's."""
        if self.ray is not None:
            return  # the actors take both from the run (ray_engine)
        torch.set_num_threads(self.run["threads"])
        if self.run.get("cpu_plan"):
            self.encoder.set_cpu_kernels(self.run["cpu_plan"])

    def undo_setup(self) -> None:
        """Nothing was written: remove the lock file and the folders setup created."""
        if self.encoder is not None:
            self.encoder.close()
        self.release()
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                break

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- the run

    def start_writing(self) -> Writer:
        if (self.fresh or self.plan_recorded) and self.rank == 0:
            atomic_write_text(self.out / RUN_FILE, json.dumps(self.run, indent=2) + "\n", self.run["run_id"])
        if self.layout is not None:
            from .parquet_writer import ParquetRankWriter

            writer = ParquetRankWriter(self.out, self.rank, self.run, self.layout)
        elif self.run["file_format"] == "vllm-cache":
            from .cache_writer import CacheRankWriter

            if self.rank == 0:
                claim_cache_folder(self.out, {k: self.run[k] for k in IDENTITY_FIELDS}, self.run["run_id"])
            writer = CacheRankWriter(self.out, self.rank, self.world, self.run)
        else:
            writer = RankWriter(self.out, self.rank, self.world, self.run["run_id"], self.run.get("cwd"),
                                self.run["pooled"])
        if not self.fresh:
            writer.recover()
        self._identify(writer.done)
        return writer

    def _identify(self, done: set[str]) -> None:
        """Each local file's identity with its size and modification time (``manifest.file_identity``), a shard
        member's with its shard's: a file or shard replaced since it was recorded is embedded again (``changed``
        counts them)."""
        recorded = {file_of(key) for key in done} - {None}
        for path in self.inputs.paths:
            if path not in self.inputs.remote:
                key, member = self.inputs.keys[path], self.inputs.members.get(path)
                file = os.path.realpath(member.shard) if member else key  # a member's key: its shard's, then name
                self.inputs.keys[path] = key = file_identity(file) + key[len(file):]
                self.changed += key not in done and file_of(key) in recorded

    def finish_recovery(self, writer: Writer) -> None:
        """A resume's writes that must wait until every rank has read the folder (``ParquetRankWriter``'s)."""
        if not self.fresh:
            writer.finish_recovery()

    def known_bad(self, todo: list[str], arrow: bool) -> tuple[list[EmbeddingRecord], list[str]]:
        """(error records of the inputs of ``todo`` known bad before encoding, the others). ``arrow``: the inputs
        pass through Arrow or Parquet, where a name they cannot store as it is is an error row, not a failed batch."""
        if arrow:
            from .parquet_writer import unstorable
        keys = self.inputs.keys
        why = {p: self.inputs.errors.get(p) or (unstorable(p, keys[p]) if arrow else None) for p in todo}
        return ([EmbeddingRecord(p, keys[p], "error", why[p], columns=self.inputs.columns.get(p))
                 for p in todo if why[p]], [p for p in todo if not why[p]])

    def encode(self, writer: Writer) -> None:
        if self.settings.engine == "ray":
            from .ray_engine import encode_on_ray

            encode_on_ray(self, writer)
            return
        args = self.settings
        mine = shard_for_rank(self.inputs.paths, self.rank, self.world, self.inputs.members)
        keys, columns = self.inputs.keys, self.inputs.columns
        known_bad, todo = self.known_bad([p for p in mine if keys[p] not in writer.done], arrow=self.layout is not None)
        progress = self.progress
        progress.begin(len(todo) + len(known_bad))
        # Records are written in input order (a table's rows keep theirs): an input known bad goes with the
        # batch that follows it.
        order = {p: i for i, p in enumerate(mine)}
        pending = collections.deque(sorted(known_bad, key=lambda r: order[r.path]))

        def write_in_order(records: list[EmbeddingRecord], upto: int) -> None:
            ahead = []
            while pending and order[pending[0].path] < upto:
                ahead.append(pending.popleft())
            if ahead or records:
                writer.write_records(sorted(ahead + records, key=lambda r: order[r.path]))
            progress.update(len(ahead), 0)

        with self.encoder:
            batches = self.encoder.iter_encode(
                # The options as given, as encode_images takes them: an option alone keeps the checkpoint's
                # other bound even where they cross (run.json records both; a resume compared them).
                items_of(todo, self.inputs.members, self.inputs.remote, self.inputs.keys), video=None,
                min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                max_batch_patches=args.batch_patches, resize=self.run["resize"],
                pooled=args.pooled_only, normalize=args.normalize, max_input_pixels=args.max_input_pixels,
                decode_bytes=args.decode_mib << 20, decode_timeout=args.decode_timeout,
                hash_pixels=self.run["file_format"] == "vllm-cache",
                on_prepared=lambda index, tokens: progress.update(1, tokens))
            for batch in batches:
                write_in_order([record_from_result(r, todo[r.index], keys[todo[r.index]], columns.get(todo[r.index]))
                                for r in batch], order[todo[batch[-1].index]])
            write_in_order([], len(mine))
        progress.close()

    def summary(self) -> tuple[int, int]:
        """(ok, failed) over this run's inputs, each counted once, from the merged manifest (rank 0)."""
        status: dict[str, str] = {}
        if self.layout is not None:
            from .parquet_writer import statuses

            for key, state in statuses(self.out):
                status.setdefault(key, state)
        else:
            for r in read_manifest_lines(self.out / MANIFEST):
                status.setdefault(record_key(r, self.run.get("cwd")), r["status"])
        keys = [self.inputs.keys[p] for p in self.inputs.paths]
        ok = sum(1 for k in keys if status.get(k) == "ok")
        return ok, len(keys) - ok


def run_embed(args: argparse.Namespace) -> int:
    """``qwenvl-vision embed``: the parsed and validated command line, run; its exit code."""
    settings = EmbedSettings.from_args(args)
    rank, world = rank_and_world()
    _let_pil_return_memory()
    group = _Group(rank, world)
    job = EmbedJob(settings, rank, world)
    threads = torch.get_num_threads()  # set for the run (--threads, a resumed run's), given back at the end
    try:
        error = None
        try:
            try:
                job.setup()
            except (QwenVLVisionError, OSError) as e:
                error = e
            group.agree(error)  # every rank holds its lock and passed the checks; nothing written yet
            job.run = group.share(job.run)  # rank 0's run id tags every rank's shards
            job.inputs = group.share(job.inputs)  # one list split over the ranks: none embedded twice or never
            try:
                job.adopt_run()  # rank 0's threads and kernels on every rank
            except QwenVLVisionError as e:  # e.g. a recorded kernel this rank's torch lacks: every rank stops
                error = e
            group.agree(error)
        except BaseException:
            job.undo_setup()
            raise
        # From here on the output is written; an OSError stops the run with exit code 3.
        writer = None
        try:
            writer = job.start_writing()
        except OSError as e:
            error = output_fault(e, job.out)
        except QwenVLVisionError as e:  # a damaged shard found by recovery: every rank stops, one line each
            error = e
        group.agree(error)  # run.json is on disk (and every rank has read the folder) before anything is rewritten
        try:
            job.finish_recovery(writer)
        except OSError as e:
            error = output_fault(e, job.out)
        except QwenVLVisionError as e:  # a damaged shard, named
            error = e
        group.agree(error)  # parts recovered before any rank adds a shard
        try:
            job.encode(writer)
        except OSError as e:
            error = output_fault(e, job.out, writer.recorded)
        except ForwardFaultError as e:  # the machine's fault, not an input's: stop, keep what is recorded
            error = ForwardFaultError(f"{e}; this process recorded {writer.recorded} inputs before it, nothing "
                                      f"recorded is lost: fix the cause (memory, device, drivers) and run the same "
                                      f"command with --resume")
            error.__cause__ = e.__cause__
        group.agree(error)  # every rank finished writing its part
        if rank == 0 and world > 1 and job.layout is None:  # Parquet shards are their own manifest: no merge
            try:
                merge_parts(job.out, world, job.run["run_id"])
            except OSError as e:
                error = output_fault(e, job.out)
        group.agree(error)  # the merged manifest is complete
        failed = 0
        if rank == 0:
            ok, failed = job.summary()
            where = job.out / MANIFEST if job.layout is None else job.out / "shard-r*.parquet"
            changed = f"; {job.changed} changed since recorded, embedded again" if job.changed else ""
            print(f"embedded {ok} of {ok + failed} inputs into {job.out} ({failed} failed{changed}; see {where})",
                  file=sys.stderr)
        if world > 1:
            # A finished run exits 0 on every rank, failed inputs or not: torchrun reports any other exit as a
            # crash and stops the other ranks. The summary line and the manifest tell the failures.
            return 0
        return 1 if failed else 0
    finally:
        if job.encoder is not None:
            job.encoder.close()
        job.release()
        group.close()
        if job.ray is not None:
            job.ray.stop()
        torch.set_num_threads(threads)
