"""oneDNN's prepacked linear weights on the CPU (qwenvl_vision.cpu_linear): outputs against transformers' towers
per item (bf16 bitwise plain addmm's, but for the MLP activation oneDNN computes in its epilogue, where this
machine's kernels give those bits), the epilogue closer to float64, one copy
of each weight, plain tensors out of state_dict and extract-weights, loads into a packed tower, close() and
teardown, threads, autograd, compile."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers.activations import ACT2FN

from qwenvl_vision import ConfigError, build_model, cpu_linear, layers, load_encoder
from qwenvl_vision.cli import main
from qwenvl_vision.cpu_linear import (
    DECISIONS,
    PackableLinear,
    balanced_chunks,
    measure_kernels,
    onednn_linear_available,
    pack_weight,
    packed_linear,
)
from qwenvl_vision.layers import Workspace
from tests.helpers import (
    FAMILY_SMALL,
    QWEN2_5_SMALL,
    QWEN3_SMALL_72,
    assert_matches_reference,
    census,
    grids_for,
    hf_forward,
    hf_tower,
    inputs,
    ours_from,
    packed_gives_addmm_bits,
    rel_err,
    write_checkpoint,
)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear ops")


def packed_count(model) -> int:
    return sum(p.is_mkldnn for p in model.parameters())


@pytest.mark.parametrize("family", list(FAMILY_SMALL))
def test_packed_towers_match_transformers_per_item(family, tmp_path):
    cfg = FAMILY_SMALL[family]
    write_checkpoint(tmp_path, cfg)
    encoder = load_encoder(tmp_path, device="cpu", linear_kernel="onednn")
    assert packed_count(encoder.model) == len(encoder.model.linear_layers()) > 0
    ref = hf_tower(cfg, seed=0)
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    result = encoder.encode_patches(pixel_values, grid_thw)
    with torch.no_grad():
        expected = hf_forward(ref, pixel_values, grid_thw)
    ours = (torch.cat(result.embeddings), [torch.cat([item[i] for item in result.deepstack])
                                          for i in range(len(expected[1]))])
    assert_matches_reference(ours, expected, grid_thw, 1e-5)


@pytest.mark.parametrize("cfg", [QWEN2_5_SMALL, QWEN3_SMALL_72, FAMILY_SMALL["qwen2_vl"]],
                         ids=["qwen2.5", "qwen3", "qwen2-vl"])
def test_bf16_packed_tower_within_tolerance_and_addmm_bitwise_where_this_machine_probes_so(cfg, monkeypatch):
    """A bf16 tower on oneDNN's packed weights, its rows handed to rope, the activation and the residual add in
    chunks (layers.linear_chunks), its MLPs by row blocks, chunks and blocks of a few dozen rows so that every
    pack crosses many of them: within test_towers' bf16 tolerance of the fp32 tower per item, like the plain one.
    Bitwise the plain addmm tower (oneDNN's epilogue activation turned off) only where this machine's probe shows
    a packed linear on such chunks gives addmm's bits (``packed_gives_addmm_bits``: on some CPUs it does, on
    others the two weights take different kernels). Where oneDNN computes a plain MLP's activation in its GEMM's
    epilogue (Qwen3's GELU-tanh), the hidden activations skip one bf16 rounding: one MLP alone is closer to
    float64 than the plain one, on any CPU."""
    chunk_bytes, block_rows = 16 << 10, 24
    monkeypatch.setattr(cpu_linear, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(layers, "MLP_BLOCK_ROWS", block_rows)
    ref = hf_tower(cfg, seed=0)
    plain = ours_from(ref, cfg).to(torch.bfloat16)
    packed = ours_from(ref, cfg).to(torch.bfloat16)
    packed.pack_linear_weights_("onednn")
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        a, levels_a = plain(pixel_values, grid_thw)
        with monkeypatch.context() as no_epilogue:
            no_epilogue.setattr(layers, "EPILOGUE_ACTIVATIONS", {})
            b, levels_b = packed(pixel_values, grid_thw)
        fused = packed(pixel_values, grid_thw)
        exact = ours_from(ref, cfg)(pixel_values, grid_thw)
    assert_matches_reference((b, levels_b), exact, grid_thw, 3e-2)  # test_towers' bf16 tolerance, per item
    shapes = [(layer.in_features, layer.out_features) for _, layer in packed.linear_layers()]
    patches = grid_thw.prod(1).tolist()  # each item runs as its own forward: its rows, and its mergers' rows / 4
    rows = sorted({*patches, *(n // cfg.merge_unit for n in patches)})
    steps = sorted({block_rows, *(max(1, chunk_bytes // (out * 2)) for _, out in shapes)})
    bitwise = packed_gives_addmm_bits(shapes, torch.bfloat16, rows, steps)
    if bitwise:
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(levels_a, levels_b, strict=True))
    if cfg.hidden_act not in cpu_linear.EPILOGUE_ACTIVATIONS or cfg.spec.mlp == "gated":
        assert not bitwise or torch.equal(fused[0], a)  # no epilogue activation in this family's MLP
        return
    assert not torch.equal(fused[0], b)
    assert_matches_reference(fused, exact, grid_thw, 3e-2)
    # One MLP alone (no residual to round the update away): closer to float64 than the plain MLP.
    x = torch.randn(200, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    mlp_plain, mlp_packed = plain.blocks[0].mlp, packed.blocks[0].mlp
    fc1, fc2 = (layer.weight.double() for layer in (mlp_plain.linear_fc1, mlp_plain.linear_fc2))
    hidden = ACT2FN[cfg.hidden_act](x.double() @ fc1.T + mlp_plain.linear_fc1.bias.double())
    want = hidden @ fc2.T + mlp_plain.linear_fc2.bias.double()
    wide = max(3 * cfg.hidden_size, mlp_plain.linear_fc1.out_features)  # as the tower sizes its workspace
    with torch.no_grad(), Workspace(200, cfg.hidden_size, wide, torch.bfloat16, torch.device("cpu")).active():
        got = {name: mlp(x, residual=torch.zeros_like(x)).double() for name, mlp in
               [("plain", mlp_plain), ("packed", mlp_packed)]}
    assert rel_err(got["packed"], want) < rel_err(got["plain"], want)


@pytest.mark.parametrize("name", sorted(cpu_linear.EPILOGUE_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogue_activations_are_transformers_activations(name, dtype):
    """oneDNN's activation in the GEMM's epilogue against transformers' on the linear's result: within fp32's
    rounding in fp32; in bf16 closer to float64 than the linear rounded and then activated."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 96, generator=gen) * 2).to(dtype)
    weight = (torch.randn(160, 96, generator=gen) / 5).to(dtype)
    bias = torch.randn(160, generator=gen).to(dtype)
    fused = cpu_linear.packed_activated_linear(x, pack_weight(weight), bias, name)
    separate = ACT2FN[name](torch.nn.functional.linear(x, weight, bias))
    exact = ACT2FN[name](torch.nn.functional.linear(x.double(), weight.double(), bias.double()))
    if dtype == torch.float32:
        assert rel_err(fused, separate) < 1e-6
    else:
        assert rel_err(fused.double(), exact) < rel_err(separate.double(), exact)


def test_a_block_of_a_packed_tower_gives_plain_tensors_too():
    model = build_model(QWEN2_5_SMALL)
    model.pack_linear_weights_("onednn")
    state = model.blocks[0].state_dict()
    assert state and not any(v.is_mkldnn for v in state.values())
    model.blocks[0].load_state_dict(state)
    assert model.blocks[0].attn.qkv.packed


def test_the_packed_weight_replaces_the_plain_one():
    gc.collect()  # the census runs no gc: earlier tests' cyclic garbage would count as live (it failed once so)
    model = build_model(QWEN2_5_SMALL)
    before = census()
    model.pack_linear_weights_("onednn")
    # The plain weights are gone: what is live is the packed ones (the census counts each as its elements), so
    # the total has not grown; keeping the plain weights beside them would have added their bytes again.
    linear_bytes = sum(layer.weight.numel() * 4 for _, layer in model.linear_layers())
    assert packed_count(model) == len(model.linear_layers()) and linear_bytes > before / 2
    assert census() == before


def test_state_dict_and_extract_weights_give_plain_tensors_equal_to_the_checkpoint(tmp_path, capsys):
    vision = write_checkpoint(tmp_path / "ckpt", QWEN2_5_SMALL)
    encoder = load_encoder(tmp_path / "ckpt", device="cpu", linear_kernel="onednn")
    state = encoder.model.state_dict()
    assert not any(v.is_mkldnn for v in state.values())
    qkv = vision["blocks.1.attn.qkv.weight"]
    assert torch.equal(state["blocks.1.attn.qkv.weight"], qkv)  # a layout change, not a rounding
    assert main(["extract-weights", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(vision) and all(torch.equal(saved[k], vision[k]) for k in vision)


def test_a_state_dict_loads_into_a_packed_tower_and_is_packed_again():
    cfg = QWEN3_SMALL_72
    ref = hf_tower(cfg, seed=3)
    model = build_model(cfg)
    model.pack_linear_weights_("onednn")
    model.load_state_dict(ref.state_dict(), strict=True)  # transformers' names, through the load hook
    assert packed_count(model) == len(model.linear_layers())
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad():
        assert_matches_reference(model(pixel_values, grid_thw), hf_forward(ref, pixel_values, grid_thw), grid_thw,
                                 1e-5)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({k: v for k, v in ref.state_dict().items() if "qkv" not in k}, strict=True)


def test_close_frees_packed_weights_and_nothing_stays_behind():
    baseline = census()
    encoder = load_encoder(QWEN3_SMALL_72, random_weights=True, device="cpu", linear_kernel="onednn")
    assert packed_count(encoder.model) > 0 and census() > baseline
    pixel_values, grid_thw = inputs(QWEN3_SMALL_72, grids_for(QWEN3_SMALL_72))
    encoder.encode_patches(pixel_values, grid_thw)
    model = encoder.model
    encoder.close()
    assert all(p.is_meta for p in model.parameters())
    del model, encoder, pixel_values, grid_thw
    assert census() == baseline


def test_threads_share_a_packed_encoder():
    encoder = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", linear_kernel="onednn")
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


def test_one_packed_weight_serves_calls_of_any_row_count(monkeypatch):
    """The reorder's row count is only a hint for the blocking: calls of any row count, and the ``out=`` form by
    row chunks, are fp32-accurate with the one packed weight. (Whether a row's bits depend on its call's row count
    is the CPU's: the tower makes an item's calls the same wherever the item is, ``VisionTower.packs``.)"""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(3000, 64, generator=generator)
    packed = pack_weight(weight, rows=1024)
    exact = x.double() @ weight.double().T + bias.double()
    for rows in (slice(0, 1), slice(0, 7), slice(5, 1029), slice(100, 3000), slice(None)):
        assert rel_err(packed_linear(x[rows].contiguous(), packed, bias), exact[rows]) < 1e-6, rows
    monkeypatch.setattr(cpu_linear, "CHUNK_BYTES", 96 * 4 * 100)  # the workspace form: 30 chunks into a buffer
    out = torch.full((3000, 96), float("nan"))
    assert packed_linear(x, packed, bias, out) is out and rel_err(out, exact) < 1e-6


def test_gradients_through_a_packed_tower_match_the_plain_one():
    """Input gradients, and weight gradients of layers made trainable after packing: the packed kernel has no
    autograd, so such calls take the plain weight."""
    cfg = QWEN2_5_SMALL
    ref = hf_tower(cfg, seed=0)
    plain, packed = ours_from(ref, cfg), ours_from(ref, cfg)
    packed.pack_linear_weights_("onednn")
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    grads = []
    for model in (plain, packed):
        model.blocks[0].attn.qkv.weight.requires_grad_(True)
        x = pixel_values.clone().requires_grad_(True)
        model(x, grid_thw)[0].square().sum().backward()
        grads.append((x.grad, model.blocks[0].attn.qkv.weight.grad))
    assert torch.allclose(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-6)
    assert grads[1][1] is not None
    assert torch.allclose(grads[1][1].to_dense(), grads[0][1], rtol=1e-4, atol=1e-5)


def test_a_packed_tower_moves_and_casts_and_stays_exact():
    cfg = QWEN3_SMALL_72
    ref = hf_tower(cfg, seed=0)
    model = ours_from(ref, cfg)
    model.pack_linear_weights_("onednn")
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    packed_bf16 = ours_from(ref, cfg).to(torch.bfloat16)  # cast, then packed
    packed_bf16.pack_linear_weights_("onednn")
    model.to(torch.bfloat16)  # unpacked, cast, packed again
    assert packed_count(model) == len(model.linear_layers()) and model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(pixel_values, grid_thw)[0], packed_bf16(pixel_values, grid_thw)[0])
    model = ours_from(ref, cfg)
    model.pack_linear_weights_("onednn")
    model.double()  # oneDNN packs no float64: plain weights, still right
    assert packed_count(model) == 0
    with torch.no_grad():
        assert_matches_reference(model(pixel_values.double(), grid_thw), hf_forward(ref, pixel_values, grid_thw),
                                 grid_thw, 1e-5)


def test_autocast_reaches_packed_layers():
    cfg = QWEN2_5_SMALL
    ref = hf_tower(cfg, seed=0)
    plain, packed = ours_from(ref, cfg), ours_from(ref, cfg)
    packed.pack_linear_weights_("onednn")
    pixel_values, grid_thw = inputs(cfg, grids_for(cfg))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(pixel_values, grid_thw)[0], packed(pixel_values, grid_thw)[0]
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_a_packed_layer_on_its_own_calls_saves_and_loads_like_a_linear():
    torch.manual_seed(0)
    layer, plain = PackableLinear(64, 96), PackableLinear(64, 96)
    plain.load_state_dict(layer.state_dict())
    assert layer.pack_("onednn") == "addmm" and not layer.packed  # a trainable weight stays plain
    layer.requires_grad_(False)
    assert layer.pack_("onednn") == "onednn"
    x = torch.randn(10, 64)
    with torch.no_grad():
        assert torch.allclose(layer(x), plain(x), rtol=1e-5, atol=1e-6)
    state = layer.state_dict()
    assert not state["weight"].is_mkldnn and torch.equal(state["weight"], plain.weight)
    other = PackableLinear(64, 96)
    layer.load_state_dict(other.state_dict())  # into the packed layer: packed again
    assert layer.packed and torch.equal(layer.state_dict()["weight"], other.weight)


def test_chunks_are_balanced_and_leave_no_short_tail():
    assert [s.stop - s.start for s in balanced_chunks(1840, 613)] == [460, 460, 460, 460]
    assert [s.stop - s.start for s in balanced_chunks(5, 613)] == [5]
    for rows, step in ((1, 1), (1000, 7), (613 * 3 + 1, 613)):
        chunks = balanced_chunks(rows, step)
        sizes = [s.stop - s.start for s in chunks]
        assert sum(sizes) == rows and max(sizes) <= step and max(sizes) - min(sizes) <= 1


def test_auto_measures_each_shape_once_and_every_tower_of_the_process_agrees():
    first = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu").model
    second = load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu").model
    assert first.linear_kernels == second.linear_kernels
    key = (QWEN2_5_SMALL.hidden_size, 3 * QWEN2_5_SMALL.hidden_size, torch.float32, torch.get_num_threads())
    assert DECISIONS[key] == first.linear_kernels["blocks.0.attn.qkv"]
    seconds = measure_kernels(torch.randn(96, 64), rows=128, repeats=1)
    assert set(seconds) == {"addmm", "onednn"} and all(s > 0 for s in seconds.values())
    assert load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", linear_kernel="addmm").model \
        .linear_kernels == dict.fromkeys(first.linear_kernels, "addmm")
    with pytest.raises(ConfigError, match="linear_kernel 'mkl'"):
        load_encoder(QWEN2_5_SMALL, random_weights=True, device="cpu", linear_kernel="mkl")


@pytest.mark.slow
def test_compiling_unpacks_first():
    model = build_model(QWEN2_5_SMALL)
    model.pack_linear_weights_("onednn")
    model.compile_blocks(backend="eager")
    assert packed_count(model) == 0


def test_a_recorded_choice_replaces_the_packing_a_tower_has():
    model = build_model(QWEN2_5_SMALL)
    model.pack_linear_weights_("onednn")
    recorded = dict.fromkeys(model.linear_kernels, "addmm")
    assert model.pack_linear_weights_(recorded) == recorded and packed_count(model) == 0
    with pytest.raises(ConfigError, match="not this tower's"):
        model.pack_linear_weights_({"blocks.0.attn.qkv": "addmm"})
