"""Fetch only what the vision tower needs from a Hugging Face repo: configs, the index, the vision shards.

Files land in the standard HF cache (``huggingface_hub.hf_hub_download``), so ``HF_HOME``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``revision`` and ``local_files_only`` behave as everywhere else. The language-model
shards are never requested: the index tells which shards hold ``visual.*`` / ``model.visual.*`` tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .weights import CONFIG_FILE, INDEX_FILE, PREPROCESSOR_FILE, SINGLE_FILE, CheckpointError, strip_vision_prefix

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.match(source)) and not Path(source).exists()


def _download(repo_id: str, filename: str, *, required: bool = True, **kwargs) -> Path | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, **kwargs))
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"repo {repo_id!r} not found (or not accessible): {e}") from e
    except EntryNotFoundError as e:
        if required:
            raise CheckpointError(f"repo {repo_id!r} has no {filename}") from e
        return None
    except LocalEntryNotFoundError as e:
        if not required and kwargs.get("local_files_only"):
            return None
        raise CheckpointError(f"cannot get {filename} of {repo_id!r} (offline, or not in the local cache): {e}") from e


def fetch_vision_checkpoint(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None,
                            local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """Download config, preprocessor config, index and the vision shards; return the snapshot folder."""
    kwargs = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    config_path = _download(repo_id, CONFIG_FILE, **kwargs)
    _download(repo_id, PREPROCESSOR_FILE, required=False, **kwargs)
    index_path = _download(repo_id, INDEX_FILE, required=False, **kwargs)
    if index_path is None:
        _download(repo_id, SINGLE_FILE, **kwargs)
        return config_path.parent
    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map", {})
    shards = sorted({shard for name, shard in weight_map.items() if strip_vision_prefix(name) is not None})
    if not shards:
        raise CheckpointError(f"{repo_id}: {INDEX_FILE} lists no vision tensors")
    for shard in shards:
        _download(repo_id, shard, **kwargs)
    return config_path.parent
