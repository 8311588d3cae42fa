"""qwenvl-vision: exact, memory-owning Qwen2.5-VL and Qwen3-VL vision encoders."""

from .embed import read_embeddings, read_encoded, read_run
from .encoder import VisionEncoder, load_encoder
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
from .inputs.video import VideoConfig
from .inputs.video_io import VideoInfo
from .model.build import build_model, from_transformers
from .model.cache import ShapeCache
from .model.config import PRESETS, VisionConfig, from_config_json, preset, resolve_config
from .model.qwen2_5 import Qwen2_5VisionTransformer
from .model.qwen3 import Qwen3VisionTransformer
from .model.tower import VisionTower
from .outputs.handoff import EncodedItems, to_transformers, to_vllm
from .results import EncodeResult
from .version import __version__

__all__ = [
    "PRESETS",
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
