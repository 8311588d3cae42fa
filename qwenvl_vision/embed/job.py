"""One embed run, start to end: ``run_embed`` (what ``qwenvl-vision embed`` calls) and ``EmbedJob``, one
process's part of it: check everything and take the folder's lock (nothing written), load the encoder, write
run.json, encode this rank's inputs batch by batch (here, or with ``--engine ray`` on Ray's actors:
``ray_engine``) and record them through the format's ``writer.Writer`` (safetensors shards + manifest, Parquet
shards that are their own manifest, or a vLLM encoder-cache folder + manifest), merge the ranks' parts. The lock,
the run.json checks, resume, ranks and exit codes are the same for every format and engine.

Threads: run.json records the torch threads of every forward (``threads``): ``--threads``, else a resumed run's,
else torch's default here (the Ray engine: each actor's). CPU results are bitwise equal only at the same count,
so ``encode_images`` under ``torch.set_num_threads(run["threads"])`` gives a run's very tensors.

Ranks (docs/embed.md): under ``torchrun`` each rank writes its own part of rank 0's list of the inputs
(``inputs.shard_for_rank``: a rank's own listing may differ, e.g. a file that arrived while the ranks started, and
would split the inputs otherwise), and rank 0 merges the parts.

Exit codes: cli.py lists them (docs/embed.md, with what to do next); a forward that fails for the machine's reasons
(a probe of the device fails too; otherwise, and on out of memory, the batch is retried item by item and an input
that fails alone is a failed input) stops the run with 4.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..backends.cpu.plan import CpuPlan
from ..errors import (
    ConfigError,
    EmbedError,
    ForwardFaultError,
    OutputFaultError,
    PeerFailedError,
    QwenVLVisionError,
    first_line,
)
from ..inputs.item_ids import IDENTITY_FIELDS
from ..inputs.pixels import large_pillow_blocks
from ..outputs.durable import refuse_link
from ..outputs.records import EmbeddingRecord, record_from_result
from ..outputs.vllm_cache import check_cache_folder, claim_cache_folder
from .inputs import MEDIA_EXTENSIONS, Inputs, file_of, gather_inputs, shard_for_rank
from .lock import FolderLock, lock_name
from .manifest import MANIFEST, RUN_FILE, part_name
from .progress import Progress
from .reader import read_manifest_lines, read_run
from .run_record import compare_runs, crossed_bounds_note, describe_run
from .shards import items_of
from .writer import OUTPUT_FAULTS, RankWriter, Writer, atomic_write_text, merge_parts, output_fault


class _Group:
    """The torchrun process group (gloo), or nothing for a single process."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.reducing = None
        self.agent = "TORCHELASTIC_RUN_ID" in os.environ  # torchrun's agent, which stops every rank once one exits
        if world > 1:
            # A rank that finishes its part early waits for the slowest at the barrier: gloo's default 30 min
            # timeout is too short for hours-long jobs. A rank that dies closes its sockets, which the others
            # notice at once, so the long timeout does not make them hang.
            try:
                dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
            except (ValueError, RuntimeError) as e:  # torchrun's other variables missing or bad; a port in use
                raise EmbedError(f"WORLD_SIZE={world}: torchrun's rendezvous at MASTER_ADDR:MASTER_PORT="
                                 f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} failed "
                                 f"({first_line(e)})" + ("" if self.agent else "; run under torchrun, or unset it")
                                 ) from None

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed; a failing rank raises its own error, the others stop quietly."""
        code = 0 if error is None else getattr(error, "exit_code", 2)
        if self.world > 1:
            flag = torch.tensor([code])
            try:
                reduced = self.reducing = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
                while not reduced.is_completed():  # a wait in C++ would hold off SIGTERM and Ctrl-C for hours
                    time.sleep(0.1)
                reduced.wait()
            except RuntimeError as e:  # a rank died (torch.distributed reports it as a RuntimeError)
                if self.agent:  # which, and why, torchrun's agent reports (the rank said it, if it could)
                    raise PeerFailedError(OutputFaultError.exit_code) from None
                raise OutputFaultError(f"rank {self.rank}: another rank stopped ({e})") from None
            if error is None and flag.item():
                raise PeerFailedError(int(flag.item()))
        if error is not None:
            raise error

    def share(self, value: Any) -> Any:
        """Rank 0's value, on every rank (a fresh run's run.json: one run id for every rank's shards)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world > 1 and (self.reducing is None or self.reducing.is_completed()):  # interrupted: its peers'
            dist.destroy_process_group()  # reduction would hold the exit


