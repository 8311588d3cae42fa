"""qwenvl_vision.embed.job: whole embed runs through the CLI. Stored tensors equal encode_images / encode_videos
on the same files, bad inputs are recorded with the API's message, two torchrun ranks merge one manifest, setup
errors are one line with nothing written."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from qwenvl_vision.cli import main
from qwenvl_vision.embed import MANIFEST, read_embeddings, read_encoded, read_manifest_lines, read_run
from qwenvl_vision.embed.inputs import file_of
from qwenvl_vision.errors import PreprocessError
from qwenvl_vision.loading import load_encoder
from tests.helpers import ENV, QWEN3_SMALL_72, rel_err, synthetic_photo
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import embed_cmd, make_media_folder, one_error_line, records, torchrun_embed_cmd


def test_embed_folder_with_good_and_bad_files(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 6)
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out),
                 "--batch-patches", "64"])
    assert code == 1  # some inputs failed
    recs = records(out)
    by_name = {Path(r["path"]).name: r for r in recs}
    assert len(recs) == 9
    for bad in ("corrupt.jpg", "empty.png", "notes.png"):
        assert by_name[bad]["status"] == "error" and bad in by_name[bad]["error"]
    ok = [r for r in recs if r["status"] == "ok"]
    assert len(ok) == 6
    # The stored tensors equal encode_images on the same files.
    encoder = load_encoder(checkpoint, device="cpu")
    expected = encoder.encode_images([r["path"] for r in ok])
    got = dict(read_embeddings(out))
    assert set(got) == {r["path"] for r in ok}
    for r, emb, grid in zip(ok, expected.embeddings, expected.grid_thw.tolist()):
        assert r["grid_thw"] == grid and r["tokens"] == emb.shape[0]
        assert torch.allclose(got[r["path"]], emb, rtol=1e-5, atol=1e-6)


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


def test_one_message_per_kind_of_bad_image_from_the_api_and_from_embed(tmp_path, checkpoint, monkeypatch):
    """Each kind of bad file gets one message naming the file, the same from encode_images (its check before any
    compute, or decoding) as in embed's manifest (decoding only); an image above --max-input-pixels is refused from
    its header, its pixels never decoded."""
    kinds = _bad_files(tmp_path / "bad")
    decoded = []
    real_load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: (decoded.append(self.size), real_load(self))[1])
    good = str(tmp_path / "bad" / "good.jpg")
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{path}\n" for path, _ in kinds.values()) + good + "\n")
    out = tmp_path / "out"
    assert main(["embed", str(listing), "--model", str(checkpoint), "--out", str(out), "--max-input-pixels",
                 "100000", "--quiet"]) == 1
    recorded = {r["path"]: r for r in records(out)}
    assert recorded[good]["status"] == "ok"
    with load_encoder(checkpoint, device="cpu") as encoder:
        for kind, (path, says) in kinds.items():
            with pytest.raises(PreprocessError) as api:
                encoder.encode_images([good, str(path)], max_input_pixels=100_000)
            message = str(api.value)
            assert message.startswith(f"image {str(path)!r}: {says}"), (kind, message)
            assert recorded[str(path)]["error"] == message, kind
    assert (400, 300) not in decoded

    # Not a file at all: the API's own kind (embed only takes paths), by position.
    with load_encoder(checkpoint, device="cpu") as encoder, pytest.raises(PreprocessError) as api:
        encoder.encode_images([good, 12345])
    assert str(api.value) == ("image 1: unsupported input type int; expected a path, PIL image, uint8 numpy array or "
                              "uint8 torch tensor")


def test_an_input_over_max_item_tokens_is_recorded_failed_and_the_others_embedded(tmp_path, checkpoint):
    paths = [tmp_path / "small.png", tmp_path / "large.png"]
    Image.fromarray(synthetic_photo(56, 56)).save(paths[0])
    Image.fromarray(synthetic_photo(224, 224)).save(paths[1])
    out = tmp_path / "out"
    assert main(["embed", *map(str, paths), "--model", str(checkpoint), "--out", str(out), "--max-item-tokens", "16",
                 "--quiet"]) == 1
    recorded = {Path(r["path"]).name: r for r in records(out)}
    assert recorded["small.png"]["status"] == "ok" and recorded["small.png"]["tokens"] <= 16
    assert recorded["large.png"]["status"] == "error" and "--max-item-tokens" in recorded["large.png"]["error"]


# Loaded at interpreter start on rank 1 only: its folder listings leave out one file, as a rank that listed the
# folder before the file arrived (or another node's stale view of it) would.
HIDE_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    _scandir, _hidden = os.scandir, os.environ["QWENVL_TEST_HIDE"]

    class _Listing:  # os.scandir's iterator, without the hidden entry
        def __init__(self, entries):
            self.entries, self.kept = entries, (entry for entry in entries if entry.name != _hidden)
        def __iter__(self):
            return self.kept
        def __next__(self):
            return next(self.kept)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.entries.close()
        def close(self):
            self.entries.close()

    os.scandir = lambda path=".": _Listing(_scandir(path))
"""


