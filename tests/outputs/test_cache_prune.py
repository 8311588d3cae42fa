"""``qwenvl-vision cache prune``: a vLLM encoder-cache folder kept under a size bound, oldest items first, safely
beside a running ``embed`` into the same folder; what it removed is accounted for (pruned.jsonl), skipped by
``read_embeddings`` and embedded again by ``--resume``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_encoded, read_manifest_lines
from qwenvl_vision.embed.lock import FolderLock
from qwenvl_vision.errors import ManifestError
from qwenvl_vision.outputs.cache_prune import PRUNED, prune_cache
from qwenvl_vision.outputs.vllm_cache import CACHE_FILE, IDENTITY_FILE
from tests.helpers import ENV, REPO, make_image_folder
from tests.helpers.embed import one_error_line

SMALL = ["--max-pixels", str(64 * 64)]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def items(folder: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in folder.glob(f"*/{CACHE_FILE}")}


def embed_cache(imgs: Path, out: Path, checkpoint: Path, *extra: str) -> int:
    return main(["embed", str(imgs), "--model", str(checkpoint), "--out", str(out), "--format", "vllm-cache",
                 "--quiet", *SMALL, *extra])


def age_items(out: Path, order: list[str], base: float) -> None:
    """Give the items last writes one minute apart, in ``order`` (the first the oldest)."""
    for i, item in enumerate(order):
        os.utime(out / item / CACHE_FILE, (base + 60 * i, base + 60 * i))


def test_prune_removes_the_oldest_items_to_the_bound_accounts_for_them_and_resume_embeds_them_again(
        tmp_path, checkpoint, capsys):
    make_image_folder(tmp_path / "imgs", 6, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    order = [r["id"] for r in records]
    age_items(out, order, time.time() - 3600)
    sizes = {i: p.stat().st_size for i, p in items(out).items()}
    bound = folder_bytes(out) - sizes[order[0]] - sizes[order[1]] // 2  # the two oldest must go, no more
    capsys.readouterr()

    (out / "qwenvl_vision_cache.lock").unlink()  # a dry run reads: it creates nothing, so a read-only folder will do
    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9), "--dry-run"]) == 0
    assert "would remove 2 item(s)" in capsys.readouterr().out and set(items(out)) == set(order)
    assert not (out / "qwenvl_vision_cache.lock").exists()

    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9)]) == 0
    line = capsys.readouterr().out.strip()
    assert "removed 2 item(s)" in line and len(line.splitlines()) == 1
    assert set(items(out)) == set(order[2:]) and folder_bytes(out) <= bound
    assert not (out / order[0]).exists()  # the emptied item folder too
    pruned = [json.loads(x) for x in (out / PRUNED).read_text().splitlines()]
    assert [p["id"] for p in pruned] == order[:2] and [p["bytes"] for p in pruned] == [sizes[i] for i in order[:2]]

    with pytest.warns(UserWarning, match="2 item"):
        read = dict(read_embeddings(out))
    assert sorted(read) == sorted(r["path"] for r in records[2:])
    # For a language model: every record left, or a removed one asked for by name refused in one line.
    with pytest.warns(UserWarning, match="2 item"):
        encoded = read_encoded(out)
    assert [e.shape[0] for e in encoded.embeddings] == [r["tokens"] for r in records[2:]]
    assert [list(g) for g in encoded.grid_thw] == [r["grid_thw"] for r in records[2:]]
    with pytest.warns(UserWarning, match="2 item"), pytest.raises(ManifestError, match=(
            rf"the item of '{re.escape(records[1]['path'])}' was removed by `qwenvl-vision cache prune`")):
        read_encoded(out, [records[2]["path"], records[1]["path"]])

    assert embed_cache(tmp_path / "imgs", out, checkpoint, "--resume") == 0
    assert set(items(out)) == set(order)  # the removed inputs are not done any more: embedded again
    assert len(dict(read_embeddings(out))) == len(records)


def test_a_prune_after_one_killed_mid_append_still_accounts_for_what_it_removes(tmp_path, checkpoint):
    make_image_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    age_items(out, [r["id"] for r in records], time.time() - 3600)
    (out / PRUNED).write_text('{"id": "0123", "by')  # a prune killed as it appended
    bound = folder_bytes(out) - items(out)[records[0]["id"]].stat().st_size // 2
    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9)]) == 0
    with pytest.warns(UserWarning, match="1 item"):
        assert sorted(dict(read_embeddings(out))) == sorted(r["path"] for r in records[1:])


def test_a_run_read_while_prunes_remove_its_items_skips_each_of_them(tmp_path, checkpoint):
    """A prune from cron meanwhile: each item it removes is skipped, however far along the reading is."""
    make_image_folder(tmp_path / "imgs", 5, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    records = read_manifest_lines(out / "manifest.jsonl")
    order = [r["id"] for r in records]
    age_items(out, [order[1], order[3], order[0], order[2], order[4]], time.time() - 3600)  # 1, then 3, the oldest

    def prune_one(item: str) -> None:
        bound = folder_bytes(out) - items(out)[item].stat().st_size + 300  # its line in pruned.jsonl stays
        assert [i.id for i in prune_cache(out, bound).removed] == [item]

    prune_one(order[1])
    reading = read_embeddings(out)
    with pytest.warns(UserWarning, match="2 item"):
        read = [next(reading)[0], next(reading)[0]]  # past the first removed item
        prune_one(order[3])
        read += [path for path, _ in reading]
    assert read == [records[i]["path"] for i in (0, 2, 4)]


def test_a_killed_writer_s_temporary_item_file_is_removed_and_costs_no_item_its_place(tmp_path, checkpoint, capsys):
    make_image_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    before = items(out)
    stale = next(iter(before.values())).with_name(f"{CACHE_FILE}.0123456789abcdef.tmp")  # a SIGKILL mid-write
    stale.write_bytes(os.urandom(300_000))
    bound = folder_bytes(out) - 300_000  # the items fit once the temporary file is gone
    capsys.readouterr()
    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9), "--dry-run"]) == 0
    assert "would remove 0 item(s)" in capsys.readouterr().out and stale.exists()
    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9)]) == 0
    line = capsys.readouterr().out
    assert "removed 0 item(s)" in line and "1 temporary file(s)" in line, line
    assert not stale.exists() and items(out) == before


def test_prune_refuses_what_it_cannot_account_for(tmp_path, checkpoint, capsys):
    other = tmp_path / "other"
    (other / ("a" * 64)).mkdir(parents=True)
    (other / ("a" * 64) / CACHE_FILE).write_bytes(b"x" * 1000)
    assert main(["cache", "prune", str(other), "--max-gb", "0"]) == 2
    one_error_line(capsys.readouterr().err, IDENTITY_FILE)
    assert (other / ("a" * 64) / CACHE_FILE).exists()
    for bad in ("-1", "nan", "lots", "1e300"):  # 1e300 GB is no number of bytes
        assert main(["cache", "prune", str(other), "--max-gb", bad]) == 2
        one_error_line(capsys.readouterr().err, "--max-gb")

    make_image_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"y" * 10)
    (out / ("b" * 64)).mkdir()
    (out / ("b" * 64) / CACHE_FILE).symlink_to(elsewhere)  # a link at an item's name: not an item, not removed
    (tmp_path / "linked").symlink_to(out)  # a big disk's folder, linked where vLLM looks: pruned through the link
    report = prune_cache(tmp_path / "linked", 0)
    assert report.kept == 0 and elsewhere.exists() and (out / ("b" * 64) / CACHE_FILE).is_symlink()
    assert (out / "manifest.jsonl").exists()

    # A link at its list of removed items: never appended through, and nothing removed unlisted.
    assert embed_cache(tmp_path / "imgs", out, checkpoint, "--resume") == 0
    before = set(items(out))
    (out / PRUNED).unlink()
    (out / PRUNED).symlink_to(elsewhere)
    capsys.readouterr()
    assert main(["cache", "prune", str(out), "--max-gb", "0"]) == 3
    one_error_line(capsys.readouterr().err, PRUNED)
    assert elsewhere.read_bytes() == b"y" * 10 and set(items(out)) == before


def test_a_running_embed_keeps_what_it_recorded_and_the_folder_keeps_to_its_bound(tmp_path, checkpoint):
    """An embed (a --resume with more inputs) runs into the folder while prunes loop beside it: the earlier
    session's items go, nothing the running session wrote is removed while it runs, it finishes cleanly, every
    item left is whole and loads, and once it ends a prune brings the folder under the bound."""
    imgs = tmp_path / "imgs"
    make_image_folder(imgs, 8, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(imgs, out, checkpoint) == 0
    first = [r["id"] for r in read_manifest_lines(out / "manifest.jsonl")]
    age_items(out, first, time.time() - 7200)
    bound = 50_000  # ~15-30 kB of it the 32 manifest lines, run.json and pruned.jsonl: some items stay
    more = tmp_path / "more"
    make_image_folder(more, 32, bad=False)
    for path in sorted(more.rglob("img*.*"), key=lambda p: p.name)[8:]:  # the first 8: imgs/' pixels, not new
        path.rename(imgs / f"more-{path.name}")
    # A slow machine (every batch 0.2 s longer): the prunes surely run while the embed writes.
    cmd = [sys.executable, "-m", "tests.helpers.fault_driver", json.dumps({"slow_s": 0.2}), "embed", str(imgs),
           "--model", str(checkpoint), "--out", str(out), "--resume", "--quiet", "--batch-patches", "64", *SMALL]
    writer = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = []
    while writer.poll() is None:
        report = prune_cache(out, bound)
        reports.append(report)
        if report.running:  # not once the writer has let its lock go (its process may still be exiting)
            assert not {i.id for i in report.removed} - set(first), "removed an item of the running embed"
        time.sleep(0.05)
    _, err = writer.communicate()
    assert writer.returncode == 0, err[-2000:]
    assert any(r.removed and r.running for r in reports)

    final = prune_cache(out, bound)
    assert final.kept_bytes <= bound and folder_bytes(out) <= bound and final.kept >= 4
    records = read_manifest_lines(out / "manifest.jsonl")
    pruned = {json.loads(x)["id"] for x in (out / PRUNED).read_text().splitlines()}
    left = items(out)
    for r in records:  # every recorded item is in place, whole, or accounted for as pruned
        assert r["status"] == "ok"
        if r["id"] in left:
            assert load_file(left[r["id"]])["ec_cache"].shape[0] == r["tokens"]
        else:
            assert r["id"] in pruned
    assert set(left) <= {r["id"] for r in records}


def test_a_lock_file_left_by_a_killed_run_holds_nothing_and_one_of_a_live_run_holds_its_items(tmp_path, checkpoint):
    """SIGKILL leaves ``embed.lock`` (the kernel drops the lock, not the file): a prune sees that nothing locks it, and
    removes what the bound asks. A lock file that a live process locks keeps the items written since it was made."""
    make_image_folder(tmp_path / "imgs", 4, bad=False)
    out = tmp_path / "cache"
    assert embed_cache(tmp_path / "imgs", out, checkpoint) == 0
    order = [r["id"] for r in read_manifest_lines(out / "manifest.jsonl")]
    age_items(out, order, time.time() + 60)  # written after any lock file made below
    bound = folder_bytes(out) - items(out)[order[0]].stat().st_size + 300  # the oldest must go (its log line stays)
    lock = out / "embed.lock"
    # A run killed while it held the folder: the real lock, taken by a process then SIGKILLed.
    killed = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path\n"
                               "from qwenvl_vision.embed.lock import FolderLock\n"
                               "lock = FolderLock(Path(sys.argv[1]), 'the folder'); lock.acquire()\n"
                               "print('held', flush=True)\n"
                               "time.sleep(60)", str(lock)], stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    with killed.stdout:
        assert killed.stdout.readline().strip() == "held"
    held = prune_cache(out, bound, dry_run=True)
    assert held.running and held.held == len(order) and not held.removed  # alive: its items are kept
    killed.kill()
    killed.wait()
    assert lock.exists() and f"pid {killed.pid} on " in lock.read_text()
    report = prune_cache(out, bound)
    assert not report.running and [i.id for i in report.removed] == order[:1] and folder_bytes(out) <= bound


def test_a_folder_above_the_bound_only_by_its_own_files_is_done_and_one_held_by_a_running_embed_is_not(
        tmp_path, capsys):
    """`--max-gb 0` removes every item: the manifest and run.json left above the bound are no failure (exit 0, the
    line says what remains); items a running embed wrote, kept above the bound, are (exit 1)."""
    out = tmp_path / "cache"
    (out / ("c" * 64)).mkdir(parents=True)
    (out / ("c" * 64) / CACHE_FILE).write_bytes(b"x" * 1000)
    for name in (IDENTITY_FILE, "manifest.jsonl", "run.json"):
        (out / name).write_text("{}\n")
    running = FolderLock(out / "embed.lock", str(out))  # a run that is still going
    running.acquire()
    later = time.time() + 60  # written after the lock file was made: the running embed's
    os.utime(out / ("c" * 64) / CACHE_FILE, (later, later))
    assert main(["cache", "prune", str(out), "--max-gb", "0"]) == 1
    assert "written by a running embed" in capsys.readouterr().out and items(out)
    running.release()
    assert main(["cache", "prune", str(out), "--max-gb", "0"]) == 0
    line = capsys.readouterr().out
    assert "removed 1 item(s)" in line and "own files" in line and not items(out)
    assert (out / "manifest.jsonl").exists() and (out / "run.json").exists()


def test_items_written_under_a_serve_client_s_uuids_are_pruned_oldest_first(tmp_path, capsys):
    """Even beside a running embed: what it holds is its own items, not the server's, whose uuids may be 64 hex
    digits too (a proxy's sha256 of the URL)."""
    import hashlib

    import torch

    from qwenvl_vision.inputs.item_ids import IDENTITY_FIELDS
    from qwenvl_vision.outputs.vllm_cache import ENTRY_KEY, claim_cache_folder, write_item

    out = tmp_path / "shared"  # as `serve --ec-shared-storage` writes it: the folder claimed, items by uuid
    claim_cache_folder(out, dict.fromkeys(IDENTITY_FIELDS, "x"), "t")
    hashed = hashlib.sha256(b"https://example.com/a.png").hexdigest()
    names = ["e" * 64, "old-uuid", hashed, "newUuid"]  # the first the embed's, the oldest
    for name in names:
        assert write_item(out, name, torch.zeros(8, 16), "t", None if name == "e" * 64 else {ENTRY_KEY: "{}"})
    running = FolderLock(out / "embed.lock", str(out))  # an embed writing into the same folder meanwhile
    running.acquire()
    age_items(out, names, time.time() + 60)  # written or touched since the embed started
    bound = folder_bytes(out) - items(out)["old-uuid"].stat().st_size * 3 // 2  # two of the server's must go
    assert main(["cache", "prune", str(out), "--max-gb", str(bound / 1e9)]) == 0
    running.release()
    assert "removed 2 item(s)" in capsys.readouterr().out
    assert sorted(items(out)) == sorted(["e" * 64, "newUuid"])


def claimed_folder(out: Path, names: list[str], base: float) -> None:
    """A folder claimed as writers claim it, with equal items ``names`` written one minute apart (the first the
    oldest)."""
    import torch

    from qwenvl_vision.inputs.item_ids import IDENTITY_FIELDS
    from qwenvl_vision.outputs.vllm_cache import claim_cache_folder, write_item

    claim_cache_folder(out, dict.fromkeys(IDENTITY_FIELDS, "x"), "t")
    for name in names:
        assert write_item(out, name, torch.zeros(64, 64), "t")
    age_items(out, names, base)


def test_the_bound_is_kept_counting_the_lines_that_pruned_jsonl_gains(tmp_path):
    """A folder exactly at the bound loses nothing; a bound one item's bytes below it costs two items, since the
    first one's line in pruned.jsonl takes some of the room it freed."""
    out = tmp_path / "cache"
    names = ["a" * 64, "b" * 64, "c" * 64]
    claimed_folder(out, names, time.time() - 3600)
    total, size = folder_bytes(out), items(out)[names[0]].stat().st_size
    assert prune_cache(out, total).removed == []
    report = prune_cache(out, total - size)
    assert [i.id for i in report.removed] == names[:2] and report.done
    assert report.kept_bytes == folder_bytes(out) <= total - size


def test_items_written_since_the_earliest_running_rank_took_its_lock_are_kept(tmp_path):
    """A two-rank embed holds embed.rank0.lock and embed.rank1.lock: what was written since the first rank started is
    the run's, kept (one written the very moment it started too); only what came before goes."""
    out = tmp_path / "cache"
    now = time.time()
    names = ["a" * 64, "b" * 64, "c" * 64]
    claimed_folder(out, names, now - 250)  # a: 250 s ago, b: 190 s, c: 130 s
    ranks = [FolderLock(out / f"embed.rank{rank}.lock", str(out)) for rank in range(2)]
    for lock in ranks:
        lock.acquire()
    b_written = (out / names[1] / CACHE_FILE).stat().st_mtime_ns
    os.utime(out / "embed.rank0.lock", ns=(b_written, b_written))  # rank 0 started as b was written
    os.utime(out / "embed.rank1.lock", (now - 50, now - 50))
    try:
        report = prune_cache(out, 0)
    finally:
        for lock in ranks:
            lock.release()
    assert report.running and [i.id for i in report.removed] == names[:1] and report.held == 2
    assert sorted(items(out)) == names[1:]


def test_a_prune_waits_for_a_writer_s_batch_and_gives_up_naming_the_lock(tmp_path, monkeypatch):
    """The writers hold the folder's lock while they write and record items: a prune waits for it (at most
    LOCK_WAIT_S), then stops with a CacheFolderError naming it, nothing removed; a dry run only reads."""
    from qwenvl_vision.errors import CacheFolderError
    from qwenvl_vision.outputs import cache_prune
    from qwenvl_vision.outputs.vllm_cache import CACHE_LOCK, cache_lock

    out = tmp_path / "cache"
    claimed_folder(out, ["a" * 64], time.time() - 3600)
    monkeypatch.setattr(cache_prune, "LOCK_WAIT_S", 0.2)
    with cache_lock(out):  # a writer's batch in progress
        with pytest.raises(CacheFolderError, match=CACHE_LOCK):
            prune_cache(out, 0)
        assert list(items(out)) == ["a" * 64]
        assert [i.id for i in prune_cache(out, 0, dry_run=True).removed] == ["a" * 64]
    assert [i.id for i in prune_cache(out, 0).removed] == ["a" * 64] and not items(out)


def test_a_link_named_as_an_item_is_never_pruned_through(tmp_path):
    """A link at an item's folder name is no item of the folder: what it points to, outside (an item file, a writer's
    temporary file), is never removed."""
    out = tmp_path / "cache"
    claimed_folder(out, ["a" * 64], time.time() - 3600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / CACHE_FILE).write_bytes(b"z" * 100_000)
    (elsewhere / f"{CACHE_FILE}.0123456789abcdef.tmp").write_bytes(b"a writer's, elsewhere")
    (out / ("b" * 64)).symlink_to(elsewhere, target_is_directory=True)
    report = prune_cache(out, 0)
    assert [i.id for i in report.removed] == ["a" * 64] and report.kept == 0 and report.stale == 0
    assert (elsewhere / CACHE_FILE).read_bytes() == b"z" * 100_000
    assert (elsewhere / f"{CACHE_FILE}.0123456789abcdef.tmp").exists()
