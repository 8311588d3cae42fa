"""The fused elementwise steps of ``native.c``, compiled for this CPU by the C compiler at hand, called by ctypes.

Why C: torch's CPU ops make several passes for add + norm, rope and the gate (its fused ``rms_norm`` is neither the
reference's bits nor faster); inductor's regions fuse them at a third to half these kernels' speed after seconds of
compiling per process. These need a C compiler (``$CC``, else ``cc``; GCC's OpenMP and ``simd`` declarations) and
glibc's libmvec; the library, named by the CPU, the source and the compiler and written whole (a temporary
renamed), is shared by the processes on one CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from ...model.layers import RMSNorm

SOURCE = Path(__file__).with_name("native.c")
# No FMA contraction or fast math (the reference rounds each product), errno-free math (vectorized sqrt and expf),
# and on x86 AVX-512's full width where the CPU has it (GCC stops at 256 bits by default).
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared",
         "-fPIC")
NAMES = {torch.bfloat16: "bf16", torch.float32: "f32"}


class NativeKernels:
    """The library's steps on torch tensors whose rows are contiguous (any row stride), in bf16 or fp32, on
    ``torch.get_num_threads()`` threads."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, long, = ctypes.c_void_p, ctypes.c_long
        signatures = {"add_norm": [pointer] * 5 + [long] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int],
                      "rope": [pointer] * 4 + [long] * 6 + [ctypes.c_int],
                      "activation": [pointer] * 2 + [long] * 4 + [ctypes.c_int] * 2}
        self.functions = {(name, dtype): getattr(library, f"{name}_{suffix}") for name in signatures
                          for dtype, suffix in NAMES.items()}
        for (name, _), function in self.functions.items():
            function.argtypes, function.restype = signatures[name], None

    def add_norm_(self, x: torch.Tensor, update: torch.Tensor | None, norm: nn.Module | None = None,
                  out: torch.Tensor | None = None) -> None:
        """``x += update`` in place (if given), then ``out = norm(x)`` (an RMSNorm or a LayerNorm, if given)."""
        weight, bias = (None, None) if norm is None else (norm.weight, getattr(norm, "bias", None))
        self.functions["add_norm", x.dtype](
            x.data_ptr(), *(None if t is None else t.data_ptr() for t in (update, weight, bias, out)), *x.shape,
            x.stride(0), *(0 if t is None else t.stride(0) for t in (update, out)), getattr(norm, "eps", 0.0),
            isinstance(norm, RMSNorm), torch.get_num_threads())

    def rope(self, x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
             head_dim: int) -> None:
        """The first ``heads`` heads of x's rows rotated into out's (out may be x), the rest of each row copied."""
        self.functions["rope", x.dtype](
            x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads, head_dim,
            x.shape[1] - heads * head_dim, x.stride(0), out.stride(0), torch.get_num_threads())

    def activation(self, x: torch.Tensor, out: torch.Tensor, gated: bool) -> None:
        """``gated``: ``out = silu(gate) * up`` of rows ``[gate | up]``; else ``out = gelu(x, approximate="tanh")``
        (out may be gate or x)."""
        self.functions["activation", x.dtype](x.data_ptr(), out.data_ptr(), *out.shape, x.stride(0), out.stride(0),
                                              gated, torch.get_num_threads())


def build(folder: Path, machine: str) -> NativeKernels:
    """The kernels compiled for ``machine`` (a key of this CPU) in ``folder``, built now unless they are there.
    Raises OSError or ``subprocess.SubprocessError`` where they cannot be built or loaded here."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = (*FLAGS, *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()))
    version = subprocess.run([*compiler, "--version"], capture_output=True, check=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), version, machine.encode()]))
    path = folder / f"{key.hexdigest()[:16]}.so"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".tmp", dir=folder, delete=False) as file:
            tmp = Path(file.name)
        try:
            subprocess.run([*compiler, *flags, str(SOURCE), "-o", str(tmp), "-lmvec", "-lm"], capture_output=True,
                           check=True, timeout=300)
            with open(tmp, "rb") as built:  # on disk before its name: a power cut leaves no empty library there
                os.fsync(built.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return NativeKernels(ctypes.CDLL(str(path)))