# Loaded at interpreter start: rank 1 is slow to finish its part; rank 0 says (its pid) when it has finished its own.
SLOW_RANK_1 = """
import os, time
from pathlib import Path
from qwenvl_vision.embed import job
_encode = job.EmbedJob.encode
def encode(self):
    _encode(self)
    Path(os.environ["QWENVL_TEST_PIDS"], f"rank{self.rank}.pid").write_text(str(os.getpid()))
    if self.rank == 1:
        time.sleep(600)
job.EmbedJob.encode = encode
"""


@pytest.mark.slow
def test_a_rank_waiting_for_a_slow_peer_stops_on_sigterm(tmp_path, checkpoint):
    """A rank done with its part waits at the barrier for the slowest, maybe for hours: a scheduler's SIGTERM (or
    Ctrl-C) stops it there at once, 143, what it recorded kept."""
    make_folder(tmp_path / "imgs", 2, bad=False)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_RANK_1)
    waiting = tmp_path / "rank0.pid"
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'site'}:{ENV['PYTHONPATH']}", "QWENVL_TEST_PIDS": str(tmp_path)}
    job = subprocess.Popen(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, tmp_path / "out"), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not waiting.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert waiting.exists(), job.stderr.read()[-3000:] if job.poll() is not None else "rank 0 never got there"
        time.sleep(1)  # in the reduction by now
        os.kill(int(waiting.read_text()), signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)  # torchrun ends the other rank once one exits
    finally:
        job.kill()
        for pid in tmp_path.glob("rank*.pid"):  # its ranks (each in a session of its own), whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
    assert "exitcode  : 143" in stderr, stderr[-3000:]
    assert len(read_manifest_lines(tmp_path / "out" / "manifest.rank0.jsonl")) == 1  # its part kept, for --resume


