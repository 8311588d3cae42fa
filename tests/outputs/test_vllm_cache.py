"""qwenvl_vision.outputs.vllm_cache and ``embed --format vllm-cache``: vLLM's encoder-cache layout as an output, read
back with plain safetensors (tests/contract/ loads it with vLLM's own ECExampleConnector).

Each item file holds exactly what ``to_vllm`` gives the item, bit for bit; ids are the same from the API and from
``embed``, and change with the model, its dtype and the pixels; a folder of another model is refused with nothing
written; a resumed and a two-rank run record each input once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwenvl_vision import load_encoder
from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_encoded, read_manifest_lines, read_run
from qwenvl_vision.errors import CacheFolderError, EncoderClosedError, InputError
from qwenvl_vision.inputs.item_ids import item_id
from qwenvl_vision.outputs.handoff import to_vllm, vllm_timestamps
from qwenvl_vision.outputs.vllm_cache import CACHE_FILE, IDENTITY_FILE, vllm_request
from tests.helpers import ENV, FAMILY_SMALL, make_image_folder, rel_err, write_checkpoint, write_video
from tests.helpers.embed import make_media_folder, one_error_line, torchrun_embed_cmd

SMALL = ["--max-pixels", str(64 * 64)]


def embed(inputs, checkpoint, out, *extra) -> int:
    """``qwenvl-vision embed`` into a vLLM encoder cache at the small size (a ``--resume`` keeps the run's format)."""
    fmt = [] if "--resume" in extra else ["--format", "vllm-cache"]
    return main(["embed", *map(str, inputs), "--model", str(checkpoint), "--out", str(out), *fmt, *SMALL, *extra])


def cached(encoder, paths, folder, **pixels) -> list[dict]:
    """The entries of the images' items, written into ``folder`` by the API (at most 64x64 pixels unless told)."""
    return encoder.encode_images(paths, **{"max_pixels": 64 * 64, **pixels}).to_vllm_cache(folder)


@pytest.fixture(scope="module")
def imgs(tmp_path_factory) -> list[str]:
    return [str(p) for p in make_image_folder(tmp_path_factory.mktemp("imgs"), 2, bad=False)]


@pytest.fixture(scope="module")
def qwen3(checkpoint3):
    return load_encoder(checkpoint3, device="cpu")


@pytest.fixture(scope="module")
def qwen25(checkpoint):
    return load_encoder(checkpoint, device="cpu")


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_embed_writes_the_items_to_vllm_gives_named_as_the_api_names_them(tmp_path, checkpoint3, qwen3):
    pytest.importorskip("av")
    images, videos = make_media_folder(tmp_path / "media", 3, 2)
    (tmp_path / "media" / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "cache"
    assert embed([tmp_path / "media"], checkpoint3, out, "--fps", "3") == 1  # the broken file fails, the rest embed
    records = {Path(r["path"]).name: r for r in read_manifest_lines(out / "manifest.jsonl")}
    assert records["broken.png"]["status"] == "error" and "broken.png" in records["broken.png"]["error"]
    image_result = qwen3.encode_images([str(p) for p in images], max_pixels=64 * 64)
    video_result = qwen3.encode_videos([str(p) for p in videos], fps=3.0)
    for paths, result in [(images, image_result), (videos, video_result)]:
        data = result.to_vllm()
        expected = data[result.modality][f"{result.modality}_embeds"].split([e.shape[0] for e in result.embeddings])
        entries = result.to_vllm_cache(tmp_path / "api")
        for path, rows, e in zip(paths, expected, entries, strict=True):
            record = records[path.name]
            assert record["id"] == e["id"] and record["modality"] == result.modality == e["modality"]
            assert record["shard"] == f"{e['id']}/{CACHE_FILE}" and record["grid_thw"] == e["grid_thw"]
            stored = load_file(out / record["shard"])
            assert list(stored) == ["ec_cache"]
            assert stored["ec_cache"].dtype == rows.dtype and torch.equal(stored["ec_cache"], rows)
            assert torch.equal(load_file(tmp_path / "api" / e["id"] / CACHE_FILE)["ec_cache"], rows)
        if result.modality == "video":  # the times vLLM's Qwen3-VL processor computes for the same frames
            assert data["video"]["timestamps"] == [records[p.name]["timestamps"] for p in videos]
            for p, info in zip(videos, result.video_info):
                assert records[p.name]["timestamps"] == vllm_timestamps(info.frame_indices, info.video_fps)
        else:
            assert all("timestamps" not in records[p.name] for p in paths)
    assert not list(out.rglob("*.tmp")) and (out / IDENTITY_FILE).is_file()
    assert read_run(out)["file_format"] == "vllm-cache"
    stored = dict(read_embeddings(out, deepstack=True))  # split back into the embedding and its levels
    for path, emb, levels in zip(images, image_result.embeddings, image_result.deepstack):
        got, got_levels = stored[records[path.name]["path"]]
        assert torch.equal(got, emb) and len(got_levels) == 2
        assert all(torch.equal(a, b) for a, b in zip(got_levels, levels))


def test_ids_change_with_the_model_its_dtype_and_the_pixels_and_stay_for_the_same(tmp_path, checkpoint3, qwen3,
                                                                                   qwen25, imgs):
    ids = {"first": [e["id"] for e in cached(qwen3, imgs, tmp_path / "a")]}
    item = tmp_path / "a" / ids["first"][0] / CACHE_FILE
    written = item.stat().st_ino, item.read_bytes(), item.stat().st_mtime_ns
    assert [e["id"] for e in cached(qwen3, imgs, tmp_path / "a")] == ids["first"]
    # An id present is not rewritten (the same file, the same bytes); its last write is refreshed, so that a
    # cache prune, oldest first, keeps what is still being asked for.
    assert (item.stat().st_ino, item.read_bytes()) == written[:2] and item.stat().st_mtime_ns >= written[2]
    other = load_encoder(checkpoint3, device="cpu", random_weights=False)
    with torch.no_grad():  # a fine-tune: the same names and shapes, one weight changed
        next(other.model.parameters()).add_(1e-3)
    ids["pixels"] = cached(qwen3, imgs, tmp_path / "b", min_pixels=32 * 32, max_pixels=48 * 48)  # other pixels
    ids["dtype"] = cached(load_encoder(checkpoint3, device="cpu", dtype=torch.bfloat16), imgs, tmp_path / "c")
    ids["weights"] = cached(other, imgs, tmp_path / "d")
    ids["family"] = cached(qwen25, imgs, tmp_path / "e")
    flat = ids["first"] + [e["id"] for key in ("pixels", "dtype", "weights", "family") for e in ids[key]]
    assert len(set(flat)) == len(flat)
    cast = load_encoder(checkpoint3, device="cpu")  # its identity taken in fp32, then the tower cast to bf16
    assert cached(cast, imgs, tmp_path / "f") == cached(qwen3, imgs, tmp_path / "f")
    made_in_fp32 = cast.encode_images(imgs, min_pixels=32 * 32, max_pixels=64 * 64)
    cast.model.to(torch.bfloat16)
    assert [e["id"] for e in cached(cast, imgs, tmp_path / "g")] == [e["id"] for e in ids["dtype"]]
    with pytest.raises(InputError, match="made in float32 and its encoder is now bfloat16"):  # named as bf16 items
        made_in_fp32.to_vllm_cache(tmp_path / "g")


def test_a_folder_holding_another_model_s_items_is_refused_and_nothing_written(tmp_path, checkpoint, qwen3, qwen25,
                                                                            imgs, capsys):
    folder = tmp_path / "cache"
    cached(qwen3, imgs, folder)
    before = listing(folder)
    with pytest.raises(CacheFolderError, match="another model"):
        cached(qwen25, imgs, folder)
    assert embed(imgs, checkpoint, folder) == 2
    assert "another model" in one_error_line(capsys.readouterr().err, "another model")
    assert listing(folder) == before
    # Items of unknown origin (vLLM's own producer, a copy without the identity file) are refused too.
    (folder / IDENTITY_FILE).unlink()
    with pytest.raises(CacheFolderError, match="not written by qwenvl-vision"):
        cached(qwen3, imgs, folder)
    uuids = tmp_path / "uuids"  # vLLM's producer names each item by its request's uuid
    (uuids / "a-uuid").mkdir(parents=True)
    (uuids / "a-uuid" / CACHE_FILE).write_bytes(b"x")
    with pytest.raises(CacheFolderError, match="not written by qwenvl-vision"):
        cached(qwen3, imgs, uuids)
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(CacheFolderError, match="a-file is a file, not a folder"):
        cached(qwen3, imgs, tmp_path / "a-file")
    (tmp_path / "listed" / IDENTITY_FILE).parent.mkdir()
    (tmp_path / "listed" / IDENTITY_FILE).write_text("[]")  # JSON, but no identity
    with pytest.raises(CacheFolderError, match=rf"{IDENTITY_FILE} is unreadable \(a JSON list, not an object\)"):
        cached(qwen3, imgs, tmp_path / "listed")


def test_the_request_names_each_item_by_its_id_with_the_grid_and_the_timing(tmp_path, qwen3, imgs):
    pytest.importorskip("av")
    video = tmp_path / "clip.mp4"
    write_video(video, 9, 48, 40, 4)
    images = cached(qwen3, imgs, tmp_path / "cache")
    videos = qwen3.encode_videos([str(video)]).to_vllm_cache(tmp_path / "cache")
    request = vllm_request([images[1], videos[0], images[0]])  # each modality's items in prompt order
    assert request["multi_modal_uuids"] == {"image": [images[1]["id"], images[0]["id"]], "video": [videos[0]["id"]]}
    data = request["multi_modal_data"]
    assert torch.equal(data["image"]["image_grid_thw"], torch.tensor([images[1]["grid_thw"], images[0]["grid_thw"]]))
    assert set(data["image"]) == {"image_grid_thw"}  # the embeddings come from the cache
    assert data["video"]["timestamps"] == [videos[0]["timestamps"]] and len(videos[0]["timestamps"]) == \
        videos[0]["grid_thw"][0]
    with pytest.raises(InputError, match="entry 1: id"):  # an id names a folder: nothing else may
        vllm_request([images[0], {**images[1], "id": "../../etc"}])
    with pytest.raises(InputError, match=r"entry 0: grid_thw 'None' is no \(t, h, w\)"):
        vllm_request([{key: value for key, value in images[0].items() if key != "grid_thw"}])


def test_omni_videos_carry_the_seconds_per_temporal_patch_of_the_fps_asked(tmp_path):
    """The Omni thinkers' processors compute temporal_patch_size / fps from the fps asked for (not the rate the
    frames came out at); frames given in memory have none, which to_vllm names."""
    pytest.importorskip("av")
    video = tmp_path / "clip.mp4"
    write_video(video, 11, 48, 40, 5)
    encoder = load_encoder(FAMILY_SMALL["qwen2_5_omni"], random_weights=True, device="cpu")
    result = encoder.encode_videos([str(video)], fps=3.0)
    assert result.to_vllm()["video"]["second_per_grid_ts"].tolist() == [pytest.approx(2 / 3)]
    (e,) = result.to_vllm_cache(tmp_path / "cache")
    assert e["second_per_grid_t"] == pytest.approx(2 / 3) and "timestamps" not in e
    assert vllm_request([e])["multi_modal_data"]["video"]["second_per_grid_ts"].tolist() == [pytest.approx(2 / 3)]
    frames = encoder.encode_videos([torch.zeros(4, 3, 56, 56, dtype=torch.uint8)])
    for handoff in (frames.to_vllm, lambda: frames.to_vllm_cache(tmp_path / "other")):
        with pytest.raises(InputError, match="video_info"):
            handoff()
    assert not (tmp_path / "other").exists()


def test_a_result_names_its_items_while_its_encoder_is_loaded_or_has_hashed_its_weights(tmp_path, checkpoint3, imgs):
    """A result does not keep its encoder alive: once the encoder is gone, which model made it is unknown. A closed
    encoder that hashed its weights before it closed still names them."""
    result = load_encoder(checkpoint3, device="cpu").encode_images(imgs, max_pixels=64 * 64)
    with pytest.raises(InputError, match="keep the encoder"):
        result.to_vllm_cache(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    encoders = [load_encoder(checkpoint3, device="cpu") for _ in range(2)]
    results = [encoder.encode_images(imgs, max_pixels=64 * 64) for encoder in encoders]
    identity = encoders[1].identity()  # hashed before it closes
    for encoder in encoders:
        encoder.close()
    with pytest.raises(EncoderClosedError):
        results[0].to_vllm_cache(tmp_path / "cache")
    assert encoders[1].identity() == identity and len(results[1].to_vllm_cache(tmp_path / "cache")) == 2


def test_a_resumed_run_and_two_ranks_record_each_input_once(tmp_path, checkpoint):
    paths = make_image_folder(tmp_path / "imgs", 5)
    out = tmp_path / "resumed"
    assert embed(paths[:2], checkpoint, out) == 0
    first = {r["path"]: r["id"] for r in read_manifest_lines(out / "manifest.jsonl")}
    assert embed([tmp_path / "imgs"], checkpoint, out, "--resume") == 1  # the format is the run's; bad files fail
    recs = read_manifest_lines(out / "manifest.jsonl")
    assert len({r["realpath"] for r in recs}) == len(recs) == len(paths) + 3
    ok = [r for r in recs if r["status"] == "ok"]
    assert {r["path"]: r["id"] for r in ok if r["path"] in first} == first
    assert {p.name for p in out.iterdir() if p.is_dir()} == {r["id"] for r in ok}
    ranks = tmp_path / "ranks"
    result = subprocess.run(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, ranks, "--format", "vllm-cache",
                                               *SMALL), env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    by_rank = read_manifest_lines(ranks / "manifest.jsonl")
    assert {r["rank"] for r in by_rank} == {0, 1} and len(by_rank) == len(recs)
    assert {r["path"]: r["id"] for r in by_rank if r["status"] == "ok"} == {r["path"]: r["id"] for r in ok}
    for r in ok:  # the ranks run 1 thread each (ENV), this process more: the same up to fp32 rounding
        assert rel_err(load_file(ranks / r["shard"])["ec_cache"], load_file(out / r["shard"])["ec_cache"]) <= 1e-5
    assert not list(ranks.rglob("*.tmp"))


def test_pooled_only_vllm_cache_is_refused(tmp_path, checkpoint, imgs, capsys):
    assert embed(imgs, checkpoint, tmp_path / "out", "--pooled-only") == 2
    one_error_line(capsys.readouterr().err, "--pooled-only")
    assert not (tmp_path / "out").exists()


def test_a_resume_removes_a_killed_run_s_temporary_item_and_records_each_input_once(tmp_path, checkpoint, qwen25):
    """A run killed while an item was being written leaves its temporary file (removed by the resume) and maybe a
    complete item it never recorded (kept: the redone input finds it under its id). Two files with the same pixels
    are one item, recorded for both."""
    paths = make_image_folder(tmp_path / "imgs", 3, bad=False)
    (tmp_path / "imgs" / "twin.png").write_bytes(paths[1].read_bytes())
    out = tmp_path / "cache"
    assert embed(paths[:1], checkpoint, out) == 0
    (orphan,) = cached(qwen25, [str(paths[2])], out)  # written, unrecorded
    stale = out / orphan["id"] / f"{CACHE_FILE}.{read_run(out)['run_id']}-r0.tmp"
    stale.write_bytes(b"half an item")
    assert embed([tmp_path / "imgs"], checkpoint, out, "--resume") == 0
    recs = read_manifest_lines(out / "manifest.jsonl")
    assert sorted(Path(r["path"]).name for r in recs) == sorted([p.name for p in paths] + ["twin.png"])
    by_name = {Path(r["path"]).name: r for r in recs}
    assert by_name["twin.png"]["id"] == by_name[paths[1].name]["id"]
    assert by_name[paths[2].name]["id"] == orphan["id"]
    assert not stale.exists() and not list(out.rglob("*.tmp"))
    assert {p.name for p in out.iterdir() if p.is_dir()} == {r["id"] for r in recs}


def test_a_pickled_result_keeps_its_tensors_and_drops_its_encoder(tmp_path, qwen3, imgs):
    import copy
    import pickle

    result = qwen3.encode_images(imgs, max_pixels=64 * 64)
    pickled = pickle.loads(pickle.dumps(result))
    assert torch.equal(pickled.embeddings[0], result.embeddings[0]) and pickled.pixels_sha256 == result.pixels_sha256
    with pytest.raises(InputError, match="pickled one drops it"):
        pickled.to_vllm_cache(tmp_path / "cache")
    assert len(copy.deepcopy(result).to_vllm_cache(tmp_path / "cache")) == 2  # a copy in memory keeps it
    streamed = [r for batch in qwen3.iter_encode(imgs, max_pixels=64 * 64) for r in batch]
    assert streamed[0].pixels_sha256 is None  # hashing is asked for: iter_encode(hash_pixels=True)
    hashed = [r for batch in qwen3.iter_encode(imgs, max_pixels=64 * 64, hash_pixels=True) for r in batch]
    assert hashed[0].pixels_sha256 == result.pixels_sha256[0]
    with pytest.raises(InputError, match="no pixel hash"):
        item_id(qwen3.identity(), "image", [1, 4, 4], None)


def test_an_omni_video_from_a_parquet_run_hands_over_at_the_run_s_fps(tmp_path):
    """Parquet has no column for the fps a video was asked at: read_encoded takes the run's."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("av")
    folder = tmp_path / "omni"
    write_checkpoint(folder, FAMILY_SMALL["qwen2_5_omni"])
    video = tmp_path / "clip.mp4"
    write_video(video, 11, 48, 40, 5)
    out = tmp_path / "out"
    assert main(["embed", str(video), "--model", str(folder), "--out", str(out), "--format", "parquet",
                 "--fps", "2.5"]) == 0
    data = to_vllm(read_encoded(out))["video"]
    assert data["second_per_grid_ts"].tolist() == [pytest.approx(2 / 2.5)]


@pytest.mark.parametrize("target", ["dangling", "another model's identity", "this model's identity"])
def test_a_link_at_the_identity_file_is_refused_and_left_as_it_is(tmp_path, qwen3, qwen25, imgs, target):
    """A dangling link reads as no identity yet (it raised a FileNotFoundError); one to another model's identity is
    that model's folder; any link is left as it is and never written through."""
    from qwenvl_vision.errors import OutputLinkError

    folder = tmp_path / "cache"
    folder.mkdir()
    pointed = tmp_path / "elsewhere.json"
    if target != "dangling":
        cached(qwen3 if target == "another model's identity" else qwen25, imgs, tmp_path / "o")
        pointed = tmp_path / "o" / IDENTITY_FILE
    (folder / IDENTITY_FILE).symlink_to(pointed)
    expected = (CacheFolderError, "another model") if target == "another model's identity" else (
        OutputLinkError, f"{IDENTITY_FILE} is a symbolic link")
    with pytest.raises(expected[0], match=expected[1]):
        cached(qwen25, imgs, folder)
    assert (folder / IDENTITY_FILE).is_symlink() and sorted(p.name for p in folder.iterdir()) == [IDENTITY_FILE]


def test_a_model_that_claims_the_folder_first_wins_and_the_other_is_refused(tmp_path, qwen3, qwen25, imgs,
                                                                              monkeypatch):
    """Two writers of two models meet on a fresh folder: the identity file is never replaced; whoever's lands
    first decides, and the other is refused before writing an item."""
    import os

    cached(qwen3, imgs, tmp_path / "first")
    theirs = (tmp_path / "first" / IDENTITY_FILE).read_bytes()
    link = os.link

    def another_writer_got_there_first(src, dst):
        Path(dst).write_bytes(theirs)  # between our exists() and our link
        return link(src, dst)

    monkeypatch.setattr(os, "link", another_writer_got_there_first)
    with pytest.raises(CacheFolderError, match="another model"):
        cached(qwen25, imgs, tmp_path / "cache")
    assert (tmp_path / "cache" / IDENTITY_FILE).read_bytes() == theirs
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [IDENTITY_FILE]


def test_a_fifo_at_an_item_s_file_is_replaced_not_opened(tmp_path):
    """The folder is shared with other writers: a FIFO where an item's file goes would block the writer holding the
    folder's lock for good (and every prune after it). In a child: the blocked open holds the GIL."""
    (tmp_path / "item").mkdir()
    fifo = tmp_path / "item" / CACHE_FILE
    os.mkfifo(fifo)
    write = ("import sys, torch; from pathlib import Path; from qwenvl_vision.outputs.vllm_cache import write_item; "
             "assert write_item(Path(sys.argv[1]), 'item', torch.ones(2, 4), 't')")
    subprocess.run([sys.executable, "-c", write, str(tmp_path)], env=ENV, check=True, timeout=60)
    assert torch.equal(load_file(fifo)["ec_cache"], torch.ones(2, 4))


def test_a_file_where_an_item_s_folder_goes_is_named_never_taken_for_the_item(tmp_path):
    from qwenvl_vision.outputs.vllm_cache import write_item

    (tmp_path / "item").write_text("another writer's")
    with pytest.raises(CacheFolderError, match=r"item is a file where an item's folder goes"):
        write_item(tmp_path, "item", torch.ones(2, 4), "t")
    assert (tmp_path / "item").read_text() == "another writer's"


def test_a_folder_of_the_same_family_in_another_dtype_or_weights_is_refused(tmp_path, checkpoint3, qwen3, imgs):
    """Every identity field decides, not the family alone: bf16 rows or a fine-tune's would load for this model's
    prompts."""
    folder = tmp_path / "cache"
    cached(qwen3, imgs, folder)
    before = listing(folder)
    tuned = load_encoder(checkpoint3, device="cpu")
    with torch.no_grad():
        next(tuned.model.parameters()).add_(1e-3)
    for other, field in ((load_encoder(checkpoint3, device="cpu", dtype=torch.bfloat16), "dtype"),
                         (tuned, "weights_sha256")):
        with pytest.raises(CacheFolderError, match=rf"another model \(.*\b{field} "):
            cached(other, imgs, folder)
        assert listing(folder) == before


def test_a_folder_with_other_files_and_folders_but_no_items_is_claimed(tmp_path, qwen3, imgs):
    """Only an item (a folder named as one, holding an item file) makes a folder without identity someone else's."""
    folder = tmp_path / "cache"
    (folder / "notes").mkdir(parents=True)
    (folder / ("d" * 64)).mkdir()  # named as an item, but holds none
    (folder / "README.txt").write_text("mine")
    assert len(cached(qwen3, imgs, folder)) == 2 and (folder / IDENTITY_FILE).is_file()


def test_items_are_written_only_while_the_folder_s_lock_is_held(tmp_path, qwen3, imgs):
    """A prune holds the folder's lock while it reads and removes: a writer waits for it before writing an item."""
    import threading

    from qwenvl_vision.outputs.vllm_cache import cache_lock

    result = qwen3.encode_images(imgs, max_pixels=64 * 64)
    folder = tmp_path / "cache"
    folder.mkdir()
    done = []
    with cache_lock(folder):  # a prune in progress
        writer = threading.Thread(target=lambda: done.append(result.to_vllm_cache(folder)))
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and not list(folder.glob(f"*/{CACHE_FILE}"))
    writer.join(30)
    assert len(done[0]) == 2 and len(list(folder.glob(f"*/{CACHE_FILE}"))) == 2


def test_a_link_at_an_item_s_file_is_refused_never_read_nor_touched(tmp_path, qwen3, imgs):
    """Somebody else's file linked in at an item's name (a valid item file, even): an OutputLinkError naming it; the
    link is left, its target neither taken for the item nor touched."""
    from qwenvl_vision.errors import OutputLinkError

    folder = tmp_path / "cache"
    (first, _) = cached(qwen3, imgs, folder)
    item = folder / first["id"] / CACHE_FILE
    elsewhere = tmp_path / "elsewhere.safetensors"
    item.rename(elsewhere)
    item.symlink_to(elsewhere)
    os.utime(elsewhere, (0, 0))
    with pytest.raises(OutputLinkError, match="symbolic link"):
        cached(qwen3, imgs, folder)
    assert item.is_symlink() and elsewhere.stat().st_mtime == 0


def test_a_request_entry_s_grid_must_be_three_numbers():
    with pytest.raises(InputError, match=r"entry 0: grid_thw '\[1, 4\]' is no \(t, h, w\)"):
        vllm_request([{"id": "a" * 64, "modality": "image", "grid_thw": [1, 4]}])
