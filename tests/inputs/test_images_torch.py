"""``resize="torch"`` against transformers' torchvision-backed ``Qwen2VLImageProcessor``, pixel by pixel.

With torchvision installed, transformers 5.24 loads that processor for every Qwen checkpoint (and Qwen3-VL's
``preprocessor_config.json`` names it, ``Qwen2VLImageProcessorFast``). Our torch path uses torch ops only; these
tests need torchvision for the reference and are skipped without it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image
from tests.helpers import IMAGE_SETTINGS, PIXEL_TOL, sample_photo

pytest.importorskip("torchvision")
pytest.importorskip("matplotlib.cbook")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: E402


def _hopper() -> Image.Image:
    return Image.open(sample_photo("grace_hopper.jpg")).convert("RGB")


def _gif(frame: tuple[int, int, int, int], transparent: int | None = None, grey: bool = True,
         screen_table: bool = True) -> bytes:
    """A GIF Pillow cannot write, on a 16 x 8 screen of background index 9: maybe a coloured global table, the
    first ``frame`` (x, y, width, height) with its own table (a grey ramp, which Pillow opens as "L", keeping a
    global palette on it; else coloured), maybe a transparent index. Its pixels as LZW literals: 9-bit codes after
    a clear code, too few for the code size to grow."""
    x, y, width, height = frame
    pixels = [(7 * i) % 256 for i in range(width * height - 1)] + [0 if transparent is None else transparent]
    codes = [256, *pixels, 257]
    packed = sum(code << 9 * i for i, code in enumerate(codes)).to_bytes((9 * len(codes) + 7) // 8, "little")
    data = b"".join(bytes([len(packed[i:i + 255])]) + packed[i:i + 255] for i in range(0, len(packed), 255))
    colour, grey_ramp = bytes((i, 255 - i, 7)[c] for i in range(256) for c in range(3)), bytes(
        i for i in range(256) for _ in range(3))
    control = bytes([0x21, 0xF9, 4, 0 if transparent is None else 1, 0, 0, transparent or 0, 0])
    screen = (16).to_bytes(2, "little") + (8).to_bytes(2, "little") + (bytes([0xF7, 9, 0]) + colour if screen_table
                                                                        else bytes([0, 9, 0]))
    return (b"GIF89a" + screen + control + b"\x2c" + b"".join(v.to_bytes(2, "little") for v in frame)
            + bytes([0x87]) + (grey_ramp if grey else colour[::-1]) + bytes([8]) + data + b"\x00\x3b")


def _images(tmp_path) -> dict:
    """The project's test photos in every input kind and the size cases that exercise different resizes."""
    hopper = _hopper()
    rgba = Image.open(sample_photo("Minduka_Present_Blue_Pack.png"))
    rgba.load()
    hopper.save(tmp_path / "hopper.png")
    hopper.resize((160, 120)).convert("P", palette=Image.ADAPTIVE, colors=32).save(tmp_path / "trns.gif",
                                                                                  transparency=5, background=9)
    grey = hopper.resize((160, 120)).convert("L")  # a whole grey ramp for its table: Pillow opens it as "L"
    grey.save(tmp_path / "grey.gif", transparency=200, background=9, optimize=False)
    assert Image.open(tmp_path / "grey.gif").mode == "L"
    (tmp_path / "local-grey.gif").write_bytes(_gif((0, 0, 16, 8), transparent=200))
    (tmp_path / "inset.gif").write_bytes(_gif((2, 1, 12, 6)))
    (tmp_path / "past.gif").write_bytes(_gif((4, 2, 14, 7), transparent=5, grey=False, screen_table=False))
    (tmp_path / "wide.gif").write_bytes(_gif((0, 0, 20, 10), grey=False))  # no transparency: torchvision leaves
    # a transparent pixel outside the screen unwritten
    assert Image.open(tmp_path / "local-grey.gif").mode == Image.open(tmp_path / "inset.gif").mode == "L"
    assert Image.open(tmp_path / "past.gif").size == (18, 9)  # Pillow widens its screen to the frame
    rgba.save(tmp_path / "rgba.png")
    alpha = np.dstack([np.asarray(hopper.resize((120, 90))), np.linspace(0, 255, 120 * 90).astype(np.uint8)
                       .reshape(90, 120)])
    return {
        "photo (jpeg path)": sample_photo("grace_hopper.jpg"),
        "png path": str(tmp_path / "hopper.png"),
        "rgba png path": str(tmp_path / "rgba.png"),
        "gif path, a transparent index": str(tmp_path / "trns.gif"),
        "grey gif path, a transparent index": str(tmp_path / "grey.gif"),
        "gif path, a grey local table under a coloured global one": str(tmp_path / "local-grey.gif"),
        "gif path, a first frame inside its screen": str(tmp_path / "inset.gif"),
        "gif path, a first frame past its screen, no global table": str(tmp_path / "past.gif"),
        "gif path, a first frame larger than its screen": str(tmp_path / "wide.gif"),
        "rgba": rgba,
        "logo rgba": Image.open(sample_photo("logo2.png")).convert("RGBA"),
        "grayscale": hopper.convert("L").resize((333, 211)),
        "palette": hopper.convert("P", palette=Image.ADAPTIVE, colors=64).resize((256, 192)),
        "cmyk": hopper.resize((300, 256)).convert("CMYK"),
        "tiny, upscaled": hopper.resize((21, 17), Image.BICUBIC),
        "above max_pixels": hopper.resize((4600, 3900), Image.BICUBIC),
        "exact size, no resize": hopper.resize((448, 448)),
        "wide": hopper.crop((0, 200, 512, 260)),
        "numpy hwc": np.asarray(hopper.resize((200, 150))),
        "numpy gray": np.asarray(hopper.convert("L").resize((170, 130)))[:, :, None],
        "numpy rgba": alpha,
        "torch chw": torch.from_numpy(np.array(hopper.resize((150, 220)))).permute(2, 0, 1).contiguous(),
    }


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return _images(tmp_path_factory.mktemp("torch-photos"))


