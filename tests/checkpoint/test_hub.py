"""load_encoder("org/name") against a local stand-in of the Hugging Face Hub (loopback only).

The stand-in (tests.helpers.FakeHub; the `hub` fixture of conftest.py) serves checkpoint folders written by
tests.helpers the way huggingface_hub's ``hf_hub_download`` expects the Hub to (HEAD/GET on
/{repo}/resolve/{revision}/{file}), records every request, and lets the tests check what was fetched: config,
preprocessor config, index and only the shards holding vision tensors; never an LLM-only shard.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest
import torch

from qwenvl_vision import CheckpointError, load_encoder
from qwenvl_vision.checkpoint.hub import fetch_vision_checkpoint, resolve_folder
from qwenvl_vision.cli import main
from qwenvl_vision.model.names import to_checkpoint_state
from tests.helpers import (
    FAMILY_SMALL,
    INDEX_FILE,
    LN_Q,
    QWEN2_5_SMALL,
    QWEN3_SMALL_72,
    REPO,
    FakeHub,
    assert_result_matches_reference,
    inputs,
    non_vision_shards,
    read_index,
    reference_outputs,
    use_endpoint,
    write_checkpoint,
    write_index,
)

hf_constants = pytest.importorskip("huggingface_hub.constants")

GRIDS = [(1, 6, 10), (2, 4, 4), (1, 2, 2)]

# Asked for on every fetch (the video one is optional: most releases have none).
SETTINGS_FILES = {"config.json", "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"}


# ---------------------------------------------------------------------- helpers


def _check_against_reference(encoder, cfg, vision_state: dict, grids) -> None:
    """Encoder outputs (fp32, CPU) equal transformers' tower holding the same weights."""
    pixel_values, grid_thw = inputs(cfg, grids)
    out = encoder.encode_patches(pixel_values, grid_thw)
    reference = reference_outputs(cfg, vision_state, pixel_values, grid_thw)
    assert all(e.dtype == torch.float32 for e in out.embeddings)
    assert len(reference[1]) == len(cfg.deepstack_visual_indexes)
    assert_result_matches_reference(out, reference, grid_thw, 1e-5)


def _check_weights(encoder, vision_state: dict) -> None:
    """The encoder holds exactly the checkpoint's vision weights (cheaper than a forward, for repeat loads)."""
    loaded = to_checkpoint_state(encoder.config, encoder.model.state_dict())
    assert loaded.keys() == vision_state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in vision_state.items())


def _snapshot(hub: FakeHub, repo_id: str, commit: str) -> Path:
    return hub.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


@pytest.fixture
def qwen25_repo(hub, tmp_path):
    """A sharded Qwen2.5-VL checkpoint (2 vision shards, 2 LLM-only shards) served as org/qwen25-tiny."""
    folder = tmp_path / "qwen25"
    vision = write_checkpoint(folder, QWEN2_5_SMALL, sharded=True, other_shards=2)
    commit = hub.add("org/qwen25-tiny", folder)
    return folder, vision, commit


# ---------------------------------------------------------------------- what is fetched


@pytest.mark.parametrize("cfg,sharded", [(QWEN2_5_SMALL, True), (QWEN3_SMALL_72, False)], ids=["sharded", "single"])
def test_a_repo_fetches_only_what_the_tower_needs_and_matches_transformers(hub, tmp_path, cfg, sharded):
    """The settings files, then transformers' order: the single file where the repo has one (the index is then
    never asked for), else the index and only the shards holding vision tensors, never an LLM-only one. Each file
    the repo has is downloaded once (a HEAD, then one GET) into the snapshot of the commit main resolved to."""
    folder = tmp_path / "repo"
    vision = write_checkpoint(folder, cfg, sharded=sharded, other_shards=2)
    commit = hub.add("org/tiny", folder)
    with load_encoder("org/tiny", device="cpu") as encoder:
        _check_against_reference(encoder, cfg, vision, GRIDS)
    expected = SETTINGS_FILES | {"model.safetensors"}
    if sharded:
        expected |= {p.name for p in folder.glob("model-*.safetensors")} - {p.name for p in non_vision_shards(folder)}
    touched = hub.files_touched()
    assert touched == expected | ({INDEX_FILE} if sharded else set())
    assert all(p.startswith("/org/tiny/resolve/") for p in hub.resolve_paths())
    present = sorted(touched & {p.name for p in folder.iterdir()})  # asked for and there: downloaded
    assert sorted(p.rsplit("/", 1)[1] for p in hub.resolve_paths("GET")) == present
    assert sorted(p.name for p in _snapshot(hub, "org/tiny", commit).iterdir()) == present


