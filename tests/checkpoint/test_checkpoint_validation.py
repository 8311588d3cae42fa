"""Checkpoints from anywhere: corrupt, truncated, hostile or mislabelled files end in one named error.

Every case corrupts a copy of a real-layout checkpoint written by ``tests.helpers.write_checkpoint`` (vision
tensors over two shards, the second shared with the language model, plus LLM-only shards; or one
``model.safetensors``) and expects a ``CheckpointError`` naming the file (and the tensor, where a rule of this
project's refuses it). The format's own rules are enforced by safetensors when it opens a shard; the rules
beyond them (shard names, floating-point dtypes, shapes, NaN) by ``qwenvl_vision/checkpoint/weights.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import re
import signal
import struct
from pathlib import Path

import pytest
import torch

from qwenvl_vision import CheckpointError, QwenVLVisionError, load_encoder
from qwenvl_vision.checkpoint import weights
from qwenvl_vision.cli import main
from tests.helpers import (
    INDEX_FILE,
    LN_Q,
    QWEN2_5_SMALL,
    QWEN3_SMALL_72,
    edit_header,
    join_shard,
    offsets_of,
    read_index,
    same_size_pair,
    set_entry,
    shard_of,
    split_shard,
    write_checkpoint,
    write_index,
)

# ---------------------------------------------------------------------- loading, deadlines


def _load(folder: Path, **kwargs):
    return load_encoder(folder, device="cpu", **kwargs)


class Hang(BaseException):
    """Raised by _deadline; a BaseException, so no ``except OSError``/``Exception`` in the code under test
    can turn a hang into an ordinary error."""


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (instead of hanging the suite) if the block runs longer than `seconds`."""
    def expired(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, QWEN2_5_SMALL)
    return folder


def _outputs(encoder) -> list[torch.Tensor]:
    cfg = encoder.config
    pixel_values = torch.randn(64, cfg.patch_dim, generator=torch.Generator().manual_seed(3))
    return encoder.encode_patches(pixel_values, [(1, 8, 8)]).embeddings


# ---------------------------------------------------------------------- the format's own rules, kept by safetensors


def _raw(change):
    """LN_Q's shard rewritten: ``change(its bytes, where its header ends)`` gives the new bytes."""
    def corrupt(folder: Path) -> Path:
        shard = shard_of(folder, LN_Q)
        raw = shard.read_bytes()
        shard.write_bytes(change(raw, 8 + struct.unpack("<Q", raw[:8])[0]))
        return shard
    return corrupt


def _header_text(text: str):
    return _raw(lambda raw, end: struct.pack("<Q", len(text.encode())) + text.encode() + raw[end:])


def _entry(**fields):
    return lambda folder: set_entry(folder, LN_Q, **fields)


def _move_ln_q(change):
    def corrupt(folder: Path) -> Path:
        begin, end = offsets_of(folder, LN_Q)
        return set_entry(folder, LN_Q, data_offsets=change(begin, end))
    return corrupt


def _overlap(folder: Path) -> Path:
    shard, a, b = same_size_pair(folder)
    return set_entry(folder, b, data_offsets=offsets_of(folder, a))


def _gap(folder: Path) -> Path:
    _, a, _ = same_size_pair(folder)
    return edit_header(folder, a, lambda header: header.pop(a))


