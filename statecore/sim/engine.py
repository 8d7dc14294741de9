"""The simulated engine: an LLM serving loop that drives the real statecore stack.

Per step, in vLLM 0.33's order, which :mod:`statecore.sim.step` defines once for both engine
models (its ``Scheduler.schedule()``, the workers, then its ``update_from_output``):

1. running requests, in running order: chunked prefill, then one decode token per step; when
   blocks run out, the newest running request is preempted (blocks freed, listed in
   ``preempted_req_ids``), the request itself last; a request that preempted itself ends
   this phase;
2. only when phase 1 preempted nothing: waiting requests, those that hold KV blocks first (a
   load ended, failed or not), then the others, each in arrival order (vLLM 0.33's
   ``kv_holding_waiting`` queue): local GPU prefix-cache hit, then
   ``get_num_new_matched_tokens``; ``None`` keeps the request waiting; an asynchronous hit
   allocates blocks, calls ``update_state_after_alloc`` and parks the request until its id
   appears in ``finished_loads``; otherwise the request is allocated and scheduled;
3. ``build_connector_meta``;
4. every worker rank: ``start_step`` (flush, loads), compute (the scheduled tokens' KV bytes are
   written into their GPU blocks), ``end_step``, ``build_worker_metadata``; the reports pass the
   fault channel and are aggregated;
5. the step's outputs: each scheduled request's tokens; a request that reached its output
   length finishes: ``request_finished``, then its blocks are freed at once;
6. the aggregated report to ``update_connector_output``; the engine learns of the loads that
   ended (see below).

Aborts come between steps: ``request_finished``, then the request's blocks are freed at once
(an aborted request that waits on a load keeps its blocks until the load ended).

With vLLM's order come the parts of vLLM 0.33's KV-cache manager that decide which block ids
a connector sees: an admission needs room for the request's whole sequence (its
``scheduler_reserve_full_isl``), and an asynchronous load also leaves free what the prefills
in flight still need; the blocks a step's tokens fill are cached when they are allocated; a
freed block without a hash is handed out next, a cached one last; a sliding-window group
skips ``computed - window + 1`` tokens (:attr:`SimConfig.vllm_window`), and a finished
request's blocks out of the window are freed before the rest; new and resumed requests are
listed first, resumed ones as new. Waiting requests sit in vLLM's two queues
(:func:`statecore.sim.step.waiting_order`). A load that ended with invalid blocks (failed or
stalled) is learnt a step after the connector ends it (vLLM learns it from the workers, to
whom the next step's metadata echoes it): its request falls back to the first invalid block,
or restarts from token 0 in a layout of several KV-cache groups; a request whose load ended
is promoted when the waiting phase reaches it (its loaded blocks cached, or all its blocks
freed when nothing was valid). ``tests/vllm/test_engine_differential.py`` runs the same
workloads, with and without failing loads, through vLLM's real ``Scheduler`` and asserts the
same connector calls step by step. Not modelled: the sliding-window admission cap
(``max_admission_blocks_per_request``, larger than the differential test's sequences).

After every step: ``scheduler.check_invariants()``, the data oracle over every valid GPU block,
the allocator's own consistency, and INV-LIVE (no request deferred or waiting on a load for
more than a bounded number of steps; a deferral counts the steps in which the engine asked).
Engine progress (:meth:`SimEngine._note_progress`): requests waiting with nothing running,
none of them loading or deferred, for as many steps as INV-LIVE allows, is a jam of the engine
model (a GPU pool too small for what its waiting requests hold; the connector owes them
nothing, so it is not a failure of the connector). The report warns of it: the figures after
it measure nothing.

KV-cache groups (``SimConfig.groups``, see :data:`GROUP_PRESETS`): every group has its own
block size, its own canonical tensors and its own block table per request; the block ids come
from one shared pool (as in an engine whose groups share one allocator), and the prefix cache
is per group. A sliding-window group frees, each time its request is scheduled, the blocks
that left the window and puts the null block 0 in their place (also in the block lists of an
admission after a prefix hit); a freed block keeps its cached hash and can be handed to another
request in any later step. The data oracle is per group (each group's tensors, its own block
hashes).

Engine behaviours beside the common ones: asynchronous loads (blocks allocated in one step,
the request scheduled in a later one), blocks handed to *foreign* requests that this connector
never saw (another connector's requests: scheduled, computed into, freed), immediate reuse of
freed blocks (``reuse_freed_first``: a freed block is the next one handed out), preemption with
stores in flight, finishes with final stores, aborts in every request state.

Expectation oracles (:mod:`statecore.specs.invariants`): INV-OWN (no store reads a block
handed to another owner before the store was flushed), INV-FLUSH-PREEMPT (a preempted
request's in-flight jobs are in that step's flush set), INV-EVICT at whole-stack level (on
every ``prepare_store``, through :class:`ObservedManager`) and INV-STORE-COMPLETE (every full
chunk a finished request produced was offered to the manager or is known to it).
"""

from __future__ import annotations

import enum
import math
import pickle
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from statecore.config import GroupConfig
from statecore.errors import InvariantViolation, ManagerError, StatecoreError
from statecore.keys import OffloadKey
from statecore.manager import Medium, OffloadingEvent
from statecore.sim import step as vllm_step
from statecore.sim.blocks import BlockPool
from statecore.sim.faults import ReportChannel, SimFaults
from statecore.sim.hashing import ROOT_HASH, extend_block_hashes
from statecore.sim.kv import KVCache
from statecore.sim.presets import GROUP_PRESETS
from statecore.sim.step import StepPass
from statecore.sim.workload import Turn, Workload, WorkloadConfig
from statecore.specs import invariants as oracles
from statecore.views import Request, ScheduledRequest, SchedulerOutput
from statecore.wire import ConnectorMetadata, WorkerMetadata

__all__ = [
    "FAULTY_CALLS",
    "GROUP_PRESETS",
    "ConnectorLike",
    "EngineStats",
    "InjectedManagerBug",
    "InjectedManagerError",
    "InjectedManagerFault",
    "ObservedManager",
    "RankStack",
    "SimClock",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "Status",
    "kv_groups",
    "reraise",
    "shutdown_observed",
    "update_observed",
]


