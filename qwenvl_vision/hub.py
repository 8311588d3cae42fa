"""Fetch only what the vision tower needs from a Hugging Face repo: configs, the index, the vision shards.

Files land in the standard HF cache (``huggingface_hub.hf_hub_download``), so ``HF_HOME``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``revision`` and ``local_files_only`` behave as everywhere else. The language-model
shards are never requested: the index tells which shards hold ``visual.*`` / ``model.visual.*`` tensors.

The revision (a branch, tag or commit) is resolved to a commit by the first download (config.json); every
later file is fetched at that commit, so all files come from one snapshot folder even if the branch moves
in between, and a file the cache knows to be absent at that commit is not asked for again.
"""

from __future__ import annotations

import re
from pathlib import Path

from .weights import (
    CONFIG_FILE,
    INDEX_FILE,
    PREPROCESSOR_FILE,
    SINGLE_FILE,
    CheckpointError,
    parse_weight_map,
    read_json,
    strip_vision_prefix,
)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.match(source)) and not Path(source).exists()


def _where(repo_id: str, revision: str | None) -> str:
    return f"repo {repo_id!r}" + (f" at revision {revision!r}" if revision else "")


def _offline(local_files_only: bool) -> bool:
    from huggingface_hub import constants

    return local_files_only or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _known_absent(repo_id: str, filename: str, revision: str | None, cache_dir: str | None) -> bool:
    """The cache recorded (``.no_exist``) that `filename` does not exist at this revision."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    return try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision) is _CACHED_NO_EXIST


def _download(repo_id: str, filename: str, *, required: bool = True, revision: str | None = None,
              cache_dir: str | None = None, local_files_only: bool = False,
              token: str | bool | None = None) -> Path | None:
    """One file into the cache; None for an absent optional file. Every failure is a CheckpointError."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import HFValidationError

    where = _where(repo_id, revision)
    if not required and revision and COMMIT_HASH.match(revision) and _known_absent(repo_id, filename, revision,
                                                                                   cache_dir):
        return None  # a commit never changes: the cache's "absent" answer is final, no request needed
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir,
                                    local_files_only=local_files_only, token=token))
    except RepositoryNotFoundError as e:  # includes GatedRepoError
        raise CheckpointError(f"repo {repo_id!r} not found on the Hub (or not accessible: private or gated "
                              f"repos need a token): {e}") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"repo {repo_id!r} has no revision {revision!r}: {e}") from e
    except LocalEntryNotFoundError as e:
        # Before EntryNotFoundError, of which it is a subclass: this one means "not in the local cache and the
        # Hub was not (or could not be) asked", not "the repo has no such file".
        if not required and (_known_absent(repo_id, filename, revision, cache_dir) or _offline(local_files_only)):
            return None
        if _offline(local_files_only):
            reason = ("local_files_only=True" if local_files_only else "HF_HUB_OFFLINE is set") + \
                " and it is not in the local Hugging Face cache (download it once online first)"
        else:
            reason = "the Hub could not be reached and it is not in the local Hugging Face cache"
        raise CheckpointError(f"cannot get {filename} of {where}: {reason}") from e
    except EntryNotFoundError as e:  # the Hub answered: no such file
        if required:
            raise CheckpointError(f"{where} has no {filename}") from e
        return None
    except HfHubHTTPError as e:
        raise CheckpointError(f"cannot get {filename} of {where}: {e}") from e
    except HFValidationError as e:
        raise CheckpointError(f"{repo_id!r} is not a valid Hugging Face repo id: {e}") from e


def fetch_vision_checkpoint(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None,
                            local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """Download config, preprocessor config, index and the vision shards; return the snapshot folder."""
    kwargs = dict(cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    config_path = _download(repo_id, CONFIG_FILE, revision=revision, **kwargs)
    snapshot = config_path.parent
    # hf_hub_download returns <cache>/models--org--name/snapshots/<commit>/config.json: pin the rest to it.
    commit = snapshot.name if COMMIT_HASH.match(snapshot.name) else revision
    kwargs["revision"] = commit
    where = _where(repo_id, revision)
    _download(repo_id, PREPROCESSOR_FILE, required=False, **kwargs)
    index_path = _download(repo_id, INDEX_FILE, required=False, **kwargs)
    if index_path is None:
        _download(repo_id, SINGLE_FILE, **kwargs)
        return snapshot
    # Shard names are checked before any download: one naming '../x' or '/etc/passwd' is refused, not fetched.
    weight_map = parse_weight_map(read_json(index_path, "index"), f"{where}: {INDEX_FILE}")
    shards = sorted({shard for name, shard in weight_map.items() if strip_vision_prefix(name) is not None})
    if not shards:
        raise CheckpointError(f"{where}: {INDEX_FILE} lists no vision tensors")
    for shard in shards:
        _download(repo_id, shard, **kwargs)
    return snapshot
