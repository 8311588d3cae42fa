"""Media for tests: generated image content (gradients plus noise), a video file of a panned real photo (PyAV),
and a folder of small images with broken ones among them. The photos themselves are
``qwenvl_vision.testing.workloads``'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from qwenvl_vision.testing.workloads import sample_photo, synthetic_photo


def content(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """uint8 HxWxC: per-channel sinusoidal gradients plus Gaussian noise, clipped (hits 0 and 255), so that resize
    and rounding differences would show."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    c = np.arange(channels)[None, None, :]
    smooth = 128 + 110 * np.sin(2 * np.pi * (x * (1 + c) + 0.7 * y) + c) * np.cos(np.pi * y * (2 - 0.3 * c))
    return np.clip(smooth + rng.normal(0, 14, (height, width, channels)), 0, 255).astype(np.uint8)


def write_video(path, count: int, width: int, height: int, rate, codec: str = "mpeg4") -> None:
    """A video file of ``count`` frames (PyAV): a real photo panned 3 px per frame, plus noise, so that sampling
    the wrong frame or resizing differently would show."""
    import av

    photo = np.asarray(Image.open(sample_photo("grace_hopper.jpg")).convert("RGB").resize((width * 2, height * 2)))
    rng = np.random.default_rng(count)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(count):
            frame = np.roll(photo, 3 * i, axis=1)[:height, :width].astype(np.int16)
            frame = np.clip(frame + rng.integers(-20, 20, frame.shape), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def make_image_folder(root: Path, n: int, bad: bool = True) -> list[Path]:
    """n small images (jpg and png, some in a subfolder); with bad=True also a corrupt, an empty and a text file
    named as images, and a non-image file. Returns the good images' paths."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sub").mkdir(exist_ok=True)
    paths = []
    for i in range(n):
        folder = root / "sub" if i % 3 == 0 else root
        path = folder / f"img{i:03d}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(synthetic_photo(40 + 7 * (i % 5), 50 + 11 * (i % 4), i, noise=25.0)).save(path)
        paths.append(path)
    if bad:
        (root / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 3)
        (root / "empty.png").write_bytes(b"")
        (root / "notes.png").write_text("just text, wrongly named")
        (root / "readme.md").write_text("not an image extension: ignored")
    return paths
