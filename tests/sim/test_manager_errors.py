"""The manager-error fault (INV-MGR-ERROR) of the simulator, the fuzzers and the model checker.

The simulator's :class:`~statecore.sim.engine.ObservedManager` applies a completion and then
raises (typed or untyped); the engine checks every ``update_connector_output`` during which
that happened with :func:`statecore.specs.invariants.manager_error_violation`. These tests pin
the fault, the oracle's every clause, both seeded mutants on a fixed scenario, and the harness
finding made on the way (a stalled load's finish reported one call late).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from statecore.errors import InvariantViolation, ManagerError
from statecore.keys import make_offload_key
from statecore.manager import ReqContext
from statecore.managers.cpu import CPUOffloadingManager
from statecore.scheduler import OffloadingScheduler
from statecore.sim.engine import (
    InjectedManagerBug,
    InjectedManagerError,
    InjectedManagerFault,
    ObservedManager,
    SimConfig,
)
from statecore.sim.run import build_stack, simulate
from statecore.sim.workload import WorkloadConfig
from statecore.specs.invariants import (
    manager_error_violation,
    raised_by_injection,
    shutdown_error_violation,
)
from statecore.specs.stack import MANAGER_ERROR_TARGETS, StackHarness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mutants"))
from catalogue import MUTANTS

KEY = make_offload_key(b"\x01" * 8, 0)


def _stored(m: Any, ctx: ReqContext) -> None:
    out = m.prepare_store([KEY], ctx)
    assert out is not None and list(out.keys_to_store) == [KEY]


@pytest.mark.parametrize("kind", ["typed", "untyped"])
def test_observed_manager_applies_the_completion_then_raises(kind: str) -> None:
    cpu = CPUOffloadingManager(4)
    obs = ObservedManager(cpu)
    ctx = ReqContext("r1")
    _stored(obs, ctx)
    obs.fail_next = kind
    with pytest.raises(InjectedManagerError if kind == "typed" else InjectedManagerBug):
        obs.complete_store([KEY], ctx, True)
    assert cpu.is_ready(KEY), "the manager applied the completion before the error"
    assert obs.fail_next is None and obs.injected_total == 1
    (inj,) = obs.injected
    assert (inj.call, inj.req_id, inj.is_store, inj.keys) == ("complete_store", "r1", True, (KEY,))
    assert isinstance(inj.error, ManagerError) == (kind == "typed")
    obs.prepare_load([KEY], ctx)
    obs.complete_load([KEY], ctx)  # unarmed and no rate: forwards only
    assert obs.injected_total == 1


def test_observed_manager_draws_its_rate_from_its_own_stream() -> None:
    cpu = CPUOffloadingManager(4)
    obs = ObservedManager(cpu, random.Random(3), 1.0)
    ctx = ReqContext("r1")
    _stored(cpu, ctx)
    with pytest.raises((InjectedManagerError, InjectedManagerBug)):
        obs.complete_store([KEY], ctx, False)
    with pytest.raises((InjectedManagerError, InjectedManagerBug)):
        obs.prepare_store([KEY], ctx)
    assert obs.injected_total == 2


def _inj(error: Exception, call: str = "complete_store") -> InjectedManagerFault:
    return InjectedManagerFault(error, call, "r1", (KEY,))


def _job(is_store: bool = True) -> Any:
    return SimpleNamespace(is_store=is_store, keys=[KEY])


def _none(rid: str) -> list[Any]:
    return []


def test_oracle_accepts_what_the_contract_says() -> None:
    typed, bug = InjectedManagerError("x"), InjectedManagerBug("y")
    assert manager_error_violation([], None, 0, False, _none) is None
    # typed, unchecked: counted, not raised
    assert manager_error_violation([_inj(typed)], None, 1, False, _none) is None
    # typed, checked: raised as it is
    assert manager_error_violation([_inj(typed)], typed, 1, True, _none) is None
    # untyped: raised as a ManagerError naming it as its cause, in either mode
    wrapped = ManagerError("job 3: complete_store raised")
    wrapped.__cause__ = bug
    for checked in (False, True):
        assert manager_error_violation([_inj(bug)], wrapped, 1, checked, _none) is None
    assert raised_by_injection(wrapped, [_inj(bug)]) and not raised_by_injection(None, [])


@pytest.mark.parametrize(
    ("injected", "raised", "counted", "checked", "live", "problem"),
    [
        ("typed", None, 0, False, False, "the scheduler counted 0"),
        ("typed", None, 1, False, True, "is still in flight"),
        ("typed", None, 1, True, False, "raised nothing"),
        ("bug", None, 1, False, False, "raised nothing"),
        ("bug", "bug", 1, False, False, "let it out untyped"),
        ("typed", "typed", 1, False, False, "raised in unchecked mode"),
    ],
)
def test_oracle_names_each_breach(
    injected: str, raised: str | None, counted: int, checked: bool, live: bool, problem: str
) -> None:
    errors = {"typed": InjectedManagerError("x"), "bug": InjectedManagerBug("y")}
    bad = manager_error_violation(
        [_inj(errors[injected])],
        errors[raised] if raised else None,
        counted,
        checked,
        (lambda rid: [_job()]) if live else _none,
    )
    assert bad is not None and bad.startswith("INV-MGR-ERROR") and problem in bad, bad


def test_oracle_matches_a_live_job_by_direction_and_keys() -> None:
    inj = [_inj(InjectedManagerError("x"))]
    assert manager_error_violation(inj, None, 1, False, lambda rid: [_job(False)]) is None
    # a prepare_store that raised made no job: a live store of those keys is another one's
    inj = [_inj(InjectedManagerError("x"), "prepare_store")]
    assert manager_error_violation(inj, None, 1, False, lambda rid: [_job()]) is None


@pytest.mark.parametrize("kind", ["typed", "untyped"])
def test_observed_manager_fails_a_prepare_store_before_it_changes_anything(kind: str) -> None:
    cpu = CPUOffloadingManager(4)
    obs = ObservedManager(cpu)
    obs.fail_next = kind
    with pytest.raises(InjectedManagerError if kind == "typed" else InjectedManagerBug):
        obs.prepare_store([KEY], ReqContext("r1"))
    assert cpu.counters().keys == 0 and obs.injected[0].call == "prepare_store"
    assert not obs.injected[0].completion


def _target(call: str) -> int:
    """The ``i >> 1`` of :meth:`StackHarness.manager_error` that arms ``call``."""
    return MANAGER_ERROR_TARGETS.index(frozenset({call}))


def _counted_once(call: str, kind: int, checked: bool, when: str = "start") -> StackHarness:
    """:func:`_scenario` with one error of ``call`` armed: it was injected once, counted once,
    and the stack drained with every invariant holding (the caller checks what else)."""
    h = _scenario(kind | _target(call) << 1, checked, when)
    assert h.stack.observed.injected_by_call == {call: 1}
    assert h.stack.scheduler.counters.manager_errors == 1
    return h


def _served_request(steps: int) -> StackHarness:
    """One request, ``steps`` engine steps with every report delivered, then its finish (the
    setting of the tests that arm a fault by hand)."""
    h = StackHarness(StackHarness.config)
    h.new_request(0, 5, 1, False, False)
    for _ in range(steps):
        _step_delivered(h)
    h.finish(0)
    return h


def _step_delivered(h: StackHarness) -> None:
    h.step()
    while h.outstanding:
        h.deliver(0)


def _scenario(i: int, checked: bool = False, when: str = "start") -> StackHarness:
    """The manager's next call of the armed kind raises; requests look up, store, finish and
    come back with the same prefix; the stack drains. ``when``: the fault is armed after the
    first request arrived (``start``), before it arrives (``arrival``), or once its first
    store is in flight, followed by an operator's reset (``reset``)."""
    h = StackHarness(dataclasses.replace(StackHarness.config, checked=checked))
    if when == "arrival":
        h.manager_error(i)
    h.new_request(0, 5, 1, False, False)
    if when == "start":
        h.manager_error(i)
    elif when == "reset":
        h.step()
        assert h.stack.scheduler.jobs, "a store in flight when the reset comes"
        h.manager_error(i)
        h.reset_cache()
    h.check()
    for r in range(8):
        if r == 3:
            h.new_request(0, 5, 1, False, False)  # the prefix the first one stored
        h.step()
        h.check()
        while h.outstanding:
            h.deliver(0)
            h.check()
        h.finish(0)
        h.check()
    h.drain_and_check()
    return h


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_prepare_store_error_is_no_room_and_the_step_goes_on(kind: int, checked: bool) -> None:
    h = _counted_once("prepare_store", kind, checked)
    assert h.stack.scheduler.counters.jobs_completed > 0  # the offer was retried and stored


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_manager_error_mid_completion_ends_the_job(kind: int, checked: bool) -> None:
    h = _scenario(kind, checked)
    assert sum(h.stack.observed.injected_by_call.values()) == 1
    assert "prepare_store" not in h.stack.observed.injected_by_call
    assert h.stack.scheduler.counters.manager_errors == 1