def kv_groups(name: str, tokens_per_block: int) -> tuple[GroupConfig, ...]:
    """The KV-cache groups of preset ``name`` for hash blocks of ``tokens_per_block`` tokens
    (even, so that the windows are whole tokens)."""
    t = tokens_per_block
    if name == "full":
        return (GroupConfig(t),)
    if name == "hybrid":
        return (GroupConfig(t), GroupConfig(t, 5 * t // 2))
    if name == "mixed":
        return (GroupConfig(t), GroupConfig(2 * t, 3 * t))
    if name == "hybrid3":
        return (GroupConfig(t), GroupConfig(t, 5 * t // 2), GroupConfig(t, 11 * t // 2))
    raise ValueError(f"unknown KV-group preset {name!r} (known: {', '.join(GROUP_PRESETS)})")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that shapes one simulation run (the seed fixes the rest).

    Attributes:
        seed: seeds every random stream of the run.
        steps: engine steps before the remaining requests are aborted and the run drains.
        num_workers: worker ranks (each with its own KV tensors and CPU pool).
        workload: the request mix.
        faults: fault probabilities.
        groups: the KV-cache group preset (:data:`GROUP_PRESETS`).
        tokens_per_block: the hash block size in tokens (the smallest group block size).
        blocks_per_chunk: GPU blocks per offloaded chunk.
        num_gpu_blocks: GPU blocks per rank, null block 0 included.
        cpu_slots: chunk slots of the CPU tier.
        page_bytes: bytes of one block in one canonical KV tensor.
        num_tensors: canonical KV tensors per rank.
        max_batched_tokens: token budget per step.
        max_running: at most this many running requests.
        watermark_blocks: admission keeps this many blocks free for running requests.
        step_seconds: injected-clock seconds per step.
        stall_timeout_s: the scheduler's stall timeout.
        stall_check_interval_s: the scheduler's stall check interval.
        live_bound_steps: INV-LIVE bound; 0 derives it from the stall timeout.
        drain_steps: at most this many steps to drain at the end; 0 derives it.
        manager: ``lru``, ``arc``, ``request-lru`` or ``request-arc`` (the CPU tier alone, with
            that policy) or ``tiering``
            (an LRU CPU tier with three file-system secondaries: a fast one, a slow one whose
            jobs complete steps later, and one whose jobs fail at random).
        tiering: shorthand for ``manager="tiering"``.
        foreign_prob: per-step probability that blocks are handed to a foreign request (one
            this connector never sees) for a few steps.
        reuse_freed_first: hand out the most recently freed block first (immediate reuse).
        checked: run the scheduler in checked mode (lifecycle machines beside the tables).
        copy_impl: the torch adapter's copy mode on the CPU tensors: ``"auto"`` (direct
            copies) or ``"staging"`` (the CUDA staging path's code: queued jobs, bounce
            buffers, the host scatter of a store when it completes).
        vllm_window: a sliding-window group frees its blocks as vLLM 0.33 does (the next
            token attends to the last ``window`` tokens: ``computed - window + 1`` skipped),
            one token earlier than this engine's earlier rule (``computed - window``, kept
            with ``False`` to compare runs). On by default and in the differential test
            against vLLM.
    """

    seed: int = 0
    steps: int = 4000
    num_workers: int = 2
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    faults: SimFaults = field(default_factory=lambda: SimFaults.preset("default"))
    groups: str = "hybrid"
    tokens_per_block: int = 16
    blocks_per_chunk: int = 2
    num_gpu_blocks: int = 128
    cpu_slots: int = 192
    page_bytes: int = 256
    num_tensors: int = 2
    max_batched_tokens: int = 256
    max_running: int = 12
    watermark_blocks: int = 4
    step_seconds: float = 0.5
    stall_timeout_s: float = 20.0
    stall_check_interval_s: float = 2.0
    live_bound_steps: int = 0
    drain_steps: int = 0
    manager: str = "lru"
    tiering: bool = False
    foreign_prob: float = 0.05
    reuse_freed_first: bool = False
    checked: bool = False
    copy_impl: str = "auto"
    vllm_window: bool = True

    def kv_groups(self) -> tuple[GroupConfig, ...]:
        """The KV-cache groups of this run."""
        return kv_groups(self.groups, self.tokens_per_block)

    def manager_kind(self) -> str:
        """``lru``, ``arc`` or ``tiering``."""
        return "tiering" if self.tiering else self.manager

    def live_bound(self) -> int:
        """INV-LIVE: steps a request may stay deferred or waiting on one load."""
        if self.live_bound_steps:
            return self.live_bound_steps
        per = (self.stall_timeout_s + 2 * self.stall_check_interval_s) / self.step_seconds
        return 2 * math.ceil(per) + 2 * self.faults.max_report_delay + 30

    def drain_bound(self) -> int:
        """Steps the final drain may take."""
        return self.drain_steps or 3 * self.live_bound()


class SimClock:
    """The injected clock: ``clock()`` returns simulated seconds."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ConnectorLike(Protocol):
    """The scheduler API the engine drives (``statecore.OffloadingScheduler``)."""

    def on_new_request(self, request: Any) -> None: ...
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]: ...
    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> object: ...
    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata: ...
    def update_connector_output(self, meta: WorkerMetadata | None) -> Any: ...
    def request_finished(self, request: Any) -> tuple[bool, None]: ...
    def has_pending_push_work(self) -> bool: ...
    def reset_cache(self) -> bool | None: ...
    def shutdown(self) -> None: ...
    def check_invariants(self) -> None: ...
    def take_events(self) -> Sequence[OffloadingEvent]: ...

    def get_stats(self) -> dict[str, Any]: ...


class RankStack(Protocol):
    """One worker rank as the engine sees it."""

    def start_step(self, meta: ConnectorMetadata) -> None: ...
    def end_step(self, meta: ConnectorMetadata) -> None: ...
    def report(self) -> WorkerMetadata | None: ...
    def advance(self, step: int) -> None: ...


class Status(enum.Enum):
    """Where a simulated request is in the engine."""

    WAITING = "waiting"
    LOADING = "waiting for remote KV"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class SimRequest:
    """Engine-side state of one request (``blocks``: one block table per KV-cache group, 0 for
    the null block)."""

    turn: Turn
    req: Request
    tokens: list[int]
    arrival: int
    status: Status = Status.WAITING
    blocks: list[list[int]] = field(default_factory=list)
    scheduled_once: bool = False
    resumed: bool = False
    aborted: bool = False
    abort_at: int | None = None
    load: tuple[int, int] | None = None
    load_since: int = 0
    kv_holding: bool = False
    """In vLLM's ``kv_holding_waiting`` queue (:func:`statecore.sim.step.waiting_order`)."""
    load_done: bool = False
    """The engine learned that the load ended (vLLM's finished receiving): the request is
    promoted when the waiting phase next reaches it (:meth:`SimEngine._promote`)."""
    deferred_since: int | None = None
    deferred_last: int = -1
    deferred_steps: int = 0
    """Steps in which the engine asked and the connector deferred, since its last answer
    (a step in which the engine did not ask, its queue being full, does not count)."""
    covered: int = 0
    """Tokens an admission with a load covered (local prefix + loaded): under the chunk-level
    policy the connector never offers those chunks again."""
    hung: bool = False
    epoch: int = 0

    def has_blocks(self) -> bool:
        """Whether the request holds any block table."""
        return any(self.blocks)


@dataclass(eq=False)
class _Foreign:
    """A request of another connector: it holds blocks for a few steps and computes into
    them; this connector only sees it in the scheduler output."""

    req_id: str
    blocks: list[list[int]]
    steps_left: int
    new: bool = True


@dataclass
class EngineStats:
    """What the engine counted itself (the scheduler's own counters are read separately)."""

    steps: int = 0
    drain_steps: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    aborted_during_load: int = 0
    preemptions: int = 0
    deferrals: int = 0
    loads_started: int = 0
    loads_finished: int = 0
    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    tokens_loaded: int = 0
    tokens_recomputed: int = 0
    tokens_computed: int = 0
    resets: int = 0
    foreign_requests: int = 0
    window_blocks_freed: int = 0
    stores_checked: int = 0
    completeness_checked: int = 0
    harness_anomalies: list[str] = field(default_factory=list)
    jams: list[str] = field(default_factory=list)
    """Where the engine model stopped making progress (:meth:`SimEngine._note_progress`)."""
    hung: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    data_errors: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hit_rate_series: list[float] = field(default_factory=list)
    in_flight_series: list[int] = field(default_factory=list)


def reraise(exc: Exception) -> None:
    """Raise ``exc`` again: hands an exception :func:`update_observed` returned to a guard
    that classifies what a call raises (the engine's ``_guard``, the model checker's)."""
    raise exc


def update_observed(
    conn: Any, obs: ObservedManager, meta: WorkerMetadata | None
) -> tuple[Any, Exception | None, str | None]:
    """``conn.update_connector_output(meta)`` with INV-MGR-ERROR
    (:func:`statecore.specs.invariants.manager_error_violation`) over the manager errors
    ``obs`` injected since the last such call (during it, or from ``prepare_store`` in the
    step's ``build_connector_meta``: those are raised by this call).

    Returns the call's result (None when it raised), what it raised that no injected error
    explains (for the caller's own error accounting) and the violation (or None).
    """
    counters = getattr(conn, "counters", None)
    raised: Exception | None = None
    result: Any = None
    try:
        result = conn.update_connector_output(meta)
    except Exception as exc:
        raised = exc
    injected, obs.injected = obs.injected, []
    before, obs.errors_counted = (
        obs.errors_counted,
        counters.manager_errors if counters is not None else 0,
    )
    jobs: Any = getattr(conn, "jobs", {})
    bad = oracles.manager_error_violation(
        injected,
        raised,
        obs.errors_counted - before,
        bool(getattr(conn, "checked", False)),
        lambda rid: [j for j in jobs.values() if j.req.req_id == rid],
    )
    other = None if oracles.raised_by_injection(raised, injected) else raised
    return result, other, bad


def shutdown_observed(conn: Any, obs: ObservedManager) -> str | None:
    """``conn.shutdown()`` with INV-MGR-ERROR
    (:func:`statecore.specs.invariants.shutdown_error_violation`) over the error ``obs``
    injected into the manager's ``shutdown`` during it, if any. Returns the violation (or
    None). The last call of a run: what it raises is the oracle's, not the engine's."""
    counters = getattr(conn, "counters", None)
    before = counters.manager_errors if counters is not None else 0
    raised: Exception | None = None
    try:
        conn.shutdown()
    except Exception as exc:
        raised = exc
    ours = [i for i in obs.injected if i.call == "shutdown"]
    obs.injected = [i for i in obs.injected if i.call != "shutdown"]
    after = counters.manager_errors if counters is not None else 0
    obs.errors_counted = after
    bad: str | None = oracles.shutdown_error_violation(
        ours[0] if ours else None, raised, after - before
    )
    return bad


class InjectedManagerError(ManagerError):
    """The typed error :class:`ObservedManager` raises from a completion (a fault)."""


class InjectedManagerBug(RuntimeError):
    """The untyped error :class:`ObservedManager` raises from a completion (a manager's bug)."""


@dataclass(frozen=True, slots=True)
class InjectedManagerFault:
    """One manager error injected by :class:`ObservedManager`.

    Attributes:
        error: what was raised.
        call: one of :data:`FAULTY_CALLS`.
        req_id: the request of the call (empty for ``on_schedule_end``).
        keys: the keys of the call.
    """

    error: Exception
    call: str
    req_id: str
    keys: tuple[OffloadKey, ...]

    @property
    def is_store(self) -> bool:
        """Whether the call concerns a store (``complete_store`` or ``prepare_store``)."""
        return self.call in ("complete_store", "prepare_store")

    @property
    def completion(self) -> bool:
        """Whether the call completes a job."""
        return self.call.startswith("complete_")


FAULTY_CALLS: tuple[str, ...] = (
    "complete_store",
    "complete_load",
    "prepare_store",
    "prepare_load",
    "lookup_many",
    "on_schedule_end",
    "on_request_finished",
    "reset_cache",
    "on_new_request",
    "take_events",
    "get_stats",
    "has_pending_work",
    "shutdown",
)
"""The manager calls the manager-error fault of :class:`ObservedManager` makes raise."""


class ObservedManager:
    """A transparent proxy of the manager that the scheduler drives, for the whole-stack
    expectation oracles: INV-EVICT on every ``prepare_store`` (no offered key among the
    evicted ones), and the keys the stack knows of since the last reset (offered to a
    ``prepare_store`` that answered, stored or declined, or found by ``lookup``), for
    INV-STORE-COMPLETE.

    It is also the world's manager-error fault (INV-MGR-ERROR): when :attr:`fail_next` is set
    (for one call) or a draw of ``fault_rng`` falls under ``fault_rate``, one of
    :data:`FAULTY_CALLS` raises: ``complete_store``, ``complete_load`` and
    ``on_request_finished`` after forwarding to the manager, ``prepare_store``,
    ``prepare_load``, ``lookup_many``, ``on_schedule_end``, ``reset_cache``,
    ``on_new_request``, ``take_events``, ``get_stats``, ``has_pending_work`` and ``shutdown``
    without forwarding (nothing changed: a failed reset leaves the manager's contents, a failed
    registration leaves the request unknown to it, failed event or stats taking leaves them
    for the next call, a failed question about pending work leaves that work, a failed
    shutdown is the run's last call); an
    :class:`InjectedManagerError` (typed) or an :class:`InjectedManagerBug` (untyped).
    Either way the manager's state is whole, so a scheduler that goes on as it should leaves
    nothing behind; what was raised waits in :attr:`injected` for the engine's oracle.
    """

    def __init__(
        self, inner: Any, fault_rng: random.Random | None = None, fault_rate: float = 0.0
    ) -> None:
        self._inner = inner
        self.violations: list[str] = []
        self.known: set[OffloadKey] = set()
        self.refused: set[OffloadKey] = set()
        """Keys offered in a ``prepare_store`` that found no room, since the engine last
        cleared the set (at the start of every step)."""
        self.calls = 0
        self.fault_rng = fault_rng
        self.fault_rate = fault_rate
        self.fail_next: str | None = None
        """``"typed"`` or ``"untyped"``: the next call of :attr:`fail_calls` raises that kind
        (then None)."""
        self.fail_calls: frozenset[str] | None = None
        """The calls :attr:`fail_next` may hit (None: any of :data:`FAULTY_CALLS`)."""
        self.injected: list[InjectedManagerFault] = []
        """Errors raised since the engine last took them."""
        self.injected_total = 0
        self.injected_by_call: dict[str, int] = {}
        """How many errors were injected into each call (``prepare_store``, ...)."""
        self.errors_counted = 0
        """The scheduler's ``manager_errors`` when the engine last took :attr:`injected`."""
        self.events_held_back = False
        """The last ``take_events`` raised: the manager still holds events the engine has not
        seen (INV-EVENTS waits for the next call that takes them)."""
        self.registered: set[str] = set()
        """Requests the manager took (``on_new_request`` forwarded) and has not finished:
        INV-STORE-COMPLETE promises nothing for a request it never took."""
        self.answers = oracles.LookupAnswers()
        """This step's lookup answers, for INV-LOAD-HIT on every ``prepare_load``."""

    def _forward(self, call: str, req_id: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the inner manager's ``call``; an error it raises was not injected:
        attributed to the system (INV-MGR-ERROR), a violation, then raised on."""
        try:
            return fn(*args)
        except Exception as exc:
            self.violations.append(oracles.caused_error_violation(call, req_id, exc))
            raise

    def take_events(self) -> Any:
        """Maybe raise (the manager-error fault: the events stay queued); else forward."""
        try:
            self._maybe_fail("take_events", (), "")
        except Exception:
            self.events_held_back = True
            raise
        self.events_held_back = False
        return self._inner.take_events()

    def get_stats(self) -> Any:
        """Maybe raise (the manager-error fault: the stats stay for the next call); else
        forward."""
        self._maybe_fail("get_stats", (), "")
        return self._inner.get_stats()

    def has_pending_work(self) -> bool:
        """Maybe raise (the manager-error fault: its work stays pending); else forward."""
        self._maybe_fail("has_pending_work", (), "")
        return bool(self._inner.has_pending_work())

    def shutdown(self) -> None:
        """Maybe raise (the manager-error fault: the run's last call); else forward."""
        self._maybe_fail("shutdown", (), "")
        self._inner.shutdown()

    def on_new_request(self, ctx: Any) -> Any:
        """Maybe raise (the manager-error fault: the request stays unknown to the manager);
        else forward."""
        self._maybe_fail("on_new_request", (), ctx.req_id)
        out = self._forward("on_new_request", ctx.req_id, self._inner.on_new_request, ctx)
        self.registered.add(ctx.req_id)
        return out

    def complete_store(self, keys: Sequence[OffloadKey], ctx: Any, success: bool = True) -> None:
        """Forward; then maybe raise (the manager-error fault)."""
        self._forward("complete_store", ctx.req_id, self._inner.complete_store, keys, ctx, success)
        self._maybe_fail("complete_store", keys, ctx.req_id)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: Any) -> None:
        """Forward; then maybe raise (the manager-error fault)."""
        self._forward("complete_load", ctx.req_id, self._inner.complete_load, keys, ctx)
        self._maybe_fail("complete_load", keys, ctx.req_id)

    def lookup_many(self, keys: Sequence[OffloadKey], ctx: Any, until_miss: bool = False) -> Any:
        """Maybe raise (the manager-error fault, nothing changed); else forward: a key found
        (ready or pending) is known."""
        self._maybe_fail("lookup_many", keys, ctx.req_id)
        out = self._forward(
            "lookup_many", ctx.req_id, self._inner.lookup_many, keys, ctx, until_miss
        )
        self.answers.looked_up(ctx.req_id, keys, out)
        self.known.update(k for k, r in zip(keys, out, strict=False) if int(r))
        return out

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: Any) -> Any:
        """Maybe raise (the manager-error fault, nothing changed); else check INV-LOAD-HIT
        against this step's lookup answers, then forward."""
        self._maybe_fail("prepare_load", keys, ctx.req_id)
        bad = self.answers.load_violation(ctx.req_id, keys)
        if bad is not None:
            self.violations.append(bad)
        return self._forward("prepare_load", ctx.req_id, self._inner.prepare_load, keys, ctx)

    def on_schedule_end(self, ctx: Any) -> None:
        """Maybe raise (the manager-error fault, nothing changed); else forward. Either way
        the step's lookup answers are spent (INV-LOAD-HIT)."""
        self.answers.step_ended()
        self._maybe_fail("on_schedule_end", (), "")
        self._forward("on_schedule_end", "", self._inner.on_schedule_end, ctx)

    def on_request_finished(self, ctx: Any) -> None:
        """Forward; then maybe raise (the manager-error fault)."""
        self._forward("on_request_finished", ctx.req_id, self._inner.on_request_finished, ctx)
        self.registered.discard(ctx.req_id)
        self._maybe_fail("on_request_finished", (), ctx.req_id)

    def _maybe_fail(self, call: str, keys: Sequence[OffloadKey], req_id: str) -> None:
        kind = self.fail_next
        if kind is not None and (self.fail_calls is None or call in self.fail_calls):
            self.fail_next = None
        else:
            kind = None
            rng = self.fault_rng
            if rng is not None and rng.random() < self.fault_rate:
                kind = "typed" if rng.random() < 0.5 else "untyped"
        if kind is None:
            return
        what = f"{call} for request {req_id!r} ({len(keys)} keys): injected fault"
        exc: Exception = InjectedManagerError(what) if kind == "typed" else InjectedManagerBug(what)
        self.injected.append(InjectedManagerFault(exc, call, req_id, tuple(keys)))
        self.injected_total += 1
        self.injected_by_call[call] = self.injected_by_call.get(call, 0) + 1
        raise exc

    def __getattr__(self, name: str) -> Any:
        if name == "_inner" or name.startswith("__"):
            # not forwarded: a copy or unpickling asks for these before ``_inner`` is set
            raise AttributeError(name)
        return getattr(self._inner, name)

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: Any) -> Any:
        """Maybe raise (the manager-error fault, nothing changed); else forward, then check
        INV-EVICT against the offered keys."""
        offered = list(keys)
        try:
            self._maybe_fail("prepare_store", offered, ctx.req_id)
        except Exception:
            self.refused.update(offered)  # as no room: the scheduler must offer them again
            raise
        out = self._forward("prepare_store", ctx.req_id, self._inner.prepare_store, offered, ctx)
        self.calls += 1
        if out is None:  # no room now: the scheduler must offer them again later
            self.refused.update(offered)
            return out
        self.known.update(offered)
        if out.evicted_keys:
            bad = oracles.evict_violation(ctx.req_id, offered, out.evicted_keys)
            if bad is not None:
                self.violations.append(bad)
        return out

    def lookup(self, key: OffloadKey, ctx: Any) -> Any:
        """Forward; a key found (ready or pending) is known."""
        r = self._forward("lookup", ctx.req_id, self._inner.lookup, key, ctx)
        self.answers.looked_up(ctx.req_id, (key,), (r,))
        if int(r):
            self.known.add(key)
        return r

    def reset_cache(self) -> None:
        """Maybe raise (the manager-error fault, nothing changed); else forward: nothing is
        known any more."""
        self._maybe_fail("reset_cache", (), "")
        self._forward("reset_cache", "", self._inner.reset_cache)
        self.known.clear()


