# mypy: disable-error-code="arg-type, list-item, dict-item"
"""The bad-input table: malformed calls at every public entry point and what each must do.

Each :class:`Case` names an entry point, describes the malformed input, and says what must
happen: a typed :mod:`statecore.errors` error (its class), or a documented, counted tolerance
(the counter that must move). :func:`run_case` runs a case on a fresh :class:`Stack` (a small
scheduler + CPU manager with a store in flight, a tiering manager, a file tier, a worker),
snapshots the observable state right before the call (:func:`observe`) and reports the
:class:`Outcome`.

The same table drives two things: ``tests/fuzz/test_bad_inputs.py`` asserts every outcome
(the expected error class, the state unchanged after a rejection, the counter moved by a
tolerance) and ``statecore docs`` renders it as the "bad inputs" page
(:func:`render_page`), with the real error messages, so the page cannot drift from the code.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from statecore import (
    ConnectorMetadata,
    CPUPool,
    GroupConfig,
    OffloadingScheduler,
    ReqContext,
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    WorkerMetadata,
    make_offload_key,
)
from statecore.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidMetadataError,
    KeyNotReadyError,
    LifecycleError,
    ManagerStateError,
    MetadataError,
    PinUnderflowError,
    StatecoreError,
    UnknownKeyError,
    UnknownRequestError,
)
from statecore.managers import (
    CPUOffloadingManager,
    FileTier,
    InlineExecutor,
    MemoryTier,
    TieringOffloadingManager,
)
from statecore.views import ScheduledColumns
from statecore.wire import DirectionStats, TransferStats
from statecore.worker import MemoryBackend, OffloadingWorker, aggregate

__all__ = [
    "CASES",
    "Case",
    "Foreign",
    "IncomparableInt",
    "IntPoser",
    "LyingInt",
    "Outcome",
    "Stack",
    "observe",
    "observe_cpu",
    "observe_scheduler",
    "observe_worker",
    "render_page",
    "run_case",
]

TPB = 4
NAN = math.nan


class Foreign:
    """An object of a type statecore has never heard of (stable repr for the docs)."""

    def __repr__(self) -> str:
        return "<Foreign>"


class LyingInt(int):
    """An ``int`` subclass whose comparisons lie: its value is negative (``LyingInt(-2)``) but
    it claims to be ``>= 0`` and never ``< 0``. A check that compares with the object's own
    operators takes it for a valid block id; statecore takes an int subclass as the int it
    equals, so it must be refused as the negative id it is."""

    def __ge__(self, other: object) -> bool:
        return True

    def __gt__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<LyingInt {int(self)}>"


class IncomparableInt(int):
    """An ``int`` subclass that answers False to every ordering comparison, so that neither
    ``< 0`` nor ``>= n`` catches it, whatever its value: a range check must read the int it
    equals."""

    def __lt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __ge__(self, other: object) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<IncomparableInt {int(self)}>"


class IntPoser:
    """Not an int at all, but poses as one to sums and comparisons: ``0 + poser`` is an int
    (``__radd__``), and it claims to be ``>= 0``. A check built from ``sum`` and ``min``
    takes it for a block id."""

    def __radd__(self, other: object) -> int:
        return 0

    def __ge__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False

    def __repr__(self) -> str:
        return "<IntPoser>"


def _hashes(seed: int, n: int) -> list[bytes]:
    return [bytes([seed, i]) * 8 for i in range(n)]


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Stack:
    """A small live stack in a known state (built fresh for every case).

    * request ``a`` (12 tokens) is running: scheduled with blocks 1, 2, 3, its store job
      :attr:`job` (3 chunks) is in flight on 2 workers, its keys are write-pending;
    * request ``z`` (4 tokens) finished; its chunk is ready and idle (:attr:`ready_key`);
    * request ``b`` shares ``z``'s first chunk and was looked up with 4 locally computed
      tokens (waiting for its allocation);
    * a tiering manager over a memory tier with request ``t`` announced; a file tier in a
      temporary directory; a worker over a memory backend.
    """

    def __init__(self, tmp: Path) -> None:
        self.clock = _Clock()
        self.config = SchedulerConfig(groups=(GroupConfig(TPB),), num_workers=2)
        self.manager = CPUOffloadingManager(16)
        self.sched = OffloadingScheduler(self.config, self.manager, self.clock)
        s = self.sched
        self.z = Request("z", 4, 4, _hashes(9, 1))
        s.on_new_request(self.z)
        s.get_num_new_matched_tokens(self.z, 0)
        s.update_state_after_alloc(self.z, [[4]], 0)
        meta = s.build_connector_meta(
            SchedulerOutput(scheduled=[ScheduledRequest("z", ((4,),), 4)])
        )
        (zjob,) = meta.store_jobs
        s.update_connector_output(WorkerMetadata(completed={zjob: 2}))
        self.ready_key = s.request_keys("z")[0][0]
        s.request_finished(self.z)
        s.build_connector_meta(SchedulerOutput())
        self.a = Request("a", 12, 12, _hashes(1, 3))
        s.on_new_request(self.a)
        s.get_num_new_matched_tokens(self.a, 0)
        s.update_state_after_alloc(self.a, [[1, 2, 3]], 0)
        meta = s.build_connector_meta(
            SchedulerOutput(
                scheduled=[ScheduledRequest("a", ((1, 2, 3),), 12)], new_req_ids=frozenset("a")
            )
        )
        (self.job,) = meta.store_jobs
        self.store_meta = meta
        self.pending_key = s.request_keys("a")[0][0]
        self.a.num_computed_tokens = 12
        self.b = Request("b", 8, 8, [*_hashes(9, 1), *_hashes(2, 1)])
        s.on_new_request(self.b)
        s.get_num_new_matched_tokens(self.b, 4)
        self.absent_key = make_offload_key(b"absent-chunk", 0)
        self.tier = MemoryTier()
        self.tiering = TieringOffloadingManager(CPUOffloadingManager(4), [self.tier])
        self.tctx = ReqContext("t")
        self.tiering.on_new_request(self.tctx)
        self.pool = CPUPool(4, [8])
        self.file_tier = FileTier(tmp / "tier", self.pool, executor=InlineExecutor())
        self.backend = MemoryBackend([8], 16, [bytearray(8 * 16)], 1)
        self.worker = OffloadingWorker(self.backend, rank=0)
        self.ctx = ReqContext("x")

    def request(self, **changes: Any) -> Request:
        """Request ``a``'s view with some fields replaced (a copy)."""
        return replace(self.a, **changes)

    def close(self) -> None:
        """Release the file tier's directory lock and the pool."""
        self.file_tier.shutdown()
        self.pool.close()


