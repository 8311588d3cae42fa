"""qwenvl_vision.inputs.images against transformers' Qwen2VLImageProcessorPil, the numerical reference.

The reference is configured the way the released checkpoints are (Qwen2.5-VL: patch 14, CLIP mean/std,
min/max pixels 3136/12845056; Qwen3-VL: patch 16, mean = std = 0.5, size 65536/16777216), built from
literal values (``tests.helpers.processors``) so a bug in PreprocessConfig cannot leak into the reference. Images
are generated (smooth gradients + noise, ``tests.helpers.content``) so that resize and rounding differences would show.

The torchvision-backed image processor is compared in tests/inputs/test_images_torch.py, the shared ``smart_resize``
in tests/inputs/test_pixels.py, videos in tests/inputs/test_video.py and tests/inputs/test_video_io.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from qwenvl_vision.errors import ConfigError, PreprocessError
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image, probe_image
from qwenvl_vision.inputs.pixels import input_name, load_rgb
from tests.helpers import (
    CLIP_MEAN,
    CLIP_STD,
    PIXEL_TOL,
    REFERENCE_FAMILIES,
    content,
    image_processors,
    image_reference,
    pil_config,
)

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
Qwen2VLImageProcessorPil = hf_pil.Qwen2VLImageProcessorPil


def load_image(image, index=None):
    """An input as RGB, converted as the PIL image processor converts it, errors named as preprocess_image's."""
    return load_rgb(image, input_name("image", index, image))


@pytest.fixture(scope="module")
def hf():
    """image_processors(), built once for this module."""
    return image_processors()


