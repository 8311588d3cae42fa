"""Decoding limits and what a name means (qwenvl_vision.inputs.video_io, batching, pixels, embed.inputs): a file name
is a path, never an FFmpeg protocol; each input's decode has a time limit and Ctrl-C is not held by a stuck decode;
unreadable folders are failed inputs; the decode budget covers what the decoder really holds; the pixel limit is
ours wherever we decode, not PIL's process-global one."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from PIL import Image

import qwenvl_vision.batching as batching
from qwenvl_vision.batching import DecodeBudget, Decoding, prepare, prepared_batches
from qwenvl_vision.cli import main
from qwenvl_vision.embed import read_embeddings
from qwenvl_vision.errors import ConfigError, PreprocessError
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image, probe_image
from qwenvl_vision.inputs.pixels import load_rgb
from qwenvl_vision.inputs.video import VideoConfig
from qwenvl_vision.inputs.video_io import probe_video, read_video_frames
from qwenvl_vision.options import DEFAULT_DECODE_TIMEOUT, EncodeOptions
from tests.helpers import ENV, make_image_folder, synthetic_photo, write_video
from tests.helpers.embed import one_error_line, records

# ---------------------------------------------------------------------- a name is a path


@pytest.mark.parametrize("odd", ["file:x.mp4", "concat:x.mp4|y.mp4"])
def test_a_video_named_like_an_ffmpeg_protocol_decodes_that_file(tmp_path, checkpoint, monkeypatch, odd):
    """FFmpeg reads ``file:x.mp4`` as the file protocol on ``x.mp4`` and ``concat:x.mp4|y.mp4`` as the two
    joined: the file of that name must be decoded, as ``embed .`` finds it in its folder."""
    pytest.importorskip("av")
    folder = tmp_path / "clips"
    folder.mkdir()
    write_video(folder / "x.mp4", 12, 64, 48, 10)
    write_video(folder / "y.mp4", 7, 48, 32, 10)
    write_video(folder / "plain.mp4", 5, 32, 24, 10)  # the odd name's content, under a name FFmpeg cannot misread
    shutil.copyfile(folder / "plain.mp4", folder / odd)
    monkeypatch.chdir(folder)
    assert probe_video(odd) == probe_video("plain.mp4") == (5, 10.0, 24, 32)

    out = tmp_path / "out"
    assert main(["embed", ".", "--model", str(checkpoint), "--out", str(out), "--quiet"]) == 0
    by_path = {r["path"]: r for r in records(out)}
    assert by_path[odd]["status"] == "ok"
    assert by_path[odd]["grid_thw"] == by_path["plain.mp4"]["grid_thw"] != by_path["x.mp4"]["grid_thw"]
    tensors = dict(read_embeddings(out))
    assert torch.equal(tensors[odd], tensors["plain.mp4"])


# ---------------------------------------------------------------------- unreadable folders


def _folder_with_a_subfolder(tmp_path) -> Path:
    """imgs/ with two images, and imgs/locked/ with a third: the folder the tests make unreadable."""
    make_image_folder(tmp_path / "imgs", 2, bad=False)
    (tmp_path / "imgs" / "locked").mkdir()
    Image.fromarray(synthetic_photo(40, 50, 9)).save(tmp_path / "imgs" / "locked" / "hidden.png")
    return tmp_path / "imgs" / "locked"


def _embed_imgs(tmp_path, checkpoint, capsys) -> tuple[int, dict[str, dict]]:
    """``embed imgs``: (exit code, the records by path), its stderr the one summary line of 2 ok out of 3."""
    out = tmp_path / "out"
    code = main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(out), "--quiet"])
    one_error_line(capsys.readouterr().err, "embedded 2 of 3 inputs", "1 failed")
    return code, {r["path"]: r for r in records(out)}


def test_an_unreadable_subfolder_is_a_failed_input_naming_it(tmp_path, checkpoint, capsys, monkeypatch):
    """The folder walk meets a folder it cannot list (injected at ``os.scandir``, so that it runs as root too):
    the folder is a failed input naming it, the rest embeds, exit 1; never "embedded 2 of 2"."""
    locked = str(_folder_with_a_subfolder(tmp_path))
    scandir = os.scandir

    def refusing(path=".", *args):
        if os.fspath(path) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return scandir(path, *args)

    monkeypatch.setattr(os, "scandir", refusing)
    code, by_path = _embed_imgs(tmp_path, checkpoint, capsys)
    assert code == 1
    assert by_path[locked]["status"] == "error"
    assert f"cannot list folder {locked}: Permission denied" in by_path[locked]["error"]
    assert sum(r["status"] == "ok" for r in by_path.values()) == 2


def test_a_folder_without_read_permission_is_a_failed_input(tmp_path, checkpoint, capsys):
    """The same with real permissions (mode 000)."""
    if os.geteuid() == 0:
        pytest.skip("root reads a folder of mode 000; the walk's refusal is tested through os.scandir above")
    locked = _folder_with_a_subfolder(tmp_path)
    locked.chmod(0)
    try:
        code, by_path = _embed_imgs(tmp_path, checkpoint, capsys)
    finally:
        locked.chmod(0o755)
    assert code == 1
    assert by_path[str(locked)]["status"] == "error" and "Permission denied" in by_path[str(locked)]["error"]


# ---------------------------------------------------------------------- the decode time limit

QWEN25 = "qwen2_5_vl"
PRE = PreprocessConfig.from_dict(None, QWEN25)


def _options(**changes) -> EncodeOptions:
    return EncodeOptions(video_config=VideoConfig.for_family(QWEN25), **changes)


class _StuckDecoder:
    """``preprocess_image`` for the tests: an input named ``stuck.png`` is admitted by the decode budget (as a real
    decode is, once its header is read; ``in_header``: never, its header read hangs) and then blocks until
    ``release`` is set (at most ``hold`` s: a decode that never ends must not outlive its test); every other input
    is decoded for real."""

    def __init__(self, hold: float = 30.0, in_header: bool = False) -> None:
        self.release, self.started, self.hold, self.in_header = threading.Event(), threading.Event(), hold, in_header
        self.real = batching.preprocess_image

    def __call__(self, item, *args, **kwargs):
        if str(item).endswith("stuck.png"):
            if not self.in_header:
                kwargs["on_header"](PIL.Image.new("RGB", (56, 56)))
            self.started.set()
            self.release.wait(self.hold)
            item = synthetic_photo(56, 56, 7)
        return self.real(item, *args, **kwargs)


@pytest.mark.parametrize("in_header", [False, True], ids=["decode", "header-read"])
def test_an_input_over_the_decode_time_limit_is_failed_and_the_others_go_on(monkeypatch, in_header):
    """Timed from its admission, or from the start of a header read that hangs (a stuck mount: it never asks the
    budget for its turn, which passes once it is given up)."""
    stuck = _StuckDecoder(in_header=in_header)
    monkeypatch.setattr(batching, "preprocess_image", stuck)
    inputs = [synthetic_photo(56, 84, 0), "stuck.png", synthetic_photo(112, 56, 1), synthetic_photo(84, 84, 2)]
    start = time.monotonic()
    try:
        batches = list(prepared_batches(inputs, _options(decode_timeout=2.0, num_workers=2), PRE))
    finally:
        stuck.release.set()
    assert time.monotonic() - start < 20  # the stuck decode waits 30 s; the limit ends it after 2
    ok = sorted(p.index for batch, _ in batches for p in batch)
    (failed,) = [p for _, fails in batches for p in fails]
    assert ok == [0, 2, 3] and failed.index == 1
    assert failed.error.startswith("image 'stuck.png': not decoded within 2 s") and "--decode-timeout" in failed.error
    assert "\n" not in failed.error


def test_a_given_up_input_neither_budget_nor_worker_stalls_the_inputs_behind_it(tmp_path, monkeypatch):
    """A decode that never returns: its bytes leave the budget when it is given up and so does its worker, so
    inputs that did not fit beside it, and would wait for a free worker, are decoded at once."""
    stuck = _StuckDecoder()
    monkeypatch.setattr(batching, "preprocess_image", stuck)
    monkeypatch.setattr(batching, "decode_cost", lambda *args: 3000)  # two never fit the budget at once
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(("a.png", "b.png")):
        Image.fromarray(synthetic_photo(56, 84, i)).save(name)
    options = _options(decode_timeout=2.0, num_workers=1, decode_bytes=4000)
    start = time.monotonic()
    try:
        batches = list(prepared_batches(["stuck.png", "a.png", "b.png"], options, PRE))
        assert not stuck.release.is_set()  # the stuck decode never returned while the others went on
    finally:
        stuck.release.set()
    assert time.monotonic() - start < 20
    assert sorted(p.index for batch, _ in batches for p in batch) == [1, 2]
    assert [p.index for _, fails in batches for p in fails] == [0]


def test_a_given_up_decode_keeps_no_budget_nor_worker_and_its_late_result_changes_none(monkeypatch):
    stuck = _StuckDecoder()
    monkeypatch.setattr(batching, "preprocess_image", stuck)
    monkeypatch.setattr(batching, "decode_cost", lambda *args: 1000)
    budget, decoding, result = DecodeBudget(4000, workers=1), Decoding(), []
    worker = threading.Thread(target=lambda: result.append(prepare("stuck.png", 0, _options(), PRE, budget,
                                                                   decoding)))
    worker.start()
    try:
        assert stuck.started.wait(5)
        assert budget.used == 1000
        assert budget.end(decoding) and budget.used == 0  # given up by the iterating side
        budget.admit(1, Decoding(), 0)  # the one worker is free again while the stuck decode runs on
    finally:
        stuck.release.set()
        worker.join(5)
    assert not worker.is_alive()  # its thread ends with its decode: a time-out leaves no decoder behind for good
    assert result == [None] and budget.used == 0  # the decoded pixels nobody takes are not counted either


def test_closing_the_batches_does_not_wait_for_a_stuck_decode(monkeypatch):
    stuck = _StuckDecoder(hold=10.0)
    monkeypatch.setattr(batching, "preprocess_image", stuck)
    inputs = [synthetic_photo(56, 56, 0), synthetic_photo(56, 56, 1), "stuck.png"]
    batches = prepared_batches(inputs, _options(max_batch_patches=1, num_workers=2), PRE)
    try:
        batch, _ = next(batches)
        assert [p.index for p in batch] == [0]
        assert stuck.started.wait(5)
        start = time.monotonic()
        batches.close()
        assert time.monotonic() - start < 2
    finally:
        stuck.release.set()


_CTRL_C_CHILD = """
import sys, threading
import numpy as np
import qwenvl_vision.batching as batching
from qwenvl_vision.inputs.images import PreprocessConfig
from qwenvl_vision.inputs.video import VideoConfig
from qwenvl_vision.options import EncodeOptions

