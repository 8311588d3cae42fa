"""Faults around a checkpoint that must never lose or silently change data: ``extract-weights`` aimed at its own
source or at the Hugging Face cache, links planted where it writes; a config file that is a dangling link, or
that an offline cache cannot vouch for. Each case goes through the public entry points (the CLI's ``main``,
``load_encoder``). Config values out of range: tests/model/test_config.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenvl_vision import CheckpointError, load_encoder
from qwenvl_vision.checkpoint.hub import fetch_vision_checkpoint
from qwenvl_vision.cli import main
from tests.helpers import QWEN2_5_SMALL, write_checkpoint
from tests.helpers.embed import one_error_line

hf_constants = pytest.importorskip("huggingface_hub.constants")


def _tree(folder: Path) -> dict[str, object]:
    """Every entry under `folder`: a link as ("link", its target), a file as its bytes, a folder as "dir"."""
    found: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        key = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found[key] = ("link", os.readlink(path))
        elif path.is_dir():
            found[key] = "dir"
        else:
            found[key] = path.read_bytes()
    return found


@pytest.fixture(scope="module")
def single_file_checkpoint(tmp_path_factory) -> Path:
    """A single-file Qwen2.5-VL checkpoint whose model.safetensors also holds language-model tensors."""
    folder = tmp_path_factory.mktemp("single") / "ckpt"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=False)
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    return copy


# ---------------------------------------------------------------------- extract-weights: its source, the cache


def test_extract_weights_never_writes_into_its_source(single_file_checkpoint, tmp_path, capsys):
    """--out the source (as given, through a link to it, or a folder inside it) is refused even with --force,
    and the single file keeps its language model: every byte of the source is unchanged."""
    src = _copy(single_file_checkpoint, tmp_path)
    before = _tree(src)
    alias = tmp_path / "alias"
    alias.symlink_to(src, target_is_directory=True)
    for out, needle in ((src, "is the source folder"), (alias, "is the source folder"),
                        (src / "vision", "is inside the source folder")):
        assert main(["extract-weights", str(src), "--out", str(out), "--force"]) == 2
        one_error_line(capsys.readouterr().err, f"--out {out}", needle, "--force or not")
    assert _tree(src) == before


def test_extract_weights_into_a_parent_of_its_source(single_file_checkpoint, tmp_path, capsys):
    """A parent of the source is a fine target as long as no name written there is a file of the source: a
    source whose config.json is a link to the parent's config.json is refused; without that link it works."""
    parent = tmp_path / "parent"
    src = _copy(single_file_checkpoint, parent)
    (parent / "config.json").write_bytes((src / "config.json").read_bytes())
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(Path("..") / "config.json")
    before = _tree(parent)
    assert main(["extract-weights", str(src), "--out", str(parent), "--force"]) == 2
    one_error_line(capsys.readouterr().err, f"--out {parent}", "config.json", "--force or not")
    assert _tree(parent) == before

    (src / "config.json").unlink()
    (src / "config.json").write_bytes((parent / "config.json").read_bytes())
    before = _tree(src)
    assert main(["extract-weights", str(src), "--out", str(parent), "--force"]) == 0
    assert _tree(src) == before
    assert json.loads((parent / "config.json").read_text())["format"] == "qwenvl-vision"


def test_extract_weights_never_removes_a_source_s_processor_config_through_a_link(single_file_checkpoint, tmp_path,
                                                                                  capsys):
    """extract-weights removes another checkpoint's processor_config.json from its target: one that is the
    source's own (the source's file a link to it) is refused, --force or not."""
    src, out = _copy(single_file_checkpoint, tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "processor_config.json").write_text("{}")
    (src / "processor_config.json").symlink_to(out / "processor_config.json")
    assert main(["extract-weights", str(src), "--out", str(out), "--force"]) == 2
    one_error_line(capsys.readouterr().err, "processor_config.json", "--force or not")
    assert (out / "processor_config.json").read_text() == "{}"


