"""``qwenvl-vision embed``: folders of images and videos -> safetensors shards + manifest.jsonl, or Parquet shards of
one row per input (``--format parquet``), resumable, multi-rank, or on Ray (``--engine ray``). This package's own
namespace is the reader API (``read_embeddings``, ``read_encoded``, ``read_run``, ``read_manifest_lines`` and the
folder's file names): reading an output back imports neither the writer nor the folder lock.

The modules, one job each: ``inputs`` (what a run works on, each rank's share), ``manifest`` (what the folder's
files hold), ``reader`` (reading them back), ``writer`` (durable writes, recovery, the ranks' merge),
``parquet_writer`` (the same for Parquet shards), ``ray_engine`` (the encoding as a Ray Data pipeline), ``lock``
(one writer per folder), ``run_record`` (run.json: what the tensors depend on, the resume check), ``progress``
(stderr while it runs), ``job`` (one run, start to end; exit codes) and ``args`` (the command line).
"""

from __future__ import annotations

from .manifest import MANIFEST, RUN_FILE, RUN_FORMAT
from .reader import read_embeddings, read_encoded, read_manifest_lines, read_run

__all__ = ["MANIFEST", "RUN_FILE", "RUN_FORMAT", "read_embeddings", "read_encoded", "read_manifest_lines", "read_run"]
