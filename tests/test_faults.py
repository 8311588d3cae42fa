"""The fault-injection tier: ``qwenvl-vision embed`` in child processes with faults at its seams (a forward that
fails at batch k, out of memory, a full disk at some byte, SIGKILL at random instants in each output format, a
damaged manifest), then ``--resume``; every input must end up recorded exactly once with the very tensor a
clean run stores. The forward's faults are injected by tests/helpers/fault_driver.py; the disk and the kills are
real."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenvl_vision import ConfigError, NumericalError, load_encoder
from qwenvl_vision.backends.cpu.kernels import onednn_packs
from qwenvl_vision.backends.cpu.packing import plan_needs
from qwenvl_vision.backends.cpu.plan import CpuPlan
from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings, read_manifest_lines
from tests.helpers import ENV, QWEN2_5_SMALL, make_image_folder, write_checkpoint
from tests.helpers.embed import embed_cmd, one_error_line, parquet_rows

IMAGES = 8


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fault-images")
    make_image_folder(folder, IMAGES, bad=False)
    return folder


@pytest.fixture(scope="module")
def clean_out(images, checkpoint, tmp_path_factory) -> Path:
    """A run without faults (one input a batch, as the faulty runs)."""
    out = tmp_path_factory.mktemp("fault-clean") / "out"
    done = run(embed_cmd([images], checkpoint, out, "--batch-patches", "1", "--device", "cpu"))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def clean(clean_out) -> dict[str, torch.Tensor]:
    """What a run without faults stores, by file name."""
    return stored(clean_out)


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def with_fault(spec: dict, cmd: list[str]) -> list[str]:
    """``cmd`` (an ``embed_cmd``) run by the fault driver with ``spec`` injected."""
    assert cmd[1:3] == ["-m", "qwenvl_vision.cli"]
    return [sys.executable, "-m", "tests.helpers.fault_driver", json.dumps(spec), *cmd[3:]]


def stored(out: Path) -> dict[str, torch.Tensor]:
    """Every stored embedding of a run, by file name; an input stored twice fails here."""
    result: dict[str, torch.Tensor] = {}
    for path, tensor in read_embeddings(out):
        name = Path(path).name
        assert name not in result, f"{name} is stored twice"
        result[name] = tensor
    return result


def statuses(out: Path) -> dict[str, list[str]]:
    """Each input's recorded statuses (a list: exactly-once means one each), from the manifest or Parquet rows."""
    rows = parquet_rows(out) if list(out.glob("shard-r*.parquet")) else read_manifest_lines(out / "manifest.jsonl")
    found: dict[str, list[str]] = {}
    for r in rows:
        found.setdefault(Path(r["path"]).name, []).append(r["status"])
    return found


def assert_exactly_once(out: Path, clean: dict[str, torch.Tensor]) -> None:
    """Every input recorded once, ok, with the clean run's very tensor; no temporary file left."""
    assert {name: ["ok"] for name in clean} == statuses(out)
    got = stored(out)
    assert got.keys() == clean.keys()
    for name, tensor in clean.items():
        assert torch.equal(got[name], tensor), name
    assert not [p for p in out.rglob("*.tmp")]


