"""Where a forward's time goes, ours against transformers': GEMM, attention, norms, rope, activation, copies.

    python -m bench.profile_tower --preset qwen2.5-vl-3b --inputs photos --dtype bf16

One forward of each tower (same weights, same inputs) under ``torch.profiler``, after a warm-up forward. A tower
that runs its modules (transformers', ours off the CPU backend) has every module's forward wrapped in a
``record_function`` scope; ours on the CPU backend runs its blocks without their modules' forward (and a module hook
would make it run the modules instead), so its steps are scoped instead. Each aten op's self time is attributed to a
category: GEMMs and SDPA kernels by name wherever they run (the CPU's GEMM attention path counts as attention);
every other op by the innermost scope around it
(norm modules -> norm; attention modules -> rope, q/k/v split and other attention glue; MLP modules ->
activation and gate multiply; mergers; the block itself -> residual adds; the rest, e.g. the patch embedding's
copies and the position embedding -> other). The CPU backend's steps (a linear's rows handed straight to the
residual add, the activation or rope: ``FUSED_STEPS``) are scoped by what they do, not by the module around them;
its native kernels (C, no aten op inside) count by their scope's own time.
A packed plain MLP's activation runs inside oneDNN's GEMM where it can and the native kernels do not run it
(``backends.cpu.forward.ACTIVATIONS``: Qwen3's GELU-tanh without them, never Qwen2-VL's quick-GELU) and then counts as
GEMM: compare the towers' totals, not that row. A native residual add fused with a norm counts as norm.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from contextlib import contextmanager

import torch

from bench.throughput import build_variants
from bench.workloads import add_workload_arguments, workload
from qwenvl_vision.backends.cpu import forward
from qwenvl_vision.backends.cpu.forward import CpuExecution
from qwenvl_vision.backends.cpu.native import NativeKernels
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.model.tower import VisionTower

GEMM_OPS = {"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
            "aten::_mkldnn_convolution", "aten::convolution_overrideable", "aten::_convolution",
            "mkldnn::_linear_pointwise"}  # oneDNN's prepacked linear (qwenvl_vision.backends.cpu.kernels)
SDPA_PREFIX = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")
CATEGORIES = ("GEMM", "attention", "norm", "rope & attention glue", "activation & gate", "merger other",
              "residual (block)", "other")


def _module_category(name: str) -> str:
    lowered = name.lower()
    if "norm" in lowered:
        return "norm"
    if "attention" in lowered:
        return "rope & attention glue"
    if any(word in lowered for word in ("mlp", "gelu", "silu", "activation")):
        return "activation & gate"
    if "merger" in lowered:
        return "merger other"
    if "block" in lowered:
        return "residual (block)"
    return "other"


def _scope_hooks(model: torch.nn.Module) -> list:
    """Wrap every module's forward in record_function('mod::<class>') via hooks; returns the handles."""
    stack: list = []

    def enter(module, args):
        scope = torch.autograd.profiler.record_function(f"mod::{type(module).__name__}")
        scope.__enter__()
        stack.append(scope)

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles


# The CPU backend's steps (it runs no block's modules), each scoped as the category of its non-GEMM ops; the
# innermost scope wins, so a packed linear's rows consumed inside a step (rope, the activation, the residual add)
# count there. The CPU's GEMM attention path is attention, GEMMs included.
FUSED_STEPS = {(CpuExecution, "norm"): "norm", (CpuExecution, "attention"): "rope & attention glue",
               (CpuExecution, "rotated_qkv"): "rope & attention glue",
               (CpuExecution, "add_linear_"): "residual (block)",
               (CpuExecution, "activated"): "activation & gate", (CpuExecution, "hidden_block"): "activation & gate",
               (CpuExecution, "merger"): "merger other", (forward, "gemm_attention"): "attention",
               # the native kernels (C through ctypes, no aten op inside): each scope's own time is the kernel's
               (NativeKernels, "add_norm_"): "norm", (NativeKernels, "rope"): "rope & attention glue",
               (NativeKernels, "activation"): "activation & gate"}


