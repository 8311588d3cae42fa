"""What ``embed --engine ray`` costs over the local engine on one machine: the same folder through both,
side by side in one run, and where the difference goes.

What is measured
----------------
``--images`` small photos (``qwenvl_vision.testing.workloads.photo``, 96..160 px a side, written once into
``--workdir``) embedded on the CPU with a preset's random weights (``--preset``, default qwen3.5-0.8b),
``--rounds`` times each, the two engines alternating, each run ``qwenvl_vision.cli.main(["embed", ...])`` in
this process into a fresh ``--out``:

- ``local``: ``embed`` as it is (one process, torch's threads: one per core);
- ``ray``: ``embed --engine ray``, which starts a local Ray with the machine's CPUs, loads the tower in the driver
  (for run.json's hashes) and again in each actor (cores / threads actors of one thread each on a small machine),
  and writes the shards the actors hand back.

Both times are wall-clock from the call to its return and include loading the tower; the ratio is ray / local
(target: within 1.15x). The rest of the Ray time is broken down by measuring alone, in the same run: starting and
stopping a local Ray (``ray.init`` + ``ray.shutdown``), loading the tower once (what each actor does before its
first batch, on top of the driver's load), and the object store's share (the embeddings of every image put and
fetched once: what crosses from the actors to the driver).

    python -m bench.ray_overhead                       # 200 images, qwen3.5-0.8b, 1 round
    python -m bench.ray_overhead --images 8            # a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from qwenvl_vision.cli import main as cli
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.testing.workloads import photo


def make_folder(folder: Path, count: int) -> Path:
    """`count` small photos (reused when the folder already holds them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = folder / f"img{i:04d}.jpg"
        if not path.exists():
            Image.fromarray(photo(96 + 16 * (i % 5), 96 + 16 * (i % 4), seed=i)).save(path, quality=90)
    return folder


def run_embed(folder: Path, out: Path, preset: str, extra: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    code = cli(["embed", str(folder), "--model", preset, "--random-weights", "--device", "cpu", "--out", str(out),
                "--quiet", *extra])
    elapsed = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"embed {' '.join(extra)} exited {code}")
    return elapsed


def parts(preset: str, out: Path) -> dict[str, float]:
    """The Ray run's overheads, each measured alone."""
    import ray
    import torch

    from qwenvl_vision.embed import read_embeddings
    from qwenvl_vision.loading import load_encoder

    start = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="error")
    cpus = int(ray.cluster_resources().get("CPU", 1))
    started = time.perf_counter() - start
    tensors = [t.float().numpy() for _, t in read_embeddings(out)]
    start = time.perf_counter()
    refs = [ray.put(t) for t in tensors]
    fetched = ray.get(refs)
    store = time.perf_counter() - start
    assert all(np.array_equal(a, b) for a, b in zip(tensors, fetched))
    start = time.perf_counter()
    ray.shutdown()
    started += time.perf_counter() - start
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in an actor
    try:
        with load_encoder(preset, random_weights=True, device="cpu"):
            pass
    finally:
        torch.set_num_threads(threads)
    load = time.perf_counter() - start
    return {"ray_start_stop_s": started, "tower_load_s": load, "object_store_s": store, "cpus": cpus,
            "embedding_mib": sum(t.nbytes for t in tensors) / 2**20}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=positive_option(int, "--images"), default=200)
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--rounds", type=positive_option(int, "--rounds"), default=1)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "qwenvl-ray-overhead")
    p.add_argument("--json", type=Path, help="write the numbers here too")
    args = p.parse_args(argv)
    folder = make_folder(args.workdir / f"photos-{args.images}", args.images)
    times: dict[str, list[float]] = {"local": [], "ray": []}
    for _ in range(args.rounds):
        times["local"].append(run_embed(folder, args.workdir / "out-local", args.preset, []))
        times["ray"].append(run_embed(folder, args.workdir / "out-ray", args.preset, ["--engine", "ray"]))
    local, ray_s = statistics.median(times["local"]), statistics.median(times["ray"])
    result = {"images": args.images, "preset": args.preset, "local_s": local, "ray_s": ray_s, "ratio": ray_s / local,
              "rounds": times, **parts(args.preset, args.workdir / "out-ray")}
    print(f"{args.images} images, {args.preset} (random weights), CPU, {result['cpus']} CPUs")
    print(f"  embed (local)        {local:8.2f} s  {args.images / local:6.1f} img/s")
    print(f"  embed --engine ray   {ray_s:8.2f} s  {args.images / ray_s:6.1f} img/s")
    print(f"  ratio ray / local    {result['ratio']:8.2f}x  (target <= 1.15x)")
    print(f"  of which, measured alone: Ray start + stop {result['ray_start_stop_s']:.2f} s, one more tower load "
          f"{result['tower_load_s']:.2f} s (each actor), object store {result['object_store_s']:.3f} s for "
          f"{result['embedding_mib']:.1f} MiB of embeddings")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
