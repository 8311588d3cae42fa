"""Ray Data integration (docs/embed.md, "Many machines: Ray Data"): ``Embedder``, the callable class for
``Dataset.map_batches`` with one encoder per actor, and what a pipeline needs around it (``embed_dataset``, the
actors' CPU shares, ``records_from_batch``). Only this module and ``ray_engine`` import Ray
(``import qwenvl_vision`` does not).

- Batches: numpy in (Ray builds no pandas objects, and the UDF works row by row anyway), a ``pyarrow.Table`` out,
  built by ``parquet.result_columns`` so that every block has one schema whatever its rows (Ray's own numpy
  conversion would type a batch by the shapes it happens to hold). A ``path`` column is passed through (the row's
  identity); bytes and pixels are not.
- Bad rows: ``VisionEncoder.iter_encode`` makes a bad input an error row and retries a forward that fails as a whole
  input by input, so the batch's good rows are kept (Ray's ``max_errored_blocks`` would drop whole blocks). A
  ``ForwardFaultError`` (the machine's reasons) fails the task, and so the run (Ray retries no task that raised).
- Threads: Ray starts an actor's torch on as many threads as its whole CPUs (1 for a fraction);
  ``Embedder(threads=N)`` sets N.
- Restarts: Ray Data's actor-pool defaults ``max_restarts=-1, max_task_retries=-1`` are kept (bounding them takes
  ``ray_remote_args``, deprecated since Ray 2.60), so an input that kills every actor it meets is retried until the
  job is stopped. Ray skips the retry's outputs the first try handed on by their place, which the driver
  (``ray_engine``) does not trust: it takes each input's row once, and records one it never gets as failed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch
from ray.data.block import BlockAccessor

from .. import version
from ..errors import CheckpointError, ConfigError, InputError
from ..inputs.pixels import FileBytes, large_pillow_blocks
from ..inputs.video import VideoConfig
from ..loading import load_encoder
from ..options import EncodeOptions
from ..outputs.parquet import ParquetLayout, result_columns
from ..outputs.parquet_reader import records_of_table
from ..outputs.records import EmbeddingRecord, record_from_result
from ..results import ItemResult
from .shards import ItemOpener

INPUT_KINDS = ("path", "bytes", "image")
# Embedder's keywords that go to every batch's ``VisionEncoder.iter_encode``, as it takes them (and defaults them).
ENCODE_OPTIONS = tuple(f.name for f in dataclasses.fields(EncodeOptions) if f.name not in ("video", "video_config"))


class Embedder:
    """``ds.map_batches(Embedder, fn_constructor_args=(source,), fn_constructor_kwargs={...},
    compute=ray.data.ActorPoolStrategy(size=N), batch_format="numpy", num_cpus=...)``: one encoder per actor,
    loaded in its constructor (``embed_dataset`` does this).

    ``source`` is ``load_encoder``'s. The input column is ``column`` (default: ``image``, else ``bytes``, else
    ``path``, the first the batch has: next to pixels or bytes a ``path`` column is the row's identity, as
    ``read_images`` / ``read_binary_files(include_paths=True)`` add it); ``kind`` says what it holds when its name is
    another (e.g. img2dataset's ``jpg``: ``column="jpg", kind="bytes"``):

    - ``path``: image and video files, as ``embed`` takes them (a video extension makes it a video, sampled at
      ``fps``; ``min_pixels`` / ``max_pixels`` bound the images only);
    - ``bytes``: encoded image files (``read_binary_files``, img2dataset), decoded in memory exactly as the same
      file on disk would be (``FileBytes``), ``image bytes`` in their errors;
    - ``image``: HxWxC (or HxW) uint8 arrays (``read_images``), as ``encode_images`` takes arrays.

    Options: ``ENCODE_OPTIONS`` (``pooled`` as ``embed --pooled-only``, ``hash_pixels`` fills the ``pixels_sha256``
    column, ...) go to every batch's ``VisionEncoder.iter_encode``, the others to ``load_encoder``; ``fps``: the
    videos' sampling rate. ``threads``: torch threads of the forward (default: Ray's, the actor's whole CPUs).
    ``weights_sha256``: the hash the loaded tower must have (``item_ids.weights_sha256``, as run.json records it),
    checked once in the constructor: an actor on another checkpoint, or drawing other random weights, fails instead
    of writing other tensors; ``package_version`` likewise (run.json's): a node with another release installed, whose
    settings may compute otherwise, fails before it loads the tower. ``identity_column``: a column of each path's
    identity as a run listed it (``embed``'s ``realpath``): a URL's bytes are then checked to be the object it names
    (its version, or its ETag).
    """

    def __init__(self, source: Any, *, column: str | None = None, kind: str | None = None, fps: float | None = None,
                 threads: int | None = None, weights_sha256: str | None = None, package_version: str | None = None,
                 identity_column: str | None = None, **options: Any) -> None:
        if package_version not in (None, installed := version.package_version()):
            raise ConfigError(f"this node's qwenvl-vision is {installed}, the run's {package_version}: install the "
                              f"run's version on every node")
        kind = kind or column
        if column is not None and kind not in INPUT_KINDS:
            raise ValueError(f"column {column!r}: pass kind= (one of {list(INPUT_KINDS)})")
        self.options = {name: options.pop(name) for name in ENCODE_OPTIONS if name in options}
        EncodeOptions(video_config=VideoConfig(), **self.options)  # refused before the tower loads
        self.column, self.kind, self.identity_column = column, kind, identity_column
        self.opener = ItemOpener()  # a URL or a shard member named by its path: read as the local engine does
        if threads is not None:
            torch.set_num_threads(threads)
        large_pillow_blocks()
        self.encoder = load_encoder(source, **options)
        if weights_sha256 is not None:
            from ..inputs.item_ids import weights_sha256 as tower_hash

            found = tower_hash(self.encoder.model)
            if found != weights_sha256:
                raise CheckpointError(f"{source}: the actor's tower hashes to {found[:12]}..., the run's to "
                                      f"{weights_sha256[:12]}... (another checkpoint, or other random weights)")
        pooled = bool(self.options.get("pooled"))
        self.layout = ParquetLayout.for_encoder(self.encoder, tokens=not pooled, pooled=pooled)
        if fps is not None:
            self.options["video_config"] = dataclasses.replace(self.encoder.video_config, fps=fps)

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

    def _items(self, values: Sequence[Any], kind: str, identities: Sequence[Any] | None
               ) -> tuple[list[Any], dict[int, str], dict[int, str]]:
        """(what iter_encode gets per row, rows already known bad -> error, row -> the name its errors use)."""
        items: list[Any] = []
        bad: dict[int, str] = {}
        names: dict[int, str] = {}
        for row, value in enumerate(values):
            if kind == "path":
                if isinstance(value, (str, os.PathLike)):
                    # (path, its identity as the run listed it), opened as the encoder reaches it (``__call__``).
                    value = (os.fspath(value), None if identities is None else identities[row])
                else:
                    bad[row] = f"path: expected a file path, got {type(value).__name__}"
            elif kind == "image":
                names[row] = "image array"
                if value is None:
                    bad[row] = "image array: missing (null)"
            else:
                names[row] = "image bytes"
                if isinstance(value, (bytes, bytearray, memoryview)):
                    value = FileBytes(names[row], bytes(value))
                else:
                    bad[row] = f"image bytes: expected bytes, got {type(value).__name__}"
            items.append(value)
        return items, bad, names

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        name, kind = self._input_column(batch)
        identities = None if self.identity_column is None else batch.get(self.identity_column)
        items, bad, names = self._items(list(batch[name]), kind, identities)
        results = {row: ItemResult(row, names.get(row, "input"), error=error) for row, error in bad.items()}
        todo = [row for row in range(len(items)) if row not in bad]
        opened = (self.opener(*items[row]) if kind == "path" else items[row] for row in todo)
        video = None if kind == "path" else False
        for done in self.encoder.iter_encode(opened, video=video, **self.options) if todo else []:
            for result in done:
                row = todo[result.index]
                # iter_encode names an array by its place in the batch, bytes by their name: the row's kind says more.
                if result.error is not None and row in names and result.error.startswith(result.name):
                    result.error = names[row] + result.error[len(result.name):]
                results[row] = result
        keep = {k: v for k, v in batch.items() if k != name or kind == "path"}
        return self._table(keep, [results[row] for row in range(len(items))])

    def _table(self, keep: dict[str, np.ndarray], results: list[ItemResult]) -> pa.Table:
        passthrough = BlockAccessor.batch_to_block(keep) if keep else None
        columns: dict[str, pa.Array] = {}
        if passthrough is not None:
            columns.update({n: passthrough.column(n) for n in passthrough.column_names})
        records = [record_from_result(r, path=r.name, realpath=r.name) for r in results]
        columns.update(result_columns(records, self.layout))
        columns["pixels_sha256"] = pa.array([r.pixels_sha256 for r in records], pa.string())
        return pa.table(columns)


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
        raise ConfigError(f"{concurrency} actors cannot share the cluster's {total:g} CPUs (Ray counts CPUs in "
                          f"steps of 0.0001): use fewer actors (embed: --ray-actors)")
    return share


def embed_dataset(ds: ray.data.Dataset, source: Any, *, concurrency: int = 1, batch_size: int = 16,
                  num_cpus: float | None = None, num_gpus: float | None = None, **options: Any) -> ray.data.Dataset:
    """``ds.map_batches(Embedder)`` with ``concurrency`` actors (one encoder each), ``batch_size`` rows a batch;
    ``options`` are Embedder's (encode and ``load_encoder`` options). ``num_cpus`` per actor defaults to
    ``actor_cpus(concurrency)``; with ``num_gpus`` (e.g. 1), each actor's encoder goes to the GPU Ray gives it.
    A dead actor is restarted and its batch retried (Ray Data's defaults)."""
    resources: dict[str, float] = {"num_cpus": actor_cpus(concurrency) if num_cpus is None else num_cpus}
    if num_gpus:
        resources["num_gpus"] = num_gpus
        options.setdefault("device", "cuda")
    # compute= rather than concurrency=, which Ray 2.51 deprecated for actor pools.
    return ds.map_batches(Embedder, fn_constructor_args=(source,), fn_constructor_kwargs=options,
                          compute=ray.data.ActorPoolStrategy(size=concurrency), batch_size=batch_size,
                          batch_format="numpy", **resources)


def records_from_batch(batch: pa.Table, *, path_column: str = "path") -> list[EmbeddingRecord]:
    """Embedder's rows (a batch of ``Dataset.iter_batches(batch_format="pyarrow")``) as ``records.EmbeddingRecord``s,
    what every writer takes, tensors float32 (``parquet_reader.records_of_table``). ``realpath`` is resolved here unless
    the batch has a column of it."""
    if not isinstance(batch, pa.Table):
        raise InputError(f"records_from_batch takes a pyarrow Table (iter_batches(batch_format=\"pyarrow\")), "
                         f"got {type(batch).__name__}")
    try:
        return records_of_table(batch, "float32", path_column=path_column)
    except (KeyError, ValueError) as e:  # a column missing, or of another type: named
        raise InputError(f"the batch is not Embedder's rows: {e}") from None