def stuck(*args, **kwargs):
    print("decoding", flush=True)
    threading.Event().wait()  # never returns, as a decode stuck in C code

batching.preprocess_image = stuck
options = EncodeOptions(video_config=VideoConfig.for_family("qwen2_5_vl"))
try:
    for _ in batching.prepared_batches([np.zeros((56, 56, 3), np.uint8)], options,
                                       PreprocessConfig.from_dict(None, "qwen2_5_vl")):
        pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_ctrl_c_stops_within_seconds_while_a_decode_is_stuck():
    """SIGINT while the only input's decode never returns: the iteration stops and the process exits at once
    (neither the pool nor the interpreter's exit joins the stuck thread)."""
    child = subprocess.Popen([sys.executable, "-c", _CTRL_C_CHILD], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "decoding\n"
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, err = child.communicate(timeout=15)
        assert time.monotonic() - start < 5
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 130 and "interrupted" in out, err[-2000:]


def test_a_video_read_stops_at_its_next_frame_once_told(tmp_path):
    pytest.importorskip("av")
    write_video(tmp_path / "clip.mp4", 12, 64, 48, 10)
    stop = threading.Event()
    stop.set()
    with pytest.raises(PreprocessError, match=r"^video '.*clip\.mp4': decoding stopped after 0 frames"):
        read_video_frames(tmp_path / "clip.mp4", lambda total, fps: list(range(total)), stop=stop)


def test_decode_timeout_is_checked():
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ConfigError, match="decode_timeout must be a positive number"):
            _options(decode_timeout=bad)
    assert _options(decode_timeout=None).decode_timeout is None
    assert _options().decode_timeout == DEFAULT_DECODE_TIMEOUT


