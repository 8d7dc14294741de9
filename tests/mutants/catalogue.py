"""The catalogue of seeded mutants: deliberate bugs that the verifiers must find.

Each entry of :data:`MUTANTS` re-introduces one bug class (a historical bug, or a bug the
verifier was extended to see) at the code site judged most likely to regress. Tools use the
catalogue to show that they have teeth: ``tests/mutants/test_mutants.py`` runs the simulator
and the whole-stack fuzzer against each, and any other checker may do the same.

Interface (stable; other tools import it). ``tests/`` is not a package: put ``tests/mutants``
on ``sys.path`` (pytest does so for the test modules beside this file) and import
``catalogue``::

    sys.path.insert(0, "tests/mutants")
    from catalogue import MUTANTS, Mutant

    for name, mutant in MUTANTS.items():
        mutant.description   # one line: what the mutant breaks
        mutant.bug_class     # the bug class it re-introduces (and where it was found)
        with mutant.apply():  # the real code is patched inside the block ...
            run_my_checker()  # ... and restored on exit, also when the block raises

``apply()`` patches attributes of real modules and classes (``setattr``) and restores the
originals on exit, innermost first; it needs no pytest fixture, so a command-line tool can use
it too. It is not re-entrant for the same mutant and is not thread-safe (it patches shared
module state). ``Mutant.patches`` lists the ``(owner, attribute name, replacement)`` triples,
for tools that want to report what changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from statecore import kernels
from statecore.adapters import vllm_metrics
from statecore.adapters.vllm_metrics import TransferSizes
from statecore.errors import ManagerError
from statecore.keys import OffloadKey
from statecore.manager import LookupResult, ReqContext
from statecore.managers import filetier, redistier
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.policies import ARCCachePolicy, LRUCachePolicy
from statecore.managers.tiering import TieringOffloadingManager
from statecore.scheduler import OffloadingScheduler, ResetResult
from statecore.scheduler import core as scheduler_core
from statecore.scheduler.effects import SchedulerEffects
from statecore.scheduler.state import SchedulerState
from statecore.wire import ConnectorMetadata

__all__ = [
    "ENGINE_OUTPUT_MUTANTS",
    "EVENT_PAYLOAD_MUTANTS",
    "FILE_MUTANTS",
    "METRICS_MUTANTS",
    "MUTANTS",
    "REDIS_MUTANTS",
    "RETAINED_MUTANTS",
    "VLLM_WRAPPER_MUTANTS",
    "Mutant",
    "patched",
]


@contextlib.contextmanager
def patched(patches: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set every ``(owner, name, value)`` for the duration of the block, then restore."""
    saved: list[tuple[Any, str, bool, Any]] = []
    try:
        for owner, name, value in patches:
            had = name in vars(owner)
            saved.append((owner, name, had, vars(owner).get(name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, had, old in reversed(saved):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)


@dataclass(frozen=True)
class Mutant:
    """One seeded bug.

    Attributes:
        name: the catalogue key.
        description: one line: what the mutant breaks.
        bug_class: the bug class it re-introduces (and where it was found).
        patches: ``(owner, attribute name, replacement)`` triples that :meth:`apply` sets.
    """

    name: str
    description: str
    bug_class: str
    patches: tuple[tuple[Any, str, Any], ...]

    def apply(self) -> contextlib.AbstractContextManager[None]:
        """A context manager: the mutant is live inside the block, undone on exit."""
        return patched(self.patches)


# -- the mutations ------------------------------------------------------------------------------


def _discard_keeping_request_set(self: SchedulerEffects, job: Any) -> None:
    del self.sched._table.live[job.job_id]  # seed 004: the request's in-flight set keeps the job
    self.sched.counters.jobs_discarded += 1


_real_reset = OffloadingScheduler.reset


def _reset_invalidating_sent_loads(self: OffloadingScheduler) -> ResetResult:
    for job in self.jobs.values():  # the old reset: every load is written off, its blocks
        if not job.is_store:  # invalid, though the workers run it (the engine fails it)
            job.sent = False
            self._finished_loads.add(job.req.req_id)
            self._failed_loads.setdefault(job.req.req_id, set()).update(job.blocks)
    return _real_reset(self)


def _apply_quorum_one(pending: int, ok: int, bad: int) -> tuple[int, int, int, int]:
    acc_bad = min(bad, pending)
    acc_ok = min(ok, pending - acc_bad)
    return 0, acc_ok, acc_bad, 0  # the first worker's report completes the job


_real_classify = kernels.classify_report


def _classify_raising(
    job_id: int, stale_threshold: int, next_job_id: int, live: bool, stalled: bool
) -> kernels.ReportKind:
    if stalled and not live:
        raise KeyError(job_id)  # upstream before stall handling: a late report crashes
    return _real_classify(job_id, stale_threshold, next_job_id, live, stalled)


def _fence_add_noop(index: dict[int, set[int]], job_id: int, blocks: Any) -> None:
    return None  # the fence index is never consulted: nothing is ever in it


_real_take_events = CPUOffloadingManager.take_events


def _take_events_without_removals(self: CPUOffloadingManager) -> list[Any]:
    return [ev for ev in _real_take_events(self) if not ev.removed]  # evictions go unannounced


_real_complete_store = CPUOffloadingManager.complete_store


def _complete_store_always_ok(
    self: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext,
    success: bool = True,
) -> None:
    _real_complete_store(self, keys, ctx, True)  # failed/stalled stores become loadable


def _complete_store_leaking_slots(
    self: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext,
    success: bool = True,
) -> None:
    free = self._free
    before = len(free)
    _real_complete_store(self, keys, ctx, success)
    del free[before:]  # a failed store's slots are never freed: the cache shrinks silently


_real_build = OffloadingScheduler.build_connector_meta


def _build_without_flushes(self: OffloadingScheduler, output: Any) -> ConnectorMetadata:
    meta = _real_build(self, output)  # the workers are never told to wait for reused blocks
    return dataclasses.replace(meta, jobs_to_flush=frozenset())


def _drop_stale_window_blocks_scheduled_only(
    self: OffloadingScheduler, allocated: set[int], window_new: list[tuple[int, Any, int]]
) -> None:
    # the old code: only the positions of requests scheduled in this step are checked
    index = self._window_blocks
    scheduled = {id(gs) for _, gs, _ in window_new}
    fresh = {(id(gs), pos) for _, gs, pos in window_new}
    for b in allocated:
        held = index.get(b)
        if not held:
            continue
        keep = []
        for gs, pos in held:
            if id(gs) not in scheduled:
                keep.append((gs, pos))
                continue
            ids = gs.block_ids
            if pos < len(ids) and ids[pos] == b and (id(gs), pos) not in fresh:
                ids[pos] = 0
        index[b] = keep
    for b, gs, pos in window_new:
        index.setdefault(b, []).append((gs, pos))


def _untracked_not_recorded(
    self: OffloadingScheduler, new_ids: Sequence[Sequence[int]], allocated: set[int]
) -> None:
    self.counters.unknown_scheduled_requests += 1  # skipped before its blocks are recorded


def _clear_block_lists_keeping_window_positions(self: OffloadingScheduler, req: Any) -> None:
    # before the leak fix: the lists are dropped, their window-index entries are not
    req.store_floor = 0
    for gs in req.groups:
        gs.block_ids.clear()
        gs.cursor = 0


def _release_keeping_window_positions(self: SchedulerEffects, req: Any) -> None:
    self.sched._reqs.pop(req.req_id, None)  # forgotten, but its window-index entries stay
    self.sched._awaiting_signal.pop(req.req_id, None)


_real_alloc = OffloadingScheduler.update_state_after_alloc


def _alloc_load_not_recorded(
    self: OffloadingScheduler, request: Any, block_ids: Any, num_external_tokens: int
) -> None:
    before = set(self._batch.allocated)
    _real_alloc(self, request, block_ids, num_external_tokens)
    if num_external_tokens > 0:  # recorded only once the request is scheduled, steps later
        self._batch.allocated.intersection_update(before)


_real_build_stores = OffloadingScheduler._build_store_jobs


def _final_stores_skipped(
    self: OffloadingScheduler, rec: Any, store_jobs: Any, finished: bool
) -> None:
    if finished:
        return  # a finished request's last chunks are silently never stored
    _real_build_stores(self, rec, store_jobs, finished)


_real_output = OffloadingScheduler.update_connector_output


def _failed_loads_forgotten(self: OffloadingScheduler, output: Any) -> Any:
    result = _real_output(self, output)
    if not result.failed_loads:
        return result
    kept = dict(sorted(result.failed_loads.items())[1:])  # the first failed load goes unsaid
    return dataclasses.replace(result, failed_loads=kept)


_real_pending_push_work = OffloadingScheduler.has_pending_push_work


def _pending_without_unsent_flush(self: OffloadingScheduler) -> bool:
    batch = self._batch
    unsent, batch.flush = batch.flush, set()  # a flush not sent yet is not pending work
    try:
        return _real_pending_push_work(self)
    finally:
        batch.flush = unsent


def _flush_request_noop(self: SchedulerEffects, req: Any) -> None:
    return None  # a preempted request's in-flight jobs are not flushed


_real_lru_evict = LRUCachePolicy.evict
_real_arc_evict = ARCCachePolicy.evict


def _lru_evict_unprotected(self: LRUCachePolicy, n: int, protected: Any) -> Any:
    return _real_lru_evict(self, n, frozenset())  # offered keys are eviction candidates


def _arc_evict_unprotected(self: ARCCachePolicy, n: int, protected: Any) -> Any:
    return _real_arc_evict(self, n, frozenset())


def _keep_block_lists(self: SchedulerEffects, req: Any) -> None:
    return None  # the preempted request keeps the block lists the engine just freed


_real_manager_error = SchedulerState._manager_error


def _escaping(*calls: str) -> Any:
    """A ``_manager_error`` that lets the error of a manager call named in ``calls`` leave
    its hook at once, from where it was caught (the handling before this was mended)."""

    def manager_error(self: OffloadingScheduler, exc: Exception, what: str, then: str) -> None:
        if any(call in what for call in calls):
            raise exc
        _real_manager_error(self, exc, what, then)

    return manager_error


def _bare_shutdown(self: OffloadingScheduler) -> None:
    # the scheduler's shutdown before 679bb97: the manager's error went out as it was raised,
    # untyped or typed, and was not counted
    self.manager.shutdown()


def _reset_not_retried(self: OffloadingScheduler) -> str | None:
    # the first mend of a raising manager reset: caught and counted, nothing pending
    try:
        self.manager.reset_cache()
    except Exception as exc:
        self._manager_error(exc, "the manager's reset_cache", "(returned False)")
        return str(exc)
    return None


def _completion_error_midway(
    self: OffloadingScheduler, exc: Exception, what: str, then: str
) -> None:
    # before 95eb2e7: a typed error was counted and raised at once in checked mode, anything
    # else escaped untyped; either way from inside the completion, before its bookkeeping
    if "complete_" not in what:
        _real_manager_error(self, exc, what, then)
        return
    if isinstance(exc, ManagerError):
        self.counters.manager_errors += 1
        if not self.checked:
            return
    raise exc


def _manager_error_ignored(self: OffloadingScheduler, exc: Exception, what: str, then: str) -> None:
    return None  # silently tolerated: never counted, never raised


_real_update_req_states = OffloadingScheduler._update_req_states
_real_apply_preemptions = OffloadingScheduler._apply_preemptions


def _update_then_preempt(self: OffloadingScheduler, output: Any) -> Any:
    scheduled = _real_update_req_states(self, output)
    _real_apply_preemptions(self, output)  # after the entries: a resumed request's lists go
    return scheduled


def _rewind_keeping_cursors(self: SchedulerEffects, req: Any) -> None:
    self.sched._dormant.discard(req.req_id)  # the store position stays where it was: what the reset
    # dropped is never offered again, later chunks are stored behind a hole


_real_window_hits = kernels.window_hits


def _window_hits_through_pending(results: Sequence[int], window: int) -> int | None:
    # a pending chunk (store or promotion in flight) counts as loadable inside a window
    hit = int(LookupResult.HIT)
    return _real_window_hits([hit if r == LookupResult.HIT_PENDING else r for r in results], window)


def _mutant(
    name: str, description: str, bug_class: str, *patches: tuple[Any, str, Any]
) -> tuple[str, Mutant]:
    return name, Mutant(name, description, bug_class, tuple(patches))


MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "jobs_to_flush_dropped",
            "build_connector_meta never tells the workers to flush jobs on reused blocks",
            "INV-FENCE: fenced stores not flushed before their blocks are rewritten",
            (OffloadingScheduler, "build_connector_meta", _build_without_flushes),
        ),
        _mutant(
            "reset_keeps_request_job_sets",
            "reset_cache discards jobs but keeps them in each request's in-flight job set",
            "seed 004: reset leaves requests waiting on discarded jobs",
            (SchedulerEffects, "discard_job", _discard_keeping_request_set),
        ),
        _mutant(
            "reset_invalidates_sent_loads",
            "reset_cache writes off loads the workers run: finished, blocks invalid",
            "a reset fails a request under vLLM's default kv_load_failure_policy",
            (OffloadingScheduler, "reset", _reset_invalidating_sent_loads),
        ),
        _mutant(
            "evictions_unannounced",
            "the CPU manager evicts and resets without a removed event",
            "INV-EVENTS: event consumers (routers, KV-event subscribers) told of blocks that are "
            "gone (the simulator took no events before, so nothing looked)",
            (CPUOffloadingManager, "take_events", _take_events_without_removals),
        ),
        _mutant(
            "manager_error_mid_completion",
            "a manager error raised by complete_store/complete_load leaves the completion at "
            "once: the job stays in flight with its fences, an untyped error escapes untyped",
            "INV-MGR-ERROR: one manager error hangs a request (fixed in 95eb2e7; no verifier "
            "injected manager errors before)",
            (SchedulerState, "_manager_error", _completion_error_midway),
        ),
        _mutant(
            "manager_errors_swallowed",
            "every manager error a hook catches is silently dropped: not counted, never raised",
            "INV-MGR-ERROR: a tolerated error that nothing counts (a manager's bug goes unseen)",
            (SchedulerState, "_manager_error", _manager_error_ignored),
        ),
        _mutant(
            "prepare_store_error_escapes",
            "an error the manager raises from prepare_store leaves build_connector_meta at "
            "once: the step's metadata is lost, the error goes into the engine",
            "INV-MGR-ERROR: one manager error in one request's store offer fails the engine "
            "step (vLLM: the engine)",
            (SchedulerState, "_manager_error", _escaping("prepare_store")),
        ),
        _mutant(
            "lookup_and_signal_errors_escape",
            "an error the manager raises from lookup_many, on_schedule_end or "
            "on_request_finished leaves the hook at once, into the engine",
            "INV-MGR-ERROR: one manager error in a lookup, a schedule end or a finish "
            "notice fails the engine (before the fix every manager call but the "
            "completions could)",
            (
                SchedulerState,
                "_manager_error",
                _escaping("lookup_many", "on_schedule_end", "on_request_finished"),
            ),
        ),
        _mutant(
            "prepare_load_error_escapes",
            "an error the manager raises from prepare_load leaves update_state_after_alloc "
            "into the engine, which has allocated the load's blocks",
            "INV-MGR-ERROR: one manager error while a load is set up fails the engine",
            (SchedulerState, "_manager_error", _escaping("prepare_load")),
        ),
        _mutant(
            "failed_reset_not_retried",
            "a manager's reset_cache error is counted and reset_cache returns False, but the "
            "manager's reset is never retried: it keeps the write-pending and pinned keys of "
            "the jobs the reset discarded (which get no completion), and its pre-reset chunks",
            "INV-TERM / INV-LIVE: one failed manager reset leaks slots for good",
            (OffloadingScheduler, "_reset_manager", _reset_not_retried),
        ),
        _mutant(
            "new_request_error_escapes",
            "an error the manager raises from on_new_request leaves the hook that tracks the "
            "request (on_new_request, a lookup, an untracked finish) into the engine",
            "INV-MGR-ERROR: one manager error on a request's arrival fails the engine",
            (SchedulerState, "_manager_error", _escaping("on_new_request")),
        ),
        _mutant(
            "get_stats_error_escapes",
            "an error the manager raises from get_stats leaves the scheduler's get_stats into "
            "the engine, which takes the stats after every step",
            "INV-MGR-ERROR: one manager error while metrics are taken fails the engine's step",
            (SchedulerState, "_manager_error", _escaping("get_stats")),
        ),
        _mutant(
            "pending_work_error_escapes",
            "an error the manager raises from has_pending_work leaves the scheduler's "
            "has_pending_push_work into the engine, which asks before every step (vLLM's "
            "has_requests)",
            "INV-MGR-ERROR: one manager error while the engine asks whether to step kills its loop",
            (SchedulerState, "_manager_error", _escaping("has_pending_work")),
        ),
        _mutant(
            "shutdown_error_escapes",
            "the scheduler's shutdown lets the manager's shutdown error out as it was raised "
            "(an untyped one untyped) and does not count it",
            "INV-MGR-ERROR: an engine that shuts down gets an untyped exception, or a manager "
            "error no counter shows",
            (OffloadingScheduler, "shutdown", _bare_shutdown),
        ),
        _mutant(
            "take_events_error_escapes",
            "an error the manager raises from take_events leaves the scheduler's take_events "
            "into the engine, which takes the events after every step",
            "INV-MGR-ERROR: one manager error while events are taken fails the engine's step",
            (SchedulerState, "_manager_error", _escaping("take_events")),
        ),
        _mutant(
            "reset_error_escapes",
            "an error the manager raises from reset_cache leaves the scheduler's reset_cache "
            "into the engine (before this was mended, the stale threshold had not moved yet)",
            "INV-MGR-ERROR: one manager error during an operator's reset fails the engine",
            (SchedulerState, "_manager_error", _escaping("reset_cache")),
        ),
        _mutant(
            "quorum_of_one",
            "the first worker's report completes a job",
            "INV-QUORUM: a job completes before every worker finished",
            (kernels, "apply_report", _apply_quorum_one),
        ),
        _mutant(
            "late_report_after_stall_raises",
            "a report for a stalled job raises KeyError into the engine",
            "seed 000: late reports after a stall crash the scheduler",
            (kernels, "classify_report", _classify_raising),
        ),
        _mutant(
            "fence_index_not_consulted",
            "store sources are never entered in the fence index",
            "INV-FENCE: reuse of a block under an in-flight store is not flushed",
            (kernels, "fence_add", _fence_add_noop),
        ),
        _mutant(
            "complete_store_always_success",
            "the CPU manager marks failed and stalled stores loadable",
            "INV-FAIL-STATE: a failed store's garbage is served as a hit",
            (CPUOffloadingManager, "complete_store", _complete_store_always_ok),
        ),
        _mutant(
            "failed_store_slots_leaked",
            "the CPU manager never frees the slots of a failed store",
            "lost capacity with no byte wrong: the cache shrinks by a slot per failed store "
            "(the simulator and the fuzzer ran no manager recount before; now one after every "
            "drain)",
            (CPUOffloadingManager, "complete_store", _complete_store_leaking_slots),
        ),
        _mutant(
            "stale_window_block_stored",
            "a freed sliding-window block handed out while its owner is not scheduled stays "
            "in the owner's store sources",
            "wrong bytes: stale sliding-window blocks stored; INV-OWN",
            (
                SchedulerState,
                "_drop_stale_window_blocks",
                _drop_stale_window_blocks_scheduled_only,
            ),
        ),
        _mutant(
            "dropped_block_lists_stay_window_indexed",
            "a preempted or resumed request's dropped block lists keep their sliding-window "
            "index entries (until the block is reused, or forever once the request is released)",
            "leak: per-request window-index entries outlive their positions; INV-REF, "
            "simulator leak check",
            (
                SchedulerState,
                "_clear_block_lists",
                _clear_block_lists_keeping_window_positions,
            ),
        ),
        _mutant(
            "released_request_stays_window_indexed",
            "a released request's sliding-window index entries are kept",
            "leak: per-request window-index entries outlive their request; INV-REF, "
            "simulator leak check",
            (SchedulerEffects, "release_request", _release_keeping_window_positions),
        ),
        _mutant(
            "untracked_allocation_not_fenced",
            "blocks scheduled for a request this connector does not track are not recorded "
            "as handed out",
            "wrong bytes: another connector's allocation not fenced; INV-OWN",
            (OffloadingScheduler, "_untracked_scheduled", _untracked_not_recorded),
        ),
        _mutant(
            "over_report_completes_job",
            "a count-only report for more workers than outstanding completes the job",
            "a job completes before every worker finished; INV-QUORUM",
            (kernels, "over_report", lambda pending, ok, bad: False),
        ),
        _mutant(
            "final_store_never_built",
            "a finished request's final store is silently never built",
            "a store that never happens (cache lost, bytes fine); INV-STORE-COMPLETE",
            (OffloadingScheduler, "_build_store_jobs", _final_stores_skipped),
        ),
        _mutant(
            "evicts_offered_key",
            "eviction ignores the keys offered to prepare_store in the same call",
            "a manager evicts a key it was just offered; INV-EVICT",
            (LRUCachePolicy, "evict", _lru_evict_unprotected),
            (ARCCachePolicy, "evict", _arc_evict_unprotected),
        ),
        _mutant(
            "async_load_allocation_not_fenced",
            "blocks allocated for an asynchronous load are recorded only when the request is "
            "scheduled (steps later)",
            "allocations for an external load scheduled in a later step; INV-OWN",
            (OffloadingScheduler, "update_state_after_alloc", _alloc_load_not_recorded),
        ),
        _mutant(
            "preempt_without_flush",
            "a preempted request's in-flight jobs are not flushed",
            "preemption does not flush a request's stores; INV-FLUSH-PREEMPT",
            (SchedulerEffects, "flush_request", _flush_request_noop),
        ),
        _mutant(
            "reset_keeps_store_cursors",
            "reset_cache leaves every live request's store cursors where they were",
            "a blind spot of every whole-stack checker: chunks a reset dropped are never "
            "offered again (later chunks stored behind a hole no prefix gets past; bytes "
            "fine); INV-STORE-COMPLETE",
            (SchedulerEffects, "rewind_request", _rewind_keeping_cursors),
        ),
        _mutant(
            "window_loads_pending_chunks",
            "a sliding-window lookup takes a window holding a chunk whose store is in flight "
            "as loadable",
            "a blind spot of every whole-stack checker: a load planned over a HIT_PENDING "
            "chunk (the manager refuses it: a manager error, a recompute); INV-LOAD-HIT, "
            "INV-MGR-ERROR (caused)",
            (kernels, "window_hits", _window_hits_through_pending),
        ),
        _mutant(
            "preempt_keeps_block_lists",
            "a preempted request keeps its freed block lists until it is scheduled again",
            "found by statecore check: a request aborted while re-loading stores from the blocks "
            "of its first allocation (wrong bytes); INV-SRC-VALID",
            (SchedulerEffects, "drop_block_lists", _keep_block_lists),
        ),
        _mutant(
            "failed_loads_forgotten",
            "update_connector_output leaves a failed load out of failed_loads (its blocks "
            "still in invalid_block_ids)",
            "a caller that reads the per-request answer (the vLLM adapter's failed_recving, a "
            "serving engine) takes a failed load's blocks as loaded (garbage KV); the engine "
            "models check the answer against vLLM's own reading of invalid_block_ids",
            (OffloadingScheduler, "update_connector_output", _failed_loads_forgotten),
        ),
        _mutant(
            "metadata_does_not_pickle",
            "a step with no store jobs answers store_keys with a MappingProxyType, which does "
            "not pickle",
            "the engine core dies when vLLM's multiprocess executor pickles the step's "
            "connector metadata to the workers (found by `vllm serve` on vLLM's CPU build; the "
            "in-process engines never pickled it)",
            (scheduler_core, "_NO_KEYS", MappingProxyType({})),
        ),
        _mutant(
            "unsent_flush_not_pending",
            "has_pending_push_work leaves out a flush not sent yet",
            "after a reset (or a stall) with no request left, the engine idles before the flush "
            "reaches the workers: the flushed copies stay in flight there until some later "
            "request's step (found by vLLM's own scheduler scenarios; the engine models kept "
            "stepping while the workers held copies, which vLLM's has_requests cannot see)",
            (OffloadingScheduler, "has_pending_push_work", _pending_without_unsent_flush),
        ),
    ]
)
"""Every seeded mutant by name (see the module docstring for the interface)."""


