"""One input's outcome as every output stores it: ``EmbeddingRecord``, from the encoder's ``ItemResult`` (or an
input known bad before encoding) to every writer (the safetensors manifest, the Parquet rows, the vLLM encoder
cache), from Ray's rows, and back from the Parquet reader. No format's library is needed to build one.

Not the ``ItemResult`` itself: the readers and Ray's rows give a record back with no encoder behind it (the token
count without the tokens of a pooled-only run, a video's frames as stored, not its ``VideoInfo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..inputs.video_io import video_record
from ..results import ItemResult


@dataclass
class EmbeddingRecord:
    """One input's row: what the writer takes and the reader gives back. Tensors are None for an error row;
    ``deepstack`` is empty when the run has no levels (or stores only pooled vectors)."""

    path: str
    realpath: str
    status: str
    error: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    tokens: int | None = None  # merged tokens, t*h*w / merge**2 (also in a run that stores only pooled vectors)
    embedding: torch.Tensor | None = None
    deepstack: list[torch.Tensor] = field(default_factory=list)
    pooled: torch.Tensor | None = None
    video: dict | None = None
    pixels_sha256: str | None = None  # item_ids.pixels_sha256, what the encoder cache names it by (not in Parquet)
    columns: dict[str, Any] | None = None  # what its table row carries (embed --keep-columns); None: no table row

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def record_from_result(result: ItemResult, path: str, realpath: str,
                       columns: dict[str, Any] | None = None) -> EmbeddingRecord:
    """The encoder's ``result`` as the record of the input at ``path`` (its identity ``realpath``), carrying its
    table row's ``columns``."""
    video = video_record(result.video_info)
    if result.error is not None:
        return EmbeddingRecord(path, realpath, "error", result.error, video=video, columns=columns)
    return EmbeddingRecord(path, realpath, "ok", None, tuple(int(x) for x in result.grid_thw),
                           int(result.embedding.shape[0]), result.embedding, list(result.deepstack or []),
                           result.pooled, video, result.pixels_sha256, columns)
