"""Ray Data integration: ``Embedder``, a callable class for ``Dataset.map_batches`` that embeds a column of images
(paths, encoded bytes or decoded arrays) with one encoder per actor, and the pieces a pipeline needs around it
(a dataset of paths, its mapping, Ray's rows back as ``records.EmbeddingRecord``).

Only this module imports Ray (``import qwenvl_vision`` does not): install ``ray[data]`` to use it.

Batch format: numpy in, Arrow out. Ray hands a numpy batch over without building pandas objects:
``read_images``' tensor column arrives as arrays (zero copy when the shapes agree), ``read_binary_files``' bytes
as a list of bytes, and the UDF works row by row anyway. It returns a ``pyarrow.Table`` built by
``parquet.result_columns``, the Parquet writer's conversion, so that every block has one schema whatever its rows
(Ray's own numpy conversion would type a batch by the shapes it happens to hold) and Ray's rows are the Parquet
layout's.

Output columns, one row per input row: the input's other columns passed through (a ``path`` input column is
kept: it is the row's identity; bytes and pixels are not), then the Parquet layout's result columns:
``status`` ("ok" / "error"), ``error`` (the one-line reason), ``grid_thw``, ``tokens``, then ``embedding``
(``list<fixed_size_list<float32, D>>``, tokens x D) and ``deepstack_0`` .. ``deepstack_{L-1}`` alike, or with
``pooled=True`` only ``pooled`` (``fixed_size_list<float32, D>``), and ``video`` (a struct of the frames used, for
a video file); last ``pixels_sha256`` (``item_ids.pixels_sha256`` of the pixels the tower read, from which the
encoder cache names the item, with ``hash_pixels=True``). Float32 holds bf16 and fp16 values exactly. An error
row is null in every column but ``status`` and ``error`` (and ``video``, for a video file). ``records_from_batch``
turns rows back into records.

Bad rows: every input is decoded and encoded under ``VisionEncoder.iter_encode``, which turns a bad input
(corrupt, empty, not an image, too large) into an error result; a forward that fails as a whole (out of memory)
is retried input by input, so one input's failure is that row's error, never a failed task, and the good rows
of the batch are kept. (Ray's ``max_errored_blocks`` would instead drop whole blocks, good rows included.)

CPUs: an actor asks for ``num_cpus`` CPUs (default 1 in Ray). With ``concurrency`` actors taking every CPU of
the cluster, the read tasks never get one and the job hangs: ``embed_dataset`` gives actors a fraction then.

Threads: Ray starts an actor's torch on as many threads as its whole CPUs (1 for a fraction); ``Embedder(threads=N)``
sets N explicitly. CPU results are bitwise equal only at the same thread count: an actor's rows are bitwise
``encode_images`` under ``torch.set_num_threads(N)`` (``embed --engine ray`` records N in run.json).

Restarts: an actor that dies mid-batch (a segfaulting decoder, the OOM killer) is restarted and its batch retried:
Ray Data's actor pools default to ``max_restarts=-1, max_task_retries=-1``, kept here (bounding them takes
``ray_remote_args``, deprecated since Ray 2.60), so an input that kills every actor it meets is retried until the
job is stopped. A retried batch's rows come out once: Ray hands on only the output of the try that finished.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray
import torch
from ray.data.block import BlockAccessor

from ..errors import CheckpointError, ForwardFaultError, InputError
from ..inputs.pixels import DEFAULT_MAX_INPUT_PIXELS, input_name
from ..inputs.video_io import is_video_file
from ..loading import load_encoder
from ..options import DEFAULT_BATCH_PATCHES, DEFAULT_DECODE_BYTES, DEFAULT_DECODE_TIMEOUT, check_option_rules
from ..outputs.parquet import ParquetLayout, result_columns
from ..outputs.parquet_reader import records_of_table
from ..outputs.records import EmbeddingRecord, record_from_result
from ..results import ItemResult
from .shards import ItemOpener

INPUT_KINDS = ("path", "bytes", "image")
BATCH_FORMAT = "numpy"


class Source(NamedTuple):
    """A path row's input before it is opened: its path, and its identity as the run listed it."""

    path: str
    identity: str | None