# ---------------------------------------------------------------------- what decoding holds


_PEAK_CHILD = """
import sys
import PIL.Image
from qwenvl_vision.batching import decode_cost
from qwenvl_vision.inputs.images import PreprocessConfig, preprocess_image

PIL.Image.core.set_block_size(64 << 20)  # as embed runs it
path, backend = sys.argv[1], sys.argv[2]
pre = PreprocessConfig.from_dict(None, "qwen2_5_vl")

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

preprocess_image(path, pre, max_pixels=128 * 128, resize=backend)  # everything imported and warm
open("/proc/self/clear_refs", "w").write("5")  # resets the RSS high-water mark
base = status("VmRSS")
preprocess_image(path, pre, max_pixels=256 * 256, resize=backend)
with PIL.Image.open(path) as header:
    print(status("VmHWM") - base, decode_cost(header, backend))
"""


@pytest.mark.parametrize("backend", ["pil", "torch"])
def test_a_palette_image_with_transparency_decodes_within_its_charged_cost(tmp_path, backend):
    """The decode budget charges what decoding a file really holds at its peak (RSS high-water mark, which sees
    Pillow's C allocations): a 9 MP palette PNG with a transparent index once took ~21 bytes a pixel."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's resettable RSS high-water mark (/proc/self/clear_refs)")
    height, width = 3000, 3000
    indices = (np.add.outer(np.arange(height) // 50, np.arange(width) // 50) % 64).astype(np.uint8)
    image = Image.fromarray(indices, "P")
    image.putpalette(synthetic_photo(8, 8, 3).tobytes())
    path = tmp_path / "palette.png"
    image.save(path, transparency=5, compress_level=1)
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(path), backend], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak, charged = map(int, out.stdout.split())
    pixels = height * width
    assert 0 < peak <= charged, f"held {peak / pixels:.1f} bytes a pixel, charged {charged / pixels}"


def test_a_palette_image_with_transparency_gives_the_reference_pixels(tmp_path):
    """Compositing the transparent index in the palette gives transformers' pixels (load_image, then
    convert_to_rgb: RGB, RGBA, onto white), also where other indices share the transparent colour."""
    image_utils = pytest.importorskip("transformers.image_utils")
    transforms = pytest.importorskip("transformers.image_transforms")
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, (200, 3), dtype=np.uint8)
    palette[[7, 50, 199]] = palette[3]
    image = Image.fromarray(rng.integers(0, 200, (61, 77), dtype=np.uint8), "P")
    image.putpalette(palette.tobytes())
    path = tmp_path / "palette.png"
    image.save(path, transparency=3)
    expected = np.asarray(transforms.convert_to_rgb(image_utils.load_image(str(path))))
    assert np.array_equal(np.asarray(load_rgb(str(path), "image")), expected)


# ---------------------------------------------------------------------- the pixel limit is ours


def _png_header_image(path: Path, width: int, height: int) -> None:
    """A 1-bit PNG of width x height black pixels: a few hundred KB on disk whatever its size."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_max_input_pixels_above_pils_limit_replaces_pils_limit(tmp_path, monkeypatch):
    """A 200 MP file within max_input_pixels passes the header checks with PIL's limit at its default (as in a
    fresh process, a Ray actor's): our limit, not the process-wide PIL one, decides; and the budget counts it."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1024 * 1024 * 1024 // 4 // 3)  # Pillow's default
    path = tmp_path / "huge.png"
    _png_header_image(path, 20_000, 10_000)
    probe_image(str(path), PRE, max_input_pixels=250_000_000, max_pixels=256 * 256)

    def charged(header):  # what the budget charges, from the header the decode opens; then stop before decoding
        raise StopIteration(batching.decode_cost(header, "pil"))

    with pytest.raises(StopIteration) as cost:
        preprocess_image(str(path), PRE, max_input_pixels=250_000_000, on_header=charged)
    assert cost.value.args == (200_000_000 * batching.DECODE_BYTES_PER_PIXEL["pil"],)
    with pytest.raises(PreprocessError, match="above the input limit of 100,000,000"):
        probe_image(str(path), PRE, max_input_pixels=100_000_000)
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1024 * 1024 * 1024 // 4 // 3)  # PIL's check comes first
    with pytest.raises(PreprocessError, match=r"huge\.png': .*above the input limit of 64,000,000"):
        probe_image(str(path), PRE, max_input_pixels=64_000_000)


def test_embed_names_its_own_pixel_limit_without_pils_warning(tmp_path, checkpoint, capsys, monkeypatch):
    """A 100 MP file, between PIL's warning and its error: one failed input naming --max-input-pixels, and no
    DecompressionBombWarning line beside the command's own."""
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1024 * 1024 * 1024 // 4 // 3)  # Pillow's default
    make_image_folder(tmp_path / "imgs", 1, bad=False)
    _png_header_image(tmp_path / "imgs" / "big.png", 10_000, 10_000)
    with warnings.catch_warnings(record=True) as shown:  # what would reach stderr outside pytest
        warnings.simplefilter("always")
        assert main(["embed", str(tmp_path / "imgs"), "--model", str(checkpoint), "--out", str(tmp_path / "out"),
                     "--quiet"]) == 1
    assert not [w for w in shown if w.category is PIL.Image.DecompressionBombWarning]
    one_error_line(capsys.readouterr().err, "1 of 2")
    [failed] = [r for r in records(tmp_path / "out") if r["status"] != "ok"]
    assert "above the input limit of 64,000,000" in failed["error"]


