"""Reading an embed output back: its run file (``read_run``), its manifest records (``read_manifest_lines``)
and the stored tensors (``read_embeddings``), of every format: safetensors shards or vLLM encoder-cache items with
manifest.jsonl, or ``--format parquet`` shards (read through ``parquet_reader.read_parquet_records``, pyarrow imported
only then). Readers need nothing of the writer: no lock, no torch.distributed.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ManifestError
from ..inputs.urls import redacted_text
from .manifest import MANIFEST, RUN_FIELDS, RUN_FILE, RUN_FORMAT, parquet_shards, read_manifest_lines


def read_run(out: str | os.PathLike) -> dict:
    """The run file (``DIR/run.json``) of an embed output: what produced its tensors, the keys of
    ``manifest.RUN_FIELDS``. ``config_sha256`` covers the vision and preprocessing configs; ``min_pixels`` is above
    ``max_pixels`` where an option crossed the checkpoint's other bound; ``cwd`` is where the run started (each
    manifest record's ``path`` is as given to the invocation that recorded it, its ``realpath`` the resolved file).
    Raises ManifestError if missing or damaged."""
    path = Path(out) / RUN_FILE
    try:
        run = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        copied = ": Parquet shards copied without it? copy it too" if parquet_shards(Path(out)) else ""
        raise ManifestError(f"{path} does not exist: not an embed output{copied}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is damaged: {e}") from None
    if not isinstance(run, dict) or not isinstance(run.get("format", RUN_FORMAT), int):
        raise ManifestError(f"{path} is damaged: not a run record; restore it (or move the folder away and embed "
                            f"afresh)")
    if run.get("format", RUN_FORMAT) > RUN_FORMAT:  # without one: damaged (the fields' check)
        raise ManifestError(f"{path} has format {run['format']}; this qwenvl-vision reads format {RUN_FORMAT} "
                            f"(upgrade it)")
    missing = [key for key in RUN_FIELDS if key not in run]
    if missing:
        raise ManifestError(f"{path} is damaged: no {', '.join(missing)}; restore it (or move the folder away and "
                            f"embed afresh)")
    return run


def read_embeddings(out: str | os.PathLike, *, deepstack: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every input recorded ok in DIR/manifest.jsonl, in manifest order, or in DIR's Parquet
    shards (a ``--format parquet`` run), in shard and row order (a file replaced since it was recorded has the
    record of its last resume that listed it). A ``--format vllm-cache`` run's items are split back into the
    embedding and its DeepStack levels.

    With deepstack=True yields (path, (embedding, [levels...])) for Qwen3-VL runs. What produced the tensors
    (model, dtype, pixel bounds, pooling): ``read_run(DIR)``, whose ManifestError refuses a folder that is no embed
    output here too. A damaged manifest line, a missing shard or key raises ManifestError naming the line or the
    shard; a damaged Parquet shard, naming the file. An encoder-cache item that ``cache prune`` removed (listed in
    the folder's ``pruned.jsonl``) is skipped, with one warning saying how many. Both formats yield the same values
    for the same run: the tokens in the run's dtype, pooled vectors as float32 (as the safetensors shards store
    them).
    """
    out = Path(out)
    if read_run(out)["file_format"] == "parquet":
        yield from _parquet_embeddings(out, deepstack)
    else:
        yield from _manifest_embeddings(out, _manifest_ok(out), deepstack)


def _manifest_ok(out: Path) -> list[dict]:
    """The manifest's ok records."""
    if any(out.glob("manifest.rank*.jsonl")):  # the manifest, if any, is behind them
        raise ManifestError(f"{out} holds the ranks' manifest parts: a run of several ranks is going on, or stopped "
                            f"before merging them into {MANIFEST}; embed --resume on the folder finishes and merges it")
    return [r for r in read_manifest_lines(out / MANIFEST) if r["status"] == "ok"]


def _manifest_embeddings(out: Path, records: list[dict], deepstack: bool) -> Iterator[tuple[str, object]]:
    handle, open_shard, pruned, skipped = None, None, set(), 0
    for r in records:
        try:
            if r["shard"] != open_shard:
                handle, open_shard = safe_open(out / r["shard"], framework="pt"), r["shard"]
            tensor = handle.get_tensor(r["key"])
            if "levels" in r:  # an encoder-cache item: [merged | level 0 | ...] along the features, as vLLM splits it
                from ..outputs.handoff import split_vllm_deepstack

                tensor, levels = split_vllm_deepstack(tensor, r["levels"])
                tensor, levels = tensor.contiguous(), [level.contiguous() for level in levels]
            elif deepstack:
                prefix = r["key"] + ".deepstack."  # levels by number: as text, 10 would come before 2
                levels = [handle.get_tensor(k) for k in sorted((k for k in handle.keys() if k.startswith(prefix)),
                                                                key=lambda k: int(k[len(prefix):]))]
        except Exception as e:  # noqa: BLE001 - safetensors' own error for a missing or damaged shard or tensor
            if "levels" in r and not (out / r["shard"]).is_file():
                from ..outputs.cache_prune import PRUNED

                if r.get("id") not in pruned:  # read again: a prune may run meanwhile (it lists items before they go)
                    pruned = {p["id"] for p in read_manifest_lines(out / PRUNED, strict=False)}  # torn: a kill's
                if r.get("id") in pruned:
                    skipped += 1
                    continue
            raise ManifestError(f"{out / MANIFEST}: {r['shard']} {r['key']!r} cannot be read ({e})") from None
        yield r["path"], (tensor, levels) if deepstack else tensor
    if skipped:
        warnings.warn(f"{out}: {skipped} item(s) removed by `qwenvl-vision cache prune` (listed in pruned.jsonl) "
                      f"were skipped", stacklevel=2)