class Embedder:
    """``ds.map_batches(Embedder, fn_constructor_args=(source,), fn_constructor_kwargs={...},
    compute=ray.data.ActorPoolStrategy(size=N), batch_format="numpy", num_cpus=...)``: one encoder per actor,
    loaded in its constructor (``embed_dataset`` does this).

    Threads: Ray runs an actor's torch on as many threads as its whole CPUs (at least one), and the last bits of
    a CPU matmul depend on how it is split over threads: an actor's results are bitwise those of
    ``encode_images`` on that many threads.

    ``source`` and ``load_options`` are ``load_encoder``'s (``device``, ``dtype``, ``random_weights``,
    ``attn_impl``, ``revision``, ``local_files_only``, ...). The input column is ``column`` (default: ``image``,
    else ``bytes``, else ``path``, the first the batch has: next to pixels or bytes a ``path`` column is the row's
    identity, as ``read_images`` / ``read_binary_files(include_paths=True)`` add it); ``kind`` says what it holds
    when its name is another (e.g. img2dataset's ``jpg``: ``column="jpg", kind="bytes"``):

    - ``path``: image and video files, as ``embed`` takes them (a video extension makes it a video, sampled at
      ``fps``; ``min_pixels`` / ``max_pixels`` bound the images only);
    - ``bytes``: encoded image files (``read_binary_files``, img2dataset); decoded exactly as the same file
      on disk would be (they are written to a spool folder made for the call and read as files, so every
      check and message is the file path's, with ``image bytes`` for the name; the folder is removed when the
      call ends, and one a killed actor left by the next Embedder on its host: ``spool_dir``, default /tmp);
    - ``image``: HxWxC (or HxW) uint8 arrays (``read_images``), as ``encode_images`` takes arrays.

    Encode options: ``min_pixels``, ``max_pixels``, ``resize``, ``pooled`` (a mean vector instead of the tokens,
    as ``embed --pooled-only``), ``normalize`` (that vector of unit L2 norm, as ``embed --normalize``),
    ``fps`` (videos), ``max_batch_patches``, ``max_input_pixels``, ``decode_bytes``,
    ``decode_timeout``, ``num_workers`` (decode threads), as for ``VisionEncoder.iter_encode``. ``threads``: torch
    threads of the forward (default: Ray's, the actor's whole CPUs). ``weights_sha256``: the hash the loaded tower
    must have (``item_ids.weights_sha256``, as run.json records it), checked once in the constructor: an actor on
    another checkpoint, or drawing other random weights, fails instead of writing other tensors.
    ``hash_pixels``: fill the ``pixels_sha256`` column (``iter_encode``'s; null otherwise).
    ``identity_column``: a column of each path's identity as a run listed it (``embed``'s ``realpath``): a URL's
    bytes are then checked to be the object it names (its version, or its ETag).
    """

    def __init__(self, source: Any, *, column: str | None = None, kind: str | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None, resize: str | None = None,
                 pooled: bool = False, normalize: bool = False, fps: float | None = None,
                 max_batch_patches: int = DEFAULT_BATCH_PATCHES,
                 max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS,
                 decode_bytes: int | None = DEFAULT_DECODE_BYTES,
                 decode_timeout: float | None = DEFAULT_DECODE_TIMEOUT, num_workers: int | None = None,
                 spool_dir: str | None = None, threads: int | None = None, weights_sha256: str | None = None,
                 hash_pixels: bool = False, identity_column: str | None = None, **load_options: Any) -> None:
        kind = kind or column
        if column is not None and kind not in INPUT_KINDS:
            raise ValueError(f"column {column!r}: pass kind= (one of {list(INPUT_KINDS)})")
        check_option_rules(min_pixels=min_pixels, max_pixels=max_pixels, pooled=pooled, normalize=normalize)
        self.column, self.kind, self.identity_column = column, kind, identity_column
        self.opener = ItemOpener()  # a URL or a shard member named by its path: read as the local engine does
        self.pooled = pooled
        if threads is not None:
            torch.set_num_threads(threads)
        self.encoder = load_encoder(source, **load_options)
        if weights_sha256 is not None:
            from ..inputs.item_ids import weights_sha256 as tower_hash

            found = tower_hash(self.encoder.model)
            if found != weights_sha256:
                raise CheckpointError(f"{source}: the actor's tower hashes to {found[:12]}..., the run's to "
                                      f"{weights_sha256[:12]}... (another checkpoint, or other random weights)")
        self.layout = ParquetLayout.for_encoder(self.encoder, tokens=not pooled, pooled=pooled)
        video_config = None if fps is None else dataclasses.replace(self.encoder.video_config, fps=fps)
        self.options = dict(min_pixels=min_pixels, max_pixels=max_pixels, resize=resize, pooled=pooled,
                            normalize=normalize, max_batch_patches=max_batch_patches,
                            max_input_pixels=max_input_pixels, decode_bytes=decode_bytes,
                            decode_timeout=decode_timeout, num_workers=num_workers, video_config=video_config,
                            hash_pixels=hash_pixels)
        self.spool_dir = spool_dir
        _remove_dead_spools(spool_dir)

    # ------------------------------------------------------------------ inputs

    def _input_column(self, batch: dict[str, np.ndarray]) -> tuple[str, str]:
        if self.column is not None:
            if self.column not in batch:
                raise KeyError(f"the batch has no column {self.column!r} (columns: {sorted(batch)})")
            return self.column, self.kind
        # Pixels or bytes over a path: read_images / read_binary_files(include_paths=True) add a path column,
        # which is then the row's identity, not its input.
        for name in ("image", "bytes", "path"):
            if name in batch:
                return name, name
        raise KeyError(f"expected an input column ({', '.join(INPUT_KINDS)}), the batch has {sorted(batch)}: "
                       f"pass column= (and kind=)")

    def _items(self, values: Sequence[Any], kind: str, spool: list[str], identities: Sequence[Any] | None = None
               ) -> tuple[list[Any], dict[int, str], dict[int, str]]:
        """(what iter_encode gets per row, rows already known bad -> error, row -> the name its errors use).
        Encoded bytes are written to files in a folder made for this call, its path put in ``spool`` (the
        caller removes it, whatever happens)."""
        items: list[Any] = []
        bad: dict[int, str] = {}
        names: dict[int, str] = {}
        for row, value in enumerate(values):
            if kind == "path":
                identity = None if identities is None else identities[row]
                # Opened as the encoder reaches it (``_encode``): a batch's fetched objects are not all held at once.
                items.append(Source(os.fspath(value), identity) if isinstance(value, (str, os.PathLike)) else value)
                if not isinstance(value, (str, os.PathLike)):
                    bad[row] = f"path: expected a file path, got {type(value).__name__}"
                continue
            if kind == "image":
                names[row] = "image array"
                items.append(value)
                if value is None:
                    bad[row] = "image array: missing (null)"
                continue
            names[row] = "image bytes"
            if not isinstance(value, (bytes, bytearray, memoryview)):
                bad[row] = f"image bytes: expected bytes, got {type(value).__name__}"
            elif len(value) == 0:
                bad[row] = "image bytes: empty (0 bytes)"
            if row in bad:
                items.append(None)
                continue
            if not spool:
                spool.append(tempfile.mkdtemp(prefix=_spool_prefix(), dir=self.spool_dir))
            spooled = os.path.join(spool[0], f"{row:06d}")
            with open(spooled, "wb") as f:
                f.write(value)
            items.append(spooled)
        return items, bad, names

    # ------------------------------------------------------------------ encoding

    def _encode(self, items: list[Any], kind: str) -> list[ItemResult]:
        """One result per item, in order; a forward that fails as a whole (out of memory on a large batch, say)
        is retried item by item, and an item that fails alone too is that row's error."""
        video = None if kind == "path" else False

        def encode(some: list[Any]) -> list[ItemResult]:
            opened = (self.opener(item.path, item.identity) if isinstance(item, Source) else item for item in some)
            return [r for batch in self.encoder.iter_encode(opened, video=video, **self.options) for r in batch]

        if len(items) > 1:
            try:
                return encode(items)
            except ForwardFaultError:
                raise  # the machine's fault (the encoder probed it): the task fails and Ray retries it elsewhere
            except Exception:  # noqa: BLE001 - each input alone decides, below
                pass
        results = []
        for index, item in enumerate(items):
            try:
                (result,) = encode([item])
                result.index = index
            except ForwardFaultError:
                raise
            except Exception as e:  # noqa: BLE001 - the row's error; the other rows go on
                item = item.path if isinstance(item, Source) else item
                name = input_name("video" if video is None and is_video_file(item) else "image", index, item)
                reason = str(e).splitlines()[0] if str(e) else ""
                result = ItemResult(index, name, error=f"{name}: {type(e).__name__}: {reason}")
            results.append(result)
        return results

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        name, kind = self._input_column(batch)
        values = list(batch[name])
        spool: list[str] = []  # this call's folder for encoded bytes, removed whatever happens
        results: dict[int, ItemResult] = {}
        try:
            identities = None if self.identity_column is None else batch.get(self.identity_column)
            items, bad, names = self._items(values, kind, spool, identities)
            todo = [row for row in range(len(values)) if row not in bad]
            for result in self._encode([items[row] for row in todo], kind) if todo else []:
                row = todo[result.index]
                if result.error is not None and row in names:
                    result.error = _renamed(result.error, result.name, names[row], items[row])
                results[row] = result
        finally:
            for folder in spool:
                shutil.rmtree(folder, ignore_errors=True)
        for row, error in bad.items():
            results[row] = ItemResult(row, names.get(row, "input"), error=error)
        keep = {k: v for k, v in batch.items() if k != name or kind == "path"}
        return self._table(keep, [results[row] for row in range(len(values))])

    def _table(self, keep: dict[str, np.ndarray], results: list[ItemResult]) -> pa.Table:
        passthrough = BlockAccessor.batch_to_block(keep) if keep else None
        columns: dict[str, pa.Array] = {}
        if passthrough is not None:
            columns.update({n: passthrough.column(n) for n in passthrough.column_names})
        records = [record_from_result(r, path=r.name, realpath=r.name) for r in results]
        columns.update(result_columns(records, self.layout))
        columns["pixels_sha256"] = pa.array([r.pixels_sha256 for r in records], pa.string())
        return pa.table(columns)


