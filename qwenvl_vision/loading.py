"""Loading: ``load_encoder(source)`` -> a ``VisionEncoder``, its tower read from a checkpoint (or random weights)
(compiled if asked) and on the CPU backend where it runs on the CPU, its preprocessing settings checked against the
tower.
"""

from __future__ import annotations

import os
import warnings

import torch

from .backends.cpu.backend import check_cpu_kernels, use_cpu_kernels
from .backends.cpu.plan import CpuPlan
from .checkpoint.hub import resolve_folder
from .checkpoint.weights import load_tower, open_checkpoint
from .devices import resolve_device, resolve_dtype
from .encoder import VisionEncoder
from .errors import ConfigError
from .inputs.images import PreprocessConfig
from .inputs.video import VideoConfig
from .model import build
from .model.attention import resolve_attn_impl
from .model.cache import check_cache_bounds
from .model.config import VisionConfig, resolve_config
from .model.random_init import random_tower
from .model.tower import VisionTower


def load_encoder(
    source: str | os.PathLike | VisionConfig | dict,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    random_weights: bool = False,
    seed: int = 0,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    cache_size: int = 1024,
    cache_bytes: int | None = 1 << 30,
    preprocess_config: PreprocessConfig | dict | None = None,
    video_config: VideoConfig | dict | None = None,
    compile: bool | dict = False,
    attn_impl: str = "auto",
    check_finite: bool = True,
    cpu_kernels: str | dict | CpuPlan = "auto",
) -> VisionEncoder:
    """Load a Qwen2.5-VL / Qwen3-VL vision encoder, reading only the vision tensors.

    source: a checkpoint folder in the released layout (sharded or single file, LLM shards may be absent),
    a vision-only folder from ``qwenvl-vision extract-weights`` or transformers' ``model.visual.save_pretrained``, a
    Hugging Face repo id (only configs, index and vision shards are fetched, into the HF cache), or, with
    ``random_weights=True``, a preset name / config for benchmarks. Defaults: CUDA when available, else CPU; bf16
    on CUDA, fp32 on CPU.
    compile: True (or a dict of torch.compile options) compiles every block with a dynamic token count,
    attention kept outside the graphs (``VisionTower.compile_blocks``); the first forwards pay the compile.
    attn_impl: "auto" (flash-attn, else PyTorch's varlen kernel on CUDA in half precision; else SDPA), "sdpa",
    "flash" or "torch_varlen"; a backend that cannot run on this device and dtype is a ConfigError.
    check_finite: refuse a checkpoint holding NaN or infinite weights (a ``CheckpointError`` naming the
    tensor); False loads such a checkpoint as it is, for deliberately odd ones.
    preprocess_config / video_config: override the checkpoint's ``preprocessor_config.json`` /
    ``video_preprocessor_config.json`` (a settings object, or a dict in the file's format).
    cpu_kernels: how the CPU runs inference (docs/api.md, CPU kernels): "auto", this machine's plan, measured once
    and cached; "reference", the modules' own ops; or a recorded plan (``encoder.cpu_plan``, a run's ``run.json``),
    the same kernels on any machine. Ignored off the CPU and with ``compile``.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolve_attn_impl(attn_impl, device, dtype)  # refuse an impossible backend before any download or read
    cpu_kernels = check_cpu_kernels(cpu_kernels)  # a bad setting is refused before any download or read
    check_cache_bounds(cache_size, cache_bytes)
    options = dict(cache_size=cache_size, cache_bytes=cache_bytes, attn_impl=attn_impl)
    if random_weights:
        config, checkpoint = resolve_config(source), None
    elif isinstance(source, (VisionConfig, dict)):
        raise ConfigError("a config alone has no weights: pass random_weights=True, or a checkpoint folder/repo id")
    else:
        checkpoint = open_checkpoint(resolve_folder(os.fspath(source), revision, local_files_only, cache_dir, token))
        config = checkpoint.config
    # The processor files are checked before the weights are read.
    pre_json = None if checkpoint is None else checkpoint.preprocessor_json()
    video_json = None if checkpoint is None else checkpoint.video_preprocessor_json()
    pre = _preprocess_config(preprocess_config, pre_json, config)
    video = video_config if isinstance(video_config, VideoConfig) else \
        VideoConfig.from_dict(video_config if video_config is not None else video_json, config.family, pre)
    if dtype == torch.float16:  # warned before the weights are read; stacklevel: the line that called load_encoder
        warnings.warn(f"float16 can overflow in the {config.family.label} tower; bfloat16 or float32 are safe. "
                      "Outputs will be checked for non-finite values.", stacklevel=2)
    model = random_tower(config, device, dtype, seed=seed, **options) if checkpoint is None else \
        load_tower(checkpoint, device, dtype, check_finite=check_finite, **options)
    if compile:
        model.compile_blocks(**(compile if isinstance(compile, dict) else {}))
    # On the CPU the CPU backend, prepared now (compiled blocks run the modules' own forward).
    model = use_cpu_kernels(model, cpu_kernels)
    return VisionEncoder(model, pre, video_config=video,
                         source=config.name or config.model_type if checkpoint is None else os.fspath(source))


def build_model(config: VisionConfig | dict | str | os.PathLike, *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, cache_size: int = 1024, cache_bytes: int | None = 1 << 30,
                attn_impl: str = "auto", cpu_kernels: str | dict | CpuPlan = "auto") -> VisionTower:
    """``model.build.build_model``'s uninitialised tower, on the CPU (or meta) its inference calls on the CPU backend
    (``cpu_kernels`` as ``load_encoder`` takes it; the plan is resolved at the first CPU inference call)."""
    model = build.build_model(config, device=device, dtype=dtype, cache_size=cache_size, cache_bytes=cache_bytes,
                              attn_impl=attn_impl)
    return use_cpu_kernels(model, cpu_kernels, now=False)


def from_transformers(visual_module: torch.nn.Module, *, attn_impl: str = "auto", cache_size: int = 1024,
                      cache_bytes: int | None = 1 << 30, cpu_kernels: str | dict | CpuPlan = "auto") -> VisionTower:
    """``model.build.from_transformers``'s tower (transformers' weights copied), on the CPU its inference calls on the
    CPU backend (``cpu_kernels`` as ``load_encoder`` takes it; the plan is resolved at the first CPU inference call)."""
    model = build.from_transformers(visual_module, attn_impl=attn_impl, cache_size=cache_size,
                                    cache_bytes=cache_bytes)
    return use_cpu_kernels(model, cpu_kernels, now=False)


def _preprocess_config(given: PreprocessConfig | dict | None, from_checkpoint: dict | None,
                       config: VisionConfig) -> PreprocessConfig:
    """The preprocessing settings, refused when their patch grid is not the tower's (the pixel rows would not
    match what the tower was trained on, yet still have a plausible shape)."""
    pre = given if isinstance(given, PreprocessConfig) else \
        PreprocessConfig.from_dict(given if given is not None else from_checkpoint, config.family)
    pairs = (("patch_size", pre.patch_size, config.patch_size), ("merge_size", pre.merge_size,
             config.spatial_merge_size), ("temporal_patch_size", pre.temporal_patch_size, config.temporal_patch_size))
    for name, ours, tower in pairs:
        if ours != tower:
            raise ConfigError(f"the preprocessor config's {name} is {ours} but the vision tower's is {tower}")
    return pre