def _alpha(height: int, width: int) -> np.ndarray:
    """uint8 HxW alpha: a ramp 0..255 across, fully transparent and fully opaque bands, and noise."""
    ramp = np.tile(np.linspace(0, 255, width), (height, 1))
    ramp += np.random.default_rng(1).normal(0, 20, (height, width))
    alpha = np.clip(ramp, 0, 255).astype(np.uint8)
    alpha[: height // 8] = 0
    alpha[-height // 8:] = 255
    return alpha


def _mode_image(kind: str, height: int = 150, width: int = 230) -> Image.Image:
    """A PIL image of the given mode (or special kind) with real content."""
    rgb = content(height, width, 3)
    gray = rgb[..., 0]
    alpha = _alpha(height, width)
    if kind == "RGB":
        return Image.fromarray(rgb)
    if kind == "RGBA":
        return Image.fromarray(np.dstack([rgb, alpha]))
    if kind == "LA":
        return Image.fromarray(np.dstack([gray, alpha]))
    if kind == "L":
        return Image.fromarray(gray)
    if kind == "1":
        return Image.fromarray(gray > 127)
    if kind.startswith("P"):
        # 64-entry palette indexed by the content (Image.quantize would be slow on noisy images).
        image = Image.fromarray(gray // 4)
        image.putpalette(content(1, 64, 3, seed=3).reshape(-1).tolist())
        if kind == "P_trns_index":
            image.info["transparency"] = 5
        elif kind == "P_trns_bytes":
            image.info["transparency"] = bytes(np.linspace(0, 255, 64).astype(np.uint8))
        elif kind == "PA":
            image = image.convert("PA")
            image.putalpha(Image.fromarray(alpha))
        return image
    if kind == "RGB_trns":
        image = Image.fromarray(rgb)
        image.info["transparency"] = tuple(int(v) for v in rgb[height // 2, width // 2])
        return image
    if kind == "I;16":  # a real 16-bit image spans 0..65535
        return Image.fromarray(gray.astype(np.uint16) * 257)
    if kind == "I;16_low":  # 0..510: half the levels survive PIL's clipping to 255
        return Image.fromarray(gray.astype(np.uint16) * 2)
    if kind == "I":
        return Image.fromarray(gray.astype(np.int32) * 3 - 200)
    if kind == "F":
        return Image.fromarray(gray.astype(np.float32) * 1.3 - 20.5)
    channels = {"CMYK": 4, "RGBa": 4, "LAB": 3, "YCbCr": 3}[kind]  # raw bytes of real content in that mode
    return Image.frombytes(kind, (width, height), content(height, width, channels).tobytes())


def _assert_matches(hf, family, image, ours_input=None, **bounds) -> None:
    """preprocess_image(ours_input or image) equals the reference on image."""
    ref_values, ref_grid = image_reference(hf[family], image, **bounds)
    values, grid = preprocess_image(image if ours_input is None else ours_input,
                                    pil_config(family), **bounds)
    assert grid == ref_grid
    assert values.dtype == torch.float32
    assert tuple(values.shape) == ref_values.shape
    assert values.shape[0] == grid[0] * grid[1] * grid[2]
    diff = float(np.abs(values.numpy() - ref_values).max())
    assert diff <= PIXEL_TOL, f"max abs diff {diff}"


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("size", [(224, 224), (300, 451), (97, 513), (640, 120), (28, 5000), (333, 333),
                                  (10, 13), (1, 1), (3, 40)])  # the last three upscaled to min_pixels
def test_sizes_match_reference(hf, family, size):
    _assert_matches(hf, family, Image.fromarray(content(*size, seed=size[0])))


MODES = ["RGB", "RGBA", "LA", "L", "1", "P", "P_trns_index", "P_trns_bytes", "PA", "RGB_trns",
         "CMYK", "I;16", "I;16_low", "I", "F", "YCbCr", "RGBa", "LAB"]


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("kind", MODES)
def test_pil_modes_match_reference(hf, family, kind):
    _assert_matches(hf, family, _mode_image(kind))


def test_rgba_is_composited_onto_white():
    rgba = np.zeros((40, 60, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red where opaque, invisible where alpha is 0
    rgba[:, 30:, 3] = 255
    rgb = np.asarray(load_image(Image.fromarray(rgba)))
    assert (rgb[:, :30] == 255).all()
    assert (rgb[:, 30:] == [200, 0, 0]).all()


def test_16_bit_is_clipped_not_scaled(hf):
    """transformers (through PIL's I;16 -> RGB) clips at 255: a full-range 16-bit image is almost white."""
    image = _mode_image("I;16")
    rgb = np.asarray(load_image(image))
    assert (rgb == 255).mean() > 0.95
    _assert_matches(hf, "qwen3_vl", image)


# (format, kind) pairs saved to disk; each format keeps its own mode and metadata quirks.
FILES = [
    ("png", "RGB"), ("png", "RGBA"), ("png", "LA"), ("png", "L"), ("png", "P_trns_index"),
    ("png", "P_trns_bytes"), ("png", "I;16"), ("png", "1"), ("jpeg", "RGB"), ("jpeg", "L"),
    ("jpeg", "CMYK"), ("bmp", "RGB"), ("tiff", "RGBA"), ("gif", "P_trns_index"), ("webp", "RGBA"), ("png", "RGB_trns"),
]


def _save(tmp_path: pathlib.Path, fmt: str, kind: str) -> pathlib.Path:
    image = _mode_image(kind)
    path = tmp_path / f"{kind.replace(';', '_')}.{fmt}"
    if fmt == "gif":
        image.save(path, transparency=image.info["transparency"])
    else:
        image.save(path)
    return path


@pytest.mark.filterwarnings("ignore:Palette images with Transparency:UserWarning")  # PIL, on P + tRNS bytes
@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("fmt,kind", FILES)
def test_files_match_reference(hf, tmp_path, family, fmt, kind):
    path = _save(tmp_path, fmt, kind)
    _assert_matches(hf, family, str(path))
    _assert_matches(hf, family, str(path), ours_input=path)  # os.PathLike too


def test_path_rgba_drops_alpha_like_transformers(hf, tmp_path):
    """For a path, transformers' load_image converts RGBA -> RGB without compositing; a PIL input composites."""
    path = _save(tmp_path, "png", "RGBA")
    config = pil_config("qwen2_5_vl")
    from_path, _ = preprocess_image(path, config)
    from_pil, _ = preprocess_image(Image.open(path), config)
    assert not torch.equal(from_path, from_pil)
    _assert_matches(hf, "qwen2_5_vl", str(path))
    _assert_matches(hf, "qwen2_5_vl", Image.open(path))


def test_exif_orientation_applied_for_paths(hf, tmp_path):
    image = Image.fromarray(content(120, 200))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    assert load_image(path).size == (120, 200)  # (width, height): transposed
    _assert_matches(hf, "qwen2_5_vl", str(path))
    _assert_matches(hf, "qwen2_5_vl", Image.open(path))  # PIL input: not transposed, by both


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("kind", ["numpy HWC", "torch CHW"])
def test_arrays_match_reference(hf, family, channels, kind):
    array = content(130, 210, channels, seed=channels + 10 * (kind == "torch CHW"))
    if channels == 4:
        array[..., 3] = _alpha(130, 210)
    _assert_matches(hf, family, array if kind == "numpy HWC" else torch.from_numpy(array).permute(2, 0, 1).contiguous())


def test_other_array_layouts_match_reference(hf):
    array = content(130, 210, 3)
    _assert_matches(hf, "qwen2_5_vl", array.transpose(2, 0, 1).copy())  # numpy CHW: unambiguous
    _assert_matches(hf, "qwen2_5_vl", torch.from_numpy(array))  # torch HWC: unambiguous
    # HxW grayscale is rejected by transformers; it must equal the (H, W, 1) array.
    _assert_matches(hf, "qwen2_5_vl", array[..., :1], ours_input=array[..., 0])


def test_input_types_agree():
    array = content(100, 150)
    config = pil_config("qwen3_vl")
    expected, grid = preprocess_image(Image.fromarray(array), config)
    # the last one is a non-contiguous view (negative strides)
    for image in (array, torch.from_numpy(array).permute(2, 0, 1), array[:, ::-1][:, ::-1]):
        values, other_grid = preprocess_image(image, config)
        assert other_grid == grid and torch.equal(values, expected)
    gray = array[..., 0]  # an ndarray subclass (np.matrix: 2-D only) is the array it holds
    with pytest.warns(PendingDeprecationWarning):
        matrix = np.asmatrix(gray)
    assert torch.equal(preprocess_image(matrix, config)[0], preprocess_image(gray, config)[0])


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_pixel_bound_overrides(hf, family):
    big = Image.fromarray(content(600, 800))
    _assert_matches(hf, family, big, max_pixels=100_000)
    _, (_, grid_h, grid_w) = preprocess_image(big, pil_config(family), max_pixels=100_000)
    patch = pil_config(family).patch_size
    assert grid_h * grid_w * patch**2 <= 100_000
    _assert_matches(hf, family, Image.fromarray(content(64, 90)), min_pixels=200_000)


def test_aspect_ratio_error_names_input():
    with pytest.raises(PreprocessError, match=r"image 7: aspect ratio"):
        preprocess_image(np.zeros((2, 500, 3), np.uint8), pil_config("qwen3_vl"), index=7)


def test_aspect_ratio_checked_before_decoding(tmp_path):
    """A file with a valid header but truncated pixel data: the aspect check fires before decoding."""
    path = tmp_path / "strip.png"
    Image.fromarray(content(4, 1000)).save(path)
    path.write_bytes(path.read_bytes()[:120])
    with pytest.raises(PreprocessError, match="aspect ratio") as err:
        preprocess_image(path, pil_config("qwen2_5_vl"), index=0)
    assert str(path) in str(err.value)
    with pytest.raises(PreprocessError, match="corrupt or truncated"):
        load_image(path)


def test_a_pil_image_opened_from_a_file_cut_short_is_named_so():
    """Opened lazily by the caller, its pixels are read here: the same message as for the file."""
    buffer = io.BytesIO()
    Image.fromarray(content(200, 300)).save(buffer, "JPEG")
    lazy = Image.open(io.BytesIO(buffer.getvalue()[:2000]))
    with pytest.raises(PreprocessError, match=r"^image 0: corrupt or truncated image data"):
        preprocess_image(lazy, pil_config("qwen2_5_vl"), index=0)


def _assert_error(image, pattern, index=4, path=None):
    """The error names the input (a file by its path, anything else by its index), the same from loading and
    from probing."""
    config = pil_config("qwen2_5_vl")
    with pytest.raises(PreprocessError, match=pattern) as err:
        preprocess_image(image, config, index=index)
    assert str(err.value).startswith(f"image {str(path)!r}: " if path is not None else f"image {index}: ")
    with pytest.raises(PreprocessError) as loaded:
        load_image(image, index=index)
    assert str(loaded.value) == str(err.value)
    if "corrupt or truncated" not in pattern:  # a file cut after its header: probing cannot know
        with pytest.raises(PreprocessError) as probed:
            probe_image(image, config, index=index)
        assert str(probed.value) == str(err.value)


def _cut_in_half(path: pathlib.Path) -> None:
    Image.fromarray(content(100, 100)).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("name,make,pattern", [
    ("missing.png", lambda path: None, "file not found"),
    ("corrupt.png", _cut_in_half, "corrupt or truncated"),
    ("empty.jpg", lambda path: path.write_bytes(b""), r"empty \(0 bytes\)"),
    ("notes.jpg", lambda path: path.write_text("this is not an image\n" * 20), "not a recognised image"),
    ("folder.png", lambda path: path.mkdir(), "not a regular file"),
    ("loop.png", lambda path: path.symlink_to(path), "cannot read it .*symbolic links"),  # not "not found"
    # PostScript, which Pillow would hand to Ghostscript to run: never opened, whatever the name says
    ("drawing.png", lambda path: path.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"),
     "not a recognised image"),
])
def test_bad_files(tmp_path, name, make, pattern):
    path = tmp_path / name
    make(path)
    _assert_error(path, pattern, path=path)
    _assert_error(str(path), pattern, path=path)


@pytest.mark.parametrize("image,pattern", [
    (np.zeros((0, 10, 3), np.uint8), "zero-size"),
    (torch.zeros((3, 10, 0), dtype=torch.uint8), "zero-size"),
    (np.zeros((10, 10, 3), np.float32), "uint8"),
    (torch.zeros((3, 10, 10)), "uint8"),
    (torch.zeros((3, 10, 10), dtype=torch.uint8, device="meta"), "cannot read the tensor's pixels"),
    (torch.zeros((3, 10, 10), dtype=torch.uint8).to_sparse(), "cannot read the tensor's pixels"),
    (np.zeros((1, 10, 10, 3), np.uint8), "2-D or 3-D"),
    (np.zeros((10, 10, 2), np.uint8), "1, 3 or 4 channels"),
    (Image.new("RGB", (0, 5)), "zero-size"),
    (12345, "unsupported input type"),
])
def test_bad_arrays_and_types(image, pattern):
    _assert_error(image, pattern)


QWEN2_5_FILE = {  # Qwen2.5-VL-7B-Instruct preprocessor_config.json
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
QWEN3_FILE = {  # Qwen3-VL preprocessor_config.json
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def test_family_defaults():
    qwen2_5 = PreprocessConfig.for_family("qwen2_5_vl")
    assert (qwen2_5.patch_size, qwen2_5.min_pixels, qwen2_5.max_pixels, qwen2_5.factor) == (14, 3136, 12845056, 28)
    assert qwen2_5.image_mean == tuple(CLIP_MEAN) and qwen2_5.image_std == tuple(CLIP_STD)
    qwen3 = PreprocessConfig.for_family("qwen3_vl")
    assert (qwen3.patch_size, qwen3.min_pixels, qwen3.max_pixels, qwen3.factor) == (16, 65536, 16777216, 32)
    assert qwen3.image_mean == qwen3.image_std == (0.5, 0.5, 0.5)
    assert PreprocessConfig.for_family("qwen3_vl_moe") == qwen3
    with pytest.raises(ValueError, match="unknown family"):
        PreprocessConfig.for_family("qwen2_vl_typo")


def test_from_dict_release_files():
    assert PreprocessConfig.from_dict(QWEN2_5_FILE, "qwen2_5_vl") == PreprocessConfig.for_family("qwen2_5_vl")
    assert PreprocessConfig.from_dict(QWEN3_FILE, "qwen3_vl") == PreprocessConfig.for_family("qwen3_vl")
    assert PreprocessConfig.from_dict(None, "qwen3_vl") == PreprocessConfig.for_family("qwen3_vl")
    # The backend follows the file's image_processor_type: Qwen3-VL's names the torchvision processor.
    assert PreprocessConfig.from_dict(QWEN3_FILE, "qwen3_vl").resize == "torch"
    assert PreprocessConfig.from_dict(QWEN2_5_FILE, "qwen2_5_vl").resize == "pil"
    assert PreprocessConfig.from_dict({**QWEN3_FILE, "image_processor_type": "Qwen2VLImageProcessorPil"},
                                      "qwen3_vl").resize == "pil"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("d", [{}, {"max_pixels": 1000000, "patch_size": 16}, {"size": {"shortest_edge": 5000,
                                                                                         "longest_edge": 90000}}])
def test_what_a_file_leaves_out_is_transformers_class_default(family, d):
    """Not the family's release values: a file's missing keys are the processor class's defaults, as transformers
    reads that file."""
    config, reference = PreprocessConfig.from_dict(d, family), Qwen2VLImageProcessorPil(**d)
    assert (config.min_pixels, config.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    assert (config.patch_size, config.image_mean, config.image_std) == (
        reference.patch_size, tuple(reference.image_mean), tuple(reference.image_std))


def test_from_dict_pixel_precedence_matches_reference():
    d = {"size": {"shortest_edge": 1000, "longest_edge": 500000}, "min_pixels": 4000, "patch_size": 14}
    config = PreprocessConfig.from_dict(d, "qwen2_5_vl")
    reference = Qwen2VLImageProcessorPil(**d)
    assert (config.min_pixels, config.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    # A size without a bound is the reference's error when it resizes, not the class default.
    for size in ({"longest_edge": 200704}, {"height": 224, "width": 224}):
        with pytest.raises(ValueError, match="must contain 'shortest_edge' and 'longest_edge'"):
            image_reference(Qwen2VLImageProcessorPil(size=size, patch_size=14), Image.fromarray(content(60, 80)))
        with pytest.raises(ConfigError, match=r"size .* lacks shortest_edge or longest_edge"):
            PreprocessConfig.from_dict({"size": size, "patch_size": 14}, "qwen2_5_vl")


@pytest.mark.parametrize("config", [
    PreprocessConfig.for_family("qwen2_5_vl"),
    PreprocessConfig.for_family("qwen3_vl"),
    PreprocessConfig(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=5000, max_pixels=90000,
                     image_mean=(0.1, 0.2, 0.3), image_std=(0.9, 0.8, 0.7)),
])
def test_to_dict_round_trips_and_loads_in_transformers(config):
    d = config.to_dict()
    assert PreprocessConfig.from_dict(d, "qwen2_5_vl") == config
    assert PreprocessConfig.from_dict(d, "qwen3_vl") == config
    reference = Qwen2VLImageProcessorPil.from_dict(d)
    image = Image.fromarray(content(180, 260))
    ref_values, ref_grid = image_reference(reference, image)
    values, grid = preprocess_image(image, config, resize="pil")
    assert grid == ref_grid
    assert float(np.abs(values.numpy() - ref_values).max()) <= PIXEL_TOL


@pytest.mark.parametrize("override", [
    {"do_resize": False}, {"do_normalize": False}, {"resample": 2}, {"rescale_factor": 1 / 256},
    {"do_center_crop": True},
])
def test_from_dict_rejects_unsupported_settings(override):
    with pytest.raises(ValueError, match="not supported"):
        PreprocessConfig.from_dict({**QWEN2_5_FILE, **override}, "qwen2_5_vl")


@pytest.mark.parametrize("kwargs", [
    {"patch_size": 0}, {"patch_size": 14, "merge_size": -1}, {"patch_size": 14, "image_mean": (0.5, 0.5)},
    {"patch_size": 14, "image_std": (0.5, 0.0, 0.5)}, {"patch_size": 14.0},
    {"patch_size": 14, "min_pixels": 9000, "max_pixels": 4000},
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        PreprocessConfig(**kwargs)


def test_numpy_integers_are_the_ints_they_are():
    """A NumPy integer (a value read from an array) is taken as its int: the config is hashed as JSON."""
    config = PreprocessConfig(patch_size=np.int64(16), min_pixels=np.int32(4096), max_pixels=np.int64(200_000))
    assert [type(v) for v in (config.patch_size, config.min_pixels, config.max_pixels)] == [int] * 3
    json.dumps(dataclasses.asdict(config))


def test_scalar_mean_std():
    config = PreprocessConfig(patch_size=16, image_mean=0.5, image_std=[0.5, 0.5, 0.5])
    assert config.image_mean == config.image_std == (0.5, 0.5, 0.5)


@pytest.mark.slow  # a subprocess
def test_torch_backend_and_video_files_never_import_torchvision(tmp_path):
    """The package must not need torchvision: the torch resize path and video files run without importing it."""
    pytest.importorskip("av")
    from tests.helpers import REPO, write_video

    write_video(tmp_path / "clip.mp4", 6, 40, 32, 5)
    code = (
        "import sys, numpy as np\n"
        "from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image\n"
        "from qwenvl_vision.inputs.video import VideoConfig, preprocess_video_file\n"
        "pre = PreprocessConfig.for_family('qwen3_vl')\n"
        "preprocess_image(np.zeros((50, 70, 3), np.uint8), pre, resize='torch')\n"
        f"preprocess_video_file({str(tmp_path / 'clip.mp4')!r}, pre, VideoConfig.for_family('qwen3_vl'))\n"
        "assert 'torchvision' not in sys.modules, 'torchvision was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_from_dict_reads_the_old_size_spelling_and_null_bounds():
    old = PreprocessConfig.from_dict({"size": {"min_pixels": 5000, "max_pixels": 90000}}, "qwen2_5_vl")
    assert (old.min_pixels, old.max_pixels) == (5000, 90000)
    nulls = PreprocessConfig.from_dict({"min_pixels": None, "max_pixels": None,
                                        "size": {"shortest_edge": 6000, "longest_edge": 80000}}, "qwen3_vl")
    assert (nulls.min_pixels, nulls.max_pixels) == (6000, 80000)


@pytest.mark.parametrize("d", [{"do_convert_rgb": False}, {"do_pad": True}, {"size": [1, 2]}, [1, 2]])
def test_from_dict_refuses_what_it_cannot_honour(d):
    with pytest.raises(ConfigError):
        PreprocessConfig.from_dict(d, "qwen2_5_vl")


def test_a_config_checks_its_temporal_patch_and_takes_an_int_scalar_std():
    with pytest.raises(ConfigError, match="temporal_patch_size"):
        PreprocessConfig(temporal_patch_size=0)
    assert PreprocessConfig(image_mean=0, image_std=1).image_std == (1.0, 1.0, 1.0)