@pytest.mark.parametrize(
    ("mutant", "kind", "problem"),
    [
        ("manager_error_mid_completion", 1, "still in flight"),
        ("manager_errors_swallowed", 0, "counted 0"),
        ("manager_errors_swallowed", 1, "raised nothing"),
    ],
)
def test_the_seeded_mutants_break_the_scenario(mutant: str, kind: int, problem: str) -> None:
    with MUTANTS[mutant].apply(), pytest.raises(InvariantViolation, match=problem):
        _scenario(kind)


def test_a_stalled_load_reported_a_call_late_is_explained() -> None:
    """Found by the fuzzer with the new fault: a load stalls in a call that raises (the
    manager's complete_load), so its finish, blocks invalid, comes with the next call, in
    which its late reports also arrive and the stall ledger forgets it. The engine once took
    that for a load invalidated for no reason."""
    h = StackHarness()
    h.new_request(system=0, extra=0, out=1, skip=True, follow=False)
    h.step()
    h.step()
    h.new_request(system=0, extra=7, out=1, skip=False, follow=True)
    h.deliver(178)
    for _ in range(3):
        h.step()
    h.deliver(8)
    h.deliver(8)
    h.new_request(system=1, extra=6, out=1, skip=False, follow=False)
    h.deliver(110)
    h.new_request(system=0, extra=1, out=2, skip=False, follow=True)
    h.step()
    h.new_request(system=1, extra=0, out=1, skip=False, follow=False)
    h.preempt(178)
    h.manager_error(1)  # untyped, the next completion
    h.deliver(0)
    h.advance_clock()
    h.check()
    assert h.stack.scheduler.counters.manager_errors == 1
    assert h.stack.scheduler.counters.jobs_stalled >= 1
    h.drain_and_check()