# Each breaks a rule of the safetensors format, which safetensors itself enforces when it opens the shard: the
# load fails with one line naming the shard (a tensor reading the wrong bytes, or the header's bytes, never loads).
FORMAT_BREAKS = {
    "negative-begin": _move_ln_q(lambda begin, end: [-8, end - begin - 8]),
    "shifted-by-4-bytes": _move_ln_q(lambda begin, end: [begin + 4, end + 4]),
    "begin>end": _move_ln_q(lambda begin, end: [end, begin]),
    "float-offsets": _move_ln_q(lambda begin, end: [float(begin), float(end)]),
    "three-offsets": _entry(data_offsets=[0, 320, 640]),
    "string-offsets": _entry(data_offsets=["0", "640"]),
    "no-data_offsets": lambda folder: edit_header(folder, LN_Q, lambda header: header[LN_Q].pop("data_offsets")),
    "overlap": _overlap,
    "bytes-between-tensors": _gap,
    "length!=shape*dtype": _entry(shape=[161]),
    "entry-is-a-string": lambda folder: edit_header(folder, LN_Q, lambda header: header.update({LN_Q: "F32"})),
    "unknown-dtype": _entry(dtype="F33"),
    "lowercase-dtype": _entry(dtype="f32"),
    "negative-dim": _entry(shape=[-160]),
    "bool-dim": _entry(shape=[True]),
    "float-dim": _entry(shape=[160.0]),
    "string-shape": _entry(shape="160"),
    "dim-over-u64": _entry(shape=[2**64, 2**64]),
    "overflowing-numel": _entry(shape=[2**62, 2**62]),
    "overflow-before-zero-dim": _entry(shape=[2**63, 4, 0]),
    "sub-byte-dtype": lambda folder: set_entry(folder, "model.layers.0.mlp.up_proj.weight", dtype="F4", shape=[1023]),
    "end-past-the-data": _raw(lambda raw, end: raw[:-4]),
    "bytes-after-the-last-tensor": _raw(lambda raw, end: raw + bytes(8)),
    "header-length-past-the-file": _raw(lambda raw, end: struct.pack("<Q", len(raw)) + raw[8:]),
    "header-length-over-the-limit": _raw(lambda raw, end: struct.pack("<Q", 2**63) + raw[8:]),
    "header-an-array": _header_text("[]"),
    "header-truncated-json": _header_text('{"a": '),
    "header-nan-literal": _header_text('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}'),
    "metadata-not-strings": _header_text('{"__metadata__": {"format": 1}}'),
    "header-minus-zero": _header_text('{"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}'),
    "header-integer-of-5000-digits": _header_text(
        '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1' + "0" * 5000 + ']}}'),
    "header-not-utf8": _raw(lambda raw, end: raw.replace(b"ln_q", b"\xffn_q", 1)),
}


@pytest.mark.parametrize("break_rule", FORMAT_BREAKS.values(), ids=FORMAT_BREAKS.keys())
def test_a_shard_breaking_the_format_is_one_error_naming_it(ckpt, break_rule):
    shard = break_rule(ckpt)
    with pytest.raises(CheckpointError, match=re.escape(str(shard))) as info:
        _load(ckpt)
    assert "\n" not in str(info.value)


def test_a_single_file_breaking_the_format_is_one_error_naming_it(tmp_path):
    """The single file's header is read to index it: the same rules, the same one line."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=False)
    shard = _move_ln_q(lambda begin, end: [-8, end - begin - 8])(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(str(shard))) as info:
        _load(tmp_path)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- the rules of this project's own


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single-file"])
@pytest.mark.parametrize("stored", ["I32", "U32"])
def test_float_weight_relabelled_as_integer_is_refused(tmp_path, sharded, stored):
    """F32 relabelled I32 or U32 (same byte length) would load the integers as weights."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=sharded)
    set_entry(tmp_path, LN_Q, dtype=stored)
    with pytest.raises(CheckpointError, match=rf"{re.escape(LN_Q)} in .*{shard_of(tmp_path, LN_Q).name} is stored "
                                              rf"as {stored}, not as a floating-point dtype"):
        _load(tmp_path)


@pytest.mark.parametrize("name", ["../ckpt/{shard}", "/etc/passwd", "C:\\weights\\model.safetensors", "..",
                                  "sub/model-00001-of-00004.safetensors", "", 2],
                         ids=["dotdot-to-an-existing-file", "absolute", "windows-absolute", "dotdot", "subfolder",
                              "empty", "not-a-string"])
def test_shard_names_must_be_plain_file_names(ckpt, name):
    """A shard name that is not a plain file name in the folder is never opened, even where the file it names
    exists ('../ckpt/<shard>' is this very shard): '../other/x' would load another folder's weights without a word.
    Load and inspect both refuse it, quoting the name."""
    index = read_index(ckpt)
    name = name.format(shard=index["weight_map"][LN_Q]) if isinstance(name, str) else name
    index["weight_map"][LN_Q] = name
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=re.escape(f"shard name {name!r} (for tensor '{LN_Q}')")):
        _load(ckpt)
    assert main(["inspect", str(ckpt)]) == 2