# -- the Redis tier's mutants (caught by tests/mutants/test_redis_mutants.py's harness) ----------


def _unreadable_keeps_answer(self: redistier.RedisTier, key: OffloadKey) -> None:
    return None  # a key the server cannot serve keeps its old answer (or none: RETRY again)


def _decode_without_checks(
    value: bytes, fingerprint: bytes, key: bytes, length: int
) -> str | memoryview:
    start = redistier.HEADER.size + len(key)  # trusts the header: no layout, key, checksum
    view = memoryview(value)
    return view[start : start + length] if len(view) >= start + length else "corrupt"


def _fingerprint_without_layout(self: redistier.TierLayout, row_bytes: Sequence[int]) -> bytes:
    return bytes(16)  # every layout shares one namespace and one header fingerprint


def _await_nothing(self: redistier.RedisTier, key: OffloadKey, req_id: str) -> None:
    return None  # the answer is not held for the request: max_known_keys may evict it unread


REDIS_MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "redis_unreadable_keeps_answer",
            "a key the server cannot serve (down, slow, missing) keeps answering HIT or RETRY",
            "requests wait on a dead server or on promotions that keep failing",
            (redistier.RedisTier, "_unreadable", _unreadable_keeps_answer),
        ),
        _mutant(
            "redis_decode_unverified",
            "a promotion copies a value's payload without checking layout, key or checksum",
            "a corrupt or foreign value is loaded as a hit (wrong bytes)",
            (redistier, "decode_value", _decode_without_checks),
        ),
        _mutant(
            "redis_namespace_without_layout",
            "the key namespace and header fingerprint ignore the layout",
            "engines of different layouts read each other's bytes",
            (redistier.TierLayout, "fingerprint", _fingerprint_without_layout),
        ),
        _mutant(
            "redis_awaited_answer_evictable",
            "a lookup answer a request awaits is not held for it (max_known_keys evicts it unread)",
            "requests whose pending lookups outnumber max_known_keys evict each other's answers "
            "and are answered RETRY forever (found in the simulator: finished requests stuck)",
            (redistier.RedisTier, "_await", _await_nothing),
        ),
    ]
)
"""The Redis tier's seeded mutants, by name (same interface as :data:`MUTANTS`)."""


