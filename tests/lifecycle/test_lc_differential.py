"""Differential tests: the compiled tables against real python-statemachine instances.

Random event sequences, with the guard-relevant data mutated at random between events, must
give identical accept/reject, identical states and identical owner calls on both sides. A
tampered copy of a table must be caught.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from lifecycle_harness import LIFECYCLES, Step, first_mismatch, plan

from statecore.lifecycle import (
    CompiledLifecycle,
    JobLifecycle,
    RequestLifecycle,
    compile_lifecycle,
)

REQUEST_DATA = st.none() | st.fixed_dictionaries({"jobs": st.sets(st.integers(0, 3), max_size=3)})
JOB_DATA = st.none() | st.fixed_dictionaries(
    {}, optional={"pending": st.integers(0, 3), "failed": st.integers(0, 2)}
)


def steps_for(lc: CompiledLifecycle) -> st.SearchStrategy[list[Step]]:
    """Random runs for ``lc``: up to 40 (data, event) steps."""
    data = REQUEST_DATA if lc.entity == "request" else JOB_DATA
    return st.lists(st.tuples(data, st.sampled_from(lc.events)), max_size=40)


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
@given(data=st.data())
def test_table_agrees_with_machine(name: str, data: st.DataObject) -> None:
    lc = LIFECYCLES[name]
    steps = data.draw(steps_for(lc), label="steps")
    assert first_mismatch(lc, steps) is None


def _fresh(name: str) -> CompiledLifecycle:
    if name == "request":
        return compile_lifecycle(RequestLifecycle, "request", "req_id")
    return compile_lifecycle(JobLifecycle, "job", "job_id")


def tamper(lc: CompiledLifecycle, row: int, entry: int, **change: Any) -> None:
    """Replace one entry ``(guard, target, actions)`` of ``lc``'s table in place."""
    rows = [list(r) for r in lc._rows]
    guard, target, actions = rows[row][entry]
    fields = {"guard": guard, "target": target, "actions": actions, **change}
    rows[row][entry] = (fields["guard"], fields["target"], fields["actions"])
    lc._rows = tuple(tuple(r) for r in rows)


def row_of(lc: CompiledLifecycle, source: str, event: str) -> int:
    return lc.state_index[source] * len(lc.events) + lc.event_index[event]


def coverage_steps(lc: CompiledLifecycle) -> list[list[Step]]:
    """One run per transition: its shortest path with guard witnesses, as differential steps."""
    p = plan(lc)
    runs: list[list[Step]] = []
    for t in lc.transitions:
        path = p.path_to(t)
        assert path is not None
        runs.append([(s.data, s.transition.event) for s in path])
    return runs


def test_fresh_compile_is_clean() -> None:
    for name in LIFECYCLES:
        lc = _fresh(name)
        for run in coverage_steps(lc):
            assert first_mismatch(lc, run) is None


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_every_retargeted_entry_is_caught(name: str) -> None:
    """Planted bugs: each table entry in turn sent to a wrong state must show a mismatch."""
    pristine = _fresh(name)
    n_states = len(pristine.states)
    runs = coverage_steps(pristine)
    planted = 0
    for row, entries in enumerate(pristine._rows):
        for entry, (_, target, _) in enumerate(entries):
            lc = _fresh(name)
            tamper(lc, row, entry, target=(target + 1) % n_states)
            found = next((m for run in runs if (m := first_mismatch(lc, run)) is not None), None)
            source = pristine.states[row // len(pristine.events)]
            event = pristine.events[row % len(pristine.events)]
            assert found, f"retargeting {event!r} from {source!r} went unnoticed"
            planted += 1
    assert planted == len(pristine.transitions)


def test_random_runs_find_a_planted_bug() -> None:
    """The random driver itself (not only the planned paths) finds a planted bug.

    Tamper: ``signal_finished`` with jobs still in flight releases the request at once instead
    of waiting in ``finished_draining``: the request is forgotten while its jobs run. Finding
    it needs ``finish``, then jobs in the record, then ``signal_finished``.
    """
    lc = _fresh("request")
    row = row_of(lc, "finished_pending_final", "signal_finished")
    entries = lc._rows[row]
    assert [lc.states[t] for _, t, _ in entries] == ["released", "finished_draining"]
    tamper(lc, row, 1, target=lc.state_index["released"])
    example = find(
        steps_for(lc),
        lambda steps: first_mismatch(lc, steps) is not None,
        settings=settings(
            max_examples=2_000, database=None, derandomize=True, phases=[Phase.generate]
        ),
    )
    message = first_mismatch(lc, example)
    assert message is not None and "'signal_finished'" in message
    assert "table -> 'released', machine -> 'finished_draining'" in message


def test_dropped_guard_is_caught() -> None:
    """A guard lost in compilation (in_flight accepts ``worker_report`` as partial always)."""
    lc = _fresh("job")
    tamper(lc, row_of(lc, "in_flight", "worker_report"), 0, guard=None)
    mismatch = first_mismatch(lc, [({"pending": 0, "failed": 0}, "worker_report")])
    assert mismatch is not None and "'partial'" in mismatch and "'completed'" in mismatch


def test_dropped_entry_is_caught_as_reject_mismatch() -> None:
    lc = _fresh("job")
    row = row_of(lc, "in_flight", "reset")
    lc._rows = tuple(() if i == row else r for i, r in enumerate(lc._rows))
    mismatch = first_mismatch(lc, [(None, "reset")])
    assert mismatch == "step 0: 'reset' from 'in_flight' with None: table rejects, machine accepts"


def test_dropped_action_is_caught() -> None:
    lc = _fresh("request")
    tamper(lc, row_of(lc, "no_transfer", "finish"), 0, actions=())
    mismatch = first_mismatch(lc, [(None, "finish")])
    assert mismatch is not None and "on_finish" in mismatch
