"""What the benchmarks and the tests feed the towers: a small config of every family, packs of grids that
exercise each family's edge cases, random patch rows, photos (real when matplotlib's sample data is installed,
else synthetic).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

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
