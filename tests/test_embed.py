"""`qwenvl-vision embed` — manifest, shards, bad inputs, resume, SIGKILL, two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from qwenvl_vision.cli import main
from qwenvl_vision.embed import gather_inputs, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.encoder import load_encoder
from qwenvl_vision.errors import PreprocessError
from tests.helpers import QWEN3_SMALL_72, REPO, rel_err, synthetic_photo, write_video
from tests.helpers import make_image_folder as make_folder


def manifest(out: Path) -> list[dict]:
    return read_manifest_lines(out / "manifest.jsonl")


def test_gather_inputs_folders_lists_and_files(tmp_path):
    paths = make_folder(tmp_path / "imgs", 4)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{paths[0]}\n# a comment\n\nimgs/img001.png\n")
    got = gather_inputs([str(tmp_path / "imgs"), str(listing), str(tmp_path / "missing.jpg")]).paths
    assert str(tmp_path / "imgs" / "readme.md") not in got
    assert str(tmp_path / "imgs" / "corrupt.jpg") in got
    assert got[-1] == str(tmp_path / "missing.jpg")
    assert len(got) == len(set(got)) == 4 + 3 + 1  # the listed files were already found in the folder


def test_embed_folder_with_good_and_bad_files(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 6)
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out),
                 "--batch-tokens", "64"])
    assert code == 1  # some inputs failed
    records = manifest(out)
    by_name = {Path(r["path"]).name: r for r in records}
    assert len(records) == 9
    for bad in ("corrupt.jpg", "empty.png", "notes.png"):
        assert by_name[bad]["status"] == "error" and bad in by_name[bad]["error"]
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) == 6
    # The stored tensors equal encode_images on the same files.
    encoder = load_encoder(checkpoint, device="cpu")
    expected = encoder.encode_images([r["path"] for r in ok])
    for r, emb, grid in zip(ok, expected.embeddings, expected.grid_thw.tolist()):
        assert r["grid_thw"] == grid and r["tokens"] == emb.shape[0]
        with safe_open(out / r["shard"], framework="pt") as f:
            assert torch.allclose(f.get_tensor(r["key"]), emb, rtol=1e-5, atol=1e-6)
    got = dict(read_embeddings(out))
    assert set(got) == {r["path"] for r in ok}


def test_embed_pooled_only_and_deepstack(tmp_path, checkpoint3):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "out"
    assert main(["embed", *map(str, paths), "--model", str(checkpoint3), "--out", str(out), "--pooled-only",
                 "--max-pixels", str(64 * 64)]) == 0
    vectors = dict(read_embeddings(out))
    assert all(v.shape == (QWEN3_SMALL_72.out_hidden_size,) for v in vectors.values())
    out2 = tmp_path / "out2"
    assert main(["embed", *map(str, paths), "--model", str(checkpoint3), "--out", str(out2),
                 "--max-pixels", str(64 * 64)]) == 0
    for path, (emb, levels) in read_embeddings(out2, deepstack=True):
        assert len(levels) == 2 and all(level.shape == emb.shape for level in levels)
        assert torch.allclose(vectors[path], emb.mean(0), rtol=1e-5, atol=1e-6)


def test_iter_encode_reports_every_input_as_it_is_prepared(tmp_path, checkpoint):
    """Per image, in input order, before the one batch they form is encoded: what embed's progress counts."""
    paths = make_folder(tmp_path / "imgs", 5, bad=False)
    inputs = [*map(str, paths[:3]), str(tmp_path / "missing.jpg"), *map(str, paths[3:])]
    reported: list[tuple[int, int]] = []
    seen_before_batch = []
    with load_encoder(checkpoint, device="cpu") as encoder:
        for batch in encoder.iter_encode(inputs, on_prepared=lambda index, tokens: reported.append((index, tokens))):
            seen_before_batch.append(len(reported))
            results = batch
    assert seen_before_batch == [6]  # a single batch, reported input by input before it ran
    assert [index for index, _ in reported] == list(range(6))
    assert [tokens for _, tokens in reported] == [0 if r.error else r.embedding.shape[0] for r in results]
    assert reported[3][1] == 0 and results[3].error