SPOOL_PREFIX = "qwenvl-ray-"


def _spool_prefix() -> str:
    """A spool folder's name: this host and process, so that a later actor can tell a dead one's leftovers."""
    return f"{SPOOL_PREFIX}{socket.gethostname()}@{os.getpid()}-"  # '@' cannot be in a host name: no other host's


def _remove_dead_spools(spool_dir: str | None) -> None:
    """Remove the spool folders of this host's processes that are gone (an actor killed mid-batch: SIGKILL, the
    OOM killer, runs no cleanup)."""
    parent = spool_dir or tempfile.gettempdir()
    mine = re.compile(rf"^{re.escape(SPOOL_PREFIX + socket.gethostname())}@(\d+)-")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = mine.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def _renamed(error: str, name: str, new_name: str, spooled: Any) -> str:
    """An error as the user's row would say it: iter_encode names an array by its position in the batch and
    spooled bytes by their temporary file, neither of which means anything to the user."""
    if error.startswith(name):
        error = new_name + error[len(name):]
    return error.replace(repr(spooled), "<bytes>") if isinstance(spooled, str) else error


# ---------------------------------------------------------------------- pipelines


def actor_cpus(concurrency: int, want: float = 1.0) -> float:
    """CPUs for each of ``concurrency`` actors: ``want``, unless that would leave the cluster no CPU for the read
    tasks (which then never run: the job hangs); then an equal share of all but one CPU, rounded down to Ray's
    resource precision (1e-4) so that the shares never add up to more (else some actors never start)."""
    total = float(ray.cluster_resources().get("CPU", 1))
    if concurrency * want + 1 <= total:
        return float(want)
    share = (total - 1) / concurrency if total > 1 else total / (concurrency + 1)
    share = math.floor(share * 10_000) / 10_000
    if share <= 0:
        raise ValueError(f"{concurrency} actors cannot share the cluster's {total:g} CPUs (Ray counts CPUs in "
                         f"steps of 0.0001): use fewer actors")
    return share


