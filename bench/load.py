"""Load benchmark: ``qwenvl_vision.load_encoder`` against transformers, on a real-size random checkpoint.

What is measured
----------------
A checkpoint with random weights at the real size of a released tower (default ``qwen2.5-vl-3b``, 669M vision
parameters) is written once, in the released layout: bf16 safetensors like the releases, a valid full
``config.json`` (the real vision config plus a 1-layer text model of the release's width, so transformers can
build the whole model), ``preprocessor_config.json``, an index and two shards, the vision tensors split across
both and the second also holding the text model. It is kept in ``--workdir`` and reused by later runs.

Each row is one way to get the vision tower onto the CPU in one dtype:

- ``ours``: ``load_encoder(folder, device="cpu", dtype=...)``;
- ``hf-tower``: transformers' tower class alone, ``<Tower>.from_pretrained(folder, dtype=...,
  key_mapping={"^visual\\.": ""})`` (``^model\\.visual\\.`` for Qwen3-VL). Its config class reads the
  ``vision_config`` section of the full config.json; the key mapping strips the vision prefix, and the text
  tensors are reported as unexpected and skipped. This is the fairest tower-only path transformers 5 offers;
- ``hf-full``: what most users run, ``<VL model>.from_pretrained(folder, dtype=...)`` (tower + the 1-layer
  text model), tower taken from ``.model.visual``. Its loaded bytes include the text model.

Every run is a fresh Python subprocess, ``--repeats`` times per row (rows interleaved, after ``--warmup``
discarded loads). In the child: the imports that row needs, ``gc.collect()``, baseline = the RSS right after
the imports, then the load, timed with ``perf_counter``, then the peak RSS. On Linux the peak is ``VmHWM``
reset to the baseline after the imports, not ``ru_maxrss``, which a child inherits from its parent's peak
through fork + exec (see ``start_rss_window``); elsewhere ``ru_maxrss``. Resident pages of memory-mapped shards
count, i.e. what the machine has to hold. Reported per row: median load time, median peak RSS delta and
absolute peak, the bytes of the loaded tower in the target dtype, and peak delta / tower bytes (issue target
for ours on CPU: <= 1.25x). Then every weight is read once (as a first forward would) and the RSS growth since
the baseline is split into anonymous and file-backed pages: a bf16 load from bf16 files keeps its weights as
views of the memory-mapped shards, so its load peak is near 0 and its weights show up as file pages once used
(shared with the page cache) instead. The page cache is warm (the files were just written or read), so times
are not cold-disk times. Transformers' loads must leave no missing or mismatched tensor.

Sanity: the first repeat of every row also encodes one fixed tiny input (an 8x8-patch image) and saves the
output; each transformers row is compared with ours at the same dtype (max |a - b| / max |ours|), and every
non-fp32 row also with ours in fp32 ("vs fp32": its rounding error).

    python -m bench.load                          # qwen2.5-vl-3b, fp32 and bf16, 3 repeats
    python -m bench.load --preset qwen3-vl-2b --json bench/load-qwen3-vl-2b.json
    python -m bench.load --device cuda --dtypes bf16 --rows ours,hf-tower   # onto the GPU

``--device cuda`` loads onto the GPU instead (the rows above with ``device=`` / ``device_map=``): the child creates
its CUDA context before the baseline (its host memory is not the load's), the timer stops after a synchronize,
and each run also reports the GPU's peak allocated bytes. The peak RSS is still the host's: what staging the
weights costs. ``--depth N`` truncates the tower (a smoke test in seconds; ``python -m bench.cuda_check --dry-run``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.model.config import QWEN2_5

REPO = Path(__file__).resolve().parent.parent
WRITER_VERSION = 1  # bump when the written checkpoint changes, so stale work dirs are rewritten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS = ("ours", "hf-tower", "hf-full")
PROBE_GRID = (1, 8, 8)
RESULT_TAG = "RESULT "
TEXT_HEAD_DIM = 128  # as in every release's text model

# transformers classes per model_type: (module, tower class, full class or None, vision prefix in the files)
HF_CLASSES = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel",
                   "Qwen2_5_VLForConditionalGeneration", "visual."),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel",
                 "Qwen3VLForConditionalGeneration", "model.visual."),
    # The MoE releases' text model is not written by this bench: tower-only there.
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel",
                     None, "model.visual."),
}

# ---------------------------------------------------------------------- the checkpoint

def text_config(cfg) -> dict:
    """A 1-layer text model of the release's width (= the merger's output), valid for transformers."""
    hidden = cfg.out_hidden_size
    common = {
        "hidden_size": hidden, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": hidden // TEXT_HEAD_DIM, "num_key_value_heads": 2, "vocab_size": 512,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    }
    if cfg.design == QWEN2_5:
        return {**common, "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    return {**common, "model_type": cfg.model_type + "_text", "head_dim": TEXT_HEAD_DIM, "rope_theta": 5000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]}}


def full_config_json(cfg) -> dict:
    """config.json as the releases write it (Qwen2.5: flat text fields, in_chans), with a tiny text model."""
    vision = cfg.to_vision_dict()
    tokens = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653}
    if cfg.design == QWEN2_5:
        vision["in_chans"] = vision.pop("in_channels")
        vision.update(spatial_patch_size=cfg.patch_size, tokens_per_second=2)
        return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": cfg.model_type,
                **text_config(cfg), **tokens, "vision_config": vision, "torch_dtype": "bfloat16"}
    vision["model_type"] = cfg.model_type
    moe = cfg.model_type == "qwen3_vl_moe"
    arch = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    return {"architectures": [arch], "model_type": cfg.model_type, "text_config": text_config(cfg),
            "tie_word_embeddings": True, **tokens, "vision_config": vision, "dtype": "bfloat16"}


def text_tensors(cfg, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The 1-layer text model's weights, named as the release names them (Qwen2.5: ``model.layers``)."""
    tc = text_config(cfg)
    hidden, inter, vocab = tc["hidden_size"], tc["intermediate_size"], tc["vocab_size"]
    head_dim = TEXT_HEAD_DIM
    q_out, kv_out = tc["num_attention_heads"] * head_dim, tc["num_key_value_heads"] * head_dim
    qwen2_5 = cfg.design == QWEN2_5
    base = "model." if qwen2_5 else "model.language_model."
    layer = base + "layers.0."
    shapes = {
        base + "embed_tokens.weight": (vocab, hidden), base + "norm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (q_out, hidden), layer + "self_attn.k_proj.weight": (kv_out, hidden),
        layer + "self_attn.v_proj.weight": (kv_out, hidden), layer + "self_attn.o_proj.weight": (hidden, q_out),
        layer + "mlp.gate_proj.weight": (inter, hidden), layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
        layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
    }
    if qwen2_5:
        shapes.update({layer + f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q_out), ("k", kv_out),
                                                                             ("v", kv_out))})
    else:
        shapes.update({layer + "self_attn.q_norm.weight": (head_dim,), layer + "self_attn.k_norm.weight": (head_dim,)})
    gen = torch.Generator().manual_seed(seed + 1)
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype) for name, shape in sorted(shapes.items())}


