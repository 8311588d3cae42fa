"""The skeleton both tower designs share; a design (qwen2_5.py, qwen3.py) supplies only what differs.

    forward = validate grids -> the call's execution, from the tower's backend -> the forwards it runs the items as
              -> per forward: per-grid plans from the instance's cache -> one plan on the device
              -> patch embedding (+ positions) -> blocks -> merger (+ DeepStack) -> input token order

Reference: transformers' ``Qwen2VisionTransformerPretrainedModel``, ``Qwen2_5_VisionTransformerPretrainedModel``
and ``Qwen3VLVisionModel`` (v5.24). Module names equal the checkpoint's tensor names without the prefix, except
for what ``names.RULE_SETS`` fuses or renames at load time. Deviations from the reference (same numbers):
grids are read from the host once per forward; per-grid tensors (token order, rope positions, segment lengths,
position taps) are cached per instance in a bounded ``ShapeCache``, concatenated for the pack (into pinned memory
for CUDA) and moved to the device once, where the rope tables are computed, so the block loop does no host sync.
The modules never read an execution state: the tower runs what its ``backend``'s ``Execution`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from ..devices import dtype_name, upload
from ..errors import ConfigError, InputError
from .attention import ATTN_IMPLS, BACKENDS, FUSED, SegmentPlan, resolve_attn_impl
from .cache import ShapeCache
from .config import VisionConfig
from .execution import Backend, Execution, Grid, ReferenceBackend, check_grids
from .layers import AttentionInputs, Block, PatchEmbed, PatchMerger, rope_cos_sin
from .names import to_module_names_


@dataclass
class GridPlan:
    """Everything derived from one grid (t, h, w) on the host; cached per instance."""

    positions: torch.Tensor  # (t*h*w, 2) int32 rope (row, col) of each patch, in the tower's token order
    frame_lengths: list[int]  # in patches
    window_lengths: list[int] | None = None  # windowed designs
    order: torch.Tensor | None = None  # (t*h*w/4,) merged-token order the blocks see, when not the input order
    # learned-position designs: (t*h*w, 4) indices into the position table and their bilinear weights
    position_taps: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardPlan:
    """One packed forward's indices and boundaries, on the device."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (N, hd) fp32, computed on the device
    frames: SegmentPlan
    windows: SegmentPlan | None
    order: torch.Tensor | None  # merged-token permutation into block order (None: input order)
    reverse: torch.Tensor | None  # its inverse, applied to the merger outputs
    position_taps: tuple[torch.Tensor, torch.Tensor] | None  # the grids' GridPlan.position_taps, packed


def compile_boundary(backend):
    """The attention backend as compiled blocks call it: run eagerly (``torch.compiler.disable``: its segment plan
    is host data), returning a tensor of its own whose token dimension is dynamic, so the graph after the break
    neither guards on views nor specialises the token count."""

    def attend(q, k, v, plan, scale, out=None):
        result = backend(q, k, v, plan, scale, out)
        result = result if result._base is None else result.clone()
        torch._dynamo.mark_dynamic(result, 0)
        return result

    return torch.compiler.disable(attend)


