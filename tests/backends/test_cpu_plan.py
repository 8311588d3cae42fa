"""The machine's CPU plan (qwenvl_vision.backends.cpu.machine, cpu.probes, cpu.plan): measured once per machine
and reused by later processes (the same bits), safe against corrupt, truncated, foreign and invalid files, an
unwritable folder and two processes tuning at once; a plan that cannot run refused; and a run's plan applied on any
machine."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from qwenvl_vision import ConfigError, load_encoder
from qwenvl_vision.backends.cpu import machine, probes
from qwenvl_vision.backends.cpu import plan as plan_module
from qwenvl_vision.backends.cpu.kernels import DEFAULT_CHUNK_BYTES, onednn_linear_available
from qwenvl_vision.backends.cpu.machine import machine_identity, machine_key, machine_plan
from qwenvl_vision.backends.cpu.plan import DEFAULT_MLP_ROWS, PROBE_LENGTHS, CpuPlan, PlanNeeds, plan_key
from qwenvl_vision.backends.cpu.probes import CHUNK_CHOICES, LINEAR_PROBE_ROWS, MLP_PROBE_LAYERS, MLP_ROW_CHOICES
from tests.helpers import QWEN2_5_SMALL, grids_for, inputs, skip_unless_onednn_runs

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear")
NEEDS = PlanNeeds(frozenset({(64, 96, torch.float32), (96, 64, torch.bfloat16)}),
                  frozenset({(torch.float32, 2, 16)}))


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A cache folder of this test's own, no process memo, and a count of every measurement made."""
    monkeypatch.setenv("QWENVL_VISION_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "PLANS", {})
    calls = []
    real = machine.measure
    monkeypatch.setattr(machine, "measure",
                        lambda needs, key, *rest: calls.append(needs) or real(needs, key, *rest))
    return tmp_path / "cpu-plans", calls


def plan_file(folder):
    [path] = folder.glob("*.json")
    return path


def forget(monkeypatch):
    """As a new process would start: no memo (the file stays)."""
    monkeypatch.setattr(machine, "PLANS", {})


def test_a_plan_is_measured_once_per_machine_and_read_back_by_a_later_process(fresh, monkeypatch):
    folder, calls = fresh
    first = machine_plan(NEEDS)
    assert len(calls) == 1 and set(first.linear) == {"64x96:float32", "96x64:bfloat16"}
    assert set(first.attention) == {plan_key("attention", torch.float32, 2, 16, n) for n in PROBE_LENGTHS}
    stored = json.loads(plan_file(folder).read_text())
    assert stored["identity"] == machine_identity() and plan_file(folder).stem == machine_key(machine_identity())
    forget(monkeypatch)
    assert machine_plan(NEEDS) == first and len(calls) == 1  # read, not measured
    more = PlanNeeds(frozenset({(64, 96, torch.float32), (128, 64, torch.float32)}))
    forget(monkeypatch)
    grown = machine_plan(more)
    assert len(calls) == 2 and calls[1].linear == {(128, 64, torch.float32)}  # only what the file lacked
    assert grown.linear["64x96:float32"] == first.linear["64x96:float32"]


def test_a_plan_of_older_probes_is_not_reused(fresh, monkeypatch):
    """Probes that choose differently (a new revision) measure the machine afresh, beside the older file."""
    folder, calls = fresh
    first = machine_plan(NEEDS)
    forget(monkeypatch)
    monkeypatch.setattr(machine, "PROBE_REVISION", machine.PROBE_REVISION + 1)
    assert machine_plan(NEEDS).linear.keys() == first.linear.keys() and len(calls) == 2
    assert len(list(folder.glob("*.json"))) == 2


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "machine": "x"', json.dumps([1, 2]),
                                     "FOREIGN", "INVALID", "NO-IDENTITY"],
                         ids=["corrupt", "truncated", "not-an-object", "foreign", "invalid-entry", "no-identity"])
