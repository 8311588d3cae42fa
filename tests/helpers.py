"""The one set of helpers for tests and benchmarks: small configs of every family, transformers' reference towers,
checkpoints written in each family's released on-disk layout, relative error, inputs, photos, memory readings, and a
stand-in of the Hugging Face Hub (``FakeHub``, ``serve_hub``: loopback HTTP only).

The reference for every family is transformers 5.24's own vision tower. Its module names are the checkpoints'
tensor names, so a checkpoint written from a reference tower's state dict is in the released naming, and loading
it through ``load_encoder`` tests our name mapping (``qwenvl_vision.names``) against the reference itself.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import json
import pathlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from qwenvl_vision import build_model
from qwenvl_vision.config import FAMILIES, QWEN2_5, VisionConfig
from qwenvl_vision.init import spread_init_
from qwenvl_vision.names import to_module_state
from qwenvl_vision.teardown import live_tensor_bytes, rss_bytes  # noqa: F401 - re-exported for tests and bench

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
assert set(FAMILY_SMALL) == set(FAMILIES)
REPO = Path(__file__).resolve().parent.parent

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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius relative error of a against reference b, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def item_errors(ours: torch.Tensor, ref: torch.Tensor, grid_thw, merge_size: int = 2) -> list[float]:
    """rel_err per item of a pack of merged outputs (rows split by t*h*w / merge**2): one norm over the whole pack
    would let a large error confined to the smallest image pass."""
    counts = [int(t * h * w) // merge_size**2 for t, h, w in torch.as_tensor(grid_thw).tolist()]
    assert ours.shape == ref.shape and sum(counts) == ref.shape[0], (tuple(ours.shape), tuple(ref.shape), counts)
    return [rel_err(a, b) for a, b in zip(ours.split(counts), ref.split(counts), strict=True)]


def assert_matches_reference(ours, ref, grid_thw, tol: float, merge_size: int = 2) -> float:
    """ours and ref are (merged, [DeepStack levels]) of one pack: every item of every output within tol of the
    reference. Returns the largest error (for reports)."""
    (merged, levels), (ref_merged, ref_levels) = ours, ref
    assert len(levels) == len(ref_levels), f"{len(levels)} DeepStack levels, the reference has {len(ref_levels)}"
    worst = 0.0
    for what, a, b in [("merged", merged, ref_merged)] + [(f"deepstack {i}", a, b) for i, (a, b) in
                                                           enumerate(zip(levels, ref_levels, strict=True))]:
        errors = item_errors(a.float().cpu(), b.float().cpu(), grid_thw, merge_size)
        bad = [(i, e) for i, e in enumerate(errors) if not e <= tol]
        assert not bad, f"{what}: items over {tol:g}: " + ", ".join(f"#{i} {e:.2e}" for i, e in bad)
        worst = max(worst, *errors)
    return worst


# ----------------------------------------------------------------------------- transformers' towers

# family -> (transformers module, vision config class, vision tower class)
HF_TOWERS = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniVisionEncoderConfig", "Qwen2_5OmniVisionEncoder"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_omni_moe": ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoderConfig", "Qwen3OmniMoeVisionEncoder"),
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
    "qwen4_exp": ("qwen4_exp", "Qwen4ExpVisionConfig", "Qwen4ExpVisionModel"),
}


def hf_classes(cfg: VisionConfig) -> tuple[type, type]:
    module_name, config_name, tower_name = HF_TOWERS[cfg.family]
    config_module = importlib.import_module(f"transformers.models.{module_name}.configuration_{module_name}")
    tower_module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return getattr(config_module, config_name), getattr(tower_module, tower_name)


def hf_vision_fields(cfg: VisionConfig) -> dict:
    """Our config in the spelling of the family's transformers vision config."""
    common = dict(depth=cfg.depth, num_heads=cfg.num_heads, patch_size=cfg.patch_size, in_channels=cfg.in_channels,
                  temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
                  hidden_act=cfg.hidden_act)
    if cfg.family == "qwen2_vl":
        ratio = cfg.intermediate_size // cfg.hidden_size
        assert cfg.hidden_size * ratio == cfg.intermediate_size, "Qwen2-VL's MLP width is an integer ratio"
        return dict(common, embed_dim=cfg.hidden_size, hidden_size=cfg.out_hidden_size, mlp_ratio=ratio)
    fields = dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  out_hidden_size=cfg.out_hidden_size)
    if cfg.spec.windows:
        fields.update(window_size=cfg.window_size, fullatt_block_indexes=list(cfg.fullatt_block_indexes))
    if cfg.design != QWEN2_5:
        fields["num_position_embeddings"] = cfg.num_position_embeddings
    if cfg.spec.deepstack:
        fields["deepstack_visual_indexes"] = list(cfg.deepstack_visual_indexes)
    return fields


