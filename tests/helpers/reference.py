"""Checks against transformers that only tests make: the reference tower's outputs on a pack (the towers
themselves are ``qwenvl_vision.testing.reference``'s), every item of a pack (a tower's output or an
``EncodeResult``) within tolerance of them, and the reference video preprocessing, compiled from transformers'
installed source because its module needs torchvision.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import torch

from qwenvl_vision.model.config import FAMILIES
from qwenvl_vision.testing.reference import hf_forward, hf_tower, item_errors
from qwenvl_vision.testing.workloads import inputs


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


def reference_outputs(cfg, vision_state: dict, pixel_values, grid_thw):
    """transformers' tower holding these vision weights (checkpoint names without prefix, any float dtype, run in
    fp32) on one pack: (merged, [DeepStack levels])."""
    ref = hf_tower(cfg, seed=None)
    ref.load_state_dict({k: v.float() for k, v in vision_state.items()}, strict=True)
    with torch.no_grad():
        return hf_forward(ref, pixel_values, grid_thw)


def forward_both(ours, ref, cfg, grids):
    """(ours, reference) outputs, each (merged, DeepStack levels), on one pack of random inputs of these grids; and
    its grid_thw."""
    pixel_values, grid_thw = inputs(cfg, grids)
    with torch.no_grad():
        return ours(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw), grid_thw


def packed(result) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An EncodeResult as one pack, (merged, [DeepStack levels]), in the reference's layout."""
    assert len(result.deepstack) == len(result.embeddings), "not one DeepStack list per item"
    counts = sorted({len(item) for item in result.deepstack})
    assert len(counts) <= 1, f"the items carry different numbers of DeepStack levels: {counts}"
    return torch.cat(result.embeddings), [torch.cat(level) for level in zip(*result.deepstack)]


def assert_result_matches_reference(result, ref, grid_thw, tol: float, merge_size: int = 2) -> float:
    """An EncodeResult against the reference's (merged, [DeepStack levels]) of the same pack: one embedding of the
    item's size per item, and every item of every output within tol. Returns the largest error."""
    sizes = [int(t * h * w) // merge_size**2 for t, h, w in torch.as_tensor(grid_thw).tolist()]
    assert [e.shape[0] for e in result.embeddings] == sizes
    return assert_matches_reference(packed(result), ref, grid_thw, tol, merge_size)


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


def segment_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
                      ) -> torch.Tensor:
    """Each segment of packed (N, H, hd) q/k/v attended alone by float64 SDPA."""
    pieces, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        split = [x[rows].double().transpose(0, 1)[None] for x in (q, k, v)]
        pieces.append(torch.nn.functional.scaled_dot_product_attention(*split, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(pieces)