def test_extract_weights_keeps_every_number_of_a_checkpoint_of_mixed_dtypes(tmp_path):
    """Without --dtype a checkpoint storing bf16 and fp32 tensors is written in fp32 (exact for both), never cast to
    one tensor's dtype."""
    src = tmp_path / "src"
    write_checkpoint(src, QWEN2_5_SMALL, dtype=torch.bfloat16)
    # The second shard of the tower's two: the first tensor read stays bf16.
    shard = [p for p in sorted(src.glob("*.safetensors")) if any(k.startswith("visual.") for k in load_file(p))][1]
    tensors = load_file(shard)
    noise = torch.Generator().manual_seed(0)
    save_file({k: v.float() + 1e-3 * torch.randn(v.shape, generator=noise) if k.startswith("visual.") else v
               for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    assert main(["extract-weights", str(src), "--out", str(tmp_path / "out")]) == 0
    with load_encoder(src, device="cpu", dtype=torch.float32) as a, load_encoder(tmp_path / "out", device="cpu",
                                                                                   dtype=torch.float32) as b:
        assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_extract_weights_never_writes_into_the_hub_cache(hub, tmp_path, capsys):
    """A snapshot's files are links into blobs: extracting into the snapshot (named by repo id or as a folder), or
    into any other folder of the cache, is refused with --force too, and no cached byte changes."""
    folder = tmp_path / "released"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True, other_shards=1)
    hub.add("org/qwen25-tiny", folder)
    snapshot = fetch_vision_checkpoint("org/qwen25-tiny")
    assert (snapshot / "config.json").is_symlink()
    before = _tree(hub.cache)
    for source, out in (("org/qwen25-tiny", snapshot), (str(snapshot), snapshot),
                        (str(folder), hub.cache / "mine"), (str(folder), snapshot.parent.parent / "blobs")):
        assert main(["extract-weights", source, "--out", str(out), "--force"]) == 2
        one_error_line(capsys.readouterr().err, f"--out {out}", "--force or not")
    assert _tree(hub.cache) == before


@pytest.mark.parametrize("name", ["model.safetensors.tmp", "config.json.tmp", "preprocessor_config.json", "--out",
                                  "--out to nothing"])
def test_extract_weights_never_writes_through_a_planted_link(single_file_checkpoint, tmp_path, capsys, name):
    """A link at a name extract-weights writes (its temporary file, a config file, or --out itself, to a folder or
    dangling) is an error naming it, raised before anything is written: what it points to is untouched and the
    link stays."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    if name.startswith("--out"):
        link = out
        if name == "--out":
            victim.mkdir()
    else:
        out.mkdir()
        victim.write_bytes(b"somebody else's data")
        link = out / name
    link.symlink_to(victim)
    assert main(["extract-weights", str(single_file_checkpoint), "--out", str(out), "--force"]) == 3
    one_error_line(capsys.readouterr().err, str(link), "symbolic link")
    assert link.is_symlink() and (link == out or sorted(p.name for p in out.iterdir()) == [name])
    found = list(victim.iterdir()) if victim.is_dir() else victim.read_bytes() if victim.exists() else None
    assert found == {"--out": [], "--out to nothing": None}.get(name, b"somebody else's data")


def test_an_extraction_that_fails_part_way_leaves_no_loadable_folder(single_file_checkpoint, tmp_path, capsys,
                                                                      monkeypatch):
    """A write that fails after the weights (a full disk) leaves the folder without config.json: it does not load
    with another extraction's settings or the family's defaults; the ending is the output's fault, exit 3."""
    import errno

    from qwenvl_vision.checkpoint import save

    out = tmp_path / "out"
    assert main(["extract-weights", str(single_file_checkpoint), "--out", str(out)]) == 0
    real = save.replace_atomically

    def full_disk_at_the_preprocessor(path, tmp, write, *args):
        if path.name == "preprocessor_config.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        return real(path, tmp, write, *args)

    monkeypatch.setattr(save, "replace_atomically", full_disk_at_the_preprocessor)
    capsys.readouterr()
    assert main(["extract-weights", str(single_file_checkpoint), "--out", str(out), "--force"]) == 3
    one_error_line(capsys.readouterr().err, f"cannot write to {out}: No space left on device",
                   "preprocessor_config.json.tmp")
    assert not (out / "config.json").exists()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_encoder(out, device="cpu")


# ---------------------------------------------------------------------- config files: dangling links, offline


@pytest.mark.parametrize("name", ["preprocessor_config.json", "video_preprocessor_config.json", "config.json",
                                  "model.safetensors.index.json"])
def test_a_dangling_config_link_is_an_error_naming_it(checkpoint, tmp_path, name):
    """A settings file, the config or the index that is a link to nothing (a Hub cache whose blob is gone) is a
    CheckpointError naming it: never read as absent, which would put the family's defaults in its place."""
    folder = _copy(checkpoint, tmp_path)
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(tmp_path / "gone" / name)
    with pytest.raises(CheckpointError, match=rf"{name} is a symbolic link to .*, which is missing"):
        load_encoder(folder, device="cpu")


@pytest.fixture
def cached_repo(hub, tmp_path, monkeypatch):
    """org/qwen25-tiny fetched once online into the stand-in's cache; then offline (HF_HUB_OFFLINE), no request
    made since. Returns the snapshot folder."""
    folder = tmp_path / "released"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True, other_shards=1)
    hub.add("org/qwen25-tiny", folder)
    snapshot = fetch_vision_checkpoint("org/qwen25-tiny")
    hub.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_offline_a_cached_link_to_a_missing_blob_is_an_error(hub, cached_repo):
    (cached_repo / "preprocessor_config.json").resolve().unlink()
    with pytest.raises(CheckpointError, match=r"preprocessor_config\.json of repo 'org/qwen25-tiny'.*is a link to "
                                              r"a missing blob"):
        load_encoder("org/qwen25-tiny", device="cpu")
    assert hub.requests == []


