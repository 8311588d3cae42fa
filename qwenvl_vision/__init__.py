"""qwenvl-vision: exact, memory-owning Qwen2.5-VL and Qwen3-VL vision encoders."""

from .cache import ShapeCache
from .config import PRESETS, VisionConfig, from_config_json, preset, resolve_config
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
from .handoff import EncodedItems, to_transformers, to_vllm
from .models import build_model, from_transformers
from .qwen2_5 import Qwen2_5VisionTransformer
from .qwen3 import Qwen3VisionTransformer
from .results import EncodeResult
from .tower import VisionTower
from .version import __version__
from .video import VideoConfig
from .video_io import VideoInfo

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
