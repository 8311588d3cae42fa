"""The ``serve`` command line: its options (``add_serve_parser``, the model options ``embed`` takes) and
``run_serve``, which loads the encoder and serves the app with uvicorn until SIGTERM (exit 0) or Ctrl-C;
``serve_settings``, the app's settings from the options."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
from pathlib import Path

from ..embed.args import FLAGS, model_options, positive_option, validate_model_args
from ..errors import ConfigError
from ..options import check_option_rules

API_KEY_ENV = "QWENVL_VISION_API_KEY"


def add_serve_parser(sub, parents=()) -> argparse.ArgumentParser:
    """The ``serve`` subparser of `sub`, bound to run_serve."""
    p = sub.add_parser("serve", help="serve the encoder over HTTP: vLLM's encoder role (disaggregated encoding) and "
                       "an embeddings endpoint", parents=[*parents, model_options()])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=positive_option(int, "--port"), default=8000, help="port (default %(default)s)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model names chat requests may give, as vLLM's flag: answers carry the first "
                        "(default: --model as given)")
    p.add_argument("--ec-shared-storage", metavar="PATH",
                   help="the encoder role: /v1/chat/completions writes each item to PATH/<uuid>/"
                        "encoder_cache.safetensors, as vLLM's ECExampleConnector consumer reads it (default: "
                        "the role is off)")
    p.add_argument("--api-key", help=f"require Authorization: Bearer KEY on the /v1 routes, as vLLM (default: "
                                     f"${API_KEY_ENV}, else no key)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                   help="fetch http(s) media only from these hosts (default: no http(s) media)")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="read file:// media only under DIR (default: no local files)")
    p.add_argument("--max-body-mib", type=positive_option(int, "--max-body-mib"), default=64,
                   help="largest request body, in MiB (default %(default)s)")
    p.add_argument("--body-timeout", type=positive_option(float, "--body-timeout"), default=60.0,
                   help="seconds a client may send nothing while its request body is under way, then it is answered "
                        "408 (nginx's client_body_timeout; default %(default)g)")
    p.add_argument("--max-bodies-mib", type=positive_option(int, "--max-bodies-mib"), default=512,
                   help="request bodies and the media read for them held at once, in MiB (each until its answer); "
                        "beyond it a request is answered 503 with Retry-After (default %(default)s)")
    p.add_argument("--max-items", type=positive_option(int, "--max-items"), default=64,
                   help="most images and videos in one request (default %(default)s)")
    p.add_argument("--max-queue", type=positive_option(int, "--max-queue"), default=256,
                   help="most items waiting for the encoder, loading their media or being encoded; beyond it a "
                        "request is answered 503 with Retry-After; uvicorn answers 503 beyond twice as many "
                        "connections at once (default %(default)s)")
    p.add_argument("--threads", type=positive_option(int, "--threads"),
                   help="torch threads of each forward (default: torch's, one per core)")
    # vLLM loads images its own way, then runs transformers' torchvision processor whatever the checkpoint names.
    p.set_defaults(func=run_serve, validate=validate_serve_args, resize="vllm")
    return p


def validate_serve_args(args: argparse.Namespace) -> None:
    if args.port > 65535:  # bind would raise OverflowError, which no setup error catches
        raise ConfigError(f"--port must be at most 65535, got {args.port}")
    if args.max_items > args.max_queue:  # such a request could never be queued: 503s forever
        raise ConfigError(f"--max-items {args.max_items} is more than --max-queue {args.max_queue}")
    if args.max_body_mib > args.max_bodies_mib:  # the largest body could never be held: 503s forever
        raise ConfigError(f"--max-body-mib {args.max_body_mib} is more than --max-bodies-mib {args.max_bodies_mib}")
    check_option_rules(min_pixels=args.min_pixels, max_pixels=args.max_pixels, names=FLAGS)
    validate_model_args(args)
    if args.allowed_local_media_path and not Path(args.allowed_local_media_path).is_dir():
        raise ConfigError(f"--allowed-local-media-path {args.allowed_local_media_path} is not a folder")


def serve_settings(args: argparse.Namespace, encoder):
    """The app's settings (``app.ServeSettings``) from the parsed options."""
    from .app import ServeSettings
    from .media import MediaPolicy

    local = args.allowed_local_media_path
    return ServeSettings(
        served_names=tuple(args.served_model_name or [args.model]), api_key=args.api_key or os.environ.get(API_KEY_ENV),
        shared=Path(args.ec_shared_storage) if args.ec_shared_storage else None,
        policy=MediaPolicy(frozenset(d.lower() for d in args.allowed_media_domains),  # as urlsplit's hostname
                           Path(local).resolve() if local else None, args.decode_timeout),
        max_body=args.max_body_mib << 20, body_timeout=args.body_timeout, max_bodies=args.max_bodies_mib << 20,
        max_items=args.max_items, max_queue=args.max_queue,
        options=dict(min_pixels=args.min_pixels, max_pixels=args.max_pixels, resize=args.resize,
                     max_batch_patches=args.batch_patches, max_input_pixels=args.max_input_pixels,
                     decode_bytes=args.decode_mib << 20, decode_timeout=args.decode_timeout,
                     max_item_tokens=args.max_item_tokens,
                     video_config=dataclasses.replace(encoder.video_config, fps=args.fps) if args.fps else None))


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from ..loading import load_encoder

    try:
        import uvicorn

        from .app import build_app
    except ImportError as e:
        raise ConfigError(f"serve needs {e.name}: pip install 'qwenvl-vision[serve]'") from None
    try:  # bound before loading: a port in use is a setup error, said at once
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    with sock:
        if args.threads:
            torch.set_num_threads(args.threads)
        encoder = load_encoder(args.model, device=args.device, dtype=args.dtype, random_weights=args.random_weights,
                               revision=args.revision, local_files_only=args.local_files_only, compile=args.compile,
                               attn_impl=args.attn)
        # The app's lifespan closes the encoder once the queue has drained; limit_concurrency bounds the connections
        # at once (a count), uvicorn answering 503 beyond it.
        server = uvicorn.Server(uvicorn.Config(build_app(encoder, serve_settings(args, encoder)), access_log=False,
                                               limit_concurrency=2 * args.max_queue))
        # uvicorn handles SIGTERM (stops accepting, finishes what is in flight) and raises it again once stopped:
        # ignored then, the stop is done (the CLI's handler, which raises, covers the load before).
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0