@contextmanager
def _scoped_fused_steps():
    """Wrap each of FUSED_STEPS in record_function('cat::<category>') while profiling, a native kernel's in
    'native::<category>'; restored after."""
    originals = {(module, name): getattr(module, name) for module, name in FUSED_STEPS}

    def scoped(function, category, prefix):
        def run(*args, **kwargs):
            # the native residual add without a norm after it (the MLP's) is the block's residual
            norm = args[3] if len(args) > 3 else kwargs.get("norm")
            step = "residual (block)" if function.__name__ == "add_norm_" and norm is None else category
            with torch.autograd.profiler.record_function(f"{prefix}::{step}"):
                return function(*args, **kwargs)
        return run

    for (module, name), category in FUSED_STEPS.items():
        setattr(module, name, scoped(originals[module, name], category,
                                     "native" if module is NativeKernels else "cat"))
    try:
        yield
    finally:
        for (module, name), function in originals.items():
            setattr(module, name, function)


def _scope_category(event) -> str | None:
    """The category of the innermost ``cat::`` or ``mod::`` scope around an event (None outside any)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("cat::"):
            return parent.name[5:]
        if parent.name.startswith("mod::"):
            return _module_category(parent.name[5:])
        parent = parent.cpu_parent
    return None


def runs_cpu_backend(model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> bool:
    """Whether a forward of ``model`` on these inputs runs our CPU backend (its blocks without their modules)."""
    if not isinstance(model, VisionTower):
        return False
    with torch.inference_mode():
        return isinstance(model.backend.execution(model, pixel_values, model.grid_list(grid_thw)), CpuExecution)


def profile_forward(model: torch.nn.Module, run, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                    ) -> dict[str, float | int]:
    """Self CPU seconds per category for one forward (``run()``), and ``cpu_backend_blocks``: the block calls the
    profiled forward ran on our CPU backend. Module hooks scope a forward that runs the modules (transformers',
    ours on the reference path); the backend is scoped by its steps alone, since a module hook makes our tower
    run the modules' forward instead (``backends.cpu.backend``) and would profile the wrong path."""
    handles = [] if runs_cpu_backend(model, pixel_values, grid_thw) else _scope_hooks(model)
    blocks = 0
    original_block = CpuExecution.block

    def counted_block(*args, **kwargs):
        nonlocal blocks
        blocks += 1
        return original_block(*args, **kwargs)

    try:
        with torch.inference_mode(), _scoped_fused_steps():
            run()  # warm-up, outside the profile
            CpuExecution.block = counted_block
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run()
    finally:
        CpuExecution.block = original_block
        for handle in handles:
            handle.remove()
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name.startswith("native::"):
            seconds[event.name[8:]] += event.self_cpu_time_total / 1e6
            continue
        if not event.name.startswith(("aten::", "mkldnn::")):
            continue
        scope = _scope_category(event)
        if event.name.startswith(SDPA_PREFIX) or scope == "attention":
            category = "attention"
        elif event.name in GEMM_OPS:
            category = "GEMM"
        else:
            category = scope or "other"
        seconds[category] += event.self_cpu_time_total / 1e6
    seconds["total"] = sum(seconds.values())
    seconds["cpu_backend_blocks"] = blocks
    return dict(seconds)


def format_profile(profiles: dict[str, dict[str, float]]) -> str:
    names = list(profiles)
    lines = [f"{'category':24s}" + "".join(f"{n:>22s}" for n in names)]
    for category in (*CATEGORIES, "total"):
        cells = []
        for name in names:
            value, total = profiles[name].get(category, 0.0), profiles[name]["total"]
            cells.append(f"{value:9.2f} s {100 * value / total:5.1f}%  ")
        lines.append(f"{category:24s}" + "".join(f"{c:>22s}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--threads", type=positive_option(int, "--threads"), default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, pixel_values, grid_thw, _, dtype = workload(args)
    variants, _ = build_variants(cfg, torch.device("cpu"), dtype)
    profiles = {name: profile_forward(v.model, lambda v=v: v.run(v.model, pixel_values, grid_thw), pixel_values,
                                  grid_thw)
                for name, v in variants.items()}
    print(f"{args.preset} depth {cfg.depth}, {args.inputs} ({int(grid_thw.prod(1).sum())} patches), {args.dtype}, "
          f"{torch.get_num_threads()} threads: self CPU time by category")
    print(format_profile(profiles))
    return profiles


if __name__ == "__main__":
    main()
