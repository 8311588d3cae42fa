"""qwenvl_vision.embed.lock: one writer per --out. A second process on a folder in use, fresh or --resume, stops at
once with one line naming the holder; the lock file goes with the run; a torchrun job meeting a held lock writes
nothing on any rank."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from qwenvl_vision import load_encoder
from qwenvl_vision.embed import read_embeddings, read_run
from qwenvl_vision.embed.lock import FolderLock, lock_name
from qwenvl_vision.errors import EmbedError
from tests.helpers import ENV
from tests.helpers import make_image_folder as make_folder
from tests.helpers.embed import assert_each_input_once, one_error_line, records, run_embed, torchrun_embed_cmd

SLOW_EMBED = """
import sys, time
import qwenvl_vision.embed.writer as writer
append = writer.append_lines
writer.append_lines = lambda *a: (time.sleep(float(sys.argv[1])), append(*a))[1]
from qwenvl_vision.cli import main
sys.exit(main(sys.argv[2:]))
"""


def slow_embed(inputs, model, out, *extra, delay=0.1) -> list[str]:
    return [sys.executable, "-c", SLOW_EMBED, str(delay), "embed", *map(str, inputs), "--model", str(model),
            "--out", str(out), "--device", "cpu", "--batch-patches", "1", *extra]


@pytest.mark.slow
def test_two_processes_one_out_fresh_then_both_resume(tmp_path, checkpoint):
    make_folder(tmp_path / "imgs", 40, bad=False)
    out = tmp_path / "out"
    # 0.5 s an image (20 s in all, killed long before): the second process must start (import torch, load the
    # checkpoint) and be refused while the first still runs, even on a busy 2-core machine.
    first = subprocess.Popen(slow_embed([tmp_path / "imgs"], checkpoint, out, delay=0.5), env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not records(out) and first.poll() is None and time.time() < deadline:  # its first line written
        time.sleep(0.01)
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

    assert all(r["status"] == "ok" for r in assert_each_input_once(out, 40))
    # Every stored tensor is the one of its path: each image re-encoded alone (as --batch-patches 1 ran it),
    # single-threaded like the children and with the run's recorded CPU plan (measured at the children's one
    # thread; in fp32 the kernels round differently), gives exactly the stored bits.
    encoder = load_encoder(checkpoint, device="cpu", cpu_kernels=read_run(out)["cpu_plan"] or "auto")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for path, stored in read_embeddings(out):
            assert torch.equal(encoder.encode_images([path], max_batch_patches=1).embeddings[0], stored), path
    finally:
        torch.set_num_threads(threads)


def test_a_held_folder_is_refused_naming_the_holder_and_the_lock_file_goes_with_the_run(tmp_path, checkpoint):
    first = FolderLock(tmp_path / lock_name(0), str(tmp_path))
    first.acquire()
    holder = re.escape(f"{tmp_path} is in use by another embed run (pid {os.getpid()} on ")
    with pytest.raises(EmbedError, match=holder):
        FolderLock(tmp_path / "embed.lock", str(tmp_path)).acquire()
    part = FolderLock(tmp_path / lock_name(1), "part 1")  # another rank's part: its own lock file
    part.acquire()
    part.release()
    first.release()
    assert not (tmp_path / "embed.lock").exists()

    make_folder(tmp_path / "imgs", 2, bad=False)
    out = tmp_path / "out"
    assert run_embed([tmp_path / "imgs"], checkpoint, out) == 0
    assert not (out / "embed.lock").exists()
    (out / "embed.lock").write_text("pid 1 on a host that died\n")  # left by a SIGKILLed run: not held
    assert run_embed([tmp_path / "imgs"], checkpoint, out, "--resume") == 0
    assert not (out / "embed.lock").exists()


@pytest.mark.slow
def test_torchrun_job_on_a_folder_in_use_writes_nothing(tmp_path, checkpoint):
    """Rank 0 meets the lock of another run; rank 1 got its own part's lock but stops with it: nothing written."""
    make_folder(tmp_path / "imgs", 3, bad=False)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "embed.lock", "w") as held:  # another embed run on this folder
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on elsewhere\n")
        held.flush()
        result = subprocess.run(torchrun_embed_cmd([tmp_path / "imgs"], checkpoint, out), env=ENV, capture_output=True,
                                text=True, timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("qwenvl-vision embed")]
    assert ours == [f"qwenvl-vision embed [rank 0]: error: {out} is in use by another embed run "
                    f"(pid 4242 on elsewhere); wait for it to finish, or choose another --out"], result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["embed.lock"]  # rank 1's lock file is gone too