@contextmanager
def stack() -> Iterator[Stack]:
    """A fresh :class:`Stack` over a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="statecore-bad-inputs-") as tmp:
        st = Stack(Path(tmp))
        try:
            yield st
        finally:
            st.close()


def observe_scheduler(s: OffloadingScheduler) -> dict[str, Any]:
    """Everything a caller can observe of a scheduler (records, indexes, counters)."""
    reqs = {
        rid: (
            s.request_state(rid),
            tuple((tuple(g.keys), tuple(g.block_ids), g.cursor, g.skip) for g in rec.groups),
            tuple(sorted(rec.jobs)),
            rec.admitted and tuple(rec.admitted),
            rec.n_hashes,
            rec.num_local_computed,
            rec.num_scheduled,
            rec.request,
        )
        for rid, rec in s.requests.items()
    }
    jobs = {
        jid: (j.state, j.pending, j.failed, j.seen, j.keys, j.blocks, j.flushed)
        for jid, j in s.jobs.items()
    }
    return {
        "requests": reqs,
        "jobs": jobs,
        "stalled": {jid: (j.pending, j.failed, j.seen) for jid, j in s.stalled_jobs.items()},
        "fence": {b: sorted(j) for b, j in s.fence_index.items()},
        "loading": dict(s.loading_keys or {}),
        "next_job_id": s.next_job_id,
        "stale_threshold": s.stale_threshold,
        "counters": s.counters.as_dict(),
        "has_pending": s.has_pending_push_work(),
    }


def observe_cpu(mgr: CPUOffloadingManager) -> tuple[Any, ...]:
    """A CPU manager's entries (reference count and slot per key) and counters."""
    entries = {k: (mgr.ref_count(k), mgr.slot_of(k)) for k in mgr.present_keys()}
    return entries, mgr.counters()