def write_checkpoint(folder: Path, cfg, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the released layout into `folder` (via a temporary folder renamed at the end)."""
    from safetensors.torch import save_file

    from qwenvl_vision.model.names import to_checkpoint_state
    from qwenvl_vision.model.random_init import random_tower

    _, _, _, prefix = HF_CLASSES[cfg.model_type]
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    tower = random_tower(cfg, "cpu", dtype, seed=seed)
    vision = {prefix + k: v.contiguous() for k, v in to_checkpoint_state(cfg, tower.state_dict()).items()}
    del tower
    names = sorted(vision)
    half = len(names) // 2
    shards = [{n: vision[n] for n in names[:half]}, {**{n: vision[n] for n in names[half:]},
                                                     **text_tensors(cfg, dtype, seed)}]
    weight_map = {}
    for i, tensors in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(partial / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    del vision, shards
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(partial / "config.json", full_config_json(cfg))
    from qwenvl_vision.inputs.images import PreprocessConfig

    preprocessor = PreprocessConfig.for_family(cfg.family).to_dict()  # the load does not depend on it
    write_json(partial / "preprocessor_config.json", preprocessor)
    write_json(partial / "bench.json", {"writer_version": WRITER_VERSION, "preset": cfg.name, "seed": seed})
    partial.rename(folder)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def ensure_checkpoint(workdir: Path, cfg, seed: int) -> tuple[Path, float | None]:
    """The checkpoint folder for this preset and seed, written unless a complete one is there."""
    folder = workdir / f"{cfg.name}-seed{seed}"
    marker = folder / "bench.json"
    if marker.is_file() and json.loads(marker.read_text()).get("writer_version") == WRITER_VERSION:
        return folder, None
    if folder.exists():
        raise SystemExit(f"{folder} exists but was written by another version of this bench; remove it")
    start = time.perf_counter()
    write_checkpoint(folder, cfg, seed)
    return folder, time.perf_counter() - start


# ---------------------------------------------------------------------- the child: one load, measured


def ru_maxrss_bytes() -> int:
    """getrusage's peak RSS (Linux reports KiB, macOS bytes). On Linux it includes the parent's peak at fork."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def proc_status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


RESET_HIGH_WATER_MARK = "VmHWM (reset after imports)"  # start_rss_window's method where the peak was reset


def start_rss_window() -> tuple[int, str]:
    """Baseline RSS now, with the peak counter reset to it where the OS allows; returns (bytes, method).

    ru_maxrss is not used on Linux: exec keeps the larger of the old and new peak, so a child inherits its
    parent's peak (here the parent's checkpoint writing) and small loads would read as 0. VmHWM belongs to the
    child's own address space, and writing 5 to clear_refs resets it to the current RSS, so an import-time
    transient cannot be mistaken for the load's peak.
    """
    current = proc_status_bytes("VmRSS")
    if current is None:
        return ru_maxrss_bytes(), "ru_maxrss"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return proc_status_bytes("VmRSS"), RESET_HIGH_WATER_MARK
    except OSError:
        return current, "VmHWM"


def resident_split() -> dict[str, int | None]:
    """Current RSS and its anonymous / file-backed (memory-mapped checkpoint pages) parts, in bytes."""
    return {"rss": proc_status_bytes("VmRSS"), "anon": proc_status_bytes("RssAnon"),
            "file": proc_status_bytes("RssFile")}


def touch_all(module: torch.nn.Module) -> None:
    """Read every parameter and buffer once (a reduction: no full-size temporary), as a first forward would.
    oneDNN-packed weights (qwenvl_vision.backends.cpu.kernels) have no reduction, and the reorder that made them has
    just written every page of them: they are resident already."""
    with torch.inference_mode():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.numel() and not t.is_mkldnn:
                t.sum()


def peak_rss(method: str) -> int:
    return ru_maxrss_bytes() if method == "ru_maxrss" else proc_status_bytes("VmHWM")


def import_for(row: str, model_type: str):
    """Import what the row needs before the baseline; return the loader's class or function."""
    if row == "ours":
        from qwenvl_vision.loading import load_encoder

        return load_encoder
    import importlib

    module_name, tower_name, full_name, _ = HF_CLASSES[model_type]
    module = importlib.import_module(module_name)
    return getattr(module, tower_name if row == "hf-tower" else full_name)


def load(row: str, loader, folder: str, dtype: torch.dtype, model_type: str, device: str = "cpu"
         ) -> tuple[object, torch.nn.Module, dict]:
    """Run the row's load; return (what to keep alive, the tower, notes)."""
    if row == "ours":
        encoder = loader(folder, device=device, dtype=dtype)
        return encoder, encoder.model, {}
    kwargs = {"dtype": dtype, "output_loading_info": True}
    if device != "cpu":
        kwargs["device_map"] = device
    if row == "hf-tower":
        kwargs["key_mapping"] = {"^" + HF_CLASSES[model_type][3].replace(".", r"\."): ""}
    model, info = loader.from_pretrained(folder, **kwargs)
    bad = {k: sorted(info[k])[:5] for k in ("missing_keys", "mismatched_keys") if info.get(k)}
    if bad:
        raise RuntimeError(f"transformers {row} load is incomplete: {bad}")
    tower = model if row == "hf-tower" else model.model.visual
    return model, tower.eval(), {"unexpected_keys": len(info.get("unexpected_keys") or ())}


def probe_output(row: str, kept, tower: torch.nn.Module, patch_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The tower's merged output for one fixed tiny input, as float32."""
    t, h, w = PROBE_GRID
    device = next(tower.parameters()).device
    pixels = torch.randn(t * h * w, patch_dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    grid = torch.tensor([PROBE_GRID], device=device)
    with torch.inference_mode():
        if row == "ours":
            out = kept.encode_patches(pixels, grid).embeddings[0]
        else:
            out = tower(pixels, grid_thw=grid).pooler_output
    return out.float().cpu().clone()


def module_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def child(spec: dict) -> dict:
    """One measured load in this (fresh) process; `spec` comes from the parent as JSON."""
    row, dtype, model_type = spec["row"], DTYPES[spec["dtype"]], spec["model_type"]
    device = spec.get("device", "cpu")
    loader = import_for(row, model_type)
    cuda = device.startswith("cuda")
    if cuda:  # the CUDA context and its host memory exist before the baseline: they are not the load's
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    gc.collect()
    before = resident_split()
    ru_before = ru_maxrss_bytes()  # kept for reference only: see start_rss_window
    base, method = start_rss_window()
    start = time.perf_counter()
    kept, tower, notes = load(row, loader, spec["folder"], dtype, model_type, device)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = peak_rss(method)
    result = {"seconds": seconds, "base_rss": base, "peak_rss": peak, "peak_delta": peak - base, "rss_method": method,
              "ru_maxrss_before": ru_before, "ru_maxrss_after": ru_maxrss_bytes(),
              "loaded_bytes": module_bytes(kept.model if row == "ours" else kept),
              "tower_bytes": module_bytes(tower), "tower_dtype": str(next(tower.parameters()).dtype),
              "tower_device": str(next(tower.parameters()).device), **notes}
    if cuda:
        result["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
    touch_all(tower)
    after = resident_split()
    if None not in before.values() and None not in after.values():
        result["used_delta"] = {k: after[k] - before[k] for k in after}
    if spec.get("probe"):
        torch.save(probe_output(row, kept, tower, spec["patch_dim"], dtype), spec["probe"])
    return result


# ---------------------------------------------------------------------- the parent: runs, table, JSON


def run_child(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "bench.load", "--child", json.dumps(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{spec['row']} {spec['dtype']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def summarize(runs: list[dict]) -> dict:
    first = runs[0]
    return {
        "seconds_median": statistics.median(r["seconds"] for r in runs),
        "seconds_all": [round(r["seconds"], 3) for r in runs],
        "peak_delta_median": int(statistics.median(r["peak_delta"] for r in runs)),
        "peak_delta_max": max(r["peak_delta"] for r in runs),
        "peak_rss_median": int(statistics.median(r["peak_rss"] for r in runs)),
        "base_rss_median": int(statistics.median(r["base_rss"] for r in runs)),
        "loaded_bytes": first["loaded_bytes"], "tower_bytes": first["tower_bytes"],
        "tower_dtype": first["tower_dtype"], "unexpected_keys": first.get("unexpected_keys"),
        "rss_method": first["rss_method"], "tower_device": first.get("tower_device"),
        "cuda_peak_allocated": max(r["cuda_peak_allocated"] for r in runs) if "cuda_peak_allocated" in first else None,
        "used_delta": {k: int(statistics.median(r["used_delta"][k] for r in runs)) for k in first["used_delta"]}
        if "used_delta" in first else None,
    }


def max_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def compare(rows: dict, probes: dict) -> None:
    """Add each row's max rel err against ours at the same dtype, and its ratios to ours."""
    for (row, dt), s in rows.items():
        ours = rows.get(("ours", dt))
        s["peak_over_tower"] = s["peak_delta_median"] / s["tower_bytes"]
        if ours is not None and row != "ours":
            s["time_vs_ours"] = s["seconds_median"] / ours["seconds_median"]
            s["peak_vs_ours"] = s["peak_delta_median"] / max(ours["peak_delta_median"], 1)
            if (row, dt) in probes and ("ours", dt) in probes:
                s["max_rel_err_vs_ours"] = max_rel_err(probes[(row, dt)], probes[("ours", dt)])
        if dt != "fp32" and (row, dt) in probes and ("ours", "fp32") in probes:
            s["max_rel_err_vs_ours_fp32"] = max_rel_err(probes[(row, dt)], probes[("ours", "fp32")])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def used(delta: dict | None) -> str:
    return "-" if delta is None else f"{mib(delta['anon'])} + {mib(delta['file'])}"


def table(rows: dict) -> str:
    head = ("row", "dtype", "load s", "peak Δ MiB", "tower MiB", "Δ/tower", "peak abs MiB",
            "after use: anon + file MiB", "time vs ours", "peak vs ours", "max rel err", "vs fp32")
    lines = [head]
    for (row, dt), s in rows.items():
        lines.append((
            row, dt, f"{s['seconds_median']:.2f}", mib(s["peak_delta_median"]), mib(s["tower_bytes"]),
            f"{s['peak_over_tower']:.2f}x", mib(s["peak_rss_median"]), used(s.get("used_delta")),
            f"{s['time_vs_ours']:.2f}x" if "time_vs_ours" in s else "-",
            f"{s['peak_vs_ours']:.2f}x" if "peak_vs_ours" in s else "-",
            f"{s['max_rel_err_vs_ours']:.1e}" if "max_rel_err_vs_ours" in s else "ref" if row == "ours" else "-",
            f"{s['max_rel_err_vs_ours_fp32']:.1e}" if "max_rel_err_vs_ours_fp32" in s else "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    return "\n".join([fmt[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *fmt[1:]])


def environment(device: str = "cpu") -> dict:
    import safetensors

    env = {"python": platform.python_version(), "torch": torch.__version__, "safetensors": safetensors.__version__,
           "cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def transformers_paths(model_type: str, rows: set[str]) -> dict:
    _, tower, full, prefix = HF_CLASSES[model_type]
    pattern = "^" + prefix.replace(".", r"\.")
    paths = {}
    if "hf-tower" in rows:
        paths["hf-tower"] = f"{tower}.from_pretrained(folder, dtype=..., key_mapping={{{pattern!r}: ''}})"
    if full and "hf-full" in rows:
        paths["hf-full"] = f"{full}.from_pretrained(folder, dtype=...).model.visual (includes a 1-layer text model)"
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-vl-3b",
                   help="a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE preset (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "qwenvl_vision_bench",
                   help="where the random checkpoint is written once and reused (default: %(default)s)")
    p.add_argument("--repeats", type=positive_option(int, "--repeats"), default=3,
                   help="fresh processes per row (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="discarded loads of each dtype first (ours where it runs), to warm the page cache and "
                        "measure ours' CPU plan (default: %(default)s)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the tower is loaded: cpu (default) or cuda")
    p.add_argument("--depth", type=positive_option(int, "--depth"),
                   help="truncate the tower to this many blocks (a quick smoke test)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def plan(args, cfg) -> list[tuple[str, str]]:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; use {sorted(DTYPES)}")
    for r in wanted:
        if r not in ROWS:
            raise SystemExit(f"unknown row {r!r}; use {ROWS}")
    if "hf-full" in wanted and HF_CLASSES[cfg.model_type][2] is None:
        print(f"note: no hf-full row for {cfg.model_type} (this bench writes no MoE text model)")
        wanted.remove("hf-full")
    if any(r != "ours" for r in wanted):
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("note: transformers is not installed; only our rows are measured")
            wanted = [r for r in wanted if r == "ours"]
    return [(r, d) for r in ROWS if r in wanted for d in dtypes]


def spec_for(row: str, dt: str, folder: Path, cfg, probe: Path | None = None, device: str = "cpu") -> dict:
    return {"row": row, "dtype": dt, "folder": str(folder), "model_type": cfg.model_type, "device": device,
            "patch_dim": cfg.patch_dim, "probe": str(probe) if probe else None}


def measure(row_plan: list[tuple[str, str]], folder: Path, cfg, args) -> tuple[dict, dict]:
    """Run the children: warm-ups (discarded), then `repeats` rounds over all rows; probes in round 1."""
    warm: dict[str, str] = {}  # each dtype once, ours where it runs: its CPU plan is measured per dtype, once a machine
    for row, dt in row_plan:
        if dt not in warm or row == "ours":
            warm[dt] = row
    for i in range(args.warmup):
        for dt, row in warm.items():
            result = run_child(spec_for(row, dt, folder, cfg, device=args.device), args.timeout)
            print(f"  [warm-up {i + 1}] {row:8s} {dt}: {result['seconds']:6.2f} s (discarded)", flush=True)
    probe_dir = Path(tempfile.mkdtemp(prefix="probes-", dir=args.workdir))
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in row_plan}
    probes: dict[tuple[str, str], torch.Tensor] = {}
    for repeat in range(args.repeats):
        for row, dt in row_plan:
            probe = probe_dir / f"{row}-{dt}.pt" if repeat == 0 else None
            result = run_child(spec_for(row, dt, folder, cfg, probe, args.device), args.timeout)
            runs[(row, dt)].append(result)
            print(f"  [{repeat + 1}/{args.repeats}] {row:8s} {dt}: {result['seconds']:6.2f} s, "
                  f"peak Δ {mib(result['peak_delta'])} MiB", flush=True)
            if probe:
                probes[(row, dt)] = torch.load(probe)
                probe.unlink()
    probe_dir.rmdir()
    return runs, probes


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(child(json.loads(args.child))), flush=True)
        return None
    from qwenvl_vision import preset

    cfg = preset(args.preset)
    if cfg.model_type not in HF_CLASSES:  # this bench writes only those families' checkpoints and transformers rows
        sys.exit(f"bench.load: --preset {args.preset} is a {cfg.model_type} tower; presets of {sorted(HF_CLASSES)} "
                 f"only")
    if args.depth:
        from bench.workloads import truncated

        cfg = truncated(cfg, args.depth)
        cfg = cfg.replace(name=f"{cfg.name}-depth{cfg.depth}")
    row_plan = plan(args, cfg)
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder, wrote = ensure_checkpoint(args.workdir, cfg, args.seed)
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"checkpoint: {folder} ({mib(on_disk)} MiB of bf16 safetensors, "
          + (f"written in {wrote:.1f} s)" if wrote is not None else "reused)"))
    runs, probes = measure(row_plan, folder, cfg, args)
    rows = {key: summarize(r) for key, r in runs.items()}
    compare(rows, probes)
    report = {"preset": cfg.name, "vision_params": sum(p.numel() for p in _meta_tower(cfg).parameters()),
              "checkpoint": str(folder), "checkpoint_bytes": on_disk, "repeats": args.repeats,
              "warmup": args.warmup, "device": args.device, "environment": environment(args.device),
              "transformers_paths": transformers_paths(cfg.model_type, {r for r, _ in row_plan}),
              "rows": [{"row": row, "dtype": dt, **s} for (row, dt), s in rows.items()]}
    print_report(report, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return report


def _meta_tower(cfg) -> torch.nn.Module:
    from qwenvl_vision import build_model

    return build_model(cfg, device="meta")


def print_report(report: dict, rows: dict) -> None:
    env = report["environment"]
    print(f"\n{report['preset']} onto {env.get('gpu', report['device'])}: {report['vision_params'] / 1e6:.0f}M vision "
          f"params; median of {report['repeats']} fresh processes; CPU x{env['cpus']}, torch {env['torch']}, "
          f"transformers {env['transformers']}")
    print(table(rows))
    for name, path in report["transformers_paths"].items():
        print(f"  {name}: {path}")
    for (row, dt), s in rows.items():
        if row == "hf-full":
            print(f"  hf-full {dt} also loads the 1-layer text model: {mib(s['loaded_bytes'] - s['tower_bytes'])} "
                  f"MiB, included in its peak")
    for (row, dt), s in rows.items():
        if row == "ours":
            verdict = "ok" if s["peak_over_tower"] <= 1.25 else "ABOVE TARGET"
            print(f"  ours {dt}: peak Δ / tower bytes = {s['peak_over_tower']:.2f}x (target <= 1.25x: {verdict})")
    methods = sorted({s["rss_method"] for s in rows.values()})
    print(f"  RSS: {', '.join(methods)}; load time and peak are medians; page cache warm")


if __name__ == "__main__":
    main()
