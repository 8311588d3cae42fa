"""What an encode returns: ``EncodeResult`` (a call's items, in input order, with what hands them to a language
model) and ``ItemResult`` (one input's outcome in a streamed encode: tensors, or the error that stopped it)."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import PreprocessError, QwenVLVisionError
from .inputs.video_io import VideoInfo


@dataclass(eq=False)  # tensors have no one truth value: results are compared by their tensors
class EncodeResult:
    """Per-item outputs in input order.

    embeddings: one (tokens_i, out_hidden_size) tensor per image/video (tokens_i = t*h*w / merge_size**2).
    grid_thw: (n, 3) int64, each item's patch grid.
    deepstack: per item, the list of its DeepStack levels (each the shape of its embedding); empty lists for
        towers without DeepStack (every family but Qwen3-VL, Qwen3-VL-MoE and Qwen3-Omni).
    pooled: (n, out_hidden_size) mean over each item's tokens, when requested.
    video_info: per item, what was read from a video file or sampled from frames by their ``video_fps`` (frames
        kept, source fps, timestamps; a ``video.VideoInfo``), None for images, for frames kept as given and for
        ``encode_patches``.
    modality: what the items are, "image" or "video" (``encode_videos``; ``encode_patches`` says what its
        caller says): a language model places image and video tokens differently.
    family: the tower's ``model_type`` (``VisionEncoder.family``), the family these embeddings belong to.
    pixels_sha256: per item, a hash of the pixel rows the tower read (``item_ids.pixels_sha256``; None where not
        hashed): with the encoder's ``identity()``, what ``to_vllm_cache`` names each item by.
    encoder: a weak reference to the encoder that made the result (it does not keep the encoder alive; a pickled
        or ``torch.save``d result drops it).
    merge_size: the tower's spatial merge (``spatial_merge_size``: merge_size x merge_size patches make one token;
        2 in every release), which the hand-off holds the tokens to.
    """

    embeddings: list[torch.Tensor]
    grid_thw: torch.Tensor
    deepstack: list[list[torch.Tensor]] = field(default_factory=list)
    pooled: torch.Tensor | None = None
    video_info: list[VideoInfo | None] = field(default_factory=list)
    modality: str = "image"
    family: str = ""
    pixels_sha256: list[str] = field(default_factory=list)
    encoder: Any = field(default=None, repr=False, compare=False)
    merge_size: int = 2

    def __len__(self) -> int:
        return len(self.embeddings)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encoder": None}  # a weak reference does not pickle

    def __copy__(self) -> EncodeResult:
        return dataclasses.replace(self)

    def __deepcopy__(self, memo: dict) -> EncodeResult:
        return dataclasses.replace(self, **{f.name: copy.deepcopy(getattr(self, f.name), memo)
                                            for f in dataclasses.fields(self) if f.name != "encoder"})

    def to_transformers(self, *more: Any, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> dict:
        """The keyword arguments of a transformers Qwen VL model's ``forward`` / ``generate`` that stand for this
        batch's pixels, and ``more`` results' after them (``mm_encoder_outputs`` and the grids):
        ``handoff.to_transformers``."""
        from .outputs.handoff import to_transformers

        return to_transformers(self, *more, dtype=dtype, device=device)

    def to_vllm(self, *more: Any, dtype: torch.dtype | str | None = None,
                device: torch.device | str | None = None) -> dict:
        """vLLM's ``multi_modal_data`` for this batch and ``more`` results after it (DeepStack levels concatenated
        along the features): ``handoff.to_vllm``."""
        from .outputs.handoff import to_vllm

        return to_vllm(self, *more, dtype=dtype, device=device)

    def to_vllm_cache(self, path: str | os.PathLike) -> list[dict]:
        """Write each item into a vLLM encoder cache folder (``ECExampleConnector``'s layout) and return what a
        request needs of each (its id, modality, grid and timing): ``vllm_cache.write_vllm_cache``."""
        from .outputs.vllm_cache import write_vllm_cache

        return write_vllm_cache(self, path)


@dataclass(eq=False)
class ItemResult:
    """One input's outcome in a streamed encode: either tensors or the error that stopped it."""

    index: int
    name: str
    embedding: torch.Tensor | None = None
    grid_thw: tuple[int, int, int] | None = None
    deepstack: list[torch.Tensor] | None = None
    pooled: torch.Tensor | None = None
    video_info: VideoInfo | None = None  # a video file's frames, fps and timestamps
    pixels_sha256: str | None = None  # item_ids.pixels_sha256 of the pixel rows the tower read
    error: str | None = None
    error_class: type[QwenVLVisionError] = PreprocessError  # what encode_images raises for this error

    @property
    def ok(self) -> bool:
        return self.error is None