def observe_worker(worker: OffloadingWorker) -> tuple[Any, ...]:
    """A worker's jobs in flight, deferred stores and ignored results."""
    return worker.in_flight, worker.deferred, worker.ignored_results


def observe(st: Stack) -> dict[str, Any]:
    """Everything a caller can observe of the stack, as plain comparable data."""
    tiering = st.tiering
    return {
        "scheduler": observe_scheduler(st.sched),
        "manager": observe_cpu(st.manager),
        "tiering": (
            tiering.tracked_requests(),
            tiering.in_flight_jobs(),
            sorted(tiering.primary.present_keys()),
            list(st.tier.finished_requests),
            len(st.tier.submitted),
        ),
        "file_tier": (st.file_tier.indexed_keys(), st.file_tier.has_pending_work()),
        "worker": observe_worker(st.worker),
    }


@dataclass(frozen=True)
class Case:
    """One malformed call and its required outcome.

    Attributes:
        area: the boundary (scheduler, manager, tier, worker, wire, config, keys).
        entry: the entry point called.
        given: the malformed input, in words.
        call: makes the call on a fresh stack.
        error: the typed error it must raise (state unchanged), or None for a tolerance.
        counter: for a tolerance, the scheduler counter that must move.
        prepare: runs before the snapshot (brings the stack into the case's state).
    """

    area: str
    entry: str
    given: str
    call: Callable[[Stack], object]
    error: type[StatecoreError] | None
    counter: str | None = None
    prepare: Callable[[Stack], object] | None = None


@dataclass(frozen=True)
class Outcome:
    """What a case did.

    Attributes:
        error: the class name of the error raised, or None.
        message: its message.
        counters: scheduler counters that moved (name -> delta), for a tolerance.
        unchanged: whether the observable state was the same after the call (rejections).
        escaped: a non-statecore exception that escaped, as text (must never happen).
    """

    error: str | None
    message: str
    counters: dict[str, int]
    unchanged: bool
    escaped: str | None = None
    error_class: type[StatecoreError] | None = None


def run_case(case: Case) -> Outcome:
    """Run ``case`` on a fresh stack and describe what happened."""
    with stack() as st:
        if case.prepare is not None:
            case.prepare(st)
        before = observe(st)
        try:
            case.call(st)
        except StatecoreError as exc:
            after = observe(st)
            return Outcome(type(exc).__name__, str(exc), {}, after == before, None, type(exc))
        except Exception as exc:  # the bug this table exists to find
            return Outcome(None, "", {}, False, f"{type(exc).__name__}: {exc}")
        after = observe(st)
        was, now = before["scheduler"]["counters"], after["scheduler"]["counters"]
        moved = {k: int(v - was[k]) for k, v in now.items() if v != was[k]}
        return Outcome(None, "", moved, after == before)


# ---------------------------------------------------------------------------------------------
# the table


def _out(*scheduled: ScheduledRequest, **kw: Any) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(scheduled), **kw)


def _good_a() -> ScheduledRequest:
    return ScheduledRequest("a", ((5,),), 1)


def _meta(**kw: Any) -> WorkerMetadata:
    return WorkerMetadata(**kw)


def _stats(**kw: Any) -> TransferStats:
    return TransferStats(load=DirectionStats(**kw))


def _finish_twice(st: Stack) -> None:
    st.sched.request_finished(st.a)


def _tiering_finished(st: Stack) -> None:
    st.tiering.on_request_finished(st.tctx)


def _conn(**kw: Any) -> ConnectorMetadata:
    return ConnectorMetadata(**kw)


S, M, T, W, X, C, K = "scheduler", "manager", "tier", "worker", "wire", "config", "keys"
IM, IA, IK = InvalidMetadataError, InvalidArgumentError, InvalidKeyError