def test_a_bad_plan_file_is_one_warning_and_a_fresh_measurement(fresh, monkeypatch, content):
    folder, calls = fresh
    good = machine_plan(NEEDS)
    path = plan_file(folder)
    stored = json.loads(path.read_text())
    if content == "FOREIGN":
        content = json.dumps({**stored, "identity": {**stored["identity"], "cpu": "another CPU"}})
    elif content == "INVALID":
        content = json.dumps({**stored, "linear": {**stored["linear"], "64x96:float32": "mkl"}})
    elif content == "NO-IDENTITY":
        content = json.dumps({k: v for k, v in stored.items() if k != "identity"})
    path.write_text(content)
    forget(monkeypatch)
    again, [message] = caught_plan(NEEDS)
    assert "measuring this machine again" in message and str(path) in message and "\n" not in message
    assert len(calls) == 2 and set(again.linear) == set(good.linear)
    assert CpuPlan.from_dict({k: v for k, v in json.loads(path.read_text()).items() if k != "identity"}) == again


TUNER = """
import json, sys
import torch
from qwenvl_vision.backends.cpu import machine as plan
real = plan.measure
def counted(needs, key, *rest):
    print("measured", flush=True)
    return real(needs, key, *rest)
plan.measure = counted
needs = plan.PlanNeeds(frozenset({(512, 768, torch.float32), (768, 512, torch.float32)}),
                       frozenset({(torch.float32, 4, 64)}))
print(json.dumps(plan.machine_plan(needs).to_dict()), flush=True)
"""


def test_two_processes_tuning_at_once_measure_once_and_agree(tmp_path):
    env = {**__import__("os").environ, "QWENVL_VISION_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", TUNER], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0].splitlines() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(line == "measured" for out in outputs for line in out) == 1
    assert json.loads(outputs[0][-1]) == json.loads(outputs[1][-1])


def test_two_processes_give_the_same_bits_on_the_machine_plan(tmp_path):
    """A later process on this machine reads the plan this one runs: the same kernels, so the same bits."""
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", dtype="bfloat16")
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
    here = torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings)
    script = f"""
import json
import torch
from qwenvl_vision import load_encoder
from tests.helpers import QWEN2_5_SMALL, grids_for, inputs
torch.set_num_threads({torch.get_num_threads()})
encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", dtype="bfloat16")
pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
print(json.dumps(encoder.cpu_plan.to_dict()))
torch.save(torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings), "{{out}}")
"""
    out = tmp_path / "there.pt"
    done = subprocess.run([sys.executable, "-c", script.replace("{out}", str(out))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == encoder.cpu_plan.to_dict()
    assert torch.equal(torch.load(out), here)


def test_a_plan_round_trips_as_a_dict_and_gives_its_entries_or_the_defaults():
    block = ("gated", "rms", 64, 2, 96, "silu", torch.bfloat16)
    other = ("gated", "rms", 64, 4, 96, "silu", torch.bfloat16)
    plan = CpuPlan("abc", {"64x96:float32": "addmm"}, {plan_key("attention", torch.bfloat16, 2, 16, 512): "gemm"},
                   linear_chunk={"gated:rms:64x2:96:silu:bfloat16": 1 << 20},
                   elementwise={"gated:rms:64x2:96:silu:bfloat16": "native"})
    assert CpuPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.chunk_bytes(block) == 1 << 20 and plan.elementwise_kernels(block) == "native"
    assert plan.chunk_bytes(other) == DEFAULT_CHUNK_BYTES  # no entry: the default
    assert plan.elementwise_kernels(other) == "aten"
    assert plan.attention_path(torch.bfloat16, 2, 16, 600) == "gemm"  # nearest probe: 512
    assert plan.attention_path(torch.bfloat16, 2, 16, 64) == "sdpa"  # no entry: torch's own
    assert plan.attention_path(torch.bfloat16, 2, 16, 100_000) == "sdpa"  # beyond the GEMM path's memory bound
    assert plan.linear_kernel(128, 64, torch.float32) == "addmm"


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "addmm"])
@pytest.mark.parametrize("whole_mlp_packed", [True, False])
def test_an_mlp_is_timed_whole_and_its_shapes_run_packed_where_it_ran_faster_so(
        fresh, monkeypatch, kernel, whole_mlp_packed):
    """Every MLP is measured as the backend runs it, told its lone linears' choices; where it ran faster with both
    packed (row blocks; a plain MLP's activation in the epilogue or natively), its two shapes are packed and its rows
    recorded; else its linears keep their lone choices and it has the default rows. A shape already recorded keeps
    its choice."""
    monkeypatch.setattr(probes, "measure_linear", lambda *_, **__: kernel)
    monkeypatch.setattr(probes, "onednn_packs", lambda dtype: True)  # the probes are mocked: any CPU
    timed = []
    monkeypatch.setattr(probes, "measure_mlp", lambda *a, **k: timed.append(a[:6]) or (
        (True, 256) if whole_mlp_packed or kernel == "onednn" else (False, DEFAULT_MLP_ROWS)))
    shapes = (64, 192, torch.bfloat16), (96, 64, torch.bfloat16)
    needs = PlanNeeds(frozenset(shapes), frozenset(), frozenset({("gated", 64, 96, "silu", torch.bfloat16)}))
    plan = machine_plan(needs)
    packs = (kernel == "onednn",) * 2
    assert timed == [("gated", 64, 96, "silu", torch.bfloat16, packs)]
    both = kernel == "onednn" or whole_mlp_packed
    assert plan.mlp == {"gated:64x96:silu:bfloat16": 256 if both else DEFAULT_MLP_ROWS}
    assert [plan.linear_kernel(*s) for s in shapes] == ["onednn" if both else "addmm"] * 2
    # A shape recorded before (a process ran with it) keeps its kernel. Recorded as addmm, the other keeps its own
    # too: the MLP is not timed whole, since only a mix of kernels nobody timed together could follow.
    missing = PlanNeeds(frozenset(shapes[1:]), frozenset(), needs.mlp)
    recorded = CpuPlan("m", {"64x192:bfloat16": "addmm"})
    again = probes.measure(missing, "m", recorded).with_entries(recorded)
    assert len(timed) == 1
    assert [again.linear_kernel(*s) for s in shapes] == ["addmm", kernel]
    assert again.mlp == {"gated:64x96:silu:bfloat16": DEFAULT_MLP_ROWS}
    # Recorded as oneDNN, the MLP is timed with it, and both packed (what it timed) may follow.
    recorded = CpuPlan("m", {"64x192:bfloat16": "onednn"})
    again = probes.measure(missing, "m", recorded).with_entries(recorded)
    assert timed[-1] == ("gated", 64, 96, "silu", torch.bfloat16, (True, kernel == "onednn"))
    assert [again.linear_kernel(*s) for s in shapes] == ["onednn", "onednn" if both else "addmm"]
    assert again.mlp == {"gated:64x96:silu:bfloat16": 256 if both else DEFAULT_MLP_ROWS}