def test_the_default_run_injects_manager_errors() -> None:
    cfg = dataclasses.replace(SimConfig(), steps=1500, workload=WorkloadConfig(num_requests=300))
    rep = simulate(cfg)
    assert rep.ok, rep.format_text()
    fc = rep.faults["manager_error"]
    assert fc.injected > 0 and fc.observed == fc.injected


TOLERATED_CALLS = (
    "lookup_many",
    "on_schedule_end",
    "on_request_finished",
    "take_events",
    "get_stats",
    "has_pending_work",
)
"""Calls whose error changes nothing but that call's answer (see the test below)."""


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("call", TOLERATED_CALLS)
def test_an_error_that_changes_only_the_calls_answer_is_tolerated(
    call: str, kind: int, checked: bool
) -> None:
    """A lookup that raises answers no hit, a schedule end that raises lets the step go on, a
    finish that raises is taken as delivered, a take of events or stats that raises gives
    nothing (or the scheduler's own stats) that time and the rest with the next take, a
    question about pending work that raises is answered as none; each counted and raised as
    the contract says (the engine's oracle checks that at the next update_connector_output),
    and no event is lost (INV-EVENTS held throughout, none is held back at the end)."""
    h = _counted_once(call, kind, checked)
    assert not h.stack.observed.events_held_back


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize(
    ("mutant", "call", "when"),
    [
        ("prepare_store_error_escapes", "prepare_store", "start"),
        ("lookup_and_signal_errors_escape", "lookup_many", "start"),
        ("lookup_and_signal_errors_escape", "on_schedule_end", "start"),
        ("lookup_and_signal_errors_escape", "on_request_finished", "start"),
        ("reset_error_escapes", "reset_cache", "reset"),
        ("new_request_error_escapes", "on_new_request", "arrival"),
        ("take_events_error_escapes", "take_events", "start"),
        ("get_stats_error_escapes", "get_stats", "start"),
        ("pending_work_error_escapes", "has_pending_work", "start"),
        ("shutdown_error_escapes", "shutdown", "start"),
    ],
)
def test_a_mutant_that_lets_the_calls_error_escape_breaks_the_scenario(
    mutant: str, call: str, when: str, kind: int
) -> None:
    with MUTANTS[mutant].apply(), pytest.raises(InvariantViolation):
        _scenario(kind | _target(call) << 1, when=when)


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_failed_manager_reset_is_retried_and_nothing_leaks(kind: int, checked: bool) -> None:
    sched = _counted_once("reset_cache", kind, checked, "reset").stack.scheduler
    assert sched.counters.resets == 1
    # the retry dropped the discarded store's write-pending key (INV-TERM: it gets no
    # completion); drain_and_check found nothing left behind
    assert not sched.manager_reset_pending