def test_fetch_returns_the_snapshot_folder_in_the_cache_chosen(hub, qwen25_repo, tmp_path):
    _, _, commit = qwen25_repo
    assert resolve_folder("org/qwen25-tiny") == _snapshot(hub, "org/qwen25-tiny", commit)
    cache_dir = tmp_path / "elsewhere"
    folder = fetch_vision_checkpoint("org/qwen25-tiny", cache_dir=str(cache_dir))
    assert folder == cache_dir / "models--org--qwen25-tiny" / "snapshots" / commit
    assert (folder / "config.json").is_file() and (folder / "model.safetensors.index.json").is_file()


# ---------------------------------------------------------------------- revision


def test_revision_is_honoured(hub, tmp_path):
    main_folder, pr_folder = tmp_path / "main", tmp_path / "pr"
    write_checkpoint(main_folder, QWEN2_5_SMALL, seed=0)
    pr_vision = write_checkpoint(pr_folder, QWEN2_5_SMALL, seed=7)
    main_commit = hub.add("org/qwen25-tiny", main_folder)
    pr_commit = hub.add("org/qwen25-tiny", pr_folder, branch="refs/pr/1")  # a '/' in the revision: URL-quoted

    encoder = load_encoder("org/qwen25-tiny", device="cpu", revision="refs/pr/1")
    _check_against_reference(encoder, QWEN2_5_SMALL, pr_vision, GRIDS[:1])
    encoder.close()
    paths = hub.resolve_paths()
    # The first request resolves the named revision; the rest are pinned to the commit it resolved to.
    assert paths[0] == "/org/qwen25-tiny/resolve/refs/pr/1/config.json"
    assert all("/resolve/refs/pr/1/" in p or f"/resolve/{pr_commit}/" in p for p in paths), paths
    assert not any("/resolve/main/" in p or main_commit in p for p in paths)

    # A commit hash as revision: every request names it.
    hub.clear()
    folder = fetch_vision_checkpoint("org/qwen25-tiny", revision=main_commit)
    assert folder.name == main_commit
    paths = hub.resolve_paths()
    assert paths and all(f"/resolve/{main_commit}/" in p for p in paths), paths

    # An unknown revision is a CheckpointError naming it.
    with pytest.raises(CheckpointError, match="no-such-branch"):
        load_encoder("org/qwen25-tiny", device="cpu", revision="no-such-branch")


# ---------------------------------------------------------------------- cache, offline


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single-file"])
def test_cached_repo_loads_offline_without_requests(hub, tmp_path, monkeypatch, sharded):
    """HF_HUB_OFFLINE, local_files_only=True, or the server gone: a repo loaded once loads from the cache, without
    a request (a single-file repo: the cache's record that the index is absent picks the single file)."""
    folder = tmp_path / "repo"
    vision = write_checkpoint(folder, QWEN2_5_SMALL, sharded=sharded, other_shards=2)
    hub.add("org/qwen25-tiny", folder)
    load_encoder("org/qwen25-tiny", device="cpu").close()
    assert hub.resolve_paths()
    hub.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with load_encoder("org/qwen25-tiny", device="cpu") as encoder:
        _check_against_reference(encoder, QWEN2_5_SMALL, vision, GRIDS[:1])
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with load_encoder("org/qwen25-tiny", device="cpu", local_files_only=True) as encoder:
        _check_weights(encoder, vision)
    hub.stop()  # a plain load falls back to the cache too
    for local_files_only in (True, False):
        with load_encoder("org/qwen25-tiny", device="cpu", local_files_only=local_files_only) as encoder:
            _check_weights(encoder, vision)
    assert hub.requests == []


# ---------------------------------------------------------------------- no network: fail fast, quietly


@pytest.fixture(params=["refuses", "never-answers"])
def dead_endpoint(request, hub, monkeypatch):
    """huggingface_hub pointed at an endpoint that refuses connections (the stand-in Hub, stopped) or that
    accepts them and never answers (a listening socket nobody reads), as a machine without network sees."""
    hub.stop()
    if request.param == "refuses":
        yield request.param
        return
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        use_endpoint(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}")
        yield request.param


