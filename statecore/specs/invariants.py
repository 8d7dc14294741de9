"""The invariant catalogue: every ``INV-*`` as a named, executable predicate.

Each :class:`Invariant` carries its statement, the failure it prevents, where it is checked,
and, for those that concern scheduler state, a ``check`` function yielding violation messages.
Checked mode (``OffloadingScheduler(checked=True)`` or ``STATECORE_CHECKED=1``) evaluates
:func:`check_scheduler` after every public call; the fuzzers and the simulator call it after
every step; the docs render :data:`INVARIANTS`. Manager-side invariants are checked by the
manager conformance machine (:mod:`statecore.specs.conformance`), end-to-end ones by the
simulator's byte oracle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from statecore import kernels
from statecore.errors import InvariantViolation, ManagerError
from statecore.keys import OffloadKey, make_offload_key
from statecore.lifecycle import (
    J_CARRIED,
    J_IN_FLIGHT,
    J_PARTIAL,
    J_STALLED,
    JOB,
    R_FINISHED_DRAINING,
    R_FINISHED_PENDING,
    R_LOADING,
    R_NO_TRANSFER,
    R_PREEMPTED,
    R_STORING,
    REQUEST,
)
from statecore.manager import LookupResult, Medium, OffloadingEvent

if TYPE_CHECKING:
    from statecore.scheduler import OffloadingScheduler

__all__ = [
    "INVARIANTS",
    "Invariant",
    "LookupAnswers",
    "caused_error_violation",
    "check_scheduler",
    "evict_violation",
    "manager_error_violation",
    "own_violation",
    "raised_by_injection",
    "scheduler_violations",
    "shutdown_error_violation",
    "store_complete_keys",
    "store_complete_violation",
]

Check = Callable[["OffloadingScheduler"], Iterator[str]]


@dataclass(frozen=True, slots=True)
class Invariant:
    """One named invariant.

    Attributes:
        code: ``INV-*``.
        statement: what must hold.
        prevents: the failure it rules out (each has shipped in a real system).
        checked_by: where it is checked (``checked mode``, ``fuzzing``, ``simulator``,
            ``CrossHair``, ``conformance``, ``unit tests``).
        check: for scheduler-state invariants, a function yielding violation messages.
    """

    code: str
    statement: str
    prevents: str
    checked_by: tuple[str, ...]
    check: Check | None = None


# ---------------------------------------------------------------------------------------------
# scheduler predicates


def _ref(s: OffloadingScheduler) -> Iterator[str]:
    jobs, reqs = s.jobs, s.requests
    for rid, rec in reqs.items():
        for jid in rec.jobs:
            job = jobs.get(jid)
            if job is None:
                yield f"request {rid!r} lists job {jid}, which is not live"
            elif job.req is not rec:
                yield f"request {rid!r} lists job {jid}, which belongs to {job.req.req_id!r}"
    for jid, job in jobs.items():
        if reqs.get(job.req.req_id) is not job.req:
            yield f"live job {jid} belongs to request {job.req.req_id!r}, which is not tracked"
        elif jid not in job.req.jobs:
            yield f"live job {jid} is missing from request {job.req.req_id!r}'s in-flight set"
    for block, jids in s.fence_index.items():
        if not jids:
            yield f"fence entry for block {block} is empty"
        for jid in jids:
            job = jobs.get(jid)
            if job is None or not job.is_store:
                yield f"fence entry for block {block} names job {jid}, not a live store job"
            elif block not in job.fenced and not (
                job.deferred_registered and block in job.deferred_fence
            ):
                yield f"fence entry for block {block} names job {jid}, which does not read it"
    for jid, job in jobs.items():
        registered = job.fenced + (job.deferred_fence if job.deferred_registered else ())
        for block in registered:
            if jid not in s.fence_index.get(block, ()):
                yield f"store job {jid} reads block {block} but is not in its fence entry"
    owner = {id(gs): rid for rid, rec in reqs.items() for gs in rec.groups}
    for block, held in s.window_index.items():
        if not held:
            yield f"window entry for block {block} is empty"
        for gs, pos in held:
            who = owner.get(id(gs))
            if who is None:
                yield f"window entry for block {block} names a position of an untracked request"
            elif not (pos < len(gs.block_ids) and gs.block_ids[pos] == block):
                yield (
                    f"window entry for block {block} names position {pos} of request {who!r}, "
                    "which does not list it"
                )
    loading = s.loading_keys
    if loading is not None:
        expected: Counter[bytes] = Counter()
        for job in jobs.values():
            if not job.is_store and not job.carried:  # a reset emptied the index
                expected.update(job.keys)
        if dict(expected) != dict(loading):
            yield "chunks-being-loaded index differs from the keys of live load jobs"


def _epoch(s: OffloadingScheduler) -> Iterator[str]:
    lo, hi = s.stale_threshold, s.next_job_id
    for jid, job in list(s.jobs.items()) + list(s.stalled_jobs.items()):
        if not 0 <= jid < hi:
            yield f"job {jid} was never issued (next id {hi})"
        elif jid < lo and not (job.carried and not job.is_store):
            yield f"job {jid} outside the current epoch [{lo}, {hi}) and not a carried load"
        elif job.carried and (job.is_store or not job.sent):
            yield f"job {jid} is carried over a reset but is not a sent load"


def _quorum(s: OffloadingScheduler) -> Iterator[str]:
    n = s.config.num_workers
    for jid, job in s.jobs.items():
        if not 0 < job.pending <= n:
            yield f"live job {jid} has {job.pending} outstanding reports of {n} workers"
        if job.pending + job.failed > n:
            yield f"live job {jid}: {job.pending} outstanding + {job.failed} failed > {n}"
        if job.seen >= 1 << n or bin(job.seen).count("1") > n - job.pending:
            yield f"live job {jid}: rank mask {job.seen:b} disagrees with {job.pending} outstanding"
    for jid, job in s.stalled_jobs.items():
        if not 0 < job.pending <= n:
            yield f"stalled job {jid} has remaining count {job.pending}"


def _term(s: OffloadingScheduler) -> Iterator[str]:
    c = s.counters
    ended = c.jobs_completed + c.jobs_failed + c.jobs_stalled + c.jobs_discarded
    if c.jobs_created != len(s.jobs) + ended:
        yield (
            f"{c.jobs_created} jobs created but {len(s.jobs)} live + {ended} ended "
            f"(completed {c.jobs_completed}, failed {c.jobs_failed}, stalled "
            f"{c.jobs_stalled}, discarded {c.jobs_discarded})"
        )


def _excl(s: OffloadingScheduler) -> Iterator[str]:
    jobs = s.jobs
    for rid, rec in s.requests.items():
        loads = [j for j in rec.jobs if j in jobs and not jobs[j].is_store]
        if loads and len(rec.jobs) != 1:
            yield f"request {rid!r} has a load and other jobs in flight: {sorted(rec.jobs)}"


def _cursor(s: OffloadingScheduler) -> Iterator[str]:
    bpc = s.config.blocks_per_chunk
    for rid, rec in s.requests.items():
        for g, gs in enumerate(rec.groups):
            if gs.cursor > len(gs.keys) or gs.cursor * bpc > len(gs.block_ids):
                yield (
                    f"request {rid!r} group {g}: store cursor {gs.cursor} beyond "
                    f"{len(gs.keys)} keys or {len(gs.block_ids) // bpc} whole chunks of blocks"
                )
    # a dormant request's steps are skipped: it must be one that can store no chunk
    for rid in s._dormant:
        held = s.requests.get(rid)
        if held is None or held.admitted is not None or not held.store_cap < held.store_floor:
            state = "untracked" if held is None else f"store floor {held.store_floor}"
            yield (
                f"request {rid!r} ({state}) is dormant (its decode steps are skipped) but "
                "could still store a chunk"
            )


def _src_valid(s: OffloadingScheduler) -> Iterator[str]:
    # loads created this step are not submitted before this step's metadata, whose fence
    # check flushes every store reading their blocks; only emitted loads count
    unsent = s._batch.loads
    load_dst: set[int] = set()
    for jid, job in s.jobs.items():
        if not job.is_store and jid not in unsent:
            load_dst.update(job.blocks)
    for jid, job in s.jobs.items():
        if job.is_store:
            if 0 in job.blocks:
                yield f"store job {jid} reads the null or a stale (zeroed) block"
            clash = load_dst.intersection(job.blocks)
            if clash and not job.flushed:
                yield (
                    f"store job {jid} reads blocks {sorted(clash)} an unfinished load writes, "
                    "and was not flushed before the load"
                )


def _fence(s: OffloadingScheduler) -> Iterator[str]:
    for jid, job in s.jobs.items():
        if not job.is_store:
            continue
        finished = job.req.state in (R_FINISHED_PENDING, R_FINISHED_DRAINING)
        if finished and job.deferred_fence and not job.deferred_registered:
            yield f"store job {jid} of finished request {job.req.req_id!r} is not fenced"


_REQ_SHAPE = {
    R_NO_TRANSFER: "no jobs",
    R_LOADING: "exactly one load job",
    R_STORING: "one or more store jobs",
    R_PREEMPTED: "one or more jobs",
    R_FINISHED_DRAINING: "one or more jobs, signalled",
}


def _lifecycle(s: OffloadingScheduler) -> Iterator[str]:
    jobs = s.jobs
    for rid, rec in s.requests.items():
        st = rec.state
        kinds = [jobs[j].is_store for j in rec.jobs if j in jobs]
        ok = True
        if st == R_NO_TRANSFER:
            ok = not rec.jobs
        elif st == R_LOADING:
            ok = kinds == [False]
        elif st == R_STORING:
            ok = bool(kinds) and all(kinds)
        elif st == R_PREEMPTED:
            ok = bool(rec.jobs)
        elif st == R_FINISHED_DRAINING:
            ok = bool(rec.jobs) and rec.signalled
        elif st == R_FINISHED_PENDING:
            ok = not rec.signalled
        else:
            ok = False
        if not ok:
            yield (
                f"request {rid!r} is in state {REQUEST.state_name(rec)!r} but holds "
                f"{len(rec.jobs)} jobs (stores: {kinds}), signalled={rec.signalled}; expected "
                f"{_REQ_SHAPE.get(st, 'a live state')}"
            )
    n = s.config.num_workers
    for jid, job in jobs.items():
        if job.state == J_IN_FLIGHT:
            ok = job.pending == n and job.failed == 0
        elif job.state == J_PARTIAL:
            ok = 0 < job.pending < n
        elif job.state == J_CARRIED:
            # a sent load, flushed (or to be flushed by the next metadata)
            flushing = job.flushed or jid in s._batch.flush
            ok = 0 < job.pending <= n and job.carried and not job.is_store and flushing
        else:
            ok = False
        if not ok:
            yield (
                f"live job {jid} is in state {JOB.state_name(job)!r} with pending "
                f"{job.pending}, failed {job.failed}"
            )
    for jid, job in s.stalled_jobs.items():
        if job.state != J_STALLED:
            yield f"ledger job {jid} is in state {JOB.state_name(job)!r}, not stalled"


def _live(s: OffloadingScheduler) -> Iterator[str]:
    last = s._table.last_stall_check
    timeout = s.config.stall_timeout_s
    for jid, job in s.jobs.items():
        if kernels.stall_due(last, job.created_at, timeout):
            yield f"job {jid} was due for the stall timeout at the last check but is live"


INVARIANTS: dict[str, Invariant] = {
    inv.code: inv
    for inv in (
        Invariant(
            "INV-REF",
            "Every job id in a request's in-flight set is a live job of that request, every "
            "live job belongs to exactly one live request, every fence entry names live store "
            "jobs that read that block, every sliding-window index entry is a position that a "
            "tracked request lists that block at, and the chunks-being-loaded index equals the "
            "keys of live load jobs.",
            "Dangling job ids that defer a request forever; KeyErrors on completion; index "
            "entries of released requests or dropped block lists kept until the block is reused.",
            ("checked mode", "fuzzing", "simulator"),
            _ref,
        ),
        Invariant(
            "INV-EPOCH",
            "Every live or stalled job belongs to the current reset epoch, except loads the "
            "workers already ran at a reset (carried over: flushed, they complete normally); "
            "reports for older epochs or never-issued ids are absorbed and counted, never "
            "applied.",
            "A late pre-reset report completing a post-reset job, or crashing the engine.",
            ("checked mode", "fuzzing", "CrossHair", "unit tests"),
            _epoch,
        ),
        Invariant(
            "INV-QUORUM",
            "A job completes only after all workers reported; outstanding counts stay in "
            "(0, num_workers] while live; a stalled job's remaining count drains to 0, then "
            "the job is forgotten. A count-only report claiming more workers than a job still "
            "waits for is rejected whole (and counted), never applied in part.",
            "Completing a store on the first rank's report while other ranks still copy.",
            ("checked mode", "fuzzing", "CrossHair"),
            _quorum,
        ),
        Invariant(
            "INV-TERM",
            "Every job reaches exactly one terminal outcome (completed, failed, stalled, "
            "discarded) and the manager receives exactly one completion for it, except for "
            "jobs discarded by reset.",
            "Double complete_store (negative counters) or none (slots leaked write-pending).",
            ("checked mode", "fuzzing", "simulator"),
            _term,
        ),
        Invariant(
            "INV-FENCE",
            "No GPU block an unfinished store (or a stalled transfer that may still land) reads "
            "or writes is handed to a new owner without that job being flushed first.",
            "Silent KV corruption: a reused block overwritten before its store copied it.",
            ("checked mode", "simulator (byte oracle)", "fuzzing"),
            _fence,
        ),
        Invariant(
            "INV-SRC-VALID",
            "A store's source blocks hold computed KV: never the null block, never a zeroed "
            "stale sliding-window block, never the destination of an unfinished load unless "
            "the store was flushed (finished on every worker) before that load was submitted.",
            "Storing garbage under a valid key.",
            ("checked mode", "fuzzing"),
            _src_valid,
        ),
        Invariant(
            "INV-EXCL",
            "Per request, the in-flight set is exactly one load, or zero or more stores; a "
            "lookup that would break this is deferred, never asserted.",
            "Engine-killing asserts when a preempted request is re-admitted mid-store.",
            ("checked mode", "lifecycle table", "fuzzing"),
            _excl,
        ),
        Invariant(
            "INV-CURSOR",
            "Per group, the next-chunk-to-store cursor never exceeds the number of keys or of "
            "whole chunks of block ids; clearing block ids rewinds it.",
            "Storing chunks whose blocks were never allocated, or skipping chunks forever.",
            ("checked mode", "CrossHair", "fuzzing"),
            _cursor,
        ),
        Invariant(
            "INV-LIFECYCLE",
            "The lifecycle state of every request and job agrees with the data it summarises "
            "(in-flight set, outstanding and failed counts, signalled flag).",
            "A table state drifting from reality, so guards decide on wrong facts.",
            ("checked mode", "fuzzing"),
            _lifecycle,
        ),
        Invariant(
            "INV-LIVE",
            "A deferred request or in-flight job leaves that state within bounded steps or "
            "time: a job past the stall timeout at the last check is no longer live.",
            "Requests hung forever behind a worker that never reports.",
            ("checked mode", "simulator (hung requests)"),
            _live,
        ),
        Invariant(
            "INV-PIN",
            "Manager reference counts never go below their floor; every pin has exactly one "
            "release on every path: completion, failure, stall, reset.",
            "Negative pin counts; keys pinned forever and never evictable.",
            ("conformance", "simulator (leak check)"),
        ),
        Invariant(
            "INV-EVICT",
            "An eviction victim is never pinned, write-pending or among the keys being stored; "
            "eviction succeeds exactly when enough evictable capacity exists; a failed "
            "eviction changes nothing.",
            "Evicting a block still in use; half-applied evictions.",
            (
                "conformance",
                "CrossHair",
                "simulator (every prepare_store)",
                "fuzzing",
                "statecore check (every prepare_store)",
            ),
        ),
        Invariant(
            "INV-EVENTS",
            "A tier's stored/removed events, replayed from the start, announce exactly the "
            "keys it holds readable: every key that becomes readable is announced stored, "
            "every readable key it drops (eviction, reset) is announced removed.",
            "A router or a second tier told of blocks that are gone, or never told of blocks "
            "that are there: requests routed to a cache that misses.",
            (
                "conformance (events replayed)",
                "simulator (CPU tier, every step)",
                "fuzzing",
                "statecore check (every action)",
            ),
        ),
        Invariant(
            "INV-OWN",
            "A store reads only GPU blocks its request may read: no source block (in any KV "
            "group) was handed to another owner (a tracked request, another connector's, an "
            "asynchronous load) before the store was created, and a block handed out while a "
            "store reading it is in flight is handed out only in a step whose jobs_to_flush "
            "holds that store. A violation even when the bytes happen to match.",
            "Another request's KV stored under this request's key (stale sliding-window "
            "blocks, unfenced allocations to untracked requests): wrong bytes served as hits.",
            ("simulator (engine model, every step)", "fuzzing", "statecore check (new stores)"),
        ),
        Invariant(
            "INV-FLUSH-PREEMPT",
            "When a request is preempted (and not finished in the same step), every one of its "
            "in-flight jobs is in that step's jobs_to_flush or was flushed before.",
            "A preempted request's freed blocks rewritten under its in-flight stores.",
            ("simulator (engine model, every step)", "fuzzing"),
        ),
        Invariant(
            "INV-STORE-COMPLETE",
            "Every full chunk of a full-attention group that a finished (not aborted) request "
            "computed is, since the last reset, offered to a prepare_store that answers "
            "(stored, or declined by the manager), or known to the manager (found by a "
            "lookup), or was refused for lack of room at its last chance (the final store), "
            "or was covered by an admission with a load since the last reset (local prefix "
            "plus loaded chunks, never offered again under the chunk-level policy). A reset "
            "drops every offer and every cover made before it: what it dropped is offered "
            "again while its request lives. Sliding-window chunks may be skipped (their "
            "blocks left the window).",
            "A store that silently never happens: cache lost, bytes fine (a request not "
            "rewound at a reset stores its later chunks behind a hole no prefix gets past).",
            ("simulator (engine model)", "fuzzing", "statecore check"),
        ),
        Invariant(
            "INV-LOAD-HIT",
            "A load is planned (prepare_load) only over keys the manager answered HIT for in "
            "that request's lookups of the same step: a prefix stops at its first chunk not "
            "HIT, and a sliding window holding a chunk whose store or promotion is still in "
            "flight (HIT_PENDING) or not known yet (RETRY) is not loadable.",
            "A load the manager must refuse: counted as a manager error and recomputed (lost "
            "hits that look like a manager fault), or, from a manager that does not refuse, "
            "bytes read before they were written.",
            ("simulator (every prepare_load)", "fuzzing", "statecore check"),
        ),
        Invariant(
            "INV-ORDER",
            "on_request_finished reaches the manager exactly once per request it took "
            "(on_new_request returned), after its last prepare_store/prepare_load, and never "
            "for one it did not take; secondary tiers are finalised only when the "
            "request finished and has no pending primary stores.",
            "Tiering KeyError on a store completing after finalisation (upstream #49635).",
            ("lifecycle table", "unit tests", "conformance"),
        ),
        Invariant(
            "INV-FAIL-STATE",
            "A worker-reported transfer failure is data (success=False): the store is discarded, "
            "the load's blocks are reported for recompute, nothing asserts.",
            "Engine crash on the first failed copy.",
            ("unit tests", "simulator", "fuzzing"),
        ),
        Invariant(
            "INV-NO-PARTIAL",
            "Data of a failed or stalled store never becomes loadable and is never cascaded to "
            "a secondary tier.",
            "Serving half-written KV as a cache hit.",
            ("conformance", "unit tests", "simulator (byte oracle)"),
        ),
        Invariant(
            "INV-DATA",
            "The KV bytes a load delivers for a key are exactly the bytes stored for it, in "
            "every KV-cache group.",
            "Silent corruption anywhere on the path.",
            ("simulator (per-group byte oracle)", "fuzzing", "worker tests"),
        ),
        Invariant(
            "INV-MGR-ERROR",
            "A manager that raises while a job completes (complete_store/complete_load) does "
            "not leave the job half-ended: the job ends, its request moves on and the rest of "
            "the report is applied. One whose prepare_store, prepare_load, lookup_many, "
            "on_schedule_end or on_request_finished raises does not stop its hook: the offer "
            "is taken as no room, the load as failed before it started (its blocks reported "
            "invalid), the lookup as no hit, the finish notice as delivered, the step goes "
            "on and its metadata is whole. One whose reset_cache raises makes reset_cache "
            "return False and keeps the manager's reset pending: no lookup hits until a "
            "retry (each build_connector_meta) succeeds, so neither pre-reset chunks nor the "
            "discarded jobs' keys outlive it. One whose on_new_request raises leaves the "
            "request tracked but unknown to it: no lookup hits, no offers, no finish notice, "
            "until a retry (its next lookup or store) succeeds. One whose take_events "
            "raises gives no events that time, one whose get_stats raises only the "
            "scheduler's own stats; the rest come with the next call. One whose "
            "has_pending_work raises is answered for as having none (the engine, which asks "
            "before every step, may idle; nothing of the scheduler's is pending then). Every "
            "such error is counted (manager_errors) and reaches the engine as a ManagerError "
            "from update_connector_output, once its report is applied, when it was untyped or "
            "checked mode is on, and not at all otherwise; an error of the manager's shutdown "
            "is raised from shutdown as a ManagerError (a typed one as it is, anything else "
            "wrapped with it as the cause), counted once. Every manager error is attributed: "
            "where a harness injects them (simulator, fuzzing, statecore check) the manager "
            "raises only the injected ones, and an error the manager raised by itself (the "
            "system caused it: a load of a key that is not loadable, say) or a manager_errors "
            "count above the injected errors is a violation.",
            "A job stuck in flight with its fences (the request hangs, its blocks stay "
            "fenced), a step's metadata lost, or an untyped exception into the engine, after "
            "one manager error.",
            ("simulator", "fuzzing", "statecore check", "unit tests"),
        ),
        Invariant(
            "INV-TABLE",
            "The compiled dispatch table and the python-statemachine classes agree on every "
            "event: same accept/reject, same target state.",
            "A hot-path table drifting from the lifecycle definition.",
            ("checked mode", "differential Hypothesis test"),
        ),
    )
}
"""Every invariant, by code."""


# ---------------------------------------------------------------------------------------------
# whole-stack expectation oracles: the one definition of the checks of INV-EVICT (at the stack
# level), INV-EVENTS and INV-STORE-COMPLETE that need the engine's view (the simulator's engine and
# ``statecore check``'s world both call these)


def evict_violation(
    req_id: str, offered: Collection[OffloadKey], evicted: Iterable[OffloadKey]
) -> str | None:
    """INV-EVICT on one ``prepare_store``: none of the keys it evicted was offered to it."""
    bad = set(offered).intersection(evicted)
    if not bad:
        return None
    k = min(bad)
    return (
        f"INV-EVICT: prepare_store for {req_id!r} evicted offered key "
        f"{bytes(k).hex()[:12]} ({len(bad)} offered keys evicted)"
    )


def replay_events_into(
    view: set[OffloadKey], events: Iterable[OffloadingEvent], medium: Medium | None = None
) -> None:
    """Apply stored/removed ``events`` (of ``medium`` only, when given) to ``view``, the set
    of keys announced so far (INV-EVENTS)."""
    for ev in events:
        if medium is None or ev.medium is medium:
            if ev.removed:
                view.difference_update(ev.keys)
            else:
                view.update(ev.keys)


def events_violation(
    announced: Collection[OffloadKey], readable: Collection[OffloadKey]
) -> str | None:
    """INV-EVENTS on one tier: ``announced`` (its events replayed from the start) against the
    keys it holds ``readable``."""
    extra = set(announced).difference(readable)
    missing = set(readable).difference(announced)
    if not extra and not missing:
        return None
    parts = []
    if extra:
        parts.append(
            f"{len(extra)} announced but not readable (first {bytes(min(extra)).hex()[:12]})"
        )
    if missing:
        parts.append(
            f"{len(missing)} readable but never announced (first {bytes(min(missing)).hex()[:12]})"
        )
    return "INV-EVENTS: the tier's events disagree with its contents: " + "; ".join(parts)


class InjectedError(Protocol):
    """One manager error injected by the world (its record of it): ``call`` names the
    manager call (``complete_store``, ``complete_load``, ``prepare_store``, ...)."""

    @property
    def error(self) -> Exception: ...
    @property
    def call(self) -> str: ...
    @property
    def req_id(self) -> str: ...
    @property
    def is_store(self) -> bool: ...
    @property
    def completion(self) -> bool: ...
    @property
    def keys(self) -> tuple[OffloadKey, ...]: ...


class LiveJob(Protocol):
    """What :func:`manager_error_violation` reads of a live job."""

    @property
    def is_store(self) -> bool: ...
    @property
    def keys(self) -> Sequence[OffloadKey]: ...


def raised_by_injection(raised: BaseException | None, injected: Sequence[InjectedError]) -> bool:
    """Whether ``raised`` (out of ``update_connector_output``) is one of the ``injected``
    errors or names one as its cause."""
    if raised is None:
        return False
    errors = [e.error for e in injected]
    return any(raised is e or raised.__cause__ is e for e in errors)


def manager_error_violation(
    injected: Sequence[InjectedError],
    raised: BaseException | None,
    counted: int,
    checked: bool,
    live_jobs: Callable[[str], Iterable[LiveJob]],
) -> str | None:
    """INV-MGR-ERROR on one ``update_connector_output``, the manager having raised
    ``injected`` since the last one: from completions during the call (each after it had
    applied the completion) or from the step's other calls (a store offer, lookup or
    schedule end that changed nothing, a finish notice applied), which this call raises.

    ``raised`` is what the call raised (None: it returned), ``counted`` how much the
    scheduler's ``manager_errors`` counter grew since the last call, ``checked`` whether the
    scheduler runs in checked mode, ``live_jobs(req_id)`` the request's jobs still in flight
    after the call.
    """
    if not injected:
        if not counted:
            return None
        return (
            f"INV-MGR-ERROR: the scheduler counted {counted} manager error(s) and the harness "
            "injected none: the system caused them"
        )
    first = injected[0]
    what = (
        f"INV-MGR-ERROR: the manager raised {len(injected)} time(s) (first: {first.call} "
        f"for request {first.req_id!r}, {type(first.error).__name__})"
    )
    problems: list[str] = []
    for inj in injected:
        if inj.completion and any(
            job.is_store == inj.is_store and tuple(job.keys) == inj.keys
            for job in live_jobs(inj.req_id)
        ):
            problems.append(f"the job of request {inj.req_id!r} is still in flight")
            break
    ours = raised_by_injection(raised, injected)
    if ours and not isinstance(raised, ManagerError):
        problems.append(f"update_connector_output let it out untyped: {raised!r}")
    if counted != len(injected):
        problems.append(f"the scheduler counted {counted}")
    must_raise = checked or any(not isinstance(i.error, ManagerError) for i in injected)
    if must_raise and raised is None:
        problems.append("update_connector_output raised nothing")
    elif ours and not must_raise:
        problems.append("all were typed, yet update_connector_output raised in unchecked mode")
    if not problems:
        return None
    return f"{what}: " + "; ".join(problems)


def caused_error_violation(call: str, req_id: str, exc: BaseException) -> str:
    """INV-MGR-ERROR: the manager's ``call`` (for ``req_id``) raised ``exc``, which the
    harness did not inject. Every manager error a harness sees is attributed: injected (a
    fault it chose) or caused (by the system: the scheduler asked for something the manager
    must refuse, or the manager is wrong), and a caused one is a violation."""
    return (
        f"INV-MGR-ERROR: the manager's {call} for request {req_id!r} raised "
        f"{type(exc).__name__} that no fault injected (caused by the system): {exc}"
    )


class LookupAnswers:
    """INV-LOAD-HIT's event record, fed by the harness's manager proxy: the manager's latest
    answer to each request's lookup of each key in the current step (``lookup``/
    ``lookup_many``), checked against every ``prepare_load``. A step's record is dropped at
    its ``on_schedule_end`` (vLLM's order: lookups and the allocations that plan loads come
    before the step's metadata), so only answers of the step the load is planned in count."""

    __slots__ = ("_answers",)

    def __init__(self) -> None:
        self._answers: dict[str, dict[OffloadKey, int]] = {}

    def looked_up(self, req_id: str, keys: Sequence[OffloadKey], results: Iterable[int]) -> None:
        """The manager answered ``results`` for ``keys`` (in order; a shorter answer, as one
        that stops at the first miss, leaves the rest unanswered)."""
        answers = self._answers.setdefault(req_id, {})
        for key, r in zip(keys, results, strict=False):
            answers[key] = int(r)

    def step_ended(self) -> None:
        """The step's metadata is being built: its lookups are spent."""
        self._answers.clear()

    def load_violation(self, req_id: str, keys: Sequence[OffloadKey]) -> str | None:
        """INV-LOAD-HIT on one ``prepare_load(keys)`` for ``req_id``: every key was
        answered HIT to that request in this step."""
        answers = self._answers.get(req_id, {})
        for i, key in enumerate(keys):
            r = answers.get(key)
            if r != LookupResult.HIT:
                said = "never answered" if r is None else f"answered {LookupResult(r).name}"
                return (
                    f"INV-LOAD-HIT: a load of {len(keys)} chunks for request {req_id!r} was "
                    f"planned over chunk {i} ({bytes(key).hex()[:12]}), {said} in this step"
                )
        return None


def shutdown_error_violation(
    injected: InjectedError | None, raised: BaseException | None, counted: int
) -> str | None:
    """INV-MGR-ERROR on the scheduler's ``shutdown``, the manager's ``shutdown`` having raised
    ``injected`` (None: it returned). ``raised`` is what the scheduler's ``shutdown`` raised
    (None: it returned), ``counted`` how much its ``manager_errors`` counter grew.

    Nothing goes on after a shutdown, so the error is not tolerated: it reaches the engine as
    a :class:`~statecore.errors.ManagerError`, the typed one as it is and anything else wrapped
    with it as the cause, and it is counted once. Without an injected error the shutdown
    raises nothing and counts nothing."""
    if injected is None:
        if raised is not None:
            return f"INV-MGR-ERROR: shutdown raised {raised!r} with no manager error"
        if counted:
            return f"INV-MGR-ERROR: shutdown counted {counted} manager errors with none raised"
        return None
    err = injected.error
    problems: list[str] = []
    if raised is None:
        problems.append("shutdown raised nothing")
    elif not isinstance(raised, ManagerError):
        problems.append(f"shutdown let it out untyped: {raised!r}")
    elif isinstance(err, ManagerError) and raised is not err:
        problems.append(f"shutdown raised {raised!r} instead of the typed error itself")
    elif not isinstance(err, ManagerError) and raised.__cause__ is not err:
        problems.append(f"shutdown raised {raised!r} without the manager's error as its cause")
    if counted != 1:
        problems.append(f"the scheduler counted {counted}")
    if not problems:
        return None
    return f"INV-MGR-ERROR: the manager's shutdown raised {type(err).__name__}: " + "; ".join(
        problems
    )


def own_violation(
    job_id: int,
    req_id: str,
    src_blocks: Iterable[int],
    owners: Sequence[Collection[str]],
    handed_now: Collection[int],
    pulled: bool,
    handed_at: Sequence[int] | None = None,
) -> str | None:
    """INV-OWN (a), on a store job the step's metadata creates: every source block (the null
    block 0 aside) may be read by the store's request (``owners[b]``: the requests it was handed
    to, shared by prefix hits), or it was handed out in this very step (``handed_now``) and the
    store is ``pulled`` (in this step's ``jobs_to_flush``: it reads before the step's compute
    writes). ``handed_at`` (the step each block was handed out) only enriches the message."""
    for b in sorted(set(src_blocks)):
        if b and req_id not in owners[b] and not (pulled and b in handed_now):
            when = f" at step {handed_at[b]}" if handed_at is not None else " before"
            return (
                f"INV-OWN: store job {job_id} of {req_id!r} reads GPU block {b}, which was "
                f"handed to {sorted(owners[b])}{when}"
            )
    return None


def store_complete_keys(
    block_hashes: Sequence[bytes],
    n_off: int,
    covered: int,
    groups: Sequence[tuple[int, int | None]],
    hash_tokens: int,
    blocks_per_chunk: int,
) -> list[OffloadKey]:
    """INV-STORE-COMPLETE: the keys a finished (not aborted) request must have offered to the
    manager since the last reset: every full chunk of every full-attention group up to
    ``n_off`` tokens (the request's offloadable tokens at its finish), past the ``covered``
    tokens of its admission with a load (never offered again). A reset rewinds every live
    request, so ``covered`` counts only admissions since the last reset (the harness sets it
    to 0 at a reset: the reset dropped the loaded chunks too). ``groups`` holds each group's
    ``(tokens per block, sliding window or None)``; ``hash_tokens`` is the tokens per block
    hash."""
    keys: list[OffloadKey] = []
    for g, (tpb, window) in enumerate(groups):
        if window is not None:
            continue  # sliding-window chunks may be skipped: their blocks left the window
        tpc = tpb * blocks_per_chunk
        hpc = tpb // hash_tokens * blocks_per_chunk
        for c in range(-(-covered // tpc), n_off // tpc):
            keys.append(make_offload_key(block_hashes[(c + 1) * hpc - 1], g))
    return keys


def store_complete_violation(
    req_id: str,
    keys: Sequence[OffloadKey],
    known: Collection[OffloadKey],
    refused: Collection[OffloadKey],
) -> str | None:
    """INV-STORE-COMPLETE, checked after the request's final store was built: every one of
    ``keys`` (:func:`store_complete_keys`) is ``known`` (offered to a ``prepare_store`` that
    answered, stored or declined, or found by a lookup, since the last reset) or was
    ``refused`` for lack of room in this step (its last chance, the final store). A request
    that finished before a reset whose final store the reset discarded is not checked; one
    that lived through a reset is: what the reset dropped must have been offered again."""
    missing = [key for key in keys if key not in known and key not in refused]
    if not missing:
        return None
    return (
        f"INV-STORE-COMPLETE: finished request {req_id!r}: {len(missing)} of its "
        f"{len(keys)} full chunks were never offered to the manager nor known to "
        f"it (first {bytes(missing[0]).hex()[:12]})"
    )


def scheduler_violations(sched: OffloadingScheduler) -> Iterator[tuple[str, str]]:
    """Every violated scheduler invariant as ``(code, message)``."""
    for inv in INVARIANTS.values():
        if inv.check is not None:
            for msg in inv.check(sched):
                yield inv.code, msg


def check_scheduler(sched: OffloadingScheduler) -> None:
    """Raise :class:`~statecore.errors.InvariantViolation` for the first violation."""
    for code, msg in scheduler_violations(sched):
        raise InvariantViolation(code, msg)
