"""Random weights with real spread, created in place on the target device and dtype.

Used for benchmarks at the real size of a released tower (no files) and by the tests. The 0.02 init
of transformers hides position and window mistakes: with it every token looks alike, so we draw
matrices ~ N(0, 1/fan_in), norm weights 1 +- 0.2, biases ~ N(0, 0.1) and the position table ~ N(0, 1).
"""

from __future__ import annotations

import torch
from torch import nn


def spread_init_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter in place, deterministically in parameter-name order."""
    gen = None
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.is_meta:  # shape-only model: nothing to fill
                continue
            gen = gen or torch.Generator(device=p.device).manual_seed(seed)  # a tower's parameters share a device
            is_norm = "norm" in name or "ln_q" in name
            if is_norm and name.endswith("weight"):
                p.uniform_(0.8, 1.2, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=gen)
            elif name.startswith("pos_embed"):
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5, generator=gen)
    return model


def random_tower(config, device: torch.device | str, dtype: torch.dtype, seed: int = 0, **model_options) -> nn.Module:
    """A tower with spread random weights allocated once, directly on `device` in `dtype`."""
    from .build import build_model

    model = build_model(config, device="meta", dtype=dtype, **model_options)
    model = model.to_empty(device=device)
    return spread_init_(model, seed).eval().requires_grad_(False)
