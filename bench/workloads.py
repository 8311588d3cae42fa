"""The options that pick a tower and a pack of inputs (``qwenvl_vision.testing.workloads``), shared by the
benchmarks (throughput, gemm_bound, profile_tower)."""

from __future__ import annotations

import argparse

import torch

from qwenvl_vision.devices import resolve_dtype
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.model.config import PRESETS, VisionConfig, preset
from qwenvl_vision.testing.workloads import INPUT_SETS, build_inputs, truncated


def add_workload_arguments(parser: argparse.ArgumentParser, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> None:
    """The options that pick a tower and a pack, shared by the benchmarks (throughput, gemm_bound, profile_tower)."""
    parser.add_argument("--preset", default="qwen2.5-vl-3b", type=str.lower, choices=sorted(PRESETS))
    parser.add_argument("--inputs", default="photos", choices=sorted(INPUT_SETS))
    parser.add_argument("--dtype", default=dtypes[0], choices=dtypes)
    parser.add_argument("--depth", type=positive_option(int, "--depth"), help="truncate the tower (see truncated())")


def workload(args: argparse.Namespace, device: str | torch.device = "cpu"
             ) -> tuple[VisionConfig, torch.Tensor, torch.Tensor, int, torch.dtype]:
    """(config, pixel_values, grid_thw, items, dtype) for add_workload_arguments' options."""
    cfg = truncated(preset(args.preset), args.depth)
    pixel_values, grid_thw, items = build_inputs(args.inputs, cfg)
    return cfg, pixel_values, grid_thw, items, resolve_dtype(args.dtype, torch.device(device))
