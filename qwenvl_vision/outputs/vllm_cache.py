"""vLLM's encoder cache as an output (docs/handoff.md, "Feed a vLLM encoder-cache consumer"): the folder a consumer's
``ECExampleConnector`` reads embeddings from, what each item is called there, and the request fields that point a
prompt at its items (``vllm_request``).

vLLM 0.33 (``vllm/distributed/ec_transfer/ec_connector/example_connector.py``): a consumer looks for
``P/{mm_hash}/encoder_cache.safetensors``, checks only that it exists, and loads its one tensor ``"ec_cache"`` onto
its device as the item's ``embed_multimodal`` output: here the item's rows of ``to_vllm``, in the dtype they were
made in. With a uuid and no processor keyword arguments, vLLM uses the uuid as the item's ``mm_hash``.

- ``{id}/encoder_cache.safetensors`` per item, ``id`` = ``item_ids.item_id`` (64 hex digits: the model's identity,
  the modality, the grid and the pixels' hash), or for ``serve`` the request's uuid (any name ``ITEM_NAME`` takes);
  an embed run's carry their records in their metadata, the server's their entry (``ENTRY_KEY``), and
  ``write_vllm_cache``'s neither (a prune beside a running embed keeps them as that embed's). Each is written
  whole under a temporary name (created exclusively, never through a link) and renamed into place. A link at an
  item's name or folder is an ``OutputLinkError``, left as it is.
- ``qwenvl_vision_cache.lock`` (item writers, ``cache_prune``) and ``qwenvl_vision_cache.json`` (the model's
  identity): a folder with another model's identity, or with items and no identity (written by something else), is
  refused (``CacheFolderError``), since a consumer would load those items for this model's prompts.

Entries (``write_vllm_cache``'s return value, the ``embed`` manifest's records) hold ``id``, ``modality``,
``grid_thw``, ``tokens`` and a video's ``timestamps`` (the Qwen3-VL families) or ``second_per_grid_t`` (the Omni
thinkers).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from ..devices import dtype_name
from ..errors import CacheFolderError, InputError
from ..inputs.item_ids import IDENTITY_FIELDS, is_sha256, item_id
from .durable import create_new, file_lock, fsync_dir, refuse_link, replace_atomically
from .handoff import MODALITIES, VllmItem, vllm_items

CACHE_FILE = "encoder_cache.safetensors"
CACHE_KEY = "ec_cache"
IDENTITY_FILE = "qwenvl_vision_cache.json"
ENTRY_KEY = "qwenvl_vision_entry"  # a serve item's metadata: what a request needs of it (``entry``)
# An item's folder name (an item_id, or a serve client's uuid): the folder's own files and an embed run's all have
# a dot, so no item can be named as one of them.
ITEM_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
CACHE_LOCK = "qwenvl_vision_cache.lock"  # held by item writers and by a prune (cache_prune)


@contextlib.contextmanager
def cache_lock(folder: Path, wait_s: float | None = None) -> Iterator[None]:
    """``folder``'s ``CACHE_LOCK`` (``durable.file_lock``), which stays in the folder; ``wait_s``: give up after that
    many seconds (``CacheFolderError``), None waits as long as it takes. Exclusive for writers too: a batch's
    writes hold it for moments, a prune is rare, and a shared hold could keep a prune out for good."""
    from filelock import Timeout

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(file_lock(folder / CACHE_LOCK, wait_s))
        except Timeout:
            raise CacheFolderError(f"{folder}: a writer held {CACHE_LOCK} for {wait_s:.0f} s; try again") from None
        yield


def check_cache_folder(folder: str | os.PathLike, identity: dict[str, str]) -> None:
    """Refuse a folder that holds another model's items, or items without an identity file; read only."""
    folder = Path(folder)
    path = folder / IDENTITY_FILE
    if folder.exists() and not folder.is_dir():
        raise CacheFolderError(f"{folder} is a file, not a folder")
    try:
        found = json.loads(path.read_text())
        if not isinstance(found, dict):
            raise ValueError(f"a JSON {type(found).__name__}, not an object")
    except FileNotFoundError:
        if folder.is_dir() and any((item / CACHE_FILE).exists() for item in folder.iterdir()
                                   if ITEM_NAME.fullmatch(item.name)):
            raise CacheFolderError(f"{folder} holds encoder-cache items but no {IDENTITY_FILE}: they were not written "
                                   f"by qwenvl-vision, so which model made them is unknown; choose another folder") \
                from None
        return
    except (OSError, ValueError) as e:
        raise CacheFolderError(f"{path} is unreadable ({e}): if no writer is running, delete it and write again") \
            from None
    differ = [k for k in IDENTITY_FIELDS if found.get(k) != identity[k]]
    if differ:
        fields = ", ".join(f"{k} {str(found.get(k))[:12]} (this model: {identity[k][:12]})" for k in differ)
        raise CacheFolderError(f"{folder} holds the encoder cache of another model ({fields}): a consumer would load "
                               f"its items for this model's prompts; choose another folder")