_SchedulePass = StepPass[SimRequest, list[list[int]]]
"""What one step's scheduling has decided so far (:class:`~statecore.sim.step.StepPass`)."""


def as_sent(meta: ConnectorMetadata) -> ConnectorMetadata:
    """The step's metadata as a worker in another process receives it.

    vLLM's multiprocess executor pickles the scheduler output, the connector metadata in it,
    to every worker: the engine models hand the workers a pickled copy, so a value that does not
    pickle (or does not survive the round trip) fails every run instead of only a real
    multi-process engine.
    """
    return cast(ConnectorMetadata, pickle.loads(pickle.dumps(meta, pickle.HIGHEST_PROTOCOL)))


def output_answer_errors(result: Any) -> list[str]:
    """Where :meth:`~statecore.scheduler.OffloadingScheduler.update_connector_output`'s answer
    contradicts itself.

    vLLM's engine reads only ``finished_loads`` and ``invalid_block_ids`` (and maps the blocks
    back to requests), so the engine models read those too; ``failed_loads``, the per-request
    answer a caller that wants it reads instead, must say the same: its requests ended a load
    (are in ``finished_loads``) and its blocks are exactly ``invalid_block_ids``.
    """
    failed = getattr(result, "failed_loads", None)
    if failed is None:  # a connector that does not give the per-request answer
        return []
    errors: list[str] = []
    stray = set(failed) - set(result.finished_loads)
    if stray:
        errors.append(f"failed_loads names {sorted(stray)[:4]}, not in finished_loads")
    blocks: set[int] = set()
    for ids in failed.values():
        blocks.update(ids)
    if blocks != set(result.invalid_block_ids):
        errors.append(
            f"failed_loads' blocks {sorted(blocks)[:8]} are not invalid_block_ids "
            f"{sorted(result.invalid_block_ids)[:8]}"
        )
    return errors


