"""The ``embed`` command line: its options, their types and the checks across them (``add_embed_parser``,
``validate_embed_args``, which also settles ``--format``'s default: parquet with ``--engine ray``, else
safetensors, and records ``format_given``). What runs the command is ``job.run_embed``, which reads the checked
Namespace: the CLI binds the parser to it. The options that load the model and size its inputs (``model_options``,
``validate_model_args``) are ``serve``'s too."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..devices import DTYPE_CHOICES, device_option, dtype_option, resolve_device
from ..errors import ConfigError
from ..inputs.pixels import DEFAULT_MAX_INPUT_PIXELS, RESIZE_BACKENDS
from ..model.attention import ATTN_IMPLS
from ..model.config import is_preset
from ..options import DEFAULT_BATCH_PATCHES, DEFAULT_DECODE_TIMEOUT, check_option_rules
from .inputs import INPUT_KINDS

FORMATS = ("safetensors", "parquet", "vllm-cache")
ENGINES = ("local", "ray")
# The encode options' flags, for the refusals options.check_option_rules makes.
FLAGS = {"min_pixels": "--min-pixels", "max_pixels": "--max-pixels", "pooled": "--pooled-only",
         "normalize": "--normalize"}


def positive_option(kind: type, name: str):
    """An argparse type: a whole number of at least 1 (``int``) or a finite number above 0 (``float``), the error
    naming the option."""
    what, bound = ("an integer", "at least 1") if kind is int else ("a number", "a positive number")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {text}")
        return value

    return parse


def _column_names(text: str) -> tuple[str, ...]:
    """argparse type of --keep-columns: comma-separated column names, none empty."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} names an empty column; give names separated by commas")
    return names


def validate_embed_args(args: argparse.Namespace) -> None:
    """Checks across options, right after parsing (argparse checks each option alone)."""
    check_option_rules(min_pixels=args.min_pixels, max_pixels=args.max_pixels, pooled=args.pooled_only,
                       normalize=args.normalize, names=FLAGS)
    if args.engine == "ray" and args.format == "safetensors":
        raise ConfigError("--engine ray writes --format parquet or vllm-cache (the driver writes what Ray hands "
                          "back, row by row): drop --format safetensors, or use --engine local")
    if args.format == "vllm-cache" and args.pooled_only:
        raise ConfigError("--format vllm-cache stores each item's tokens, which a vLLM consumer places in the prompt: "
                          "drop --pooled-only")
    if args.engine == "ray" and args.device not in (None, "cpu", "cuda"):
        raise ConfigError(f"--device {args.device}: each Ray actor runs on the GPU its node gives it; use --device "
                          f"cuda or cpu with --engine ray")
    for option, value in (("--ray-address", args.ray_address), ("--ray-actors", args.ray_actors)):
        if value and args.engine != "ray":
            raise ConfigError(f"{option} {value} needs --engine ray")
    args.format_given = args.format is not None  # a --resume without it takes the run's
    if not args.format_given:
        args.format = "parquet" if args.engine == "ray" else "safetensors"
    if not args.out:  # as `--out "$OUT"` with OUT unset gives: never the current folder by accident
        raise ConfigError("--out is empty: give the folder to write")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    validate_model_args(args)


def validate_model_args(args: argparse.Namespace) -> None:
    """The checks across ``model_options``: a preset needs --random-weights, which takes no --revision; a --device
    this machine lacks is refused unless Ray's actors, on the cluster's machines, load the tower."""
    resolve_device(args.device, here=getattr(args, "engine", None) != "ray")
    if args.random_weights and args.revision:
        raise ConfigError("--revision means a Hub checkpoint; --random-weights takes a preset")
    if is_preset(args.model) and not args.random_weights:
        raise ConfigError(f"--model {args.model} is a preset (no weights): add --random-weights for random weights "
                          f"at its size, or give a checkpoint folder or repo id")