def test_a_name_too_long_for_the_file_system_is_named(ckpt):
    """A plain shard name of 256 characters, or a folder path past the limit: the OSError stat raises is the
    one-line CheckpointError naming it."""
    index = read_index(ckpt)
    index["weight_map"][LN_Q] = "a" * 256 + ".safetensors"
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=r"shard .*aaaa\.safetensors is unreadable \(File name too long\)"):
        _load(ckpt)
    with pytest.raises(CheckpointError, match=r"checkpoint folder '.*aaaa' cannot be read \(File name too long\)"):
        _load(ckpt / ("a" * 300))
    index["weight_map"][LN_Q] = "model.safetensors\0x"  # JSON's \u0000: no file system's name holds one
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=r"shard .*model\.safetensors.*is unreadable \(embedded null byte\)"):
        _load(ckpt)


def test_tensor_under_both_vision_prefixes_is_refused(ckpt):
    """'visual.x' and 'model.visual.x' both name module x: which one is meant cannot be told."""
    index = read_index(ckpt)
    index["weight_map"]["model." + LN_Q] = index["weight_map"][LN_Q]
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=r"holds merger\.ln_q\.weight twice, as visual\.merger\.ln_q\.weight "
                                              r"and model\.visual\.merger\.ln_q\.weight"):
        _load(ckpt)


@pytest.mark.parametrize("index", [[], {"weight_map": ["x"]}, {"metadata": {}}])
def test_index_that_is_not_an_object_is_named(ckpt, index):
    """An index.json holding a list, or without a weight_map object, is a CheckpointError naming it, not a bare
    AttributeError."""
    write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=re.escape(INDEX_FILE)):
        _load(ckpt)


@pytest.mark.parametrize("which", ["vision-shard", "index", "config", "single-file", "device"])
def test_a_fifo_or_device_is_refused_at_once_by_load_and_inspect(tmp_path, capsys, which):
    """A FIFO in place of a shard, the index, the config or the single file, or a shard that is a link to a
    character device, would hang a read forever: load and inspect refuse it by name at once, unread."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=which != "single-file")
    path = {"index": tmp_path / INDEX_FILE, "config": tmp_path / "config.json",
            "single-file": tmp_path / "model.safetensors"}.get(which) or shard_of(tmp_path, LN_Q)
    path.unlink()
    if which == "device":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    with _deadline(20):
        with pytest.raises(CheckpointError, match=rf"{re.escape(path.name)}.* is not a regular file"):
            _load(tmp_path)
        capsys.readouterr()
        assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert path.name in err and "is not a regular file" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("value", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_non_finite_weight_is_named_and_can_be_loaded_on_request(tmp_path, dtype, value):
    """A NaN/Inf weight would load, and embed would record 'ok' with all-NaN embeddings: refused."""
    write_checkpoint(tmp_path, QWEN3_SMALL_72, dtype=dtype)
    name = "model.visual.blocks.1.mlp.linear_fc1.weight"
    shard = shard_of(tmp_path, name)
    header, data = split_shard(shard)
    begin = header[name]["data_offsets"][0]
    element = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    position = begin + 37 * len(element)
    join_shard(shard, header, data[:position] + element + data[position + len(element):])
    kind = r"1 NaN and 0 infinite" if math.isnan(value) else r"0 NaN and 1 infinite"
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in .*{shard.name} holds {kind} value"):
        _load(tmp_path, dtype=torch.float32)
    encoder = _load(tmp_path, dtype=torch.float32, check_finite=False)
    weight = encoder.model.state_dict()["blocks.1.mlp.linear_fc1.weight"]
    assert weight.flatten()[37].item() == value or math.isnan(value) and math.isnan(weight.flatten()[37].item())


def test_a_weight_that_overflows_the_dtype_it_is_cast_to_is_refused(tmp_path):
    """A finite float32 weight beyond bfloat16's range is infinite once loaded in bf16: refused as such."""
    write_checkpoint(tmp_path, QWEN3_SMALL_72, dtype=torch.float32)
    name = "model.visual.blocks.1.mlp.linear_fc1.weight"
    shard = shard_of(tmp_path, name)
    header, data = split_shard(shard)
    position = header[name]["data_offsets"][0] + 37 * 4
    element = torch.tensor([3.4e38], dtype=torch.float32).numpy().tobytes()
    join_shard(shard, header, data[:position] + element + data[position + 4:])
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in .* holds 0 NaN and 1 infinite value\(s\) as "
                                              r"bfloat16 \(load it in float32, as stored\)"):
        _load(tmp_path, dtype=torch.bfloat16)
    assert _load(tmp_path, dtype=torch.float32).model.state_dict()["blocks.1.mlp.linear_fc1.weight"].isfinite().all()


