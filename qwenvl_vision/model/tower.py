"""The skeleton both tower designs share; a design (qwen2_5.py, qwen3.py) supplies only what differs.

    forward = validate grids -> the forwards the items run as (``packs``: on the CPU one per item)
              -> per forward: per-grid plans from the instance's cache -> one plan on the device
              -> patch embedding (+ positions) -> blocks -> merger (+ DeepStack) -> input token order

Reference: transformers' ``Qwen2VisionTransformerPretrainedModel``, ``Qwen2_5_VisionTransformerPretrainedModel``
and ``Qwen3VLVisionModel`` (v5.24). Module names equal the checkpoint's tensor names without the prefix, except
for what ``names.RULE_SETS`` fuses or renames at load time. Deviations from the reference (same numbers):
grids are read from the host once per forward; per-grid tensors (token order, rope tables, segment lengths,
position taps) are cached per instance in a bounded ``ShapeCache``, concatenated for the pack and moved to the
device once, so the block loop does no host sync; on the CPU each item runs as its own forward (``packs``), which
changes no number.

Execution, chosen once per call (``execution``): the modules' own forward (``ReferenceExecution``: autograd,
autocast, ``torch.compile``, CUDA, and ``cpu_kernels="reference"``), or on the CPU in inference the CPU backend
(``cpu.forward.CpuExecution``) on the machine's measured plan (``cpu.machine``), its linears packed where the plan
says so (``cpu.packing``). Only the tower knows which: the modules never read an execution state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..backends.cpu.forward import CpuExecution
from ..backends.cpu.machine import machine_plan
from ..backends.cpu.packing import (
    PACKING_LOCK,
    block_need,
    dense_state_dict,
    drop_packed_,
    linear_layers,
    pack_linears_,
    plan_needs,
    unpack_linears_,
)
from ..backends.cpu.plan import CpuPlan
from ..backends.cpu.workspace import Workspace
from ..errors import ConfigError, InputError
from .attention import ATTN_IMPLS, BACKENDS, SegmentPlan, resolve_attn_impl
from .cache import ShapeCache
from .config import VisionConfig
from .layers import AttentionInputs, Block, PatchEmbed, PatchMerger
from .names import to_module_names_

Grid = tuple[int, int, int]


@dataclass
class GridPlan:
    """Everything derived from one grid (t, h, w) on the host; cached per instance."""

    cos: torch.Tensor  # (t*h*w, hd) fp32, in the tower's token order
    sin: torch.Tensor
    frame_lengths: list[int]  # in patches
    window_lengths: list[int] | None = None  # windowed designs
    order: torch.Tensor | None = None  # (t*h*w/4,) merged-token order the blocks see, when not the input order
    # learned-position designs: (t*h*w, 4) indices into the position table and their bilinear weights
    position_taps: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardPlan:
    """One packed forward's indices and boundaries, on the device."""

    rope: tuple[torch.Tensor, torch.Tensor]
    frames: SegmentPlan
    windows: SegmentPlan | None
    order: torch.Tensor | None  # merged-token permutation into block order (None: input order)
    reverse: torch.Tensor | None  # its inverse, applied to the merger outputs
    position_taps: tuple[torch.Tensor, torch.Tensor] | None  # the grids' GridPlan.position_taps, packed


def aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` contiguous and 64-byte aligned, copied only where they are not: an item's rows cut from a pack start
    where its neighbours end, and some CPU kernels round by the address of their input (MKL without its
    reproducibility mode)."""
    if rows.is_contiguous() and rows.data_ptr() % 64 == 0:
        return rows
    return rows.clone(memory_format=torch.contiguous_format)


class ReferenceExecution:
    """The modules' own forward (``layers.py``, the math) with the tower's attention backend."""

    name = "reference"

    def __init__(self, attend: Callable) -> None:
        self.attend = attend

    def attention_inputs(self, rope: tuple[torch.Tensor, torch.Tensor], segments: SegmentPlan) -> AttentionInputs:
        return AttentionInputs(rope, segments, self.attend)

    def block(self, block: Block, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        return block(x, inputs)

    def merger(self, merger: PatchMerger, x: torch.Tensor) -> torch.Tensor:
        return merger(x)


CPU_KERNELS = ("auto", "reference")


def check_cpu_kernels(cpu_kernels: str | dict | CpuPlan) -> str | CpuPlan:
    """"auto" (the machine's measured plan), "reference" (the modules' own ops: addmm and SDPA, out of place), or a
    plan (a ``CpuPlan`` or its dict, as a run recorded it: the same kernels again, the same bits)."""
    if isinstance(cpu_kernels, CpuPlan):
        return cpu_kernels
    if isinstance(cpu_kernels, dict):
        return CpuPlan.from_dict(cpu_kernels)
    if cpu_kernels not in CPU_KERNELS:
        raise ConfigError(f"cpu_kernels {cpu_kernels!r} is not one of {list(CPU_KERNELS)} or a CPU plan")
    return cpu_kernels


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


def accept_checkpoint_names(tower: VisionTower, state_dict: dict, prefix: str, *_load_arguments) -> None:
    """``load_state_dict`` pre-hook (torch's ``register_load_state_dict_pre_hook`` signature): the family's
    checkpoint names put together into the tower's module names (``names.to_module_names_``) before loading."""
    module_names = [name for name, _ in tower.named_parameters()] + [name for name, _ in tower.named_buffers()]
    to_module_names_(tower.config, state_dict, module_names, prefix)


def autocasting(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def unpack_before_load(tower: VisionTower, *_load_arguments) -> None:
    """``load_state_dict`` pre-hook: a packed tensor cannot be copied into; the next CPU forward packs again."""
    tower.unpack_linear_weights_()


class VisionTower(nn.Module):
    """A Qwen vision tower of any family: patch embedding, blocks, merger and (Qwen3-VL) DeepStack mergers.

    Owns ``config``, a bounded per-instance ``shape_cache`` and its attention backend (``attn_impl``: "auto",
    "sdpa", "flash" or "torch_varlen", resolved for the device and dtype the tower runs on).
    """

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
        self.compiled = False
        # load_state_dict takes the family's checkpoint names too (transformers' tower's state dict, a released
        # checkpoint's tensors without prefix): stacked and renamed as they arrive, still strict.
        self.register_load_state_dict_pre_hook(accept_checkpoint_names)
        # The CPU backend's setting, the plan it resolved to for the weights' dtype, and the plan the linears are
        # packed for (``prepare_cpu_``). Packed weights leave as plain tensors, are unpacked to load into and to move.
        self.cpu_kernels: str | CpuPlan = "auto"
        self.cpu_plan: CpuPlan | None = None
        self.packed_plan: CpuPlan | None = None
        for module in self.modules():  # a packed weight leaves as a plain tensor from any module's state_dict
            if isinstance(module, nn.Linear):
                module.register_state_dict_post_hook(dense_state_dict)
        self.register_load_state_dict_pre_hook(unpack_before_load)
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
        order, DeepStack levels of the same shape, [] for towers without DeepStack). The items run as the
        forwards ``packs`` says, all on one execution (``execution``)."""
        grids = self.grid_list(grid_thw)
        self.check_pixels(pixel_values, grids)
        device = self.patch_embed.proj.weight.device
        pixel_values = pixel_values.to(device, non_blocking=True)
        packs = self.packs(grids, device)
        rows = [sum(t * h * w for t, h, w in pack) for pack in packs]
        execution = self.execution(max(rows), pixel_values)
        results = [self.forward_pack(aligned(pixels), pack, execution)
                   for pixels, pack in zip(pixel_values.split(rows), packs, strict=True)]
        if len(results) == 1:
            return results[0]
        merged = torch.cat([embeddings for embeddings, _ in results])
        return merged, [torch.cat(level) for level in zip(*(levels for _, levels in results), strict=True)]

    def packs(self, grids: list[Grid], device: torch.device) -> list[list[Grid]]:
        """The forwards a pack of items runs as: on the CPU one per item, elsewhere one for the whole pack.

        Why: an item's result must not depend on the items beside it (every output path, resume, rank and Ray
        actor batches differently and promises the same tensors). On some CPUs a GEMM row's bits depend on the
        call's row count or on the row's place in it (and a threaded elementwise kernel's vector/scalar split
        falls where the call's length puts it), so on the CPU each item runs alone: the same calls on the same
        rows whatever its neighbours, on any CPU, at a given thread count and kernel choice. Its GEMMs are one
        item's rows instead of the pack's, which costs little at the towers' sizes (docs/benchmarks.md). On
        CUDA a pack of small images alone would be launch-bound: it runs whole, and an item agrees across
        batchings within its dtype's rounding."""
        return [[grid] for grid in grids] if device.type == "cpu" else [grids]

    def forward_pack(self, pixel_values: torch.Tensor, grids: list[Grid], execution: ReferenceExecution | CpuExecution
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward over a pack of items (``forward``) on the call's execution."""
        plan = self.prepare(grids, pixel_values.device)
        x = self.embed(pixel_values, plan)
        full = execution.attention_inputs(self._dynamic(*plan.rope), plan.frames)
        windowed = full if plan.windows is None else execution.attention_inputs(plan.rope, plan.windows)
        levels = []
        for i, block in enumerate(self.blocks):
            x = execution.block(block, self._dynamic(x)[0], full if i in self.full_attention_blocks else windowed)
            if i in self.deepstack_level:
                levels.append(execution.merger(self.deepstack_merger_list[self.deepstack_level[i]], x))
        merged = execution.merger(self.merger, x)
        if plan.reverse is not None:
            merged, levels = merged[plan.reverse], [level[plan.reverse] for level in levels]
        return merged, levels

    def grid_plan(self, grid: Grid) -> GridPlan:
        return self.shape_cache.get_or_compute(grid, lambda: self.compute_grid_plan(grid))

    def prepare(self, grids: list[Grid], device: torch.device | str = "cpu") -> ForwardPlan:
        """Concatenate the cached per-grid plans for a pack, with offsets, and move them to the device once."""
        plans = [self.grid_plan(g) for g in grids]

        def packed(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(tensors).to(device, non_blocking=True)

        order = reverse = None
        if plans[0].order is not None:
            offsets, offset = [], 0
            for t, h, w in grids:
                offsets.append(offset)
                offset += t * h * w // self.config.merge_unit
            order_host = torch.cat([p.order + o for p, o in zip(plans, offsets)])
            order, reverse = order_host.to(device, non_blocking=True), packed([torch.argsort(order_host)])
        windows = None
        if plans[0].window_lengths is not None:
            windows = SegmentPlan.from_lengths([n for p in plans for n in p.window_lengths], device)
        return ForwardPlan(
            rope=(packed([p.cos for p in plans]), packed([p.sin for p in plans])),
            frames=SegmentPlan.from_lengths([n for p in plans for n in p.frame_lengths], device),
            windows=windows,
            order=order,
            reverse=reverse,
            position_taps=None if plans[0].position_taps is None else (
                packed([p.position_taps[0] for p in plans]), packed([p.position_taps[1] for p in plans])),
        )

    # ------------------------------------------------------------------ inputs

    def grid_list(self, grid_thw: torch.Tensor | list) -> list[Grid]:
        """The grids as Python ints (one host read per forward), validated against the merge size."""
        if isinstance(grid_thw, torch.Tensor):
            if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
                raise InputError(f"grid_thw must have shape (n, 3), got {tuple(grid_thw.shape)}")
            if grid_thw.is_floating_point():
                raise InputError(f"grid_thw must be an integer tensor, got {grid_thw.dtype}")
            rows = grid_thw.tolist()
        else:
            rows = [list(g) for g in grid_thw]
        grids: list[Grid] = []
        merge = self.config.spatial_merge_size
        for i, row in enumerate(rows):
            if len(row) != 3:
                raise InputError(f"grid_thw[{i}] must be (t, h, w), got {row}")
            t, h, w = (int(v) for v in row)
            if t < 1 or h < 1 or w < 1:
                raise InputError(f"grid_thw[{i}] = {(t, h, w)} has a non-positive entry")
            if h % merge or w % merge:
                raise InputError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge size {merge}")
            grids.append((t, h, w))
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
        (a tower moved with ``.to("cuda", torch.bfloat16)`` then runs the fused kernel). Compiled blocks reach it
        through the tower's one compile boundary."""
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
        and image mix.

        The attention backend is the compile boundary (``torch.compiler.disable``): its segment plan is host
        data computed per forward. Compiled blocks run out of place (inductor plans its own memory). options go
        to torch.compile, e.g. mode="max-autotune-no-cudagraphs". The first forward pays the compile (seconds
        to minutes); dynamo's code cache is process-wide, and ``close()`` still frees the weights.
        """
        if options.get("fullgraph"):
            raise ConfigError("compile_blocks: fullgraph=True is impossible: attention is kept out of the graph "
                             "on purpose (its per-forward segment plan would recompile every new image mix)")
        if options.get("mode") in ("reduce-overhead", "max-autotune"):
            raise ConfigError(f"compile_blocks: mode={options['mode']!r} records CUDA graphs, which need fixed "
                             "shapes; the token count varies per pack. Use 'max-autotune-no-cudagraphs' or 'default'")
        self.unpack_linear_weights_()  # inductor plans its own kernels; dynamo does not trace opaque tensors
        self.compiled = True
        self.cpu_plan = None
        for block in self.blocks:
            block.compile(**options)

    # ------------------------------------------------------------------ the CPU backend

    def set_cpu_kernels(self, cpu_kernels: str | dict | CpuPlan = "auto") -> None:
        """How the CPU runs inference: "auto" (the machine's measured plan, ``cpu.machine.machine_plan``),
        "reference" (the modules' own ops: transformers' addmm and SDPA), or a plan (a ``CpuPlan`` or its dict,
        e.g. a run's recorded one). Applied now where the weights are on the CPU (measuring what this machine's
        plan lacks, packing the linears it runs on oneDNN), else when they arrive there."""
        self.cpu_kernels = check_cpu_kernels(cpu_kernels)
        self.cpu_plan = None
        self.prepare_cpu_()

    def prepare_cpu_(self) -> CpuPlan | None:
        """The plan the CPU backend runs now (None: the modules' own forward), its linears packed for it.

        Packing changes the tower's Parameters (one lock for every tower, so that concurrent first calls pack
        once), outside inference mode (they stay ordinary tensors). Calls on one tower from several threads are
        safe while they all run inference, or all the modules' forward; mixing the two at once is not."""
        weight = self.patch_embed.proj.weight
        if self.cpu_kernels == "reference" or weight.device.type != "cpu" or weight.is_meta or self.compiled:
            if self.packed_plan is not None:
                self.unpack_linear_weights_()
            return None
        if self.cpu_plan is not None and self.packed_plan is self.cpu_plan:
            return self.cpu_plan  # the steady state: no lock taken
        with PACKING_LOCK, torch.inference_mode(False), torch.no_grad():
            if self.cpu_plan is None:
                given = self.cpu_kernels
                self.cpu_plan = machine_plan(plan_needs(self)) if given == "auto" else given
            if self.packed_plan is not self.cpu_plan:
                pack_linears_(self, self.cpu_plan)
                self.packed_plan = self.cpu_plan
            return self.cpu_plan

    def unpack_linear_weights_(self) -> None:
        with PACKING_LOCK, torch.inference_mode(False), torch.no_grad():
            unpack_linears_(self)
            self.packed_plan = None

    def free_weights_(self) -> None:
        """Every parameter and buffer replaced by a storage-less meta tensor (``VisionEncoder.close``): a reference
        to the module kept elsewhere no longer pins the weights."""
        drop_packed_(self)
        self.packed_plan = None
        self.to("meta")

    def _apply(self, fn, recurse=True):
        # Packed tensors support no conversion: moved plain, packed again for the new dtype by the next forward.
        self.unpack_linear_weights_()
        self.cpu_plan = None
        return super()._apply(fn, recurse)

    def _dynamic(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Compiled blocks: the token count is the one dynamic size of their inputs (so a pack whose token count
        equals a static size, e.g. N == hidden size, does not specialise the graph to N == D)."""
        if self.compiled and not torch.compiler.is_compiling():
            for tensor in tensors:
                torch._dynamo.mark_dynamic(tensor, 0)
        return tensors

    # ------------------------------------------------------------------ the execution of a call

    def execution(self, rows: int, pixel_values: torch.Tensor) -> ReferenceExecution | CpuExecution:
        """How this call runs, chosen once: the CPU backend in CPU inference on a plan (its workspace sized for
        ``rows`` hidden states), else the modules' own forward (compiled blocks, inside a compiled graph, under
        autocast, when autograd is recording, off the CPU, with ``cpu_kernels="reference"``, and while a module
        has forward hooks: the CPU backend calls no module's forward, and a hook is there to see one)."""
        weight = self.patch_embed.proj.weight
        reference = (self.compiled or torch.compiler.is_compiling() or self._recording_grad(pixel_values)
                     or autocasting(weight.device.type) or self.hooked())
        plan = None if reference else self.prepare_cpu_()
        if plan is None:
            if any(m.weight.is_mkldnn for _, m in linear_layers(self)):
                # the modules' forward takes plain weights; the next CPU call packs. Inside a traced forward too:
                # Parameters are swapped, not computed
                unpack = self.unpack_linear_weights_
                (torch.compiler.disable(unpack) if torch.compiler.is_compiling() else unpack)()
            return ReferenceExecution(self.attention_backend())
        cfg = self.config
        mlp_width = cfg.intermediate_size * (2 if cfg.family.mlp == "gated" else 1)
        block = block_need(self.blocks[0])
        # the plan's scratch, but at least the widest row through it (rope's q and k, a merger's grouped rows)
        scratch = max(plan.scratch_elements(block), 2 * cfg.hidden_size, cfg.merge_unit * cfg.hidden_size)
        workspace = Workspace(rows, cfg.hidden_size, max(3 * cfg.hidden_size, mlp_width), weight.dtype,
                              weight.device, scratch)
        return CpuExecution(plan, workspace, plan.chunk_bytes(block))

    def hooked(self) -> bool:
        """Whether a forward hook would see a module of this tower run (its own, or a global one)."""
        module_globals = nn.modules.module  # torch's own registry of global hooks (no public getter)
        if getattr(module_globals, "_global_forward_hooks", None) or \
                getattr(module_globals, "_global_forward_pre_hooks", None):
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules() if m is not self)

    def _recording_grad(self, pixel_values: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (pixel_values.requires_grad
                                            or any(p.requires_grad for p in self.parameters()))

    # ------------------------------------------------------------------ reporting

    def describe(self) -> dict:
        """What this tower is and how it runs, for people and logs."""
        weight = self.patch_embed.proj.weight
        cfg = self.config
        return {
            "family": cfg.model_type, "label": cfg.family.label, "design": cfg.design, "name": cfg.name,
            "depth": cfg.depth, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
            "out_hidden_size": cfg.out_hidden_size, "patch_size": cfg.patch_size,
            "deepstack_levels": len(cfg.deepstack_visual_indexes),
            "attn_impl": self.attn_impl, "attention": self.attention,
            "device": str(weight.device), "dtype": str(weight.dtype).replace("torch.", ""),
            "compiled": self.compiled, "parameters": sum(p.numel() for p in self.parameters()),
            "items": "one forward each" if len(self.packs([(1, 2, 2)] * 2, weight.device)) > 1
            else "one forward per pack",
            "execution": "cpu" if self.cpu_plan is not None and self.packed_plan is self.cpu_plan else "reference",
            "cpu_plan": None if self.cpu_plan is None else self.cpu_plan.machine,
            "linear_kernels": {"addmm": sum(not m.weight.is_mkldnn for _, m in linear_layers(self)),
                               "onednn": sum(m.weight.is_mkldnn for _, m in linear_layers(self))},
        }

    def cache_stats(self) -> dict[str, int]:
        return self.shape_cache.stats()

    def clear_cache(self) -> None:
        self.shape_cache.clear()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