def claim_cache_folder(folder: str | os.PathLike, identity: dict[str, str], tag: str) -> None:
    """Check the folder (``check_cache_folder``), create it, and give it this identity if it has none: written
    whole under a temporary name, then linked into place only if no other writer's got there first (a link does
    not replace), and checked again."""
    folder = Path(folder)
    check_cache_folder(folder, identity)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / IDENTITY_FILE
    refuse_link(path)  # a link (a dangling one reads as absent) is never the folder's identity, nor written through
    if path.exists():
        return
    tmp = folder / f"{IDENTITY_FILE}.{tag}.tmp"
    text = json.dumps({k: identity[k] for k in IDENTITY_FIELDS}, indent=2) + "\n"
    try:
        with create_new(tmp) as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        pass  # another writer claimed it meanwhile: its identity decides, below
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(folder)
    check_cache_folder(folder, identity)


def write_item(folder: Path, item: str, rows: torch.Tensor, tag: str, metadata: dict[str, str] | None = None) -> bool:
    """``folder/item/encoder_cache.safetensors`` holding ``rows`` as ``"ec_cache"``, whole or not at all, with
    ``metadata``. An item already there is kept if safetensors reads it, else replaced. ``tag`` names
    the temporary file. Whether it was written."""
    target = folder / item / CACHE_FILE
    if found_item(folder, item) is not None:  # kept; a file safetensors does not read is rewritten below
        return False
    target.parent.mkdir(exist_ok=True)
    rows = rows.detach().contiguous().cpu()
    data = save({CACHE_KEY: rows}, metadata={"format": "pt", **(metadata or {})})
    replace_atomically(target, target.parent / f"{CACHE_FILE}.{tag}.tmp", lambda f: f.write(data))
    fsync_dir(folder)
    return True


def found_item(folder: Path, item: str) -> dict[str, str] | None:
    """The metadata of ``folder/item/encoder_cache.safetensors`` when safetensors reads it, and the file touched (found
    in place is written again, for a prune's oldest-first); None when no such file is there. A link at the item's
    folder or file is an ``OutputLinkError``: never read, nor written through; another file where the item's folder
    goes, a ``CacheFolderError`` naming it."""
    target = folder / item / CACHE_FILE
    refuse_link(target.parent)
    if target.parent.exists() and not target.parent.is_dir():
        raise CacheFolderError(f"{target.parent} is a file where an item's folder goes: remove it, or name the item "
                               f"otherwise")
    refuse_link(target)
    with contextlib.suppress(OSError):
        if not stat.S_ISREG(target.stat().st_mode):  # a FIFO would block the open, and the lock's other holders
            return None
    metadata = item_metadata(target)
    if metadata is not None:
        with contextlib.suppress(OSError):
            os.utime(target)
    return metadata


def item_metadata(path: Path) -> dict[str, str] | None:
    """An item file's metadata where safetensors reads the file, else None."""
    from safetensors import SafetensorError, safe_open

    with contextlib.suppress(SafetensorError, OSError), safe_open(path, framework="pt") as f:
        return f.metadata() or {}
    return None