def test_non_finite_weight_in_the_last_tensor_read_is_refused(ckpt):
    """The last vision tensor of the last shard (nothing read after it) is checked too."""
    shards = sorted({shard_of(ckpt, n) for n in read_index(ckpt)["weight_map"] if n.startswith("visual.")})
    header, data = split_shard(shards[-1])
    name = max((n for n in header if n.startswith("visual.")), key=lambda n: header[n]["data_offsets"])
    end = header[name]["data_offsets"][1]
    join_shard(shards[-1], header, data[:end - 4] + struct.pack("<f", math.nan) + data[end:])
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in .*{shards[-1].name} holds 1 NaN"):
        _load(ckpt)


@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.float16, 60000.0)], ids=["f32", "f16"])
def test_finite_weights_whose_sum_overflows_still_load(tmp_path, dtype, big):
    """Finite values whose sum overflows (as fp16 sums easily do) are finite: a sum-based check would refuse them."""
    write_checkpoint(tmp_path, QWEN2_5_SMALL, dtype=dtype)
    shard = shard_of(tmp_path, LN_Q)
    header, data = split_shard(shard)
    begin = header[LN_Q]["data_offsets"][0]
    values = torch.tensor([big, big], dtype=dtype).view(torch.uint8).numpy().tobytes()
    join_shard(shard, header, data[:begin] + values + data[begin + len(values):])
    weight = _load(tmp_path, dtype=torch.float32).model.merger.norm.weight
    assert weight[:2].tolist() == [torch.tensor(big, dtype=dtype).item()] * 2


def test_language_model_tensor_in_a_dtype_torch_lacks_still_loads(ckpt):
    """Not stricter than safetensors where it does not matter: an LLM tensor stored as FP8 is never read."""
    clean = _outputs(_load(ckpt))
    set_entry(ckpt, "model.layers.0.mlp.up_proj.weight", dtype="F8_E4M3", shape=[512])
    assert all(torch.equal(a, b) for a, b in zip(clean, _outputs(_load(ckpt))))


# ---------------------------------------------------------------------- disk errors


