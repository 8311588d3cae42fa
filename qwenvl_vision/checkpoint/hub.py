"""Fetch only what the vision tower needs from a Hugging Face repo: configs, the index, the vision shards.

Files land in the standard HF cache (``huggingface_hub.hf_hub_download``), so ``HF_HOME``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``revision`` and ``local_files_only`` behave as everywhere else. The language-model
shards are never requested: the index tells which shards hold ``visual.*`` / ``model.visual.*`` tensors.

The revision (a branch, tag or commit) is resolved to a commit by the first download (config.json); every
later file is fetched at that commit, so all files come from one snapshot folder even if the branch moves
in between.

Without network the answer comes at once and quietly: before the first download, one HEAD request without
retries and with a short timeout (``REACH_TIMEOUT_S``, or ``HF_HUB_ETAG_TIMEOUT`` when set) checks that the Hub
answers at all (``hf_hub_download`` alone retries an unreachable Hub five times with backoff and a 60 s timeout:
~25 s of warning lines, minutes against an endpoint that accepts connections but never answers). If it does not,
and with ``HF_HUB_OFFLINE`` or ``local_files_only``, every file comes from the cache only, and a file that is not
there is one CheckpointError; an optional file (a preprocessor config, the index) counts as absent only where the
cache recorded that the repo lacks it (``.no_exist``) or holds a whole download of the repo, never because it was
not downloaded: its defaults would then replace settings the repo may have.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError, ConfigError
from ..model.config import PRESETS, from_config_json
from .weights import (
    CONFIG_FILE,
    INDEX_FILE,
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    SINGLE_FILE,
    VIDEO_PREPROCESSOR_FILE,
    parse_weight_map,
    read_json,
    strip_vision_prefix,
)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
# Seconds the reachability check waits for the Hub (to connect, then for its answer); a HEAD to the Hub takes
# well under a second on a working connection. HF_HUB_ETAG_TIMEOUT, when set, is used instead.
REACH_TIMEOUT_S = 4.0


def _local_reason(source: str) -> str | None:
    """Why `source` is read as a local path rather than a Hub repo id (a phrase for messages), or None.

    A path: it starts with ``./``, ``../``, ``/`` or ``~``, holds more than one ``/`` (or a ``\\``), or its first
    component is a folder here (``models/foo`` with a ``models/`` folder in the working directory). Anything else
    of the shape ``owner/name`` is a repo id.
    """
    start = next((start for start in ("./", "../", "/", "~") if source.startswith(start)), None)
    if start is not None:
        return f"it starts with {start}"
    if "\\" in source or source.count("/") > 1:
        return "a Hub repo id is 'owner/name', with one '/' and no '\\'"
    owner = source.split("/", 1)[0]
    if "/" in source and Path(owner).is_dir():
        return (f"{owner}/ is a folder here; to fetch the Hub repo {source!r} instead, run from a folder "
                f"without {owner}/")
    return None


def looks_like_repo_id(source: str) -> bool:
    """`source` names a Hugging Face repo, not a local folder: it has the shape ``owner/name``, no such path
    exists, and it does not look like a path (``_local_reason``)."""
    return bool(REPO_ID.match(source)) and not Path(source).exists() and _local_reason(source) is None


def _where(repo_id: str, revision: str | None) -> str:
    return f"repo {repo_id!r}" + (f" at revision {revision!r}" if revision else "")


def _unreachable(repo_id: str, revision: str | None) -> str | None:
    """Why the Hub cannot be reached (a phrase for an error message), or None when it answers, whatever the
    answer (a 404 or a 5xx is an answer: hf_hub_download then asks again and reports it as usual).

    One HEAD for config.json on huggingface_hub's own HTTP session (its proxy and TLS settings), no retries, no
    redirects followed.
    """
    from huggingface_hub import constants, hf_hub_url, utils

    # Set or not is the environment's to say: huggingface_hub fills in its default, which a user may set too.
    timeout = float(constants.HF_HUB_ETAG_TIMEOUT) if os.environ.get("HF_HUB_ETAG_TIMEOUT") else REACH_TIMEOUT_S
    try:
        utils.get_session().head(hf_hub_url(repo_id, CONFIG_FILE, revision=revision), timeout=timeout)
    except Exception as e:  # whatever this version's HTTP client (httpx2, httpx, requests) raises: no answer
        waited = f" within {timeout:g} s" if "timeout" in type(e).__name__.lower() else ""
        detail = " ".join(str(e).split())
        return (f"the Hub could not be reached ({constants.ENDPOINT} did not answer{waited}: "
                f"{type(e).__name__}{': ' + detail if detail else ''})")
    return None


def _not_cached(repo_id: str, filename: str, *, required: bool, revision: str | None, cache_dir: str | None,
                why: str, snapshot: Path | None) -> None:
    """None for an optional file the cache knows the repo lacks; else the CheckpointError saying why the file
    that the Hub could not be asked for is not there. `snapshot`: the snapshot folder, to name a broken link."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    where = _where(repo_id, revision)
    if snapshot is not None and (snapshot / filename).is_symlink():
        raise CheckpointError(f"cannot get {filename} of {where}: {why} and the Hugging Face cache is broken "
                              f"({snapshot / filename} is a link to a missing blob): download it again online")
    # What a whole snapshot lacks, the repo lacks: .gitattributes is in every Hub repo and only a download of the
    # whole repo (`hf download`) fetches it; transformers' from_pretrained never does.
    if not required and (try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
                         is _CACHED_NO_EXIST or snapshot is not None and (snapshot / ".gitattributes").is_file()):
        return None
    lacks = "" if required else ", nor is a record that the repo lacks it (defaults never stand in for its settings)"
    raise CheckpointError(f"cannot get {filename} of {where}: {why} and it is not in the local Hugging Face cache"
                          f"{lacks}: load it once online first")


