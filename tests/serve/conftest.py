"""The serve tests' app: a tiny Qwen3-VL encoder (DeepStack) served in this process by FastAPI's TestClient, with a
key, the encoder role, a loopback media domain, a local media folder and small limits (4 items a request, 4 waiting);
one whose encoder waits to be let go (``held``); and the media they send."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from qwenvl_vision import load_encoder
from tests.helpers import synthetic_photo, write_video
from tests.helpers.serve import KEY, Held, app_of, server_options


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

    root = tmp_path_factory.mktemp("serve")
    (root / "local").mkdir()
    for name in ("a.png", "clip.mp4"):
        (root / "local" / name).write_bytes(media[name].read_bytes())
    with TestClient(app_of(load_encoder(checkpoint3, device="cpu"), *server_options(root)),
                    headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, root


@pytest.fixture
def held(tmp_path, checkpoint3):
    """(client, encoder): the app's settings (``served``) over a ``Held`` encoder, let go at the end."""
    from fastapi.testclient import TestClient

    (tmp_path / "local").mkdir()
    encoder = Held(load_encoder(checkpoint3, device="cpu"))
    try:
        with TestClient(app_of(encoder, *server_options(tmp_path)), headers={"Authorization": f"Bearer {KEY}"},
                        raise_server_exceptions=False) as c:  # a 500 is answered, as to a client
            yield c, encoder
            encoder.go.set()
    finally:
        encoder.go.set()


@pytest.fixture(scope="module")
def encoder3(checkpoint3):
    """The reference: the same checkpoint loaded as the app loads it."""
    with load_encoder(checkpoint3, device="cpu") as encoder:
        yield encoder
