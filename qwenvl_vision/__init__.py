"""qwenvl-vision: exact, memory-owning Qwen2.5-VL and Qwen3-VL vision encoders.

Importing the package loads the core only: the model, loading, preprocessing and the encode API. The reader of
``embed`` runs and the hand-off to language models are exported here too, but load on first use (``_LAZY``), so
that an encode never pays for the batch job, Parquet or the vLLM cache.
"""

import importlib
from typing import Any

from .encoder import VisionEncoder
from .errors import (
    CheckpointError,
    ConfigError,
    EmbedError,
    EncoderClosedError,
    ForwardFaultError,
    InputError,
    ManifestError,
    NumericalError,
    PreprocessError,
    QwenVLVisionError,
)
from .inputs.pixels import FileBytes
from .inputs.video import VideoConfig
from .inputs.video_io import VideoInfo
from .loading import build_model, from_transformers, load_encoder
from .model.cache import ShapeCache
from .model.config import PRESETS, VisionConfig, from_config_json, preset, resolve_config
from .model.qwen2_5 import Qwen2_5VisionTransformer
from .model.qwen3 import Qwen3VisionTransformer
from .model.tower import VisionTower
from .results import EncodeResult
from .version import __version__

# Exported name -> the module that defines it, imported when the name is first read.
_LAZY = {
    "read_embeddings": ".embed.reader",
    "read_encoded": ".embed.reader",
    "read_run": ".embed.reader",
    "EncodedItems": ".outputs.handoff",
    "to_transformers": ".outputs.handoff",
    "to_vllm": ".outputs.handoff",
}

__all__ = [
    "PRESETS",
    "FileBytes",
    "CheckpointError",
    "NumericalError",
    "PreprocessError",
    "QwenVLVisionError",
    "read_embeddings",
    "read_encoded",
    "read_run",
    "ConfigError",
    "EmbedError",
    "ManifestError",
    "__version__",
    "EncodeResult",
    "EncoderClosedError",
    "ForwardFaultError",
    "VisionEncoder",
    "load_encoder",
    "InputError",
    "Qwen2_5VisionTransformer",
    "Qwen3VisionTransformer",
    "ShapeCache",
    "VisionConfig",
    "VisionTower",
    "VideoConfig",
    "VideoInfo",
    "build_model",
    "from_transformers",
    "EncodedItems",
    "to_transformers",
    "to_vllm",
    "from_config_json",
    "preset",
    "resolve_config",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
