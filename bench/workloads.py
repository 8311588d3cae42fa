"""The benchmarks' named packs of preprocessed photos and videos (``INPUT_SETS``, built from
``qwenvl_vision.testing.workloads``' photos) and the options that pick a tower and a pack, shared by the benchmarks
(throughput, gemm_bound, profile_tower)."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from qwenvl_vision.devices import resolve_dtype
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image
from qwenvl_vision.inputs.video import preprocess_video
from qwenvl_vision.model.config import PRESETS, VisionConfig, preset
from qwenvl_vision.testing.workloads import photo

INPUT_SETS = {
    # 4 photos as a user embeds them: ~3.9k patches (patch 14), each resized under max_pixels 448^2.
    "photos": {"images": [(600, 512), (480, 640), (640, 480), (560, 560)], "video": None, "max_pixels": 448 * 448},
    "mixed": {"images": [(448, 448), (768, 1024), (1536, 2048)], "video": (16, 448, 448)},
    # Batches of 448 px images at patch 14 (512 px at patch 16), sized in patches: the same count per family.
    **{f"{n}x1024": {"image_patches": [(32, 32)] * n, "video": None} for n in (1, 4, 16, 64)},
    "256-patch": {"image_patches": [(16, 16)] * 64, "video": None},  # 64 thumbnails (224 px at patch 14)
    "small": {"images": [(224, 224), (336, 448)], "video": (4, 224, 224)},
}


def truncated(cfg: VisionConfig, depth: int | None) -> VisionConfig:
    """cfg cut to its first `depth` blocks for slow CPUs, keeping the per-layer mix: every 8th block full attention
    for Qwen2.5 (as released), the DeepStack indexes below the depth for Qwen3."""
    if not depth or depth >= cfg.depth:
        return cfg
    if cfg.family.windows:
        return cfg.replace(depth=depth, fullatt_block_indexes=tuple(i for i in range(depth) if (i + 1) % 8 == 0))
    return cfg.replace(depth=depth, deepstack_visual_indexes=tuple(i for i in cfg.deepstack_visual_indexes
                                                                     if i < depth))


def build_inputs(name: str, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pixel_values, grid_thw, items) of one of INPUT_SETS, through our (bit-exact) preprocessing."""
    spec = INPUT_SETS[name]
    pre = PreprocessConfig.for_family(cfg.family)
    if "max_pixels" in spec:
        pre = dataclasses.replace(pre, max_pixels=spec["max_pixels"])
    sizes = list(spec.get("images", ()))
    sizes += [(h * cfg.patch_size, w * cfg.patch_size) for h, w in spec.get("image_patches", ())]
    rows, grids = [], []
    for i, (h, w) in enumerate(sizes):
        values, grid = preprocess_image(photo(h, w, i), pre)
        rows.append(values)
        grids.append(grid)
    if spec["video"]:
        frames, h, w = spec["video"]
        clip = np.stack([np.roll(photo(h, w), 7 * f, axis=1) for f in range(frames)])
        values, grid = preprocess_video(clip, pre)
        rows.append(values)
        grids.append(grid)
    items = len(sizes) + (1 if spec["video"] else 0)
    return torch.cat(rows), torch.tensor(grids), items


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
