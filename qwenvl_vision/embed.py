"""``qwenvl-vision embed``: folders of images -> safetensors shards + manifest.jsonl, resumable, multi-rank.

Durability: a batch's shard is written to a temporary file and renamed into place *before* its
manifest lines are appended (one write, flushed and fsynced). A run killed at any instant therefore
leaves (a) complete shards, (b) a manifest whose complete lines all point at complete shards, and at
worst (c) one shard nobody references and one half-written last line. ``--resume`` drops (c), keeps
every input recorded ok exactly once, retries the rest, and never reuses a shard name.

Ranks: under ``torchrun`` (RANK / WORLD_SIZE set) inputs are split statically, rank r taking inputs
r, r+W, r+2W, ... (never padded with duplicates); each rank writes ``shard-r{rank}-*.safetensors`` and
``manifest.rank{rank}.jsonl``; after a gloo barrier rank 0 merges the parts into ``manifest.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
LIST_EXTENSIONS = {".txt", ".lst", ".list"}
MANIFEST = "manifest.jsonl"


# ---------------------------------------------------------------------- inputs


def collect_inputs(inputs: list[str]) -> list[str]:
    """Image files as given, folders recursively by image extension (sorted), text files as path lists."""
    paths: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            paths.extend(str(f) for f in sorted(p.rglob("*")) if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        elif p.suffix.lower() in LIST_EXTENSIONS and p.is_file():
            base = p.parent
            for line in p.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    paths.append(str(Path(line) if Path(line).is_absolute() else base / line))
        else:
            paths.append(str(p))  # a missing file is recorded as an error, not dropped
    seen: set[str] = set()
    unique = []
    for path in paths:  # the same file named twice is embedded once
        if path not in seen:
            seen.add(path)
            unique.append(path)
    return unique


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def shard_for_rank(paths: list[str], rank: int, world: int) -> list[str]:
    return paths[rank::world]


# ---------------------------------------------------------------------- manifest


def part_name(rank: int, world: int) -> str:
    return MANIFEST if world == 1 else f"manifest.rank{rank}.jsonl"


def read_manifest_lines(path: Path) -> list[dict]:
    """Complete JSON lines of a manifest; a torn last line (killed mid-write) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "path" in record:
            records.append(record)
    return records


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _append_lines(path: Path, records: list[dict]) -> None:
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records)
    with open(path, "a") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class RankWriter:
    """Writes one rank's shards and manifest part; recovers a killed run's state on resume."""

    def __init__(self, out: Path, rank: int, world: int, resume: bool) -> None:
        self.out, self.rank, self.world = out, rank, world
        out.mkdir(parents=True, exist_ok=True)
        self.manifest = out / part_name(rank, world)
        self.done: dict[str, dict] = {}
        self.next_shard = 0
        if resume:
            self._recover()
        else:
            self._start_fresh()

    def _own_shards(self) -> list[Path]:
        return sorted(self.out.glob(f"shard-r{self.rank}-*.safetensors"))

    def _start_fresh(self) -> None:
        if self.manifest.exists() or self._own_shards():
            raise FileExistsError(f"{self.out} already holds a run (rank {self.rank}); use --resume to continue "
                                  f"it or choose another --out")

    def _recover(self) -> None:
        records = read_manifest_lines(self.manifest)
        if self.world > 1 and not records:  # resuming a finished multi-rank run: parts were merged
            merged = read_manifest_lines(self.out / MANIFEST)
            records = [r for r in merged if r.get("rank", 0) == self.rank]
        for r in records:
            if r.get("status") == "ok" and (self.out / r["shard"]).is_file():
                self.done.setdefault(r["path"], r)
        referenced = {r["shard"] for r in self.done.values()}
        for shard in self._own_shards():  # written but never recorded: the run died between rename and append
            if shard.name not in referenced:
                shard.unlink()
        for tmp in self.out.glob(f"shard-r{self.rank}-*.tmp"):
            tmp.unlink()
        numbers = [int(s.stem.rsplit("-", 1)[1]) for s in self._own_shards()]
        self.next_shard = max(numbers, default=-1) + 1
        # Rewrite the part with each ok input once; errors are dropped so they are retried.
        _atomic_write_text(self.manifest, "".join(json.dumps(r) + "\n" for r in self.done.values()))

    def write_batch(self, results, pooled_only: bool) -> tuple[int, int]:
        """One shard for the batch's successes (renamed into place), then its manifest lines."""
        tensors: dict[str, torch.Tensor] = {}
        records = []
        shard_name = f"shard-r{self.rank}-{self.next_shard:06d}.safetensors"
        ok = failed = 0
        for r in results:
            record = {"path": r.path, "status": "ok" if r.ok else "error", "error": r.error, "rank": self.rank}
            if r.ok:
                key = f"{ok:06d}"
                if pooled_only:
                    tensors[key] = r.pooled.float().contiguous().cpu()
                else:
                    tensors[key] = r.embedding.contiguous().cpu()
                    for level, t in enumerate(r.deepstack or []):
                        tensors[f"{key}.deepstack.{level}"] = t.contiguous().cpu()
                record.update(shard=shard_name, key=key, grid_thw=list(r.grid_thw),
                              tokens=int(r.embedding.shape[0]))
                ok += 1
            else:
                failed += 1
            records.append(record)
        if tensors:
            tmp = self.out / (shard_name[: -len(".safetensors")] + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.out / shard_name)
            self.next_shard += 1
        _append_lines(self.manifest, records)
        return ok, failed