# -- the file tier's mutants (caught by tests/mutants/test_file_mutants.py's harness) -----------


def _read_one_any_key(self: filetier.FileTier, key: OffloadKey, slot: int) -> tuple[str, int]:
    # the real read, but the key stored in the file is skipped, not compared with the key
    # asked for: a valid file of another key under this key's name is served
    pool = self.pool
    header = filetier._HEADER
    try:
        with open(self.path_of(key), "rb") as f:
            head = f.read(header.size)
            if len(head) != header.size:
                return "corrupt", 0
            magic, version, key_len, length, crc = header.unpack(head)
            f.read(key_len)
            if magic != filetier._MAGIC or version != filetier._VERSION:
                return "corrupt", 0
            if length != pool.slot_bytes:
                return "corrupt", 0
            actual = self._crc_seed
            for i in range(pool.num_regions):
                row = pool.row(i, slot)
                if f.readinto(row) != len(row):
                    return "corrupt", 0
                actual = zlib.crc32(row, actual)
            if f.read(1) or actual != crc:
                return "corrupt", 0
    except (FileNotFoundError, IsADirectoryError):
        return "missing", 0
    except OSError:
        return "io-error", 0
    return "ok", length


FILE_MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "file_key_unchecked",
            "a file-tier read does not compare the key stored in the file with the key asked for",
            "a blind spot of the whole test suite: a valid chunk file of another key under a "
            "key's name (a copy, a rename, a restore into the wrong place) is served as that "
            "key (wrong bytes)",
            (filetier.FileTier, "_read_one", _read_one_any_key),
        ),
    ]
)
"""The file tier's seeded mutants, by name (same interface as :data:`MUTANTS`)."""