@pytest.mark.parametrize("layout", ["single-file", "sharded", "config"])
def test_a_disk_error_reading_a_file_is_a_checkpoint_error_naming_it(tmp_path, monkeypatch, layout):
    """An error from the disk (here an EIO) reading the config or a shard is a CheckpointError naming the file:
    the single file when open_checkpoint reads its header to index it, a shard when its tensors are read."""
    def failing_read(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    write_checkpoint(tmp_path, QWEN2_5_SMALL, sharded=layout != "single-file")
    if layout == "config":
        expected = r"cannot read config .*config\.json: .*Input/output error"
        monkeypatch.setattr(Path, "read_bytes", failing_read)
    else:
        expected = r"cannot read shard .*\.safetensors.*: .*Input/output error"
        monkeypatch.setattr(weights, "safe_open", failing_read)
    with pytest.raises(CheckpointError, match=expected):
        _load(tmp_path)


# ---------------------------------------------------------------------- fuzz


FUZZ_CONFIG = QWEN2_5_SMALL.replace(depth=2, hidden_size=32, intermediate_size=16, num_heads=2, out_hidden_size=16,
                                    fullatt_block_indexes=(1,))
FUZZ_CASES = 200
ODD_VALUES = [None, "x", 1.5, -1, True, [], {}, 2**64]


def _mutate_index(rng: random.Random, index: dict, shards: list[str]) -> str:
    name = rng.choice(sorted(index["weight_map"]))
    op = rng.randrange(4)
    if op == 0:
        index["weight_map"][name] = rng.choice(shards + ["../" + shards[0], "/" + shards[0], "sub/" + shards[0],
                                                         "missing.safetensors", ""])
    elif op == 1:
        index["weight_map"][name] = rng.choice(ODD_VALUES)
    elif op == 2:
        del index["weight_map"][name]
    else:
        index["weight_map"] = rng.choice(ODD_VALUES)
        return f"weight_map = {index['weight_map']!r}"
    return f"{name}: {index['weight_map'].get(name, '(removed)')!r}"


def _flip_byte(rng: random.Random, raw: bytes, end: int) -> tuple[bytes, str]:
    position = rng.randrange(end)
    value = rng.choice([b for b in range(256) if b != raw[position]])
    return raw[:position] + bytes([value]) + raw[position + 1:], f"[{position}] {raw[position]:#x} -> {value:#x}"


def _corrupt(rng: random.Random, folder: Path, shards: list[str]) -> tuple[str, Path, bytes]:
    """Apply one random corruption to the index or a shard; return (what was done, the file, its original bytes)."""
    kind = rng.choice(["header-byte", "header-byte", "header-length", "index-byte", "index-field", "non-finite"])
    vision_shards = sorted({shard_of(folder, n) for n in read_index(folder)["weight_map"] if n.startswith("visual.")})
    if kind.startswith("index"):
        path = folder / INDEX_FILE
    else:
        path = rng.choice(vision_shards if kind == "non-finite" else vision_shards + [folder / s for s in shards])
    original = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    if kind == "index-field":
        index = json.loads(original)
        done = _mutate_index(rng, index, shards)
        corrupted = json.dumps(index).encode()
    elif kind.endswith("byte"):  # anywhere in the index, or in a shard's length prefix and JSON
        corrupted, done = _flip_byte(rng, original, len(original) if kind == "index-byte" else header_end)
    elif kind == "header-length":  # the header's padding makes +-1 still parse: the data would shift
        change = rng.choice([-8, -2, -1, 1, 2, 8])
        corrupted, done = struct.pack("<Q", header_end - 8 + change) + original[8:], f"{change:+d}"
    else:
        header = split_shard(path)[0]
        name = rng.choice([n for n in header if n.startswith("visual.")])
        begin, end = header[name]["data_offsets"]
        element, value = rng.randrange((end - begin) // 4), rng.choice([math.nan, math.inf, -math.inf])
        position = header_end + begin + 4 * element
        corrupted = original[:position] + struct.pack("<f", value) + original[position + 4:]
        done = f"{name} element {element} = {value}"
    path.write_bytes(corrupted)
    return f"{kind} {path.name} {done}", path, original


def test_fuzz_single_corruptions_end_in_a_named_error_or_the_same_numbers(tmp_path):
    """200 seeded single-byte corruptions of the weight files' metadata (safetensors headers, the index), changes
    of a header's length or of one index field, and NaN/Inf writes into tensor data: each load ends in a project
    error, or in outputs equal to the clean checkpoint's; never another exception, a hang or different numbers.
    (Each rule a changed header field breaks is a FORMAT_BREAKS case above.)

    Other bytes of the tensor data are not flipped: the format carries no checksum, so a changed finite weight
    is undetectable by design. config.json is left alone: a changed value there (an eps) legitimately changes
    the numbers; its checks belong to config.py.
    """
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, FUZZ_CONFIG, other_shards=1)
    clean = _outputs(_load(folder))
    shards = sorted(set(read_index(folder)["weight_map"].values()))
    rng = random.Random(12)
    outcomes, failures = {"error": 0, "same": 0}, []
    for case in range(FUZZ_CASES):
        what, path, original = _corrupt(rng, folder, shards)
        try:
            with _deadline(20):
                outputs = _outputs(_load(folder))
        except QwenVLVisionError:
            outcomes["error"] += 1
        except (Exception, Hang) as e:  # anything else is what this test looks for
            failures.append(f"case {case} ({what}): {type(e).__name__}: {e}")
        else:
            if what.startswith("non-finite") or not all(torch.equal(a, b) for a, b in zip(clean, outputs)):
                failures.append(f"case {case} ({what}): loaded with different numbers")
            outcomes["same"] += 1
        finally:
            path.write_bytes(original)
    assert not failures, "\n".join(failures)
    assert outcomes["error"] > 50 and outcomes["same"] > 5, outcomes  # both ways out were exercised
