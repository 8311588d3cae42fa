"""The queue of items waiting for the encoder, and the one thread that encodes them: it takes every item queued at
that moment, hands them to ``iter_encode`` (which decodes ahead on its threads, within the decode budget, and
batches by patches) and resolves each item's future on its event loop as its batch comes out. The event loop never
decodes or runs a forward. A request's items hold their room in the queue from before their media are read
(``reserve``) until they are answered; a request the queue has no room for is refused at once (503): never an
unbounded backlog of items."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ForwardFaultError
from ..inputs.pixels import FileBytes
from ..results import ItemResult
from .media import RequestError


@dataclass(eq=False)
class Job:
    file: FileBytes
    normalize: bool
    future: asyncio.Future


class Batcher:
    """Owns the encoder's forwards. ``options``: ``iter_encode``'s keyword arguments (limits, pixel bounds)."""

    def __init__(self, encoder: Any, options: dict[str, Any], max_queue: int, queue_gauge: Any, items_counter: Any):
        self.encoder, self.options, self.max_queue = encoder, options, max_queue
        self.queue_gauge, self.items_counter = queue_gauge, items_counter
        self.jobs: collections.deque[Job] = collections.deque()
        self.reserved = 0  # items whose media are loading (reserve)
        self.encoding = 0  # items taken by the encoder's thread and not yet answered
        self.fault: str | None = None  # a ForwardFaultError's line: the device is broken, every later forward fails
        self.ready = threading.Condition()
        self.stopping = False
        # Started by the first request: running from here, it would keep an app never served, and its encoder, alive.
        self.thread = threading.Thread(target=self.run, name="qwenvl-vision-encoder", daemon=True)

    @contextlib.contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        """Room in the queue for ``n`` items while their media load and ``submit`` queues them; a queue without it, or
        a broken device: 503 at once, before any media is read."""
        with self.ready:
            if self.stopping:  # the thread has ended, or ends once the items reserved before are queued and done
                raise RequestError("the server is shutting down", 503)
            if self.thread.ident is None:
                self.thread.start()
            if self.fault is not None:  # as /health answers: a balancer sends the request elsewhere
                raise RequestError(self.fault, 503)
            if (held := self.count()) + n > self.max_queue:
                raise RequestError(f"the encoder's queue is full ({held} items waiting, loading or being encoded, "
                                   f"--max-queue {self.max_queue}); try again shortly", 503, {"Retry-After": "1"})
            self.reserved += n
            self.count()
        try:
            yield
        finally:
            with self.ready:
                self.reserved -= n
                self.count()
                self.ready.notify()  # a stopping thread waits for the reserved items

    def submit(self, files: list[FileBytes], normalize: bool = False) -> list[asyncio.Future]:
        """Queue the files, in the room ``reserve`` holds for them; their futures resolve to ``ItemResult``s."""
        loop = asyncio.get_running_loop()
        jobs = [Job(f, normalize, loop.create_future()) for f in files]
        with self.ready:
            self.jobs.extend(jobs)
            self.count()
            self.ready.notify()
        return [job.future for job in jobs]

    def count(self) -> int:
        """The items ``reserve`` counts against --max-queue, and the gauge set to them (called holding ``ready``)."""
        held = len(self.jobs) + self.reserved + self.encoding
        self.queue_gauge.set(held)
        return held

    def run(self) -> None:
        while True:
            with self.ready:
                while not self.jobs and not (self.stopping and not self.reserved):
                    self.ready.wait()
                if not self.jobs:  # stopping, the queue drained and nothing reserved that could still be queued
                    return
                taken, self.jobs = list(self.jobs), collections.deque()
                self.encoding = len(taken)
            for normalize in (False, True):  # one call per setting: normalize is an option of the call
                group = [job for job in taken if job.normalize == normalize]
                if group:
                    self.encode(group, normalize)

    def encode(self, jobs: list[Job], normalize: bool) -> None:
        """Each job's future resolved, its room in the queue given back just before (the client may send again)."""
        if self.fault is not None:  # queued before the device broke: refused as reserve refuses, with no forward
            self.answer(jobs, RequestError(self.fault, 503))
            return
        options = self.options
        if self.encoder.device.type == "cpu":
            # On the CPU each item runs as its own forward whatever its batch (execution.forwards_on): batches of
            # one answer each item as soon as its forward ends, so clients resend while the others are encoded.
            options = {**options, "max_batch_patches": 1}
        fed: list[Job] = []  # the jobs given to iter_encode, in its order

        def files() -> Iterator[FileBytes]:
            for job in jobs:
                if not job.future.done():  # done: its client hung up before the encoder reached it (skipped)
                    fed.append(job)
                    yield job.file

        answered: set[Job] = set()
        left: BaseException = asyncio.CancelledError()  # what the jobs not answered get: skipped ones, nobody's
        try:
            for batch in self.encoder.iter_encode(files(), video=None, pooled=True, normalize=normalize, **options):
                self.items_counter.inc(sum(result.ok for result in batch))
                done = [fed[result.index] for result in batch]
                answered.update(done)
                self.answer(done, batch)
        except Exception as e:  # noqa: BLE001 - a failed forward fails the items waiting for it, and the server goes on
            if isinstance(e, ForwardFaultError):
                self.fault = f"the encoder's device failed; restart the server: {e}"
            left = e
        self.answer([job for job in jobs if job not in answered], left)

    def answer(self, jobs: list[Job], outcomes: list[ItemResult] | BaseException) -> None:
        with self.ready:
            self.encoding -= len(jobs)
            self.count()
        for i, job in enumerate(jobs):
            self.resolve(job.future, outcomes if isinstance(outcomes, BaseException) else outcomes[i])

    @staticmethod
    def resolve(future: asyncio.Future, outcome: ItemResult | BaseException) -> None:
        def settle() -> None:
            if not future.done():  # done: its request went away (a client that hung up)
                (future.set_exception if isinstance(outcome, BaseException) else future.set_result)(outcome)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it
            future.get_loop().call_soon_threadsafe(settle)

    def close(self) -> None:
        """Encode what is queued, then stop the thread."""
        with self.ready:
            self.stopping = True
            self.ready.notify()
        if self.thread.ident is not None:
            self.thread.join()