def hf_vision_config(cfg: VisionConfig, attn_implementation: str = "sdpa"):
    config_class, _ = hf_classes(cfg)
    hf_cfg = config_class(**hf_vision_fields(cfg))
    hf_cfg._attn_implementation = attn_implementation
    return hf_cfg


def hf_tower(cfg: VisionConfig, attn_implementation: str = "sdpa", *, device=None, dtype=None, seed: int | None = 0
             ) -> torch.nn.Module:
    """transformers' tower for cfg; weights with real spread (``seed``), or its own init with seed=None.
    ``device="meta"`` builds it without memory (load weights with ``load_state_dict(..., assign=True)``)."""
    _, tower_class = hf_classes(cfg)
    with torch.device(device or "cpu"):
        tower = tower_class._from_config(hf_vision_config(cfg, attn_implementation), dtype=dtype)
    if seed is not None and device != "meta":
        spread_init_(tower, seed)
    return tower.eval().requires_grad_(False)


def hf_forward(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(merged, deepstack levels) from transformers' tower, in the same shape as ours."""
    out = tower(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def ours_from(ref: torch.nn.Module, cfg: VisionConfig, **options) -> torch.nn.Module:
    """Our tower carrying the reference tower's weights (read under the checkpoint names the reference uses)."""
    ours = build_model(cfg, device="meta", **options)
    state = to_module_state(cfg, dict(ref.state_dict()), list(ours.state_dict()))
    ours.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True, assign=True)
    weight = ours.patch_embed.proj.weight
    ours.set_attention(ours.attn_impl, weight.device, weight.dtype)
    return ours.eval().requires_grad_(False)


def pair(cfg: VisionConfig, seed: int = 0):
    """(ours, reference) with the same spread weights."""
    ref = hf_tower(cfg, seed=seed)
    return ours_from(ref, cfg), ref


# ----------------------------------------------------------------------------- released-layout checkpoints

# The shards a full checkpoint holds besides the tower, by where they are in each family's layout.
OTHER_TENSORS = {
    "qwen2_vl": ("model.layers.{i}.mlp.up_proj.weight", "lm_head.weight"),
    "qwen2_5_vl": ("model.layers.{i}.mlp.up_proj.weight", "lm_head.weight"),
    "qwen2_5_omni": ("thinker.model.layers.{i}.mlp.up_proj.weight", "thinker.audio_tower.layers.{i}.fc1.weight",
                     "talker.model.layers.{i}.mlp.up_proj.weight", "token2wav.code2wav_dit_model.proj_out.weight"),
    "qwen3_omni_moe": ("thinker.model.layers.{i}.mlp.gate.weight", "thinker.audio_tower.layers.{i}.fc1.weight",
                       "talker.model.layers.{i}.mlp.up_proj.weight", "code2wav.decoder.{i}.conv.weight"),
}
DEFAULT_OTHER = ("model.language_model.layers.{i}.mlp.up_proj.weight", "lm_head.weight")

PREPROCESSOR_FILES = {  # preprocessor_config.json as the families' releases write them
    QWEN2_5: {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"},
    "qwen3": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "image_processor_type": "Qwen2VLImageProcessorFast"},
}


# video_preprocessor_config.json in the Qwen3-VL releases' format: pixel bounds for the whole clip that differ from
# the image ones (4096..25165824 against 65536..16777216), so that mixing them up shows.
QWEN3_VIDEO_PREPROCESSOR_FILE = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_sample_frames": True,
    "fps": 2, "min_frames": 4, "max_frames": 768, "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def released_config_json(cfg: VisionConfig) -> dict:
    """config.json as the family's releases write it: its vision spelling, nested where the family nests it."""
    vision = hf_vision_fields(cfg)
    if cfg.design == QWEN2_5:  # the patch-14 releases write in_chans and spatial_patch_size
        vision["in_chans"] = vision.pop("in_channels")
        vision["spatial_patch_size"] = vision["patch_size"]
    vision["model_type"] = cfg.family
    spec = cfg.spec
    text = {"hidden_size": cfg.out_hidden_size, "model_type": f"{cfg.family}_text"}
    if spec.vision_config_at == ("vision_config",):
        return {"architectures": ["ForConditionalGeneration"], "model_type": cfg.family, "text_config": text,
                "vision_config": vision}
    thinker = {"model_type": f"{cfg.family}_thinker", "vision_config": vision, "text_config": text,
               "audio_config": {"d_model": 32}}
    return {"architectures": ["ForConditionalGeneration"], "model_type": cfg.family, "thinker_config": thinker,
            "talker_config": {"hidden_size": 32}}


def write_checkpoint(folder: Path, cfg: VisionConfig, *, prefix: str | None = None, sharded: bool = True,
                     dtype: torch.dtype = torch.float32, seed: int = 0, other_shards: int = 2
                     ) -> dict[str, torch.Tensor]:
    """A checkpoint in the family's released layout, weights from the reference tower with real spread; returns
    the reference's vision state dict (checkpoint names without prefix).

    Sharded: vision tensors split over the first two shards, the second also holding other tensors (as in the
    releases, where a shard boundary falls inside the tower), plus `other_shards` shards without vision tensors.
    """
    folder.mkdir(parents=True, exist_ok=True)
    prefix = cfg.spec.prefixes[0] if prefix is None else prefix
    vision = {k: v.to(dtype).contiguous() for k, v in hf_tower(cfg, seed=seed).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    names = OTHER_TENSORS.get(cfg.family, DEFAULT_OTHER)

    def other(i: int) -> dict[str, torch.Tensor]:
        return {name.format(i=i): torch.randn(16, 8, generator=gen).to(dtype) for name in names}

    named = {prefix + k: v for k, v in vision.items()}
    (folder / "config.json").write_text(json.dumps(released_config_json(cfg)))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_FILES[cfg.design]))
    if cfg.spec.video_sampling == "qwen3":  # Qwen3-VL's releases carry their own video settings
        (folder / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VIDEO_PREPROCESSOR_FILE))
    if not sharded:
        save_file({**named, **other(0)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return vision
    ordered = sorted(named)
    half = len(ordered) // 2
    shards = [{n: named[n] for n in ordered[:half]}, {**{n: named[n] for n in ordered[half:]}, **other(0)}]
    shards += [other(i + 1) for i in range(other_shards)]
    weight_map = {}
    for i, tensors in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in tensors})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return vision


