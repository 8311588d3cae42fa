"""``qwenvl-vision embed``, the batch job (docs/embed.md). This package's own namespace is the reader API
(``read_embeddings``, ``read_encoded``, ``read_run``, ``read_manifest_lines`` and the folder's file names): reading an
output back imports neither the writer nor the folder lock. The modules' map: docs/architecture.md.
"""

from __future__ import annotations

from .manifest import MANIFEST, RUN_FILE, RUN_FORMAT
from .reader import read_embeddings, read_encoded, read_manifest_lines, read_run

__all__ = ["MANIFEST", "RUN_FILE", "RUN_FORMAT", "read_embeddings", "read_encoded", "read_manifest_lines", "read_run"]
