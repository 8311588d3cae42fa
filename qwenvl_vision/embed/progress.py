"""What a long embed run shows on stderr while it goes: a bar on a terminal, a line every few seconds elsewhere,
nothing with ``--quiet``."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

PROGRESS_EVERY_S = 5.0  # without a terminal: one progress line at most this often


class Progress:
    """What a long run shows on stderr: a tqdm bar on a terminal; elsewhere (a log file, a job scheduler) a
    line at most every PROGRESS_EVERY_S seconds with done/total, inputs/s, tokens/s and ETA, and one when the
    run ends; nothing with --quiet. ``note`` prints a one-off line (loading, ...) unless quiet.

    An input counts as done once it is decoded and resized (or has failed), so the count moves input by input
    even when a whole small job is one forward; the batch it joins is written at most one batch (and the
    prefetch depth) later."""

    def __init__(self, rank: int, quiet: bool) -> None:
        self.stream = sys.stderr
        self.quiet = quiet
        self.label = f"embed[rank {rank}]" if rank else "embed"
        self.terminal = not quiet and self.stream.isatty()
        self.bar = None
        self.total = self.done = self.tokens = 0
        self.start = self.last_line = 0.0

    def note(self, message: str) -> None:
        if not self.quiet:
            print(f"{self.label}: {message}", file=self.stream, flush=True)

    def begin(self, total: int) -> None:
        self.total, self.start = total, time.perf_counter()
        self.last_line = self.start
        if self.terminal:
            self.bar = tqdm(total=total, unit="input", desc=self.label, dynamic_ncols=True, file=self.stream)
        else:
            self.note(f"{total} input{'s' if total != 1 else ''} to embed")

    def update(self, inputs: int, tokens: int) -> None:
        """`inputs` more done, giving `tokens` embedding rows."""
        self.done += inputs
        self.tokens += tokens
        now = time.perf_counter()
        if self.bar is not None:
            elapsed = max(now - self.start, 1e-9)
            self.bar.update(inputs)
            self.bar.set_postfix(tok_s=f"{self.tokens / elapsed:.0f}")
        elif now - self.last_line >= PROGRESS_EVERY_S and self.done < self.total:  # close() prints the last
            self._line(now)

    def _line(self, now: float) -> None:
        self.last_line = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "?"
        self.note(f"{self.done}/{self.total} inputs ({100 * self.done / max(self.total, 1):.0f}%), "
                  f"{rate:.1f} inputs/s, {self.tokens / elapsed:.0f} tok/s, ETA {eta}")

    def close(self) -> None:
        """The run's work is written: close the bar, or print the last line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.total:
            self._line(time.perf_counter())