CASES: list[Case] = [
    # -- scheduler hooks -----------------------------------------------------------------------
    Case(S, "on_new_request", "a foreign object", lambda s: s.sched.on_new_request(Foreign()), IM),
    Case(
        S,
        "on_new_request",
        "request_id=5",
        lambda s: s.sched.on_new_request(s.request(request_id=5)),
        IM,
    ),
    Case(
        S,
        "on_new_request",
        "num_tokens=None",
        lambda s: s.sched.on_new_request(s.request(request_id="n", num_tokens=None)),
        IM,
    ),
    Case(
        S,
        "on_new_request",
        "block_hashes=[None]",
        lambda s: s.sched.on_new_request(s.request(request_id="n", block_hashes=[None])),
        IM,
    ),
    Case(
        S,
        "on_new_request",
        "kv_transfer_params=[1]",
        lambda s: s.sched.on_new_request(s.request(request_id="n", kv_transfer_params=[1])),
        IM,
    ),
    Case(
        S,
        "on_new_request",
        "kv_transfer_params={'max_load_tokens': -1}",
        lambda s: s.sched.on_new_request(
            s.request(request_id="n", kv_transfer_params={"max_load_tokens": -1})
        ),
        None,
        "invalid_transfer_params",
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_computed_tokens=-1",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, -1),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_computed_tokens=None",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, None),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_computed_tokens=True",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, True),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_computed_tokens=NaN",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, NAN),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_computed_tokens=2**70 (beyond the request)",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, 2**70),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "max_num_new_tokens=-5",
        lambda s: s.sched.get_num_new_matched_tokens(s.b, 0, -5),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "num_prompt_tokens > num_tokens",
        lambda s: s.sched.get_num_new_matched_tokens(replace(s.b, num_prompt_tokens=99), 0),
        IM,
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "a running request (a lookup only answers)",
        lambda s: s.sched.get_num_new_matched_tokens(s.a, 12),
        None,
        "lookups",
    ),
    Case(
        S,
        "get_num_new_matched_tokens",
        "a finished request",
        lambda s: s.sched.get_num_new_matched_tokens(s.a, 0),
        LifecycleError,
        prepare=_finish_twice,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "block_ids=None",
        lambda s: s.sched.update_state_after_alloc(s.b, None, 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "num_external_tokens=None",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, 5]], None),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "num_external_tokens=-3",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, 5]], -3),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "block_ids=[[4, None]]",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, None]], 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "block_ids=[[-1]]",
        lambda s: s.sched.update_state_after_alloc(s.b, [[-1]], 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "block_ids=[[4, LyingInt(-2)]] (an int subclass that is -2 but compares as >= 0)",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, LyingInt(-2)]], 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "block_ids=[[4, IntPoser()]] (not an int; sums to an int, compares as >= 0)",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, IntPoser()]], 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "two block lists for one KV-cache group",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4], [5]], 0),
        IM,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "empty block lists for 4 locally computed tokens",
        lambda s: s.sched.update_state_after_alloc(s.b, [[]], 0),
        MetadataError,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "num_external_tokens=400 (more than the lists hold)",
        lambda s: s.sched.update_state_after_alloc(s.b, [[4, 6]], 400),
        MetadataError,
    ),
    Case(
        S,
        "update_state_after_alloc",
        "an untracked request",
        lambda s: s.sched.update_state_after_alloc(s.request(request_id="ghost"), [[7]], 0),
        UnknownRequestError,
    ),
    Case(
        S, "build_connector_meta", "output=None", lambda s: s.sched.build_connector_meta(None), IM
    ),
    Case(
        S,
        "build_connector_meta",
        "a good entry, then one with two block lists for one KV-cache group",
        lambda s: s.sched.build_connector_meta(
            _out(_good_a(), ScheduledRequest("b", ((6,), (7,)), 1))
        ),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "new_block_ids=(None,)",
        lambda s: ScheduledRequest("b", (None,), 1),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "num_scheduled_tokens=-1",
        lambda s: ScheduledRequest("a", ((),), -1),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "new_block_ids=((5.0,),)",
        lambda s: ScheduledRequest("a", ((5.0,),), 1),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "resumed_from_preemption='yes'",
        lambda s: ScheduledRequest("a", ((),), 1, "yes"),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "req_id=None",
        lambda s: ScheduledRequest(None, ((),), 1),
        IM,
    ),
    Case(
        X,
        "SchedulerOutput",
        "scheduled=[a good entry, a foreign object]",
        lambda s: _out(_good_a(), Foreign()),
        IM,
    ),
    Case(
        X,
        "SchedulerOutput",
        "preempted_req_ids={1}",
        lambda s: _out(preempted_req_ids=frozenset({1})),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "new_block_ids=((LyingInt(-2),),) (an int subclass that is -2 but compares as >= 0)",
        lambda s: ScheduledRequest("a", ((LyingInt(-2),),), 1),
        IM,
    ),
    Case(
        X,
        "ScheduledRequest",
        "new_block_ids=[[5], [IntPoser()]] (not an int; sums to an int, compares as >= 0)",
        lambda s: ScheduledRequest("a", [[5], [IntPoser()]], 1),
        IM,
    ),
    Case(
        X,
        "ScheduledColumns",
        "new_block_ids=[[[LyingInt(-2)]]] (an int subclass that is -2 but compares as >= 0)",
        lambda s: ScheduledColumns(["a"], [[[LyingInt(-2)]]], [1]),
        IM,
    ),
    Case(
        X,
        "SchedulerOutput",
        "extra_allocated_block_ids={LyingInt(-2)}",
        lambda s: _out(extra_allocated_block_ids=frozenset({LyingInt(-2)})),
        IM,
    ),
    Case(
        X,
        "SchedulerOutput",
        "extra_allocated_block_ids={-1}",
        lambda s: _out(extra_allocated_block_ids=frozenset({-1})),
        IM,
    ),
    Case(
        S,
        "build_connector_meta",
        "a live request view turned bad since the last hook (num_computed_tokens=None)",
        lambda s: s.sched.build_connector_meta(_out(_good_a())),
        None,
        "invalid_request_views",
        prepare=lambda s: setattr(s.a, "num_computed_tokens", None),
    ),
    Case(
        S,
        "build_connector_meta",
        "an untracked request scheduled",
        lambda s: s.sched.build_connector_meta(_out(ScheduledRequest("ghost", ((9,),), 1))),
        None,
        "unknown_scheduled_requests",
    ),
    Case(
        S, "update_connector_output", "a str", lambda s: s.sched.update_connector_output("ok"), IM
    ),
    Case(
        S,
        "update_connector_output",
        "completed=None",
        lambda s: s.sched.update_connector_output(_meta(completed=None)),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "failed=[1, 2]",
        lambda s: s.sched.update_connector_output(_meta(failed=[1, 2])),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "stats=None",
        lambda s: s.sched.update_connector_output(_meta(stats=None)),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "stats.load.seconds=NaN",
        lambda s: s.sched.update_connector_output(_meta(stats=_stats(seconds=NAN))),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "stats.load.bytes=-1",
        lambda s: s.sched.update_connector_output(_meta(stats=_stats(bytes=-1))),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "rank='0'",
        lambda s: s.sched.update_connector_output(_meta(rank="0")),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "a valid completion next to completed_ranks=None",
        lambda s: s.sched.update_connector_output(
            _meta(completed={s.job: 2}, completed_ranks=None)
        ),
        IM,
    ),
    Case(
        S,
        "update_connector_output",
        "completed={job: '1'} (a count that is not an int)",
        lambda s: s.sched.update_connector_output(_meta(completed={s.job: "1"})),
        None,
        "invalid_report_counts",
    ),
    Case(
        S,
        "update_connector_output",
        "completed={999: 1} (a job never issued)",
        lambda s: s.sched.update_connector_output(_meta(completed={999: 1})),
        None,
        "unknown_reports",
    ),
    Case(
        S,
        "update_connector_output",
        "rank 0's report delivered twice (rank-tagged)",
        lambda s: s.sched.update_connector_output(
            _meta(completed={s.job: 1}, completed_ranks={s.job: 1}, rank=0)
        ),
        None,
        "duplicate_reports",
        prepare=lambda s: s.sched.update_connector_output(
            _meta(completed={s.job: 1}, completed_ranks={s.job: 1}, rank=0)
        ),
    ),
    Case(S, "request_finished", "None", lambda s: s.sched.request_finished(None), IM),
    Case(
        S,
        "request_finished",
        "a request that already finished",
        lambda s: s.sched.request_finished(s.a),
        LifecycleError,
        prepare=_finish_twice,
    ),
    Case(
        S,
        "request_finished",
        "a request never seen",
        lambda s: s.sched.request_finished(s.request(request_id="never")),
        None,
        "untracked_finishes",
    ),
    Case(S, "request_keys", "req_id=5", lambda s: s.sched.request_keys(5), UnknownRequestError),
    Case(
        S,
        "request_state",
        "an untracked id",
        lambda s: s.sched.request_state("ghost"),
        UnknownRequestError,
    ),
    # -- CPU manager ---------------------------------------------------------------------------
    Case(M, "prepare_load", "keys=None", lambda s: s.manager.prepare_load(None, s.ctx), IK),
    Case(M, "prepare_load", "keys=[None]", lambda s: s.manager.prepare_load([None], s.ctx), IK),
    Case(
        M,
        "prepare_load",
        "keys=['abcdef'] (a str)",
        lambda s: s.manager.prepare_load(["abcdef"], s.ctx),
        IK,
    ),
    Case(
        M,
        "prepare_load",
        "a ready key, then None (the ready key is not pinned)",
        lambda s: s.manager.prepare_load([s.ready_key, None], s.ctx),
        IK,
    ),
    Case(
        M,
        "prepare_load",
        "an absent key",
        lambda s: s.manager.prepare_load([s.absent_key], s.ctx),
        UnknownKeyError,
    ),
    Case(
        M,
        "prepare_load",
        "a write-pending key",
        lambda s: s.manager.prepare_load([s.pending_key], s.ctx),
        KeyNotReadyError,
    ),
    Case(
        M,
        "complete_load",
        "keys=[b'xy'] (shorter than a group index)",
        lambda s: s.manager.complete_load([b"xy"], s.ctx),
        IK,
    ),
    Case(
        M,
        "complete_load",
        "a ready key that is not pinned",
        lambda s: s.manager.complete_load([s.ready_key], s.ctx),
        PinUnderflowError,
    ),
    Case(M, "prepare_store", "keys=None", lambda s: s.manager.prepare_store(None, s.ctx), IK),
    Case(M, "complete_store", "keys=None", lambda s: s.manager.complete_store(None, s.ctx), IK),
    Case(
        M,
        "prepare_store",
        "keys='abcdefgh' (a str)",
        lambda s: s.manager.prepare_store("abcdefgh", s.ctx),
        IK,
    ),
    Case(M, "prepare_store", "keys=[1]", lambda s: s.manager.prepare_store([1], s.ctx), IK),
    Case(
        M,
        "complete_store",
        "success='no'",
        lambda s: s.manager.complete_store([s.pending_key], s.ctx, "no"),
        IA,
    ),
    Case(M, "lookup", "key=None", lambda s: s.manager.lookup(None, s.ctx), IK),
    Case(M, "touch", "keys=5", lambda s: s.manager.touch(5, s.ctx), IK),
    Case(
        M, "CPUOffloadingManager", "num_slots='8'", lambda s: CPUOffloadingManager("8"), ConfigError
    ),
    Case(
        M, "CPUOffloadingManager", "num_slots=NaN", lambda s: CPUOffloadingManager(NAN), ConfigError
    ),
    Case(
        M,
        "CPUOffloadingManager",
        "num_slots=True",
        lambda s: CPUOffloadingManager(True),
        ConfigError,
    ),
    Case(M, "CPUOffloadingManager", "policy=5", lambda s: CPUOffloadingManager(4, 5), ConfigError),
    Case(
        M,
        "CPUOffloadingManager",
        "store_threshold=1.5",
        lambda s: CPUOffloadingManager(4, store_threshold=1.5),
        ConfigError,
    ),
    # -- tiering manager and tiers -------------------------------------------------------------
    Case(
        T,
        "TieringOffloadingManager.on_request_finished",
        "a second finish",
        lambda s: s.tiering.on_request_finished(s.tctx),
        ManagerStateError,
        prepare=_tiering_finished,
    ),
    Case(
        T,
        "TieringOffloadingManager.lookup",
        "ctx=None",
        lambda s: s.tiering.lookup(s.ready_key, None),
        IA,
    ),
    Case(
        T,
        "TieringOffloadingManager.prepare_store",
        "keys=[None]",
        lambda s: s.tiering.prepare_store([None], s.tctx),
        IK,
    ),
    Case(
        T,
        "TieringOffloadingManager",
        "primary=None",
        lambda s: TieringOffloadingManager(None),
        ConfigError,
    ),
    Case(
        T,
        "TieringOffloadingManager",
        "secondaries=[a foreign object]",
        lambda s: TieringOffloadingManager(CPUOffloadingManager(2), [Foreign()]),
        ConfigError,
    ),
    Case(
        T,
        "FileTier.submit_store",
        "slot 99 in a 4-slot pool",
        lambda s: s.file_tier.submit_store(0, [s.ready_key], [99]),
        IA,
    ),
    Case(
        T,
        "FileTier.submit_load",
        "keys=[None]",
        lambda s: s.file_tier.submit_load(0, [None], [0]),
        IK,
    ),
    Case(
        T,
        "FileTier.submit_store",
        "a job id already submitted",
        lambda s: s.file_tier.submit_store(7, [s.ready_key], [1]),
        IA,
        prepare=lambda s: s.file_tier.submit_load(7, [s.ready_key], [0]),
    ),
    Case(T, "FileTier.lookup", "key=b'' (empty)", lambda s: s.file_tier.lookup(b"", s.ctx), IK),
    Case(
        T,
        "FileTier",
        "max_bytes=-1",
        lambda s: FileTier("/nonexistent", s.pool, max_bytes=-1),
        ConfigError,
    ),
    Case(
        T,
        "FileTier",
        "fsync='yes'",
        lambda s: FileTier("/nonexistent", s.pool, fsync="yes"),
        ConfigError,
    ),
    Case(T, "FileTier", "pool=None", lambda s: FileTier("/nonexistent", None), ConfigError),
    Case(
        T,
        "MemoryTier.submit_store",
        "two slots for one key",
        lambda s: s.tier.submit_store(0, [s.ready_key], [0, 1]),
        IA,
    ),
    # -- worker --------------------------------------------------------------------------------
    Case(
        W,
        "OffloadingWorker",
        "rank=-1",
        lambda s: OffloadingWorker(s.backend, rank=-1),
        ConfigError,
    ),
    Case(
        W,
        "OffloadingWorker",
        "rank=True",
        lambda s: OffloadingWorker(s.backend, rank=True),
        ConfigError,
    ),
    Case(W, "OffloadingWorker", "backend=None", lambda s: OffloadingWorker(None), ConfigError),
    Case(W, "OffloadingWorker.start_step", "meta=None", lambda s: s.worker.start_step(None), IM),
    Case(
        W,
        "OffloadingWorker.start_step",
        "load_jobs={'1': a job}",
        lambda s: s.worker.start_step(_conn(load_jobs={"1": s.store_meta.store_jobs[s.job]})),
        IM,
    ),
    Case(
        W,
        "OffloadingWorker.start_step",
        "a good flush set, then store_jobs={0: None}",
        lambda s: s.worker.start_step(_conn(store_jobs={0: None}, jobs_to_flush=frozenset({0}))),
        IM,
    ),
    Case(
        W,
        "OffloadingWorker.end_step",
        "jobs_to_flush={None}",
        lambda s: s.worker.end_step(_conn(jobs_to_flush=frozenset({None}))),
        IM,
    ),
    Case(W, "OffloadingWorker.wait", "job_ids=None", lambda s: s.worker.wait(None), IM),
    Case(W, "OffloadingWorker.wait", "job_ids=['a']", lambda s: s.worker.wait(["a"]), IM),
    # -- wire types ----------------------------------------------------------------------------
    Case(
        X, "WorkerMetadata.aggregate", "other=None", lambda s: WorkerMetadata().aggregate(None), IM
    ),
    Case(
        X,
        "WorkerMetadata.aggregate",
        "completed={1: 'x'}",
        lambda s: WorkerMetadata().aggregate(_meta(completed={1: "x"})),
        IM,
    ),
    Case(
        X,
        "worker.aggregate",
        "a report, then a str",
        lambda s: aggregate([WorkerMetadata(), "x"]),
        IM,
    ),
    # -- configuration -------------------------------------------------------------------------
    Case(
        C,
        "SchedulerConfig",
        "num_workers=NaN",
        lambda s: SchedulerConfig(num_workers=NAN),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "num_workers=True",
        lambda s: SchedulerConfig(num_workers=True),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "num_workers=2.0",
        lambda s: SchedulerConfig(num_workers=2.0),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "blocks_per_chunk='2'",
        lambda s: SchedulerConfig(blocks_per_chunk="2"),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "stall_timeout_s=NaN",
        lambda s: SchedulerConfig(stall_timeout_s=NAN),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "stall_timeout_s=inf",
        lambda s: SchedulerConfig(stall_timeout_s=math.inf),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "stall_check_interval_s=True",
        lambda s: SchedulerConfig(stall_check_interval_s=True),
        ConfigError,
    ),
    Case(
        C,
        "SchedulerConfig",
        "offload_prompt_only='no'",
        lambda s: SchedulerConfig(offload_prompt_only="no"),
        ConfigError,
    ),
    Case(
        C, "SchedulerConfig", "groups=(16,)", lambda s: SchedulerConfig(groups=(16,)), ConfigError
    ),
    Case(C, "GroupConfig", "tokens_per_block=16.0", lambda s: GroupConfig(16.0), ConfigError),
    Case(C, "GroupConfig", "sliding_window=-1", lambda s: GroupConfig(16, -1), ConfigError),
    Case(C, "CPUPool", "num_slots='4'", lambda s: CPUPool("4", [8]), ConfigError),
    Case(C, "CPUPool", "row_bytes=[0]", lambda s: CPUPool(4, [0]), ConfigError),
    # -- keys ----------------------------------------------------------------------------------
    Case(K, "make_offload_key", "group_idx=-1", lambda s: make_offload_key(b"h", -1), IA),
    Case(K, "make_offload_key", "group_idx=2**32", lambda s: make_offload_key(b"h", 2**32), IA),
    Case(K, "make_offload_key", "group_idx=True", lambda s: make_offload_key(b"h", True), IA),
    Case(K, "make_offload_key", "block_hash=None", lambda s: make_offload_key(None, 0), IA),
    Case(
        K,
        "make_offload_key",
        "block_hash=5 (bytes(5) would be five zero bytes)",
        lambda s: make_offload_key(5, 0),
        IA,
    ),
]
"""Every case; ``tests/fuzz/test_bad_inputs.py`` runs them all, the docs page lists them."""