def _download(repo_id: str, filename: str, *, required: bool = True, revision: str | None = None,
              cache_dir: str | None = None, token: str | bool | None = None,
              offline: str | None = None, snapshot: Path | None = None) -> Path | None:
    """One file into the cache; None for an optional file the repo lacks. Every failure is a CheckpointError.

    offline: why the Hub is not to be asked (see fetch_vision_checkpoint); the file then comes from the cache
    without a request. snapshot: the snapshot folder once known, for naming a broken cache link.
    """
    from huggingface_hub import hf_hub_download, utils

    where = _where(repo_id, revision)
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, token=token,
                                    local_files_only=offline is not None))
    except utils.RepositoryNotFoundError as e:  # includes GatedRepoError
        raise CheckpointError(f"repo {repo_id!r} not found on the Hub (or not accessible: private or gated "
                              f"repos need a token): {e}") from e
    except utils.LocalEntryNotFoundError:
        # Before EntryNotFoundError, of which it is a subclass: "not in the local cache and the Hub could not be
        # asked" (offline, or it stopped answering after the reachability check), not "the repo has no such file".
        return _not_cached(repo_id, filename, required=required, revision=revision, cache_dir=cache_dir,
                           why=offline or "the Hub could not be reached", snapshot=snapshot)
    except utils.EntryNotFoundError as e:  # the Hub answered: no such file
        if required:
            raise CheckpointError(f"{where} has no {filename}") from e
        return None
    except Exception as e:  # noqa: BLE001 - a revision it lacks, an invalid id or file name, a 5xx, a connection
        # the client's retries could not keep (its HTTP library's own errors)
        raise CheckpointError(f"cannot get {filename} of {where}: {e}") from e


def fetch_vision_checkpoint(repo_id: str, *, revision: str | None = None, cache_dir: str | None = None,
                            local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """Download config, preprocessor config, index and the vision shards (offline: the module's docstring); return
    the snapshot folder."""
    from huggingface_hub import constants

    offline = ("local_files_only=True" if local_files_only else "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else _unreachable(repo_id, revision))
    kwargs = dict(cache_dir=cache_dir, token=token, offline=offline)
    config_path = _download(repo_id, CONFIG_FILE, revision=revision, **kwargs)
    snapshot = config_path.parent
    # hf_hub_download returns <cache>/models--org--name/snapshots/<commit>/config.json: pin the rest to it.
    commit = snapshot.name if COMMIT_HASH.match(snapshot.name) else revision
    kwargs.update(revision=commit, snapshot=snapshot)
    where = _where(repo_id, revision)
    # An unsupported model stops here, before anything else is fetched.
    prefixes = from_config_json(read_json(config_path, "config", ConfigError)).family.prefixes
    _download(repo_id, PREPROCESSOR_FILE, required=False, **kwargs)
    _download(repo_id, VIDEO_PREPROCESSOR_FILE, required=False, **kwargs)
    _download(repo_id, PROCESSOR_FILE, required=False, **kwargs)
    # transformers' order: the single file where the repository has one, else the index and its shards. Offline,
    # a snapshot holding the index but not the single file (a fetch that asked for the index alone) is read by its
    # index: what was fetched is what a load reads.
    index_only = offline is not None and not (snapshot / SINGLE_FILE).exists() and (snapshot / INDEX_FILE).is_file()
    if not index_only and _download(repo_id, SINGLE_FILE, required=False, **kwargs) is not None:
        return snapshot
    index_path = _download(repo_id, INDEX_FILE, required=False, **kwargs)
    if index_path is None:
        raise CheckpointError(f"{where} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    # Shard names are checked before any download: one naming '../x' or '/etc/passwd' is refused, not fetched.
    weight_map = parse_weight_map(read_json(index_path, "index"), f"{where}: {INDEX_FILE}")
    shards = sorted({shard for name, shard in weight_map.items() if strip_vision_prefix(name, prefixes) is not None})
    if not shards:
        raise CheckpointError(f"{where}: {INDEX_FILE} lists no vision tensors")
    for shard in shards:
        _download(repo_id, shard, **kwargs)
    return snapshot


def resolve_folder(source: str, revision: str | None = None, local_files_only: bool = False,
                   cache_dir: str | None = None, token: str | bool | None = None) -> Path:
    """The checkpoint folder a source names: a folder as it is, a repo id fetched (vision files only).

    A source that looks like a path (``looks_like_repo_id``) and does not exist is a CheckpointError saying why
    it was read as a path; the Hub is never asked about it.
    """
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            return path
        exists = path.exists()
    except OSError as e:  # a name too long for the file system
        raise CheckpointError(f"checkpoint folder {source[:200]!r} cannot be read ({e.strerror})") from None
    if exists:
        raise CheckpointError(f"checkpoint folder {source} is a file: give the folder that holds config.json")
    if source.lower() in PRESETS:
        raise CheckpointError(f"{source!r} is a preset: pass random_weights=True for random weights at its size, "
                              f"or give a checkpoint folder / repo id")
    if looks_like_repo_id(source):
        return fetch_vision_checkpoint(source, revision=revision, cache_dir=cache_dir,
                                       local_files_only=local_files_only, token=token)
    reason = _local_reason(source)
    if reason is not None:
        raise CheckpointError(f"checkpoint folder {source} does not exist (read as a local path: {reason})")
    raise CheckpointError(f"checkpoint folder {source} does not exist (and it is not a repo id like 'Qwen/...')")