def merge_parts(out: Path, world: int) -> Path:
    """Rank 0, after all ranks finished: parts -> one manifest.jsonl (atomic), parts removed."""
    records = []
    for rank in range(world):
        records.extend(read_manifest_lines(out / part_name(rank, world)))
    _atomic_write_text(out / MANIFEST, "".join(json.dumps(r) + "\n" for r in records))
    for rank in range(world):
        (out / part_name(rank, world)).unlink(missing_ok=True)
    return out / MANIFEST


def read_embeddings(out: str | os.PathLike, *, deepstack: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every input recorded ok in DIR/manifest.jsonl, in manifest order.

    With deepstack=True yields (path, (embedding, [levels...])) for Qwen3-VL runs.
    """
    out = Path(out)
    records = read_manifest_lines(out / MANIFEST)
    open_shard, handle = None, None
    try:
        for r in records:
            if r.get("status") != "ok":
                continue
            if r["shard"] != open_shard:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(out / r["shard"], framework="pt")
                handle.__enter__()
                open_shard = r["shard"]
            tensor = handle.get_tensor(r["key"])
            if deepstack:
                names = sorted(k for k in handle.keys() if k.startswith(r["key"] + ".deepstack."))
                yield r["path"], (tensor, [handle.get_tensor(k) for k in names])
            else:
                yield r["path"], tensor
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


# ---------------------------------------------------------------------- the job


class _PathResult:
    """An ItemResult with the input's path attached (the manifest's key)."""

    def __init__(self, item, path: str) -> None:
        self.path = path
        self.ok = item.ok
        self.error = item.error
        self.embedding = item.embedding
        self.grid_thw = item.grid_thw
        self.deepstack = item.deepstack
        self.pooled = item.pooled


def _progress(total: int, rank: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", desc=f"embed[rank {rank}]" if rank else "embed", dynamic_ncols=True,
                disable=None, file=sys.stderr)


def run_embed(args: argparse.Namespace) -> int:
    from .encoder import load_encoder

    rank, world = rank_and_world()
    distributed = world > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    out = Path(args.out)
    try:
        all_paths = collect_inputs(args.inputs)
        mine = shard_for_rank(all_paths, rank, world)
        writer = RankWriter(out, rank, world, args.resume)
        todo = [p for p in mine if p not in writer.done]
        device = args.device
        if device is None and torch.cuda.is_available():
            device = "cuda"
        if device and device.startswith("cuda") and distributed:  # one GPU per local rank
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % max(torch.cuda.device_count(), 1)}"
        encoder = load_encoder(args.model, device=device, dtype=args.dtype, random_weights=args.random_weights,
                               compile=args.compile)
        failed = 0
        with encoder, _progress(len(todo), rank) as bar:
            start, tokens = time.perf_counter(), 0
            batches = encoder.iter_encode(todo, min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                                          max_batch_tokens=args.batch_tokens, pooled=args.pooled_only)
            for batch in batches:
                results = [_PathResult(r, todo[r.index]) for r in batch]
                ok, bad = writer.write_batch(results, args.pooled_only)
                failed += bad
                tokens += sum(int(r.embedding.shape[0]) for r in results if r.ok)
                bar.update(ok + bad)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(img_s=f"{bar.n / elapsed:.1f}", tok_s=f"{tokens / elapsed:.0f}")
        if distributed:
            dist.barrier()
            if rank == 0:
                merge_parts(out, world)
            dist.barrier()
        records = read_manifest_lines(out / MANIFEST) if rank == 0 else read_manifest_lines(writer.manifest)
        total_failed = sum(1 for r in records if r.get("status") != "ok") if rank == 0 else failed
        if rank == 0:
            ok_count = sum(1 for r in records if r.get("status") == "ok")
            print(f"embedded {ok_count} of {len(all_paths)} inputs into {out} "
                  f"({total_failed} failed; see {out / MANIFEST})", file=sys.stderr)
        return 1 if total_failed else 0
    finally:
        if distributed:
            dist.destroy_process_group()


def add_embed_parser(sub) -> None:
    p = sub.add_parser("embed", help="embed images into safetensors shards with a manifest")
    p.add_argument("inputs", nargs="+", help="image files, folders (recursive), or .txt files listing paths")
    p.add_argument("--model", required=True, help="checkpoint folder, vision-only folder, repo id, or preset")
    p.add_argument("--out", required=True, help="output folder for shards and manifest.jsonl")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--min-pixels", type=int)
    p.add_argument("--max-pixels", type=int)
    p.add_argument("--batch-tokens", type=int, default=16384, help="patches per forward (an item above runs alone)")
    p.add_argument("--pooled-only", action="store_true", help="store one mean vector per image")
    p.add_argument("--resume", action="store_true", help="continue a killed or failed run in --out")
    p.add_argument("--random-weights", action="store_true", help="with a preset --model: random weights, offline")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the blocks (pays off on CUDA for long jobs; slower on CPU, see README)")
    p.set_defaults(func=run_embed)
