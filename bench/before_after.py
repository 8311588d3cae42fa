"""Old tree against this one and transformers, side by side in one process: the ratio a refactor must keep.

    cp -r OLD_CHECKOUT/qwenvl_vision /tmp/oldpkg/qwenvl_vision_old   # the old package under another name
    python -m bench.before_after --old /tmp/oldpkg --preset qwen2.5-vl-3b --inputs photos --dtype fp32

The old package gets the reference tower's weights through its own ``names.to_module_state`` when it has one (trees
that stack gate/up at load time), else loads the state dict directly (every tree up to 86749f6). Variants: this
tree as load_encoder sets it up ("ours": on the CPU, oneDNN's prepacked linears where they are faster here), this
tree with every linear on addmm ("ours-reference": the modules' own ops), the old tree (with this tree's
kernel choices where it packs linears too), transformers.
Timing as ``bench.throughput``: interleaved, median after warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from bench import throughput
from bench.workloads import add_workload_arguments, workload


def import_old_package(folder: Path, name: str = "qwenvl_vision_old"):
    """The old package from folder/name, imported under its own name without putting folder on the import path
    (its modules import each other relatively, so only the package itself needs finding)."""
    spec = importlib.util.spec_from_file_location(name, folder / name / "__init__.py",
                                                  submodule_search_locations=[str(folder / name)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"no package {name} in {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="folder holding the old package as qwenvl_vision_old")
    add_workload_arguments(parser, dtypes=("fp32", "bf16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    cfg, pixel_values, grid_thw, items, dtype = workload(args)
    variants, _ = throughput.build_variants(cfg, device, dtype, addmm_variant=True)
    old = import_old_package(Path(args.old))
    fields = {k: getattr(cfg, k) for k in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                            "out_hidden_size", "patch_size", "fullatt_block_indexes",
                                            "deepstack_visual_indexes")}
    family = "qwen2_5_vl" if cfg.design == "qwen2_5" else "qwen3_vl"
    old_model = old.build_model(old.VisionConfig(family=family, **fields), dtype=dtype)
    state = dict(variants["transformers"].model.state_dict())
    old_names = getattr(old, "names", None) or importlib.import_module("qwenvl_vision_old.names")
    if hasattr(old_names, "to_module_state"):
        state = old_names.to_module_state(old_model.config, state, list(old_model.state_dict()))
    old_model.load_state_dict(state, strict=True)
    if hasattr(old_model, "pack_linear_weights_"):  # a tree with packed CPU linears: set up as its load_encoder
        old_model.pack_linear_weights_("auto")
    if hasattr(old_model, "set_cpu_kernels"):  # a tree with the CPU backend: this tree's plan, the same kernels
        old_model.set_cpu_kernels(variants["ours"].model.cpu_plan.to_dict())
    variants = {"ours": variants["ours"], "ours-reference": variants["ours-reference"],
                "ours-before": throughput.Variant(throughput.run_ours, old_model),
                "transformers": variants["transformers"]}
    timings = throughput.measure(variants, pixel_values, grid_thw, device, args.warmup, args.repeats)
    result = throughput.summarize(cfg, args.preset, args.inputs, grid_thw, items, device, dtype, timings, None, {})
    throughput.print_table(result)
    return result


if __name__ == "__main__":
    main()
