"""Device and dtype: what the API accepts (``resolve_device``, ``resolve_dtype``), the argparse types of the
command line's ``--device`` and ``--dtype`` (the same spellings, refused when parsed), the project's dtype names
(``DTYPE_SPELLINGS`` and its views) and ``upload``, the one way host data reaches the device."""

from __future__ import annotations

import argparse

import torch

from .errors import ConfigError


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype ("bfloat16"), as DTYPES and every file the project writes spell it."""
    return str(dtype).removeprefix("torch.")


# The one dtype table: every spelling the API and --dtype accept of a dtype the tower runs in; the rest are views.
DTYPE_SPELLINGS = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
DTYPES = {dtype_name(d): d for d in DTYPE_SPELLINGS.values()}  # by the name run.json, plans and Parquet write
DTYPE_CHOICES = ", ".join("/".join(n for n, d in DTYPE_SPELLINGS.items() if d is t) for t in DTYPES.values())
# safetensors' names of the floats a checkpoint may store (float64 too: it is cast on load).
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def upload(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The host tensors concatenated (dim 0) onto ``device`` in one copy. For CUDA they are concatenated into one
    pinned buffer, so that the non-blocking copy is asynchronous (from pageable memory the host waits for it); the
    caching host allocator keeps the buffer until the copy has run. Elsewhere: ``torch.cat`` then ``.to``."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.cat(tensors).to(device)
    first = tensors[0]
    staging = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(tensors, out=staging).to(device, non_blocking=True)


def resolve_device(device: str | torch.device | None, *, here: bool = True) -> torch.device:
    """The device to run on: CUDA when there is one and nothing was asked; a device this machine lacks is refused
    (``here=False`` checks the spelling only: the device of another machine, a Ray actor's)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if resolved.type not in ("cpu", "cuda", "meta"):  # mps, xpu: torch knows them, the towers run on neither
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    if not here or resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available here (no GPU, or a CPU build of torch "
                          f"{torch.__version__}); use the CPU (--device cpu)")
    if (resolved.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype: bf16 on CUDA and fp32 elsewhere when nothing was asked (``load_encoder`` warns of fp16,
    naming the family, once it has read the config)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPE_SPELLINGS:
        resolved = DTYPE_SPELLINGS[dtype.lower()]
    else:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_SPELLINGS)}")
    if resolved not in DTYPES.values():
        raise ConfigError(f"unsupported dtype {resolved}; use float32, bfloat16 or float16")
    return resolved


def dtype_option(text: str) -> str:
    """argparse type of a --dtype option: what ``resolve_dtype`` takes, refused when parsed."""
    try:
        resolve_dtype(text, torch.device("cpu"))
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_option(text: str) -> str:
    """argparse type of a --device option: cpu, cuda or cuda:N, its spelling (each command checks that the machine
    has it where the tower loads: embed's Ray actors run on other machines)."""
    try:
        if resolve_device(text, here=False).type != "meta":  # the API's tower of no memory: nothing a command runs
            return text
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    raise argparse.ArgumentTypeError(f"device {text!r} is not supported; use cpu, cuda or cuda:N")