def non_vision_shards(folder: Path) -> list[Path]:
    """The shards of a sharded checkpoint that hold no vision tensor."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for n, f in index.items() if "visual." in n}
    return sorted(folder / f for f in set(index.values()) - vision_files)


# ----------------------------------------------------------------------------- reference preprocessing

def hf_source_function(relative_path: str, class_name: str, function_name: str, namespace: dict):
    """Compile one method of a transformers class from its installed source (its module needs torchvision)."""
    import transformers

    source = (pathlib.Path(transformers.__file__).parent / relative_path).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == function_name:
                    module = ast.Module(body=[item], type_ignores=[])
                    exec(compile(module, relative_path, "exec"), namespace)
                    return namespace[function_name]
    raise AssertionError(f"{class_name}.{function_name} not found in {relative_path}")


VIDEO_FILES = {  # by the family's video_sampling rule (config.Family)
    "qwen2": ("models/qwen2_vl/video_processing_qwen2_vl.py", "Qwen2VLVideoProcessor"),
    "qwen3": ("models/qwen3_vl/video_processing_qwen3_vl.py", "Qwen3VLVideoProcessor"),
}


def reference_video(processor, family, frames):
    """Each frame through the image processor's own steps, then the video processor's patchify."""
    patchify = hf_source_function(*VIDEO_FILES[FAMILIES[family].video_sampling], "patchify", {"torch": torch})
    factor = processor.patch_size * processor.merge_size
    normalized = []
    for frame in frames:
        image = processor.process_image(frame, do_convert_rgb=True)
        image = processor.resize(image, size=processor.size, resample=processor.resample, factor=factor)
        image = processor.rescale(image, processor.rescale_factor)
        normalized.append(processor.normalize(image, processor.image_mean, processor.image_std))
    video = torch.from_numpy(np.stack(normalized))[None]  # (1, F, C, H, W)
    values, grid_t, grid_h, grid_w = patchify(None, video, processor.patch_size, processor.merge_size,
                                              processor.temporal_patch_size)
    return values[0].numpy(), (grid_t, grid_h, grid_w)



# ----------------------------------------------------------------------------- photos


def write_video(path, count: int, width: int, height: int, rate, codec: str = "mpeg4") -> None:
    """A video file of ``count`` frames (PyAV): a real photo panned 3 px per frame, plus noise, so that sampling
    the wrong frame or resizing differently would show."""
    import av

    photo = np.asarray(Image.open(sample_photo("grace_hopper.jpg")).convert("RGB").resize((width * 2, height * 2)))
    rng = np.random.default_rng(count)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(count):
            frame = np.roll(photo, 3 * i, axis=1)[:height, :width].astype(np.int16)
            frame = np.clip(frame + rng.integers(-20, 20, frame.shape), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())



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


def make_image_folder(root: Path, n: int, bad: bool = True) -> list[Path]:
    """n small images (jpg and png, some in a subfolder); with bad=True also a corrupt, an empty and a text file
    named as images, and a non-image file. Returns the good images' paths."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sub").mkdir(exist_ok=True)
    paths = []
    for i in range(n):
        folder = root / "sub" if i % 3 == 0 else root
        path = folder / f"img{i:03d}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(synthetic_photo(40 + 7 * (i % 5), 50 + 11 * (i % 4), i, noise=25.0)).save(path)
        paths.append(path)
    if bad:
        (root / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 3)
        (root / "empty.png").write_bytes(b"")
        (root / "notes.png").write_text("just text, wrongly named")
        (root / "readme.md").write_text("not an image extension: ignored")
    return paths


