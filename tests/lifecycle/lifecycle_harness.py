"""Shared helpers for the lifecycle tests: records, recording owners, the differential check,
guard witnesses and shortest-path transition coverage.

Imported by the test modules of this folder (pytest puts the folder on ``sys.path``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from statemachine.exceptions import TransitionNotAllowed

from statecore.errors import LifecycleError
from statecore.lifecycle import JOB, REQUEST, CompiledLifecycle, TransitionInfo, effects_class

# ---------------------------------------------------------------------------------------------
# Records and owners


def _recorder(hook: str) -> Callable[..., None]:
    def record(self: RecordingOwner, rec: Any, *args: Any) -> None:
        ident = getattr(rec, "req_id", None) or getattr(rec, "job_id", None)
        self.calls.append((hook, ident, *args))

    return record


class RecordingOwner(effects_class("_RecordingHooks", _recorder)):  # type: ignore[misc]
    """A lifecycle owner that records every hook call as ``(hook, entity id, *args)``."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []


class ReqRec:
    """A request record (the fields the request guards and actions read)."""

    __slots__ = ("_shadow", "_sm", "jobs", "owner", "req_id", "state")
    _shadow: str  # the machine's state field in checked mode
    _sm: Any

    def __init__(self, owner: RecordingOwner, req_id: str = "req-1") -> None:
        self.req_id = req_id
        self.owner = owner
        self.jobs: set[int] = set()
        self.state = REQUEST.initial


class JobRec:
    """A job record (the fields the job guards and actions read)."""

    __slots__ = (
        "_shadow",
        "_sm",
        "failed",
        "is_store",
        "job_id",
        "owner",
        "pending",
        "sent",
        "state",
    )
    _shadow: str
    _sm: Any

    def __init__(self, owner: RecordingOwner, job_id: int = 7) -> None:
        self.job_id = job_id
        self.owner = owner
        self.pending = 2
        self.failed = 0
        self.is_store = True  # a store: a reset discards it
        self.sent = True
        self.state = JOB.initial


def new_record(lc: CompiledLifecycle, owner: RecordingOwner) -> Any:
    """A fresh record for ``lc`` (by its entity), in the initial state."""
    if lc.entity == "request":
        return ReqRec(owner)
    if lc.entity == "job":
        return JobRec(owner)
    raise ValueError(f"no test record for entity {lc.entity!r}")


def apply_data(rec: Any, data: dict[str, Any] | None) -> None:
    """Set the guard-relevant fields of ``rec`` (copies sets so records never share one)."""
    for name, value in (data or {}).items():
        setattr(rec, name, set(value) if isinstance(value, set | frozenset) else value)


# ---------------------------------------------------------------------------------------------
# Differential check: compiled table vs a real machine instance

Step = tuple[dict[str, Any] | None, str]
"""One step of a run: data to set on the record first (or None), then the event name."""


def first_mismatch(lc: CompiledLifecycle, steps: Iterable[Step]) -> str | None:
    """Drive a table record and a machine-instance record through ``steps``.

    Both start in the initial state with a recording owner each. Before each event the same
    data is applied to both records. Returns a description of the first disagreement (accept
    vs reject, state after the event, or owner calls made), or None when they agree
    throughout. The table side dispatches through ``lc.fire``, so ``lc`` should not be in
    checked mode.
    """
    t_owner, m_owner = RecordingOwner(), RecordingOwner()
    t_rec, m_rec = new_record(lc, t_owner), new_record(lc, m_owner)
    lc.attach(t_rec)
    sm = lc.machine(model=m_rec, state_field="_shadow")
    for i, (data, event) in enumerate(steps):
        apply_data(t_rec, data)
        apply_data(m_rec, data)
        before = lc.states[t_rec.state]
        try:
            lc.fire(t_rec, lc.event_index[event])
            t_ok = True
        except LifecycleError:
            t_ok = False
        try:
            sm.send(event)
            m_ok = True
        except TransitionNotAllowed:
            m_ok = False
        where = f"step {i}: {event!r} from {before!r} with {data!r}"
        if t_ok != m_ok:
            return f"{where}: table {'accepts' if t_ok else 'rejects'}, machine " + (
                "accepts" if m_ok else "rejects"
            )
        t_state = lc.states[t_rec.state]
        if t_state != m_rec._shadow:
            return f"{where}: table -> {t_state!r}, machine -> {m_rec._shadow!r}"
        if t_owner.calls != m_owner.calls:
            return f"{where}: table calls {t_owner.calls!r}, machine calls {m_owner.calls!r}"
    return None


# ---------------------------------------------------------------------------------------------
# Guard witnesses and shortest paths (transition coverage)

