"""Transition coverage generated from the lifecycle graphs.

For every transition of every lifecycle, a breadth-first search over the transition graph gives
a shortest event path from the initial state that ends with it (as XState's path generation
does). Each step first sets the record's data from a per-guard witness table so the planned
transition is the one selected. The path is walked through the compiled table, and through the
real machine in checked mode, asserting the state after every step. The last test fails when
any transition is not exercised, so a new transition needs a reachable source and witnesses
for its guards.
"""

from __future__ import annotations

import pytest
from lifecycle_harness import (
    LIFECYCLES,
    NEGATIVE_WITNESSES,
    WITNESSES,
    MissingWitness,
    RecordingOwner,
    new_record,
    plan,
    walk,
)

from statecore.lifecycle import CompiledLifecycle, TransitionInfo, checked_mode

CASES = [
    pytest.param(name, i, id=f"{name}:{t.event}:{t.source}->{t.target}:{t.guard_text or '-'}")
    for name, lc in sorted(LIFECYCLES.items())
    for i, t in enumerate(lc.transitions)
]


@pytest.mark.parametrize(("name", "index"), CASES)
def test_shortest_path_to_transition(name: str, index: int) -> None:
    lc = LIFECYCLES[name]
    t = lc.transitions[index]
    path = plan(lc).path_to(t)
    assert path is not None, f"{t.source!r} is unreachable from {lc.states[lc.initial]!r}"
    assert path[-1].transition is t
    table_calls = walk(lc, path)
    with checked_mode(lc):
        machine_calls = walk(lc, path)
    assert table_calls == machine_calls


def test_paths_are_shortest() -> None:
    """Each prefix reaches its state in the BFS distance (no path is longer than needed)."""
    for lc in LIFECYCLES.values():
        p = plan(lc)
        dist = {s: len(prefix) for s, prefix in p.to_state.items()}
        for t in lc.transitions:
            if t.source in dist and t.target in dist:
                assert dist[t.target] <= dist[t.source] + 1


def test_every_guard_has_witnesses() -> None:
    for lc in LIFECYCLES.values():
        for t in lc.transitions:
            for func, _ in t.guards:
                assert func.__name__ in WITNESSES, func.__name__
                assert func.__name__ in NEGATIVE_WITNESSES, func.__name__


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_witnesses_make_their_guards_true_and_false(name: str) -> None:
    lc = LIFECYCLES[name]
    for func in {f for t in lc.transitions for f, _ in t.guards}:
        rec = new_record(lc, RecordingOwner())
        for attr, value in WITNESSES[func.__name__].items():
            setattr(rec, attr, value)
        assert func(rec), f"witness of {func.__name__} does not satisfy it"
        for attr, value in NEGATIVE_WITNESSES[func.__name__].items():
            setattr(rec, attr, value)
        assert not func(rec), f"negative witness of {func.__name__} does not falsify it"


def exercised(lc: CompiledLifecycle) -> set[int]:
    """Indices of the transitions that the generated paths actually take (fast and checked)."""
    index = {id(t): i for i, t in enumerate(lc.transitions)}
    seen: set[int] = set()

    def note(t: TransitionInfo) -> None:
        seen.add(index[id(t)])

    p = plan(lc)
    for t in lc.transitions:
        path = p.path_to(t)
        if path is None:
            continue
        walk(lc, path, on_step=note)
        with checked_mode(lc):
            walk(lc, path, on_step=note)
    return seen


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_all_transitions_exercised(name: str) -> None:
    lc = LIFECYCLES[name]
    seen = exercised(lc)
    missing = [
        f"{t.event}: {t.source} -> {t.target} [{t.guard_text}]"
        for i, t in enumerate(lc.transitions)
        if i not in seen
    ]
    assert not missing, f"{name}: transitions never exercised: {missing}"
    assert len(seen) == len(lc.transitions)


def test_coverage_notices_an_unreachable_transition() -> None:
    """The coverage machinery reports a transition whose source the BFS cannot reach."""
    from statemachine import State, StateMachine

    class Island(StateMachine):
        validate_disconnected_states = False
        a = State(initial=True)
        b = State(final=True)
        c = State()
        go = a.to(b)
        drift = c.to(b)

    from statecore.lifecycle import compile_lifecycle

    lc = compile_lifecycle(Island, "request", "req_id")
    p = plan(lc)
    unreachable = [t for t in lc.transitions if p.path_to(t) is None]
    assert [(t.event, t.source) for t in unreachable] == [("drift", "c")]
    assert len(exercised(lc)) == 1


def _mystery(model: object) -> bool:
    return True


def test_coverage_demands_a_witness_for_a_new_guard() -> None:
    from statemachine import State, StateMachine

    from statecore.lifecycle import compile_lifecycle

    class Guarded(StateMachine):
        a = State(initial=True)
        b = State(final=True)
        go = a.to(b, cond=_mystery)

    lc = compile_lifecycle(Guarded, "job", "job_id")
    with pytest.raises(MissingWitness, match="_mystery"):
        plan(lc).path_to(lc.transitions[0])
