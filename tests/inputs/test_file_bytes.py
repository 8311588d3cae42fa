"""``FileBytes``: a file's bytes in memory (a WebDataset member, an object from storage) encode bitwise as the file
on disk does, images in both resize backends and videos, and a bad one gets the same one-line error, named by its
name."""

from __future__ import annotations

import pytest
import torch

from qwenvl_vision import FileBytes, PreprocessError, load_encoder
from qwenvl_vision.options import DEFAULT_DECODE_BYTES
from tests.helpers import make_image_folder, write_video


@pytest.fixture(scope="module")
def encoder(checkpoint3):
    with load_encoder(checkpoint3, device="cpu") as enc:
        yield enc


@pytest.mark.parametrize("resize", ["pil", "torch"])
def test_images_in_memory_encode_bitwise_as_their_files(encoder, tmp_path, resize):
    paths = make_image_folder(tmp_path / "imgs", 4, bad=False)
    in_memory = [FileBytes(f"mem/{p.name}", p.read_bytes()) for p in paths]
    want = encoder.encode_images([str(p) for p in paths], max_pixels=64 * 64, resize=resize)
    got = encoder.encode_images(in_memory, max_pixels=64 * 64, resize=resize)
    assert all(torch.equal(a, b) for a, b in zip(got.embeddings, want.embeddings, strict=True))
    assert got.pixels_sha256 == want.pixels_sha256  # the same item ids in an encoder cache


def test_objects_are_fetched_once_each_within_the_decode_budget(encoder, tmp_path):
    paths = make_image_folder(tmp_path / "imgs", 3, bad=False)
    fetches = []
    objects = [FileBytes(f"s3://bucket/{p.name}", fetch=lambda limit, p=p: (fetches.append(limit), p.read_bytes())[1])
               for p in paths]
    got = encoder.encode_images(objects, max_pixels=64 * 64)
    assert fetches == [DEFAULT_DECODE_BYTES] * 3  # each fetched once, not read whole before the budget admits it
    assert not any(o.fetched for o in objects)
    want = encoder.encode_images([str(p) for p in paths], max_pixels=64 * 64)
    assert all(torch.equal(a, b) for a, b in zip(got.embeddings, want.embeddings, strict=True))


def test_a_video_in_memory_encodes_bitwise_as_its_file(encoder, tmp_path):
    pytest.importorskip("av")
    path = tmp_path / "clip.mp4"
    write_video(path, 9, 48, 40, 4)
    want = encoder.encode_videos([str(path)])
    got = encoder.encode_videos([FileBytes("clip.mp4", path.read_bytes())])
    assert torch.equal(got.embeddings[0], want.embeddings[0])
    assert got.video_info[0] == want.video_info[0]


def test_a_playlist_in_memory_opens_no_file_it_names(encoder, tmp_path, monkeypatch):
    """An ffconcat playlist sent as bytes (a server's data URL) would have FFmpeg open the files it names, relative
    to the process's folder: refused as not a video, the file never read."""
    pytest.importorskip("av")
    write_video(tmp_path / "private.mp4", 9, 48, 40, 4)
    monkeypatch.chdir(tmp_path)
    playlist = FileBytes("clip.mp4", b"ffconcat version 1.0\nfile private.mp4\n")
    with pytest.raises(PreprocessError, match=r"'clip.mp4'.*not a recognised video file"):
        encoder.encode_videos([playlist])


def test_bad_bytes_are_named_by_their_name_in_one_line(encoder, tmp_path):
    for data, needle in [(b"", "file is empty"), (b"not an image", "not a recognised image file")]:
        with pytest.raises(PreprocessError, match=needle) as caught:
            encoder.encode_images([FileBytes("shard.tar/000001.jpg", data)])
        assert "'shard.tar/000001.jpg'" in str(caught.value) and "\n" not in str(caught.value)


def test_a_url_s_kind_is_its_path_s_extension():
    from qwenvl_vision.inputs.video_io import is_video_file

    assert is_video_file(FileBytes("https://store/clip.mp4?X-Amz-Signature=abc", b"x"))
    assert not is_video_file(FileBytes("https://store/photo.jpg?v=2", b"x"))