class ResetAnswer:
    """Holds what :meth:`~statecore.scheduler.OffloadingScheduler.reset` answered until the
    calls that must deliver it: its ``flushed_jobs`` in the next step's ``jobs_to_flush``, its
    ``discarded_loads`` in the next :meth:`update_connector_output`'s ``finished_loads`` and
    ``failed_loads`` (their blocks are recomputed)."""

    def __init__(self) -> None:
        self.flush: set[int] = set()
        self.loads: set[str] = set()

    def reset(self, result: Any) -> None:
        """Note a reset's answer (None: the call raised, nothing was answered)."""
        if result is not None and hasattr(result, "flushed_jobs"):
            self.flush.update(result.flushed_jobs)
            self.loads.update(result.discarded_loads)

    def built(self, meta: Any) -> list[str]:
        """The step's metadata: the reset's flushed jobs must be in its ``jobs_to_flush``."""
        missing = self.flush - set(meta.jobs_to_flush)
        self.flush.clear()
        if not missing:
            return []
        return [f"reset answered flushed_jobs {sorted(missing)[:8]}, not in jobs_to_flush"]

    def output(self, result: Any) -> list[str]:
        """The next output's answer: the reset's discarded loads ended, failed."""
        loads, self.loads = self.loads, set()
        failed = getattr(result, "failed_loads", None)
        missing = loads - set(result.finished_loads)
        if failed is not None:
            missing |= loads - set(failed)
        if not missing:
            return []
        return [
            f"reset answered discarded_loads {sorted(missing)[:4]}, not reported ended and "
            "failed by the next update_connector_output"
        ]


