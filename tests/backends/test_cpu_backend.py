"""The CPU inference backend (qwenvl_vision.backends.cpu): its forward against transformers' towers per item, its
workspace ops bitwise the reference's, oneDNN's packed weights (one copy, plain out of state_dict, loads, moves,
autograd, autocast, teardown), the GEMM attention path against float64, the execution it picks per call (never the
workspace off the CPU), and the seam: the tower knows nothing of it and carries no hook or override for it."""

from __future__ import annotations

import ast
import copy as copying
import dataclasses
import gc
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.activations import ACT2FN

from qwenvl_vision import ConfigError, InputError, VisionTower, build_model, load_encoder
from qwenvl_vision.backends.cpu import forward
from qwenvl_vision.backends.cpu.backend import CpuBackend
from qwenvl_vision.backends.cpu.forward import ACTIVATIONS, CpuExecution
from qwenvl_vision.backends.cpu.kernels import (
    balanced_chunks,
    onednn_linear_available,
    pack_weight,
    packed_chunks,
    packed_linear,
)
from qwenvl_vision.backends.cpu.packing import linear_layers
from qwenvl_vision.backends.cpu.plan import CpuPlan, plan_key
from qwenvl_vision.backends.cpu.workspace import Workspace
from qwenvl_vision.cli import main
from qwenvl_vision.model import layers
from qwenvl_vision.model.attention import SegmentPlan
from qwenvl_vision.model.tower import accept_checkpoint_names
from tests.helpers import (
    FAMILY_SMALL,
    QWEN2_5_SMALL,
    QWEN3_SMALL_72,
    addmm_ignores_row_stride,
    assert_matches_reference,
    census,
    forced_plan,
    forward_both,
    grids_for,
    hf_forward,
    hf_tower,
    inputs,
    ours_from,
    packed_gives_addmm_bits,
    pair,
    rel_err,
    segment_reference,
    skip_unless_onednn_runs,
    write_checkpoint,
)

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear ops")
HEADS, HEAD_DIM = 4, 72
EPILOGUES = sorted(name for name, activation in ACTIVATIONS.items() if activation.epilogue is not None)


def plain_and_packed(cfg):
    """Two towers of one transformers tower's weights, one on the reference kernels, one with every linear packed,
    and inputs for them."""
    ref = hf_tower(cfg, seed=0)
    plain, packed = ours_from(ref, cfg), ours_from(ref, cfg)
    CpuBackend("reference").attach(plain)
    CpuBackend(forced_plan(packed, "onednn")).attach(packed)
    return plain, packed, inputs(cfg, grids_for(cfg))


def packed_count(model) -> int:
    """The tower's linears on oneDNN's layout, as ``describe`` reports them (and as the modules hold them)."""
    count = model.describe()["linear_kernels"]["onednn"]
    assert count == sum(p.is_mkldnn for p in model.parameters())
    return count


def call_execution(model, pixel_values, grid_thw):
    """The execution the tower's backend gives a call of these inputs (what ``forward`` asks it once)."""
    return model.backend.execution(model, pixel_values, model.grid_list(grid_thw))


def execution(dtype=torch.float32, rows=4096, dim=240, hidden=720, plan=None) -> CpuExecution:
    return CpuExecution(plan or CpuPlan("test"), Workspace(rows, dim, "plain", hidden, dtype, "cpu"))


# ----------------------------------------------------------------------------- workspace ops, bitwise


@pytest.mark.parametrize("name", sorted(layers.ACTIVATIONS))
def test_the_backend_s_form_of_every_activation_of_the_model_is_bitwise_transformers_activation(name):
    """The backend has a form of each (where the native kernels do not run it); bits on any CPU: the same aten kernel
    over the same iteration, in place or on a copy in the rows of a larger buffer (the workspace's)."""
    x = torch.randn(31_817, 33) * 5  # rows split over threads
    assert torch.equal(execution().activate(x.clone(), name), ACT2FN[name](x))
    out = torch.full((40_000, 33), float("nan"))[:31_817]
    got = execution().activate(x.clone(), name, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, ACT2FN[name](x))


# ----------------------------------------------------------------------------- towers on the backend


@needs_onednn
@pytest.mark.parametrize("family", list(FAMILY_SMALL))
def test_packed_towers_match_transformers_per_item(family, tmp_path):
    cfg = FAMILY_SMALL[family]
    write_checkpoint(tmp_path, cfg)
    encoder = load_encoder(tmp_path, device="cpu", cpu_kernels="reference")
    CpuBackend(forced_plan(encoder.model, "onednn", "gemm")).attach(encoder.model)
    assert packed_count(encoder.model) == len(linear_layers(encoder.model)) > 0
    assert encoder.describe()["execution"] == "cpu"
    ref = hf_tower(cfg, seed=0)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    result = encoder.encode_patches(pixel_values, grid_thw)
    with torch.no_grad():
        expected = hf_forward(ref, pixel_values, grid_thw)
    ours = (torch.cat(result.embeddings), [torch.cat([item[i] for item in result.deepstack])
                                          for i in range(len(expected[1]))])
    assert_matches_reference(ours, expected, grid_thw, 1e-5)


