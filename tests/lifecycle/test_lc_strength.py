"""Lifecycle compilation refuses what it cannot run fast (a sampled mutation run found the
action check unasserted): a guard or an action given by name, not as a function."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from statemachine import State, StateMachine

from statecore.lifecycle.table import compile_lifecycle


def _ok(*_args: object, **_kwargs: object) -> bool:
    return True


class _NamedAction(StateMachine):
    idle = State(initial=True)
    busy = State(final=True)

    start = idle.to(busy, on="do_start")

    def do_start(self) -> None:
        """A method: python-statemachine resolves the name; the table cannot."""


class _NamedGuard(StateMachine):
    idle = State(initial=True)
    busy = State(final=True)

    start = idle.to(busy, cond="can_start")

    def can_start(self) -> bool:
        return True


class _Functions(StateMachine):
    idle = State(initial=True)
    busy = State(final=True)

    start = idle.to(busy, cond=_ok, on=_ok)


def test_action_given_by_name_is_refused_at_compile_time() -> None:
    with pytest.raises(TypeError, match=r"_NamedAction: action 'do_start' must be callable"):
        compile_lifecycle(_NamedAction, "thing", "thing_id")


def test_guard_given_by_name_is_refused_at_compile_time() -> None:
    with pytest.raises(TypeError, match=r"_NamedGuard: guard 'can_start' of idle->busy"):
        compile_lifecycle(_NamedGuard, "thing", "thing_id")


def test_functions_compile() -> None:
    table = compile_lifecycle(_Functions, "thing", "thing_id")
    assert [(t.event, t.source, t.target, t.actions) for t in table.transitions] == [
        ("start", "idle", "busy", (_ok,))
    ]


def _a(rec: Any) -> bool:
    return bool(rec.a)


def _b(rec: Any) -> bool:
    return bool(rec.b)


class _TwoGuards(StateMachine):
    idle = State(initial=True)
    busy = State(final=True)

    start = idle.to(busy, cond=[_a, _b])


@pytest.mark.parametrize(
    ("a", "b", "allowed"), [(True, True, True), (True, False, False), (False, True, False)]
)
def test_a_transition_with_two_guards_needs_both(a: bool, b: bool, allowed: bool) -> None:
    # the one-guard shortcut of the compiler must not drop the second guard
    table = compile_lifecycle(_TwoGuards, "thing", "thing_id")
    rec = SimpleNamespace(state=table.state_index["idle"], a=a, b=b, thing_id="t")
    assert table.accepts(rec, table.events.index("start")) is allowed


class _Unless(StateMachine):
    idle = State(initial=True)
    busy = State(final=True)

    start = idle.to(busy, unless=_a)


@pytest.mark.parametrize(("a", "allowed"), [(True, False), (False, True)])
def test_a_transition_with_one_negated_guard_needs_it_false(a: bool, allowed: bool) -> None:
    # the one-guard shortcut applies to a plain guard only: an `unless` guard is negated
    table = compile_lifecycle(_Unless, "thing", "thing_id")
    assert [t.guard_text for t in table.transitions] == ["not _a"]
    rec = SimpleNamespace(state=table.state_index["idle"], a=a, thing_id="t")
    assert table.accepts(rec, table.events.index("start")) is allowed