def _load(args: argparse.Namespace, device: str | None, progress: Progress, dtype=None, attn: str | None = None,
          cpu_plan: CpuPlan | str | None = None):
    """The encoder, and the checkpoint folder it came from (None for random weights); says what it does.
    ``dtype`` and ``attn`` default to the options (the Ray driver loads on its CPU in the actors' dtype);
    ``cpu_plan`` is a resumed run's recorded CPU plan (its very bits) or "reference" (a Ray driver whose actors run
    on GPUs: no CPU plan to measure), else this machine's runs."""
    from ..checkpoint.hub import looks_like_repo_id, resolve_folder
    from ..checkpoint.weights import open_checkpoint, vision_entries
    from ..devices import resolve_device, resolve_dtype
    from ..loading import load_encoder
    from ..model.attention import resolve_attn_impl

    dtype = args.dtype if dtype is None else dtype
    attn = args.attn if attn is None else attn
    where = str(resolve_device(device))
    resolve_attn_impl(attn, where, resolve_dtype(dtype, torch.device(where)))  # before any fetch or read
    start = time.perf_counter()
    source, folder = args.model, None
    if args.random_weights:
        progress.note(f"building {args.model} with random weights on {where}")
    else:
        if looks_like_repo_id(args.model):
            progress.note(f"fetching config, index and vision shards of {args.model} from the Hugging Face Hub "
                          f"(or its local cache)")
        source = resolve_folder(args.model, args.revision, args.local_files_only, None, None)
        checkpoint = open_checkpoint(source)  # the headers only
        shards, size = len(checkpoint.shard_files), sum(e["bytes"] for e in vision_entries(checkpoint).values())
        size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        progress.note(f"reading {shards} shard{'s' if shards != 1 else ''} with the vision tensors ({size}) from "
                      f"{source} onto {where}")
        folder = str(source.absolute())
    encoder = load_encoder(source, device=device, dtype=dtype, random_weights=args.random_weights,
                           compile=args.compile, attn_impl=attn, cpu_kernels=cpu_plan or "auto")
    progress.note(f"loaded the {encoder.family} tower ({str(encoder.dtype).removeprefix('torch.')}) in "
                  f"{time.perf_counter() - start:.1f} s")
    return encoder, folder