def run_block(block: Block, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
    """A block's call as ``compile_blocks`` compiles it: one function for every block, the block an argument.
    torch's ``Module.compile`` would store in each block a compiled call bound to that block, a cycle that only
    the garbage collector frees, so ``del`` of a compiled encoder would keep its weights until a collection."""
    return block(x, inputs)


def accept_checkpoint_names(tower: VisionTower, state_dict: dict, prefix: str, *_load_arguments) -> None:
    """``load_state_dict`` pre-hook (torch's ``register_load_state_dict_pre_hook`` signature): the family's
    checkpoint names put together into the tower's module names (``names.to_module_names_``) before loading."""
    module_names = [name for name, _ in tower.named_parameters()] + [name for name, _ in tower.named_buffers()]
    to_module_names_(tower.config, state_dict, module_names, prefix)


class VisionTower(nn.Module):
    """A Qwen vision tower of any family: patch embedding, blocks, merger and (Qwen3-VL) DeepStack mergers; owns
    ``config``, a bounded per-instance ``shape_cache``, its attention (``set_attention``) and the ``backend`` that
    runs its calls."""

    def __init__(self, config: VisionConfig, cache_size: int = 1024, cache_bytes: int | None = 1 << 30,
                 attn_impl: str = "auto") -> None:
        super().__init__()
        self.config = config
        spec = config.family
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size, config.patch_size,
                                      config.hidden_size, bias=spec.patch_bias)
        self.blocks = nn.ModuleList(
            Block(config.hidden_size, config.num_heads, config.intermediate_size, config.hidden_act, spec.norm,
                  spec.mlp)
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(config.hidden_size, config.out_hidden_size, config.merge_unit, spec.norm)
        if spec.deepstack:
            self.deepstack_merger_list = nn.ModuleList(
                PatchMerger(config.hidden_size, config.out_hidden_size, config.merge_unit, spec.norm,
                            norm_after_view=True)
                for _ in config.deepstack_visual_indexes
            )
        self.deepstack_level = {block: level for level, block in enumerate(config.deepstack_visual_indexes)}
        self.full_attention_blocks = config.full_attention_blocks
        # A plain attribute, not a module/buffer: it is not saved, moved by .to() or shared between instances.
        self.shape_cache = ShapeCache(cache_size, cache_bytes)
        self.compiled_block: Callable | None = None  # compile_blocks' run_block
        # load_state_dict takes the family's checkpoint names too (transformers' tower's state dict, a released
        # checkpoint's tensors without prefix): stacked and renamed as they arrive, still strict.
        self.register_load_state_dict_pre_hook(accept_checkpoint_names)
        self.backend: Backend = ReferenceBackend()
        # (placement it was chosen for, backend name, callable); attention_backend is the one place that sets it.
        self.attention_choice: tuple[tuple, str, Callable] | None = None
        self.set_attention(attn_impl)

    # ------------------------------------------------------------------ what a design supplies

    def compute_grid_plan(self, grid: Grid) -> GridPlan:
        raise NotImplementedError

    def embed(self, pixel_values: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
        """Patch embedding of the rows, in block order (the design may add positions)."""
        if plan.order is not None:  # groups of merge_unit rows follow their merged token
            unit, width = self.config.merge_unit, pixel_values.shape[-1]
            pixel_values = pixel_values.reshape(-1, unit, width)[plan.order].reshape(-1, width)
        return self.patch_embed(pixel_values)

    # ------------------------------------------------------------------ the skeleton

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values (sum t*h*w, C*T*P*P) in merge-block order -> (merged tokens (sum t*h*w/4, out) in input
        order, DeepStack levels of the same shape, [] for towers without DeepStack). The call runs on the one
        execution its backend gives, as the forwards that execution says."""
        grids = self.grid_list(grid_thw)
        self.check_pixels(pixel_values, grids)
        device = self.patch_embed.proj.weight.device
        if pixel_values.device != device:
            pixel_values = upload([pixel_values], device)
        execution = self.backend.execution(self, pixel_values, grids)
        results = [self.forward_pack(rows, pack, execution) for rows, pack in execution.forwards]
        if len(results) == 1:
            return results[0]
        merged = torch.cat([embeddings for embeddings, _ in results])
        return merged, [torch.cat(level) for level in zip(*(levels for _, levels in results), strict=True)]

    def forward_pack(self, pixel_values: torch.Tensor, grids: list[Grid], execution: Execution
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward over a pack of items (``forward``) on the call's execution."""
        plan = self.prepare(grids, pixel_values.device)
        x = self.embed(pixel_values, plan)
        full = execution.attention_inputs(self._dynamic(*plan.rope), plan.frames)
        windowed = full if plan.windows is None else execution.attention_inputs(plan.rope, plan.windows)
        levels, step = [], self.compiled_block or execution.block
        for i, block in enumerate(self.blocks):
            x = step(block, self._dynamic(x)[0], full if i in self.full_attention_blocks else windowed)
            if i in self.deepstack_level:
                levels.append(execution.merger(self.deepstack_merger_list[self.deepstack_level[i]], x))
        merged = execution.merger(self.merger, x)
        if plan.reverse is not None:
            merged, levels = merged[plan.reverse], [level[plan.reverse] for level in levels]
        return merged, levels

    def grid_plan(self, grid: Grid) -> GridPlan:
        return self.shape_cache.get_or_compute(grid, lambda: self.compute_grid_plan(grid))

    def prepare(self, grids: list[Grid], device: torch.device | str = "cpu") -> ForwardPlan:
        """Concatenate the cached per-grid plans for a pack, with offsets, and move them to the device once each;
        the rope tables are computed there from the integer positions (a tenth of the bytes to copy)."""
        plans = [self.grid_plan(g) for g in grids]
        self.attention_backend()
        grouped = self.attention_choice[1] not in FUSED  # the fused kernels take the whole pack: no groups

        order = reverse = None
        if plans[0].order is not None:
            offsets = [0, *accumulate(t * h * w // self.config.merge_unit for t, h, w in grids)]
            order_host = torch.cat([p.order + o for p, o in zip(plans, offsets)])
            order, reverse = upload([order_host], device), upload([torch.argsort(order_host)], device)
        cfg = self.config
        return ForwardPlan(
            rope=rope_cos_sin(upload([p.positions for p in plans], device), cfg.head_dim, cfg.rope_theta),
            frames=SegmentPlan.from_lengths([n for p in plans for n in p.frame_lengths], device, grouped),
            windows=None if plans[0].window_lengths is None else SegmentPlan.from_lengths(
                [n for p in plans for n in p.window_lengths], device, grouped),
            order=order,
            reverse=reverse,
            position_taps=None if plans[0].position_taps is None else tuple(
                upload([p.position_taps[i] for p in plans], device) for i in range(2)),
        )

    # ------------------------------------------------------------------ inputs

    def grid_list(self, grid_thw: torch.Tensor | list) -> list[Grid]:
        """The grids as Python ints (one host read per forward), validated against the merge size."""
        grids = check_grids(grid_thw, self.config.spatial_merge_size, "the tower's input")
        if not grids:
            raise InputError("grid_thw is empty: nothing to encode")
        return grids

    def check_pixels(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        expected_rows = sum(t * h * w for t, h, w in grids)
        width = self.config.patch_dim
        if pixel_values.ndim != 2 or pixel_values.shape != (expected_rows, width):
            raise InputError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({expected_rows}, {width}): "
                f"rows = sum(t*h*w) over grid_thw {grids}, width = C*T*P*P = "
                f"{self.config.in_channels}*{self.config.temporal_patch_size}*{self.config.patch_size}^2"
            )

    # ------------------------------------------------------------------ attention backend and compile

    def set_attention(self, attn_impl: str) -> None:
        """Run attention with ``attn_impl`` ("auto", "sdpa", "flash", "torch_varlen"): checked now for the device
        and dtype the weights are on (ConfigError if it cannot run there; on meta weights, when they arrive)."""
        if attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"attn_impl {attn_impl!r} is not one of {list(ATTN_IMPLS)}")
        self.attn_impl = attn_impl
        self.attention_choice = None
        if not self.patch_embed.proj.weight.is_meta:
            self.attention_backend()

    def attention_backend(self) -> Callable:
        """The backend callable for where the weights are now: the one place the backend is chosen, once per
        forward. It is chosen again only when the weights' device or dtype, ``attn_impl`` or compilation changed
        (a tower moved with ``.to("cuda", torch.bfloat16)`` then runs the fused kernel)."""
        weight = self.patch_embed.proj.weight
        placement = (weight.device, weight.dtype, self.attn_impl, self.compiled)
        if self.attention_choice is None or self.attention_choice[0] != placement:
            name = resolve_attn_impl(self.attn_impl, weight.device, weight.dtype)
            backend = BACKENDS[name]
            self.attention_choice = (placement, name, compile_boundary(backend) if self.compiled else backend)
        return self.attention_choice[2]

    @property
    def attention(self) -> str | None:
        """The name of the backend that runs where the weights are now (None while they are on meta)."""
        if self.patch_embed.proj.weight.is_meta:
            return None
        self.attention_backend()
        return self.attention_choice[1]

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` every block with a dynamic token count: one graph pair serves every block, pack size
        and image mix; attention stays outside the graph (``compile_boundary``). Compiled blocks run out of place
        (inductor plans its own memory). options go to torch.compile, e.g. mode="max-autotune-no-cudagraphs". The
        first forward pays the compile (seconds to minutes); dynamo's code cache is process-wide, and ``close()``
        still frees the weights."""
        if options.get("fullgraph"):
            raise ConfigError("compile_blocks: fullgraph=True is impossible: attention is kept out of the graph "
                             "on purpose (its per-forward segment plan would recompile every new image mix)")
        if options.get("mode") in ("reduce-overhead", "max-autotune"):
            raise ConfigError(f"compile_blocks: mode={options['mode']!r} records CUDA graphs, which need fixed "
                             "shapes; the token count varies per pack. Use 'max-autotune-no-cudagraphs' or 'default'")
        self.backend.release(self)  # inductor plans its own kernels on the modules as the model defines them
        self.compiled_block = torch.compile(run_block, **options)

    @property
    def compiled(self) -> bool:
        return self.compiled_block is not None

    # ------------------------------------------------------------------ the backend that runs the calls

    def use_backend(self, backend: Backend) -> None:
        """Run this tower's calls on ``backend`` from now on; the previous one gives the modules back first."""
        self.backend.release(self)
        self.backend = backend

    def _dynamic(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Compiled blocks: the token count is the one dynamic size of their inputs (so a pack whose token count
        equals a static size, e.g. N == hidden size, does not specialise the graph to N == D). A soft mark: x and the
        rope tables share the token count, a relation a hard ``mark_dynamic`` refuses under dynamo's eager backend."""
        if self.compiled and not torch.compiler.is_compiling():
            for tensor in tensors:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return tensors

    # ------------------------------------------------------------------ reporting

    def describe(self) -> dict:
        """What this tower is and how its calls run (its backend's report), for people and logs."""
        weight = self.patch_embed.proj.weight
        cfg = self.config
        return {
            "family": cfg.model_type, "label": cfg.family.label, "design": cfg.design, "name": cfg.name,
            "depth": cfg.depth, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
            "out_hidden_size": cfg.out_hidden_size, "patch_size": cfg.patch_size,
            "deepstack_levels": len(cfg.deepstack_visual_indexes),
            "attn_impl": self.attn_impl, "attention": self.attention,
            "device": str(weight.device), "dtype": dtype_name(weight.dtype),
            "compiled": self.compiled, "parameters": sum(p.numel() for p in self.parameters()),
            **self.backend.describe(self),
        }

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
