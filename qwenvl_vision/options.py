"""One encode call's settings: ``EncodeOptions`` (frozen, checked when built), the rules across options that every
path taking them applies (``check_option_rules``: the API, the Ray Embedder, the embed command), and the defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError
from .inputs.pixels import DEFAULT_MAX_INPUT_PIXELS, check_pixel_bounds, check_resize_backend, whole_number
from .inputs.video import VideoConfig, positive_number

DEFAULT_BATCH_PATCHES = 16384  # patches per forward: a few photos at a time
DEFAULT_DECODE_BYTES = 1 << 30
# Seconds one input may take to decode and resize (from its admission by the decode budget) before it is
# recorded as failed: far above a 4K photo (~1 s) or a few minutes of 1080p video, but it ends a stall.
DEFAULT_DECODE_TIMEOUT = 600.0


@dataclass(frozen=True, kw_only=True)
class EncodeOptions:
    """One encode call's settings, each as ``VisionEncoder.iter_encode`` takes it (``num_workers`` None: up to 4
    decoding threads, one per core; 0: one), refused (ConfigError) when built if out of range."""

    video_config: VideoConfig
    video: bool | None = False
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_input_pixels: int | None = DEFAULT_MAX_INPUT_PIXELS
    resize: str | None = None
    pooled: bool = False
    normalize: bool = False
    max_batch_patches: int = DEFAULT_BATCH_PATCHES
    num_workers: int | None = None
    prefetch: int = 8
    decode_bytes: int | None = DEFAULT_DECODE_BYTES
    hash_pixels: bool = False
    decode_timeout: float | None = DEFAULT_DECODE_TIMEOUT
    max_item_tokens: int | None = None

    def __post_init__(self) -> None:
        for option, least in (("min_pixels", 1), ("max_pixels", 1), ("max_batch_patches", 1), ("max_input_pixels", 1),
                              ("decode_bytes", 1), ("prefetch", 0), ("max_item_tokens", 1), ("num_workers", 0)):
            value = getattr(self, option)
            if value is not None or option == "max_batch_patches":  # None: the default or no bound
                object.__setattr__(self, option, whole_number(value, option, least))
        check_option_rules(min_pixels=self.min_pixels, max_pixels=self.max_pixels, pooled=self.pooled,
                           normalize=self.normalize)
        if self.resize is not None:
            check_resize_backend(self.resize, "resize")
        if self.decode_timeout is not None and not positive_number(self.decode_timeout):
            raise ConfigError(f"decode_timeout must be a positive number of seconds (or None: no limit), "
                              f"got {self.decode_timeout!r}")
        if not isinstance(self.video_config, VideoConfig):
            raise ConfigError(f"video_config must be a VideoConfig (dataclasses.replace(encoder.video_config, ...)), "
                              f"got {type(self.video_config).__name__}")

    @property
    def workers(self) -> int:
        return max(1, self.num_workers if self.num_workers is not None else min(4, os.cpu_count() or 1))


# The options as the API's refusals spell them (the embed command passes its flags instead).
API_NAMES = {"min_pixels": "min_pixels", "max_pixels": "max_pixels", "pooled": "pooled=True",
             "normalize": "normalize=True"}


def check_option_rules(*, min_pixels: int | None = None, max_pixels: int | None = None, pooled: bool = False,
                       normalize: bool = False, names: dict[str, str] = API_NAMES) -> None:
    """The rules across encode options, for every path that takes them (EncodeOptions, encode_patches, the Ray
    Embedder, the embed command); ``names``: the options as the caller spells them."""
    check_pixel_bounds(min_pixels, max_pixels, (names["min_pixels"], names["max_pixels"]))
    if normalize and not pooled:
        raise ConfigError(f"{names['normalize']} makes the pooled vectors unit length; the tokens a language model "
                          f"reads are never normalized: pass {names['pooled']} too")
