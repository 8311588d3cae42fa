"""Towers of every family against transformers' towers (litgpt-style parity), caches, presets."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from unittest.mock import patch

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwenvl_vision import PRESETS, ConfigError, InputError, build_model, load_encoder, preset
from qwenvl_vision.backends.cpu.backend import CpuBackend
from qwenvl_vision.backends.cpu.kernels import onednn_linear_available
from qwenvl_vision.model.attention import torch_varlen_missing
from qwenvl_vision.model.cache import ShapeCache
from qwenvl_vision.model.config import FAMILIES
from qwenvl_vision.model.execution import ReferenceBackend, one_forward, one_forward_per_item
from qwenvl_vision.model.names import to_checkpoint_state
from tests.helpers import (
    FAMILY_SMALL,
    QWEN2_5_GRIDS,
    QWEN2_5_SMALL,
    QWEN3_GRIDS,
    QWEN3_SMALL_64,
    QWEN3_SMALL_72,
    assert_matches_reference,
    forced_plan,
    forward_both,
    grids_for,
    hf_tower,
    inputs,
    pair,
)

FAMILY_IDS = list(FAMILY_SMALL)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_against_hf_tower_fp32(family):
    """Every family's tower, on a pack mixing a grid that is not a multiple of the window, a 2-frame video, the
    smallest grid and (Qwen3 design) one larger than the position table: merged tokens and every DeepStack level,
    each item within 1e-5 of the reference."""
    cfg = FAMILY_SMALL[family]
    (merged, levels), expected, grid_thw = forward_both(*pair(cfg), cfg, grids_for(cfg))
    assert merged.shape == (int(grid_thw.prod(1).sum()) // 4, cfg.out_hidden_size)
    assert len(levels) == len(cfg.deepstack_visual_indexes)
    assert all(level.shape == merged.shape for level in levels)
    assert_matches_reference((merged, levels), expected, grid_thw, 1e-5)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_bf16_end_to_end_close_to_fp32(family):
    cfg = FAMILY_SMALL[family]
    ours, ref = pair(cfg)
    (merged, levels), expected, grid_thw = forward_both(ours.to(torch.bfloat16), ref, cfg, grids_for(cfg))
    assert merged.dtype == torch.bfloat16 and torch.isfinite(merged).all()
    assert_matches_reference((merged, levels), expected, grid_thw, 3e-2)


@pytest.mark.parametrize("cfg,grids", [(QWEN2_5_SMALL, QWEN2_5_GRIDS), (QWEN3_SMALL_72, QWEN3_GRIDS)],
                         ids=["qwen2.5", "qwen3"])
def test_a_pack_as_one_forward_equals_items_one_by_one(cfg, grids):
    """Attention never crosses an image: a pack run as one forward (as on CUDA; the CPU runs each item alone)
    equals each item encoded alone, item by item."""
    model, _ = pair(cfg)
    pixel_values, grid_thw = inputs(cfg, grids)
    with torch.no_grad():
        with patch.object(model.backend, "forwards", lambda tower: one_forward):
            packed = model(pixel_values, grid_thw)
        singles = [model(chunk, grid_thw[i : i + 1])
                   for i, chunk in enumerate(pixel_values.split(grid_thw.prod(1).tolist()))]
    alone = (torch.cat([merged for merged, _ in singles]),
             [torch.cat(level) for level in zip(*[levels for _, levels in singles])])
    assert_matches_reference(packed, alone, grid_thw, 1e-5)


class RowDependentKernels(TorchDispatchMode):
    """GEMMs and attention whose results' last bits depend on the call's row count (or batch of segments) and on
    each row's place in the call, as some CPUs' kernels do: whatever of an item's result depends on the other
    items of its pack shows as changed bits."""

    GEMMS = {torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.mkldnn._linear_pointwise}
    ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in self.GEMMS:
            self.nudge_(result, result.shape[0])
        elif packet in self.ATTENTION:  # (batch, heads, L, hd): the batch is the count of equal segments
            self.nudge_(result[0].transpose(0, 2), result[0].shape[0])
        return result

    @staticmethod
    def nudge_(x: torch.Tensor, calls_rows: int) -> None:
        place = (torch.arange(x.shape[0]) + calls_rows) % 5
        x.mul_((1 + 8 * torch.finfo(x.dtype).eps * place).to(x.dtype).view(-1, *[1] * (x.ndim - 1)))


@pytest.mark.parametrize("cfg,dtype,kernel", [(QWEN2_5_SMALL, torch.float32, "addmm"),
                                              (QWEN2_5_SMALL, torch.bfloat16, "onednn"),
                                              (QWEN3_SMALL_72, torch.float32, "onednn"),
                                              (QWEN3_SMALL_72, torch.bfloat16, "addmm"),
                                              (QWEN3_SMALL_72, torch.float32, None)],
                         ids=["qwen2.5-fp32-addmm", "qwen2.5-bf16-onednn", "qwen3-fp32-onednn", "qwen3-bf16-addmm",
                              "qwen3-fp32-no-backend"])
def test_an_item_has_the_same_bits_in_any_pack_even_where_kernels_depend_on_the_call(cfg, dtype, kernel):
    """On the CPU each item of a pack runs as its own forward (``model.execution.forwards_on``), so its bits do not
    depend on its neighbours: a property of the code, not of this CPU's kernels. Shown with kernels made to depend
    on the call (``RowDependentKernels``): alone, in a pack and in another order, every item is bitwise the same;
    the same pack run as one forward (what the tower does on CUDA) changes an item, so the check has teeth. A tower
    with no backend attached (``ReferenceBackend``) keeps the rule too."""
    if kernel == "onednn" and not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear ops")
    model = pair(cfg)[0].to(dtype)
    if kernel is None:  # a tower built without the package's backend runs the modules' forward, items alike
        model.use_backend(ReferenceBackend())
    else:
        CpuBackend(forced_plan(model, kernel)).attach(model)
    grids = grids_for(cfg)
    pixel_values, grid_thw = inputs(cfg, grids)
    items = pixel_values.split(grid_thw.prod(1).tolist())

    def encode(order: list[int]) -> dict[int, list[torch.Tensor]]:
        merged, levels = model(torch.cat([items[i] for i in order]), grid_thw[order])
        counts = [int(grid_thw[i].prod()) // cfg.merge_unit for i in order]
        per_level = [output.split(counts) for output in (merged, *levels)]
        return {i: [level[n] for level in per_level] for n, i in enumerate(order)}

    with torch.no_grad(), RowDependentKernels():
        pack = encode(list(range(len(grids))))
        shuffled = encode(list(reversed(range(len(grids)))))
        alone = {i: encode([i])[i] for i in range(len(grids))}
        with patch.object(model.backend, "forwards", lambda tower: one_forward):
            as_one_forward = encode(list(range(len(grids))))
    for i in range(len(grids)):
        assert all(torch.equal(a, b) for a, b in zip(pack[i], alone[i], strict=True)), i
        assert all(torch.equal(a, b) for a, b in zip(shuffled[i], alone[i], strict=True)), i
    assert any(not torch.equal(a, b) for i in pack for a, b in zip(as_one_forward[i], alone[i], strict=True))


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_our_weights_load_into_the_reference_strictly(family):
    """Our fused and renamed tensors go back to exactly the reference's (= the checkpoints') names and shapes."""
    cfg = FAMILY_SMALL[family]
    ours, _ = pair(cfg, seed=3)
    ref = hf_tower(cfg, seed=None)
    ref.load_state_dict(to_checkpoint_state(cfg, ours.state_dict()), strict=True)
    ours_out, expected, grid_thw = forward_both(ours, ref, cfg, grids_for(cfg)[:2])
    assert_matches_reference(ours_out, expected, grid_thw, 1e-5)


def test_window_index_worked_example():
    model = build_model("qwen2.5-vl-3b", device="meta")
    plan = model.prepare([(1, 6, 10)])
    assert plan.order.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 4, 9, 14]
    assert plan.windows.cu_seqlens.tolist() == [0, 48, 60]
    assert plan.frames.cu_seqlens.tolist() == [0, 60]


def test_window_boundaries_of_a_video_and_a_pack():
    model = build_model("qwen2.5-vl-3b", device="meta")
    plan = model.prepare([(2, 8, 8), (1, 6, 10)])
    # Each 8x8 frame is one whole window (the 4x4 merged grid gets an empty padding window, dropped).
    assert plan.windows.cu_seqlens.tolist() == [0, 64, 128, 176, 188]
    assert plan.frames.cu_seqlens.tolist() == [0, 64, 128, 188]
    assert sorted(plan.order.tolist()) == list(range(47))
    assert torch.equal(plan.order[plan.reverse], torch.arange(47))


@pytest.mark.parametrize(
    "name,expected_millions",
    [("qwen2.5-vl-3b", 669), ("qwen2.5-vl-7b", 677), ("qwen3-vl-2b", 407), ("qwen3-vl-8b", 576),
     ("qwen2-vl-7b", 676), ("qwen3.5-0.8b", 101), ("qwen3.8-flash-next", 449)],
)
def test_released_presets_parameter_counts(name, expected_millions):
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == expected_millions


@pytest.mark.parametrize("name,tensors", [("qwen2.5-omni-7b", 518), ("qwen3.8-flash-next", 333)])
def test_presets_need_the_released_tensor_count(name, tensors):
    """The checkpoints' vision tensor counts (518 in Qwen2.5-Omni's index: split q/k/v; 333 in Qwen3.8-Flash-Next)."""
    cfg = preset(name)
    assert len(to_checkpoint_state(cfg, build_model(cfg, device="meta").state_dict())) == tensors


def test_every_preset_builds_on_meta():
    assert {cfg.family for cfg in PRESETS.values()} == set(FAMILIES.values())
    for name, cfg in PRESETS.items():
        model = build_model(name, device="meta")
        # The module shapes follow from the released numbers (plain arithmetic, not the builder's own code).
        d, merged = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        mlp_in = 2 * cfg.intermediate_size if cfg.family.mlp == "gated" else cfg.intermediate_size
        shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
        assert len(model.blocks) == cfg.depth, name
        assert shapes["patch_embed.proj.weight"] == (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                                     cfg.patch_size), name
        assert shapes["blocks.0.attn.qkv.weight"] == (3 * d, d), name
        assert shapes["blocks.0.mlp." + ("gate_up_proj" if cfg.family.mlp == "gated" else "linear_fc1") + ".weight"] \
            == (mlp_in, d), name
        assert shapes["merger.linear_fc1.weight"] == (merged, merged), name
        assert shapes["merger.linear_fc2.weight"] == (cfg.out_hidden_size, merged), name
        deepstack = [k for k in shapes if k.startswith("deepstack_merger_list.") and k.endswith("linear_fc2.weight")]
        assert len(deepstack) == len(cfg.deepstack_visual_indexes), name
        if cfg.design == "qwen3":
            assert shapes["pos_embed.weight"] == (48 * 48, d), name


def test_bad_inputs_are_named():
    model = pair(QWEN2_5_SMALL)[0]
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, [(1, 4, 4)])
    with pytest.raises(InputError, match=r"expected \(16, 1176\)"):
        model(pixel_values[:-1], grid_thw)
    with pytest.raises(InputError, match="multiples of the merge size"):
        model(pixel_values[:15], torch.tensor([[1, 3, 5]]))
    with pytest.raises(InputError, match=r"\(n, 3\)"):
        model(pixel_values, torch.tensor([1, 4, 4]))
    with pytest.raises(InputError, match="table of integers"):  # the grid check the hand-offs make too
        model(pixel_values, [[1, 4.5, 4]])


# ----------------------------------------------------------------------------- caches


def test_cache_hit_returns_the_identical_object_and_instances_never_share_entries():
    model, other = build_model(QWEN2_5_SMALL), build_model(QWEN2_5_SMALL)
    first = model.grid_plan((1, 6, 10))
    assert model.grid_plan((1, 6, 10)) is first and len(model.shape_cache) == 1
    assert other.shape_cache is not model.shape_cache and len(other.shape_cache) == 0
    assert other.grid_plan((1, 6, 10)) is not first
    model.shape_cache.clear()
    assert model.grid_plan((1, 6, 10)) is not first
    assert len(model.shape_cache) == 1


def test_cache_bounds_hold_and_evict_the_least_recent():
    model = build_model(QWEN3_SMALL_64, cache_size=3)
    plans = {h: model.grid_plan((1, h, 2)) for h in (2, 4, 6, 8)}
    assert len(model.shape_cache) == 3
    assert model.grid_plan((1, 8, 2)) is plans[8] and model.grid_plan((1, 2, 2)) is not plans[2]
    model = build_model(QWEN3_SMALL_64, cache_size=100, cache_bytes=60_000)
    for h in range(2, 40, 2):
        model.grid_plan((1, h, 4))
    assert 0 < model.shape_cache.nbytes <= 60_000


@pytest.mark.parametrize("option", [dict(cache_size=None), dict(cache_size=-1), dict(cache_size=True),
                                    dict(cache_bytes=-5), dict(cache_bytes="1GB")])
def test_cache_bounds_that_bound_nothing_are_refused_by_name_before_any_read(option, tmp_path):
    with pytest.raises(ConfigError, match=next(iter(option))):
        load_encoder(QWEN3_SMALL_64, random_weights=True, device="cpu", **option)
    with pytest.raises(ConfigError, match=next(iter(option))):  # a folder of nothing: refused before it is looked at
        load_encoder(tmp_path / "no-such-checkpoint", **option)


def test_threads_hammering_new_shapes_match_serial():
    model = pair(QWEN2_5_SMALL)[0]
    grids = [(1, 2 * i, 2 * j) for i in range(1, 5) for j in range(1, 5)]
    packs = [inputs(QWEN2_5_SMALL, [g], seed=i) for i, g in enumerate(grids)]
    with torch.no_grad():
        fresh = pair(QWEN2_5_SMALL)[0]
        serial = [fresh(*x)[0] for x in packs]
    barrier = threading.Barrier(8)
    computed, compute = [], model.compute_grid_plan

    def counted(grid):
        computed.append(tuple(grid))
        time.sleep(0.02)  # long enough for the other threads on this grid to ask for it meanwhile
        return compute(grid)

    model.compute_grid_plan = counted

    def worker(tid: int) -> dict[int, tuple[torch.Tensor, object]]:
        barrier.wait()
        done = {}
        for k in range(len(packs)):
            i = (k + tid % 2) % len(packs)  # four threads on each grid at once
            with torch.no_grad():
                done[i] = (model(*packs[i])[0], model.grid_plan(grids[i]))
        return done

    with ThreadPoolExecutor(8) as pool:
        threads = list(pool.map(worker, range(8)))  # a worker's exception is raised here
    for done in threads:
        for i, (out, plan) in done.items():
            assert torch.equal(out, serial[i]), grids[i]
            assert plan is threads[0][i][1]  # every thread got the one computed value
    assert sorted(computed) == sorted(grids)  # each grid computed once, every other thread waiting for it


def test_model_freed_by_del_after_forwards():
    model = pair(QWEN2_5_SMALL)[0]
    with torch.no_grad():
        for grids in ([(1, 4, 4)], [(1, 6, 10), (2, 8, 8)], [(1, 2, 2)]):
            model(*inputs(QWEN2_5_SMALL, grids))
    assert len(model.shape_cache) == 4
    ref = weakref.ref(model)
    cache_ref = weakref.ref(model.shape_cache)
    gc.disable()
    try:
        del model
        assert ref() is None and cache_ref() is None  # by reference counting alone, no cycles
    finally:
        gc.enable()


def test_attention_plan_runs_large_windows_in_place_and_batches_small_ones():
    model = build_model("qwen2.5-vl-3b", device="meta")
    # A large frame: every full window of it is one contiguous run (a view, no gather), longest first.
    plan = model.prepare([(1, 110, 146), (2, 32, 32)])
    assert all(group.index is None for group in plan.windows.groups)
    assert plan.windows.groups[0].length == 64 and plan.windows.groups[0].start == 0
    assert sum(g.length * g.count for g in plan.windows.groups) == 110 * 146 + 2 * 32 * 32
    # Many small images: their equal segments are gathered into one batched call, not one call each.
    plan = model.prepare([(1, 6, 10), (1, 4, 4)] * 8)
    gathered = [g for g in plan.frames.groups if g.index is not None]
    assert {(g.length, g.count) for g in gathered} == {(60, 8), (16, 8)}
    assert len(plan.frames.groups) == 2


def test_the_shape_cache_hands_evicted_entries_pages_back_to_the_os(monkeypatch):
    """Every TRIM_EVERY_BYTES of evicted entries, and on clear, the heap is trimmed (glibc keeps freed pages of
    evicted entries resident otherwise: RSS crept after the cache was full)."""
    from qwenvl_vision.model import cache

    trims = []
    monkeypatch.setattr(cache, "return_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(cache, "TRIM_EVERY_BYTES", 1 << 20)
    shapes = cache.ShapeCache(maxsize=2, max_bytes=None)
    for grid in range(10):  # 512 KiB each: 8 evicted, 4 MiB
        shapes.get_or_compute(grid, lambda: torch.zeros(1 << 17))
    assert len(shapes) == 2 and len(trims) == 4
    shapes.clear()
    assert len(trims) == 5


def test_a_cache_hit_makes_its_grid_the_most_recent():
    model = build_model(QWEN3_SMALL_64, cache_size=2)
    hot = model.grid_plan((1, 2, 2))
    model.grid_plan((1, 4, 2))
    assert model.grid_plan((1, 2, 2)) is hot
    model.grid_plan((1, 6, 2))  # evicts (1, 4, 2), the least recently used
    assert model.grid_plan((1, 2, 2)) is hot
    assert len(model.shape_cache) == 2


def test_an_image_and_a_video_of_one_frame_size_each_get_their_own_plan():
    model = build_model(QWEN2_5_SMALL)
    image, video = model.grid_plan((1, 8, 8)), model.grid_plan((2, 8, 8))
    assert video is not image and len(model.shape_cache) == 2
    assert len(video.positions) == 2 * len(image.positions) and video.frame_lengths == [64, 64]
    assert len(video.order) == 2 * len(image.order)


def test_a_grid_of_no_frames_is_refused():
    model = pair(QWEN2_5_SMALL)[0]
    pixel_values, _ = inputs(QWEN2_5_SMALL, [(1, 4, 4)])
    with pytest.raises(InputError, match=r"item 1: grid \(0, 4, 4\)"):
        model(pixel_values, [[1, 4, 4], [0, 4, 4]])


def test_pixel_rows_of_the_wrong_width_are_named():
    model = pair(QWEN2_5_SMALL)[0]
    pixel_values, grid_thw = inputs(QWEN2_5_SMALL, [(1, 4, 4)])
    with pytest.raises(InputError, match=r"shape \(16, 1175\), expected \(16, 1176\)"):
        model(pixel_values[:, :-1], grid_thw)
    with pytest.raises(InputError, match=r"shape \(1, 16, 1176\), expected \(16, 1176\)"):
        model(pixel_values[None], grid_thw)


def test_each_item_runs_on_contiguous_rows_aligned_to_64_bytes_whatever_the_pack_s_address():
    """Where a GEMM's rounding may follow its operand's address, an item's bits must not follow its batch's."""
    grids = [(1, 2, 2), (1, 4, 4)]
    width, rows = QWEN2_5_SMALL.patch_dim, 4 + 16
    pixel_values = torch.randn(rows * width + 1)[1:].view(rows, width)  # 4 bytes past an aligned start
    assert pixel_values.data_ptr() % 64
    forwards = one_forward_per_item(pixel_values, grids)
    assert [g for _, g in forwards] == [[grid] for grid in grids]
    for (item, _), expected in zip(forwards, pixel_values.split([4, 16]), strict=True):
        assert item.is_contiguous() and item.data_ptr() % 64 == 0
        assert torch.equal(item, expected)


def test_an_entry_over_the_byte_bound_is_handed_back_without_flushing_the_cache():
    model = build_model(QWEN3_SMALL_64, cache_bytes=20_000)
    small = model.grid_plan((1, 2, 2))
    assert model.grid_plan((1, 64, 64)) is not None  # its taps are over the bound: not kept
    assert len(model.shape_cache) == 1 and model.grid_plan((1, 2, 2)) is small


def test_a_failed_computation_is_not_cached_and_the_next_call_computes_again():
    shapes = ShapeCache()

    def fail():
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        shapes.get_or_compute((1, 2, 2), fail)
    assert len(shapes) == 0
    assert shapes.get_or_compute((1, 2, 2), lambda: torch.zeros(3)).tolist() == [0, 0, 0]
    assert len(shapes) == 1


def test_clear_empties_the_byte_count_too():
    model = build_model(QWEN3_SMALL_64, cache_bytes=60_000)
    model.grid_plan((1, 20, 20))
    model.shape_cache.clear()
    assert len(model.shape_cache) == 0 and model.shape_cache.nbytes == 0
    for h in (2, 4, 6):
        model.grid_plan((1, h, 4))
    assert len(model.shape_cache) == 3


def test_a_copied_tower_has_its_own_empty_cache():
    model = build_model(QWEN2_5_SMALL, cache_size=7)
    model.grid_plan((1, 4, 4))
    copied = copy.deepcopy(model)
    assert copied.shape_cache is not model.shape_cache and len(copied.shape_cache) == 0
    assert copied.shape_cache.maxsize == 7 and len(model.shape_cache) == 1


def test_built_towers_are_frozen_and_in_eval_mode_so_a_call_records_no_graph():
    for model in (build_model(QWEN2_5_SMALL), build_model(QWEN3_SMALL_64, device="meta")):
        assert not model.training and not any(p.requires_grad for p in model.parameters())
    model = build_model(QWEN2_5_SMALL)
    merged, _ = model(*inputs(QWEN2_5_SMALL, [(1, 4, 4)]))  # no torch.no_grad(): still no autograd graph
    assert not merged.requires_grad


def test_the_attention_backend_is_chosen_again_when_the_weights_change_dtype():
    if torch_varlen_missing() is not None:
        pytest.skip(torch_varlen_missing())
    model = build_model(QWEN2_5_SMALL, device="meta")
    assert model.prepare([(1, 8, 8)]).frames.groups  # sdpa in fp32: equal segments grouped
    model.to(torch.bfloat16)
    assert model.prepare([(1, 8, 8)]).frames.groups == []  # torch_varlen: the whole pack at once
    assert model.attention_choice[1] == "torch_varlen"