def test_no_lookup_hits_while_the_manager_reset_is_pending() -> None:
    h = _served_request(3)
    h.step()
    sched = h.stack.scheduler
    obs = h.stack.observed
    obs.fail_next, obs.fail_calls = "typed", frozenset({"reset_cache"})
    assert sched.reset_cache() is False and sched.manager_reset_pending
    held = h.stack.manager.counters().keys
    assert held, "the manager kept its chunks: its reset raised"
    hits_before = sched.counters.lookup_hit_tokens
    h.new_request(0, 5, 1, False, False)  # the same prefix: a hit, were the manager trusted
    r = h.engine.waiting[-1]
    assert sched.get_num_new_matched_tokens(r.req, 0) == (0, False)
    assert sched.counters.lookup_hit_tokens == hits_before
    h.step()  # build_connector_meta retries the manager's reset first
    assert not sched.manager_reset_pending and sched.reset_cache() is True


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_failed_registration_is_retried_at_the_next_lookup(kind: int, checked: bool) -> None:
    h = _counted_once("on_new_request", kind, checked, "arrival")
    assert h.stack.scheduler.counters.jobs_completed > 0  # registered at its lookup, then stored


def test_an_unregistered_request_is_never_offered_nor_finished_to_the_manager() -> None:
    calls: list[str] = []

    h = StackHarness(StackHarness.config)
    obs = h.stack.observed

    def refuse(ctx: ReqContext) -> Any:
        calls.append("on_new_request")
        exc = ManagerError(f"request {ctx.req_id!r}: no room for another request")
        # the test's fault: attributed as injected (INV-MGR-ERROR), not caused by the system
        obs.injected.append(InjectedManagerFault(exc, "on_new_request", ctx.req_id, ()))
        raise exc

    obs.on_new_request = refuse
    inner = obs._inner
    for name in ("prepare_store", "lookup_many", "on_request_finished"):
        real = getattr(inner, name)

        def spy(*a: Any, _n: str = name, _r: Any = real) -> Any:
            calls.append(_n)
            return _r(*a)

        setattr(inner, name, spy)
    h.new_request(0, 5, 1, False, False)
    for _ in range(4):
        _step_delivered(h)
    h.finish(0)
    h.step()
    h.drain_and_check()
    # retried at its lookup and at each store it could have made, never anything else
    assert set(calls) == {"on_new_request"} and len(calls) >= 2
    assert h.stack.scheduler.counters.manager_errors == len(calls)


