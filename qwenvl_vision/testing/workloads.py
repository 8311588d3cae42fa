"""What the benchmarks and the tests feed the towers: a small config of every family, packs of grids that
exercise each family's edge cases, random patch rows, photos (real when matplotlib's sample data is installed,
else synthetic), and the benchmarks' named packs of preprocessed photos and videos (``INPUT_SETS``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from PIL import Image

from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image
from qwenvl_vision.inputs.video import preprocess_video
from qwenvl_vision.model.config import FAMILIES, QWEN2_5, VisionConfig

# ----------------------------------------------------------------------------- small configs of every family

QWEN2_5_SMALL = VisionConfig(  # released head_dim 80, window 112 / patch 14, full attention in blocks 1 and 3
    family="qwen2_5_vl", depth=4, hidden_size=160, intermediate_size=96, num_heads=2, out_hidden_size=64,
    patch_size=14, fullatt_block_indexes=(1, 3),
)
QWEN3_SMALL_72 = VisionConfig(  # head_dim 72 (Qwen3-VL-8B and larger), real 48x48 position table
    family="qwen3_vl", depth=3, hidden_size=144, intermediate_size=96, num_heads=2, out_hidden_size=64,
    patch_size=16, deepstack_visual_indexes=(0, 1),
)
QWEN3_SMALL_64 = QWEN3_SMALL_72.replace(hidden_size=128, deepstack_visual_indexes=(1,))  # head_dim 64 (2B, 4B)

# One small tower per family, with the family's own differences (norms, MLP, windows, DeepStack, names).
FAMILY_SMALL: dict[str, VisionConfig] = {
    "qwen2_vl": VisionConfig(family="qwen2_vl", depth=3, hidden_size=160, intermediate_size=320, num_heads=2,
                             out_hidden_size=64, patch_size=14),
    "qwen2_5_vl": QWEN2_5_SMALL,
    "qwen2_5_omni": QWEN2_5_SMALL.replace(family="qwen2_5_omni"),
    "qwen3_vl": QWEN3_SMALL_72,
    "qwen3_vl_moe": QWEN3_SMALL_64.replace(family="qwen3_vl_moe"),
    "qwen3_omni_moe": QWEN3_SMALL_72.replace(family="qwen3_omni_moe"),
    "qwen3_5": QWEN3_SMALL_64.replace(family="qwen3_5", deepstack_visual_indexes=()),
    "qwen3_5_moe": QWEN3_SMALL_72.replace(family="qwen3_5_moe", deepstack_visual_indexes=()),
    "qwen4_exp": QWEN3_SMALL_64.replace(family="qwen4_exp", deepstack_visual_indexes=()),
}
assert set(FAMILY_SMALL) == set(FAMILIES), "a family without a small config would go untested"

# ----------------------------------------------------------------------------- packs of grids

# Not a multiple of the window (merged 3x5), a 2-frame video, the smallest grid, a grid whose merged
# size divides the window (the padding adds an empty window), a tall one.
QWEN2_5_GRIDS = [(1, 6, 10), (2, 8, 8), (1, 2, 2), (1, 16, 20), (1, 18, 12)]
# ... and for Qwen3 a grid larger than the 48x48 position table.
QWEN3_GRIDS = [(1, 6, 10), (2, 8, 8), (1, 2, 2), (1, 52, 50)]


def grids_for(cfg: VisionConfig) -> list[tuple[int, int, int]]:
    return QWEN2_5_GRIDS if cfg.design == QWEN2_5 else QWEN3_GRIDS


def inputs(cfg: VisionConfig, grids, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel_values rows for a pack of grids, and grid_thw."""
    grid_thw = torch.tensor(grids)
    rows = int(grid_thw.prod(1).sum())
    return torch.randn(rows, cfg.patch_dim, generator=torch.Generator().manual_seed(seed)), grid_thw


# ----------------------------------------------------------------------------- photos


def sample_photo(name: str) -> str:
    """Path of one of matplotlib's bundled sample photos (real pictures, no network)."""
    import matplotlib.cbook as cbook

    return str(cbook.get_sample_data(name, asfileobj=False))


def synthetic_photo(height: int, width: int, seed: int = 0, noise: float = 20.0) -> np.ndarray:
    """An HxWx3 uint8 picture of smooth gradients plus noise, so that resize and rounding differences show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) * 127 / max(height + width, 1)], -1)
    return np.clip(base + rng.normal(0, noise, base.shape), 0, 255).astype(np.uint8)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 picture: a real photo resized when matplotlib's sample data is there, else synthetic."""
    try:
        image = Image.open(sample_photo("grace_hopper.jpg")).convert("RGB")
        return np.asarray(image.resize((width, height), Image.BICUBIC))
    except Exception:  # noqa: BLE001 - any failure: synthesise
        return synthetic_photo(height, width, seed)


# ----------------------------------------------------------------------------- the benchmarks' packs

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