def test_a_device_that_fails_from_batch_k_on_stops_with_exit_4_naming_the_batch_then_resume_finishes(
        tmp_path, images, checkpoint, clean):
    out = tmp_path / "out"
    cmd = embed_cmd([images], checkpoint, out, "--batch-patches", "1", "--device", "cpu")
    failed = run(with_fault({"fail_from": 3}, cmd))
    assert failed.returncode == 4, failed.stderr
    line = one_error_line(failed.stderr, "the forward of a batch of 1 input", "RuntimeError",
                          "injected: a kernel failed", "recorded 3 inputs", "--resume")
    assert line.startswith("qwenvl-vision embed: error: ")
    assert [s for v in statuses(out).values() for s in v] == ["ok"] * 3  # the three before it, kept
    resumed = run([*cmd, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(out, clean)


@pytest.mark.parametrize(("fault", "bad", "words"), [
    # One batch holds every input; the machine cannot hold more than one at a time: retried item by item.
    ({"oom_above_items": 1}, None, ()),
    ({"oom_item": "img003"}, "img003.png", ("out of memory encoding it alone", "--max-pixels")),
    # The forward fails on a batch holding img004, and on img004 alone, while a probe of the device works: the
    # input's doing (a resume would otherwise meet it, and stop, every time).
    ({"bad_item": "img004"}, "img004.jpg", ("its forward fails alone while the device works: RuntimeError: "
                                            "injected: no kernel for this shape",)),
])
def test_a_forward_that_fails_for_its_inputs_fails_only_the_input_that_fails_alone_and_the_run_goes_on(
        tmp_path, images, checkpoint, clean, fault, bad, words):
    out = tmp_path / "out"
    done = run(with_fault(fault, embed_cmd([images], checkpoint, out, "--device", "cpu")))
    assert done.returncode == (0 if bad is None else 1), done.stderr
    assert statuses(out) == {name: ["error" if name == bad else "ok"] for name in clean}
    error = next((r["error"] for r in read_manifest_lines(out / "manifest.jsonl") if r["status"] == "error"), "")
    assert all(word in error for word in words), error
    got = stored(out)  # an item's bits do not depend on its pack
    assert got.keys() == clean.keys() - {bad} and all(torch.equal(got[name], clean[name]) for name in got)
    assert not list(out.rglob("*.tmp"))


def test_an_error_the_package_did_not_expect_is_one_line_exit_5(tmp_path, images, checkpoint):
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "import sys; from qwenvl_vision import encoder; from qwenvl_vision.cli import main; "
           "encoder.VisionEncoder._forward_batch = lambda *a: {}['no such key']; sys.exit(main(sys.argv[1:]))",
           *embed_cmd([images], checkpoint, out, "--device", "cpu")[3:]]
    done = run(cmd)
    assert done.returncode == 5, done.stderr
    one_error_line(done.stderr, "internal error, KeyError", "--debug")
    debug = run([*cmd, "--resume", "--debug"])
    assert debug.returncode == 5 and "Traceback" in debug.stderr


def written(out: Path) -> int:
    """How many records a run has made durable so far: manifest lines, or Parquet shards (one per batch here)."""
    manifest = out / "manifest.jsonl"
    if manifest.exists():
        return manifest.read_bytes().count(b"\n")
    return len(list(out.glob("shard-r*.parquet")))


@pytest.mark.parametrize("file_format", ["safetensors", "parquet", "vllm-cache"])
def test_sigkill_at_random_instants_then_resume_records_each_input_once(
        tmp_path, images, checkpoint, clean, file_format):
    """Each run is killed at a random instant after a random number of records (so on any machine's speed it is
    killed mid-run), then resumed; the last resume finishes."""
    out = tmp_path / "out"
    cmd = embed_cmd([images], checkpoint, out, "--batch-patches", "1", "--device", "cpu", "--format", file_format)
    rng = random.Random(f"{file_format}-kills")
    kills = 0
    for _ in range(2):
        target = min(written(out) + rng.randint(1, 3), IMAGES - 1) if out.exists() else rng.randint(1, 3)
        proc = subprocess.Popen([*cmd, "--resume"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and not (out.exists() and written(out) >= target):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))  # anywhere in the work on the next record
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait()
    resumed = run([*cmd, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert kills >= 1, "no run was killed: the runs finished before any instant was reached"
    assert_exactly_once(out, clean)


@pytest.mark.parametrize("damage", ["truncated", "torn last line", "garbage line"])
def test_a_damaged_manifest_then_resume_records_each_input_once(tmp_path, images, checkpoint, clean, damage):
    out = tmp_path / "out"
    cmd = embed_cmd([images], checkpoint, out, "--batch-patches", "1", "--device", "cpu")
    assert run(cmd).returncode == 0
    manifest = out / "manifest.jsonl"
    text = manifest.read_bytes()
    lines = text.splitlines(keepends=True)
    if damage == "truncated":
        manifest.write_bytes(text[: len(text) // 3])
    elif damage == "torn last line":
        manifest.write_bytes(b"".join(lines[:-1]) + lines[-1][:10])
    else:
        manifest.write_bytes(b"".join(lines[:2]) + b"\x00garbage{\n" + b"".join(lines[2:]))
    resumed = run([*cmd, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(out, clean)


@pytest.fixture
def small_disk(tmp_path):
    """A real file system (a 4 MiB tmpfs) and ``fill(free)``, which leaves only ``free`` bytes of it free, and
    ``make_room()``, which frees them again."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a full disk cannot be made here")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {made.stderr.decode().strip()}")
    filler = mount / "filler"

    def fill(free: int) -> None:
        stats = os.statvfs(mount)
        filler.write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - free))

    try:
        yield mount, fill, lambda: filler.unlink()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_stops_with_exit_3_and_resume_finishes_once_there_is_room(
        small_disk, images, checkpoint, clean, clean_out):
    mount, fill, make_room = small_disk
    out = mount / "out"
    cmd = embed_cmd([images], checkpoint, out, "--batch-patches", "1", "--device", "cpu")
    files = [p for p in clean_out.rglob("*") if p.is_file()]
    fill(sum(-(-p.stat().st_size // 4096) * 4096 for p in files) // 2)  # room for about half the run (pages)
    full = run(cmd)
    assert full.returncode == 3, full.stderr
    one_error_line(full.stderr, "No space left on device", "--resume")
    done_before = [s for v in statuses(out).values() for s in v]
    assert 0 < len(done_before) < IMAGES, done_before  # the disk filled up mid-run
    make_room()
    resumed = run([*cmd, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(out, clean)


def test_a_prune_frees_a_full_disk_and_accounts_for_what_it_removed(small_disk, capsys):
    """When a prune is most needed: the disk so full that its list of removed items cannot grow, but for a few bytes
    a line cut short would take (taken back: the list's lines stay whole)."""
    from qwenvl_vision.inputs.item_ids import IDENTITY_FIELDS
    from qwenvl_vision.outputs.cache_prune import PRUNED
    from qwenvl_vision.outputs.vllm_cache import CACHE_FILE, claim_cache_folder, write_item

    mount, fill, make_room = small_disk
    page = os.statvfs(mount).f_bsize
    out = mount / "cache"
    claim_cache_folder(out, dict.fromkeys(IDENTITY_FIELDS, "x"), "t")
    names = [f"item{i}" for i in range(4)]
    for i, name in enumerate(names):
        write_item(out, name, torch.zeros(64, 256), "t")
        os.utime(out / name / CACHE_FILE, (1e9 + i, 1e9 + i))  # the first the oldest

    def pad(room: int) -> None:
        """A line that leaves the list's last page ``room`` bytes: a line more needs them, or a page more."""
        listed = (out / PRUNED).stat().st_size if (out / PRUNED).exists() else 0
        with open(out / PRUNED, "a") as f:
            f.write(json.dumps({"id": "padding", "pad": "x" * (-(listed + 29 + room) % page)}) + "\n")

    pad(40)
    fill(0)
    size = (out / names[0] / CACHE_FILE).stat().st_size
    assert main(["cache", "prune", str(out), "--max-gb", str(size * 2.5 / 1e9)]) == 0, capsys.readouterr().err
    assert "removed 2 item(s)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("item")) == names[2:]
    assert [json.loads(line)["id"] for line in (out / PRUNED).read_text().splitlines()] == ["padding", *names[:2]]

    # Files held open (vLLM loading one, a reader's map) free nothing as they go: one goes unlisted, named.
    make_room()
    pad(0)
    held = [open(out / name / CACHE_FILE, "rb") for name in names[2:]]  # closed below
    try:
        fill(0)
        assert main(["cache", "prune", str(out), "--max-gb", "0"]) == 3
        one_error_line(capsys.readouterr().err, "disk is full", f"item {names[2]}", "gone unlisted")
        assert [name for name in names[2:] if (out / name / CACHE_FILE).exists()] == names[3:]
    finally:
        for f in held:
            f.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_outputs_that_are_not_finite_are_never_stored_as_ok_in_any_dtype(tmp_path, images, dtype, capsys):
    """A checkpoint whose finite weights overflow the forward (the merger's last weight near float32's largest):
    the API raises NumericalError, and embed records every input as failed with that one line (exit 1) instead of
    storing inf/nan embeddings as ok."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, QWEN2_5_SMALL, sharded=False)
    tensors = load_file(folder / "model.safetensors")
    weight = next(name for name in tensors if name.endswith("merger.mlp.2.weight"))
    tensors[weight] = torch.full_like(tensors[weight], 3e38)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    with load_encoder(str(folder), device="cpu", dtype=torch_dtype) as encoder:
        with pytest.raises(NumericalError, match=f"inf/nan in {str(torch_dtype).removeprefix('torch.')}"):
            encoder.encode_images(sorted(images.rglob("*.jpg"))[:2])
    out = tmp_path / "out"
    assert main(["embed", str(images), "--model", str(folder), "--out", str(out), "--dtype", dtype,
                 "--device", "cpu", "--quiet"]) == 1
    records = read_manifest_lines(out / "manifest.jsonl")
    assert len(records) == IMAGES and all(r["status"] == "error" for r in records)
    assert all("the tower's outputs contain inf/nan" in r["error"] for r in records)
    assert list(read_embeddings(out)) == []


@pytest.mark.parametrize("name", ["manifest.jsonl", "run.json"])
def test_a_link_at_the_run_s_own_file_names_is_refused_before_anything_is_written(tmp_path, images, checkpoint,
                                                                                    capsys, name):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "someone-else's.txt"
    (out / name).symlink_to(target)  # dangling: exists() is False, so only a link check sees it
    assert main(["embed", str(images), "--model", str(checkpoint), "--out", str(out), "--device", "cpu",
                 "--quiet"]) == 3
    one_error_line(capsys.readouterr().err, name, "symbolic link")
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).is_symlink() and not target.exists()


def test_a_recorded_cpu_plan_this_cpu_cannot_run_is_one_line(checkpoint):
    """A run's plan recorded on a CPU whose oneDNN packs bf16 linears, resumed on one whose oneDNN cannot (an AVX2
    CPU): a ConfigError saying what to do, not oneDNN's RuntimeError."""
    if onednn_packs(torch.bfloat16):
        pytest.skip("this CPU's oneDNN packs bf16 linears: a plan it cannot run cannot be made here")
    with load_encoder(str(checkpoint), device="cpu", dtype=torch.bfloat16, cpu_kernels="reference") as encoder:
        needs = plan_needs(encoder.model)
    recorded = CpuPlan("avx512-machine", dict.fromkeys(needs.keys("linear"), "onednn"))
    with pytest.raises(ConfigError, match=r"CPU plan of avx512-machine runs \d+x\d+ bfloat16 linears on oneDNN, "
                                          r"which this CPU cannot run .*cpu_kernels='auto'"):
        load_encoder(str(checkpoint), device="cpu", dtype=torch.bfloat16, cpu_kernels=recorded)