def test_events_held_back_by_an_error_come_with_the_next_take() -> None:
    h = StackHarness(StackHarness.config)
    sched, obs = h.stack.scheduler, h.stack.observed
    h.new_request(0, 5, 1, False, False)
    while not sched.counters.jobs_completed:  # every take raises until the store completed
        obs.fail_next, obs.fail_calls = "typed", frozenset({"take_events"})
        _step_delivered(h)
    announced = h.engine._announced
    assert obs.events_held_back and not announced  # the stored event waits in the manager
    h.check()  # its take succeeds: INV-EVENTS holds, one take late
    assert not obs.events_held_back and announced == set(h.engine.cpu_ready_keys()) != set()
    assert sched.counters.manager_errors == obs.injected_by_call["take_events"] >= 1


def test_a_raising_has_pending_work_answers_false_only_when_nothing_of_the_schedulers_waits() -> (
    None
):
    h = StackHarness(StackHarness.config)
    sched, obs = h.stack.scheduler, h.stack.observed
    h.new_request(0, 5, 1, False, False)
    h.step()
    assert sched.jobs  # a store in flight: the manager is not asked
    obs.fail_next, obs.fail_calls = "typed", frozenset({"has_pending_work"})
    assert sched.has_pending_push_work() is True and not obs.injected
    obs.fail_next = None
    while h.outstanding:
        h.deliver(0)
    h.finish(0)
    for _ in range(4):
        _step_delivered(h)
    assert not sched.jobs and not sched.has_pending_push_work()  # nothing left: False
    obs.fail_next, obs.fail_calls = "typed", frozenset({"has_pending_work"})
    assert sched.has_pending_push_work() is False  # the manager asked, and raised
    assert obs.injected_by_call == {"has_pending_work": 1}
    assert sched.counters.manager_errors == 1
    h.drain_and_check()


def test_the_managers_stats_come_with_the_next_call() -> None:
    h = StackHarness(StackHarness.config)
    sched, obs = h.stack.scheduler, h.stack.observed
    whole = set(sched.get_stats())
    obs.fail_next, obs.fail_calls = "typed", frozenset({"get_stats"})
    own = set(sched.get_stats())
    assert "live_jobs" in own and own < whole  # the manager's part is missing this time
    assert set(sched.get_stats()) == whole and sched.counters.manager_errors == 1


def test_shutdown_oracle_accepts_what_the_contract_says() -> None:
    typed, bug = InjectedManagerError("x"), InjectedManagerBug("y")
    assert shutdown_error_violation(None, None, 0) is None
    assert shutdown_error_violation(_inj(typed, "shutdown"), typed, 1) is None
    wrapped = ManagerError("the manager's shutdown raised InjectedManagerBug: y")
    wrapped.__cause__ = bug
    assert shutdown_error_violation(_inj(bug, "shutdown"), wrapped, 1) is None