def embed_dataset(ds: ray.data.Dataset, source: Any, *, concurrency: int = 1, batch_size: int = 16,
                  num_cpus: float | None = None, num_gpus: float | None = None, udf: type = Embedder,
                  **options: Any) -> ray.data.Dataset:
    """``ds.map_batches(Embedder)`` with ``concurrency`` actors (one encoder each), ``batch_size`` rows a batch;
    ``options`` are Embedder's (encode and ``load_encoder`` options). ``num_cpus`` per actor defaults to
    ``actor_cpus(concurrency)``; with ``num_gpus`` (e.g. 1), each actor's encoder goes to the GPU Ray gives it.
    A dead actor is restarted and its batch retried (Ray Data's defaults). ``udf``: Embedder or a subclass."""
    resources: dict[str, float] = {"num_cpus": actor_cpus(concurrency) if num_cpus is None else num_cpus}
    if num_gpus:
        resources["num_gpus"] = num_gpus
        options.setdefault("device", "cuda")
    # compute= rather than concurrency=, which Ray 2.51 deprecated for actor pools.
    return ds.map_batches(udf, fn_constructor_args=(source,), fn_constructor_kwargs=options,
                          compute=ray.data.ActorPoolStrategy(size=concurrency), batch_size=batch_size,
                          batch_format=BATCH_FORMAT, **resources)


