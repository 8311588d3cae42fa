"""``qwenvl-vision``: extract-weights, inspect, embed, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_WEIGHTS_DIR = Path("weights")  # relative to where the command runs, as the README shows


def _default_out(source: str) -> Path:
    name = source.rstrip("/").replace("\\", "/").split("/")[-1] or "vision"
    return DEFAULT_WEIGHTS_DIR / f"{name}-vision"


def cmd_extract_weights(args: argparse.Namespace) -> int:
    from .encoder import load_encoder
    from .weights import save_vision_only

    encoder = load_encoder(args.source, device="cpu", dtype=args.dtype or _stored_dtype(args.source),
                           revision=args.revision, local_files_only=args.local_files_only)
    out = Path(args.out) if args.out else _default_out(args.source)
    with encoder:
        save_vision_only(encoder.model, out, encoder.preprocess_config.to_dict())
        total = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
        count = len(encoder.model.state_dict())
    print(f"wrote {count} vision tensors ({total / 2**20:.1f} MiB) to {out}")
    return 0


def _stored_dtype(source: str):
    """Keep the checkpoint's own dtype when extracting (bf16 for the releases)."""
    import torch

    from .weights import SAFETENSORS_DTYPES, open_checkpoint, read_header

    if not Path(source).is_dir():
        return torch.bfloat16
    first = next(iter(open_checkpoint(source).tensors.values()))
    return SAFETENSORS_DTYPES.get(read_header(first.file)[0][first.name]["dtype"], torch.float32)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .encoder import _resolve_folder
    from .weights import open_checkpoint, vision_entries

    folder = _resolve_folder(args.source, args.revision, args.local_files_only, None, None)
    checkpoint = open_checkpoint(folder)
    entries = vision_entries(checkpoint)  # every header validated as a load does; one read per shard
    total_bytes = 0
    dtypes: dict[str, int] = {}
    for entry in entries.values():
        dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
        begin, end = entry["data_offsets"]
        total_bytes += end - begin
    report = {
        "folder": str(folder),
        "family": checkpoint.config.family,
        "model_type": checkpoint.config.model_type,
        "vision_only": checkpoint.vision_only,
        "tensors": len(checkpoint.tensors),
        "bytes": total_bytes,
        "dtypes": dtypes,
        "shards": [p.name for p in checkpoint.shard_files],
        "config": checkpoint.config.to_vision_dict(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:12s} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenvl-vision", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("extract-weights", help="write a vision-only checkpoint from a released one")
    p.add_argument("source", help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--out", help="output folder (default: weights/<name>-vision)")
    p.add_argument("--dtype", help="convert to this dtype (default: keep the stored dtype)")
    p.add_argument("--revision")
    p.add_argument("--local-files-only", action="store_true")
    p.set_defaults(func=cmd_extract_weights)

    p = sub.add_parser("inspect", help="family, config, tensor count and bytes, without loading weights")
    p.add_argument("source")
    p.add_argument("--revision")
    p.add_argument("--local-files-only", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    try:
        from .embed import add_embed_parser
    except ImportError:  # pragma: no cover - embed lands with encode_images
        pass
    else:
        add_embed_parser(sub)
    try:
        from .bench_cli import add_bench_parser
    except ImportError:  # pragma: no cover
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .preprocess import PreprocessError
    from .weights import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, PreprocessError, FileNotFoundError) as e:
        print(f"qwenvl-vision {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