@pytest.mark.parametrize(
    ("injected", "raised", "counted", "problem"),
    [
        (None, "typed", 0, "with no manager error"),
        (None, None, 1, "counted 1 manager errors with none raised"),
        ("typed", None, 1, "raised nothing"),
        ("typed", "typed", 0, "the scheduler counted 0"),
        ("typed", "other", 1, "instead of the typed error itself"),
        ("bug", "bug", 1, "let it out untyped"),
        ("bug", "other", 1, "without the manager's error as its cause"),
    ],
)
def test_shutdown_oracle_names_each_breach(
    injected: str | None, raised: str | None, counted: int, problem: str
) -> None:
    errors: dict[str, Exception] = {
        "typed": InjectedManagerError("x"),
        "bug": InjectedManagerBug("y"),
        "other": ManagerError("z"),
    }
    bad = shutdown_error_violation(
        _inj(errors[injected], "shutdown") if injected else None,
        errors[raised] if raised else None,
        counted,
    )
    assert bad is not None and bad.startswith("INV-MGR-ERROR") and problem in bad, bad


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_manager_shutdown_error_reaches_the_engine_typed_and_counted(
    kind: int, checked: bool
) -> None:
    """The fault armed early waits for the run's last call: drain_and_check shuts down under
    the oracle (a ManagerError, the typed error itself or the untyped one as its cause,
    counted once), whatever the mode."""
    _counted_once("shutdown", kind, checked)


@pytest.mark.parametrize("kind", ["typed", "untyped"])
def test_the_simulator_shuts_down_under_the_oracle(kind: str) -> None:
    """The simulator's engine ends a run with the connector's shutdown, checked: clean on the
    scheduler as it is, a violation under the mutant that lets the error out bare."""
    cfg = dataclasses.replace(SimConfig(), steps=30, workload=WorkloadConfig(num_requests=4))
    for mutant in (None, "shutdown_error_escapes"):
        stack, engine = build_stack(cfg)
        try:
            engine.run()
            stack.observed.fail_next, stack.observed.fail_calls = kind, frozenset({"shutdown"})
            if mutant is None:
                engine.shutdown()
            else:
                with MUTANTS[mutant].apply():
                    engine.shutdown()
        finally:
            stack.shut_down = True
            stack.close()
        assert stack.observed.injected_by_call.get("shutdown") == 1
        found = [v for v in engine.stats.violations if "shutdown" in v]
        if mutant is None:
            assert not engine.stats.violations, engine.stats.violations
        else:
            assert found and "INV-MGR-ERROR" in found[0], engine.stats.violations


def _reset_retried_twice(h: StackHarness) -> None:
    """A running request stores its chunks; the operator's reset fails, and so does its retry
    by the next step (a step in which the manager's reset is still pending), which the step
    after that retries successfully; then the request finishes."""
    reset = 2 * MANAGER_ERROR_TARGETS.index(frozenset({"reset_cache"}))
    h.new_request(system=0, extra=6, out=6, skip=False, follow=False)
    for _ in range(2):
        h.step()
        h.check()
    for _ in range(4):
        h.deliver(0)
    h.manager_error(reset)
    h.reset_cache()
    h.check()
    h.manager_error(reset)
    h.step()  # the retry fails: the manager is still to be reset
    h.check()
    for _ in range(4):
        h.deliver(0)
    h.step()  # the retry goes through
    h.check()
    h.finish(0)
    h.step()
    h.check()
    h.drain_and_check()


def test_offers_wait_for_a_pending_manager_reset() -> None:
    """While the manager's reset is pending nothing is offered to it: what it took would be
    dropped by the retry behind the request's store cursors, a hole no prefix gets past
    (INV-STORE-COMPLETE). Found by the reset clause of INV-STORE-COMPLETE."""
    _reset_retried_twice(StackHarness())
    with pytest.raises(InvariantViolation, match="INV-STORE-COMPLETE"):
        real = OffloadingScheduler._build_store_jobs

        def offering(self: OffloadingScheduler, rec: Any, jobs: Any, finished: bool) -> None:
            pending, self._manager_reset_pending = self._manager_reset_pending, False
            try:  # the old behaviour: offers go to the manager whose reset is pending
                real(self, rec, jobs, finished)
            finally:
                self._manager_reset_pending = pending

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(OffloadingScheduler, "_build_store_jobs", offering)
            _reset_retried_twice(StackHarness())