@needs_onednn
@pytest.mark.parametrize(("timings", "expected"), [
    ((1.0, 0.5, 0.9, 0.8, 0.9, 0.3), (True, 1024)),  # packed ran faster: the rows of the fastest block
    ((1.0, 1.04, 0.9, 0.3, 0.9, 0.9), (True, 256)),  # bf16's tie preference keeps oneDNN within 5%
    ((1.0, 0.5, 0.9, 0.87, 0.9, 0.9), (True, DEFAULT_MLP_ROWS)),  # a near tie keeps the default rows
    ((1.0, 1.2), (False, DEFAULT_MLP_ROWS)),  # the lone choices ran faster: no rows measured
])
def test_an_mlp_is_timed_as_chosen_then_packed_then_per_block_rows(monkeypatch, timings, expected):
    """measure_mlp runs the backend's MLP (each timing a real call), lone choices first, then both packed at the
    default rows, then each of MLP_ROW_CHOICES; both linears already packed skip the first two."""
    skip_unless_onednn_runs(torch.bfloat16)  # it runs real bf16 MLPs on oneDNN
    calls, ran, seen = iter(timings), [], []
    monkeypatch.setattr(probes, "best_seconds", lambda fn, repeats: (fn(), next(calls))[1])
    real_mlp = probes.CpuExecution.mlp

    def spied_mlp(self, mlp, x, residual):  # the linears' kernels of each timed MLP, as it ran
        ran.append(tuple(m.weight.is_mkldnn for m in mlp.children() if isinstance(m, torch.nn.Linear)))
        seen.append(id(mlp))
        return real_mlp(self, mlp, x, residual)

    monkeypatch.setattr(probes.CpuExecution, "mlp", spied_mlp)
    assert probes.measure_mlp("gated", 64, 96, "silu", torch.bfloat16, (False, True)) == expected
    assert next(calls, None) is None
    # as told first, then both packed; each timing a pass through MLP_PROBE_LAYERS distinct MLPs
    assert ran == [(False, True)] * MLP_PROBE_LAYERS + [(True, True)] * MLP_PROBE_LAYERS * (len(timings) - 1)
    passes = [seen[i:i + MLP_PROBE_LAYERS] for i in range(0, len(seen), MLP_PROBE_LAYERS)]
    assert all(len(set(layers)) == MLP_PROBE_LAYERS for layers in passes)  # distinct layers, as a tower has
    calls = iter((0.9, 0.2, 0.9, 0.9))
    assert probes.measure_mlp("plain", 64, 96, "gelu_pytorch_tanh", torch.bfloat16, (True, True)) == (True, 256)
    # fp32 keeps the lone choices unless both packed ran 10% faster (oneDNN rounds differently from addmm)
    calls = iter((1.0, 0.95))
    assert probes.measure_mlp("plain", 64, 96, "gelu_pytorch_tanh", torch.float32, (False, False)) == (
        False, DEFAULT_MLP_ROWS)
    calls = iter((1.0, 0.85, 0.9, 0.9, 0.9, 0.9))
    assert probes.measure_mlp("plain", 64, 96, "gelu_pytorch_tanh", torch.float32, (False, False)) == (
        True, DEFAULT_MLP_ROWS)