@needs_onednn
@pytest.mark.parametrize("cfg", [QWEN2_5_SMALL, QWEN3_SMALL_72, FAMILY_SMALL["qwen2_vl"]],
                         ids=["qwen2.5", "qwen3", "qwen2-vl"])
def test_bf16_packed_tower_within_tolerance_and_addmm_bitwise_where_this_machine_probes_so(cfg, monkeypatch):
    """A bf16 tower on oneDNN's packed weights, its rows handed to the activation and the residual add in chunks, its
    MLPs by row blocks, chunks and blocks of a few dozen rows so that every pack crosses many of them:
    within test_towers' bf16 tolerance of the fp32 tower per item. Bitwise the addmm plan's tower (oneDNN's epilogue
    activation turned off) only where this machine's probe shows a packed linear on such chunks gives addmm's bits
    (``packed_gives_addmm_bits``). Where oneDNN computes a plain MLP's activation in its GEMM's epilogue (Qwen3's
    GELU-tanh), the hidden activations skip one bf16 rounding: one MLP alone is closer to float64, on any CPU."""
    chunk_bytes, block_rows = 16 << 10, 24
    ref = hf_tower(cfg, seed=0)
    plain = ours_from(ref, cfg).to(torch.bfloat16)
    CpuBackend(forced_plan(plain, "addmm")).attach(plain)
    packed = ours_from(ref, cfg).to(torch.bfloat16)
    CpuBackend(forced_plan(packed, "onednn", mlp_rows=block_rows, chunk_bytes=chunk_bytes)).attach(packed)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    assert call_execution(packed, pixel_values, grid_thw).chunk_bytes == chunk_bytes  # chunks of a few dozen rows
    with torch.no_grad():
        a, levels_a = plain(pixel_values, grid_thw)
        with monkeypatch.context() as no_epilogue:
            no_epilogue.setattr(forward, "ACTIVATIONS", {name: dataclasses.replace(activation, epilogue=None)
                                                         for name, activation in ACTIVATIONS.items()})
            b, levels_b = packed(pixel_values, grid_thw)
        fused = packed(pixel_values, grid_thw)
        exact = ours_from(ref, cfg)(pixel_values, grid_thw)
    assert_matches_reference((b, levels_b), exact, grid_thw, 3e-2)  # test_towers' bf16 tolerance, per item
    shapes = [(layer.in_features, layer.out_features) for _, layer in linear_layers(packed)]
    patches = grid_thw.prod(1).tolist()  # each item runs as its own forward: its rows, and its mergers' rows / 4
    rows = sorted({*patches, *(n // cfg.merge_unit for n in patches)})
    steps = sorted({block_rows, *(max(1, chunk_bytes // (out * 2)) for _, out in shapes)})
    bitwise = packed_gives_addmm_bits(shapes, torch.bfloat16, rows, steps)
    epilogue = cfg.hidden_act in EPILOGUES and cfg.family.mlp != "gated"
    assert_matches_reference(fused, exact, grid_thw, 3e-2)
    # oneDNN's epilogue skips a rounding where the family's MLP has one; else the fused tower runs the same path
    assert torch.equal(fused[0], b) != epilogue
    if epilogue:
        # One MLP alone (no residual to round the update away): closer to float64 than the addmm plan's MLP.
        x = torch.randn(200, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        mlp_plain, mlp_packed = plain.blocks[0].mlp, packed.blocks[0].mlp
        fc1, fc2 = (layer.weight.double() for layer in (mlp_plain.linear_fc1, mlp_plain.linear_fc2))
        hidden = ACT2FN[cfg.hidden_act](x.double() @ fc1.T + mlp_plain.linear_fc1.bias.double())
        want = hidden @ fc2.T + mlp_plain.linear_fc2.bias.double()
        run = execution(torch.bfloat16, 200, cfg.hidden_size, cfg.intermediate_size, packed.backend.plan(packed))
        with torch.no_grad():
            got = {name: run.mlp(mlp, x, residual=torch.zeros_like(x)).double() for name, mlp in
                   [("plain", mlp_plain), ("packed", mlp_packed)]}
        assert rel_err(got["packed"], want) < rel_err(got["plain"], want)
    if not bitwise:
        pytest.skip("this machine's oneDNN packed bf16 linear does not give addmm's bits on these row chunks "
                    "(packed_gives_addmm_bits): the bitwise claims are unchecked here, the tolerances held")
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(levels_a, levels_b, strict=True))
    if not epilogue:  # no epilogue activation in this family's MLP: the fused tower is the addmm plan's too
        assert torch.equal(fused[0], a)


@needs_onednn
@pytest.mark.parametrize("name", EPILOGUES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogue_activations_are_transformers_activations(name, dtype):
    """oneDNN's activation in the GEMM's epilogue against transformers' on the linear's result: within fp32's
    rounding in fp32; in bf16 closer to float64 than the linear rounded and then activated."""
    skip_unless_onednn_runs(dtype)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 96, generator=gen) * 2).to(dtype)
    weight = (torch.randn(160, 96, generator=gen) / 5).to(dtype)
    bias = torch.randn(160, generator=gen).to(dtype)
    fused = packed_linear(x, pack_weight(weight), bias, ACTIVATIONS[name].epilogue)
    separate = ACT2FN[name](F.linear(x, weight, bias))
    exact = ACT2FN[name](F.linear(x.double(), weight.double(), bias.double()))
    if dtype == torch.float32:
        assert rel_err(fused, separate) < 1e-6
    else:
        assert rel_err(fused.double(), exact) < rel_err(separate.double(), exact)


def test_the_reference_setting_runs_the_modules_own_forward_bitwise():
    """``cpu_kernels="reference"``: transformers' ops as the modules write them (no workspace, no packing)."""
    cfg = QWEN3_SMALL_72
    ref = hf_tower(cfg, seed=0)
    model = ours_from(ref, cfg)
    CpuBackend("reference").attach(model)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    modules = []
    with torch.no_grad():
        got = model(pixel_values, grid_thw)
        for block in model.blocks:  # what the modules' own forward gives, called here block by block
            block.register_forward_hook(lambda *_: modules.append(1))
        model(pixel_values, grid_thw)
    assert model.describe()["execution"] == "reference" and packed_count(model) == 0
    assert len(modules) == len(grid_thw) * len(model.blocks)
    assert_matches_reference(got, hf_forward(ref, pixel_values, grid_thw), grid_thw, 1e-5)
    with pytest.raises(ConfigError, match="cpu_kernels 'mkl'"):
        CpuBackend("mkl")


# ----------------------------------------------------------------------------- attention paths


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_take_the_plan_s_attention_path_and_it_is_as_exact_as_sdpa(dtype, monkeypatch):
    """A plan that runs 512-token probes on the GEMM path: 64-token windows and one frame beyond the GEMM path's
    memory bound run SDPA, two 600-token frames (nearest probe 512) run two GEMMs per head, on strided q/k/v views
    of one fused qkv, into a strided output. Each segment within fp32 accuracy of float64, and in bf16 no further
    from it than SDPA itself on the same frames."""
    lengths = [64] * 3 + [600, 600, 6200]
    n, scale = sum(lengths), HEAD_DIM**-0.5
    qkv = torch.randn(n, 3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, v = qkv.unbind(1)
    plan = CpuPlan("test", {}, {plan_key("attention", dtype, HEADS, HEAD_DIM, 512): "gemm",
                                plan_key("attention", dtype, HEADS, HEAD_DIM, 4096): "gemm"})
    out = torch.full((n, 2, HEADS, HEAD_DIM), float("nan"), dtype=dtype)[:, 0]
    counts = []  # the GEMM path runs once, for the run of two 600-token frames
    monkeypatch.setattr(forward, "gemm_attention", lambda q, k, v, count, *rest, run=forward.gemm_attention:
                        counts.append(count) or run(q, k, v, count, *rest))
    attended = execution(dtype, plan=plan).attend(q, k, v, SegmentPlan.from_lengths(lengths), scale, out=out)
    assert counts == [2] and attended.data_ptr() == out.data_ptr()
    expected = segment_reference(q, k, v, lengths, scale)
    frames = slice(3 * 64, 3 * 64 + 1200)
    if dtype == torch.float32:
        assert rel_err(attended, expected) < 1e-6
    else:
        sdpa = F.scaled_dot_product_attention(*[x[frames].unflatten(0, (2, 600)).transpose(1, 2) for x in (q, k, v)],
                                              scale=scale).transpose(1, 2).flatten(0, 1)
        assert rel_err(attended[frames], expected[frames]) < rel_err(sdpa, expected[frames])
        assert rel_err(attended, expected) < 4e-3


@needs_onednn
def test_many_scattered_frames_are_gathered_onto_the_gemm_path():
    """Six 520-token images between 8-token ones: one gathered group of the six (``out[index] = ...``)."""
    lengths = [520, 8] * 6
    n, scale = sum(lengths), HEAD_DIM**-0.5
    q, k, v = (torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(i)) for i in range(3))
    segments = SegmentPlan.from_lengths(lengths)
    assert any(group.index is not None and group.length == 520 for group in segments.groups)
    plan = CpuPlan("test", {}, {plan_key("attention", torch.float32, HEADS, HEAD_DIM, 512): "gemm"})
    attended = execution(plan=plan).attend(q, k, v, segments, scale)
    assert rel_err(attended, segment_reference(q, k, v, lengths, scale)) < 1e-6


@needs_onednn
@pytest.mark.parametrize("cfg", [QWEN2_5_SMALL, QWEN3_SMALL_72], ids=["qwen2.5", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_towers_with_frames_on_the_gemm_path_match_transformers(cfg, dtype):
    """A 576-token image and a 2-frame video of 512-token frames (Qwen2.5's full-attention blocks, every Qwen3
    block attend them by two GEMMs per head) and a small image, against transformers' fp32 tower per item."""
    ours, ref = pair(cfg)
    ours = ours.to(dtype)
    CpuBackend(forced_plan(ours, "onednn", "gemm")).attach(ours)
    grids = [(1, 24, 24), (2, 16, 32), (1, 4, 6)]
    (merged, levels), expected, grid_thw = forward_both(ours, ref, cfg, grids)
    assert_matches_reference((merged, levels), expected, grid_thw, 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_video_beside_a_larger_image_on_torch_s_elementwise_ops_matches_transformers(dtype):
    """Where the elementwise steps run on torch's ops (float16 here, or no C compiler), rope makes fresh q and k and
    v stays in the qkv buffer: an item of a third of the workspace's rows (a 6-frame video, windows of two lengths)
    must not get its attention output written over its own v, against transformers' fp32 tower per item."""
    ours, ref = pair(QWEN2_5_SMALL)
    ours = ours.to(dtype)
    CpuBackend(forced_plan(ours, elementwise="aten")).attach(ours)
    (merged, levels), expected, grid_thw = forward_both(ours, ref, QWEN2_5_SMALL, [(1, 48, 48), (3, 12, 20)])
    assert_matches_reference((merged.float(), levels), expected, grid_thw, 1e-5 if dtype == torch.float32 else 3e-2)


# ----------------------------------------------------------------------------- the execution the tower picks


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_off_the_cpu_a_block_launches_no_per_chunk_kernels(monkeypatch):
    """A tower off the CPU (here on ``meta``, a device-agnostic stand-in for CUDA) runs the modules' forward: the
    CPU workspace is never made, and a forward of one frame dispatches as many ops at 64 tokens as at 65k (a packed
    linear's row chunks would grow with the rows)."""
    monkeypatch.setattr(Workspace, "__init__", lambda *_: pytest.fail("the CPU workspace was made off the CPU"))
    model = build_model(QWEN3_SMALL_72).to("meta")
    counts = []
    for side in (8, 256):
        pixel_values = torch.empty(side * side, QWEN3_SMALL_72.patch_dim, device="meta")
        with torch.no_grad(), CountOps() as ops:
            model(pixel_values, torch.tensor([[1, side, side]]))
        counts.append(ops.count)
    assert counts[0] == counts[1] and model.describe()["execution"] == "reference"


def test_a_tower_built_on_meta_and_filled_on_the_cpu_runs_the_cpu_backend():
    """The parity tests' way (built on ``meta``, the reference's weights loaded on the CPU) runs what users run."""
    ours, _ = pair(QWEN3_SMALL_72)
    pixel_values, grid_thw = inputs(QWEN3_SMALL_72, grids_for(QWEN3_SMALL_72))
    with torch.no_grad():
        ours(pixel_values, grid_thw)
    assert isinstance(ours.backend, CpuBackend) and ours.describe()["execution"] == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a tower off the CPU needs a GPU to be loaded on")
def test_off_the_cpu_no_cpu_backend_is_attached_and_a_bad_setting_is_still_refused():
    """A tower loaded off the CPU runs the modules' own forward with no CPU backend attached, ``set_cpu_kernels``
    included."""
    encoder = load_encoder(QWEN3_SMALL_72, random_weights=True, device="cuda")
    encoder.set_cpu_kernels("auto")
    with pytest.raises(ConfigError, match="cpu_kernels 'mkl'"):
        encoder.set_cpu_kernels("mkl")
    assert not isinstance(encoder.model.backend, CpuBackend) and encoder.cpu_plan is None


@needs_onednn
@pytest.mark.parametrize("cfg", [QWEN2_5_SMALL, QWEN3_SMALL_72], ids=["qwen2.5", "qwen3"])
def test_the_forward_runs_the_plan_s_chunk_size(cfg, monkeypatch):
    """A packed linear computes the plan's bytes of output per oneDNN call (the plan's for the tower's block
    shape); the chunked tower stays within fp32 tolerance of transformers' per item."""
    ref = hf_tower(cfg, seed=0)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    default = ours_from(ref, cfg)
    CpuBackend(forced_plan(default, "addmm")).attach(default)
    packed = ours_from(ref, cfg)
    CpuBackend(forced_plan(packed, "onednn", chunk_bytes=8 << 10)).attach(packed)
    asked = []
    real = forward.packed_chunks
    monkeypatch.setattr(forward, "packed_chunks", lambda x, w, b, chunk: asked.append(chunk) or real(x, w, b, chunk))
    with torch.no_grad():
        default(pixel_values, grid_thw)
        assert not asked  # addmm everywhere: no chunked oneDNN call
        chunked = packed(pixel_values, grid_thw)
        expected = hf_forward(ref, pixel_values, grid_thw)
    assert asked and set(asked) == {8 << 10}
    assert_matches_reference(chunked, expected, grid_thw, 1e-5)


# ----------------------------------------------------------------------------- packed weights


@needs_onednn
def test_the_packed_weight_replaces_the_plain_one():
    gc.collect()  # the census runs no gc: earlier tests' cyclic garbage would count as live
    model = build_model(QWEN2_5_SMALL, cpu_kernels="reference")
    before = census()
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    # The plain weights are gone: what is live is the packed ones (the census counts each as its elements), so the
    # total has not grown; keeping the plain weights beside them would have added their bytes again.
    linear_bytes = sum(layer.weight.numel() * 4 for _, layer in linear_layers(model))
    assert packed_count(model) == len(linear_layers(model)) and linear_bytes > before / 2
    assert census() == before


@needs_onednn
def test_state_dict_and_extract_weights_give_plain_tensors_equal_to_the_checkpoint(tmp_path):
    vision = write_checkpoint(tmp_path / "ckpt", QWEN2_5_SMALL)
    encoder = load_encoder(tmp_path / "ckpt", device="cpu", cpu_kernels="reference")
    CpuBackend(forced_plan(encoder.model, "onednn")).attach(encoder.model)
    state = encoder.model.state_dict()
    assert packed_count(encoder.model) > 0 and not any(v.is_mkldnn for v in state.values())
    assert torch.equal(state["blocks.1.attn.qkv.weight"], vision["blocks.1.attn.qkv.weight"])  # a layout change
    assert main(["extract-weights", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(vision) and all(torch.equal(saved[k], vision[k]) for k in vision)


@needs_onednn
def test_a_state_dict_loads_into_a_packed_tower_and_is_packed_again():
    cfg = QWEN3_SMALL_72
    ref = hf_tower(cfg, seed=3)
    model = build_model(cfg)
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    model.load_state_dict(ref.state_dict(), strict=True)  # transformers' names, through the load hook
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        assert_matches_reference(model(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw), grid_thw,
                                 1e-5)
    assert packed_count(model) == len(linear_layers(model))
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({k: v for k, v in ref.state_dict().items() if "qkv" not in k}, strict=True)


@needs_onednn
def test_close_frees_packed_weights_and_nothing_stays_behind():
    baseline = census()
    encoder = load_encoder(QWEN3_SMALL_72, random_weights=True, device="cpu", cpu_kernels="reference")
    CpuBackend(forced_plan(encoder.model, "onednn")).attach(encoder.model)
    assert packed_count(encoder.model) > 0 and census() > baseline
    pixel_values, grid_thw = inputs(QWEN3_SMALL_72, grids_for(QWEN3_SMALL_72))
    encoder.encode_patches(pixel_values, grid_thw)
    model = encoder.model
    encoder.close()
    assert all(p.is_meta for p in model.parameters())
    del model, encoder, pixel_values, grid_thw
    assert census() == baseline


def test_threads_share_an_encoder_on_the_backend():
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
    expected = torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings)
    results = []

    def work():
        results.append(torch.cat(encoder.encode_patches(pixel_values, grid_thw).embeddings))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(torch.equal(r, expected) for r in results)


@needs_onednn
def test_one_packed_weight_serves_calls_of_any_row_count():
    """The reorder's row count is only a hint for the blocking: calls of any row count, and by row chunks, are
    fp32-accurate with the one packed weight."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(3000, 64, generator=generator)
    packed = pack_weight(weight, rows=1024)
    exact = x.double() @ weight.double().T + bias.double()
    for rows in (slice(0, 1), slice(0, 7), slice(5, 1029), slice(100, 3000), slice(None)):
        assert rel_err(packed_linear(x[rows].contiguous(), packed, bias), exact[rows]) < 1e-6, rows
    chunks = list(packed_chunks(x, packed, bias, 96 * 4 * 100))  # 30 chunks, each fresh
    assert len(chunks) == 30 and rel_err(torch.cat([y for _, y in chunks]), exact) < 1e-6


@needs_onednn
def test_gradients_through_a_packed_tower_match_the_plain_one_and_inference_packs_again():
    """Autograd runs the modules' forward: a packed tower is unpacked for it (input gradients match the plain
    tower's, and a packed weight made trainable stays trainable and gets its gradient), and the next inference call
    runs the plan's packed weights again, the trainable one plain."""
    plain, packed, (pixel_values, grid_thw) = plain_and_packed(QWEN2_5_SMALL)
    packed.blocks[0].attn.qkv.weight.requires_grad_(True)
    grads = []
    for model in (plain, packed):
        x = pixel_values.clone().requires_grad_(True)
        model(x, grid_thw)[0].square().sum().backward()
        grads.append(x.grad)
    assert packed_count(packed) == 0 and torch.equal(grads[1], grads[0])
    weight = packed.blocks[0].attn.qkv.weight
    assert weight.requires_grad and not weight.is_mkldnn and weight.grad is not None and weight.grad.abs().sum() > 0
    with torch.no_grad():
        packed(pixel_values, grid_thw)
    assert packed_count(packed) == len(linear_layers(packed)) - 1


@needs_onednn
def test_a_packed_tower_moves_and_casts_and_stays_exact():
    cfg = QWEN3_SMALL_72
    ref = hf_tower(cfg, seed=0)
    model = ours_from(ref, cfg)
    CpuBackend(forced_plan(model.to(torch.bfloat16), "onednn")).attach(model)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    packed_bf16 = ours_from(ref, cfg).to(torch.bfloat16)  # cast, then packed
    CpuBackend(model.backend.plan(model)).attach(packed_bf16)
    model.float().to(torch.bfloat16)  # unpacked, cast twice; packed again by the next forward
    with torch.no_grad():
        assert torch.equal(model(pixel_values, grid_thw)[0], packed_bf16(pixel_values, grid_thw)[0])
    assert packed_count(model) == len(linear_layers(model)) and model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16


@needs_onednn
def test_autocast_runs_the_modules_forward_on_a_packed_tower():
    plain, packed, (pixel_values, grid_thw) = plain_and_packed(QWEN2_5_SMALL)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(pixel_values, grid_thw)[0], packed(pixel_values, grid_thw)[0]
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_chunks_are_balanced_and_leave_no_short_tail():
    assert [s.stop - s.start for s in balanced_chunks(1840, 613)] == [460, 460, 460, 460]
    assert [s.stop - s.start for s in balanced_chunks(5, 613)] == [5]
    for rows, step in ((1, 1), (1000, 7), (613 * 3 + 1, 613)):
        sizes = [s.stop - s.start for s in balanced_chunks(rows, step)]
        assert sum(sizes) == rows and max(sizes) <= step and max(sizes) - min(sizes) <= 1


@needs_onednn
@pytest.mark.slow
def test_compiling_unpacks_first():
    model = build_model(QWEN2_5_SMALL)
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    model.compile_blocks(backend="eager")
    assert packed_count(model) == 0 and model.describe()["execution"] == "reference"


def test_the_addmm_and_sdpa_plan_gives_the_reference_bits_where_addmm_ignores_strides():
    """The backend on torch's own kernels (addmm into the workspace, SDPA) runs the reference's ops in its order:
    the modules' own forward's bits, in fp32 and bf16, where this machine's addmm gives a strided view's rows the
    bits of the same rows contiguous (``addmm_ignores_row_stride``); within the towers' tolerance everywhere."""
    unchecked = []
    for dtype in (torch.float32, torch.bfloat16):
        for cfg in (QWEN2_5_SMALL, QWEN3_SMALL_72):
            model = build_model(cfg).to(dtype)
            pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
            with torch.no_grad():
                CpuBackend("reference").attach(model)
                reference = model(pixel_values, grid_thw)
                CpuBackend(forced_plan(model, "addmm", "sdpa")).attach(model)
                assert model.describe()["execution"] == "cpu"
                backend = model(pixel_values, grid_thw)
            assert_matches_reference(backend, reference, grid_thw, 1e-5 if dtype == torch.float32 else 3e-2)
            if not addmm_ignores_row_stride(model, int(grid_thw.prod(1).max()), dtype):
                unchecked.append(f"{cfg.model_type} {dtype}")
                continue
            assert torch.equal(backend[0], reference[0]), (cfg.model_type, dtype)
            assert all(torch.equal(a, b) for a, b in zip(backend[1], reference[1], strict=True))
    if unchecked:
        pytest.skip(f"this machine's addmm gives other bits on strided rows (addmm_ignores_row_stride) for "
                    f"{', '.join(unchecked)}: the bitwise claim is unchecked there, the tolerances held")


@needs_onednn
def test_forward_hooks_see_every_module():
    """A hook is there to see a module run, and the CPU backend calls no module's forward: with a hook the tower
    runs the modules' forward (the same numbers within the kernels' rounding)."""
    cfg = QWEN3_SMALL_72
    model = build_model(cfg)
    CpuBackend(forced_plan(model, "onednn", "gemm")).attach(model)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        packed = model(pixel_values, grid_thw)[0]
        seen = []
        handle = model.blocks[1].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        hooked = model(pixel_values, grid_thw)[0]
        handle.remove()
    assert len(seen) == len(grid_thw) and rel_err(hooked, packed) < 1e-5


# ----------------------------------------------------------------------------- the seam


def test_the_tower_module_imports_nothing_of_the_backends():
    """The model asks its backend for each call's execution and knows no backend: tower.py imports none."""
    path = Path(VisionTower.__module__.replace(".", "/") + ".py")
    source = Path(__file__).resolve().parents[2] / path
    reached = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom):
            anchor = VisionTower.__module__.split(".")[: -node.level] if node.level else []
            reached.append(".".join(anchor + [node.module or ""]))
        elif isinstance(node, ast.Import):
            reached += [alias.name for alias in node.names]
    assert reached and not [m for m in reached if m.startswith("qwenvl_vision.backends")], reached


@needs_onednn
def test_a_tower_run_on_packed_weights_carries_no_state_dict_hook_and_no_conversion_override():
    """Packing swaps the layers' class (``PackedLinear`` keeps the module contract on its own class): the tower
    and its modules carry no hook for it, and the tower converts with torch's own ``_apply``."""
    cfg = QWEN3_SMALL_72
    model = build_model(cfg)
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        model(pixel_values, grid_thw)
    assert packed_count(model) == len(linear_layers(model)) and model.describe()["execution"] == "cpu"
    assert type(model)._apply is torch.nn.Module._apply
    for module in model.modules():
        assert not (module._state_dict_hooks or module._state_dict_pre_hooks or module._load_state_dict_post_hooks
                    or module._forward_hooks or module._forward_pre_hooks), module
        if module is not model:
            assert not module._load_state_dict_pre_hooks, module
    # the tower's one load hook takes the checkpoints' names, whatever runs it
    assert [hook.hook for hook in model._load_state_dict_pre_hooks.values()] == [accept_checkpoint_names]


@needs_onednn
def test_a_packed_fp32_tower_converts_as_its_plain_weights_and_is_packed_again():
    """A conversion that changes nothing keeps the packing; a cast gives the layers back plain in the new dtype (the
    next call runs the plan there, packed where it says so); a cast back packs again; to meta frees them."""
    cfg = QWEN2_5_SMALL
    ref = hf_tower(cfg, seed=0)
    model = ours_from(ref, cfg)
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    layers_count = len(linear_layers(model))
    with torch.no_grad():
        before = model(pixel_values, grid_thw)
        model.float().to("cpu")
        assert packed_count(model) == layers_count and torch.equal(model(pixel_values, grid_thw)[0], before[0])
        model.to(torch.bfloat16)
        assert packed_count(model) == 0 and model.describe()["execution"] == "reference"
        assert all(p.dtype == torch.bfloat16 and not p.is_mkldnn for p in model.parameters())
        expected = hf_forward(ref, pixel_values, grid_thw)
        assert_matches_reference(model(pixel_values, grid_thw), expected, grid_thw, 3e-2)  # no bf16 entry: addmm
        model.float()
        assert_matches_reference(model(pixel_values, grid_thw), expected, grid_thw, 3e-2)  # bf16-rounded weights
        assert packed_count(model) == layers_count and model.describe()["execution"] == "cpu"
        model.double()  # oneDNN packs no float64: plain weights, still right
        assert_matches_reference(model(pixel_values.double(), grid_thw), expected, grid_thw, 3e-2)
        assert packed_count(model) == 0
    CpuBackend(forced_plan(model.float(), "onednn")).attach(model)
    assert packed_count(model) == layers_count
    model.to("meta")
    assert all(p.is_meta for p in model.parameters()) and model.describe()["execution"] == "reference"


@needs_onednn
def test_describe_reports_the_execution_the_calls_run_on():
    """``describe`` reports the state the backend decides each call on: the plan once prepared, the modules'
    forward after a call that needed it, the plan again after the next inference call."""
    cfg = QWEN2_5_SMALL
    model = build_model(cfg)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    assert model.describe()["execution"] == "reference"  # "auto" resolves the plan at the first inference call
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    assert model.describe()["execution"] == call_execution(model, pixel_values, grid_thw).name == "cpu"
    assert model.describe()["cpu_plan"] == "forced" and model.describe()["items"] == "one forward each"
    needs_grad = pixel_values.clone().requires_grad_(True)
    assert call_execution(model, needs_grad, grid_thw).name == model.describe()["execution"] == "reference"
    assert model.describe()["linear_kernels"] == {"addmm": len(linear_layers(model)), "onednn": 0}
    with torch.no_grad():
        model(pixel_values, grid_thw)
    assert model.describe()["execution"] == "cpu" and packed_count(model) == len(linear_layers(model))
    model.to("meta")
    assert model.describe()["items"] == "one forward per pack"


def test_the_pixel_rows_are_checked_once_per_encode_call(monkeypatch):
    """The pixel rows are checked by the tower's forward alone, not again by the encoder; a direct call checks the
    rows and the grids."""
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", cpu_kernels="reference")
    model = encoder.model
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
    checked = model.grid_list(grid_thw)
    assert checked == list(map(tuple, grid_thw.tolist()))
    pixel_checks = []
    real = VisionTower.check_pixels
    monkeypatch.setattr(VisionTower, "check_pixels", lambda self, *args: pixel_checks.append(1) or real(self, *args))
    encoder.encode_patches(pixel_values, grid_thw)
    assert pixel_checks == [1]
    with pytest.raises(InputError, match="pixel_values has shape"):
        model(pixel_values[:-1], checked)
    with pytest.raises(InputError, match="multiples of the merge size"):
        model(pixel_values, [[1, 3, 4]])


@needs_onednn
def test_a_conversion_that_changes_nothing_keeps_the_packing_and_still_reaches_the_bias():
    """``share_memory_`` keeps the packed weight and moves the bias into shared memory; ``to_empty`` (new storage)
    gives the layers back plain, on new storage, as it does to any module."""
    cfg = QWEN2_5_SMALL
    model = ours_from(hf_tower(cfg, seed=0), cfg)
    CpuBackend(forced_plan(model, "onednn")).attach(model)
    layers_count = len(linear_layers(model))
    model.share_memory()
    assert packed_count(model) == layers_count
    assert all(layer.bias.is_shared() for _, layer in linear_layers(model) if layer.bias is not None)
    old_bias = model.blocks[0].attn.qkv.bias.data_ptr()
    model.to_empty(device="cpu")
    assert packed_count(model) == 0 and not any(p.is_mkldnn for p in model.parameters())
    assert model.blocks[0].attn.qkv.bias.data_ptr() != old_bias


@needs_onednn
def test_a_backend_runs_one_tower_and_a_copy_gets_its_own():
    """A backend's preparation is its tower's packed layers: a second tower is refused by name (and stays free to
    take a backend of its own), the first keeps running on its plan, and a deep copy of the tower (its packed layers
    copied plain) gets a backend of its own that packs the copy's layers again: the same bits."""
    cfg = QWEN2_5_SMALL
    first = ours_from(hf_tower(cfg, seed=0), cfg)
    second = ours_from(hf_tower(cfg, seed=0), cfg)
    plan = forced_plan(first, "onednn")
    backend = CpuBackend(plan).attach(first)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with pytest.raises(ConfigError, match="^this CpuBackend already runs another tower"):
        backend.attach(second)
    assert second.backend is not backend
    second.use_backend(backend)  # by hand: its calls are refused, and a backend of its own takes over
    with pytest.raises(ConfigError, match="^this CpuBackend already runs another tower"):
        second(pixel_values, grid_thw)
    CpuBackend(plan).attach(second)
    with torch.no_grad():
        expected = first(pixel_values, grid_thw)
        assert torch.equal(second(pixel_values, grid_thw)[0], expected[0])
        assert first.describe()["execution"] == "cpu" and packed_count(first) == len(linear_layers(first))
        copy = copying.deepcopy(first)
        assert copy.backend is not backend and torch.equal(copy(pixel_values, grid_thw)[0], expected[0])
    assert copy.describe()["execution"] == "cpu" and packed_count(copy) == len(linear_layers(copy))
    assert first.describe()["execution"] == "cpu" and packed_count(first) == len(linear_layers(first))
    assert all(a.weight is not b.weight for (_, a), (_, b) in zip(linear_layers(first), linear_layers(copy)))


@needs_onednn
def test_adopting_the_plan_the_layers_are_packed_for_repacks_nothing():
    """``set_cpu_kernels`` with the plan the encoder already runs on (a run adopting its recorded plan) keeps every
    packed weight; another plan packs for that plan."""
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    plan = forced_plan(encoder.model, "onednn")
    encoder.set_cpu_kernels(plan)
    weights = [layer.weight for _, layer in linear_layers(encoder.model)]
    encoder.set_cpu_kernels(plan.to_dict())
    assert all(a is b for a, b in zip(weights, [layer.weight for _, layer in linear_layers(encoder.model)]))
    encoder.set_cpu_kernels(forced_plan(encoder.model, "addmm"))
    assert encoder.describe()["linear_kernels"]["onednn"] == 0 and encoder.cpu_plan.machine == "forced"


def test_a_backend_that_packs_nothing_serves_any_tower():
    """Off the packing path ("reference", off the CPU, compiled) a backend holds nothing of a tower, so towers that
    share one (``nn.DataParallel``'s replicas share their module's attributes) all run on it."""
    cfg = QWEN2_5_SMALL
    ref = hf_tower(cfg, seed=0)
    first, second = ours_from(ref, cfg), ours_from(ref, cfg)
    backend = CpuBackend("reference").attach(first)
    second.use_backend(backend)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        assert torch.equal(first(pixel_values, grid_thw)[0], second(pixel_values, grid_thw)[0])
    assert first.describe()["execution"] == second.describe()["execution"] == "reference"


@needs_onednn
def test_a_plan_this_cpu_cannot_pack_is_refused_and_the_tower_runs_as_before(monkeypatch):
    """A recorded plan whose oneDNN kernels this CPU lacks (another machine's bf16) is refused in one line, and the
    encoder goes on with the setting it had, the same bits (it kept the refused one and failed every call)."""
    from qwenvl_vision.backends.cpu.packing import PackedLinear

    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
    before = encoder.encode_patches(pixel_values, grid_thw).embeddings
    plan = forced_plan(encoder.model, "onednn")

    def no_kernel(layer):
        raise RuntimeError("no oneDNN kernel for this dtype on this CPU")

    monkeypatch.setattr(PackedLinear, "pack_", staticmethod(no_kernel))
    with pytest.raises(ConfigError, match="which this CPU cannot run"):
        encoder.set_cpu_kernels(plan)
    monkeypatch.undo()
    assert encoder.model.backend.cpu_kernels == "auto"
    after = encoder.encode_patches(pixel_values, grid_thw).embeddings
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_auto_runs_the_plan_of_the_thread_count_at_each_call():
    """The machine's plan is measured per torch thread count: a process that changes the count after loading runs
    that count's plan, as a process started at it would (the same kernels, the same bits)."""
    threads = torch.get_num_threads()
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, grids_for(QWEN2_5_SMALL))
    encoder.encode_patches(pixel_values, grid_thw)
    first = encoder.describe()["cpu_plan"]
    try:
        torch.set_num_threads(threads + 1)
        encoder.encode_patches(pixel_values, grid_thw)
        assert encoder.describe()["cpu_plan"] != first
        fresh = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu")
        assert encoder.describe()["cpu_plan"] == fresh.describe()["cpu_plan"]
    finally:
        torch.set_num_threads(threads)