def _bad_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """One file per kind of bad image: kind -> (path, what its message must say)."""
    folder.mkdir()
    jpeg = folder / "good.jpg"
    Image.fromarray(synthetic_photo(60, 80, 3)).save(jpeg)
    kinds = {
        "missing": (folder / "missing.jpg", "file not found"),
        "empty": (folder / "empty.jpg", "file is empty (0 bytes)"),
        "not an image": (folder / "notes.png", "not a recognised image file (corrupt, or not an image)"),
        "corrupt header": (folder / "header.jpg", "corrupt or truncated image data (OSError: "),
        "truncated data": (folder / "cut.jpg", "corrupt or truncated image data (OSError: "),
        "too many pixels": (folder / "big.png", "400x300 = 120,000 pixels is above the input limit of 100,000"),
        "aspect ratio": (folder / "strip.png", "aspect ratio 250.0 (height 4, width 1000) exceeds 200"),
    }
    kinds["empty"][0].write_bytes(b"")
    kinds["not an image"][0].write_text("just text, wrongly named\n" * 10)
    kinds["corrupt header"][0].write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 3)  # fails in open
    kinds["truncated data"][0].write_bytes(jpeg.read_bytes()[:jpeg.stat().st_size // 2])  # header fine
    Image.new("RGB", (400, 300)).save(kinds["too many pixels"][0])
    Image.new("RGB", (1000, 4)).save(kinds["aspect ratio"][0])
    return kinds


def test_one_message_per_kind_of_bad_image_from_the_api_and_from_embed(tmp_path, checkpoint):
    """Each kind of bad file gets one message naming the file, the same from encode_images (its check before any
    compute, or decoding) as in embed's manifest (decoding only)."""
    kinds = _bad_files(tmp_path / "bad")
    good = str(tmp_path / "bad" / "good.jpg")
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{path}\n" for path, _ in kinds.values()) + good + "\n")
    out = tmp_path / "out"
    assert main(["embed", str(listing), "--model", str(checkpoint), "--out", str(out), "--max-input-pixels",
                 "100000", "--quiet"]) == 1
    recorded = {r["path"]: r for r in manifest(out)}
    assert recorded[good]["status"] == "ok"
    with load_encoder(checkpoint, device="cpu") as encoder:
        for kind, (path, says) in kinds.items():
            with pytest.raises(PreprocessError) as api:
                encoder.encode_images([good, str(path)], max_input_pixels=100_000)
            message = str(api.value)
            assert message.startswith(f"image {str(path)!r}: {says}"), (kind, message)
            assert recorded[str(path)]["error"] == message, kind

    # Not a file at all: the API's own kind (embed only takes paths), by position.
    with load_encoder(checkpoint, device="cpu") as encoder, pytest.raises(PreprocessError) as api:
        encoder.encode_images([good, 12345])
    assert str(api.value) == ("image 1: unsupported input type int; expected a path, PIL image, uint8 numpy array or "
                              "uint8 torch tensor")


def test_resume_duplicates_nothing(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 5)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-tokens", "64"]
    main(args)
    first = manifest(out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert main(args) == 2  # refusing to mix two runs without --resume
    (tmp_path / "imgs" / "corrupt.jpg").unlink()
    # fixed between runs: retried on resume
    Image.fromarray(synthetic_photo(33, 47, 99)).save(tmp_path / "imgs" / "corrupt.jpg")
    assert main([*args, "--resume"]) == 1  # empty.png and notes.png still fail
    records = manifest(out)
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == len(first)
    ok_first = {r["path"]: (r["shard"], r["key"]) for r in first if r["status"] == "ok"}
    ok_now = {r["path"]: (r["shard"], r["key"]) for r in records if r["status"] == "ok"}
    assert {p: ok_now[p] for p in ok_first} == ok_first  # nothing recomputed
    assert len(ok_now) == len(ok_first) + 1
    assert set(shards) < {p.name for p in out.glob("*.safetensors")}


def _embed_cmd(inputs, model, out, *extra):
    return [sys.executable, "-m", "qwenvl_vision.cli", "embed", *map(str, inputs), "--model", str(model),
            "--out", str(out), *extra]


def _kill_then_resume(inputs: Path, model: Path, out: Path, killed_once) -> int:
    """Run embed (one input a batch) in a child, SIGKILL it once ``killed_once(manifest records)`` holds, then
    resume it to the end; returns how many records the killed run had left."""
    cmd = _embed_cmd([inputs], model, out, "--batch-tokens", "1", "--device", "cpu")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if killed_once(read_manifest_lines(out / "manifest.jsonl")):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_manifest_lines(out / "manifest.jsonl"))
    resumed = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return killed_at


def test_sigkill_mid_run_then_resume(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 60, bad=False)
    out = tmp_path / "out"
    killed_at = _kill_then_resume(tmp_path / "imgs", checkpoint, out, lambda records: len(records) >= 5)
    assert 5 <= killed_at < 60
    records = manifest(out)
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == 60
    assert all(r["status"] == "ok" for r in records)
    referenced = {r["shard"] for r in records}
    assert referenced == {p.name for p in out.glob("*.safetensors")}  # no orphan shard left behind
    assert not list(out.glob("*.tmp"))
    assert len(dict(read_embeddings(out))) == 60  # every shard readable


def test_two_ranks_under_torchrun_merge_one_manifest(tmp_path, checkpoint):
    paths = make_folder(tmp_path / "imgs", 7)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "qwenvl_vision.cli", "embed", str(tmp_path / "imgs"), "--model", str(checkpoint),
           "--out", str(out), "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    # The bad files fail, yet the finished job exits 0 on every rank: any other exit code makes torchrun
    # report a crash (ChildFailedError) and kill the other ranks. The summary line says what failed.
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("embedded")]
    assert summary == [f"embedded {len(paths)} of {len(paths) + 3} inputs into {out} (3 failed; see "
                       f"{out / 'manifest.jsonl'})"]
    records = manifest(out)
    assert len(records) == len(paths) + 3
    assert len({r["path"] for r in records}) == len(records)  # split statically, never duplicated
    assert {r["rank"] for r in records} == {0, 1}
    assert not list(out.glob("manifest.rank*.jsonl"))
    assert {p.name.split("-")[1] for p in out.glob("shard-*.safetensors")} == {"r0", "r1"}
    assert len(dict(read_embeddings(out))) == len(paths)
    run_id = read_run(out)["run_id"]  # every rank tags its shards with the one run id in run.json
    for shard in out.glob("shard-*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            assert f.metadata()["qwenvl_vision_run"] == run_id, shard.name


def test_embed_offline_random_preset(tmp_path):
    paths = make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(paths[0]), "--model", "qwen3-vl-2b", "--random-weights", "--out", str(out),
                 "--max-pixels", str(64 * 64), "--pooled-only"]) == 0
    (record,) = manifest(out)
    assert record["status"] == "ok" and record["grid_thw"][0] == 1
    assert json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["tokens"] == record["tokens"]