@pytest.mark.parametrize("family", list(IMAGE_SETTINGS))
def test_torch_resize_equals_torchvision_processor(images, family):
    settings = dict(IMAGE_SETTINGS[family])
    reference = Qwen2VLImageProcessor(**settings)
    config = dataclasses.replace(PreprocessConfig.for_family(family), resize="pil")  # resize chosen per call
    if family == "qwen3_vl":  # above max_pixels at Qwen3's 16.7 MP bound would be a 60 MP test image
        settings["size"] = {"shortest_edge": 65536, "longest_edge": 4_000_000}
        reference = Qwen2VLImageProcessor(**settings)
        config = dataclasses.replace(config, max_pixels=4_000_000)
    for name, image in images.items():
        expected = reference([image], return_tensors="pt")
        values, grid = preprocess_image(image, config, resize="torch")
        assert list(grid) == expected["image_grid_thw"][0].tolist(), name
        assert values.shape == expected["pixel_values"].shape, name
        assert (values - expected["pixel_values"]).abs().max().item() <= PIXEL_TOL, name


def test_backends_differ_and_each_matches_its_own_processor(images):
    """The reason for the option: the two transformers backends disagree by far more than our tolerance."""
    settings = IMAGE_SETTINGS["qwen3_vl"]
    config = PreprocessConfig.for_family("qwen3_vl")
    image = images["photo (jpeg path)"]
    pil_ref = Qwen2VLImageProcessorPil(**settings)([image], return_tensors="pt")["pixel_values"]
    torch_ref = Qwen2VLImageProcessor(**settings)([image], return_tensors="pt")["pixel_values"]
    assert (pil_ref - torch_ref).abs().max().item() > 1e-3
    assert (preprocess_image(image, config, resize="pil")[0] - pil_ref).abs().max().item() <= PIXEL_TOL
    assert (preprocess_image(image, config, resize="torch")[0] - torch_ref).abs().max().item() <= PIXEL_TOL
    # Qwen3-VL's released config names the torchvision processor: that is the default.
    assert config.resize == "torch"
    assert torch.equal(preprocess_image(image, config)[0], preprocess_image(image, config, resize="torch")[0])
