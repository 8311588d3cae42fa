"""``qwenvl-vision embed``, the batch job (docs/embed.md). This package's own namespace is the reader API
(``read_embeddings``, ``read_encoded``, ``read_run``, ``read_manifest_lines`` and the folder's file names): reading an
output back imports neither the writer nor the folder lock.

The modules, one job each: ``inputs`` (what a run works on, each rank's share; ``tables``, ``shards`` and ``remote``
read tables, WebDataset shards and URLs), ``manifest`` (what the folder's files hold), ``reader`` (reading them
back), ``writer`` (durable writes, recovery, the ranks' merge), ``parquet_writer`` and ``cache_writer`` (the same for
Parquet shards and vLLM encoder-cache items), ``ray_engine`` and ``ray`` (the encoding as a Ray Data pipeline),
``lock`` (one writer per folder), ``run_record`` (run.json: what the tensors depend on, the resume check),
``progress`` (stderr while it runs), ``job`` (one run, start to end; exit codes) and ``args`` (the command line).
"""

from __future__ import annotations

from .manifest import MANIFEST, RUN_FILE, RUN_FORMAT
from .reader import read_embeddings, read_encoded, read_manifest_lines, read_run

__all__ = ["MANIFEST", "RUN_FILE", "RUN_FORMAT", "read_embeddings", "read_encoded", "read_manifest_lines", "read_run"]
