"""Peak RSS of ``qwenvl-vision embed`` on a folder of very large images: what decoding costs.

What is measured
----------------
``--count`` JPEGs of about ``--pixels`` pixels each (smooth gradients with mild noise, so a few hundred KB each:
the file sizes say nothing about the decoded size) are written once into ``--workdir`` and reused. A tiny
random Qwen2.5-VL checkpoint (4 blocks, width 160) is written next to them, so the tower's weights and
activations are negligible and the peak is the decode. ``--max-pixels`` (default 200704, 256 merged tokens)
keeps the resized inputs small for the same reason.

Each run is ``qwenvl_vision.cli.main(["embed", ...])`` in a fresh Python subprocess; the peak is the child's
own ``VmHWM`` (``/proc/self/status``) at exit, minus nothing: it includes the ~0.3-0.5 GB of the torch import.
A baseline row embeds one small image the same way, so ``peak - baseline`` is what the large images cost.

``--pythonpath`` runs the children against another source tree (e.g. ``git archive <commit> | tar -x -C DIR``)
to measure before and after side by side; a tree without ``--max-input-pixels`` is run without that option.

    python -m bench.embed_memory                                  # 6 images of 63.9 MP, default limit
    python -m bench.embed_memory --pixels 89400000 --max-input-pixels 89478485
    python -m bench.embed_memory --pythonpath /tmp/base --pixels 89400000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import os, sys
cpus = int(os.environ["EMBED_MEMORY_CPUS"])
os.cpu_count = lambda: cpus  # embed decodes with min(4, cpu_count) threads: emulate a machine this wide
import qwenvl_vision
from qwenvl_vision.cli import main
code = main(sys.argv[2:])
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
with open(sys.argv[1], "w") as f:
    f.write(f"{code} {peak} {qwenvl_vision.__file__}")
"""


def write_images(folder: Path, count: int, pixels: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    side = math.isqrt(pixels)
    height, width = side, pixels // side
    paths = []
    for i in range(count):
        path = folder / f"big{i}-{width}x{height}.jpg"
        if not path.exists():
            rng = np.random.default_rng(i)
            x = (np.arange(width, dtype=np.uint32) * 255 // width).astype(np.uint8)
            y = (np.arange(height, dtype=np.uint32) * 255 // height).astype(np.uint8)
            image = np.empty((height, width, 3), dtype=np.uint8)
            image[..., 0] = x[None, :]
            image[..., 1] = y[:, None]
            image[..., 2] = rng.integers(96, 160, size=(height, width), dtype=np.uint8)
            Image.fromarray(image).save(path, quality=80)
            del image
        paths.append(path)
    return paths


def write_tiny_checkpoint(folder: Path) -> Path:
    """The small Qwen2.5-VL tower in the released layout (which every tree reads, old ones included), fp32."""
    if not (folder / "config.json").exists():
        import torch

        from bench.load import write_checkpoint
        from bench.workloads import QWEN2_5_SMALL

        write_checkpoint(folder, QWEN2_5_SMALL, dtype=torch.float32)
    return folder


def run_child(pythonpath: Path, argv: list[str], cpus: int) -> tuple[int, int]:
    """Run embed in a fresh process importing the package from `pythonpath`; (exit code, peak bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "peak"
        env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
               "EMBED_MEMORY_CPUS": str(cpus)}
        # cwd = the tree: `python -c` puts the cwd first on the import path, ahead of PYTHONPATH.
        proc = subprocess.run([sys.executable, "-c", CHILD, str(result_file), *argv], env=env, capture_output=True,
                              text=True, cwd=pythonpath)
        if not result_file.exists():
            raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        code, peak, package = result_file.read_text().split(maxsplit=2)
        if not Path(package).resolve().is_relative_to(pythonpath.resolve()):
            raise SystemExit(f"the child imported {package}, not the tree {pythonpath}")
        return int(code), int(peak)


def supports_max_input_pixels(pythonpath: Path) -> bool:
    """Whether the tree's embed has --max-input-pixels (embed.py in older trees, embed/args.py now)."""
    root = pythonpath / "qwenvl_vision"
    source = root / "embed.py" if (root / "embed.py").exists() else root / "embed" / "args.py"
    return "max-input-pixels" in source.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--pixels", type=int, default=63_900_000, help="pixels per image")
    parser.add_argument("--max-input-pixels", type=int, help="passed to embed (default: embed's own)")
    parser.add_argument("--max-pixels", type=int, default=200704)
    parser.add_argument("--extra", default="", help="more embed options, space separated")
    parser.add_argument("--pythonpath", type=Path, default=REPO, help="source tree the children import")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "qwenvl-embed-memory")
    parser.add_argument("--cpus", type=int, default=8,
                        help="os.cpu_count() as the children see it (embed decodes with min(4, cpu_count) threads)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    images = write_images(args.workdir / "images" / f"{args.pixels}", args.count, args.pixels)
    small = write_images(args.workdir / "images" / "small", 1, 640 * 480)
    checkpoint = write_tiny_checkpoint(args.workdir / "tiny-qwen2.5")
    rows = {}
    runs = (("baseline (one 0.3 MP image)", small), (f"{args.count} x {args.pixels / 1e6:.1f} MP", images))
    for name, inputs in runs:
        with tempfile.TemporaryDirectory(dir=args.workdir) as out:
            argv = ["embed", *map(str, inputs), "--model", str(checkpoint), "--out", str(Path(out) / "emb"),
                    "--device", "cpu", "--max-pixels", str(args.max_pixels), *args.extra.split()]
            if args.max_input_pixels and supports_max_input_pixels(args.pythonpath):
                argv += ["--max-input-pixels", str(args.max_input_pixels)]
            code, peak = run_child(args.pythonpath, argv, args.cpus)
            records = [json.loads(line) for line in (Path(out) / "emb" / "manifest.jsonl").read_text().splitlines()]
        ok = sum(r["status"] == "ok" for r in records)
        errors = sorted({r["error"].split(": ", 1)[-1] for r in records if r["status"] != "ok"})
        rows[name] = {"exit": code, "ok": ok, "inputs": len(records), "peak_rss_mib": round(peak / 2**20, 1),
                      "errors": errors}
    base = next(iter(rows.values()))["peak_rss_mib"]
    input_mib = sum(p.stat().st_size for p in images) / 2**20
    print(f"tree: {args.pythonpath}; input files {input_mib:.1f} MiB; max_pixels {args.max_pixels}; "
          f"cpu_count seen {args.cpus}")
    for name, row in rows.items():
        print(f"{name:28s} exit {row['exit']}  ok {row['ok']}/{row['inputs']}  peak RSS {row['peak_rss_mib']:8.1f} MiB"
              f"  (+{row['peak_rss_mib'] - base:.1f} over baseline)" + "".join(f"\n    {e}" for e in row["errors"]))
    if args.json:
        args.json.write_text(json.dumps({"tree": str(args.pythonpath), "pixels": args.pixels, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