def paths_dataset(paths: Sequence[str | os.PathLike], *, blocks: int | None = None) -> ray.data.Dataset:
    """A dataset of one ``path`` row per input, in order (``embed``'s gathered inputs, say)."""
    items = [{"path": os.fspath(p)} for p in paths]
    return ray.data.from_items(items, override_num_blocks=blocks)


def embed_paths(paths: Sequence[str | os.PathLike], source: Any, **options: Any) -> ray.data.Dataset:
    """The Ray pipeline for a list of image and video paths: ``embed_dataset(paths_dataset(paths), ...)``."""
    return embed_dataset(paths_dataset(paths), source, **options)


def records_from_batch(batch: pa.Table, *, path_column: str = "path") -> list[EmbeddingRecord]:
    """Embedder's rows (a batch of ``Dataset.iter_batches(batch_format="pyarrow")``) as ``records.EmbeddingRecord``s,
    what every writer takes, tensors float32 (``parquet_reader.records_of_table``). ``realpath`` is resolved here unless
    the batch has a column of it."""
    if not isinstance(batch, pa.Table):
        raise InputError(f"records_from_batch takes a pyarrow Table (iter_batches(batch_format=\"pyarrow\")), "
                         f"got {type(batch).__name__}")
    if path_column not in batch.column_names:
        raise InputError(f"the batch has no column {path_column!r} (columns: {batch.column_names})")
    try:
        return records_of_table(batch, "float32", path_column=path_column)
    except ValueError as e:
        raise InputError(f"the batch is not Embedder's rows: {e}") from None
