"""A transfer backend wrapper whose copies land at seeded later steps.

A store copy reads its GPU source blocks when it *executes*, not when it is submitted. With a
store delayed by a few steps, a GPU block that is handed to a new owner and overwritten by the
new owner's compute before the copy ran would put the new owner's bytes under the old key; the
oracle then sees wrong bytes when that key is loaded (INV-DATA). The scheduler prevents this by
flushing (``jobs_to_flush`` -> the worker's ``wait``), which makes the copy execute at once;
each such forced execution is counted, as evidence that a fenced block was reused mid-store.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from statecore.wire import TransferJob
from statecore.worker import TransferBackend, TransferResult

__all__ = ["DelayedBackend"]


@dataclass(slots=True)
class _Pending:
    job_id: int
    job: TransferJob
    is_store: bool
    due: int


class DelayedBackend:
    """Holds submitted jobs until their landing step, then runs them on ``inner``.

    Args:
        inner: the backend doing the copies (e.g. the torch adapter on CPU tensors).
        rng: seeded stream deciding which stores are delayed and by how much.
        delay_prob: probability that a store is delayed.
        max_delay: largest delay in steps.

    Completion order stays FIFO per direction, as on a CUDA stream.
    """

    def __init__(
        self, inner: TransferBackend, rng: random.Random, delay_prob: float, max_delay: int
    ) -> None:
        self.inner = inner
        self.rng = rng
        self.delay_prob = delay_prob
        self.max_delay = max_delay
        self.step = 0
        self._queues: dict[bool, deque[_Pending]] = {True: deque(), False: deque()}
        self.delayed_stores = 0
        self.forced_by_flush = 0
        self.executed = 0
        self.inner_errors = 0
        self._failed: list[TransferResult] = []

    def advance(self, step: int) -> None:
        """The engine is at ``step``: run every job whose landing step has come."""
        self.step = step
        for q in self._queues.values():
            while q and q[0].due <= step:
                self._run(q.popleft())

    def pending(self) -> int:
        """Jobs submitted and not yet executed."""
        return sum(len(q) for q in self._queues.values())

    def _run(self, p: _Pending) -> None:
        self.executed += 1
        try:
            self.inner.submit(p.job_id, p.job, p.is_store)
            self.inner.wait((p.job_id,))
        except Exception:  # the inner backend refused or broke: the job failed
            self.inner_errors += 1
            self._failed.append(TransferResult(p.job_id, False, 0, 0.0, p.is_store))

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Queue the job; a delayed store lands ``1..max_delay`` steps later."""
        due = self.step
        if is_store and self.max_delay and self.rng.random() < self.delay_prob:
            due += self.rng.randint(1, self.max_delay)
            self.delayed_stores += 1
        q = self._queues[is_store]
        if q and q[-1].due > due:
            due = q[-1].due  # FIFO per direction
        p = _Pending(job_id, job, is_store, due)
        if due <= self.step and not q:
            self._run(p)
        else:
            q.append(p)

    def poll(self) -> list[TransferResult]:
        """Results of the jobs that executed."""
        out, self._failed = self._failed, []
        return out + self.inner.poll()

    def wait(self, job_ids: Collection[int]) -> None:
        """Run the waited jobs now, with every earlier job of their direction."""
        wanted = set(job_ids)
        for q in self._queues.values():
            last = max((i for i, p in enumerate(q) if p.job_id in wanted), default=-1)
            for _ in range(last + 1):
                p = q.popleft()
                if p.due > self.step:
                    self.forced_by_flush += 1
                self._run(p)

    def shutdown(self) -> None:
        """Run everything pending, then shut the inner backend down."""
        for q in self._queues.values():
            while q:
                self._run(q.popleft())
        self.inner.shutdown()