def test_embed_compiled_matches_eager(tmp_path, checkpoint3):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        assert main(["embed", *map(str, paths), "--model", str(checkpoint3), "--out", str(out),
                     "--max-pixels", str(64 * 64), *extra]) == 0
        runs[name] = dict(read_embeddings(out))
    assert runs["compiled"].keys() == runs["eager"].keys() and len(runs["eager"]) == 3
    for path, emb in runs["eager"].items():
        assert rel_err(runs["compiled"][path], emb) <= 1e-5


# ---------------------------------------------------------------------- videos beside images


def make_media_folder(root: Path, images: int, videos: int) -> tuple[list[Path], list[Path]]:
    """Images (make_image_folder, no bad files) and small video files (mp4, avi, mkv) in one folder tree."""
    image_paths = make_folder(root, images, bad=False)
    video_paths = []
    for i in range(videos):
        path = root / ("sub" if i % 2 else ".") / f"clip{i:03d}{('.mp4', '.avi', '.mkv')[i % 3]}"
        write_video(path, 5 + 3 * i, 48 + 8 * (i % 3), 40, 4 + i % 3)  # 1..3 s at 4..6 fps: 2..6 frames sampled
        video_paths.append(path)
    return image_paths, video_paths


@pytest.mark.parametrize("model", ["checkpoint", "checkpoint3"])
def test_embed_folder_mixing_images_and_videos(tmp_path, request, model):
    """checkpoint3 (Qwen3-VL) has a video_preprocessor_config.json whose bounds differ from the image ones: each
    kind must be sized by its own (the run's --min/--max-pixels are the images')."""
    pytest.importorskip("av")
    checkpoint = request.getfixturevalue(model)
    images, videos = make_media_folder(tmp_path / "media", 3, 3)
    broken = tmp_path / "media" / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 10)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "media"), "--model", str(checkpoint), "--out", str(out),
                 "--fps", "3"]) == 1  # the broken video fails, the rest embed
    records = {Path(r["path"]).name: r for r in manifest(out)}
    assert len(records) == 3 + 3 + 1
    assert records["broken.mp4"]["status"] == "error" and "broken.mp4" in records["broken.mp4"]["error"]
    run = read_run(out)
    encoder = load_encoder(checkpoint, device="cpu")
    assert run["video"] == {**encoder.video_config.to_dict(), "fps": 3.0}
    assert (run["min_pixels"], run["max_pixels"]) == (encoder.preprocess_config.min_pixels,
                                                      encoder.preprocess_config.max_pixels)
    expected = encoder.encode_videos([str(p) for p in videos], fps=3.0)
    images_expected = encoder.encode_images([str(p) for p in images])
    stored = dict(read_embeddings(out))
    for path, emb, info in zip(videos, expected.embeddings, expected.video_info):
        record = records[path.name]
        assert record["status"] == "ok" and record["grid_thw"][0] == (len(info.frame_indices) + 1) // 2
        assert record["video"] == {"frames": info.frame_indices, "timestamps": info.timestamps,
                                   "fps": info.video_fps, "sampled_fps": info.sampled_fps,
                                   "total_frames": info.total_frames}
        assert rel_err(stored[record["path"]], emb) <= 1e-5
    for path, emb in zip(images, images_expected.embeddings):
        assert "video" not in records[path.name] and records[path.name]["grid_thw"][0] == 1
        assert rel_err(stored[records[path.name]["path"]], emb) <= 1e-5
    # Other video settings are other tensors: --resume refuses them.
    assert main(["embed", str(tmp_path / "media"), "--model", str(checkpoint), "--out", str(out),
                 "--resume", "--fps", "2"]) == 2


