"""`embed` never mixes two runs. One writer per --out, resume only the same run, every failure one line.

One test per bullet of the issue's "Why" list (two processes on one --out; resume with other settings; the
tracebacks; bad pixel settings; close() under load; decode memory; duplicates and hand edits), plus the
fault tests: a full disk and a read-only folder stop the run with exit code 3 and --resume finishes it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import qwenvl_vision.embed as embed
from qwenvl_vision import EncoderClosedError, load_encoder
from qwenvl_vision.cli import main
from qwenvl_vision.embed import ManifestError, read_embeddings, read_manifest_lines, read_run
from qwenvl_vision.version import package_version
from tests.helpers import REPO, synthetic_photo
from tests.helpers import make_image_folder as make_folder

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
# An embed process whose manifest appends take `delay` seconds more (a slow disk): long enough to be caught
# running by a second process without needing hundreds of images.
SLOW_EMBED = """
import sys, time
import qwenvl_vision.embed as embed
append = embed._append_lines
embed._append_lines = lambda *a: (time.sleep(float(sys.argv[1])), append(*a))[1]
from qwenvl_vision.cli import main
sys.exit(main(sys.argv[2:]))
"""


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress and loading lines ('embed: ...', which --quiet silences)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("embed: ", "embed[rank"))]


def one_error_line(stderr: str, *needles: str) -> str:
    """stderr is exactly one line, no traceback, naming every needle."""
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def records(out: Path) -> list[dict]:
    return read_manifest_lines(out / "manifest.jsonl")


def assert_each_input_once(out: Path, expected: int) -> list[dict]:
    recs = records(out)
    paths = [r["path"] for r in recs]
    assert len(paths) == len(set(paths)) == expected
    referenced = {r["shard"] for r in recs if r["status"] == "ok"}
    assert referenced == {p.name for p in out.glob("*.safetensors")}  # no orphan shard
    assert not list(out.glob("*.tmp"))
    assert len(dict(read_embeddings(out))) == sum(r["status"] == "ok" for r in recs)
    return recs


# ---------------------------------------------------------------------- two processes, one --out


def slow_embed(inputs, model, out, *extra, delay=0.1) -> list[str]:
    return [sys.executable, "-c", SLOW_EMBED, str(delay), "embed", *map(str, inputs), "--model", str(model),
            "--out", str(out), "--device", "cpu", "--batch-tokens", "1", *extra]


def wait_for_lines(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if len(read_manifest_lines(out / "manifest.jsonl")) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the first run wrote fewer than {n} lines (exit {proc.poll()})")


def test_two_processes_one_out_fresh_then_both_resume(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 40, bad=False)
    out = tmp_path / "out"
    # 0.5 s an image (20 s in all, killed long before): the second process must start (import torch, load the
    # checkpoint) and be refused while the first still runs, even on a busy 2-core machine.
    first = subprocess.Popen(slow_embed([tmp_path / "imgs"], checkpoint, out, delay=0.5), env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_lines(out, 1, first)
    second = subprocess.run(slow_embed([tmp_path / "imgs"], checkpoint, out), env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 2
    one_error_line(second.stderr, str(out), "in use", f"pid {first.pid}")
    assert first.poll() is None, "the first run ended before the second was refused: raise the delay"
    first.send_signal(signal.SIGKILL)  # killed mid-run: both next processes have work left to do
    first.wait()
    assert 1 <= len(records(out)) < 40

    resumes = [subprocess.Popen(slow_embed([tmp_path / "imgs"], checkpoint, out, "--resume", delay=0.02), env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in resumes]
    assert sorted(code for code, _ in results) in ([0, 0], [0, 2]), results
    for code, stderr in results:
        assert "Traceback" not in stderr
        if code == 2:
            one_error_line(stderr, "in use")

    recs = assert_each_input_once(out, 40)
    assert all(r["status"] == "ok" for r in recs)
    # Every stored tensor is the one of its path: each image re-encoded alone (as --batch-tokens 1 ran it),
    # single-threaded like the children, gives exactly the stored bits.
    encoder = load_encoder(checkpoint, device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for path, stored in read_embeddings(out):
            assert torch.equal(encoder.encode_images([path], max_batch_tokens=1).embeddings[0], stored), path
    finally:
        torch.set_num_threads(threads)


def test_lock_file_is_removed_and_reused_after_the_run(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    assert not (out / "embed.lock").exists()
    (out / "embed.lock").write_text("pid 1 on a host that died\n")  # left by a SIGKILLed run: not held
    assert main([*args, "--resume"]) == 0
    assert not (out / "embed.lock").exists()


# ---------------------------------------------------------------------- resume checks the settings


def test_resume_refuses_other_settings(tmp_path, checkpoint, checkpoint3, capsys):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    run = read_run(out)
    assert run["model"] == str(checkpoint) and run["dtype"] == "float32" and run["pooled"] is False
    assert (run["min_pixels"], run["max_pixels"]) == (3136, 12845056)  # the checkpoint's
    before = (out / "manifest.jsonl").read_bytes(), sorted(p.name for p in out.iterdir())

    cases = [
        (["--pooled-only"], ["pooled false (now true)"]),
        (["--dtype", "bf16"], ['dtype "float32" (now "bfloat16")']),
        (["--max-pixels", "50000"], ["max_pixels 12845056 (now 50000)"]),
        (["--resize", "torch"], ['resize "pil" (now "torch")']),
        (["--model", str(checkpoint3)], ["config_sha256", "weights_sha256", "another model"]),
    ]
    for extra, needles in cases:
        argv = ["embed", str(tmp_path / "imgs"), "--out", str(out), "--resume", *extra]
        if "--model" not in extra:
            argv += ["--model", str(checkpoint)]
        assert main(argv) == 2, extra
        one_error_line(capsys.readouterr().err, "other settings", *needles)
        assert ((out / "manifest.jsonl").read_bytes(), sorted(p.name for p in out.iterdir())) == before

    # A run file from before the resize backend was recorded meant "pil": it resumes, and "torch" is refused.
    # One from before video settings were recorded takes the first resume's, and holds later resumes to them.
    run.pop("resize")
    run.pop("video")
    (out / "run.json").write_text(json.dumps(run))
    base = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--resume"]
    assert main([*base, "--resize", "torch"]) == 2
    one_error_line(capsys.readouterr().err, 'resize "pil" (now "torch")')
    assert main([*base, "--fps", "4"]) == 0
    capsys.readouterr()
    assert read_run(out)["video"]["fps"] == 4.0 and read_run(out)["resize"] == "pil"
    assert main([*base, "--fps", "1"]) == 2
    one_error_line(capsys.readouterr().err, "video", '"fps": 4.0')

    # Same settings (and a moved model folder: the hashes decide, not the spelling): resumes.
    moved = tmp_path / "moved-ckpt"
    moved.symlink_to(checkpoint)
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(moved), "--out", str(out), "--resume",
                 "--fps", "4"]) == 0


# ---------------------------------------------------------------------- one line instead of a traceback


USAGE_ERRORS = {
    "unknown device": (["--device", "tpu9"], ["--device", "tpu9"]),
    "device with a typo": (["--device", "cdua"], ["unknown device 'cdua'"]),
    "dtype fp8": (["--dtype", "fp8"], ["unsupported dtype 'fp8'", "bf16"]),
    "batch tokens 0": (["--batch-tokens", "0"], ["--batch-tokens must be at least 1, got 0"]),
    "max pixels 0": (["--max-pixels", "0"], ["--max-pixels must be at least 1, got 0"]),
    "max pixels -1": (["--max-pixels", "-1"], ["--max-pixels must be at least 1, got -1"]),
    "max pixels not a number": (["--max-pixels", "1e6"], ["--max-pixels must be an integer"]),
    "min above max": (["--min-pixels", "50000", "--max-pixels", "40000"],
                      ["--min-pixels 50000 is above --max-pixels 40000"]),
    "max input pixels 0": (["--max-input-pixels", "0"], ["--max-input-pixels must be at least 1"]),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_errors_are_one_line_exit_2_nothing_written(case, tmp_path, checkpoint, capsys):
    extra, needles = USAGE_ERRORS[case]
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), *extra])
    assert code == 2
    one_error_line(capsys.readouterr().err, "error", *needles)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(tmp_path, checkpoint, capsys):
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path), "--model", str(checkpoint), "--out", str(out), "--device", "cuda"]) == 2
    one_error_line(capsys.readouterr().err, "--device", "CUDA is not available", "--device cpu")
    assert not out.exists()


def test_setup_errors_are_one_line_exit_2_nothing_written(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 1, bad=False)
    a_file = tmp_path / "emb.txt"
    a_file.write_text("not a folder")
    cases = [
        (["--model", str(checkpoint), "--out", str(a_file)], [str(a_file), "is a file, not a folder"]),
        (["--model", str(checkpoint), "--out", str(a_file / "sub")], ["Not a directory", str(a_file)]),
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
    assert a_file.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.txt", "imgs", "o4"]  # o1..o3 never created


def test_rerun_without_resume_is_one_line_and_touches_nothing(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(args) == 2
    one_error_line(capsys.readouterr().err, str(out), "already holds a run", "--resume")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_debug_shows_the_traceback(tmp_path, checkpoint, capsys):
    out = tmp_path / "out"
    out.write_text("a file")
    for argv in (["--debug", "embed"], ["embed", "--debug"]):
        assert main([*argv, str(tmp_path), "--model", str(checkpoint), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("qwenvl-vision embed: error:")


def test_binary_list_file_is_one_failed_input_and_the_run_goes_on(tmp_path, checkpoint, capsys):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    binary = tmp_path / "paths.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(f"{paths[0]}\ncaf\xe9.jpg\n".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text(f"# my list\n{paths[1]}\n")
    out = tmp_path / "out"
    code = main(["embed", str(binary), str(latin1), str(good), str(paths[2]), "--model", str(checkpoint),
                 "--out", str(out)])
    assert code == 1
    one_error_line(capsys.readouterr().err, "embedded 2 of 4 inputs", "2 failed")
    by_path = {r["path"]: r for r in records(out)}
    assert by_path[str(binary)]["status"] == "error"
    assert "not a text file (NUL byte" in by_path[str(binary)]["error"]
    assert "not a UTF-8 text file (byte" in by_path[str(latin1)]["error"]
    assert by_path[str(paths[1])]["status"] == by_path[str(paths[2])]["status"] == "ok"


# ---------------------------------------------------------------------- disk full, read-only: exit 3, then resume


def fail_on_call(monkeypatch, name: str, n: int, error: OSError, partial: bool = False) -> None:
    """Make embed.<name> raise `error` on its n-th call (after writing half its data when `partial`)."""
    real = getattr(embed, name)
    calls = [0]

    def faulty(*args):
        calls[0] += 1
        if calls[0] == n:
            if partial and name == "_save_shard":  # a shard that ran out of space half way
                Path(args[1]).write_bytes(b"\x00" * 100)
            elif partial:  # a manifest append torn half way
                with open(args[0], "a") as f:
                    f.write('{"path": "half a li')
            raise error
        return real(*args)

    monkeypatch.setattr(embed, name, faulty)


FAULTS = {
    "disk full writing a shard": ("_save_shard", 3, errno.ENOSPC, "No space left on device"),
    "read-only appending the manifest": ("_append_lines", 2, errno.EROFS, "Read-only file system"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_output_fault_exits_3_and_resume_finishes(fault, tmp_path, checkpoint, capsys, monkeypatch):
    name, n, code, text = FAULTS[fault]
    make_folder(tmp_path / "imgs", 12)  # 12 images and 3 bad files
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-tokens", "64"]
    with monkeypatch.context() as patch:
        fail_on_call(patch, name, n, OSError(code, os.strerror(code), str(out / "x")), partial=True)
        assert main(args) == 3
    one_error_line(capsys.readouterr().err, f"cannot write to {out}", text, "this process recorded", "--resume")
    recorded = records(out)  # every complete line is valid: nothing recorded is lost
    assert 0 < len(recorded) < 15
    assert main([*args, "--resume"]) == 1  # the 3 bad files fail again
    recs = assert_each_input_once(out, 15)
    assert {r["path"]: r for r in recs if r["status"] == "ok"}.keys() >= {r["path"] for r in recorded
                                                                          if r["status"] == "ok"}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root and mount permission needed; skipped in CI containers without them)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def remount(mount_point: Path, options: str) -> None:
    result = subprocess.run(["mount", "-o", f"remount,{options}", str(mount_point)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_real_full_disk_and_read_only_folder(small_tmpfs, tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 60, bad=False)
    out = small_tmpfs / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--batch-tokens", "64"]
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\x00" * 32 * 1024)  # leaves room for a few shards only
    assert main(args) == 3
    one_error_line(capsys.readouterr().err, "No space left on device", "--resume")
    done_when_full = len(records(out))
    assert 0 < done_when_full < 60

    remount(small_tmpfs, "ro")  # read-only from the start: not even the lock file can be made
    assert main([*args, "--resume"]) == 3
    one_error_line(capsys.readouterr().err, "Read-only file system", "--resume")

    remount(small_tmpfs, "rw")
    filler.unlink()
    remount(small_tmpfs, "size=4m")
    real_append = embed._append_lines
    calls = [0]

    def append_then_turn_read_only(path, recs):  # the folder turns read-only mid-run
        calls[0] += 1
        if calls[0] == 3:
            # A read-only bind mount over the folder: the lock's open descriptor (on the writable mount
            # underneath) would make a plain remount fail with EBUSY.
            subprocess.run(["mount", "--bind", str(out), str(out)], check=True)
            remount(out, "bind,ro")
        real_append(path, recs)

    with monkeypatch.context() as patch:
        patch.setattr(embed, "_append_lines", append_then_turn_read_only)
        assert main([*args, "--resume"]) == 3
    one_error_line(capsys.readouterr().err, "Read-only file system")
    assert len(records(out)) > done_when_full

    subprocess.run(["umount", str(out)], check=True)
    assert main([*args, "--resume"]) == 0
    recs = assert_each_input_once(out, 60)
    assert all(r["status"] == "ok" for r in recs)


# ---------------------------------------------------------------------- close() under load


@pytest.mark.parametrize("call", ["images", "videos sampled by fps"])
def test_close_while_other_threads_encode(checkpoint, call):
    encoder = load_encoder(checkpoint, device="cpu")
    images = [synthetic_photo(56 + 28 * (i % 3), 84, i) for i in range(4)]
    if call == "images":
        def encode():
            return encoder.encode_images(images, max_batch_tokens=64)
    else:  # per-call video settings (fps) must not escape close() either
        def encode():
            return encoder.encode_videos([np.stack(images[:1] * 6)], fps=2.0, video_fps=4.0, max_batch_tokens=64)
    outcomes: dict[str, int] = defaultdict(int)
    unexpected: list[BaseException] = []
    lock, one_done = threading.Lock(), threading.Event()
    started = threading.Barrier(5)

    def count(outcome: str) -> None:
        with lock:
            outcomes[outcome] += 1

    def work() -> None:
        started.wait()
        while True:
            try:
                out = encode()
            except EncoderClosedError:
                count("closed")
                return
            except BaseException as e:  # noqa: BLE001 - what the issue saw: RuntimeError about a meta tensor
                with lock:
                    unexpected.append(e)
                return
            assert all(torch.isfinite(e).all() for e in out.embeddings)
            count("ok")
            one_done.set()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    assert one_done.wait(timeout=120)  # encodes complete, and every thread keeps starting new ones
    encoder.close()
    for t in threads:
        t.join(timeout=60)
    assert not unexpected, unexpected
    assert outcomes["closed"] == 4 and outcomes["ok"] >= 1
    with pytest.raises(EncoderClosedError):
        encoder.encode_images(images)


# ---------------------------------------------------------------------- decode memory


def test_images_above_max_input_pixels_are_refused_from_the_header(tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 2, bad=False)
    Image.new("RGB", (400, 300), (10, 20, 30)).save(tmp_path / "imgs" / "big.png")
    decoded = []
    real_open = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: (decoded.append(self.size), real_open(self))[1])
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out),
                 "--max-input-pixels", "100000"])
    assert code == 1
    one_error_line(capsys.readouterr().err, "embedded 2 of 3 inputs", "1 failed")
    (big,) = [r for r in records(out) if r["status"] == "error"]
    assert big["path"].endswith("big.png")
    assert "400x300 = 120,000 pixels is above the input limit of 100,000" in big["error"]
    assert (400, 300) not in decoded  # refused before its pixels were decoded
    # The API refuses it the same way, before any compute.
    with pytest.raises(embed.QwenVLVisionError, match="above the input limit"):
        load_encoder(checkpoint, device="cpu").encode_images([big["path"]], max_input_pixels=100_000)


def test_decode_budget_bounds_what_workers_hold_at_once(tmp_path, checkpoint, monkeypatch):
    """Four workers, a budget that fits one large image: large images are never decoded together."""
    import qwenvl_vision.encoder as encoder_module

    folder = tmp_path / "imgs"
    folder.mkdir()
    paths = []
    for i in range(8):  # large (1000x800) and small (100x80) images, interleaved
        side = (1000, 800) if i % 2 == 0 else (100, 80)
        path = folder / f"img{i}.png"
        Image.fromarray(synthetic_photo(side[1], side[0], i)).save(path)
        paths.append(str(path))
    large_cost = 1000 * 800 * encoder_module.DECODE_BYTES_PER_PIXEL
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = encoder_module.preprocess_image

    def tracked(image, *args, **kwargs):
        big = Image.open(image).size == (1000, 800)
        with lock:
            in_flight[0] += big
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.05)  # a slow decode, so that overlaps would happen
            return real(image, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= big

    monkeypatch.setattr(encoder_module, "preprocess_image", tracked)
    encoder = load_encoder(checkpoint, device="cpu")
    bounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4,
                                                  decode_bytes=large_cost + 1000) for r in batch]
    assert peak[0] == 1 and all(r.ok for r in bounded)
    peak[0] = 0
    unbounded = [r for batch in encoder.iter_encode(paths, max_pixels=20_000, num_workers=4, decode_bytes=None)
                 for r in batch]
    assert peak[0] > 1  # the check can fail: without the budget, large images do overlap
    for a, b in zip(bounded, unbounded):
        assert torch.equal(a.embedding, b.embedding)


def test_decode_budget_is_released_when_the_caller_stops_early(checkpoint, tmp_path):
    paths = [str(p) for p in make_folder(tmp_path / "imgs", 12, bad=False)]
    encoder = load_encoder(checkpoint, device="cpu")
    for _ in encoder.iter_encode(paths, max_batch_tokens=1, num_workers=4, decode_bytes=1):
        break  # the workers still waiting for budget are woken and the pool shuts down
    assert len([r for b in encoder.iter_encode(paths, num_workers=4, decode_bytes=1) for r in b]) == 12


# ---------------------------------------------------------------------- duplicates and hand edits


def test_the_same_file_by_two_spellings_is_embedded_once(tmp_path, checkpoint, capsys, monkeypatch):
    paths = make_folder(tmp_path / "imgs", 3, bad=False)
    (tmp_path / "link.png").symlink_to(paths[1])
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(paths[0], tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{paths[0]}\n./{relative}\n")
    out = tmp_path / "out"
    code = main(["embed", relative, str(paths[0]), "imgs", str(listing), "link.png", "--model", str(checkpoint),
                 "--out", str(out)])
    assert code == 0
    one_error_line(capsys.readouterr().err, "embedded 3 of 3 inputs", "0 failed")
    # First spellings: the relative name, then the folder's files as the folder spells them.
    assert [r["path"] for r in records(out)] == [relative, "imgs/img001.png", "imgs/img002.jpg"]
    assert read_run(out)["cwd"] == str(tmp_path)

    # Resumed from elsewhere with other spellings: everything is already done.
    monkeypatch.chdir(REPO)
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--resume"]) == 0
    one_error_line(capsys.readouterr().err, "embedded 3 of 3 inputs")
    assert len(records(out)) == 3


def test_hand_edited_manifest_gets_a_named_error_and_resume_redoes_the_line(tmp_path, checkpoint, capsys):
    make_folder(tmp_path / "imgs", 4, bad=False)
    out = tmp_path / "out"
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]
    assert main(args) == 0
    lines = (out / "manifest.jsonl").read_text().splitlines()
    edited = json.loads(lines[1])
    del edited["shard"]
    lines[1] = json.dumps(edited)
    lines[2] = lines[2][:-5]  # a damaged middle line (not the torn tail of a killed run)
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")

    with pytest.raises(ManifestError, match=r"manifest.jsonl, line 2: damaged manifest line: status ok but no "
                                            r"'shard'"):
        list(read_embeddings(out))
    with pytest.raises(ManifestError, match=r"line 2"):
        read_manifest_lines(out / "manifest.jsonl")
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    one_error_line(capsys.readouterr().err, "embedded 4 of 4 inputs")
    recs = assert_each_input_once(out, 4)
    redone = {r["path"]: r["shard"] for r in recs}
    assert redone[edited["path"]] != json.loads(lines[0])["shard"]  # its input was embedded again


def test_a_shard_name_that_leaves_the_folder_is_refused(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    record = records(out)[0]
    record["shard"] = "../elsewhere/shard-r0-000000.safetensors"
    (out / "manifest.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ManifestError, match="line 1: .* is not a shard file name of this folder"):
        list(read_embeddings(out))


def test_torn_last_line_is_not_damage(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    with open(out / "manifest.jsonl", "a") as f:
        f.write('{"path": "half a reco')  # a run killed mid-append
    assert len(dict(read_embeddings(out))) == 2


def test_shards_follow_the_umask(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name


def test_shard_metadata_names_the_run(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 1, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out)]) == 0
    (shard,) = out.glob("*.safetensors")
    with safe_open(shard, framework="pt") as f:
        assert f.metadata()["qwenvl_vision_run"] == read_run(out)["run_id"]


def test_torchrun_job_on_a_folder_in_use_writes_nothing(tmp_path, checkpoint):
    """Rank 0 meets the lock of another run; rank 1 got its own part's lock but stops with it: nothing written."""
    import fcntl

    make_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "embed.lock", "w") as held:  # another embed run on this folder
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
             "qwenvl_vision.cli", "embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out),
             "--device", "cpu"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("qwenvl-vision embed")]
    assert ours == [f"qwenvl-vision embed [rank 0]: error: {out} is in use by another embed run "
                    f"(pid 4242 on elsewhere); wait for it to finish, or choose another --out"], result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["embed.lock"]  # rank 1's lock file is gone too


