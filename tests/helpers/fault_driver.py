"""``qwenvl-vision`` in a child process with a fault injected at the forward's seam, for tests/test_faults.py.

    python -m tests.helpers.fault_driver SPEC COMMAND ARGS...

SPEC is JSON; every key is optional:

- ``{"fail_from": k}``: the device breaks at the k-th forward (0-based, counting retries and the encoder's own
  probe of the device): that forward and every later one raise a kernel's RuntimeError;
- ``{"bad_item": "name"}``: every forward that holds an input whose name contains "name" raises a kernel's
  RuntimeError (a shape a kernel refuses), alone too; the device works;
- ``{"oom_above_items": n}``: every forward over more than n items runs out of memory (a batch too large for the
  machine: the encoder retries it item by item);
- ``{"oom_item": "name"}``: every forward that holds an input whose name contains "name" runs out of memory,
  alone too;
- ``{"slow_s": s}``: every batch's forward takes s seconds longer (a slow machine: another process can act while
  the run is under way).

Only the seam is replaced: the real forward runs whenever no fault applies, and everything around it (batching,
retries, the writers, the CLI's error lines and exit codes) is the package's own code.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from qwenvl_vision import encoder as encoder_module
from qwenvl_vision.cli import main


def install(spec: dict) -> None:
    real = encoder_module.VisionEncoder._forward_batch
    real_unchecked = encoder_module.VisionEncoder._encode_unchecked
    calls = {"n": 0}

    def encode_unchecked(self, *args, **kwargs):
        k = calls["n"]
        calls["n"] += 1
        if "fail_from" in spec and k >= spec["fail_from"]:
            raise RuntimeError("injected: a kernel failed (the device is gone)")
        return real_unchecked(self, *args, **kwargs)

    def forward_batch(self, batch, options):
        time.sleep(spec.get("slow_s", 0))
        names = [p.name for p in batch]
        if "oom_above_items" in spec and len(batch) > spec["oom_above_items"]:
            return raise_inside(self, batch, options, real, torch.OutOfMemoryError("injected: out of memory"))
        if "oom_item" in spec and any(spec["oom_item"] in n for n in names):
            return raise_inside(self, batch, options, real, torch.OutOfMemoryError("injected: out of memory"))
        if "bad_item" in spec and any(spec["bad_item"] in n for n in names):
            return raise_inside(self, batch, options, real, RuntimeError("injected: no kernel for this shape"))
        return real(self, batch, options)

    encoder_module.VisionEncoder._encode_unchecked = encode_unchecked
    encoder_module.VisionEncoder._forward_batch = forward_batch


def raise_inside(encoder, batch, options, real, error: BaseException):
    """Run the real ``_forward_batch`` with the tower's forward raising ``error``: the encoder's own handling
    (retry item by item, the one-line fault) is what runs."""
    unchecked = encoder_module.VisionEncoder._encode_unchecked

    def failing(*args, **kwargs):  # once: the retries that follow run the real forward (or their own fault)
        encoder_module.VisionEncoder._encode_unchecked = unchecked
        raise error

    encoder_module.VisionEncoder._encode_unchecked = failing
    try:
        return real(encoder, batch, options)
    finally:
        encoder_module.VisionEncoder._encode_unchecked = unchecked


if __name__ == "__main__":
    install(json.loads(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