def test_a_linear_s_kernel_is_timed_summed_over_an_item_s_row_counts(monkeypatch):
    """oneDNN's rate jumps between row counts: a kernel fast at one count only does not win."""
    skip_unless_onednn_runs(torch.bfloat16)  # it runs real bf16 linears on oneDNN
    counts = len(LINEAR_PROBE_ROWS)
    times = iter([1.0] * counts + [0.5] * (counts - 1) + [2.5])  # addmm at each count, then oneDNN at each
    monkeypatch.setattr(probes, "best_seconds", lambda fn, repeats: (fn(), next(times))[1])
    assert probes.measure_linear(64, 96, torch.bfloat16) == "addmm"
    assert next(times, None) is None


@pytest.mark.parametrize(("aten_s", "expected"), [(0.97, "native"), (0.9, "aten"), (1.2, "native")])
def test_a_block_s_native_steps_are_kept_unless_the_modules_ops_ran_clearly_faster(monkeypatch, aten_s, expected):
    """Near a tie (a few % in fp32, the block's GEMMs dominating) the native steps stay: one pass a step."""
    timings = iter((aten_s, 1.0))
    monkeypatch.setattr(probes, "best_seconds", lambda fn, repeats: next(timings))
    need = ("gated", "rms", 64, 2, 96, "silu", torch.float32)
    assert probes.measure_block(need, CpuPlan("test"), native=object()) == (DEFAULT_CHUNK_BYTES, expected)
    assert next(timings, None) is None  # no linear packed: no chunk timed