# -- retained state (caught by tests/test_retained_state.py's oracles) ---------------------------

_real_prepare_store = CPUOffloadingManager.prepare_store


def _prepare_store_logging_sizes(
    self: CPUOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> Any:
    out = _real_prepare_store(self, keys, ctx)
    if out is not None and out.keys_to_store:  # the old list: one float per store, kept
        self.__dict__.setdefault("_alloc_history", []).append(float(len(out.keys_to_store)))
    return out


def _sizes_add_listing(self: TransferSizes, sizes: Any) -> None:
    if not isinstance(self._counts, list):  # the old list: one entry per job until asked
        self._counts = list(self._counts.elements())  # type: ignore[assignment]
    self._counts.extend(sizes)


def _sizes_take_listing(self: TransferSizes) -> list[int]:
    counts = self._counts
    self._counts = []  # type: ignore[assignment]
    return list(counts) if isinstance(counts, list) else list(counts.elements())


RETAINED_MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "cpu_alloc_sizes_per_store",
            "the CPU manager keeps one allocation size per store until get_stats",
            "memory flat: ~32 bytes per job retained by an engine that never "
            "asks for stats (the 10^6-job soak's RSS slope)",
            (CPUOffloadingManager, "prepare_store", _prepare_store_logging_sizes),
        ),
        _mutant(
            "tier_events_kept_with_events_off",
            "the tiering manager keeps its tiers' events with the primary's events off",
            "memory flat: one event per stored chunk batch retained by an "
            "engine that never takes events",
            (TieringOffloadingManager, "_drop_tier_events", lambda self: None),
        ),
        _mutant(
            "adapter_sizes_per_job",
            "the vLLM adapter keeps one transfer size per job until get_kv_connector_stats",
            "memory flat: two ints per job retained by an embedding that never asks for stats",
            (TransferSizes, "add", _sizes_add_listing),
            (TransferSizes, "take", _sizes_take_listing),
        ),
    ]
)
"""Retained-state mutants, by name (same interface as :data:`MUTANTS`): each re-introduces a
container that grows with the run's history; the memory oracles catch them, the simulator,
fuzzer and model checker (which see states, not memory) are not asked to."""