def test_offline_a_settings_file_the_repo_lacks_keeps_the_defaults(hub, tmp_path, monkeypatch):
    """The Hub said the repo has no preprocessor_config.json (the cache recorded it): offline, the family's
    defaults are right, and the load works without a request."""
    folder = tmp_path / "released"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=True, other_shards=1)
    (folder / "preprocessor_config.json").unlink()
    hub.add("org/no-preprocessor", folder)
    fetch_vision_checkpoint("org/no-preprocessor")
    hub.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with load_encoder("org/no-preprocessor", device="cpu") as encoder:
        assert encoder.preprocess_config.max_pixels == 12845056
    assert hub.requests == []


def test_offline_a_settings_file_only_a_whole_snapshot_lacks_keeps_the_defaults(hub, cached_repo):
    """Offline, a preprocessor config the cache neither holds nor knows to be absent (a partial download: another
    tool's, or what transformers' from_pretrained fetched, a generation config, a tokenizer, a model card) may
    exist in the repo: an error naming it, not the family's defaults. A snapshot that ``hf download`` left holds
    every file of the repo (its .gitattributes among them, which only a whole download fetches): a settings file
    it lacks, the repo lacks (Qwen2.5-VL ships no video preprocessor config), so the defaults are right."""
    (cached_repo / "preprocessor_config.json").unlink()
    for name in ("generation_config.json", "tokenizer.json", "README.md"):
        (cached_repo / name).write_text("{}")
    for local_files_only, why in ((False, "HF_HUB_OFFLINE is set"), (True, "local_files_only=True")):
        with pytest.raises(CheckpointError, match=rf"preprocessor_config\.json of repo 'org/qwen25-tiny'.*: {why}"):
            load_encoder("org/qwen25-tiny", device="cpu", local_files_only=local_files_only)
    (cached_repo / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    with load_encoder("org/qwen25-tiny", device="cpu") as encoder:
        assert encoder.preprocess_config.max_pixels == 12845056
    assert hub.requests == []