def model_options() -> argparse.ArgumentParser:
    """A parent parser of the options that load the model and size its inputs, shared by ``embed`` and ``serve``."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", required=True, help="checkpoint folder, vision-only folder, repo id, or preset")
    p.add_argument("--revision", help="Hub branch, tag or commit of --model (default: main)")
    p.add_argument("--local-files-only", action="store_true",
                   help="take a repo id --model from the Hugging Face cache only, never the network (as "
                        "HF_HUB_OFFLINE=1)")
    p.add_argument("--device", type=device_option,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu; embed under torchrun: "
                        "each rank's cuda:LOCAL_RANK)")
    p.add_argument("--dtype", type=dtype_option, help=f"{DTYPE_CHOICES} (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--min-pixels", type=positive_option(int, "--min-pixels"),
                   help="smallest image area after resizing (default: the checkpoint's)")
    p.add_argument("--max-pixels", type=positive_option(int, "--max-pixels"),
                   help="largest image area after resizing (default: the checkpoint's); below the checkpoint's "
                        "min_pixels, small images are still upscaled to that min, as in transformers' processor: "
                        "give --min-pixels too")
    p.add_argument("--resize", choices=RESIZE_BACKENDS,
                   help="whose pipeline the pixels match: pil = transformers' PIL image processor (transformers "
                        "without torchvision), torch = its torchvision processor (with torchvision), vllm = vLLM's "
                        "image loading (EXIF, transparency onto white) then that processor, and its video reading "
                        "(a file turned upright, Qwen2's frames picked as it picks them); default: what the "
                        "checkpoint's preprocessor_config.json names (...Fast: torch); serve: vllm")
    p.add_argument("--fps", type=positive_option(float, "--fps"),
                   help="frames per second sampled from video files (default: the checkpoint's video settings, "
                        "else 2)")
    p.add_argument("--max-input-pixels", type=positive_option(int, "--max-input-pixels"),
                   default=DEFAULT_MAX_INPUT_PIXELS,
                   help="refuse files whose header declares more pixels, before decoding (embed records them as "
                        "failed; default %(default)s)")
    p.add_argument("--decode-mib", type=positive_option(int, "--decode-mib"), default=1024,
                   help="memory images being decoded or waiting for their batch may hold at once, in MiB "
                        "(an image needing more is decoded alone; default %(default)s)")
    p.add_argument("--decode-timeout", type=positive_option(float, "--decode-timeout"), default=DEFAULT_DECODE_TIMEOUT,
                   metavar="SECONDS",
                   help="refuse an input whose decoding takes longer (embed records it as failed and goes on; "
                        "default %(default)g)")
    p.add_argument("--max-item-tokens", type=positive_option(int, "--max-item-tokens"),
                   help="refuse an input that resizes to more embedding tokens, before its forward "
                        "(a video file before its frames decode, from its header): bounds one item's time and memory "
                        "(a long video can take hundreds of thousands; default: no bound)")
    p.add_argument("--batch-patches", type=positive_option(int, "--batch-patches"), default=DEFAULT_BATCH_PATCHES,
                   help="patches per forward (an item above runs alone; default %(default)s)")
    p.add_argument("--random-weights", action="store_true", help="with a preset --model: random weights, offline")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the blocks (pays off on CUDA for long jobs; slower on CPU: "
                        "docs/benchmarks.md)")
    p.add_argument("--attn", default="auto", choices=ATTN_IMPLS,
                   help="attention backend (default auto: flash-attn, else torch varlen on CUDA in bf16/fp16, "
                        "else sdpa); one that cannot run on the device and dtype is refused")
    return p


def add_embed_parser(sub, parents=()) -> argparse.ArgumentParser:
    """The ``embed`` subparser of `sub`, its options checked by validate_embed_args; the caller sets its func."""
    p = sub.add_parser("embed", help="embed images and videos into safetensors or Parquet shards, or a vLLM encoder "
                       "cache (with a manifest)",
                       parents=[*parents, model_options()])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUT_KINDS)
    p.add_argument("--out", required=True, help="output folder for shards, manifest.jsonl and run.json")
    p.add_argument("--path-column", default="path", metavar="NAME",
                   help="in a table input (.parquet, .csv, .tsv, .jsonl): the column naming each file, relative "
                        "paths from the table's folder (default %(default)s)")
    p.add_argument("--keep-columns", type=_column_names, default=(), metavar="A,B",
                   help="carry these columns of a table input into the outputs: Parquet columns beside the "
                        "results, a 'columns' object in each manifest line")
    p.add_argument("--pooled-only", action="store_true", help="store one mean vector per image")
    p.add_argument("--normalize", action="store_true",
                   help="with --pooled-only: vectors of unit L2 norm (for cosine retrieval), recorded in run.json")
    p.add_argument("--format", choices=FORMATS,
                   help="safetensors: shards + manifest.jsonl; parquet: shards of one row per input (path, status, "
                        "error, grid, tokens, the tensors as float32, video frames), run.json in their schema "
                        "metadata; vllm-cache: one {id}/encoder_cache.safetensors per item, the folder a vLLM "
                        "consumer's ECExampleConnector reads, and manifest.jsonl with each item's id, grid and "
                        "timing (default: a resumed run's; else safetensors, parquet with --engine ray)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="local: this process (or torchrun's ranks); ray: a Ray Data pipeline, the forward on actors "
                        "(needs ray[data]; writes --format parquet or vllm-cache; default %(default)s)")
    p.add_argument("--ray-address",
                   help="with --engine ray: join this Ray cluster (e.g. auto, or ray://head:10001; default: "
                        "RAY_ADDRESS's when set, else a local one started with this machine's CPUs and GPUs)")
    p.add_argument("--ray-actors", type=positive_option(int, "--ray-actors"),
                   help="with --engine ray: encoder actors (default: one per GPU with --device cuda, or without "
                        "--device on a cluster with GPUs, unless --random-weights; else as many as the nodes hold at "
                        "--threads each); each holds a copy of the tower")
    p.add_argument("--threads", type=positive_option(int, "--threads"),
                   help="torch threads of each forward (default: torch's, one per core, locally; on Ray CPU actors the "
                        "cluster's CPUs / 4, at most a node's, at least 1; a --resume keeps the run's). run.json "
                        "records it: CPU results are bitwise equal only at the same thread count")
    p.add_argument("--resume", action="store_true", help="continue a killed or failed run in --out")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (bar on a terminal, else a line every few seconds) and no loading lines; "
                        "errors, a note on crossed pixel bounds and the final summary still print")
    p.set_defaults(validate=validate_embed_args)
    return p