ENGINE_OUTPUT_MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "preemption_after_resume",
            "build_connector_meta applies the output's preemptions after its scheduled "
            "entries: a request preempted and resumed in one output loses its resumed block "
            "lists, so its recomputed chunks are never stored again",
            "vLLM's reset_prefix_cache(reset_running_requests=True) preempts outside "
            "scheduling and the next output resumes the request (found by the end-to-end "
            "suite on vLLM's CPU build)",
            (OffloadingScheduler, "_apply_preemptions", lambda self, output: None),
            (OffloadingScheduler, "_update_req_states", _update_then_preempt),
        ),
    ]
)
"""Mutants of how the scheduler reads an engine output that the simulator's and fuzzer's
engine models never produce (same interface as :data:`MUTANTS`); the scheduler unit test of
that output shape (``tests/mutants/test_engine_output_mutants.py``) and the end-to-end suite
on vLLM's CPU build catch them."""


METRICS_MUTANTS: dict[str, Mutant] = dict(
    [
        _mutant(
            "metrics_registered_twice",
            "a second OffloadPrometheus on the same registry registers statecore's metrics "
            "next to the first one's, and prometheus_client refuses them "
            "(Duplicated timeseries)",
            "a second vLLM engine with the connector and stats on in one process fails at "
            "start: vLLM unregisters its own vllm: metrics before it registers them again, "
            "not statecore's (found by the end-to-end suite on vLLM's CPU build)",
            (vllm_metrics, "unregister_statecore_metrics", lambda registry: 0),
        ),
    ]
)
"""Mutants of the vLLM adapter's Prometheus metrics (same interface as :data:`MUTANTS`);
``tests/mutants/test_metrics_mutants.py`` catches them against a real ``prometheus_client``
registry."""