def test_sigkill_mid_run_with_videos_then_resume(tmp_path, checkpoint):
    pytest.importorskip("av")
    images, videos = make_media_folder(tmp_path / "media", 20, 12)
    out = tmp_path / "out"
    killed_at = _kill_then_resume(tmp_path / "media", checkpoint, out,
                                  lambda records: any("video" in r for r in records))
    assert 1 <= killed_at < 32
    records = manifest(out)
    assert len({r["path"] for r in records}) == len(records) == 32
    assert all(r["status"] == "ok" for r in records)
    assert sum("video" in r for r in records) == 12
    assert {r["shard"] for r in records} == {p.name for p in out.glob("*.safetensors")}
    assert not list(out.glob("*.tmp"))
    encoder = load_encoder(checkpoint, device="cpu")
    stored = dict(read_embeddings(out))
    expected = encoder.encode_videos([str(p) for p in videos])
    by_path = {Path(r["path"]).name: r["path"] for r in records}
    for path, emb in zip(videos, expected.embeddings):
        assert rel_err(stored[by_path[path.name]], emb) <= 1e-5


def test_a_header_without_frame_count_is_counted_once_per_video(tmp_path, checkpoint, monkeypatch):
    """Matroska writes no frame count: the decode estimate's probe counts the packets, and the read reuses it."""
    pytest.importorskip("av")
    import qwenvl_vision.video as video

    write_video(tmp_path / "clip.mkv", 20, 48, 40, 10)
    counts = []
    real = video._count_packets
    monkeypatch.setattr(video, "_count_packets", lambda *a: counts.append(1) or real(*a))
    encoder = load_encoder(checkpoint, device="cpu")
    [[result]] = list(encoder.iter_encode([str(tmp_path / "clip.mkv")], video=None))
    assert result.ok and result.video_info.total_frames == 20
    assert len(counts) == 1