class SimEngine:
    """The engine loop over a connector, worker ranks and the data oracle.

    Args:
        cfg: the run configuration.
        connector: the scheduler (already built over its manager, with ``clock``).
        stacks: one :class:`RankStack` per worker rank.
        kv: the GPU KV tensors the ranks copy from and to.
        clock: the clock the connector reads.
        in_flight: returns the number of the connector's in-flight jobs (for the plot).
    """

    def __init__(
        self,
        cfg: SimConfig,
        connector: ConnectorLike,
        stacks: Sequence[RankStack],
        kv: KVCache,
        clock: SimClock,
        in_flight: Callable[[], int] = lambda: 0,
        channel: ReportChannel | None = None,
        check_each_step: bool = True,
    ) -> None:
        self.cfg = cfg
        self.conn = connector
        self.stacks = list(stacks)
        self.cpu_ready_keys: Callable[[], set[OffloadKey]] | None = None
        """The keys the CPU tier holds readable, for the event oracle (set by the stack when
        its CPU tier emits events); None: events are taken every step but not checked."""
        self._announced: set[OffloadKey] = set()
        self.kv = kv
        self.clock = clock
        self._in_flight = in_flight
        root = random.Random(cfg.seed)
        self.rng = random.Random(root.getrandbits(64))
        self.workload = Workload(cfg.workload, random.Random(root.getrandbits(64)))
        channel_rng = random.Random(root.getrandbits(64))
        self.channel = channel or ReportChannel(
            cfg.faults,
            channel_rng,
            cfg.num_workers,
            late_after_steps=math.ceil(
                (cfg.stall_timeout_s + 2 * cfg.stall_check_interval_s) / cfg.step_seconds
            )
            + 2,
        )
        self.foreign_rng = random.Random(root.getrandbits(64))
        self.check_each_step = check_each_step
        # INV-DATA at store time: (job id, job, the keys it writes) -> errors
        self.store_oracle: Callable[[int, Any, tuple[Any, ...]], list[str]] | None = None
        self.reset_answer = ResetAnswer()
        self._load_job_of: dict[str, int] = {}  # request -> its emitted load job
        self._failed_jobs: set[int] = set()  # jobs a delivered report failed
        self._stalled_seen: set[int] = set()
        """Jobs seen in the stall ledger after a call: what explains a stalled load's invalid
        blocks when its finish is reported in a later call, after the ledger forgot it (a
        call that raised reports its finished loads in the next one)."""
        """Verifies the stored bytes of a store job that completed successfully."""
        self.live_jobs: Callable[[], Any] = lambda: ()
        self.stalled_jobs: Callable[[], Any] = lambda: ()
        self.observed: ObservedManager | None = None
        """The manager proxy of the expectation oracles (set by the stack builder)."""
        self.step_hooks: list[Callable[[int], None]] = []
        """Called at the start of every step with its number (e.g. a slow tier's clock)."""
        self._stores: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # store job -> (job, keys)
        groups = cfg.kv_groups()
        self.groups = groups
        self.n_groups = len(groups)
        self.tph = min(g.tokens_per_block for g in groups)
        self.g_tpb = [g.tokens_per_block for g in groups]
        self.g_win = [g.sliding_window for g in groups]
        self.g_hpb = [t // self.tph for t in self.g_tpb]
        self.sliding = [g for g in range(self.n_groups) if self.g_win[g] is not None]
        step = 1
        for t in self.g_tpb:
            step = step * t // math.gcd(step, t)
        self.hit_unit = step
        self.chunk_hashes: dict[bytes, tuple[bytes, ...]] = {}
        """Last hash of a chunk (tagged with its group) -> the block hashes of its blocks."""
        self._preempted_next: set[str] = set()
        self.pool = BlockPool(
            cfg.num_gpu_blocks,
            on_evict=kv.dont_care,
            reuse_freed_first=cfg.reuse_freed_first,
            uncached_first=True,
        )
        self.tpb = self.tph
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.by_id: dict[str, SimRequest] = {}
        self.foreign: list[_Foreign] = []
        self.finished_since_last: set[str] = set()
        self.stats = EngineStats()
        self.step_no = 0
        self.epoch = 0
        self._live_bound = cfg.live_bound()
        self._stuck_since: int | None = None
        self._cum_hit = 0
        self._cum_prompt = 0
        self.arrived = 0
        self.extra_pending: Callable[[], bool] = lambda: False
        """More work the drain must wait for (e.g. the scheduler's stalled-job ledger)."""
        # INV-OWN: who may read each block (handed to one owner; prefix hits share it)
        self.owners: list[set[str]] = [set() for _ in range(cfg.num_gpu_blocks)]
        self.handed_at: list[int] = [-1] * cfg.num_gpu_blocks
        self._handed: set[int] = set()
        self._unflushed_stores: dict[int, tuple[str, frozenset[int]]] = {}
        self._jobs_of: dict[str, set[int]] = {}
        self._job_req: dict[int, str] = {}
        self._completeness: list[tuple[str, list[OffloadKey], int]] = []
        self._n_foreign = 0
        self._vllm_window = cfg.vllm_window
        self._failed_ends: list[tuple[SimRequest, frozenset[int]]] = []
        """Loads the connector ended with invalid blocks, not yet applied: vLLM's engine
        applies them at the end of the next step (:meth:`_loads_ended`)."""
        self._inflight: dict[str, SimRequest] = {}
        """vLLM's in-flight prefills: requests loading, or admitted with prompt tokens not yet
        scheduled."""

    @property
    def admitted_prompt_tokens(self) -> int:
        """Prompt tokens of every admission (a re-admission after preemption counts again)."""
        return self._cum_prompt

    # -- public --------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests not yet done."""
        return len(self.by_id)

    def run(self, progress: Callable[[int, int], None] | None = None) -> EngineStats:
        """Run ``cfg.steps`` steps (or until the workload is done), then drain."""
        cfg = self.cfg
        while self.step_no < cfg.steps and not (self.workload.exhausted and not self.by_id):
            self.step(admit=True)
            if progress is not None:
                progress(self.step_no, cfg.steps)
        for r in list(self.by_id.values()):
            if not r.aborted:
                self.abort(r)
        self.drain()
        return self.stats

    def drain(self) -> None:
        """Step (nothing new admitted) while any work is pending, bounded."""
        bound = self.cfg.drain_bound()
        n = 0
        while n < bound and self._work_pending():
            self.step(admit=False)
            n += 1
        self.stats.drain_steps = n

    def _work_pending(self) -> bool:
        """Whether the engine steps again: :func:`statecore.sim.step.has_requests` (requests
        not done, foreign ones included, finishes not yet sent to the workers, or the
        connector's ``has_pending_push_work``), and :attr:`extra_pending`, the stack's own
        clocks (the stalled-job ledger's expiry, secondary-tier executors)."""
        return vllm_step.has_requests(
            bool(self.by_id or self.foreign),
            bool(self.finished_since_last),
            lambda: (
                self.extra_pending()
                or bool(self._guard("has_pending_push_work", self.conn.has_pending_push_work))
            ),
        )

    def reset_cache(self) -> None:
        """``reset_cache`` between steps (every request's epoch moves on; what the reset drops
        must be offered again, covers by loads included: INV-STORE-COMPLETE)."""
        self.epoch += 1
        for r in self.by_id.values():
            r.covered = 0
        reset = getattr(self.conn, "reset", None)
        if reset is None:
            self._guard("reset_cache", self.conn.reset_cache)
        else:  # the call that says what it did
            self.reset_answer.reset(self._guard("reset", reset))

    # -- one step ------------------------------------------------------------------------------

    def step(self, admit: bool = True) -> None:
        """One engine step (see the module docstring)."""
        cfg, f = self.cfg, self.cfg.faults
        k = self.step_no
        self.clock.now += cfg.step_seconds
        self.kv.dirty = True
        # the engine's loop asks whether to keep stepping before every step (vLLM's
        # has_requests asks the connector's has_pending_push_work)
        self._guard("has_pending_push_work", self.conn.has_pending_push_work)
        for hook in self.step_hooks:
            hook(k)
        if f.reset and self.rng.random() < f.reset:
            self.channel.injected["reset"] += 1
            self.stats.resets += 1
            self.reset_cache()
            # loads carried over the reset stay live: their reports are not stale
            self.channel.reset_happened(frozenset(getattr(self.conn, "jobs", ())))
        if admit:
            for turn in self.workload.arrivals(k):
                self._arrive(turn, k)
        for r in list(self.by_id.values()):
            if r.abort_at is not None and r.abort_at <= k and not r.aborted:
                self.abort(r)

        if self.observed is not None:
            self.observed.refused.clear()
        # the failed loads this step's metadata echoes to the workers: vLLM's engine learns
        # of them from this step's output
        echoed, self._failed_ends = self._failed_ends, []
        pass_ = self._schedule(k)
        scheduled = pass_.scheduled
        preempted = {r.turn.req_id for r in pass_.preempted}
        if scheduled or self.running or not self.waiting:
            self._stuck_since = None
        else:
            self._note_progress(k)
        foreign = self._schedule_foreign(admit)
        # as vLLM 0.33's SchedulerOutput lists them: new, then resumed (as new), then running
        listed, as_new = vllm_step.listed(pass_)
        new_ids = {r.turn.req_id for r in as_new}
        output = SchedulerOutput(
            scheduled=tuple(
                ScheduledRequest(r.turn.req_id, tuple(tuple(b) for b in blocks), n, resumed)
                for r, n, blocks, resumed in listed
            )
            + foreign,
            new_req_ids=frozenset(new_ids),
            finished_req_ids=frozenset(self.finished_since_last),
            preempted_req_ids=frozenset(preempted | self._preempted_next),
        )
        self.finished_since_last = set()
        self._preempted_next = set()
        meta = self._guard("build_connector_meta", self.conn.build_connector_meta, output)
        if meta is None:
            meta = ConnectorMetadata()
        else:
            for err in self.reset_answer.built(meta):
                self.stats.violations.append(f"step {k}: {err}")
        self._expect_after_build(k, meta, output.preempted_req_ids - output.finished_req_ids)
        self._handed = set()
        for job_id in (*meta.load_jobs, *meta.store_jobs):
            self.channel.job_emitted(job_id, k)
        for job_id, job in meta.load_jobs.items():
            self._load_job_of[job.req_id] = job_id
        if self.store_oracle is not None:
            keys_of = meta.store_keys
            for job_id, job in meta.store_jobs.items():
                self._stores[job_id] = (job, keys_of.get(job_id, ()))

        sent = as_sent(meta)
        for s in self.stacks:
            s.advance(k)
            s.start_step(sent)
        for r, n, _, _ in scheduled:
            self._compute(r, n)
        self._compute_foreign()
        for rank, s in enumerate(self.stacks):
            s.end_step(sent)
            self.channel.submit(rank, s.report(), k)
        # vLLM's update_from_output: the finished requests, then the workers' report
        self._after_compute(k, scheduled)
        self.feed(self.channel.deliver(k))
        for r, invalid in echoed:
            self._end_load(k, r, invalid)
        self._take_events()
        if self.check_each_step:
            self._check(k)
        self.step_no += 1
        self.stats.steps = self.step_no
        self.stats.hit_rate_series.append(
            self._cum_hit / self._cum_prompt if self._cum_prompt else 0.0
        )
        self.stats.in_flight_series.append(self._in_flight())

    def feed(self, report: WorkerMetadata | None) -> None:
        """Hand an aggregated worker report to the connector and apply the loads that ended."""
        if report is not None and report.failed:
            self._failed_jobs.update(report.failed)  # what explains a load's invalid blocks
        obs = self.observed
        if obs is None:
            result = self._guard(
                "update_connector_output", self.conn.update_connector_output, report
            )
        else:
            result = self._update_observed(obs, report)
        stalled = getattr(self.conn, "stalled_jobs", None)
        if stalled:
            self._stalled_seen.update(stalled)
        if result is not None:
            for err in [*output_answer_errors(result), *self.reset_answer.output(result)]:
                self.stats.violations.append(f"step {self.step_no}: {err}")
            self._loads_ended(self.step_no, result.finished_loads, result.invalid_block_ids)
        if self._stores:
            self._stores_ended()
        if self._unflushed_stores or self._job_req:
            self._forget_ended_jobs()

    def _update_observed(self, obs: ObservedManager, report: WorkerMetadata | None) -> Any:
        """``update_connector_output`` under INV-MGR-ERROR (:func:`update_observed`)."""
        result, other, bad = update_observed(self.conn, obs, report)
        if bad is not None:
            self._violation(bad)
        if other is not None:
            self._guard("update_connector_output", reraise, other)
        return result

    def _register_chunks(self, hashes: Sequence[bytes]) -> None:
        bpc = self.cfg.blocks_per_chunk
        reg = self.chunk_hashes
        for g in range(self.n_groups):
            hpb = self.g_hpb[g]
            tag = bytes([g])
            # the hash of block i of this group is hashes[(i + 1) * hpb - 1]
            n_blocks = len(hashes) // hpb
            for end in range(n_blocks - (n_blocks % bpc), 0, -bpc):
                last = hashes[end * hpb - 1] + tag
                if last in reg:
                    break
                reg[last] = tuple(hashes[(i + 1) * hpb - 1] for i in range(end - bpc, end))

    def block_hash(self, r: SimRequest, g: int, i: int) -> bytes:
        """The hash of block ``i`` of group ``g`` of ``r`` (the block must be full)."""
        return r.req.block_hashes[(i + 1) * self.g_hpb[g] - 1]

    def _stores_ended(self) -> None:
        live = self.live_jobs()
        oracle = self.store_oracle
        for job_id in [j for j in self._stores if j not in live]:
            job, keys = self._stores.pop(job_id)
            if oracle is not None:
                self.stats.stores_checked += 1
                for err in oracle(job_id, job, keys):
                    self.stats.data_errors.append(f"step {self.step_no}: {err}")

    def preempt(self, r: SimRequest) -> None:
        """Preempt running ``r`` between steps; the next step lists it as preempted."""
        if r.status is Status.RUNNING:
            self._preempt(r)
            self._preempted_next.add(r.turn.req_id)

    def finish(self, r: SimRequest) -> None:
        """Finish running ``r`` now (a stop condition on its last sampled token).

        Only a request past its prefill can stop (a stop needs a sampled token, so every token
        but the last is computed); for any other request this does nothing.
        """
        if r.status is Status.RUNNING and r.req.num_computed_tokens == r.req.num_tokens - 1:
            self.stats.requests_finished += 1
            self._finished(r)
            self._retire(r, completed=True)

    def arrive(self, turn: Turn) -> SimRequest:
        """Submit ``turn`` now."""
        self._arrive(turn, self.step_no)
        return self.by_id[turn.req_id]

    def check(self) -> None:
        """Run the after-step checks now (invariants, data oracle, INV-LIVE)."""
        self._check(self.step_no)

    def shutdown(self) -> None:
        """Shut the connector down, as an engine does after its last step, under
        INV-MGR-ERROR (:func:`shutdown_observed`: the manager's ``shutdown`` may be the
        manager-error fault's call); a breach is a violation of the run."""
        obs = self.observed
        if obs is None:
            self.conn.shutdown()
            return
        bad = shutdown_observed(self.conn, obs)
        if bad is not None:
            self.stats.violations.append(f"step {self.step_no}: {bad} (at shutdown)")

    def _guard(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except InvariantViolation as exc:
            self.stats.violations.append(f"step {self.step_no}: {call}: {exc}")
        except StatecoreError as exc:
            self.stats.errors.append(f"step {self.step_no}: {call}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # an untyped exception into the engine: the worst kind
            self.stats.errors.append(
                f"step {self.step_no}: {call}: untyped {type(exc).__name__}: {exc!r}"
            )
        return None

    def take_stats(self) -> None:
        """Take the connector's stats, as vLLM's engine does after every step (the fuzzers'
        harness does; the simulator's report reads the manager's own at the end instead)."""
        self._guard("get_stats", self.conn.get_stats)

    def _take_events(self) -> None:
        """Take the connector's KV events, as an engine that publishes them does after every
        step (a manager with events on keeps them until asked), and replay the CPU tier's."""
        events = self._guard("take_events", self.conn.take_events)
        oracles.replay_events_into(self._announced, events or (), Medium.CPU)

    def _check_events(self, k: int) -> None:
        """INV-EVENTS on the CPU tier (:func:`statecore.specs.invariants.events_violation`)."""
        ready = self.cpu_ready_keys
        if ready is None:
            return
        self._take_events()  # what happened since the step (a reset between steps, say)
        if self.observed is not None and self.observed.events_held_back:
            return  # the manager's take_events raised: its events come with the next one
        held = ready()
        bad = oracles.events_violation(self._announced, held)
        if bad is not None:
            self.stats.violations.append(f"step {k}: CPU tier: {bad}")
            self._announced = set(held)  # report each divergence once

    # -- expectation oracles -------------------------------------------------------------------

    def _violation(self, msg: str) -> None:
        self.stats.violations.append(f"step {self.step_no}: {msg}")

    def _expect_after_build(
        self, k: int, meta: ConnectorMetadata, preempted: frozenset[str]
    ) -> None:
        """INV-OWN, INV-FLUSH-PREEMPT and INV-STORE-COMPLETE over this step's metadata."""
        flush = meta.jobs_to_flush
        unflushed = self._unflushed_stores
        for j in flush:
            unflushed.pop(j, None)
        # INV-OWN (b): a block handed out this step is under no unflushed older store
        handed = self._handed
        if handed:
            for j, (rid, srcs) in unflushed.items():
                hit = srcs & handed
                if hit:
                    b = min(hit)
                    self._violation(
                        f"INV-OWN: GPU block {b} was handed to {sorted(self.owners[b])} while "
                        f"store job {j} of {rid!r} reading it was in flight and not flushed"
                    )
                    handed = handed - hit
        # INV-FLUSH-PREEMPT: every in-flight job of a preempted request is flushed now (a
        # request also finished in this step is exempt: its fences take over, INV-OWN checks)
        for rid in preempted:
            for j in self._jobs_of.get(rid, ()):
                if j not in flush and j in unflushed:
                    self._violation(
                        f"INV-FLUSH-PREEMPT: {rid!r} was preempted with store job {j} in "
                        "flight, and the job is not in this step's jobs_to_flush"
                    )
        # INV-OWN (a): a new store reads only blocks its request may read
        for j, job in meta.store_jobs.items():
            rid = job.req_id
            srcs = frozenset(b for b in getattr(job.src, "block_ids", ()) if b)
            pulled = j in flush  # submitted before this step's compute: reads first
            bad = oracles.own_violation(
                j, rid, srcs, self.owners, self._handed, pulled, self.handed_at
            )
            if bad is not None:
                self._violation(bad)
            if j not in flush:
                unflushed[j] = (rid, srcs)
            self._job_req[j] = rid
            self._jobs_of.setdefault(rid, set()).add(j)
        for j, job in meta.load_jobs.items():
            self._job_req[j] = job.req_id
        obs = self.observed
        if obs is not None:
            if obs.violations:
                for v in obs.violations:
                    self._violation(v)
                obs.violations.clear()
            if self._completeness:
                self._check_completeness(obs)

    def _forget_ended_jobs(self) -> None:
        live, stalled = self.live_jobs(), self.stalled_jobs()
        ended = [j for j in self._job_req if j not in live and j not in stalled]
        for j in ended:
            rid = self._job_req.pop(j)
            self._unflushed_stores.pop(j, None)
            jobs = self._jobs_of.get(rid)
            if jobs is not None:
                jobs.discard(j)
                if not jobs:
                    del self._jobs_of[rid]

    def _note_finished(self, r: SimRequest) -> None:
        """INV-STORE-COMPLETE: after the finish's final store (built in the next step), every
        full-attention chunk the request computed must be offered to the manager or known to
        it since the last reset (sliding-window chunks may legitimately be skipped: their
        blocks left the window)."""
        req = r.req
        if req.is_aborted:
            return  # an abort: nothing is promised
        obs = self.observed
        if obs is not None and r.turn.req_id not in obs.registered:
            return  # the manager never took the request (its on_new_request raised)
        n_off = min(max(req.num_prompt_tokens, req.num_tokens - 1), req.num_computed_tokens)
        keys: list[OffloadKey] = oracles.store_complete_keys(
            req.block_hashes,
            n_off,
            r.covered,  # covered at admission: a named cause, never offered
            list(zip(self.g_tpb, self.g_win, strict=True)),
            self.tph,
            self.cfg.blocks_per_chunk,
        )
        if keys:
            self._completeness.append((r.turn.req_id, keys, self.epoch))

    def _check_completeness(self, obs: ObservedManager) -> None:
        pending, self._completeness = self._completeness, []
        unusable = bool(getattr(self.conn, "manager_reset_pending", False))
        for rid, keys, epoch in pending:
            if epoch != self.epoch or unusable:
                continue  # a reset discarded the final store, or the manager took nothing
            self.stats.completeness_checked += 1
            # named causes: stored or declined by the manager (known), found by a lookup
            # (known), no room at the last chance, the final store (refused this step)
            bad = oracles.store_complete_violation(rid, keys, obs.known, obs.refused)
            if bad is not None:
                self._violation(bad)

    # -- arrivals, aborts, finish --------------------------------------------------------------

    def _arrive(self, turn: Turn, k: int) -> None:
        tokens = list(turn.prompt)
        req = Request(
            request_id=turn.req_id,
            num_prompt_tokens=len(tokens),
            num_tokens=len(tokens),
            skip_reading_prefix_cache=turn.skip_prefix,
        )
        extend_block_hashes(req.block_hashes, tokens, self.tph)
        self._register_chunks(req.block_hashes)
        r = SimRequest(turn, req, tokens, k, epoch=self.epoch)
        r.blocks = [[] for _ in range(self.n_groups)]
        if turn.abort_after is not None:
            r.abort_at = k + turn.abort_after
        self.by_id[turn.req_id] = r
        self.arrived += 1
        self.waiting.append(r)
        self.stats.prompt_tokens += len(tokens)
        self._guard("on_new_request", self.conn.on_new_request, req)

    def abort(self, r: SimRequest) -> None:
        """Abort ``r`` (from the API, between steps)."""
        r.aborted = True
        r.req.is_aborted = True
        self.stats.requests_aborted += 1
        self._finished(r)
        if r.status is Status.LOADING:  # vLLM: still waiting for remote KV
            self.stats.aborted_during_load += 1
            if not r.load_done:
                return  # blocks held until the load ended
        self._retire(r, completed=False)

    def _finished(self, r: SimRequest) -> None:
        # vLLM frees the blocks out of the window before it tells the connector
        self._slide(r)
        self._guard("request_finished", self.conn.request_finished, r.req)
        self.finished_since_last.add(r.turn.req_id)
        self._note_finished(r)

    def _retire(self, r: SimRequest, completed: bool) -> None:
        self._inflight.pop(r.turn.req_id, None)
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._release_all(r)
        r.status = Status.DONE
        del self.by_id[r.turn.req_id]
        self.workload.turn_ended(r.turn, self.step_no, completed)

    def _release_all(self, r: SimRequest) -> None:
        for blocks in r.blocks:
            self.pool.release(blocks)
        r.blocks = [[] for _ in range(self.n_groups)]

    # -- block tables --------------------------------------------------------------------------

    def _n_blocks(self, g: int, tokens: int) -> int:
        return -(-tokens // self.g_tpb[g])

    def _out_of_window(self, g: int, computed: int) -> int:
        """Leading blocks of sliding-window group ``g`` that no token after ``computed``
        attends to (0 for full attention)."""
        w = self.g_win[g]
        if w is None:
            return 0
        if self._vllm_window:  # vLLM: the next token attends to the last w tokens
            return max(0, computed - w + 1) // self.g_tpb[g]
        if computed <= w:
            return 0
        return (computed - w) // self.g_tpb[g]

    def _hand_out(self, rid: str, n: int) -> list[int]:
        fresh = self.pool.allocate(n) or []
        k = self.step_no
        for b in fresh:
            self.owners[b] = {rid}
            self.handed_at[b] = k
        self._handed.update(fresh)
        return fresh

    def _share(self, rid: str, blocks: Sequence[int]) -> None:
        self.pool.touch([b for b in blocks if b])
        for b in blocks:
            if b:
                self.owners[b].add(rid)

    def _local_hit(self, r: SimRequest) -> tuple[int, list[list[int]]]:
        """The longest locally cached prefix (tokens) and its per-group block lists (null
        blocks for sliding-window blocks out of the window)."""
        req = r.req
        limit = req.num_tokens - 1
        if req.skip_reading_prefix_cache or limit <= 0:
            return 0, [[] for _ in range(self.n_groups)]
        cached = self.pool.cached
        hashes = req.block_hashes
        full_len = limit
        for g in range(self.n_groups):
            if self.g_win[g] is not None:
                continue
            tag, hpb, n = bytes([g]), self.g_hpb[g], 0
            while (n + 1) * hpb <= len(hashes) and hashes[(n + 1) * hpb - 1] + tag in cached:
                n += 1
            full_len = min(full_len, n * self.g_tpb[g])
        length = full_len - full_len % self.hit_unit
        while length > 0:
            lists: list[list[int]] | None = []
            for g in range(self.n_groups):
                tag, hpb = bytes([g]), self.g_hpb[g]
                first = self._out_of_window(g, length)
                row = [0] * first
                for i in range(first, self._n_blocks(g, length)):
                    b = cached.get(hashes[(i + 1) * hpb - 1] + tag)
                    if b is None:
                        lists = None
                        break
                    row.append(b)
                if lists is None:
                    break
                lists.append(row)
            if lists is not None:
                return length, lists
            length -= self.hit_unit
        return 0, [[] for _ in range(self.n_groups)]

    def _need(self, r: SimRequest, tokens: int, computed: int) -> list[int]:
        """Per group, blocks to add so that ``r`` holds ``tokens`` tokens (null blocks for
        positions out of the window of ``computed`` are not counted); -1 entries never."""
        out = []
        for g in range(self.n_groups):
            have = len(r.blocks[g])
            first = self._out_of_window(g, computed)
            want = self._n_blocks(g, tokens)
            holes = sum(1 for i in range(first, have) if not r.blocks[g][i])
            out.append(holes + max(0, want - max(have, first)))
        return out

    def _extend(self, r: SimRequest, tokens: int, computed: int) -> list[list[int]]:
        """Give ``r`` the blocks for ``tokens`` tokens (null out of the window of
        ``computed``, fresh blocks in null holes inside it, e.g. after a load that was
        recomputed); returns the new block ids per group. Holes are filled only before a
        request's first scheduling (or resumption), when the engine sends its whole lists: a
        connector only learns appended blocks later."""
        rid = r.turn.req_id
        new: list[list[int]] = []
        for g in range(self.n_groups):
            row = r.blocks[g]
            first = self._out_of_window(g, computed)
            want = self._n_blocks(g, tokens)
            added: list[int] = []
            for i in range(first, len(row)):
                if not row[i]:
                    (b,) = self._hand_out(rid, 1)
                    row[i] = b
                    added.append(b)
            while len(row) < min(first, want):
                row.append(0)
            n = want - len(row)
            if n > 0:
                fresh = self._hand_out(rid, n)
                row.extend(fresh)
                added.extend(fresh)
            new.append(added)
        return new

    def _slide(self, r: SimRequest) -> None:
        """Free the sliding-window blocks that left ``r``'s window (null block in place)."""
        computed = r.req.num_computed_tokens
        for g in self.sliding:
            row = r.blocks[g]
            left: list[int] = []
            for i in range(min(self._out_of_window(g, computed), len(row))):
                b = row[i]
                if b:
                    if self._vllm_window:
                        left.append(b)  # freed together, the last first, as vLLM does
                    else:
                        self.pool.release([b])
                    row[i] = 0
                    self.stats.window_blocks_freed += 1
            if left:
                self.pool.release(left)

    # -- scheduling ----------------------------------------------------------------------------

    def _waiting_order(self) -> list[SimRequest]:
        """The order step 1b tries the waiting requests in
        (:func:`statecore.sim.step.waiting_order`)."""
        return vllm_step.waiting_order(self.waiting, lambda r: r.kv_holding)

    def _schedule(self, k: int) -> _SchedulePass:
        """Step 1 of the module docstring (:func:`statecore.sim.step.schedule`): the running
        requests, then, only when none was preempted in this step, the waiting ones."""
        pass_: _SchedulePass = StepPass(self.cfg.max_batched_tokens)
        vllm_step.schedule(
            pass_,
            lambda p: vllm_step.schedule_running(self.running, p, self),
            lambda p: self._schedule_waiting(k, p),
        )
        for r, n, _, _ in pass_.scheduled:
            if r.req.num_computed_tokens + n >= r.req.num_tokens:
                self._inflight.pop(r.turn.req_id, None)  # its prefill is scheduled
        return pass_

    def _inflight_reserved(self) -> int:
        """Blocks the prefills in flight (admitted or loading, not yet fully scheduled) still
        need to hold their whole sequence (:func:`statecore.sim.step.remaining_blocks`):
        vLLM keeps them free when it admits a load."""
        remaining = vllm_step.remaining_blocks
        return sum(
            remaining(
                self._n_blocks(g, r.req.num_tokens),
                len(r.blocks[g]),
                self._out_of_window(g, r.req.num_computed_tokens),
            )
            for r in self._inflight.values()
            for g in range(self.n_groups)
        )

    def _schedule_waiting(self, k: int, pass_: _SchedulePass) -> None:
        """Admit waiting requests (lookups, allocation, asynchronous loads) into ``pass_``."""
        skipped: list[SimRequest] = []
        self._admit_waiting(k, pass_, skipped)
        if skipped:  # vLLM prepends them to their queues (statecore.sim.step.requeue_skipped)
            for r in skipped:
                r.kv_holding = vllm_step.holds_kv(
                    r.req.num_computed_tokens, r.status is Status.LOADING
                )
            self.waiting = vllm_step.requeue_skipped(self.waiting, skipped)

    def _admit_waiting(self, k: int, pass_: _SchedulePass, skipped: list[SimRequest]) -> None:
        """Step 1b's pass over the waiting requests (those it skips into ``skipped``)."""
        cfg = self.cfg
        scheduled = pass_.scheduled
        for r in self._waiting_order():
            if pass_.budget <= 0 or len(self.running) >= cfg.max_running:
                break
            if r.turn.req_id in self._preempted_next:
                skipped.append(r)  # preempted between steps: not in this step
                continue
            if r.status is Status.LOADING:
                if not r.load_done:
                    skipped.append(r)  # waits for its load
                    continue
                self._promote(r)
            local: list[list[int]] = [[] for _ in range(self.n_groups)]
            fresh_lookup = not r.has_blocks()
            if fresh_lookup:
                req = r.req
                n_local, local = self._local_hit(r)
                res = self._guard(
                    "get_num_new_matched_tokens",
                    self.conn.get_num_new_matched_tokens,
                    req,
                    n_local,
                )
                if res is None:
                    skipped.append(r)
                    continue
                ext, is_async = res
                if ext is None:
                    self.stats.deferrals += 1
                    if r.deferred_since is None:
                        r.deferred_since = k
                    r.deferred_last = k
                    r.deferred_steps += 1
                    skipped.append(r)
                    continue
                r.deferred_since = None
                r.deferred_steps = 0
                if ext > 0 and is_async:
                    total = n_local + ext
                    if self._vllm_window:
                        # vLLM takes no local hit block that falls out of the window of the
                        # whole hit (a null block in its place)
                        for g in self.sliding:
                            for i in range(min(self._out_of_window(g, total), len(local[g]))):
                                local[g][i] = 0
                    # what the prefills in flight still need, with the blocks they hold (this
                    # request, in flight again after a failed load, holds none yet)
                    reserved = self._inflight_reserved()
                    r.blocks = [list(x) for x in local]
                    need = sum(self._need(r, total, total))
                    room = self._room(local)
                    # vLLM: the whole sequence must fit, and the loaded prefix beside what
                    # the prefills in flight still need
                    full = sum(self._need(r, r.req.num_tokens, total))
                    need = vllm_step.admission_blocks(need, full, reserved)
                    if room - need < cfg.watermark_blocks:
                        r.blocks = [[] for _ in range(self.n_groups)]
                        break
                    self._share(r.turn.req_id, [b for x in local for b in x])
                    self._extend(r, total, total)
                    self._guard(
                        "update_state_after_alloc",
                        self.conn.update_state_after_alloc,
                        req,
                        tuple(tuple(x) for x in r.blocks),
                        ext,
                    )
                    r.status = Status.LOADING
                    # vLLM counts the loaded tokens as computed from the admission on (the
                    # blocks the prefills in flight still need are counted from there)
                    req.num_computed_tokens = total
                    self._inflight[r.turn.req_id] = r
                    r.load = (n_local, ext)
                    r.covered = max(r.covered, total)
                    r.load_since = k
                    if self.rng.random() < cfg.workload.abort_during_load_prob:
                        r.abort_at = k + 1
                    self.stats.loads_started += 1
                    self._count_hits(r, n_local, ext)
                    skipped.append(r)
                    continue
                computed = n_local
                r.blocks = [list(x) for x in local]
            else:
                computed = r.req.num_computed_tokens
            n = min(r.req.num_tokens - computed, pass_.budget)
            need = sum(self._need(r, computed + n, computed))
            need = vllm_step.admission_blocks(need, sum(self._need(r, r.req.num_tokens, computed)))
            if self._room(local) - need < cfg.watermark_blocks:
                if any(local):
                    r.blocks = [[] for _ in range(self.n_groups)]
                break
            self._share(r.turn.req_id, [b for x in local for b in x])
            self._extend(r, computed + n, computed)
            # vLLM caches the blocks the step's tokens fill when it allocates them
            self._cache_blocks(r, computed, computed + n)
            self._guard(
                "update_state_after_alloc",
                self.conn.update_state_after_alloc,
                r.req,
                tuple(tuple(x) for x in r.blocks),
                0,
            )
            if fresh_lookup:
                self._count_hits(r, computed, 0)
            if computed + n < r.req.num_tokens:
                self._inflight[r.turn.req_id] = r
            r.req.num_computed_tokens = computed
            self.waiting.remove(r)
            self.running.append(r)
            r.status = Status.RUNNING
            r.kv_holding = False
            if not r.scheduled_once:
                pass_.new.add(r)
            scheduled.append((r, n, [list(x) for x in r.blocks], r.resumed and r.scheduled_once))
            r.scheduled_once = True
            r.resumed = False
            pass_.budget -= n

    # -- the running requests, as statecore.sim.step.schedule_running asks -------------------

    def is_running(self, r: SimRequest) -> bool:
        """Whether ``r`` is running (:class:`~statecore.sim.step.RunningModel`)."""
        return r.status is Status.RUNNING

    def token_counts(self, r: SimRequest) -> tuple[int, int]:
        """``r``'s computed tokens and its tokens so far."""
        return r.req.num_computed_tokens, r.req.num_tokens

    def free_out_of_window(self, r: SimRequest) -> None:
        """Free ``r``'s sliding-window blocks that left its window (:meth:`_slide`)."""
        self._slide(r)

    def blocks_needed(self, r: SimRequest, upto: int, computed: int) -> int:
        """Fresh blocks ``r`` needs for ``upto`` tokens, every group together."""
        return sum(self._need(r, upto, computed))

    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now."""
        return self.pool.num_free

    def preempt_now(self, r: SimRequest) -> None:
        """Preempt ``r`` inside the step (its blocks freed, back at the head of the queue)."""
        self._preempt(r)

    def allocate(self, r: SimRequest, upto: int, computed: int) -> list[list[int]]:
        """Give ``r`` the blocks for ``upto`` tokens; the blocks the step's tokens fill are
        cached when they are allocated, as vLLM does. Returns the new ids per group."""
        fresh = self._extend(r, upto, computed)
        self._cache_blocks(r, computed, upto)
        return fresh

    def _schedule_foreign(self, admit: bool) -> tuple[ScheduledRequest, ...]:
        """Foreign requests: new ones take blocks (any group), old ones end."""
        out: list[ScheduledRequest] = []
        keep: list[_Foreign] = []
        for fr in self.foreign:
            fr.steps_left -= 1
            if fr.steps_left < 0:
                for blocks in fr.blocks:
                    self.pool.release(blocks)
                continue
            keep.append(fr)
        self.foreign = keep
        rng = self.foreign_rng
        p = self.cfg.foreign_prob
        if admit and p and rng.random() < p:
            self.add_foreign(rng.randint(1, 4), rng.randint(1, 3))
        for fr in self.foreign:
            ids = tuple(tuple(b) for b in fr.blocks) if fr.new else ((),) * self.n_groups
            out.append(ScheduledRequest(fr.req_id, ids, 1, False))
        return tuple(out)

    def add_foreign(self, n_blocks: int, steps: int) -> None:
        """A foreign request takes ``n_blocks`` fresh blocks in every group now (if there is
        room) and holds them for ``steps`` more steps."""
        if self.pool.num_free - n_blocks * self.n_groups < self.cfg.watermark_blocks:
            return
        rid = f"foreign-{self._n_foreign}"
        self._n_foreign += 1
        self.stats.foreign_requests += 1
        blocks = [self._hand_out(rid, n_blocks) for _ in range(self.n_groups)]
        self.foreign.append(_Foreign(rid, blocks, steps))

    def _compute_foreign(self) -> None:
        """A foreign request writes its own bytes into its blocks."""
        for fr in self.foreign:
            if not fr.new:
                continue
            fr.new = False
            salt = sum(map(ord, fr.req_id))
            for g, blocks in enumerate(fr.blocks):
                for b in blocks:
                    self.kv.write_partial(b, ROOT_HASH, [salt, b, g], g)

    def _room(self, local: Sequence[Sequence[int]]) -> int:
        """Free blocks left once the local prefix hits ``local`` are taken off the free list."""
        ref = self.pool.ref
        return self.pool.num_free - sum(1 for x in local for b in x if b and ref[b] == 0)

    def _count_hits(self, r: SimRequest, local: int, ext: int) -> None:
        self.stats.local_hit_tokens += local
        self._cum_hit += local + ext
        self._cum_prompt += r.req.num_prompt_tokens

    def _preempt(self, r: SimRequest) -> None:
        self.stats.preemptions += 1
        self._inflight.pop(r.turn.req_id, None)
        self.running.remove(r)
        self._release_all(r)
        r.req.num_computed_tokens = 0
        r.status = Status.WAITING
        r.resumed = True
        self.waiting.insert(0, r)

    # -- compute and outputs -------------------------------------------------------------------

    def _compute(self, r: SimRequest, n: int) -> None:
        kv = self.kv
        start = r.req.num_computed_tokens
        end = start + n
        for g in range(self.n_groups):
            tpb = self.g_tpb[g]
            row = r.blocks[g]
            for i in range(start // tpb, self._n_blocks(g, end)):
                b = row[i]
                if not b:
                    continue  # out of the window: nothing attends to it any more
                block_end = (i + 1) * tpb
                if end >= block_end:
                    kv.write_full(b, self.block_hash(r, g, i), g)
                else:
                    parent = self.block_hash(r, g, i - 1) if i else ROOT_HASH
                    kv.write_partial(b, parent, r.tokens[i * tpb : end], g)
        self.stats.tokens_computed += n

    def _cache_blocks(self, r: SimRequest, start: int, end: int) -> None:
        """Blocks completed by tokens ``start..end`` enter the prefix cache of their group."""
        for g in range(self.n_groups):
            tpb, row, tag = self.g_tpb[g], r.blocks[g], bytes([g])
            for i in range(start // tpb, end // tpb):
                if i < len(row) and row[i]:
                    self.pool.cache(row[i], self.block_hash(r, g, i) + tag)

    def _after_compute(
        self, k: int, scheduled: list[tuple[SimRequest, int, list[list[int]], bool]]
    ) -> None:
        for r, n, _, _ in scheduled:
            if r.status is not Status.RUNNING:
                continue  # aborted meanwhile (cannot happen inside a step) or preempted
            req = r.req
            start = req.num_computed_tokens
            req.num_computed_tokens = start + n
            self._cache_blocks(r, start, start + n)
            if req.num_computed_tokens < req.num_tokens:
                continue
            tok = self.workload.next_token()
            r.tokens.append(tok)
            r.turn.output.append(tok)
            req.num_tokens += 1
            extend_block_hashes(req.block_hashes, r.tokens, self.tph)
            self._register_chunks(req.block_hashes)
            if len(r.turn.output) >= r.turn.max_output:
                self.stats.requests_finished += 1
                self._finished(r)
                self._retire(r, completed=True)

    def _loads_ended(self, k: int, finished: frozenset[str], invalid: frozenset[int]) -> None:
        """The connector says these loads ended (``invalid``: the blocks they left invalid).

        A load that ended valid is applied now. One that left invalid blocks (it failed or
        stalled) is applied at the end of the next step (see :mod:`statecore.sim.step`):
        vLLM's engine learns of it only from the workers' output of the step whose metadata
        echoes it.
        """
        claimed: set[int] = set()
        for rid in sorted(finished):
            r = self.by_id.get(rid)
            if r is None or r.status is not Status.LOADING or r.load is None:
                self.stats.harness_anomalies.append(
                    f"step {k}: finished_loads names {rid!r}, which is not waiting on a load"
                )
                continue
            start, n = r.load
            job_id = self._load_job_of.pop(rid, None)
            had_invalid = False
            for g in range(self.n_groups):
                tpb, row = self.g_tpb[g], r.blocks[g]
                first, last = start // tpb, self._n_blocks(g, start + n)
                for i in range(first, last):
                    if row[i] and row[i] in invalid:
                        claimed.update(row[i:last])
                        had_invalid = True
                        break
            if had_invalid:
                self._unexplained_invalid(k, rid, job_id)
                self._failed_ends.append((r, invalid))
                continue
            self._end_load(k, r, invalid)
        stray = invalid - claimed
        if stray:
            self.stats.harness_anomalies.append(
                f"step {k}: invalid_block_ids {sorted(stray)[:8]} belong to no ended load"
            )

    def _end_load(self, k: int, r: SimRequest, invalid: frozenset[int]) -> None:
        """The engine learns that ``r``'s load ended, the blocks in ``invalid`` lost (vLLM's
        ``update_from_output``): the computed tokens it keeps are
        :func:`statecore.sim.step.load_end`'s, and an aborted request is freed. The rest
        waits for the request's promotion (:meth:`_promote`). (With several KV-cache groups
        the request restarts from 0: truncating to the local prefix would be wrong with a
        sliding-window group, whose local hit blocks out of the window of the whole hit were
        left null at admission.)
        """
        if r.load is None or r.load_done:
            return
        rid = r.turn.req_id
        start, n = r.load
        first_invalid: int | None = None
        for g in range(self.n_groups):
            tpb, row = self.g_tpb[g], r.blocks[g]
            for i in range(start // tpb, self._n_blocks(g, start + n)):
                if row[i] and row[i] in invalid:
                    if first_invalid is None or i * tpb < first_invalid:
                        first_invalid = i * tpb
                    break
        computed = vllm_step.load_end(start, n, first_invalid, self.n_groups)
        restart = first_invalid is not None and self.n_groups > 1
        valid_end = start if restart else computed
        for g in range(self.n_groups):
            tpb, row = self.g_tpb[g], r.blocks[g]
            for i in range(start // tpb, valid_end // tpb):
                b = row[i]
                if not b or i * tpb < start:
                    continue
                for e in self.kv.verify_loaded(k, b, self.block_hash(r, g, i), g):
                    self.stats.data_errors.append(f"{e} (request {rid})")
        self.stats.loads_finished += 1
        self.stats.tokens_loaded += valid_end - start
        lost = start + n - valid_end + (start if restart else 0)
        self.stats.tokens_recomputed += lost
        self._cum_hit -= lost
        r.req.num_computed_tokens = computed
        r.load_done = True
        if r.aborted:
            self._retire(r, completed=False)

    def _promote(self, r: SimRequest) -> None:
        """The waiting phase reaches ``r`` after its load ended (vLLM's
        ``_update_waiting_for_remote_kv``): the loaded blocks enter the prefix cache, or, with
        nothing valid, every block is freed (a retry may hit the local cache, and the request
        starts over with a fresh lookup); a request whose prompt was loaded whole computes
        its last token again."""
        if r.load is None:
            return
        start = r.load[0]
        computed = r.req.num_computed_tokens
        if computed:
            for g in range(self.n_groups):
                tpb, row, tag = self.g_tpb[g], r.blocks[g], bytes([g])
                for i in range(start // tpb, computed // tpb):
                    b = row[i]
                    if b and i * tpb >= start:
                        self.pool.cache(b, self.block_hash(r, g, i) + tag)
        else:
            self._release_all(r)
        if computed >= r.req.num_tokens:
            r.req.num_computed_tokens = r.req.num_tokens - 1
        r.load = None
        r.load_done = False
        r.status = Status.WAITING

    def _unexplained_invalid(self, k: int, rid: str, job_id: int | None) -> None:
        """A load ended with invalid blocks: only a failure or a stall may explain it.

        Under vLLM's default ``kv_load_failure_policy`` ("fail") the engine aborts such a
        request, so a load invalidated for any other reason (a cache reset) fails a user
        request: an engine error.
        """
        if job_id is None:
            return  # never sent to the workers (the engine never waited on a transfer)
        if job_id in self._failed_jobs or job_id in self._stalled_seen:
            return
        self.stats.errors.append(
            f"step {k}: request {rid}: load job {job_id} ended with invalid blocks though no "
            "rank failed it and it did not stall (vLLM's default kv_load_failure_policy "
            "'fail' would fail the request)"
        )

    def _note_progress(self, k: int) -> None:
        """Engine progress: step ``k`` scheduled nothing, with requests waiting and none
        running. When that lasts INV-LIVE's bound with none of them loading or deferred (the
        connector owes them nothing), the engine model is jammed: recorded in
        :attr:`EngineStats.jams` once per jam, naming what holds the blocks (the report warns
        of it)."""
        if any(r.status is Status.LOADING or r.deferred_last == k for r in self.waiting):
            self._stuck_since = None
            return
        if self._stuck_since is None:
            self._stuck_since = k
        if k - self._stuck_since != self._live_bound:
            return
        holders = [r for r in self.waiting if r.has_blocks()]
        held = sum(len(b) for r in holders for b in r.blocks)
        head = self.waiting[0]
        self.stats.jams.append(
            f"step {k}: the engine made no progress in {self._live_bound} steps: "
            f"{len(self.waiting)} requests waiting (none loading or deferred), none running, "
            f"{self.pool.num_free} GPU blocks free, {held} held by {len(holders)} waiting "
            f"requests; the first waiting is {head.turn.req_id!r} "
            f"({head.req.num_tokens} tokens)"
        )

    # -- checks --------------------------------------------------------------------------------

    def _check(self, k: int) -> None:
        try:
            self.conn.check_invariants()
        except InvariantViolation as exc:
            self.stats.violations.append(f"step {k}: {exc}")
        self._check_events(k)
        for e in self.kv.verify_all(k):
            self.stats.data_errors.append(str(e))
        bound = self._live_bound
        for r in self.by_id.values():
            if r.hung:
                continue
            if r.status is Status.LOADING and k - r.load_since > bound:
                r.hung = True
                self.stats.hung.append(
                    f"{r.turn.req_id}: waiting on its load since step {r.load_since} (> {bound})"
                )
            elif (
                r.deferred_since is not None
                and r.deferred_last == k  # asked, and deferred again (the engine may not ask)
                and r.deferred_steps > bound
            ):
                r.hung = True
                self.stats.hung.append(
                    f"{r.turn.req_id}: lookup deferred in {r.deferred_steps} steps since step "
                    f"{r.deferred_since} (> {bound})"
                )