# -- the vLLM adapter's KV-event payloads (caught by tests/vllm/test_event_payload_mutants.py) ---


def _from_vllm_adapter(module: str, name: str) -> Any:
    """``name`` of the vLLM adapter module ``module``, or None where vLLM is not installed (a
    folder named vllm on the path, a namespace package, is not vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    try:
        return getattr(importlib.import_module(f"statecore.adapters.{module}"), name)
    except ImportError:  # another vLLM release than the adapter's
        return None


_EventPayloads = _from_vllm_adapter("vllm", "EventPayloads")


class _NextChunksTokens:
    """A request as ``EventPayloads.record_store`` reads it, whose token ids start one chunk
    late: each chunk's payload gets the next chunk's tokens."""

    def __init__(self, request: Any, shift: int) -> None:
        self.block_hashes = request.block_hashes
        self.all_token_ids = request.all_token_ids[shift:]
        self.lora_request = getattr(request, "lora_request", None)


def _record_store_next_chunks_tokens(self: Any, request: Any, keys: Sequence[OffloadKey]) -> None:
    _real_record_store(self, _NextChunksTokens(request, self._tpc[0]), keys)


def _to_kv_events_popping_new_stores(self: Any, events: Any) -> Any:
    self._unannounced.clear()  # a removal drops the payload a new store of the chunk recorded
    return _real_to_kv_events(self, events)


def _to_kv_events_one_at_a_time(self: Any, events: Any) -> Any:
    out = []
    for ev in events:  # each event a batch of its own: a removal drops the payload at once
        out += _real_to_kv_events(self, [ev])
    return out


def _reset_dropping_payloads(self: Any) -> None:
    self._payloads.clear()  # before the reset's removal events are made from them
    self._stale.clear()
    self._unannounced.clear()


if _EventPayloads is not None:
    _real_record_store = _EventPayloads.record_store
    _real_to_kv_events = _EventPayloads.to_kv_events
    EVENT_PAYLOAD_MUTANTS: dict[str, Mutant] = dict(
        [
            _mutant(
                "payload_lookup_not_recorded",
                "EventPayloads.record_lookup records nothing: a chunk a lookup finds offloaded "
                "gets a payload only if this engine's request stored it",
                "a chunk promoted from a secondary tier (stored before a reset, or by another "
                "engine sharing the tier) was announced with vLLM's placeholder payload in "
                "self-describing KV events (found by vLLM's own connector tests; vLLM's "
                "connector records lookup hits)",
                (_EventPayloads, "record_lookup", lambda self, request, keys, pending=(): None),
            ),
            _mutant(
                "payload_tokens_of_next_chunk",
                "a stored chunk's payload carries the token ids of the chunk after it (off by "
                "one chunk)",
                "a KV event whose token ids do not hash to the block hashes it announces",
                (_EventPayloads, "record_store", _record_store_next_chunks_tokens),
            ),
            _mutant(
                "payload_removed_under_a_new_store",
                "a removal event drops the chunk's payload even when a store of the chunk, "
                "recorded since, is still to be announced",
                "the chunks a reset drops and running requests store again at once (or a "
                "chunk evicted and stored again in one step) were announced with the "
                "placeholder payload: the removal of the old copy, converted after the new "
                "store job was built, dropped its payload (found by the payload oracle: 653 "
                "chunks in one reset run)",
                (_EventPayloads, "to_kv_events", _to_kv_events_popping_new_stores),
            ),
            _mutant(
                "payload_dropped_at_removal",
                "a removal event drops the chunk's payload at once, not at the end of its batch",
                "a chunk the CPU tier moves into a secondary tier (the CPU removal first in the "
                "batch, then the file tier's store) was announced there with the placeholder "
                "payload (found by the payload oracle: about 500 of 1,731 file-tier stores in "
                "one tiering run)",
                (_EventPayloads, "to_kv_events", _to_kv_events_one_at_a_time),
            ),
            _mutant(
                "payload_dropped_at_reset",
                "a cache reset drops every payload at once, before the reset's removal events "
                "are made from them",
                "a reset's removal of a chunk of several blocks names only its key's hash: "
                "the other block hashes it was announced with are never removed",
                (_EventPayloads, "reset", _reset_dropping_payloads),
            ),
        ]
    )
else:
    EVENT_PAYLOAD_MUTANTS = {}
"""Mutants of the vLLM adapter's self-describing KV-event payloads (same interface as
:data:`MUTANTS`; empty where vLLM is not installed, since they patch the adapter's
``EventPayloads``); the payload oracle of ``tests/vllm/kv_event_oracle.py`` catches them in
vLLM engine runs (``tests/vllm/test_event_payload_mutants.py``)."""


# -- the wrapper of a vLLM manager behind statecore's scheduler ---------------------------------


_VllmSpecManager = _from_vllm_adapter("vllm_spec", "VllmSpecManager")


def _prepare_load_not_undone(self: Any, keys: Any, ctx: Any) -> Any:
    with self._held():  # a refused spec raises with the pins the call took still held
        spec = self.vllm.prepare_load(list(keys), self._ctx(ctx))
    return self._load_store_spec(spec, "prepare_load", len(keys))


def _prepare_store_not_undone(self: Any, keys: Any, ctx: Any) -> Any:
    from statecore.manager import PrepareStoreOutput

    with self._held():  # a refused spec raises with the room the call allocated still taken
        out = self.vllm.prepare_store(list(keys), self._ctx(ctx))
    if out is None:
        return None
    to_store = tuple(out.keys_to_store)
    spec = self._load_store_spec(out.store_spec, "prepare_store", len(to_store))
    return PrepareStoreOutput(to_store, spec, tuple(out.evicted_keys))


if _VllmSpecManager is not None:
    from statecore.adapters.vllm_manager import VllmManagerAdapter as _VllmManagerAdapter

    _adapter_on_schedule_end = _VllmManagerAdapter.on_schedule_end
    VLLM_WRAPPER_MUTANTS: dict[str, Mutant] = dict(
        [
            _mutant(
                "spec_refusal_not_undone",
                "a load or store spec the spec wrapper refuses leaves the vLLM manager's pins "
                "or allocated room behind",
                "a typed error that changed the manager's state: keys write-pending and pins "
                "held for good (found while the two wrappers of a vLLM manager were merged)",
                (_VllmSpecManager, "prepare_load", _prepare_load_not_undone),
                (_VllmSpecManager, "prepare_store", _prepare_store_not_undone),
            ),
            _mutant(
                "spec_stats_not_taken",
                "the spec wrapper never asks the vLLM manager for its statistics",
                "state a vLLM manager keeps until asked grows for good behind statecore's "
                "scheduler (its allocation sizes, one per store)",
                (_VllmSpecManager, "get_stats", lambda self: {}),
            ),
            _mutant(
                "reset_flush_never_sent",
                "the spec wrapper forwards on_schedule_end without on_reset_flushed after a reset",
                "a vLLM manager waiting for a call statecore's scheduler never makes: vLLM's "
                "tiering manager stopped promoting after a reset",
                (_VllmSpecManager, "on_schedule_end", _adapter_on_schedule_end),
            ),
        ]
    )
else:
    VLLM_WRAPPER_MUTANTS = {}
"""Seeded mutants of :class:`~statecore.adapters.vllm_spec.VllmSpecManager` (empty without
vLLM): each must fail ``tests/vllm/test_vllm_wrappers.py``'s test of its rule."""