@pytest.mark.slow
def test_two_ranks_under_torchrun_merge_one_manifest_of_rank_0s_list(tmp_path, checkpoint):
    """Each rank embeds its share of rank 0's list (here rank 1 lists one file fewer, which would shift the split,
    embedding some inputs twice and others never), and rank 0 merges the parts into one manifest."""
    paths = make_folder(tmp_path / "imgs", 7)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HIDE_ON_RANK_1)
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'site'}:{ENV['PYTHONPATH']}", "QWENVL_TEST_HIDE": paths[0].name}
    out = tmp_path / "out"
    result = subprocess.run(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, out), env=env, capture_output=True,
                            text=True, timeout=300)
    # The bad files fail, yet the finished job exits 0 on every rank: any other exit code makes torchrun
    # report a crash (ChildFailedError) and kill the other ranks. The summary line says what failed.
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("embedded")]
    assert summary == [f"embedded {len(paths)} of {len(paths) + 3} inputs into {out} (3 failed; see "
                       f"{out / 'manifest.jsonl'})"]
    recs = records(out)
    assert len(recs) == len(paths) + 3
    assert len({r["path"] for r in recs}) == len(recs)  # split statically, never duplicated
    ok = sorted(file_of(r["realpath"]) for r in recs if r["status"] == "ok")
    assert ok == sorted(str(p.resolve()) for p in paths) and {r["rank"] for r in recs} == {0, 1}
    assert not list(out.glob("manifest.rank*.jsonl"))
    assert {p.name.split("-")[1] for p in out.glob("shard-*.safetensors")} == {"r0", "r1"}
    assert len(dict(read_embeddings(out))) == len(paths)
    run_id = read_run(out)["run_id"]  # every rank tags its shards with the one run id in run.json
    for shard in out.glob("shard-*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            assert f.metadata()["qwenvl_vision_run"] == run_id, shard.name


# Loaded at interpreter start: rank 1's device fails (at once, or once rank 0 waits at the barrier); rank 0's part
# takes ten minutes, or none.
FAULT_ON_RANK_1 = """
import os, time
from qwenvl_vision.embed import job
from qwenvl_vision.errors import ForwardFaultError
def encode(self):
    busy = os.environ["QWENVL_TEST_RANK_0"] == "busy"
    if self.rank == 1:
        time.sleep(0 if busy else 3)
        raise ForwardFaultError("the test's device fault")
    time.sleep(600 if busy else 0)
job.EmbedJob.encode = encode
"""


@pytest.mark.slow
@pytest.mark.parametrize("rank_0", ["busy", "waiting"])
def test_a_rank_whose_device_fails_stops_the_run_at_once_under_torchrun(tmp_path, checkpoint, rank_0):
    """Not once the other ranks have finished their parts, hours later: torchrun's agent stops them; a rank waiting
    at the barrier stops quietly (torchrun names the rank that failed)."""
    make_folder(tmp_path / "imgs", 2, bad=False)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAULT_ON_RANK_1)
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'site'}:{ENV['PYTHONPATH']}", "QWENVL_TEST_RANK_0": rank_0}
    job = subprocess.Popen(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, tmp_path / "out"), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert "exitcode  : 4" in stderr, stderr[-3000:]  # torchrun's report, after the rank's own line:
    assert [line for line in stderr.splitlines() if "error:" in line] == [
        "qwenvl-vision embed [rank 1]: error: the test's device fault; this process recorded 0 inputs before it, "
        "nothing recorded is lost: fix the cause (memory, device, drivers) and run the same command with --resume"]


def test_one_rank_under_torchrun_exits_0_and_a_failed_rendezvous_is_one_line(tmp_path, checkpoint, capsys,
                                                                              monkeypatch):
    make_folder(tmp_path / "imgs", 1)  # with bad files
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--device", "cpu"]
    with monkeypatch.context() as env:  # torchrun --nproc-per-node 1: any exit but 0 is a crash to it
        env.setenv("TORCHELASTIC_RUN_ID", "test")
        assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert "1 of 4 inputs" in capsys.readouterr().err
    with socket.socket() as taken, monkeypatch.context() as env:  # the rendezvous port is in use
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                            ("WORLD_SIZE", "2")):
            env.setenv(name, value)
        assert main([*args, "--out", str(tmp_path / "two")]) == 2
    one_error_line(capsys.readouterr().err, f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}")
    assert not (tmp_path / "two").exists()


