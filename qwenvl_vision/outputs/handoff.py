"""Hand the tower's outputs to a language model in place of pixels: transformers' ``mm_encoder_outputs=`` and vLLM's
embedding inputs (docs/handoff.md), from an ``EncodeResult`` or tensors read back from an ``embed`` run.

transformers 5.24 (the reference; ``transformers/models/<family>/modeling_<family>.py`` of the family's
model_type, ``<Family>Model.forward``: the block that starts ``if (pixel_values is not None or
pixel_values_videos is not None) and mm_encoder_outputs is not None`` and the ``mm_encoder_outputs.get("image")``
/ ``.get("video")`` branches after it, in ``Qwen2VLModel``, ``Qwen3VLModel``, the Omni thinkers'
``forward``; the encoders' own output in their ``get_image_features``):

- ``mm_encoder_outputs={"image": out, "video": out}`` with the grids and, for M-RoPE, ``mm_token_type_ids`` (0 text,
  1 image, 2 video; the Omni thinkers do not take it: they find the items after each vision start token).
- ``out.pooler_output`` is a tuple with one ``(tokens_i, out_hidden_size)`` tensor per item, concatenated in order
  into the placeholder tokens of that modality; the families without DeepStack read only that
  (``BaseModelOutputWithPooling``).
- Qwen3-VL, Qwen3-VL-MoE and Qwen3-Omni also read ``out.deepstack_features``: per level a tuple with one tensor per
  item (``BaseModelOutputWithDeepstackFeatures``, defined in each of the three modeling files).

vLLM 0.33 (``vllm/model_executor/models/qwen2_vl.py``, ``qwen2_5_vl.py``, ``qwen3_vl.py``: the ``image_embeds`` /
``video_embeds`` inputs, ``Qwen3VLMultiModalDataParser``, ``Qwen3VLProcessingInfo._calculate_timestamps`` and
``Qwen3VLForConditionalGeneration._compute_deepstack_embeds``; vLLM is not a dependency: tests/contract/ runs
this layout through vLLM's own code in a venv of its own):

- ``image_embeds`` / ``video_embeds`` ``(sum of tokens, width)`` over the prompt's items of that modality in order,
  their grids ``(items, 3)``; for the DeepStack families width ``D * (1 + levels)``, which
  ``_compute_deepstack_embeds`` splits at ``visual_dim`` and views as ``(levels, D)`` per token.
- Video timing: the parsers of ``Family.prompt_timestamps`` require ``timestamps`` (``vllm_timestamps``, from
  ``video_info``; frames given in memory without their rate have none: an InputError naming ``video_info``). The
  Omni thinkers' take ``second_per_grid_ts``, ``temporal_patch_size / video_info.requested_fps`` as their
  processors compute it, which ``to_vllm`` always writes: without it vLLM assumes 1.0 (Qwen2.5-Omni) or 2.0
  (Qwen3-Omni). Qwen2.5-VL's take none (vLLM assumes 2 fps).

Deviations, on purpose:
- ``last_hidden_state`` is None in the outputs built here: transformers' own holds the tower's pre-merger patch
  states, which no Qwen VL forward reads and this package does not keep.
- ``to_transformers`` casts the tensors only when asked (``dtype=`` / ``device=``); the models cast
  ``pooler_output`` (and the DeepStack levels) to their own dtype and device anyway, so passing the model's
  avoids a second copy, not an error.
- Items are checked before anything is built (item count against grids, rows against ``t*h*w / merge**2``,
  DeepStack levels against the family), so a mismatch is an ``InputError`` naming the item instead of
  transformers' placeholder-count error or a silent mis-scatter.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices import DTYPE_SPELLINGS, dtype_name, resolve_dtype
from ..errors import ConfigError, InputError
from ..inputs.video import positive_number
from ..model.config import FAMILIES, family_named
from ..model.execution import check_grids

MODALITIES = ("image", "video")
# mm_token_type_ids values (transformers' ProcessorMixin.create_mm_token_type_ids): 0 text, 1 image, 2 video.
TOKEN_TYPES = {"image": 1, "video": 2}
TEMPORAL_PATCH = 2  # and packs 2 frames into one temporal patch


@dataclass
class EncodedItems:
    """Per-item vision outputs of one modality, in prompt order: what ``to_transformers`` / ``to_vllm`` read.

    An ``EncodeResult`` carries the same attributes; this class is the form for tensors read back from an
    ``embed`` run (``read_embeddings(out, deepstack=True)`` gives each record's embedding and levels, its manifest
    line the grid, ``read_run(out)["family"]`` the family; a record with a ``"video"`` entry is a video).

    embeddings: one ``(tokens_i, D)`` tensor per item. grid_thw: ``(n, 3)`` patch grids (a tensor or lists).
    deepstack: per item its list of DeepStack levels (each the shape of its embedding), or empty lists / None for
    families without DeepStack. modality: "image" or "video". family: the tower's model_type. video_info: per
    video, the frames it was sampled at, its source frame rate and the fps asked for (a ``video_io.VideoInfo``, or an
    embed record's ``"video"`` entry), which ``to_vllm`` needs for the Qwen3-VL families and the Omni thinkers; None
    for images. merge_size: the tower's spatial merge (2 in every release; ``read_encoded`` reads the run's).
    """

    embeddings: Sequence[torch.Tensor]
    grid_thw: torch.Tensor | Sequence[Sequence[int]]
    deepstack: Sequence[Sequence[torch.Tensor]] | None = field(default=None)
    modality: str = "image"
    family: str = ""
    video_info: Sequence[Any] | None = None
    merge_size: int = 2


def _check(result: Any, what: str) -> EncodedItems:
    """One result's items as plain lists, validated: the shapes a language model's placeholders and DeepStack
    need (grids as ``check_grids`` checks them for the tower)."""
    try:
        embeddings, grid_thw = list(result.embeddings), result.grid_thw
        modality, family = result.modality, family_named(result.family, InputError)
    except AttributeError as e:
        raise InputError(f"{what} is not an encode result (needs embeddings, grid_thw, deepstack, modality, "
                         f"family): {e}") from None
    if modality not in MODALITIES:
        raise InputError(f"{what}: modality {modality!r} is not one of {MODALITIES}")
    merge = getattr(result, "merge_size", 2)
    grids = check_grids(grid_thw, merge, what)
    n = len(embeddings)
    deepstack = [list(levels) for levels in (getattr(result, "deepstack", None) or [[]] * n)]
    infos = list(getattr(result, "video_info", None) or [None] * n)
    for name, got in (("grids", grids), ("DeepStack level lists", deepstack), ("video_info entries", infos)):
        if len(got) != n:
            raise InputError(f"{what}: {n} embeddings but {len(got)} {name}")
    counts = {len(levels) for levels in deepstack}
    if embeddings and (len(counts) != 1 or (0 in counts) == family.deepstack):
        need = "its DeepStack levels for every item (read_embeddings(..., deepstack=True))" if family.deepstack \
            else "no DeepStack levels"
        raise InputError(f"{what}: a {family.label} language model takes {need}; got {sorted(counts)} levels per item")
    for i, (embedding, (t, h, w), levels) in enumerate(zip(embeddings, grids, deepstack, strict=True)):
        tokens = t * h * w // merge**2
        if embedding.dim() != 2 or embedding.shape[0] != tokens:
            raise InputError(f"{what}, item {i}: embedding of shape {tuple(embedding.shape)}, but grid {(t, h, w)} "
                             f"has {tokens} tokens")
        bad = [j for j, level in enumerate(levels) if level.shape != embedding.shape]
        if bad:
            raise InputError(f"{what}, item {i}: DeepStack level {bad[0]} of shape {tuple(levels[bad[0]].shape)}, "
                             f"not the embedding's {tuple(embedding.shape)}")
    return EncodedItems(embeddings, grids, deepstack, modality, family.model_type, infos, merge)


def _video_field(info: Any, *names: str) -> Any:
    """The first of ``names`` a video's ``video_info`` holds (a ``VideoInfo``, its ``dataclasses.asdict``, or an embed
    record's ``"video"`` entry), or None."""
    get = info.get if isinstance(info, dict) else lambda name: getattr(info, name, None)
    return next((value for value in map(get, names) if value is not None), None)