def census() -> int:
    """Bytes of live tensor storages reachable from Python, each storage counted once (meta: none)."""
    return live_tensor_bytes()


# ----------------------------------------------------------------------------- a stand-in of the Hugging Face Hub


@dataclass
class Revision:
    commit: str
    files: dict[str, Path]  # repo path -> file on disk
    etags: dict[str, str] = field(default_factory=dict)


class FakeHub:
    """Repos -> revisions (branch names and their commit hashes) -> files; a record of every request."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Revision]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, decoded path)
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.endpoint = ""

    def add(self, repo_id: str, folder: Path, *, branch: str = "main") -> str:
        """Serve every file of `folder` as `repo_id` at `branch`; return the commit hash it resolves to."""
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
        # The Hub's ETag is the git blob sha1 for small files and the LFS sha256 for large ones; any stable
        # content hash will do here.
        etags = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()}
        revision = Revision(commit, files, etags)
        refs = self.repos.setdefault(repo_id, {})
        refs[branch] = revision
        refs[commit] = revision
        return commit

    def log(self, method: str, path: str) -> None:
        with self.lock:
            self.requests.append((method, path))

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def resolve_paths(self, method: str | None = None) -> list[str]:
        with self.lock:
            return [p for m, p in self.requests if method is None or m == method]

    def files_touched(self) -> set[str]:
        return {path.split("/resolve/", 1)[1].split("/", 1)[1] for path in self.resolve_paths()}

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so no pooled keep-alive connection outlives hub.stop().
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:  # keep pytest output quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _reply(self, status: int, headers: dict[str, str], data: bytes = b"", body: bool = True) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and data:
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, commit: str | None = None, body: bool = True) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
            if commit is not None:
                headers["X-Repo-Commit"] = commit  # the Hub sends it with EntryNotFound: HF caches the absence
            self._reply(status, headers, f'{{"error": "{message}"}}'.encode(), body)

        def _serve(self, body: bool) -> None:
            raw = urlsplit(self.path).path
            parts = raw.split("/")  # "", org, name, "resolve", revision (quoted, may hold %2F), file...
            hub.log(self.command, unquote(raw))
            if len(parts) < 6 or parts[3] != "resolve":
                return self._error(404, "EntryNotFound" if parts[1:2] == ["api"] else "RepoNotFound",
                                   "Not served by this stand-in", body=body)
            repo_id = f"{unquote(parts[1])}/{unquote(parts[2])}"
            revision_name, filename = unquote(parts[4]), unquote("/".join(parts[5:]))
            refs = hub.repos.get(repo_id)
            if refs is None:
                return self._error(404, "RepoNotFound", "Repository not found", body=body)
            revision = refs.get(revision_name)
            if revision is None:
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + revision_name, body=body)
            path = revision.files.get(filename)
            if path is None:
                return self._error(404, "EntryNotFound", "Entry not found", revision.commit, body=body)
            data = path.read_bytes()
            etag = f'"{revision.etags[filename]}"'
            headers = {"X-Repo-Commit": revision.commit, "ETag": etag, "X-Linked-Etag": etag,
                       "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            status, start = 200, 0
            requested = self.headers.get("Range", "")
            if body and requested.startswith("bytes=") and requested.endswith("-"):  # resume: "bytes=N-"
                start = int(requested[len("bytes="):-1])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._reply(status, headers, data[start:], body)

    return Handler


def use_endpoint(monkeypatch, endpoint: str) -> None:
    """Point huggingface_hub at `endpoint` (it read HF_ENDPOINT into its constants at import time)."""
    from huggingface_hub import constants as hf_constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@contextlib.contextmanager
def serve_hub(tmp_path: Path, monkeypatch) -> Iterator[FakeHub]:
    """A running stand-in Hub; huggingface_hub pointed at it, with an empty temporary cache and HF home
    (`tmp_path/hf-home`). The `hub` fixture of conftest.py is this, for one test."""
    from huggingface_hub import constants as hf_constants

    # huggingface_hub read HF_HUB_CACHE / HF_HUB_OFFLINE into constants at import time, too.
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.server = server
    fake.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    use_endpoint(monkeypatch, fake.endpoint)
    cache = tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    try:  # user-agent agent detection may fetch {ENDPOINT}/api/agent-harnesses once: keep it off the record
        from huggingface_hub.utils import _detect_agent
        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    except (ImportError, AttributeError):
        pass
    fake.cache = cache
    try:
        yield fake
    finally:
        fake.stop()
        thread.join(timeout=5)
