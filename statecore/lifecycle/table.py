"""Compile a python-statemachine class into a flat dispatch table.

One python-statemachine instance costs about 190 us and 35 KB to build and tens of us per
event, far too much for thousands of jobs per engine step. :func:`compile_lifecycle` reads a
machine class once (states, events, transitions in declaration order, guard and action
callables) and builds a table indexed by small integers. Dispatch is then a tuple lookup, the
guard calls and an attribute store.

Records dispatched through a :class:`CompiledLifecycle` hold their state as an ``int`` in
``state``; in checked mode they also carry a real machine instance in ``_sm`` (its state in
``_shadow``), and every event runs through both: the table decides, the machine runs the
actions, and any disagreement raises :class:`~statecore.errors.InvariantViolation`
(``INV-TABLE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from statecore.errors import InvariantViolation, LifecycleError

__all__ = ["CompiledLifecycle", "TransitionInfo", "checked_mode", "compile_lifecycle"]

Guard = Callable[[Any], bool]
Action = Callable[[Any], None]
_Row = tuple[tuple[Guard | None, int, tuple[Action, ...]], ...]


@dataclass(frozen=True, slots=True)
class TransitionInfo:
    """One transition as declared in the machine class (for docs, tests and coverage).

    Attributes:
        event: the event name.
        source: source state id.
        target: target state id.
        guards: ``(function, expected)`` pairs; ``expected`` is False for ``unless=``.
        actions: the action functions, in call order.
        internal: a self-transition that runs no exit/entry (the state does not change).
    """

    event: str
    source: str
    target: str
    guards: tuple[tuple[Guard, bool], ...]
    actions: tuple[Action, ...]
    internal: bool

    @property
    def guard_text(self) -> str:
        """The guard as text: ``a and not b``, or empty."""
        return " and ".join(f.__name__ if e else f"not {f.__name__}" for f, e in self.guards)


def _combine(guards: tuple[tuple[Guard, bool], ...]) -> Guard | None:
    if not guards:
        return None
    if len(guards) == 1 and guards[0][1]:
        return guards[0][0]

    def guard(rec: Any) -> bool:
        return all(bool(f(rec)) is e for f, e in guards)

    return guard


class CompiledLifecycle:
    """The dispatch table of one lifecycle machine class.

    Attributes:
        entity: what the records are (``"request"``, ``"job"``), for error messages.
        machine: the python-statemachine class it was compiled from.
        states: state ids; a record's ``state`` indexes it.
        events: event ids; the ``EV_*``-style integers passed to :meth:`fire` index it.
        transitions: every transition in declaration order.
        initial: the index of the initial state.
        final: indices of final states.
    """

    def __init__(self, machine: type[StateMachine], entity: str, id_attr: str) -> None:
        self.entity = entity
        self.machine = machine
        self.id_attr = id_attr
        self.states: tuple[str, ...] = tuple(s.id for s in machine.states)
        self.events: tuple[str, ...] = tuple(e.id for e in machine.events)  # type: ignore[attr-defined]
        self.state_index = {s: i for i, s in enumerate(self.states)}
        self.event_index = {e: i for i, e in enumerate(self.events)}
        self.initial = next(i for i, s in enumerate(machine.states) if s.initial)
        self.final = frozenset(i for i, s in enumerate(machine.states) if s.final)
        self.transitions: tuple[TransitionInfo, ...] = tuple(self._read_transitions())
        n_ev = len(self.events)
        rows: list[list[tuple[Guard | None, int, tuple[Action, ...]]]] = [
            [] for _ in range(len(self.states) * n_ev)
        ]
        for t in self.transitions:
            src = self.state_index[t.source]
            rows[src * n_ev + self.event_index[t.event]].append(
                (_combine(t.guards), self.state_index[t.target], t.actions)
            )
        self._rows: tuple[_Row, ...] = tuple(tuple(r) for r in rows)
        self._n_ev = n_ev
        self.checked = False
        self.fire: Callable[[Any, int], None] = self._fire_fast

    def _read_transitions(self) -> Iterator[TransitionInfo]:
        for state in self.machine.states:
            for t in state.transitions:
                guards: list[tuple[Guard, bool]] = []
                for spec in t.cond:
                    if not callable(spec.func):
                        raise TypeError(
                            f"{self.machine.__name__}: guard {spec.func!r} of "
                            f"{t.source.id}->{t.target.id} must be a function, not a name"
                        )
                    guards.append((spec.func, spec.expected_value is not False))
                actions = tuple(spec.func for spec in t.on if not spec.is_convention)
                for a in actions:
                    if not callable(a):
                        raise TypeError(f"{self.machine.__name__}: action {a!r} must be callable")
                for event in t.events:
                    yield TransitionInfo(
                        event=event.id,
                        source=t.source.id,
                        target=t.target.id,
                        guards=tuple(guards),
                        actions=actions,
                        internal=bool(t.internal),
                    )

    # -- dispatch ------------------------------------------------------------------------------

    def _fire_fast(self, rec: Any, event: int) -> None:
        for guard, target, actions in self._rows[rec.state * self._n_ev + event]:
            if guard is None or guard(rec):
                rec.state = target
                for action in actions:
                    action(rec)
                return
        raise self._rejected(rec, event)

    def choose(self, rec: Any, event: int) -> int | None:
        """The target state index ``event`` would lead to, or None if rejected. No effect."""
        for guard, target, _ in self._rows[rec.state * self._n_ev + event]:
            if guard is None or guard(rec):
                return int(target)
        return None

    def accepts(self, rec: Any, event: int) -> bool:
        """Whether ``event`` is allowed for ``rec`` now (guards evaluated, nothing changes)."""
        return self.choose(rec, event) is not None

    def require(self, rec: Any, event: int) -> None:
        """Raise :class:`LifecycleError` unless ``event`` is allowed for ``rec`` now."""
        if self.choose(rec, event) is None:
            raise self._rejected(rec, event)

    def _rejected(self, rec: Any, event: int) -> LifecycleError:
        return LifecycleError(
            self.entity, getattr(rec, self.id_attr, "?"), self.states[rec.state], self.events[event]
        )

    def state_name(self, rec: Any) -> str:
        """The state id of ``rec``."""
        return self.states[int(rec.state)]

    def is_in(self, rec: Any, state: str) -> bool:
        """Whether ``rec`` is in state ``state``."""
        return bool(rec.state == self.state_index[state])

    # -- checked mode --------------------------------------------------------------------------

    def attach(self, rec: Any) -> None:
        """Give ``rec`` its initial state (and, in checked mode, a real machine beside it)."""
        rec.state = self.initial
        if self.checked:
            rec._sm = self.machine(model=rec, state_field="_shadow")

    def _fire_checked(self, rec: Any, event: int) -> None:
        sm = getattr(rec, "_sm", None)
        if sm is None:  # created before checked mode was switched on
            rec._shadow = self.states[rec.state]
            sm = rec._sm = self.machine(model=rec, state_field="_shadow", start_value=rec._shadow)
        if rec._shadow != self.states[rec.state]:
            raise InvariantViolation(
                "INV-TABLE",
                f"{self.entity} {getattr(rec, self.id_attr, '?')!r}: table state "
                f"{self.states[rec.state]!r} but machine state {rec._shadow!r}",
            )
        target = self.choose(rec, event)
        name = self.events[event]
        if target is None:
            try:
                sm.send(name)
            except TransitionNotAllowed:
                raise self._rejected(rec, event) from None
            raise InvariantViolation(
                "INV-TABLE",
                f"{self.entity} {getattr(rec, self.id_attr, '?')!r}: table rejects {name!r} "
                f"in {self.states[rec.state]!r}, machine accepts it",
            )
        rec.state = target
        try:
            sm.send(name)  # runs the actions
        except TransitionNotAllowed:
            raise InvariantViolation(
                "INV-TABLE",
                f"{self.entity} {getattr(rec, self.id_attr, '?')!r}: table accepts {name!r}, "
                f"machine rejects it",
            ) from None
        if rec._shadow != self.states[target]:
            raise InvariantViolation(
                "INV-TABLE",
                f"{self.entity} {getattr(rec, self.id_attr, '?')!r}: on {name!r} table goes to "
                f"{self.states[target]!r}, machine to {rec._shadow!r}",
            )

    def set_checked(self, on: bool) -> None:
        """Switch checked mode on or off for this lifecycle."""
        self.checked = on
        self.fire = self._fire_checked if on else self._fire_fast


def compile_lifecycle(machine: type[StateMachine], entity: str, id_attr: str) -> CompiledLifecycle:
    """Compile ``machine`` into a :class:`CompiledLifecycle`."""
    return CompiledLifecycle(machine, entity, id_attr)


@contextlib.contextmanager
def checked_mode(*lifecycles: CompiledLifecycle) -> Iterator[None]:
    """Run every event of ``lifecycles`` through the real machines too (default: both)."""
    from statecore.lifecycle import JOB, REQUEST

    targets = lifecycles or (REQUEST, JOB)
    before = [lc.checked for lc in targets]
    for lc in targets:
        lc.set_checked(True)
    try:
        yield
    finally:
        for lc, was in zip(targets, before, strict=True):
            lc.set_checked(was)