def vllm_timestamps(frame_indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """One time in seconds per temporal patch of a video, as vLLM's Qwen3-VL processor computes them
    (``Qwen3VLProcessingInfo._calculate_timestamps``): the sampled frame indices padded to a multiple of the
    temporal patch by repeating the last, each divided by the source fps, then the mean of each group's first and
    last."""
    indices = list(frame_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / video_fps for index in indices]
    step = temporal_patch_size
    return [(seconds[i] + seconds[i + step - 1]) / 2 for i in range(0, len(seconds), step)]


def _by_modality(results: Sequence[Any]) -> dict[str, EncodedItems]:
    """The results' items grouped by modality, each group in the order given (the prompt's order)."""
    checked = [_check(r, f"result {i}") for i, r in enumerate(results)]
    for name, kinds in (("families", {c.family for c in checked}), ("merge sizes", {c.merge_size for c in checked})):
        if len(kinds) > 1:
            raise InputError(f"results from towers of different {name}: {sorted(kinds)}")
    kinds = {(e.shape[1], e.dtype, len(levels)) for c in checked for e, levels in zip(c.embeddings, c.deepstack)}
    if len(kinds) > 1:  # one tower's outputs share them; items of two towers or two dtypes do not go in one prompt
        shown = ", ".join(f"width {d} {dtype_name(t)} with {n} levels" for d, t, n in sorted(kinds, key=str))
        raise InputError(f"the results' items differ in width, dtype or DeepStack levels ({shown}): hand over the "
                         f"items of one tower and one dtype")
    grouped: dict[str, EncodedItems] = {}
    for c in checked:
        into = grouped.setdefault(c.modality, EncodedItems([], [], [], c.modality, c.family, [], c.merge_size))
        into.embeddings += c.embeddings
        into.grid_thw += c.grid_thw
        into.deepstack += c.deepstack
        into.video_info += c.video_info
    return grouped


def _output_class(family: str) -> type:
    """The class the family's own ``get_image_features`` returns (DeepStack families define their own)."""
    if FAMILIES[family].deepstack:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return module.BaseModelOutputWithDeepstackFeatures
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling


def model_placement(dtype: torch.dtype | str | None, device: torch.device | str | None
                    ) -> tuple[torch.dtype | None, torch.device | None]:
    """A hand-off's ``dtype`` and ``device``, the language model's (None: the items' own): torch's, or a dtype as
    ``load_encoder`` spells it; anything else is a ConfigError naming it, not torch's error."""
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, torch.device("cpu"))
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype {dtype!r}: a torch.dtype or one of {sorted(DTYPE_SPELLINGS)}")
    try:
        return dtype, None if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; a torch.device or its name (cpu, cuda:0, ...)") from None