class EmbedJob:
    """One process's part of an embed run: setup (nothing written), then write, then merge."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.settings, self.rank, self.world = args, rank, world
        self.out = Path(args.out)
        self.lock: FolderLock | None = None
        self.created: list[Path] = []  # the folders setup made, deepest first
        self.encoder = None
        self.run: dict | None = None
        self.own: dict | None = None  # this process's own run.json, where the run is fresh: rank 0's is shared
        self.fresh = True
        self.plan_recorded = False  # a resume on a CPU of a run started elsewhere: run.json now records its plan
        self.inputs = Inputs()
        self.progress = Progress(rank, args.quiet)
        self.folder: str | None = None  # the checkpoint folder (the Ray actors load it again)
        self.layout = None  # a Parquet run's layout
        self.ray = None  # --engine ray: the cluster and the actors' plan (ray_engine.RayPlan)
        self.writer: Writer | None = None
        self.changed = 0  # inputs recorded ok whose file has changed since: embedded again

    # -- setup: every check before the first write; on failure the folder is left as it was

    def setup(self) -> None:
        args, out = self.settings, self.out
        what = str(out) if self.rank == 0 else f"part {self.rank} of {out}"
        try:
            # The folders mkdir -p creates, deepest first: removed again if setup fails (undo_setup).
            folders = (out.absolute(), *out.absolute().parents)
            self.created = list(itertools.takewhile(lambda folder: not folder.exists(), folders))
            out.mkdir(parents=True, exist_ok=True)
            self.lock = FolderLock(out / lock_name(self.rank), what)
            self.lock.acquire()
        except OSError as e:
            if e.errno in OUTPUT_FAULTS:  # nothing written; the same command runs once the folder is fixed
                raise output_fault(e, out) from e
            raise EmbedError(f"--out {out}: {e.strerror or e}"  # a link to nowhere, a file; a lock refused
                             f"{f' ({e.filename})' if e.filename else ''}") from e
        for name in (RUN_FILE, MANIFEST, part_name(self.rank, self.world)):  # refused before anything is written
            refuse_link(out / name)
        recorded = recorded_plan = None  # a resumed run's, and its CPU plan: its very bits
        # (Part of) a run already here: a fresh run would mix two runs' files.
        if any(any(out.glob(name)) for name in (RUN_FILE, MANIFEST, "manifest.rank*.jsonl", "shard-r*.safetensors",
                                                "shard-r*.parquet")):
            if not args.resume:
                raise EmbedError(f"{out} already holds a run; add --resume to continue it, or choose another --out")
            recorded = read_run(out)
            if recorded["cpu_plan"] is not None:  # one this version cannot run: refused before anything is fetched
                try:
                    recorded_plan = CpuPlan.from_dict(recorded["cpu_plan"])
                except ConfigError as e:
                    raise EmbedError(f"{out / RUN_FILE}: {e}; its embeddings read as they are: finish the run with "
                                     f"the version and machine that started it, or choose another --out") from None
            if not args.format_given:  # --resume continues the folder's format unless told
                args.format = recorded["file_format"]
        self.inputs = gather_inputs(args.inputs, args.path_column, args.keep_columns)
        if not self.inputs.paths:
            raise EmbedError(f"no inputs: {', '.join(args.inputs)} hold no image or video files (by extension: "
                             f"{' '.join(sorted(MEDIA_EXTENSIONS))}) and list no paths")
        if args.engine == "ray":
            try:
                from .ray_engine import RayPlan
            except ModuleNotFoundError as e:
                raise EmbedError(f"--engine ray needs Ray Data: pip install 'ray[data]' ({e})") from None

            # Ray is up before the model loads (the plan needs the cluster's CPUs and GPUs); nothing is written.
            self.ray = RayPlan.start(args, self.world, (recorded or {}).get("threads"), self.progress)
            threads = self.ray.threads
            torch.set_num_threads(threads)  # the CPU plan is the machine's at the actors' thread count
            # The driver loads the tower on its CPU for run.json, in the actors' dtype (bf16 on their GPUs).
            gpus = self.ray.device != "cpu"
            dtype = torch.bfloat16 if gpus and args.dtype is None else args.dtype
            self.encoder, self.folder = _load(args, "cpu", self.progress, dtype=dtype, attn="auto",
                                              cpu_plan="reference" if gpus else recorded_plan)
        else:
            threads = args.threads or (recorded or {}).get("threads") or torch.get_num_threads()
            torch.set_num_threads(threads)
            device = args.device or ("cuda" if torch.cuda.is_available() else None)  # None: the encoder's default
            if device and device.startswith("cuda") and self.world > 1:  # one GPU per local rank
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank)) % max(torch.cuda.device_count(), 1)}"
            self.encoder, self.folder = _load(args, device, self.progress, cpu_plan=recorded_plan)
        if args.fps is not None:
            self.encoder.video_config = dataclasses.replace(self.encoder.video_config, fps=args.fps)
        if args.format == "parquet":
            try:
                from ..outputs.parquet import ParquetLayout
            except ImportError:  # an extra: the core never imports it
                raise ConfigError("--format parquet needs pyarrow: pip install 'qwenvl-vision[parquet]'") from None
            self.layout = ParquetLayout.for_encoder(self.encoder, tokens=not args.pooled_only, pooled=args.pooled_only,
                                                    columns=self.inputs.column_types)
        now = describe_run(self.encoder, args, self.folder, self.world, threads, self.inputs.column_types)
        if args.format == "vllm-cache":  # another model's items in the folder: refused before anything is written
            check_cache_folder(out, self.encoder.identity())
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
            self.run = self.own = now

    def adopt_run(self, lead: str) -> None:
        """After ``_Group.share``: run as the run records (rank 0's choices under torchrun, where another node's
        own could differ): its torch threads and its CPU plan, so that every rank's tensors are bitwise one run's.
        ``lead``: rank 0's lock note, which this rank finds in its --out only where the ranks share one folder."""
        if self.rank:
            try:
                found = (self.out / lock_name(0)).read_text()
            except OSError:
                found = None
            if found != lead:  # the ranks' parts would never be merged: the run would end 0 with others' inputs lost
                raise EmbedError(f"--out {self.out} is not the folder rank 0 writes into" + (
                    f" (its {lock_name(0)} is empty: a full disk?)" if found == "" else
                    ": every rank needs the one folder, on a file system they all share"))
        if self.ray is not None:
            return  # the actors take both from the run (ray_engine)
        if self.fresh and self.rank:  # other options, checkpoint, version or device here: refused as a resume is
            compare_runs(self.run, {**self.own, "threads": self.run["threads"]}, self.out, "rank 0")
        torch.set_num_threads(self.run["threads"])
        if self.run.get("cpu_plan"):
            self.encoder.set_cpu_kernels(self.run["cpu_plan"])

    def undo_setup(self) -> None:
        """Nothing was written: remove the lock file and the folders setup created (run_embed closes the encoder)."""
        self.release()
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                break

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- the run

    def start_writing(self) -> None:
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
            writer = RankWriter(self.out, self.rank, self.world, self.run["run_id"], self.run["pooled"])
        if not self.fresh:
            writer.recover({file_of(key): key for key in self.inputs.keys.values()})
        self.writer = writer
        self.changed = sum(key not in writer.done and file_of(key) in writer.replaced
                           for key in self.inputs.keys.values())

    def encode_options(self) -> dict:
        """The run's encode options, as ``iter_encode`` (and the Ray ``Embedder``) take them: as given, so that an
        option alone keeps the checkpoint's other bound even where they cross (run.json records both)."""
        args = self.settings
        return dict(min_pixels=args.min_pixels, max_pixels=args.max_pixels, resize=self.run["resize"],
                    pooled=args.pooled_only, normalize=args.normalize, max_batch_patches=args.batch_patches,
                    max_input_pixels=args.max_input_pixels, decode_bytes=args.decode_mib << 20,
                    decode_timeout=args.decode_timeout, hash_pixels=self.run["file_format"] == "vllm-cache",
                    max_item_tokens=args.max_item_tokens)

    def encode(self) -> None:
        """Encode this rank's inputs still to do, here or on Ray's actors, and record every outcome through the
        writer: in input order (a table's rows keep theirs; Ray's come as its actors finish them), an input known
        bad before encoding with the batch that follows it."""
        inputs = self.inputs
        mine = shard_for_rank(inputs.paths, self.rank, self.world, inputs.members)
        # Where the inputs pass through Arrow or Parquet, a name they cannot store as it is is an error row, not a
        # failed batch.
        arrow = self.layout is not None or self.ray is not None
        if arrow:
            from .parquet_writer import unstorable
        why = {p: inputs.errors.get(p) or (unstorable(p, inputs.keys[p]) if arrow else None)
               for p in mine if inputs.keys[p] not in self.writer.done}
        todo = [p for p in why if not why[p]]
        self.progress.begin(len(why))
        order = {p: i for i, p in enumerate(mine)}
        pending = collections.deque(EmbeddingRecord(p, inputs.keys[p], "error", why[p], columns=inputs.columns.get(p))
                                    for p in why if why[p])
        if self.ray is not None:
            from .ray_engine import encode_on_ray

            batches = encode_on_ray(self, todo)
        else:
            batches = self._encode_here(todo)
        for records in itertools.chain(batches, [[]]):
            upto = order[records[-1].path] if records else len(mine)
            ahead = []
            while pending and order[pending[0].path] < upto:
                ahead.append(pending.popleft())
            if ahead or records:
                self.writer.write_records(sorted(ahead + records, key=lambda r: order[r.path]))
            self.progress.update(len(ahead), 0)
        self.progress.close()

    def _encode_here(self, todo: list[str]):
        """The records of ``todo``, batch by batch, from this process's encoder (progress counts each input as it
        is decoded)."""
        inputs = self.inputs
        with self.encoder:
            for batch in self.encoder.iter_encode(
                    items_of(todo, inputs.members, inputs.keys), video=None,
                    on_prepared=lambda index, tokens: self.progress.update(1, tokens), **self.encode_options()):
                paths = [todo[r.index] for r in batch]
                yield [record_from_result(r, p, inputs.keys[p], inputs.columns.get(p)) for r, p in zip(batch, paths)]

    def merge(self) -> None:
        """Rank 0, once every rank wrote its part: the parts into one manifest (Parquet shards are their own)."""
        if self.rank == 0 and self.world > 1 and self.layout is None:
            merge_parts(self.out, self.world, self.run["run_id"])

    def summary(self) -> tuple[int, int]:
        """(ok, failed) over this run's inputs, each counted once, from the merged manifest (rank 0); an input
        whose bytes are not known now (a bare path: ``inputs.file_identity``) counts as its file's ok record."""
        if self.layout is not None:
            from .parquet_writer import statuses

            rows = statuses(self.out)
        else:
            rows = [(r["realpath"], r["status"]) for r in read_manifest_lines(self.out / MANIFEST)]
        done = {key for key, state in rows if state == "ok"}
        done |= {file_of(key) for key in done}
        ok = sum(self.inputs.keys[p] in done for p in self.inputs.paths)
        return ok, len(self.inputs.paths) - ok


