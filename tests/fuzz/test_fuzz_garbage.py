"""Garbage fuzzing: valid engine traffic mixed with arbitrary values at every public entry point.

:class:`GarbageMachine` extends the whole-stack machine
(:class:`statecore.specs.stack.StackMachine`: engine events, worker reports, faults, every
invariant after every rule, a drain and leak check at the end) with rules that call a public
entry point with one argument (or one field of an argument) replaced by garbage: ``None``,
wrong types, NaN and infinities, negative and huge numbers, bools where ints belong, int
subclasses whose comparisons lie and objects posing as ints, foreign
objects. Entry points: the six scheduler hooks and its
accessors, the CPU manager's API, each worker's per-step hooks, the wire and view types, the
configuration and key constructors.

For every garbage call:

* only :class:`~statecore.errors.StatecoreError` subclasses may escape;
* a rejected call leaves the observable state unchanged (scheduler records, indexes and
  counters, the manager's entries and counters, every worker), compared with snapshots taken
  before and after;
* garbage drawn from the must-reject pools is rejected; report entries that are documented
  tolerances (a count that is not a positive int, a job id never issued) are absorbed with
  only counters moving;
* every invariant holds afterwards (the machine's invariant), and the run drains clean.

Budget: a few examples in the default test command; the ``fuzz`` profile
(``STATECORE_HYPOTHESIS_PROFILE=fuzz``) runs a long campaign.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from statecore import (
    ConnectorMetadata,
    CPUPool,
    GroupConfig,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    WorkerMetadata,
    make_offload_key,
    validate,
    wire,
)
from statecore.errors import StatecoreError
from statecore.managers import CPUOffloadingManager
from statecore.specs.bad_inputs import (
    Foreign,
    IntPoser,
    LyingInt,
    observe_cpu,
    observe_scheduler,
    observe_worker,
)
from statecore.specs.stack import StackMachine
from statecore.wire import DirectionStats, TransferStats
from statecore.worker import OffloadingWorker, aggregate

FOREIGN = Foreign()
INT_BAD: list[Any] = [None, "7", 1.5, math.nan, math.inf, True, -1, -(2**63), FOREIGN, [3]]
"""Never a valid count, size or index (ints >= 0 only; bools are not ints)."""
NC_BAD: list[Any] = [*INT_BAD, 2**70]
"""Never a valid ``num_computed_tokens`` (also: beyond any request)."""
ID_BAD: list[Any] = [None, 5, 1.5, b"id", FOREIGN, ["r"], math.nan]
HASHES_BAD: list[Any] = [None, 5, 1.5, "abc", FOREIGN, math.nan]
FLAG_BAD: list[Any] = [None, "yes", 1, 0, 1.5, FOREIGN]
WRONG_GROUP_COUNT: Any = [[1], [2]]
"""Stands for one block list more than the stack has KV-cache groups (made at draw time: the
stack's groups are hybrid, so two lists can be a valid shape)."""
BLOCKS_BAD: list[Any] = [
    None,
    5,
    "x",
    b"\x01",
    [[None]],
    [[1.5]],
    [[-1]],
    WRONG_GROUP_COUNT,
    [FOREIGN],
    [[FOREIGN]],
    [["3"]],
    [[math.nan]],
    [[LyingInt(-2)]],
    [[4, IntPoser()]],
]
KEYS_BAD: list[Any] = [
    None,
    5,
    "abcdefgh",
    b"abcdefgh",
    [None],
    [1],
    ["abcdefgh"],
    [b"xy"],
    [FOREIGN],
    [make_offload_key(b"k" * 8, 0), None],
    FOREIGN,
]
OBJ_BAD: list[Any] = [None, 5, "x", 1.5, math.nan, FOREIGN, [1], (2,)]
FLOAT_BAD: list[Any] = [None, "1", math.nan, math.inf, -math.inf, -1, 0, True, FOREIGN]

_REQUEST_FIELDS: dict[str, list[Any]] = {
    "request_id": ID_BAD,
    "num_tokens": INT_BAD,
    "num_prompt_tokens": INT_BAD,
    "num_computed_tokens": INT_BAD,
    "block_hashes": HASHES_BAD,
    "skip_reading_prefix_cache": FLAG_BAD,
    "is_aborted": FLAG_BAD,
}


def _bad_meta(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Any:
    """A worker report whose shape is wrong (must be rejected whole)."""
    kind = draw(st.integers(0, 8))
    if kind == 0:
        return draw(st.sampled_from(OBJ_BAD[1:]))  # None is a valid "no report"
    if kind == 1:
        return WorkerMetadata(completed=draw(st.sampled_from(OBJ_BAD)))
    if kind == 2:
        return WorkerMetadata(failed=draw(st.sampled_from(OBJ_BAD)))
    if kind == 3:
        return WorkerMetadata(stats=draw(st.sampled_from(OBJ_BAD)))
    if kind == 4:
        return WorkerMetadata(
            stats=TransferStats(load=DirectionStats(seconds=draw(st.sampled_from(FLOAT_BAD[:6]))))
        )
    if kind == 5:
        return WorkerMetadata(
            stats=TransferStats(store=DirectionStats(bytes=draw(st.sampled_from(INT_BAD))))
        )
    if kind == 6:
        return WorkerMetadata(rank=draw(st.sampled_from([*INT_BAD[1:]])))
    if kind == 7:
        return WorkerMetadata(completed_ranks=draw(st.sampled_from(OBJ_BAD)))
    return WorkerMetadata(stats=TransferStats(load=draw(st.sampled_from(OBJ_BAD))))


class GarbageMachine(StackMachine):
    """The whole-stack machine plus garbage at every public entry point."""

    calls: ClassVar[dict[str, int]] = {"rejected": 0, "tolerated": 0}

    # -- helpers -------------------------------------------------------------------------------

    def _snapshot(self) -> tuple[Any, ...]:
        stack = self.h.stack
        mgr = stack.manager
        # observing asks the manager whether it has pending work: it must not spend a manager
        # fault the machine armed (the counter it moves would read as a change of state)
        obs = stack.observed
        armed, obs.fail_next = obs.fail_next, None
        try:
            return (
                observe_scheduler(stack.scheduler),
                observe_cpu(mgr) if isinstance(mgr, CPUOffloadingManager) else None,
                tuple(observe_worker(r.worker) for r in stack.ranks),
            )
        finally:
            obs.fail_next = armed

    def _unarmed(self, fn: Callable[[], object]) -> object:
        """``fn()`` with the machine's manager faults held back until it returns, for the
        next valid call: a fault armed and not spent yet (a garbage call that reaches the
        manager, as ``update_connector_output`` retrying a deferred ``on_new_request``, must
        not spend it), and a manager error the scheduler owes the next
        ``update_connector_output`` (raised by a call that went on; a garbage call must not
        deliver it). Either would read as the garbage's effect."""
        obs = self.h.stack.observed
        sched = self.h.stack.scheduler
        armed, obs.fail_next = obs.fail_next, None
        owed, sched._manager_failures = sched._manager_failures, []
        try:
            return fn()
        finally:
            obs.fail_next = armed
            sched._manager_failures = owed + sched._manager_failures

    def _reject(self, what: str, fn: Callable[[], object]) -> None:
        """``fn`` must raise a StatecoreError and change nothing."""
        before = self._snapshot()
        try:
            self._unarmed(fn)
        except StatecoreError:
            after = self._snapshot()
            assert after == before, f"{what}: rejected, but the state changed"
            GarbageMachine.calls["rejected"] += 1
            return
        except Exception as exc:
            raise AssertionError(f"{what}: untyped {type(exc).__name__}: {exc}") from exc
        raise AssertionError(f"{what}: garbage accepted")

    def _tolerate(self, what: str, fn: Callable[[], object]) -> None:
        """``fn`` is a documented tolerance: accepted, only counters move."""
        before = self._snapshot()
        try:
            self._unarmed(fn)
        except Exception as exc:
            raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}") from exc
        after = self._snapshot()
        strip = [dict(s[0], counters=None) for s in (before, after)]
        assert strip[0] == strip[1] and before[1:] == after[1:], f"{what}: state changed"
        GarbageMachine.calls["tolerated"] += 1

    def _real_request(self, i: int) -> Any:
        active = self.h._active()
        return active[i % len(active)].req if active else None

    def _bad_request(self, data: st.DataObject) -> Any:
        """A request view with one field garbage, or not a request view at all."""
        base = self._real_request(data.draw(st.integers(0, 7)))
        if base is None or data.draw(st.integers(0, 4)) == 0:
            return data.draw(st.sampled_from(OBJ_BAD))
        name = data.draw(st.sampled_from(sorted(_REQUEST_FIELDS)))
        value = data.draw(st.sampled_from(_REQUEST_FIELDS[name]))
        return dataclasses.replace(base, **{name: value})

    # -- scheduler hooks -----------------------------------------------------------------------

    @rule(data=st.data(), hook=st.integers(0, 9))
    def garbage_scheduler(self, data: st.DataObject, hook: int) -> None:
        """A scheduler hook or accessor with one argument (or field) garbage."""
        StackMachine.steps_run += 1
        s = self.h.stack.scheduler
        draw = data.draw
        real = self._real_request(draw(st.integers(0, 7)))
        if hook == 0:
            bad = self._bad_request(data)
            self._reject("on_new_request", lambda: s.on_new_request(bad))
        elif hook == 1:
            bad = self._bad_request(data)
            self._reject(
                "get_num_new_matched_tokens(bad request)",
                lambda: s.get_num_new_matched_tokens(bad, 0),
            )
        elif hook == 2 and real is not None:
            nc = draw(st.sampled_from(NC_BAD))
            self._reject(
                "get_num_new_matched_tokens(num_computed_tokens)",
                lambda: s.get_num_new_matched_tokens(real, nc),
            )
        elif hook == 3 and real is not None:
            mx = draw(st.sampled_from([x for x in INT_BAD if x is not None]))  # None: no cap
            self._reject(
                "get_num_new_matched_tokens(max_num_new_tokens)",
                lambda: s.get_num_new_matched_tokens(real, 0, mx),
            )
        elif hook == 4 and real is not None:
            if draw(st.booleans()):
                blocks = draw(st.sampled_from(BLOCKS_BAD))
                if blocks is WRONG_GROUP_COUNT:
                    blocks = [[1 + g] for g in range(len(s.config.groups) + 1)]
                self._reject(
                    "update_state_after_alloc(block_ids)",
                    lambda: s.update_state_after_alloc(real, blocks, 0),
                )
            else:
                ext = draw(st.sampled_from(INT_BAD))
                self._reject(
                    "update_state_after_alloc(num_external_tokens)",
                    lambda: s.update_state_after_alloc(real, [[1]] * len(s.config.groups), ext),
                )
        elif hook == 5:
            kind = draw(st.integers(0, 2))
            out: Any
            if kind == 0:
                out = draw(st.sampled_from(OBJ_BAD))
            elif kind == 1 and real is not None:
                wrong = tuple((1 + g,) for g in range(len(s.config.groups) + 1))
                out = SchedulerOutput(scheduled=[ScheduledRequest(real.request_id, wrong, 1)])
            else:
                out = dataclasses.replace  # a function: not a SchedulerOutput
            self._reject("build_connector_meta", lambda: s.build_connector_meta(out))
        elif hook == 6:
            meta = _bad_meta(draw)
            self._reject("update_connector_output(shape)", lambda: s.update_connector_output(meta))
        elif hook == 7:
            # documented tolerances: counts that are not positive ints, never-issued job ids
            live = sorted(s.jobs)
            if live and draw(st.booleans()):
                job = draw(st.sampled_from(live))
                count = draw(st.sampled_from([0, -2, True, 1.5, "1", None, math.nan]))
            else:
                job = draw(st.sampled_from([s.next_job_id + 1000, -5, "j", 1.5, None, -(2**70)]))
                count = draw(st.sampled_from([1, 2, 0, "1"]))
            col = draw(st.sampled_from(["completed", "failed"]))
            meta = WorkerMetadata(**{col: {job: count}})
            self._tolerate(
                "update_connector_output(entries)", lambda: s.update_connector_output(meta)
            )
        elif hook == 8:
            bad = self._bad_request(data)
            self._reject("request_finished", lambda: s.request_finished(bad))
        else:
            rid = draw(st.sampled_from(ID_BAD))
            self._reject("request_state", lambda: s.request_state(rid))
            self._reject("request_keys", lambda: s.request_keys(rid))

    # -- manager, workers ------------------------------------------------------------------------

    @rule(data=st.data(), call=st.integers(0, 6))
    def garbage_manager(self, data: st.DataObject, call: int) -> None:
        """The manager's API with garbage keys (or a garbage ``success`` flag)."""
        StackMachine.steps_run += 1
        m = self.h.stack.manager
        draw = data.draw
        keys = draw(st.sampled_from(KEYS_BAD))
        key = draw(st.sampled_from([None, 5, "abcdefgh", b"xy", b"", FOREIGN, [b"k" * 8], 1.5]))
        ctx = next(iter(self.h.stack.scheduler.requests.values()), None)
        rctx = ctx.ctx if ctx is not None else None
        fns: list[tuple[str, Callable[[], object]]] = [
            ("lookup", lambda: m.lookup(key, rctx)),  # type: ignore[arg-type]
            ("prepare_load", lambda: m.prepare_load(keys, rctx)),  # type: ignore[arg-type]
            ("complete_load", lambda: m.complete_load(keys, rctx)),  # type: ignore[arg-type]
            ("prepare_store", lambda: m.prepare_store(keys, rctx)),  # type: ignore[arg-type]
            ("complete_store", lambda: m.complete_store(keys, rctx)),  # type: ignore[arg-type]
            ("touch", lambda: m.touch(keys, rctx)),  # type: ignore[arg-type]
        ]
        if call < len(fns):
            name, fn = fns[call]
            self._reject(name, fn)
        else:
            pending = [k for k in self.h.stack.manager.present_keys()]  # type: ignore[attr-defined]
            flag = draw(st.sampled_from(FLAG_BAD))
            good = pending[:1]
            self._reject("complete_store(success)", lambda: m.complete_store(good, rctx, flag))  # type: ignore[arg-type]

    @rule(data=st.data(), call=st.integers(0, 2), rank=st.integers(0, 1))
    def garbage_worker(self, data: st.DataObject, call: int, rank: int) -> None:
        """A worker's per-step hooks with garbage metadata or job ids."""
        StackMachine.steps_run += 1
        w = self.h.stack.ranks[rank % len(self.h.stack.ranks)].worker
        draw = data.draw
        if call == 2:
            ids = draw(st.sampled_from([None, 5, "ab", ["a"], [None], [1.5], FOREIGN]))
            self._reject("wait", lambda: w.wait(ids))
            return
        meta = draw(
            st.sampled_from(
                [
                    *OBJ_BAD,
                    ConnectorMetadata(load_jobs={"1": None}),  # type: ignore[dict-item]
                    ConnectorMetadata(store_jobs={0: None}),  # type: ignore[dict-item]
                    ConnectorMetadata(jobs_to_flush=frozenset({None})),  # type: ignore[arg-type]
                    ConnectorMetadata(load_jobs=[1]),  # type: ignore[arg-type]
                    ConnectorMetadata(jobs_to_flush=[1]),  # type: ignore[arg-type]
                ]
            )
        )
        hook = w.start_step if call == 0 else w.end_step
        self._reject(hook.__name__, lambda: hook(meta))

    # -- constructors (no state: they must only raise typed errors) ------------------------------

    @rule(data=st.data(), which=st.integers(0, 9))
    def garbage_constructor(self, data: st.DataObject, which: int) -> None:
        """A configuration, key, view or wire constructor with a garbage argument."""
        StackMachine.steps_run += 1
        draw = data.draw
        ints = draw(st.sampled_from(INT_BAD))
        fns: list[tuple[str, Callable[[], object]]] = [
            ("SchedulerConfig(num_workers)", lambda: SchedulerConfig(num_workers=ints)),
            ("SchedulerConfig(blocks_per_chunk)", lambda: SchedulerConfig(blocks_per_chunk=ints)),
            (
                "SchedulerConfig(stall_timeout_s)",
                lambda: SchedulerConfig(stall_timeout_s=draw(st.sampled_from(FLOAT_BAD))),
            ),
            ("GroupConfig", lambda: GroupConfig(ints)),
            ("CPUOffloadingManager", lambda: CPUOffloadingManager(ints)),
            ("make_offload_key(group)", lambda: make_offload_key(b"h" * 8, ints)),
            (
                "make_offload_key(hash)",
                lambda: make_offload_key(draw(st.sampled_from([None, 5, "h", 1.5, FOREIGN])), 0),
            ),
            (
                "ScheduledRequest",
                lambda: ScheduledRequest(
                    "r", draw(st.sampled_from(BLOCKS_BAD[:7] + BLOCKS_BAD[8:])), 1
                ),
            ),
            (
                "WorkerMetadata.aggregate",
                lambda: aggregate([WorkerMetadata(), draw(st.sampled_from(OBJ_BAD))]),
            ),
            ("CPUPool", lambda: CPUPool(ints, [8])),
        ]
        name, fn = fns[which]
        backend = self.h.stack.ranks[0].worker._backend
        extra = [("OffloadingWorker(rank)", lambda: OffloadingWorker(backend, rank=ints))]
        self._reject(name, fn)
        if which == 0:
            name, fn = extra[0]
            self._reject(name, fn)


def _profile_settings() -> settings:
    if settings.get_current_profile_name() == "fuzz":
        return settings(  # 60-90 s a path on a 2-core machine (the budget aims at >= 60 s)
            max_examples=1500,
            stateful_step_count=100,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    return settings(  # about 15 s on the shared 2-core machine
        max_examples=8,
        stateful_step_count=35,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.mark.usefixtures("view_checks")  # with and without the views' C checks
def test_garbage_fuzzing() -> None:
    """Valid traffic and garbage interleaved: typed errors only, rejections change nothing,
    every invariant holds, the run drains clean (the views checked with their C accepting
    checks, and by the pure-Python path alone)."""
    GarbageMachine.calls = {"rejected": 0, "tolerated": 0}
    run_state_machine_as_test(GarbageMachine, settings=_profile_settings())
    print(f"garbage calls: {GarbageMachine.calls}")
    assert GarbageMachine.calls["rejected"] > 0


def test_garbage_fuzzer_catches_a_missing_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded mutant: the report-shape check removed; the fuzzer finds the untyped error
    (or the state change) that a malformed report then causes."""
    monkeypatch.setattr(validate, "worker_metadata", lambda *a, **k: None)
    monkeypatch.setattr(wire, "check_worker_metadata", lambda *a, **k: None)  # aggregate's

    class Mutant(GarbageMachine):
        @rule(data=st.data())
        def bad_report(self, data: st.DataObject) -> None:
            meta = _bad_meta(data.draw)
            self._reject(
                "update_connector_output",
                lambda: self.h.stack.scheduler.update_connector_output(meta),
            )

    # the stubbed check also guards WorkerMetadata.aggregate: either entry point shows it
    with pytest.raises(AssertionError, match=r"update_connector_output|WorkerMetadata\.aggregate"):
        run_state_machine_as_test(
            Mutant,
            settings=settings(
                max_examples=30,
                stateful_step_count=20,
                deadline=None,
                database=None,
                report_multiple_bugs=False,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