def to_transformers(result: Any, *more: Any, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> dict[str, Any]:
    """Keyword arguments for a transformers 5.24 Qwen VL model's ``forward`` / ``generate`` in place of pixels.

    ``result`` (and ``more``): ``EncodeResult``s or ``EncodedItems``; items of a modality are taken in the order
    given, which must be the order of their placeholders in the prompt. Returns ``{"mm_encoder_outputs":
    {"image": ..., "video": ...}, "image_grid_thw": ..., "video_grid_thw": ...}`` (the modalities present). Add
    ``input_ids``, ``attention_mask`` and ``mm_token_type_ids`` (``mm_token_type_ids`` here, or the processor's),
    and a video's timing where the family takes one (Qwen2.5-VL's ``second_per_grid_ts``, 2 / ``sampled_fps``; the
    Omni thinkers' ``video_second_per_grid``, 2 / ``requested_fps``; or the processor's), as the prompt's.
    ``dtype`` / ``device``: the model's, to hand over tensors it need not copy. Imports transformers.
    """
    dtype, device = model_placement(dtype, device)
    outputs: dict[str, Any] = {}
    kwargs: dict[str, Any] = {"mm_encoder_outputs": outputs}
    for modality, items in _by_modality((result, *more)).items():
        fields: dict[str, Any] = {"last_hidden_state": None,
                                  "pooler_output": tuple(e.to(device, dtype) for e in items.embeddings)}
        if FAMILIES[items.family].deepstack:
            fields["deepstack_features"] = [tuple(level.to(device, dtype) for level in per_level)
                                            for per_level in zip(*items.deepstack)]
        outputs[modality] = _output_class(items.family)(**fields)
        kwargs[f"{modality}_grid_thw"] = torch.tensor(items.grid_thw, dtype=torch.long, device=device).view(-1, 3)
    return kwargs


def to_vllm(result: Any, *more: Any, dtype: torch.dtype | str | None = None,
            device: torch.device | str | None = None) -> dict[str, dict[str, Any]]:
    """vLLM's ``multi_modal_data`` for a prompt (``LLM(..., enable_mm_embeds=True)``): ``{"image": {"image_embeds":
    T, "image_grid_thw": G}, "video": {"video_embeds": ..., "video_grid_thw": ...}}`` (the modalities present).

    T is ``(sum of tokens, D)`` over the items in order; for the DeepStack families each row is ``[merged |
    level 0 | level 1 | ...]`` (width ``D * (1 + levels)``), the layout vLLM's ``_compute_deepstack_embeds``
    splits back (``split_vllm_deepstack``). Videos carry their timing where the family needs it (see the module
    docstring): the Qwen3-VL families' ``"timestamps"`` (per video one float per temporal patch,
    ``vllm_timestamps``), the Omni thinkers' ``"second_per_grid_ts"`` (one float per video), from each item's
    ``video_info``.
    """
    dtype, device = model_placement(dtype, device)
    data: dict[str, dict[str, Any]] = {}
    for modality, items in _by_modality((result, *more)).items():
        per_item = _items_for_vllm(items)
        rows = [item.rows for item in per_item]
        fields = data[modality] = {
            f"{modality}_embeds": (torch.cat(rows) if rows else torch.empty(0, 0)).to(device, dtype),
            f"{modality}_grid_thw": torch.tensor(items.grid_thw, dtype=torch.long, device=device).view(-1, 3)}
        if any(item.timestamps is not None for item in per_item):  # a family's videos all have them or none do
            fields["timestamps"] = [item.timestamps for item in per_item]
        if any(item.second_per_grid_t is not None for item in per_item):
            fields["second_per_grid_ts"] = torch.tensor([item.second_per_grid_t for item in per_item])
    return data


@dataclass
class VllmItem:
    """One item as a vLLM model's encoder output holds it: its rows (``[merged | level 0 | ...]``), its grid,
    and the timing its family's prompt needs (``timestamps`` / ``second_per_grid_t``; None where it needs none)."""

    modality: str
    rows: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamps: list[float] | None = None
    second_per_grid_t: float | None = None


def vllm_items(result: Any) -> list[VllmItem]:
    """Each item of one result (an ``EncodeResult`` or ``EncodedItems``) as vLLM's encoder output holds it, checked
    as ``to_vllm`` checks it."""
    return _items_for_vllm(_check(result, "result"))


def _items_for_vllm(items: EncodedItems) -> list[VllmItem]:
    """Each checked item in vLLM's encoder-output form, a video's timing from its ``video_info``, checked against
    its grid."""
    family = FAMILIES[items.family]
    out = []
    for i, (embedding, levels, grid, info) in enumerate(zip(items.embeddings, items.deepstack, items.grid_thw,
                                                            items.video_info, strict=True)):
        item = VllmItem(items.modality, torch.cat([embedding, *levels], dim=-1) if levels else embedding, grid)
        out.append(item)
        if items.modality == "video" and family.seconds_per_grid:
            fps = _video_field(info, "requested_fps")
            if not positive_number(fps):
                raise InputError(f"video {i}: vLLM's {family.label} models need the fps its frames were sampled at, "
                                 f"and its video_info has no requested_fps ({fps!r}): encode the video file, give "
                                 f"video_fps, or build EncodedItems(..., video_info=) with requested_fps (the fps "
                                 f"given to encode_videos)")
            item.second_per_grid_t = TEMPORAL_PATCH / float(fps)
        elif items.modality == "video" and family.prompt_timestamps:
            found = _video_field(info, "frames", "frame_indices"), _video_field(info, "fps", "video_fps")
            # An array's or a tensor's as Python's list and float: their truth and types are numpy's and torch's.
            indices, fps = (getattr(value, "tolist", lambda value=value: value)() for value in found)
            if not isinstance(indices, (list, tuple)) or not indices or not positive_number(fps):
                raise InputError(f"video {i}: vLLM's {family.label} models need each video's timestamps, and its "
                                 f"video_info holds no frame indices and source fps (frames in memory without "
                                 f"video_fps?): encode the video file, give video_fps, or build EncodedItems(..., "
                                 f"video_info=) with its sampled frame indices and source fps")
            item.timestamps = vllm_timestamps([int(x) for x in indices], float(fps), TEMPORAL_PATCH)
            if len(item.timestamps) != grid[0]:
                raise InputError(f"video {i}: {len(indices)} sampled frames make {len(item.timestamps)} temporal "
                                 f"patches, but its grid has t={grid[0]}")
    return out


def split_vllm_deepstack(embeds: torch.Tensor, levels: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(merged, [level 0, level 1, ...])`` from a ``to_vllm`` embeds tensor, split as vLLM's
    ``Qwen3VLForConditionalGeneration._compute_deepstack_embeds`` splits it: ``visual_dim = width / (1 + levels)``,
    ``torch.split(embeds, [visual_dim, levels * visual_dim], dim=-1)``, the rest viewed as ``(tokens, levels,
    visual_dim)`` and read level by level (vLLM's ``permute(1, 0, 2)`` of the scattered copy)."""
    if embeds.dim() != 2 or levels < 0 or embeds.shape[-1] % (1 + levels):
        raise InputError(f"embeds of shape {tuple(embeds.shape)} do not hold 1 + {levels} equal feature blocks")
    visual_dim = embeds.shape[-1] // (1 + levels)
    merged, multiscale = torch.split(embeds, [visual_dim, levels * visual_dim], dim=-1)
    per_level = multiscale.reshape(embeds.shape[0], levels, visual_dim).permute(1, 0, 2)
    return merged, list(per_level.unbind(0))


def mm_token_type_ids(input_ids: torch.Tensor, *, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` for ``input_ids``: 1 at image placeholders, 2 at video ones, 0 elsewhere
    (as its processors build them; the M-RoPE positions of Qwen2-VL .. Qwen4-Exp are computed from it)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == image_token_id] = TOKEN_TYPES["image"]
    types[input_ids == video_token_id] = TOKEN_TYPES["video"]
    return types
