"""What memory is in use right now, without running the cyclic gc: a census of live tensor storages, the process
RSS, the memory a new instance could still get, and one measurement point of all of them (the teardown
benchmark's reading, ``qwenvl_vision.teardown.study``).
"""

from __future__ import annotations

import gc
import os
from typing import Any


def live_tensor_storages() -> dict[tuple[str, int], tuple[int, str]]:
    """Every untyped storage reachable from a gc-tracked tensor: (device, data_ptr) -> (bytes, example).

    Tensors held only from C++ (autograd graphs, allocator caches) are invisible here; the RSS and the
    CUDA allocator counters cover those.
    """
    import torch

    # type(), not isinstance(): no __class__ lookups on arbitrary objects (some warn or import on access).
    # FakeTensors (torch.compile's tracing values) have no data.
    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)
               and type(obj).__name__ != "FakeTensor"]
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    for obj in tensors:
        try:
            if obj.is_meta:
                continue
            if obj.is_mkldnn:  # oneDNN's packed weights (cpu.packing) have no storage to ask: one per tensor
                nbytes, key = obj.numel() * obj.element_size(), ("mkldnn", id(obj))
            else:
                storage = obj.untyped_storage()
                nbytes, key = storage.nbytes(), (str(storage.device), storage.data_ptr())
        except Exception:  # noqa: BLE001 - sparse / nested / wrapper tensors without a plain storage
            continue
        if key not in seen or nbytes > seen[key][0]:
            seen[key] = (nbytes, f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')} {obj.device}")
    return seen


def live_tensor_bytes() -> int:
    """Bytes of all live tensor storages, each counted once (see live_tensor_storages)."""
    return sum(n for n, _ in live_tensor_storages().values())


def rss_bytes() -> int | None:
    """Resident set size, after asking glibc to return free heap pages (malloc_trim), or None."""
    from ..model.cache import return_freed_memory

    return_freed_memory()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def available_bytes(device: Any) -> int | None:
    """Memory a new instance could still use: CUDA free + cached, or MemAvailable on Linux."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def measure(device: Any, storages: dict | None = None) -> dict[str, Any]:
    """One point: tensor census (+ RSS on CPU, allocator counters on CUDA); ``storages``, when given, receives the
    census itself (``live_tensor_storages``). Never runs the cyclic gc."""
    import torch

    live = live_tensor_storages()
    point: dict[str, Any] = {"tensor_bytes": sum(n for n, _ in live.values())}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()  # process-wide cuBLAS workspaces, allocated on the first matmul
        torch.cuda.empty_cache()
        point["cuda_allocated"] = torch.cuda.memory_allocated(device)
        point["cuda_reserved"] = torch.cuda.memory_reserved(device)
    point["rss_bytes"] = rss_bytes()
    if storages is not None:
        storages.update(live)
    return point


def point_bytes(point: dict[str, Any], device: Any) -> int:
    """The number a verdict reads from a point: CUDA allocated bytes on CUDA, the tensor census elsewhere."""
    return point["cuda_allocated"] if device.type == "cuda" else point["tensor_bytes"]