_AREAS = {
    S: "Scheduler hooks (`OffloadingScheduler`)",
    M: "CPU manager (`CPUOffloadingManager`)",
    T: "Tiering manager and secondary tiers",
    W: "Worker (`OffloadingWorker`)",
    X: "Wire types and views",
    C: "Configuration",
    K: "Offload keys",
}


def _cell(text: str) -> str:
    # Markdown table cell: pipes escaped; brackets outside code spans escaped too, so that a
    # path such as ``block_ids[0][1]`` is not read as a reference link (mkdocs-autorefs).
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("[", "\\[").replace("]", "\\]")
    return "`".join(parts)


def render_page() -> str:
    """The "bad inputs" documentation page, generated by running every case."""
    lines = [
        "# Bad inputs",
        "",
        "<!-- generated by `statecore docs` from statecore.specs.bad_inputs; do not edit -->",
        "",
        "Every public entry point validates all of its arguments before it changes anything "
        "(see `statecore.validate`). This page is generated by running the table that "
        "`tests/fuzz/test_bad_inputs.py` asserts: each malformed call either raises a typed "
        "error from `statecore.errors` and leaves every observable state unchanged, or is a "
        "documented tolerance that is absorbed and counted in `SchedulerCounters`. The "
        "garbage fuzzer (`tests/fuzz/test_fuzz_garbage.py`) throws arbitrary values at the "
        "same entry points between valid engine traffic and checks the same rules plus every "
        "invariant.",
        "",
        "Errors derive from `StatecoreError`; `InvalidArgumentError` (and its subclasses "
        "`InvalidMetadataError`, `InvalidKeyError`) also derive from `TypeError` and "
        "`ValueError`, `ConfigError` from `ValueError`.",
        "",
    ]
    for area, title in _AREAS.items():
        lines += [f"## {title}", "", "| call | input | outcome |", "| --- | --- | --- |"]
        for case in CASES:
            if case.area != area:
                continue
            out = run_case(case)
            if out.error is not None:
                outcome = f"`{out.error}`: {out.message}"
            elif out.escaped is not None:
                outcome = f"**untyped** {out.escaped}"
            else:
                moved = ", ".join(f"`{k}` +{v}" for k, v in sorted(out.counters.items()))
                outcome = f"accepted, counted: {moved}" if moved else "accepted"
            lines.append(f"| `{case.entry}` | {_cell(case.given)} | {_cell(outcome)} |")
        lines.append("")
    return "\n".join(lines)