@pytest.mark.slow
def test_ranks_whose_out_is_no_one_folder_are_refused(tmp_path, checkpoint):
    """Each rank's --out on its own node's disk: rank 0 would merge only its own part, exit 0."""
    make_folder(tmp_path / "imgs", 2, bad=False)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ranks = []
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
        ranks.append(subprocess.Popen(embed_cmd([tmp_path / "imgs"], checkpoint, "emb", "--device", "cpu"), env=env,
                                      cwd=tmp_path / f"node{rank}", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    try:
        ends = [(p.wait(timeout=120), p.stderr.read()) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [code for code, _ in ends] == [2, 2], ends
    one_error_line(ends[1][1], "--out emb is not the folder rank 0 writes into")
    assert not list(tmp_path.glob("node*/emb"))  # nothing written, on either node


_SIGTERM_CHILD = """
import sys, threading
from qwenvl_vision import batching
from qwenvl_vision.cli import main

real = batching.preprocess_image
calls = []

lock = threading.Lock()

def second_stuck(*args, **kwargs):  # the first input decodes; the others never return, as a decode stuck in C
    with lock:
        calls.append(1)
        count = len(calls)
        if count == 2:
            print("stuck", flush=True)
    if count > 1:
        threading.Event().wait()
    return real(*args, **kwargs)

batching.preprocess_image = second_stuck
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_stops_a_run_as_ctrl_c_does_with_its_own_status(tmp_path, checkpoint):
    """SIGTERM (preemption, kill) mid-run: one line, exit 143, the folder's lock released and what is recorded
    kept; --resume finishes the run."""
    import signal
    import sys

    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "out"
    argv = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--device", "cpu"]
    child = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD, *argv], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "stuck\n"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "embed: terminated (SIGTERM); what is recorded is kept" in err
    assert not (out / "embed.lock").exists()
    assert main([*argv, "--resume"]) == 0
    assert sorted(file_of(r["realpath"]) for r in records(out)) == sorted(str(p.resolve()) for p in paths)


@pytest.mark.slow
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
    records = {Path(r["path"]).name: r for r in read_manifest_lines(out / MANIFEST)}
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
                                   "total_frames": info.total_frames, "requested_fps": 3.0}
        assert rel_err(stored[record["path"]], emb) <= 1e-5
    for path, emb in zip(images, images_expected.embeddings):
        assert "video" not in records[path.name] and records[path.name]["grid_thw"][0] == 1
        assert rel_err(stored[records[path.name]["path"]], emb) <= 1e-5
    # Other video settings are other tensors: --resume refuses them.
    assert main(["embed", str(tmp_path / "media"), "--model", str(checkpoint), "--out", str(out),
                 "--resume", "--fps", "2"]) == 2


def test_setup_errors_are_one_line_exit_2_nothing_written(tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 1, bad=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # an empty --out must not write here
    a_file = tmp_path / "emb.txt"
    a_file.write_text("not a folder")
    (tmp_path / "dangling").symlink_to("nowhere")
    cases = [
        (["--model", str(checkpoint), "--out", str(a_file)], [str(a_file), "is a file, not a folder"]),
        (["--model", str(checkpoint), "--out", str(a_file / "sub")], ["--out", "Not a directory", str(a_file)]),
        (["--model", str(checkpoint), "--out", str(tmp_path / "dangling")], ["--out", "File exists", "dangling"]),
        (["--model", str(checkpoint), "--out", ""], ["--out is empty"]),
        (["--model", "qwen2.5-vl-3b", "--out", str(tmp_path / "o1")], ["preset", "--random-weights"]),
        (["--model", str(tmp_path / "no-such-ckpt"), "--out", str(tmp_path / "o2")], ["does not exist"]),
        (["--model", str(tmp_path / "imgs"), "--out", str(tmp_path / "o3")], ["config.json"]),
        (["--model", str(checkpoint), "--out", str(tmp_path / "o4" / "deeper")], []),  # fine: the control
    ]
    for extra, needles in cases:
        code = main(["embed", str(tmp_path / "imgs"), *extra])
        err = capsys.readouterr().err
        if not needles:
            assert code == 0, err
            continue
        assert code == 2, err
        one_error_line(err, *needles)
    # torchrun's RANK / WORLD_SIZE without the rest of its environment, or naming no rank of the world
    for rank, world, needles in (("0", "2", ["WORLD_SIZE=2", "MASTER_ADDR"]), ("2", "2", ["RANK='2'", "WORLD_SIZE"]),
                                 ("0", "two", ["WORLD_SIZE='two'"])):
        with monkeypatch.context() as env:
            env.delenv("MASTER_ADDR", raising=False)
            env.setenv("RANK", rank)
            env.setenv("WORLD_SIZE", world)
            code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / "o6")])
        err = capsys.readouterr().err
        assert code == 2, err
        one_error_line(err, *needles)
    assert a_file.read_text() == "not a folder" and not any((tmp_path / "cwd").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "dangling", "emb.txt", "imgs", "o4"]  # no others


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda runs here")
def test_a_missing_gpu_is_one_line_exit_2_nothing_written(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 1, bad=False)
    for device in ("cuda", "cuda:1"):
        out = tmp_path / "out" / "deeper"
        assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--device",
                     device]) == 2
        one_error_line(capsys.readouterr().err, f"device '{device}'", "CUDA is not available", "--device cpu")
        assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path, checkpoint, capsys):
    out = tmp_path / "out"
    out.write_text("a file")
    for argv in (["--debug", "embed"], ["embed", "--debug"]):
        assert main([*argv, str(tmp_path), "--model", str(checkpoint), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("qwenvl-vision embed: error:")


def machine_measures(monkeypatch, tmp_path, kernel: str) -> None:
    """This process's machine plan made to choose ``kernel`` for every linear: a fresh cache folder, no memo."""
    from qwenvl_vision.backends.cpu import machine, probes

    monkeypatch.setenv("QWENVL_VISION_CACHE", str(tmp_path / f"cache-{kernel}"))
    monkeypatch.setattr(machine, "PLANS", {})
    monkeypatch.setattr(probes, "measure_linear", lambda *_, **__: kernel)


def test_a_resume_and_every_rank_use_the_run_s_cpu_plan(tmp_path, checkpoint, monkeypatch):
    """The CPU plan is this machine's measurement, and the bits differ between kernels: run.json records the first
    run's plan, a resume (whose machine would now choose otherwise) loads with it, and a rank adopts rank 0's
    (``adopt_run``, with its thread count)."""
    from qwenvl_vision.backends.cpu.kernels import onednn_linear_available
    from qwenvl_vision.embed.job import EmbedJob
    from qwenvl_vision.encoder import VisionEncoder

    if not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--quiet",
            "--format", "parquet"]
    machine_measures(monkeypatch, tmp_path, "onednn")
    assert main(args) == 0
    plan = read_run(out)["cpu_plan"]
    assert plan and set(plan["linear"].values()) == {"onednn"}
    make_folder(tmp_path / "more", 1, bad=False)
    machine_measures(monkeypatch, tmp_path, "addmm")
    used = []
    real_load, iter_encode = load_encoder, VisionEncoder.iter_encode

    def spy(self, *a, **k):
        used.append((self.cpu_plan.to_dict(), self.describe()["linear_kernels"]["addmm"]))
        return iter_encode(self, *a, **k)

    monkeypatch.setattr(VisionEncoder, "iter_encode", spy)
    assert main([*args[:2], str(tmp_path / "more"), *args[2:], "--resume"]) == 0
    assert used == [(plan, 0)] and read_run(out)["cpu_plan"] == plan
    got = dict(read_embeddings(out))
    with real_load(checkpoint, device="cpu", cpu_kernels=plan) as encoder:
        want = encoder.encode_images(sorted(got))
    assert all(torch.equal(got[p], e) for p, e in zip(sorted(got), want.embeddings))

    threads = torch.get_num_threads()
    job = EmbedJob.__new__(EmbedJob)
    job.ray, job.run, job.fresh, job.rank = None, {"threads": 1, "cpu_plan": plan}, False, 0  # a resume: compared
    job.encoder = real_load(checkpoint, device="cpu")  # this rank's own plan: addmm everywhere
    try:
        job.adopt_run(lead="")
        assert job.encoder.cpu_plan.to_dict() == plan and torch.get_num_threads() == 1
        assert job.encoder.describe()["linear_kernels"]["addmm"] == 0
    finally:
        job.encoder.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("file_format, mtime_ns, name", [
    ("safetensors", None, None), ("parquet", None, None), ("vllm-cache", None, None),
    ("safetensors", -10**18, None),  # dated before 1970: negative
    ("safetensors", None, "a#size=1,mtime_ns=2.jpg"), ("parquet", None, "a#size=1,mtime_ns=2.jpg"),  # named as a state
])
def test_a_file_replaced_since_it_was_recorded_is_embedded_again_and_read_as_it_is_now(tmp_path, checkpoint, capsys,
                                                                                        file_format, mtime_ns, name):
    import os

    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    if name is not None:
        paths[1] = paths[1].rename(paths[1].with_name(name))
    replaced = str(paths[1])
    if mtime_ns is not None:
        os.utime(replaced, ns=(mtime_ns, mtime_ns))
    small = ["--model", str(checkpoint), "--max-pixels", str(64 * 64), "--format", file_format, "--quiet"]
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--out", str(out), *small]) == 0
    before = read_encoded(out, [replaced])
    Image.fromarray(synthetic_photo(64, 40, 99)).save(replaced)  # other contents, another grid, under the same name
    if mtime_ns is not None:
        os.utime(replaced, ns=(2 * mtime_ns, 2 * mtime_ns))
    alone = tmp_path / "alone"
    assert main(["embed", replaced, "--out", str(alone), *small]) == 0
    want = read_encoded(alone)
    assert torch.as_tensor(want.grid_thw).tolist() != torch.as_tensor(before.grid_thw).tolist()
    capsys.readouterr()
    for _ in range(2):  # the first resume embeds it again; the second has nothing to do, and keeps it
        assert main(["embed", str(tmp_path / "imgs"), "--out", str(out), "--resume", *small]) == 0
        summary = one_error_line(capsys.readouterr().err, "embedded 3 of 3 inputs")
        assert ("1 changed" in summary) == (_ == 0), summary
        got = read_encoded(out, [replaced])
        assert torch.equal(torch.as_tensor(got.grid_thw), torch.as_tensor(want.grid_thw))
        assert torch.equal(got.embeddings[0], want.embeddings[0])
        stored = list(read_embeddings(out))
        assert sorted(path for path, _ in stored) == sorted(map(str, paths))
        assert torch.equal(dict(stored)[replaced], want.embeddings[0])


def test_a_missing_file_named_as_a_url_s_version_is_retried_and_recorded_once(tmp_path, checkpoint):
    paths = make_folder(tmp_path / "imgs", 1, bad=False)
    late = tmp_path / "imgs" / "shot#etag=1.jpg"
    listed = tmp_path / "list.txt"
    listed.write_text(f"{paths[0]}\n{late}\n")
    out, small = tmp_path / "out", ["--model", str(checkpoint), "--max-pixels", str(64 * 64), "--quiet"]
    assert main(["embed", str(listed), "--out", str(out), *small]) == 1  # the missing file is a failed input
    Image.fromarray(synthetic_photo(40, 48, 1)).save(late)
    assert main(["embed", str(listed), "--out", str(out), "--resume", *small]) == 0
    assert sorted((r["path"], r["status"]) for r in records(out)) == sorted([(str(paths[0]), "ok"), (str(late), "ok")])


@pytest.mark.parametrize("file_format", ["safetensors", "parquet"])
def test_files_replaced_then_resumed_by_two_ranks_under_another_split_read_as_they_are_now(tmp_path, checkpoint,
                                                                                          file_format):
    """A resume under torchrun deals the inputs anew (one added sorts first: each file moves to the other rank), so
    a replaced file's new record is written by another rank than its old one: the old record is dropped, and each
    file reads back once, as it is now."""
    paths = make_folder(tmp_path / "imgs", 4, bad=False)
    out = tmp_path / "out"
    cmd = torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, out, "--format", file_format, "--max-pixels", "4096")
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = read_encoded(out)
    for i, path in enumerate(paths):  # other contents and sizes, under the same names
        Image.fromarray(synthetic_photo(64 - 8 * i, 40 + 8 * i, 90 + i)).save(path)
    Image.fromarray(synthetic_photo(48, 48, 7)).save(tmp_path / "imgs" / "0-added.png")
    done = subprocess.run([*cmd, "--resume"], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embedded 5 of 5 inputs" in done.stderr and "4 changed" in done.stderr, done.stderr[-3000:]
    names = [*map(str, paths)]
    want = load_encoder(checkpoint, device="cpu").encode_images(names, max_pixels=4096)
    got = read_encoded(out, names)
    assert [list(g) for g in got.grid_thw] == [list(g) for g in want.grid_thw] != [list(g) for g in before.grid_thw]
    assert sorted(path for path, _ in read_embeddings(out)) == sorted([*names, str(tmp_path / "imgs" / "0-added.png")])