@pytest.mark.parametrize("kernel", ["onednn", "addmm"])
@pytest.mark.parametrize("native", [True, False])
def test_a_block_s_elementwise_steps_and_chunk_are_measured_on_the_plan_s_kernels_and_only_what_a_file_lacks(
        fresh, monkeypatch, kernel, native):
    """A tower's block shape gets its elementwise steps (the modules' ops or the native kernels, where these build)
    and its packed linears' output per call (where any runs packed; else the default), each of the search space,
    timed on a block running the plan's kernels; a stored plan that lacks them (measured for the same kernels when
    no tower of this block shape had asked) has them measured alone, its kernels kept."""
    if kernel == "onednn" and not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    if native and machine.native_kernels() is None:
        pytest.skip("no C compiler builds the native CPU kernels here (the warning says why)")
    if not native:
        monkeypatch.setattr(machine, "native_kernels", lambda: None)
    folder, calls = fresh
    block = ("plain", "layer", 64, 2, 96, "gelu_pytorch_tanh", torch.float32)
    needs = PlanNeeds(frozenset({(64, 192, torch.float32), (64, 64, torch.float32), (64, 96, torch.float32),
                                 (96, 64, torch.float32)}), frozenset({(torch.float32, 2, 32)}),
                      frozenset({("plain", 64, 96, "gelu_pytorch_tanh", torch.float32)}), frozenset({block}))
    monkeypatch.setattr(probes, "measure_linear", lambda *_, **__: kernel)
    monkeypatch.setattr(probes, "onednn_packs", lambda dtype: True)  # the probes are mocked: any CPU
    # the MLP keeps its lone choices (timed whole it might pack them, which is another test's)
    monkeypatch.setattr(probes, "measure_mlp", lambda *a, **__: (all(a[5]), DEFAULT_MLP_ROWS))
    timed, searched = [], []
    real, real_fastest = probes.measure_block, probes.fastest
    monkeypatch.setattr(probes, "measure_block",
                        lambda need, plan, *a: timed.append((need, dict(plan.linear))) or real(need, plan, *a))
    monkeypatch.setattr(probes, "fastest", lambda seconds, default: searched.append(tuple(seconds))
                        or real_fastest(seconds, default))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a probe that failed would warn and record the defaults
        full = machine_plan(needs)
    key = "plain:layer:64x2:96:gelu_pytorch_tanh:float32"
    assert timed == [(block, dict.fromkeys(full.linear, kernel))]  # timed on the kernels chosen before
    # the elementwise steps where the native kernels build, the chunk where a linear runs packed
    assert searched == [("aten", "native")] * native + [CHUNK_CHOICES] * (kernel == "onednn")
    assert set(full.linear_chunk) == set(full.elementwise) == {key}
    assert full.elementwise_kernels(block) in (("aten", "native") if native else ("aten",))
    assert full.chunk_bytes(block) in (CHUNK_CHOICES if kernel == "onednn" else (DEFAULT_CHUNK_BYTES,))
    path = plan_file(folder)
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "linear_chunk": {}, "elementwise": {}}))
    forget(monkeypatch)
    for probe in ("measure_linear", "measure_attention", "measure_mlp"):
        monkeypatch.setattr(probes, probe, lambda *_, probe=probe, **__: pytest.fail(f"{probe} ran again"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is read, not refused
        again = machine_plan(needs)
    assert calls[-1] == PlanNeeds(blocks=frozenset({block})) and len(timed) == 2
    assert (again.linear, again.attention, again.mlp) == (full.linear, full.attention, full.mlp)
    assert set(json.loads(path.read_text())["elementwise"]) == {key}


def test_a_size_other_than_the_default_must_be_clearly_faster():
    assert probes.fastest({1: 0.90, 4: 1.0, 8: 0.99}, 4) == 1
    assert probes.fastest({1: 0.97, 4: 1.0, 8: 0.99}, 4) == 4  # within the margin: the default stays
    assert probes.fastest({1: 0.97, 8: 1.0}, 4) == 1  # no default among the choices: the fastest


def test_without_onednn_a_plan_holds_torch_s_kernels_and_block_sizes_and_is_complete(fresh, monkeypatch):
    """A torch without oneDNN's linear: addmm and SDPA everywhere, no chunks to size (the default chunk); the plan
    then lacks nothing, so a later load measures nothing."""
    folder, calls = fresh
    for module in (machine, probes):  # the machine's identity and what its probes time
        monkeypatch.setattr(module, "onednn_linear_available", lambda: False)
    block = ("gated", "rms", 64, 2, 96, "silu", torch.float32)
    needs = PlanNeeds(frozenset({(64, 192, torch.float32), (96, 64, torch.float32), (64, 64, torch.float32)}),
                      frozenset({(torch.float32, 2, 32)}), frozenset({("gated", 64, 96, "silu", torch.float32)}),
                      frozenset({block}))
    plan = machine_plan(needs)
    assert set(plan.linear.values()) == {"addmm"} and set(plan.attention.values()) == {"sdpa"}
    assert plan.chunk_bytes(block) == DEFAULT_CHUNK_BYTES and set(plan.elementwise) == {plan_key("blocks", *block)}
    assert plan.missing(needs).empty()
    forget(monkeypatch)
    assert machine_plan(needs) == plan and len(calls) == 1


@needs_onednn
def test_measuring_leaves_the_caller_s_random_state_alone(fresh, monkeypatch):
    """Every probe, the MLP's included (its linears made to measure packed), draws from generators of its own."""
    monkeypatch.setattr(probes, "measure_linear", lambda *_, **__: "onednn")
    monkeypatch.setattr(probes, "onednn_packs", lambda dtype: True)  # the probes are mocked: any CPU
    timed = []
    real = probes.measure_mlp
    monkeypatch.setattr(probes, "measure_mlp", lambda *a, **k: timed.append(a) or real(*a, **k))
    blocks = []
    real_block = probes.measure_block
    monkeypatch.setattr(probes, "measure_block", lambda *a, **k: blocks.append(a) or real_block(*a, **k))
    needs = PlanNeeds(frozenset({(64, 192, torch.float32), (96, 64, torch.float32), (64, 64, torch.float32)}),
                      frozenset(), frozenset({("gated", 64, 96, "silu", torch.float32)}),
                      frozenset({("gated", "rms", 64, 2, 96, "silu", torch.float32)}))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    machine_plan(needs)
    assert timed and blocks and torch.equal(torch.rand(3), expected)


# ----------------------------------------------------------------------------- a held lock, planted links


# fp32 only: a CPU without oneDNN's bf16 linear warns about it while measuring, which is not what these count.
NEEDS32 = PlanNeeds(frozenset({(64, 96, torch.float32), (96, 64, torch.float32)}), frozenset({(torch.float32, 2, 16)}))
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def caught_plan(needs):
    """(machine_plan(needs), the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = machine_plan(needs)
    return plan, [str(w.message) for w in caught]


def test_a_plan_lock_held_by_a_stopped_process_is_waited_for_a_bounded_time_then_one_warning(fresh, monkeypatch):
    """Another process holds the lock and is stopped (SIGSTOP): the load waits PLAN_LOCK_WAIT_S, warns once naming
    the lock file, measures for itself and saves the plan whole (a later load reads it without waiting)."""
    folder, calls = fresh
    folder.mkdir(parents=True)
    lock = folder / f"{machine_key(machine_identity())}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(zip(("plan", "warnings"), caught_plan(NEEDS32))), daemon=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        os.kill(holder.pid, signal.SIGSTOP)
        monkeypatch.setattr(machine, "PLAN_LOCK_WAIT_S", 1.0, raising=False)
        start = time.monotonic()
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the load still waits for the CPU plan lock"
    finally:
        holder.kill()
        holder.wait()
        thread.join(timeout=60)
    assert time.monotonic() - start >= 1.0 and len(calls) == 1
    assert set(done["plan"].linear) == {"64x96:float32", "96x64:float32"}
    [message] = done["warnings"]
    assert str(lock) in message and "still held" in message and "\n" not in message
    forget(monkeypatch)
    again, messages = caught_plan(NEEDS32)
    assert again == done["plan"] and len(calls) == 1 and messages == []  # saved: read back, no measuring


def test_a_file_system_that_refuses_locks_still_keeps_the_plan(fresh, monkeypatch):
    """NFS without lockd or Lustre without flock refuse the lock: one warning, and the plan is still saved."""
    def refused(*_args, **_kwargs):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(machine, "file_lock", refused)
    plan, [message] = caught_plan(NEEDS32)
    assert "cannot lock" in message
    forget(monkeypatch)
    again, messages = caught_plan(NEEDS32)
    assert again == plan and messages == []  # saved: read back, no measuring


@pytest.mark.parametrize("name", ["{key}.lock", "{key}.json.{pid}.tmp", ""], ids=["lock", "tmp", "folder"])
def test_a_link_where_the_cache_writes_is_not_followed_and_the_plan_is_measured_for_the_process(fresh, tmp_path, name):
    """A link planted at the lock's or the temporary file's name, or a folder that cannot be made (a link to a file
    where it would be: permissions do not stop root): what it points to is neither created nor written, the link
    stays, one warning names it, the plan is measured for the process alone."""
    folder, calls = fresh
    if name:
        folder.mkdir(parents=True)
    link = folder / name.format(key=machine_key(machine_identity()), pid=os.getpid())
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    link.symlink_to(target)
    plan, messages = caught_plan(NEEDS32)
    assert set(plan.linear) == {"64x96:float32", "96x64:float32"} and len(calls) == 1
    assert target.read_bytes() == b"precious" and link.is_symlink() and not list(folder.glob("*.json"))
    [message] = messages
    assert str(link) in message and "for this process only" in message


def test_a_link_at_the_plan_file_is_neither_read_nor_written_through(fresh, tmp_path, monkeypatch):
    """A link at ``{key}.json`` to a valid plan file elsewhere: not read (one warning naming it); the saved plan
    replaces the link itself, never what it points to."""
    folder, calls = fresh
    good = machine_plan(NEEDS32)
    path = plan_file(folder)
    target = tmp_path / "elsewhere.json"
    target.write_bytes(path.read_bytes())
    before = target.read_bytes()
    path.unlink()
    path.symlink_to(target)
    forget(monkeypatch)
    plan, messages = caught_plan(NEEDS32)
    assert set(plan.linear) == set(good.linear) and len(calls) == 2
    [message] = messages
    assert str(path) in message and "symbolic link" in message
    assert target.read_bytes() == before and not path.is_symlink()


# ----------------------------------------------------------------------------- a plan's fields


GOOD = CpuPlan("0123456789abcdef", {"64x96:float32": "addmm"}, {"float32:2x16:512": "sdpa"},
               {"gated:64x96:silu:float32": DEFAULT_MLP_ROWS},
               {"gated:rms:64x2:96:silu:float32": DEFAULT_CHUNK_BYTES},
               {"gated:rms:64x2:96:silu:float32": "aten"})
BLOCK = "gated:rms:64x2:96:silu:float32"


@pytest.mark.parametrize(("bad", "named"), [
    ([], "format None"), ({"format": 9}, "format 9"), ({"format": 2, "linear": {}}, "format 2"),
    ({"linear": None}, "fields"), ({"mlp": {"gated:64x96:silu:float32": 512.0}}, "mlp"),
    ({"elementwise": {BLOCK: "fused"}}, "fused"), ({"linear_chunk": {BLOCK: True}}, "linear_chunk"),
    ({"linear": {"64x96:float32": "mkl"}}, "mkl"),
    ({"attention": {"bfloat16:2x16:512": "flash"}}, "flash"), ("NO-ONEDNN", "onednn"),
], ids=lambda v: str(v)[:24])
def test_a_plan_that_cannot_run_is_refused_naming_it(bad, named, monkeypatch):
    """A plan given as cpu_kernels= or recorded by a run: another format, a missing field, an unknown kernel,
    oneDNN's where this torch has none, or a size below one, is one line naming it."""
    if bad == "NO-ONEDNN":
        monkeypatch.setattr(plan_module, "onednn_linear_available", lambda: False)
        bad = {"linear": {"64x96:float32": "onednn"}}
    bad = {**GOOD.to_dict(), **bad} if isinstance(bad, dict) else bad
    with pytest.raises(ConfigError, match="CPU plan") as refused:
        CpuPlan.from_dict(bad)
    assert named in str(refused.value) and "\n" not in str(refused.value) and len(str(refused.value)) < 300
    with pytest.raises(ConfigError, match=named if isinstance(bad, dict) else "cpu_kernels"):  # the public API's
        load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", cpu_kernels=bad)


def test_the_defaults_and_a_measured_plan_round_trip(fresh):
    """Every size the probes can choose, and a plan measured here, read back as they were."""
    for rows, chunk, kernels in zip(MLP_ROW_CHOICES, CHUNK_CHOICES * 2, ("aten", "native") * 3, strict=False):
        plan = CpuPlan("m", mlp={"gated:64x96:silu:float32": rows}, linear_chunk={BLOCK: chunk},
                       elementwise={BLOCK: kernels})
        assert CpuPlan.from_dict(plan.to_dict()) == plan
    needs = PlanNeeds(NEEDS32.linear, NEEDS32.attention, frozenset({("gated", 64, 96, "silu", torch.float32)}),
                      frozenset({("gated", "rms", 64, 2, 96, "silu", torch.float32)}))
    measured = machine_plan(needs)
    assert CpuPlan.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured


def test_a_plan_saved_by_another_process_while_this_one_measured_wins(fresh, monkeypatch):
    """Without the lock (held past the wait), another process may save its plan while this one measures: the saved
    entries win, so every process on the machine runs one plan, and ours (timed beside its measuring) replace none."""
    folder, calls = fresh
    real, theirs = machine.measure, {}

    def measure_while_another_saves(needs, key, *rest):
        ours = real(needs, key, *rest)
        flipped = {k: "addmm" if v == "onednn" else "onednn" for k, v in ours.linear.items()}
        theirs["plan"] = CpuPlan(ours.machine, flipped, ours.attention, ours.mlp, ours.linear_chunk, ours.elementwise)
        machine.save_plan(folder / f"{key}.json", theirs["plan"], machine_identity())
        return ours

    monkeypatch.setattr(machine, "measure", measure_while_another_saves)
    plan = machine.machine_plan(NEEDS32)
    assert dict(plan.linear) == dict(theirs["plan"].linear) == json.loads(plan_file(folder).read_text())["linear"]