# ---------------------------------------------------------------------- issue 14, item 5: rough edges


def test_empty_input_set_is_one_line_exit_2(tmp_path, checkpoint, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "notes.md").write_text("no images here")
    (tmp_path / "empty.txt").write_text("# nothing listed\n")
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), str(tmp_path / "empty.txt"), "--model", str(checkpoint),
                 "--out", str(out)])
    assert code == 2
    one_error_line(capsys.readouterr().err, "no inputs", str(tmp_path / "imgs"), ".jpg")
    assert not out.exists()


def test_cli_names_random_weights_version_and_inspect_preset(tmp_path, capsys):
    assert main(["embed", str(tmp_path), "--model", "qwen3-vl-2b", "--out", str(tmp_path / "o")]) == 2
    one_error_line(capsys.readouterr().err, "qwen3-vl-2b is a preset", "--random-weights")
    assert main(["extract-weights", "qwen3-vl-2b"]) == 2
    one_error_line(capsys.readouterr().err, "qwen3-vl-2b is a preset", "no weights")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"qwenvl-vision {package_version()}"
    assert main(["inspect", "Qwen3-VL-2B", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The released Qwen3-VL-2B tower: 24 blocks of width 1024, out 2048, DeepStack after blocks 5, 11, 17.
    assert (report["preset"], report["family"], report["config"]["depth"], report["config"]["out_hidden_size"]) \
        == ("qwen3-vl-2b", "qwen3_vl", 24, 2048)
    assert report["config"]["deepstack_visual_indexes"] == [5, 11, 17]
    assert 350e6 < report["parameters"] < 450e6 and report["bytes_bf16"] == 2 * report["parameters"]


def test_every_option_has_help_with_its_default(capsys):
    from qwenvl_vision.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for command in ("embed", "extract-weights", "inspect"):
        sub = subparsers.choices[command]
        for action in sub._actions:
            assert action.help, f"{command} {action.option_strings or action.dest} has no help text"
    assert main(["embed", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("cpu, cuda or cuda:N", "bf16/bfloat16", "default: bf16 on CUDA, fp32 on CPU",
                   "default: the checkpoint's", "default 16384", "default 64000000"):
        assert needle in text


def test_extract_weights_refuses_a_non_empty_target_without_force(tmp_path, checkpoint, capsys):
    target = tmp_path / "vision"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert main(["extract-weights", str(checkpoint), "--out", str(target)]) == 2
    one_error_line(capsys.readouterr().err, str(target), "is not empty", "--force")
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert main(["extract-weights", str(checkpoint), "--out", str(target), "--force"]) == 0
    assert (target / "keep.txt").read_text() == "mine" and (target / "model.safetensors").is_file()


# ---------------------------------------------------------------------- issue 14, item 4: progress


def test_progress_without_a_terminal_and_quiet(tmp_path, checkpoint, capsys, monkeypatch):
    make_folder(tmp_path / "imgs", 6, bad=False)
    monkeypatch.setattr(embed, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    args = ["embed", str(tmp_path / "imgs"), "--model", str(checkpoint)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert len({r["shard"] for r in read_manifest_lines(tmp_path / "out" / "manifest.jsonl")}) == 1  # one batch
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("embed: reading 2 shards with the vision tensors (") and "onto cpu" in lines[0]
    assert lines[1].startswith("embed: loaded the qwen2_5_vl tower (float32) in ")
    assert lines[2] == "embed: 6 images to embed"
    steps = [line for line in lines if re.match(r"embed: \d+/6 images \(\d+%\), [\d.]+ img/s, \d+ tok/s, ETA ", line)]
    assert [int(line.split()[1].split("/")[0]) for line in steps] == [1, 2, 3, 4, 5, 6]  # image by image
    assert steps[-1] == lines[-2]  # the last one once everything is written, just before the summary
    assert lines[-1].startswith("embedded 6 of 6 inputs")

    assert main([*args, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"embedded 6 of 6 inputs into {tmp_path / 'quiet'} (0 failed; see {tmp_path / 'quiet' / 'manifest.jsonl'})"]


# ---------------------------------------------------------------------- found in review


def test_resume_of_a_stopped_run_from_another_directory_redoes_only_what_is_missing(
        tmp_path, checkpoint, capsys, monkeypatch):
    """Records carry the resolved file: a run stopped part-way and resumed from elsewhere, with other spellings,
    finishes each input exactly once and counts every input done."""
    (tmp_path / "a").mkdir()
    make_folder(tmp_path / "a" / "imgs", 4, bad=False)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path / "a")
    with monkeypatch.context() as patch:
        fail_on_call(patch, "_save_shard", 2, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)))
        assert main(["embed", "imgs", "--model", str(checkpoint), "--out", str(out), "--batch-tokens", "64"]) == 3
    assert 0 < len(records(out)) < 4
    (tmp_path / "b" / "c").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "b" / "c")
    capsys.readouterr()
    assert main(["embed", "../../a/imgs", "--model", str(checkpoint), "--out", str(out), "--resume"]) == 0
    one_error_line(capsys.readouterr().err, "embedded 4 of 4 inputs", "0 failed")
    assert main(["embed", "../../a/imgs", "--model", str(checkpoint), "--out", str(out), "--resume"]) == 0
    recs = assert_each_input_once(out, 4)
    assert {r["realpath"] for r in recs} == {str(p.resolve()) for p in (tmp_path / "a" / "imgs").rglob("img*")}


def test_a_fifo_among_the_inputs_is_one_failed_input_not_a_hang(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2, bad=False)
    os.mkfifo(tmp_path / "pipe.jpg")  # named on the command line: a folder scan skips what is not a file
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "qwenvl_vision.cli", "embed", str(tmp_path / "imgs"),
                             str(tmp_path / "pipe.jpg"), "--model", str(checkpoint), "--out", str(out), "--quiet"],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1, result.stderr[-2000:]
    (failed,) = [r for r in records(out) if r["status"] == "error"]
    assert failed["path"].endswith("pipe.jpg") and "not a regular file" in failed["error"]


def test_read_embeddings_of_a_multi_rank_run_stopped_before_merging_says_so(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--quiet"]) == 0
    (out / "manifest.jsonl").rename(out / "manifest.rank0.jsonl")
    with pytest.raises(ManifestError, match="not merged|before merging.*--resume"):
        list(read_embeddings(out))