def _parquet_embeddings(out: Path, deepstack: bool) -> Iterator[tuple[str, object]]:
    from ..outputs.parquet_reader import read_parquet_records

    # No shards where the run stopped before its first.
    for record in (r for r in read_parquet_records(parquet_shards(out)) if r.ok):
        if record.embedding is None:  # a pooled-only run
            tensor, levels = record.pooled.float(), []
        else:
            tensor, levels = record.embedding, record.deepstack
        yield record.path, ((tensor, levels) if deepstack else tensor)


def read_encoded(out: str | os.PathLike, paths: list[str] | None = None, *, modality: str | None = None):
    """Stored results as the language model takes them: a ``handoff.EncodedItems`` of the ok records of ``paths``
    (as recorded, in that order; None: every ok record of the modality), with their grids, DeepStack levels and
    the run's family, for ``handoff.to_transformers`` / ``to_vllm``, the same as ``EncodeResult`` converts.

    ``modality``: "image" or "video"; None takes the records' own when they agree. A prompt's images and its
    videos are two calls. A ``--pooled-only`` run has no tokens to hand over, and a path recorded twice (two files
    given under one relative path from two directories) is ambiguous: a ManifestError each.
    """
    from ..outputs.handoff import EncodedItems

    if modality not in (None, "image", "video"):
        raise ManifestError(f"modality {modality!r}: use 'image' or 'video'")
    if isinstance(paths, (str, os.PathLike)):  # else read as one path per character
        raise ManifestError(f"paths must be a list of recorded paths, got one ({str(paths)[-200:]!r}): pass [it]")
    run = read_run(out)
    if run.get("pooled"):
        raise ManifestError(f"{out} is a --pooled-only run: it stores one vector per input, not the tokens a "
                            f"language model takes")
    out = Path(out)
    if run["file_format"] == "parquet":  # the small columns first (grids, tokens), the asked-for tensors after
        from ..outputs.parquet_reader import read_parquet_grids

        stored = [grid for path in parquet_shards(out) for grid in read_parquet_grids(path)]
        tensors_of = _parquet_embeddings(out, True)
    else:
        records = _manifest_ok(out)
        stored = [(r["path"], r["grid_thw"], r.get("video"), r["tokens"]) for r in records]
        tensors_of = _manifest_embeddings(out, records, True)
    found: dict[str, tuple[list[int], str, dict | None]] = {}
    merge = 2  # the tower's merge size, as a record's grid and tokens give it (tokens = t*h*w / merge**2)
    for path, grid, video, tokens in stored:
        if path in found:
            raise ManifestError(f"{out} records {path!r} twice (two files under one relative path): ask by realpath "
                                f"in read_manifest_lines, or pass paths as recorded once")
        found[path] = (grid, "video" if video else "image", video)
        merge = math.isqrt(math.prod(grid) // tokens)
    # A URL's path is stored with its secrets as *** (inputs.urls): asked for as given, it is found as stored.
    wanted = list(found) if paths is None else [p if p in found else redacted_text(p) for p in paths]
    missing = [p for p in wanted if p not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ManifestError(f"{out} has no ok record for {missing[0]!r}{more}")
    kinds = {found[p][1] for p in wanted}
    if modality is None and len(kinds) > 1:
        raise ManifestError("these records are images and videos: pass modality='image' or 'video' (a prompt's "
                            "images and its videos are handed over separately)")
    modality = modality or (kinds.pop() if kinds else "image")
    if paths is None:
        wanted = [p for p in wanted if found[p][1] == modality]
    elif any(found[p][1] != modality for p in wanted):
        raise ManifestError(f"not every one of these records is a {modality}")
    keep = set(wanted)
    tensors = {path: value for path, value in tensors_of if path in keep}
    # What the reading skipped is an item ``cache prune`` removed (it warned): left out of "every record",
    # refused by name when asked for.
    pruned = [p for p in wanted if p not in tensors]
    if pruned and paths is not None:
        more = f" (and {len(pruned) - 1} more)" if len(pruned) > 1 else ""
        raise ManifestError(f"{out}: the item of {pruned[0]!r}{more} was removed by `qwenvl-vision cache prune` "
                            f"(listed in pruned.jsonl); embed --resume embeds it again")
    wanted = [p for p in wanted if p in tensors]
    # A record without requested_fps (a Parquet row: no column holds it) was sampled at the run's video fps.
    fps = run["video"]["fps"]  # run.json always records it
    infos = [found[p][2] if found[p][2] is None or "requested_fps" in found[p][2]
             else {**found[p][2], "requested_fps": fps} for p in wanted]
    return EncodedItems([tensors[p][0] for p in wanted], [found[p][0] for p in wanted],
                        [tensors[p][1] for p in wanted], modality, run["family"], video_info=infos,
                        merge_size=merge)