def test_embed_records_an_input_over_decode_timeout_as_failed_and_goes_on(tmp_path, checkpoint, capsys, monkeypatch):
    """The limit through the CLI: ``--decode-timeout`` reaches the decode workers, the slow file is a failed input
    naming the limit (exit 1), and every other input is stored."""
    folder = tmp_path / "imgs"
    make_image_folder(folder, 3, bad=False)
    Image.fromarray(synthetic_photo(56, 56, 9)).save(folder / "stuck.png")
    stuck = _StuckDecoder()
    monkeypatch.setattr(batching, "preprocess_image", stuck)
    out = tmp_path / "out"
    try:
        code = main(["embed", str(folder), "--model", str(checkpoint), "--out", str(out), "--device", "cpu",
                     "--decode-timeout", "3", "--quiet"])
    finally:
        stuck.release.set()
    assert code == 1
    by_name = {Path(r["path"]).name: r for r in records(out)}
    assert by_name.pop("stuck.png")["error"].endswith("not decoded within 3 s (the decode time limit: embed "
                                                      "--decode-timeout, decode_timeout); left out, a larger limit "
                                                      "lets it finish")
    assert len(by_name) == 3 and all(r["status"] == "ok" for r in by_name.values())
    assert len(dict(read_embeddings(out))) == 3
