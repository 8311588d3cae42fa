"""qwenvl-vision: extract-weights, inspect, cache, embed, bench, serve.

Errors: every error ends the command with one line on stderr, ``qwenvl-vision COMMAND: error: ...``;
``--debug`` adds the traceback. Exit codes (docs/embed.md lists them with what to do next): 0 done; 1 some
inputs failed (the run finished, the failures are recorded); 2 usage or setup error (nothing written); 3 the
run stopped on an I/O fault of its output (nothing recorded is lost; ``embed --resume`` finishes it); 4 the
run stopped because a forward failed for the machine's reasons (nothing recorded is lost; ``--resume``); 5 an
internal error (a bug: the line says so, ``--debug`` shows where); 130 interrupted; 141 stdout closed; 143
terminated (SIGTERM: a scheduler's preemption, ``kill``; stopped as Ctrl-C stops it), except ``serve``, for
which SIGTERM is the normal stop: 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

from .devices import DTYPE_CHOICES, dtype_option

DEFAULT_WEIGHTS_DIR = Path("weights")  # relative to where the command runs, as docs/api.md shows


def _default_out(source: str) -> Path:
    if Path(source).is_dir():  # "." or "../x": the folder's own name
        name = Path(source).resolve().name or "vision"
    else:  # a repo id: its name
        name = source.rstrip("/").replace("\\", "/").split("/")[-1] or "vision"
    return DEFAULT_WEIGHTS_DIR / f"{name}-vision"


def validate_extract_args(args: argparse.Namespace) -> None:
    """Refuse, before loading anything: a preset (it has no weights), a target whose writing would change a local
    source or the Hugging Face cache (even with --force), and a non-empty target without --force."""
    from .errors import ConfigError
    from .model.config import is_preset

    if is_preset(args.source):
        raise ConfigError(f"{args.source} is a preset: it has no weights to extract (--random-weights is for "
                          f"embed and bench); give a checkpoint folder or a repo id")
    if args.out is not None and not args.out:
        raise ConfigError("--out is empty: give the folder to write, or leave the option out for the default")
    out = Path(args.out) if args.out else _default_out(args.source)
    source = Path(args.source).expanduser()
    if source.is_dir():  # a repo id is checked once fetched (cmd_extract_weights), against its snapshot folder
        refuse_extract_target(source, out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"{out} is not empty; add --force to write the vision checkpoint into it anyway "
                          f"(its files of the same names are replaced)")


# The Hugging Face cache's layout (huggingface_hub's file_download.py): a folder per repo, "models--org--name"
# (or datasets--, spaces--), holding "blobs" and "snapshots" whose files are links into "blobs".
_HUB_REPO_FOLDER_PREFIXES = ("models--", "datasets--", "spaces--")


def _in_hub_cache(path: Path) -> Path | None:
    """The Hugging Face cache this process uses (huggingface_hub's, which follows HF_HUB_CACHE and HF_HOME), or a repo
    folder in that layout elsewhere, that the resolved ``path`` is in; None otherwise."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE).expanduser().resolve()
    if path == root or root in path.parents:
        return root
    for folder in (path, *path.parents):
        if folder.name.startswith(_HUB_REPO_FOLDER_PREFIXES) and \
                any((folder / part).is_dir() for part in ("blobs", "snapshots")):
            return folder
    return None


def refuse_extract_target(source: Path, out: Path) -> None:
    """A ConfigError, whatever --force says, for a target whose writing could change a checkpoint: the source
    folder itself or a folder inside it, any folder in the Hugging Face cache (its snapshot files are links into
    blobs other snapshots share), and a folder where a name extract-weights writes is a source file (a source
    file that is a link into the target). Paths are compared resolved, so links to folders cannot hide them."""
    from .checkpoint.save import TEMPORARY_SUFFIX, VISION_ONLY_FILES
    from .errors import ConfigError

    src, dst = source.expanduser().resolve(), out.expanduser().resolve()
    if dst == src or src in dst.parents:
        where = "is the source folder" if dst == src else f"is inside the source folder {source}"
        raise ConfigError(f"--out {out} {where}: extract-weights never writes into its source (its files would be "
                          f"replaced, --force or not); choose an --out outside {source}")
    cache = _in_hub_cache(dst)
    if cache is not None:
        raise ConfigError(f"--out {out} is inside the Hugging Face cache {cache}, whose files other snapshots and "
                          f"programs share: extract-weights never writes there, --force or not; choose an --out "
                          f"outside it")
    source_files = {entry.resolve(): entry for entry in src.iterdir()}
    for name in VISION_ONLY_FILES:
        for written in (dst / name, dst / (name + TEMPORARY_SUFFIX)):
            if written in source_files:
                raise ConfigError(f"--out {out}: writing {written.name} there would replace the source's "
                                  f"{source_files[written]} (a link to it), --force or not; choose another --out")


def cmd_extract_weights(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint.hub import resolve_folder
    from .checkpoint.save import save_vision_only
    from .checkpoint.weights import open_checkpoint, vision_entries
    from .devices import SAFETENSORS_DTYPES
    from .loading import load_encoder

    folder = resolve_folder(args.source, args.revision, args.local_files_only, None, None)  # a repo id: fetched
    out = Path(args.out) if args.out else _default_out(args.source)
    refuse_extract_target(folder, out)  # again for a local folder: it may have changed since validate
    # Without --dtype, the checkpoint's own; float32 where it mixes dtypes (exact for each) or stores F64 (cast so
    # on load).
    stored = {SAFETENSORS_DTYPES[e["dtype"]] for e in vision_entries(open_checkpoint(folder)).values()}
    stored = stored.pop() if len(stored) == 1 and torch.float64 not in stored else torch.float32
    encoder = load_encoder(folder, device="cpu", dtype=args.dtype or stored, cpu_kernels="reference")
    with encoder:
        pre = encoder.preprocess_config
        try:
            count = save_vision_only(encoder.model, out, pre.to_dict(), encoder.video_config.to_dict(pre))
        except OSError as e:  # the output's fault (a full disk, permissions): exit 3, like embed's
            from .errors import OutputFaultError

            where = f" ({Path(e.filename).name})" if e.filename else ""
            raise OutputFaultError(f"cannot write to {out}: {e.strerror or e}{where}; it holds no config.json, so "
                                   f"it does not load: fix the folder and run again with --force") from None
        total = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
    print(f"wrote {count} vision tensors ({total / 2**20:.1f} MiB) to {out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.hub import resolve_folder
    from .checkpoint.weights import open_checkpoint, vision_entries
    from .model.config import is_preset, preset

    if is_preset(args.source):  # a released tower's shape, without weights (counted on the meta device)
        from .model.build import build_model

        config = preset(args.source)
        parameters = sum(p.numel() for p in build_model(config, device="meta").parameters())
        _print_report({
            "preset": config.name,
            "family": config.model_type,
            "weights": "none: use --random-weights (embed, bench) for random weights at this size, or a repo id",
            "parameters": parameters,
            "bytes_bf16": parameters * 2,
            "config": config.to_vision_dict(),
        }, args.json)
        return 0
    folder = resolve_folder(args.source, args.revision, args.local_files_only, None, None)
    checkpoint = open_checkpoint(folder)
    entries = vision_entries(checkpoint).values()  # every header validated as a load does; one read per shard
    report = {
        "folder": str(folder),
        "family": checkpoint.config.model_type,
        "vision_only": checkpoint.vision_only,
        "tensors": len(checkpoint.tensors),
        "bytes": sum(entry["bytes"] for entry in entries),
        "dtypes": dict(collections.Counter(entry["dtype"] for entry in entries)),
        "shards": [p.name for p in checkpoint.shard_files],
        "config": checkpoint.config.to_vision_dict(),
    }
    _print_report(report, args.json)
    return 0


def gigabytes(text: str) -> float:
    """argparse type of --max-gb: a finite number of GB (10^9 bytes), at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value * 1e9) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB >= 0")
    return value


def cmd_cache_prune(args: argparse.Namespace) -> int:
    from .outputs.cache_prune import prune_cache

    report = prune_cache(args.folder, round(args.max_gb * 1e9), dry_run=args.dry_run)
    print(f"qwenvl-vision cache prune: {args.folder}: {report.line(args.dry_run)}")
    return 0 if report.done else 1


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:12s} {value}")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage is one --help away); subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .version import package_version

    parser = _Parser(prog="qwenvl-vision", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    # Also accepted after the command; SUPPRESS keeps the subcommand from resetting a --debug given before it.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    hub = _Parser(add_help=False)  # where a repo id comes from
    hub.add_argument("--revision", help="Hub branch, tag or commit (default: main)")
    hub.add_argument("--local-files-only", action="store_true",
                     help="use the Hugging Face cache only, never the network (as HF_HUB_OFFLINE=1)")

    p = sub.add_parser("extract-weights", help="write a vision-only checkpoint from a released one",
                       parents=[common, hub])
    p.add_argument("source", help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--out", help="output folder (default: weights/<name>-vision); must be empty unless --force")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out (same-name files replaced)")
    p.add_argument("--dtype", type=dtype_option, help=f"convert to this dtype: {DTYPE_CHOICES} (default: keep the "
                                                "checkpoint's stored dtype; fp32 for F64 or mixed dtypes)")
    p.set_defaults(func=cmd_extract_weights, validate=validate_extract_args)

    p = sub.add_parser("inspect", help="family, config, tensor count and bytes, without loading weights",
                       parents=[common, hub])
    p.add_argument("source", help="checkpoint folder, Hugging Face repo id, or preset name")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("cache", help="a vLLM encoder-cache folder (embed --format vllm-cache)", parents=[common])
    cache = p.add_subparsers(dest="cache_command", required=True)
    p = cache.add_parser("prune", help="remove the oldest items until the folder holds at most --max-gb",
                         parents=[common])
    p.add_argument("folder", help="the encoder-cache folder (safe beside a running embed writing into it)")
    p.add_argument("--max-gb", type=gigabytes, required=True, help="the bound, in GB (10^9 bytes)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.set_defaults(func=cmd_cache_prune)

    from .embed.args import add_embed_parser
    from .embed.job import run_embed
    from .serve.main import add_serve_parser
    from .teardown.study import add_bench_parser

    add_embed_parser(sub, parents=[common]).set_defaults(func=run_embed)
    add_bench_parser(sub, parents=[common])
    add_serve_parser(sub, parents=[common])
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split("\n"))


@contextlib.contextmanager
def _shown_on_stderr(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs: each warning as one line, ``Category: message`` (Python's own adds the library's file,
    line and source line, which mean nothing to a user of the command), and the package's INFO log lines (a CPU plan
    being measured) as ``COMMAND: ...``, unless ``--quiet``."""
    import PIL.Image

    logger = logging.getLogger("qwenvl_vision")
    level, propagate, formatwarning = logger.level, logger.propagate, warnings.formatwarning
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{args.command}: %(message)s"))
    handler.setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # an application's root handler would print each line a second time
    warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\n"
    try:
        with warnings.catch_warnings():  # PIL's bomb warning precedes our own pixel limit's refusal of the file
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        warnings.formatwarning = formatwarning


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is: every clean-up that Ctrl-C runs (locks released, what is recorded
    kept) runs for it too; the command then exits 143 (128 + SIGTERM), as a shell reports a process it ended, except
    ``serve``: 0, its normal stop."""


def _terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    from .errors import QwenVLVisionError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed on one line
        return e.code if isinstance(e.code, int) else 2
    main_thread = threading.current_thread() is threading.main_thread()  # where alone a handler can be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        with _shown_on_stderr(args):
            validate = getattr(args, "validate", None)
            if validate is not None:
                validate(args)
            return args.func(args)
    except BrokenPipeError:  # the reader of our stdout went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error ends in one line
        if isinstance(e, Terminated) and args.command == "serve":  # its normal stop, while it loads too
            return 0
        if args.debug:
            traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            print(f"qwenvl-vision {args.command}: {what}" + ("; what is recorded is kept, --resume continues"
                                                            if args.command == "embed" else ""), file=sys.stderr)
            return 143 if isinstance(e, Terminated) else 130
        if not isinstance(e, (QwenVLVisionError, OSError)):  # a bug: --debug shows where
            print(f"qwenvl-vision {args.command}: error: internal error, {type(e).__name__}: {_one_line(e)[:500]} "
                  f"(a bug: run again with --debug for the traceback and report it)", file=sys.stderr)
            return 5  # a bug's own exit status (docs/embed.md)
        if not getattr(e, "quiet", False):  # quiet: another torchrun rank failed and printed why
            rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None  # torchrun's
            where = f" [rank {rank}]" if rank is not None else ""
            print(f"qwenvl-vision {args.command}{where}: error: {_one_line(e)}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2: usage and setup errors
    finally:
        if main_thread and previous is not None:  # None: a handler set from C, which Python cannot put back
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
