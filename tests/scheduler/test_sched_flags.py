"""Per-job flags the invariants read, set exactly when their event happens (issue 18).

``flushed`` says a job went out in a step's ``jobs_to_flush``: every worker finishes it
before that step writes any GPU block. INV-SRC-VALID accepts a store reading blocks that an
unfinished load writes only if the store was flushed first; a job starts unflushed, and the
step that flushes it marks it.
"""

from __future__ import annotations

import pytest
from sched_harness import Harness, admit_with_load, config, make_manager, offloaded, prefill

from statecore import InvariantViolation


def test_store_is_unflushed_until_a_step_flushes_it(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1, 2, 3, 4], 16)
    h.add("c", list(range(50, 58)))
    (store,) = prefill(h, "c")
    assert not h.sched.jobs[store].flushed and not h.sched.jobs[load].flushed
    # make the sent load write the blocks the store reads (a clash only a flush excuses)
    h.sched.jobs[load].blocks = h.sched.jobs[store].blocks
    with pytest.raises(InvariantViolation, match="INV-SRC-VALID"):
        h.sched.check_invariants()
    meta = h.step(preempted=["c"])  # the preemption flushes c's store
    assert store in meta.jobs_to_flush
    assert h.sched.jobs[store].flushed and not h.sched.jobs[load].flushed
    h.sched.check_invariants()
