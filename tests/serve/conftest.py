"""The serve tests' app: a tiny Qwen3-VL encoder (DeepStack) served in this process by FastAPI's TestClient, with a
key, the encoder role, a loopback media domain, a local media folder and small limits (6 items a request, 4 waiting);
and the media they send."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from qwenvl_vision import load_encoder
from tests.helpers import synthetic_photo, write_video
from tests.helpers.serve import KEY


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("media")
    paths = {}
    for i, name in enumerate(("a.png", "b.png", "c.png")):
        paths[name] = folder / name
        Image.fromarray(synthetic_photo(40 + 9 * i, 56 + 7 * i, i, noise=25.0)).save(paths[name])
    paths["clip.mp4"] = folder / "clip.mp4"
    write_video(paths["clip.mp4"], 6, 48, 40, 4)
    paths["broken.png"] = folder / "broken.png"
    paths["broken.png"].write_bytes(b"\x89PNG\r\n\x1a\n not really a png" * 3)
    return paths


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoint3, media):
    """(client, root): the app over ``root/shared`` (encoder role), media from 127.0.0.1 and under ``root/local``."""
    from fastapi.testclient import TestClient

    from qwenvl_vision.serve.app import ServeSettings, build_app
    from qwenvl_vision.serve.media import MediaPolicy

    root = tmp_path_factory.mktemp("serve")
    (root / "local").mkdir()
    for name in ("a.png", "clip.mp4"):
        (root / "local" / name).write_bytes(media[name].read_bytes())
    settings = ServeSettings("tiny", api_key=KEY, shared=root / "shared", max_body=1 << 20, max_items=6, max_queue=4,
                             policy=MediaPolicy(frozenset({"127.0.0.1"}), (root / "local").resolve(), 30.0))
    app = build_app(load_encoder(checkpoint3, device="cpu"), settings)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, root


@pytest.fixture(scope="module")
def encoder3(checkpoint3):
    """The reference: the same checkpoint loaded as the app loads it."""
    with load_encoder(checkpoint3, device="cpu") as encoder:
        yield encoder