def entry(name: str, item: VllmItem) -> dict[str, Any]:
    """What a request needs of the item cached as ``name`` (see the module docstring)."""
    out: dict[str, Any] = {"id": name, "modality": item.modality, "grid_thw": list(item.grid_thw),
                           "tokens": int(item.rows.shape[0])}
    if item.timestamps is not None:
        out["timestamps"] = list(item.timestamps)
    if item.second_per_grid_t is not None:
        out["second_per_grid_t"] = item.second_per_grid_t
    return out


def write_vllm_cache(result: Any, folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Write an ``EncodeResult``'s items into a vLLM encoder-cache folder; their entries, in order.

    The result's encoder must still be loaded, or have given its ``identity()`` before it closed. Nothing is
    written when the folder holds another model's items or an item cannot be handed to vLLM (a video without
    its frame timing where the family needs it).
    """
    if not hasattr(result, "encoder"):
        raise InputError(f"a {type(result).__name__} names no model: only an EncodeResult (of encode_images, "
                         f"encode_videos or encode_patches) can be cached")
    encoder = result.encoder() if result.encoder is not None else None
    if encoder is None:
        raise InputError("this result's encoder is gone (a result does not keep it alive, and a pickled one drops "
                         "it), so which model made it is unknown: keep the encoder in a variable until the cache is "
                         "written")
    identity = encoder.identity()
    items = vllm_items(result)  # every item checked, and named, before anything is written
    made = {dtype_name(item.rows.dtype) for item in items} - {identity["dtype"]}
    if made:  # the ids name the encoder's dtype: rows of another would load for its prompts
        raise InputError(f"this result was made in {', '.join(sorted(made))} and its encoder is now "
                         f"{identity['dtype']}: write the cache before casting the tower")
    digests = list(result.pixels_sha256 or [None] * len(items))
    names = [item_id(identity, item.modality, item.grid_thw, d) for item, d in zip(items, digests, strict=True)]
    folder = Path(folder)
    tag = uuid.uuid4().hex
    claim_cache_folder(folder, identity, tag)
    with cache_lock(folder):  # a prune (cache_prune) removes nothing while items are written
        for name, item in zip(names, items):
            write_item(folder, name, item.rows, tag)
    return [entry(name, item) for name, item in zip(names, items)]


def vllm_request(entries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fields of a vLLM request whose items come from an encoder cache: ``{"multi_modal_data": {...},
    "multi_modal_uuids": {...}}``, to pass beside the prompt (``LLM.generate({"prompt": ..., **request})``).

    ``entries``: the prompt's items, each modality's in the order of its placeholders (``write_vllm_cache``'s
    entries, or records of an ``embed --format vllm-cache`` manifest). Send it without processor or media-IO
    keyword arguments: vLLM takes a uuid as the item's cache name only then (with them it hashes the model, uuid
    and arguments, and runs its own tower on a miss).
    """
    data: dict[str, dict[str, Any]] = {}
    uuids: dict[str, list[str]] = {}
    grouped: dict[str, list[dict[str, Any]]] = {}
    for i, e in enumerate(entries):
        # The id becomes a folder name under the consumer's cache: anything but an id could name another file.
        if not isinstance(e, dict) or not is_sha256(e.get("id")) or e.get("modality") not in MODALITIES:
            raise InputError(f"entry {i}: id {str(e.get('id') if isinstance(e, dict) else e)[:80]!r} is not 64 hex "
                             f"digits, or its modality is not one of {MODALITIES}")
        if not isinstance(e.get("grid_thw"), (list, tuple)) or len(e["grid_thw"]) != 3:
            raise InputError(f"entry {i}: grid_thw {str(e.get('grid_thw'))[:80]!r} is no (t, h, w)")
        grouped.setdefault(e["modality"], []).append(e)
    for modality, items in grouped.items():
        fields: dict[str, Any] = {f"{modality}_grid_thw": torch.tensor([e["grid_thw"] for e in items],
                                                                       dtype=torch.long)}
        if "timestamps" in items[0]:
            fields["timestamps"] = [list(e["timestamps"]) for e in items]
        if "second_per_grid_t" in items[0]:
            fields["second_per_grid_ts"] = torch.tensor([float(e["second_per_grid_t"]) for e in items])
        data[modality] = fields
        uuids[modality] = [e["id"] for e in items]
    return {"multi_modal_data": data, "multi_modal_uuids": uuids}
