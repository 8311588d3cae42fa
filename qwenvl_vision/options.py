"""Command-line option types shared by the subcommands (``cli`` and ``embed``)."""

from __future__ import annotations

import argparse

DTYPE_CHOICES = "fp32/float32, bf16/bfloat16, fp16/float16/half"


def dtype_option(text: str) -> str:
    """argparse type of a --dtype option: one of encoder.DTYPES' spellings."""
    from .encoder import DTYPES

    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(f"unsupported dtype {text!r}; use one of {', '.join(sorted(DTYPES))}")
    return text
