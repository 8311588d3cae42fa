"""Checks against transformers that only tests make: every item of a pack within tolerance of the reference
tower (the towers themselves are ``bench.reference``'s), and the reference video preprocessing, compiled from
transformers' installed source because its module needs torchvision.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import torch

from bench.reference import item_errors
from qwenvl_vision.config import FAMILIES


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