@pytest.mark.slow  # waits out the reachability timeout (4 s)
def test_unreachable_hub_fails_within_seconds_with_one_line(dead_endpoint, tmp_path, capfd):
    """hf_hub_download alone retries for ~25 s (refused) or minutes (no answer), printing a warning per try."""
    start = time.perf_counter()
    code = main(["embed", str(REPO / "examples" / "photos"), "--model", "Qwen/Qwen2.5-VL-3B-Instruct",
                 "--out", str(tmp_path / "out")])
    elapsed = time.perf_counter() - start
    err = capfd.readouterr().err
    assert code == 2 and elapsed < 10, (elapsed, err)
    errors = [line for line in err.splitlines() if not line.startswith("embed: ")]  # the loading note
    assert len(errors) == 1, err
    assert errors[0].startswith("qwenvl-vision embed: error: cannot get config.json of repo "
                                "'Qwen/Qwen2.5-VL-3B-Instruct': the Hub could not be reached (")
    assert "not in the local Hugging Face cache" in errors[0]
    assert ("within 4 s" in errors[0]) == (dead_endpoint == "never-answers")
    assert not (tmp_path / "out").exists()


def test_hf_hub_etag_timeout_set_is_the_wait_even_at_huggingface_hub_s_default(hub, tmp_path, monkeypatch, capfd):
    """huggingface_hub fills in its default (10 s) when the variable is unset; a user who sets that very value asks
    for it all the same (here the default is made 1 s, so the test waits 1 s, not 10)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(constants, "DEFAULT_ETAG_TIMEOUT", 1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        use_endpoint(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}")
        assert main(["embed", str(REPO / "examples" / "photos"), "--model", "org/never-cached",
                     "--out", str(tmp_path / "out")]) == 2
    assert "did not answer within 1 s" in capfd.readouterr().err


@pytest.mark.slow  # waits out the reachability timeout (4 s)
def test_unreachable_hub_loads_a_cached_repo_without_waiting(hub, qwen25_repo, monkeypatch, capfd):
    _, vision, _ = qwen25_repo
    load_encoder("org/qwen25-tiny", device="cpu").close()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        use_endpoint(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.perf_counter()
        with load_encoder("org/qwen25-tiny", device="cpu") as encoder:
            _check_weights(encoder, vision)
        assert time.perf_counter() - start < 10
    assert "Retry" not in capfd.readouterr().err


# ---------------------------------------------------------------------- errors


def test_missing_repo_is_a_checkpoint_error_naming_it(hub):
    with pytest.raises(CheckpointError, match="org/does-not-exist") as info:
        load_encoder("org/does-not-exist", device="cpu")
    assert "not found" in str(info.value)
    # Nothing but config.json asked for (twice: the reachability check, then hf_hub_download's own HEAD).
    assert set(hub.resolve_paths()) == {"/org/does-not-exist/resolve/main/config.json"}


def test_a_repo_never_downloaded_is_a_clear_error_offline_and_loads_once_cached(hub, qwen25_repo, tmp_path, capsys,
                                                                                monkeypatch):
    """The repo exists on the Hub, but nothing of it is cached and local_files_only (or HF_HUB_OFFLINE) forbids
    asking: one line saying so, not a claim that the repo lacks the file, and no request; once cached, it loads."""
    embed = ["embed", str(REPO / "examples" / "photos"), "--model", "org/qwen25-tiny", "--local-files-only",
             "--out", str(tmp_path / "out")]
    assert main(embed) == 2
    err = capsys.readouterr().err
    assert "config.json of repo 'org/qwen25-tiny': local_files_only=True and it is not in the local Hugging Face " \
           "cache" in err and "has no" not in err
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="org/qwen25-tiny.*HF_HUB_OFFLINE"):
        load_encoder("org/qwen25-tiny", device="cpu")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert hub.requests == []
    load_encoder("org/qwen25-tiny", device="cpu").close()
    hub.stop()
    assert main([*embed, "--quiet"]) == 0


def test_repo_without_config_or_vision_tensors(hub, tmp_path):
    folder = tmp_path / "llm-only"
    write_checkpoint(folder, QWEN2_5_SMALL, prefix="model.language_model.extra.")
    hub.add("org/llm-only", folder)
    with pytest.raises(CheckpointError, match="lists no vision tensors"):
        load_encoder("org/llm-only", device="cpu")
    assert not any(p.endswith(".safetensors") for p in hub.resolve_paths("GET"))

    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "README.md").write_text("hi")
    hub.add("org/no-config", tmp_path / "no-config")
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_encoder("org/no-config", device="cpu")


def test_a_download_dropped_past_the_client_s_retries_is_one_line_naming_the_file(hub, qwen25_repo, capsys):
    folder, _, _ = qwen25_repo
    shard = sorted(p.name for p in folder.glob("*.safetensors"))[0]
    hub.cut.add(shard)
    assert main(["inspect", "org/qwen25-tiny"]) == 2  # a CheckpointError's, not a bug's
    [line] = capsys.readouterr().err.splitlines()
    assert f"error: cannot get {shard} of repo 'org/qwen25-tiny'" in line


def test_hub_refuses_a_shard_name_outside_the_repo_before_downloading(hub, tmp_path):
    """An index naming a shard outside the repo is refused once the index is read: no shard is asked for."""
    folder = tmp_path / "repo"
    write_checkpoint(folder, QWEN2_5_SMALL)
    index = read_index(folder)
    index["weight_map"][LN_Q] = "../../evil.safetensors"
    write_index(folder, index)
    hub.add("org/evil", folder)
    with pytest.raises(CheckpointError, match=re.escape("shard name '../../evil.safetensors'")):
        fetch_vision_checkpoint("org/evil")
    assert hub.files_touched() == SETTINGS_FILES | {"model.safetensors", INDEX_FILE}


# ---------------------------------------------------------------------- the Omni models' nested layout


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_repo_fetches_only_the_thinkers_vision_shards(hub, tmp_path, family):
    """Omni checkpoints nest the tower under thinker_config / thinker.visual. and hold audio, talker and
    token2wav/code2wav shards: only config, preprocessor, index and the vision shards are downloaded."""
    cfg = FAMILY_SMALL[family]
    folder = tmp_path / family
    vision = write_checkpoint(folder, cfg, sharded=True, other_shards=3)
    others = {p.name for p in non_vision_shards(folder)}
    hub.add(f"org/{family}", folder)
    encoder = load_encoder(f"org/{family}", device="cpu")
    _check_against_reference(encoder, cfg, vision, [(1, 6, 10), (2, 4, 4)])
    touched = hub.files_touched()
    assert len(others) == 3 and not touched & others
    assert touched == SETTINGS_FILES | {"model.safetensors", "model.safetensors.index.json"} | (
        {p.name for p in folder.glob("model-*.safetensors")} - others)


# ---------------------------------------------------------------------- resolve_folder: what a source names


def test_resolve_folder_takes_a_folder_as_it_is(hub, tmp_path, monkeypatch):
    """A folder is used in place, even one whose name looks like a repo id; '~' is the home folder."""
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_folder("org/name") == Path("org/name")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_folder("~/org") == tmp_path / "org"
    assert hub.requests == []


@pytest.mark.parametrize("source,why", [
    ("nowhere", "and it is not a repo id"), ("./org/name", "read as a local path: it starts with ./"),
    ("models/foo", "models/ is a folder here"),
    ("a/b/c", "read as a local path: a Hub repo id is 'owner/name'"), ("../x", "it starts with ../"),
    ("/abs/x", "it starts with /"), ("~/x", "it starts with ~"),
    ("qwen3-vl-2b", "is a preset: pass random_weights=True"), ("Qwen2.5-VL-3B", "is a preset: pass random_weights"),
])
def test_resolve_folder_names_a_source_that_is_neither_a_folder_nor_a_repo_id(hub, tmp_path, monkeypatch, source,
                                                                              why):
    """A missing path: one error naming it and why it was read as a path (``models/foo`` has a repo id's shape,
    but models/ is a folder here); a preset name: that it is one. The Hub is not asked."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(CheckpointError, match=rf"{re.escape(source)}.*{re.escape(why)}"):
        resolve_folder(source)
    assert hub.requests == []


def test_offline_a_cached_index_without_the_single_file_s_answer_is_read_by_its_index(hub, qwen25_repo):
    """A cache filled by a fetch that asked for the index alone (no record of whether model.safetensors exists)
    still loads offline: by its index, as it was fetched."""
    _, vision, commit = qwen25_repo
    load_encoder("org/qwen25-tiny", device="cpu").close()
    (hub.cache / "models--org--qwen25-tiny" / ".no_exist" / commit / "model.safetensors").unlink()
    hub.stop()
    encoder = load_encoder("org/qwen25-tiny", device="cpu", local_files_only=True)
    _check_against_reference(encoder, QWEN2_5_SMALL, vision, GRIDS)
