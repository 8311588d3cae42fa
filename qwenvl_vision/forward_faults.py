"""What a failed or non-finite forward means for a batch job: out of memory (retry smaller), the machine's fault
(stop, ``ForwardFaultError``), an input's own failure, outputs with inf/nan. The encoder decides with these;
the wording of each one-line error lives here."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def nonfinite_items(embeddings: Sequence[torch.Tensor], deepstack: Sequence[Sequence[torch.Tensor]],
                    pooled: torch.Tensor | None) -> list[int]:
    """Indices of the items whose embedding, DeepStack levels or pooled vector hold inf or nan (one host sync)."""
    if not embeddings:
        return []
    finite = torch.stack([torch.isfinite(e).all() for e in embeddings])
    for i, levels in enumerate(deepstack):
        for level in levels:
            finite[i] &= torch.isfinite(level).all()
    if pooled is not None:
        finite &= torch.isfinite(pooled).all(dim=-1)
    return (~finite).nonzero().flatten().tolist()


def nonfinite_message(what: str, dtype: torch.dtype) -> str:
    """The one line for outputs with inf/nan: float16 overflows in the tower; in another dtype the weights or the
    config are at fault."""
    if dtype == torch.float16:
        return f"{what}: the tower's outputs contain inf/nan in float16 (the tower overflowed); use bfloat16 or float32"
    return (f"{what}: the tower's outputs contain inf/nan in {str(dtype).removeprefix('torch.')}: the checkpoint's "
            f"weights or config values overflow; check them (qwenvl-vision inspect shows the config)")


def is_out_of_memory(error: BaseException) -> bool:
    """Out of memory, on any device: torch's own error, Python's, or an allocator's RuntimeError that says so."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "not enough memory", "alloc_failed"))


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back before retrying smaller (CUDA keeps them otherwise)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message, at most ``limit`` characters (torch's messages run long)."""
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def describe_batch(names: Sequence[str], shown: int = 3) -> str:
    """'a batch of 3 inputs (a.jpg, b.jpg, c.jpg)', the first few named."""
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    return f"a batch of {len(names)} input{'s' if len(names) != 1 else ''} ({listed})"


def why_alone(failure: BaseException | None, patches: int, device: torch.device) -> str:
    """Why an input failed on its own: out of memory (``failure`` None), or an error the device does not share."""
    if failure is None:
        return f"out of memory encoding it alone ({patches:,} patches on {device}): lower its size (max_pixels, " \
               f"--max-pixels)"
    return f"its forward fails alone while the device works: {type(failure).__name__}: {first_line(failure)}"