WITNESSES: dict[str, dict[str, Any]] = {
    # request guards
    "has_jobs": {"jobs": {1}},
    "no_jobs": {"jobs": set()},
    # job guards
    "outstanding": {"pending": 1, "failed": 0},
    "all_ok": {"pending": 0, "failed": 0},
    "any_failed": {"pending": 0, "failed": 1},
    "drained": {"pending": 0, "failed": 0},
    "carries_over": {"is_store": False, "sent": True},
    "dropped_at_reset": {"is_store": True},
}
"""For each guard function (by name), record data that makes it true."""

NEGATIVE_WITNESSES: dict[str, dict[str, Any]] = {
    "has_jobs": {"jobs": set()},
    "no_jobs": {"jobs": {1}},
    "outstanding": {"pending": 0},
    "all_ok": {"pending": 1},
    "any_failed": {"pending": 1},
    "drained": {"pending": 1},
    "carries_over": {"is_store": True},
    "dropped_at_reset": {"is_store": False, "sent": True},
}
"""For each guard function, record data that makes it false (for ``unless=`` guards)."""


class MissingWitness(LookupError):
    """A guard has no entry in the witness tables: add one to cover its transitions."""


def witness(t: TransitionInfo) -> dict[str, Any]:
    """Data that satisfies every guard of ``t``."""
    data: dict[str, Any] = {}
    for func, expected in t.guards:
        table = WITNESSES if expected else NEGATIVE_WITNESSES
        try:
            data.update(table[func.__name__])
        except KeyError:
            kind = "witness" if expected else "negative witness"
            raise MissingWitness(f"guard {func.__name__!r} has no {kind}") from None
    return data


def selected(lc: CompiledLifecycle, rec: Any, state: str, event: str) -> TransitionInfo | None:
    """The transition the machine definition selects: first declared whose guards all hold."""
    for t in lc.transitions:
        if t.source == state and t.event == event and all(bool(f(rec)) is e for f, e in t.guards):
            return t
    return None


@dataclass(frozen=True)
class PathStep:
    """One planned step: set ``data``, send ``transition.event``, expect ``transition``."""

    data: dict[str, Any]
    transition: TransitionInfo


@dataclass
class Plan:
    """Shortest event paths to the transitions of one lifecycle."""

    lc: CompiledLifecycle
    to_state: dict[str, list[TransitionInfo]] = field(default_factory=dict)

    def path_to(self, t: TransitionInfo) -> list[PathStep] | None:
        """The shortest path ending with ``t``, or None if its source is unreachable."""
        prefix = self.to_state.get(t.source)
        if prefix is None:
            return None
        return [PathStep(witness(s), s) for s in [*prefix, t]]


def plan(lc: CompiledLifecycle) -> Plan:
    """Breadth-first search over the transition graph from the initial state.

    Edges are transitions (every guard is assumed satisfiable through its witness; the walk
    checks that it is). ``to_state[s]`` is a shortest transition sequence reaching ``s``.
    """
    start = lc.states[lc.initial]
    result = Plan(lc, {start: []})
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for t in lc.transitions:
            if t.source == state and t.target not in result.to_state:
                result.to_state[t.target] = [*result.to_state[state], t]
                queue.append(t.target)
    return result


def walk(
    lc: CompiledLifecycle,
    steps: Sequence[PathStep],
    fire: Callable[[Any, int], None] | None = None,
    on_step: Callable[[TransitionInfo], None] | None = None,
) -> list[tuple[Any, ...]]:
    """Walk ``steps`` on a fresh record, asserting the planned transition and state each step.

    Uses ``lc.attach`` (so in checked mode the record gets a machine) and ``fire`` (default:
    ``lc.fire``). Returns the owner calls made along the way.
    """
    owner = RecordingOwner()
    rec = new_record(lc, owner)
    lc.attach(rec)
    dispatch = lc.fire if fire is None else fire
    for i, step in enumerate(steps):
        t = step.transition
        apply_data(rec, step.data)
        state = lc.states[rec.state]
        assert state == t.source, f"step {i}: expected to be in {t.source!r}, in {state!r}"
        chosen = selected(lc, rec, state, t.event)
        assert chosen is t, (
            f"step {i}: witness {step.data!r} selects {chosen!r} instead of {t!r}: "
            "an earlier-declared transition wins; adjust the witness tables"
        )
        dispatch(rec, lc.event_index[t.event])
        after = lc.states[rec.state]
        assert after == t.target, f"step {i}: {t.event!r} led to {after!r}, not {t.target!r}"
        if on_step is not None:
            on_step(t)
    return owner.calls


LIFECYCLES: dict[str, CompiledLifecycle] = {"request": REQUEST, "job": JOB}
