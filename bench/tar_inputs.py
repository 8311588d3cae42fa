"""Inputs from a WebDataset shard against the same files in a folder: images/s of the encode loop ``embed`` runs,
side by side in one process.

    python -m bench.tar_inputs                       # 48 photos, qwen3.5-0.8b random weights, 4 rounds
    python -m bench.tar_inputs --images 96 --max-pixels 200704

Both sides use one loaded encoder and ``embed``'s own input pieces: ``gather_inputs`` over the folder or the shard,
then ``iter_encode`` over ``shards.items_of`` (a path per file, or a member's bytes read from its shard when
decoded), the outputs checked bitwise equal. Rounds alternate (folder, shard, shard, folder, ...) so that a
machine's drift moves both; the medians and their ratio are printed. The files are JPEGs of the package's test
photos at several sizes.
"""

from __future__ import annotations

import argparse
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from qwenvl_vision import load_encoder
from qwenvl_vision.embed.args import positive_option
from qwenvl_vision.embed.inputs import gather_inputs
from qwenvl_vision.embed.shards import items_of
from qwenvl_vision.testing.workloads import photo

SIZES = [(448, 448), (600, 512), (480, 640), (640, 480), (560, 560), (336, 448)]


def write_collection(folder: Path, count: int) -> tuple[Path, Path]:
    """``count`` JPEG photos in ``folder/imgs`` and the same bytes as members of ``folder/shard.tar``."""
    imgs = folder / "imgs"
    imgs.mkdir(parents=True)
    paths = []
    for i in range(count):
        h, w = SIZES[i % len(SIZES)]
        path = imgs / f"{i:06d}.jpg"
        Image.fromarray(photo(h, w, i)).save(path, quality=90)
        paths.append(path)
    shard = folder / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for path in paths:
            tar.add(path, arcname=path.name)
    return imgs, shard


def encode(encoder, source: Path, max_pixels: int) -> tuple[float, list[torch.Tensor]]:
    inputs = gather_inputs([str(source)])
    start = time.perf_counter()
    out = [r.embedding for batch in encoder.iter_encode(items_of(inputs.paths, inputs.members), video=None,
                                                        max_pixels=max_pixels) for r in batch]
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=positive_option(int, "--images"), default=48)
    parser.add_argument("--rounds", type=positive_option(int, "--rounds"), default=4,
                        help="rounds per side, alternating")
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--max-pixels", type=int, default=224 * 224)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, load_encoder(args.preset, device="cpu", random_weights=True) as enc:
        folder, shard = write_collection(Path(tmp), args.images)
        encode(enc, folder, args.max_pixels)  # warm-up: the CPU plan, the shape cache, the page cache
        times: dict[str, list[float]] = {"folder": [], "shard": []}
        outputs = {}
        for r in range(args.rounds):
            for side in (("folder", "shard") if r % 2 == 0 else ("shard", "folder")):
                seconds, outputs[side] = encode(enc, folder if side == "folder" else shard, args.max_pixels)
                times[side].append(seconds)
        assert all(torch.equal(a, b) for a, b in zip(outputs["folder"], outputs["shard"], strict=True))
    medians = {side: statistics.median(t) for side, t in times.items()}
    result = {"images": args.images, "preset": args.preset, "max_pixels": args.max_pixels,
              "threads": torch.get_num_threads(), "times_s": times, "median_s": medians,
              "images_per_s": {side: args.images / m for side, m in medians.items()},
              "shard_vs_folder": medians["folder"] / medians["shard"]}
    print(f"{args.images} images, {args.preset} (random weights), max_pixels {args.max_pixels}, "
          f"{result['threads']} threads, {args.rounds} rounds a side")
    for side in ("folder", "shard"):
        print(f"  {side:6s} {medians[side]:.2f} s  {result['images_per_s'][side]:.1f} img/s  "
              f"({', '.join(f'{t:.2f}' for t in times[side])})")
    print(f"  shard / folder throughput: {result['shard_vs_folder']:.3f}")
    return result


if __name__ == "__main__":
    main()