def run_embed(args: argparse.Namespace) -> int:
    """``qwenvl-vision embed``: the parsed and validated command line, run; its exit code."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")  # torchrun's, else one process
    if not (rank.isdecimal() and world.isdecimal() and int(rank) < int(world)):
        raise EmbedError(f"RANK={rank!r} WORLD_SIZE={world!r}: not a rank of a torchrun world (integers, 0 <= RANK < "
                         f"WORLD_SIZE); run under torchrun, or unset them")
    rank, world = int(rank), int(world)
    large_pillow_blocks()
    group = _Group(rank, world)
    job = EmbedJob(args, rank, world)
    threads = torch.get_num_threads()  # set for the run (--threads, a resumed run's), given back at the end

    def step(action: Callable[[], Any], writing: bool = True, at_once: bool = False) -> None:
        """``action`` on this rank, then every rank learns whether any failed (``_Group.agree``). Once writing, an
        OSError is the output's fault (exit 3) and what is recorded is kept."""
        error = None
        try:
            action()
        except OSError as e:
            error = output_fault(e, job.out, getattr(job.writer, "recorded", None)) if writing else e
        except ForwardFaultError as e:  # the machine's fault, not an input's: stop, keep what is recorded
            error = ForwardFaultError(f"{e}; this process recorded {job.writer.recorded} inputs before it, nothing "
                                      f"recorded is lost: fix the cause (memory, device, drivers) and run the same "
                                      f"command with --resume")
            error.__cause__ = e.__cause__
        except QwenVLVisionError as e:  # a damaged shard found by recovery too: every rank stops, one line each
            error = e
        if error is not None and at_once and group.agent:
            # Not once the others have finished their parts (hours, maybe): torchrun's agent stops the ranks of this
            # node, each keeping what it recorded; another node's stop quietly at the barrier.
            raise error
        group.agree(error)

    try:
        try:
            step(job.setup, writing=False)  # every rank holds its lock and passed the checks; nothing written yet
            # Rank 0's run id tags every rank's shards; its list is split over the ranks (none embedded twice or
            # never); its lock note is in every rank's --out, if they share it.
            job.run, job.inputs, lead = group.share((job.run, job.inputs, job.lock.note))
            step(lambda: job.adopt_run(lead), writing=False)  # rank 0's threads and kernels, or every rank stops
        except BaseException:
            job.undo_setup()
            raise
        # From here on the output is written; an OSError stops the run with exit code 3.
        step(job.start_writing)  # run.json is on disk (and every rank has read the folder) before any rewrite
        step(lambda: job.writer.finish_recovery())  # parts recovered before any rank adds a shard
        step(job.encode, at_once=True)  # every rank finished writing its part
        step(job.merge)  # the merged manifest is complete
        failed = 0
        if rank == 0:
            ok, failed = job.summary()
            where = job.out / MANIFEST if job.layout is None else job.out / "shard-r*.parquet"
            changed = f"; {job.changed} changed since recorded, embedded again" if job.changed else ""
            print(f"embedded {ok} of {ok + failed} inputs into {job.out} ({failed} failed{changed}; see {where})",
                  file=sys.stderr)
        if world > 1 or group.agent:
            # A finished run exits 0 on every rank, failed inputs or not: torchrun reports any other exit as a
            # crash and stops the other ranks (or restarts the run). The summary line and the manifest tell them.
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
