"""The CPU benchmarks that check the speed targets run (on the smallest workload): they must not rot.

Each builds a released preset's width (one block deep) and transformers' tower of it: slow.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from bench import gemm_bound, profile_tower, throughput
from qwenvl_vision import preset
from qwenvl_vision.backends.cpu.kernels import onednn_linear_available

TINY = ["--preset", "qwen3.5-0.8b", "--inputs", "small", "--depth", "1", "--dtype", "fp32"]

pytestmark = pytest.mark.slow


def test_gemm_bound_times_every_product_and_the_attention():
    result = gemm_bound.main(TINY)
    assert result["bound_s"] == pytest.approx(result["gemm_s"] + result["attention_s"])
    assert result["gemm_s"] > 0 and result["attention_s"] > 0
    # patch embedding, qkv, proj, fc1, fc2, merger fc1 and fc2: every shape timed by every kernel here
    kernels = {"mm", "onednn"} if onednn_linear_available() else {"mm"}
    assert len(result["rates_gflops_per_s"]) == 7
    assert all(set(rates) == kernels and min(rates.values()) > 0 for rates in result["rates_gflops_per_s"].values())


def test_profile_attributes_every_op_of_both_towers(capsys):
    profiles = profile_tower.main(TINY)
    assert set(profiles) == {"ours", "transformers"}
    for profile in profiles.values():  # the kernels are found by name, the rest through the module scopes
        assert profile["GEMM"] > 0 and profile["attention"] > 0 and profile["norm"] > 0
        assert profile["rope & attention glue"] > 0 and profile["activation & gate"] > 0
        assert profile["residual (block)"] > 0  # the MLP's residual add (natively: the add without a norm)
    # ours is profiled as it runs for a user, on the CPU backend: a module hook would send it to the modules
    assert profiles["ours"]["cpu_backend_blocks"] > 0 and profiles["transformers"]["cpu_backend_blocks"] == 0
    assert "rope & attention glue" in capsys.readouterr().out


def test_throughput_reports_the_fraction_of_the_bound(capsys):
    result = throughput.main([*TINY, "--repeats", "2", "--warmup", "0", "--gemm-bound"])
    rounds = result["gemm_bound"]["rounds_s"]  # the bound is measured after each round, beside its forwards
    assert len(rounds) == 2 and result["gemm_bound"]["bound_s"] == pytest.approx(sum(rounds) / 2, abs=1e-3)
    assert 0 < result["variants"]["ours"]["fraction_of_bound"]
    assert "GEMM bound" in capsys.readouterr().out


def test_a_timed_forward_runs_alone_and_its_peak_is_the_rss_high_water_mark():
    """No thread samples memory beside a timed CPU forward (one slowed a 2-core machine's forward); the peak is
    Linux's reset high-water mark, which sees a transient the block freed before it ended."""
    import mmap
    import threading

    import torch

    from bench.load import RESET_HIGH_WATER_MARK, start_rss_window

    threads = []

    def forward(model, pixel_values, grid_thw):
        threads.append(threading.active_count())
        # 64 MiB the kernel maps afresh and faults in page by page, then unmaps: a transient the resident set
        # cannot already hold (a tensor of that size may come from heap pages an earlier test left resident).
        with mmap.mmap(-1, 64 << 20) as transient:
            for page in range(0, 64 << 20, mmap.PAGESIZE):
                transient[page] = 1
            touched = sum(transient[page] for page in range(0, 64 << 20, mmap.PAGESIZE))
        return torch.tensor(touched)

    before = threading.active_count()
    call = throughput.timed(forward, None, None, None, torch.device("cpu"))
    peak = call.peak
    assert threads == [before] and call.seconds > 0 and call.out.item() == (64 << 20) // mmap.PAGESIZE
    assert call.device_seconds is None  # CUDA events only on CUDA
    if start_rss_window()[1] != RESET_HIGH_WATER_MARK:
        assert peak is None  # no resettable high-water mark here: unknown, never a wrong number
    else:
        assert peak >= 60 << 20


def test_tar_inputs_bench_compares_bitwise_equal_sides():
    """bench.tar_inputs' logic on 3 photos, one round a side: both sides timed, outputs checked equal inside."""
    from bench import tar_inputs

    result = tar_inputs.main(["--images", "3", "--rounds", "1"])
    assert set(result["median_s"]) == {"folder", "shard"} and result["shard_vs_folder"] > 0


def test_load_names_a_preset_whose_family_it_does_not_write():
    from bench import load

    with pytest.raises(SystemExit, match="qwen3.5-0.8b is a qwen3_5 tower"):
        load.main(["--preset", "qwen3.5-0.8b", "--depth", "1"])


def test_load_refuses_depth_0_before_writing_the_whole_tower(tmp_path, monkeypatch, capsys):
    from bench import load

    def no_checkpoint(*args):
        raise AssertionError("a checkpoint was about to be written for --depth 0")

    monkeypatch.setattr(load, "ensure_checkpoint", no_checkpoint)
    with pytest.raises(SystemExit) as exit_:
        load.main(["--preset", "qwen2.5-vl-3b", "--depth", "0", "--rows", "ours", "--workdir", str(tmp_path)])
    assert exit_.value.code == 2 and "--depth" in capsys.readouterr().err


def test_the_bound_s_gemm_rate_is_that_of_its_median_gemm_time():
    """With two rounds the median is their mean: the rate printed beside it is that time's, not one round's."""
    rounds = [{"bound_s": s + 1.0, "gemm_s": s, "attention_s": 1.0, "gemm_gflop": 1000.0,
               "gemm_gflops_per_s": round(1000.0 / s, 1), "rates_gflops_per_s": {}} for s in (9.0, 13.0)]
    result = {"variants": {"ours": {}}}
    throughput.add_bound(result, rounds, SimpleNamespace(times={"ours": [20.0, 20.0]}))
    assert result["gemm_bound"]["gemm_s"] == 11.0 and result["gemm_bound"]["gemm_gflops_per_s"] == 90.9


def test_load_warms_every_dtype_ours_times_before_timing_it(monkeypatch, tmp_path):
    """Ours measures its CPU plan once per dtype and machine: a dtype not warmed up timed that measurement."""
    import torch

    from bench import load

    def child(spec, timeout):
        ran.append((spec["row"], spec["dtype"]))
        if spec["probe"]:
            torch.save(torch.zeros(1), spec["probe"])
        return {"seconds": 0.0, "peak_delta": 0}

    ran: list = []
    monkeypatch.setattr(load, "run_child", child)
    rows = [("transformers", "fp32"), ("ours", "fp32"), ("transformers", "bf16"), ("ours", "bf16")]
    load.measure(rows, tmp_path, preset("qwen2.5-vl-3b"),
                 SimpleNamespace(warmup=1, repeats=1, workdir=tmp_path, device="cpu", timeout=1))
    assert ran[:2] == [("ours", "fp32"), ("ours", "bf16")] and ran[2:] == rows


@pytest.mark.parametrize(("option", "value"), [("--preset", "bogus"), ("--repeats", "0"), ("--depth", "0"),
                                               ("--dtype", "int8")])
def test_a_bad_workload_option_is_an_argparse_error_naming_it(option, value, capsys):
    """No traceback, and never a silent stand-in (``--depth 0`` once timed the whole tower)."""
    for bench in (throughput, gemm_bound) if option != "--repeats" else (throughput,):
        with pytest.raises(SystemExit) as exit_:
            bench.main([*TINY, option, value])
        assert exit_.value.code == 2 and option in capsys.readouterr().err


def test_the_gemm_bound_on_cuda_times_the_kernels_not_their_launch():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: a CUDA call returns before its kernel ends only there")
    n = 8192
    seconds, _ = gemm_bound.gemm_seconds(Counter({(n, n, n): 1}), torch.bfloat16, torch.device("cuda"))
    assert seconds > 2 * n**3 / 5e15  # no GPU runs a dense bf16 product at 5 PFLOP/s; its launch takes microseconds


@pytest.mark.parametrize(("bench", "option"), [("throughput", "--threads"), ("profile_tower", "--threads"),
                                               ("load", "--repeats"), ("serve", "--clients"), ("serve", "--images"),
                                               ("serve", "--requests"), ("tar_inputs", "--rounds"),
                                               ("ray_overhead", "--rounds")])
def test_a_count_below_one_is_an_argparse_error_naming_it(bench, option, capsys):
    """Not a traceback from deep inside the run (a division by zero, an empty median), or after the whole run."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"bench.{bench}").main([option, "0"])
    assert exit_.value.code == 2 and f"{option} must be at least 1" in capsys.readouterr().err
