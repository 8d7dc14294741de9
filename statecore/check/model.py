"""The world the model checker explores: the real stack plus a small engine and worker model.

A :class:`World` holds one real :class:`~statecore.OffloadingScheduler` over one real
:class:`~statecore.managers.cpu.CPUOffloadingManager`, one real
:class:`~statecore.worker.OffloadingWorker` per rank, each over a :class:`LabelBackend`, and an
engine model (requests, a GPU block pool, a step function in vLLM's order). Nothing of the
lifecycles is re-implemented: every decision is taken by the production code, the world only
plays the environment.

The environment's moves are :data:`Action` tuples, applied by :meth:`World.apply`:

* engine: ``("arrive", r)``, ``("step",)`` (in vLLM 0.33's order: the running requests'
  chunked prefill and decode with preemption under memory pressure, then, when none was
  preempted, admission with lookups; allocation from a LIFO free list so just-freed blocks are
  reused first; ``build_connector_meta``, every rank's ``start_step``, compute, ``end_step``,
  then ``update_connector_output``), ``("finish", r)``, ``("abort", r)``, ``("preempt", r)``;
* workers: ``("ok", rank, job)`` (the copy runs now and its report arrives), ``("fail", ...)``
  (the copy scribbles garbage and the job is reported failed), ``("lose", ...)`` (the copy
  runs, the report never arrives), ``("late", ...)`` (the copy runs, the report arrives after a
  clock jump past the stall timeout), ``("dup", rank, job, ok)`` (a delivered report arrives
  again), ``("over", job)`` (a count-only report, without rank masks, claims one more
  completion than the job still waits for); in a scope with ``manager_errors``,
  ``("okerr", rank, job, typed)`` (the report is delivered and the manager raises from the
  completion it causes, after applying it: a typed ``ManagerError`` or an untyped exception)
  and ``("steperr", call, typed)`` (an engine step in which the manager's first ``call``
  raises: ``prepare_store``, ``prepare_load``, ``lookup_many`` or ``on_schedule_end``
  before it changes anything, ``on_request_finished`` after);
* ``("jump",)``: the clock passes the stall timeout and the stall check runs;
  ``("reset",)``: the operator calls ``reset_cache``; with ``manager_errors``,
  ``("reseterr", typed)``: the same, the manager's ``reset_cache`` raising before it changes
  anything, ``("arriveerr", r, typed)``: request ``r`` arrives and the manager's
  ``on_new_request`` raises (the manager does not take it), and ``("takeerr", typed)``: the
  engine takes the KV events and the manager's ``take_events`` raises (they stay queued),
  ``("statserr", typed)``: the same for the connector's stats and ``get_stats``, and
  ``("pendingerr", typed)``: the engine asks whether to keep stepping and the manager's
  ``has_pending_work`` raises (offered when nothing of the scheduler's is pending, the only
  time the scheduler asks the manager); ``("shutdown",)`` and ``("shuterr", typed)``: once
  everything is quiescent, the engine shuts the connector down, the manager's ``shutdown``
  raising in the second (the last move of a trace: nothing follows it).

A scope with ``redis=True`` (one worker) puts the real tiering manager over the CPU tier with
the real :class:`~statecore.managers.redistier.RedisTier` below it, on a server double
(:mod:`statecore.check.shared`); the CPU tier's labels then live in pool rows that the tier
copies. Its moves: ``("down",)`` / ``("up",)`` (the server refuses connections, or is back),
``("corrupt", i)`` / ``("evict", i)`` (the value of the first prompt's chunk ``i`` is damaged or
gone), ``("peer", i)`` / ``("foreign", i)`` (another engine of the same layout, or of another
layout whose bytes carry the label ``foreign:`` + key, stores that chunk on the server).
Down, corrupt and evict are faults. The fault-free continuation never brings the server back:
with the server down, every request must still finish (lookups answer MISS).

The abstract byte model: every GPU block and CPU slot of every rank holds a *label* (the
offload key of the chunk whose KV it holds, a partial-block label, :data:`GARBAGE` or empty).
Compute writes labels, transfers copy them (through the worker's own block-mapping arithmetic,
:func:`~statecore.worker.plan_block_copies`), failed transfers scribble :data:`GARBAGE`. The
engine checks, whenever a load ends and before a request computes, that every block the
request treats as valid holds the label its tokens imply (INV-DATA), on every rank.

The whole-stack expectation oracles are those of the simulator, defined once in
:mod:`statecore.specs.invariants`: the scheduler drives the simulator's
:class:`~statecore.sim.engine.ObservedManager` over the real manager (INV-EVICT on every
``prepare_store``, the keys the stack knows of), the engine records the request each GPU block
was last handed to (INV-OWN on every store job of a step's metadata) and checks
INV-STORE-COMPLETE once a finished request's final store was built.

:meth:`World.key` is the canonical, hashable form of the whole state used to explore each
state once. It renames job ids (order-preserving, which is all the scheduler compares) and
reduces timestamps to "before or after the last clock jump" (the only clock movement is a jump
longer than the stall timeout), and leaves out counters and statistics, which never steer
behaviour.
"""

from __future__ import annotations

import logging
import operator
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from statecore.check.shared import FOREIGN, LabelPool, ServerDouble
from statecore.config import GroupConfig, SchedulerConfig
from statecore.errors import StatecoreError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import CPULoadStoreSpec, Medium, OffloadPolicy
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.filetier import InlineExecutor
from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout
from statecore.managers.tiering import TieringOffloadingManager
from statecore.scheduler import OffloadingScheduler
from statecore.sim import step as vllm_step
from statecore.sim.engine import (
    ObservedManager,
    ResetAnswer,
    SimClock,
    as_sent,
    output_answer_errors,
    reraise,
    shutdown_observed,
    update_observed,
)
from statecore.sim.hashing import ROOT_HASH, chain_hash, extend_block_hashes
from statecore.specs import invariants as oracles
from statecore.views import Request, ScheduledRequest, SchedulerOutput
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata
from statecore.worker import OffloadingWorker, TransferResult, job_specs, plan_block_copies

__all__ = [
    "GARBAGE",
    "Action",
    "Clock",
    "EngineRequest",
    "LabelBackend",
    "Scope",
    "World",
    "format_action",
]

Action = tuple[Any, ...]
"""One move of the environment, e.g. ``("step",)`` or ``("ok", 0, 3)``."""

_Pass = vllm_step.StepPass["EngineRequest", tuple[tuple[int, ...], ...]]
"""What one engine step has scheduled so far."""

INJECTED_FAULTS_LOG = logging.getLogger("statecore.check.injected_faults")
"""Where the shared tier's fault log writes in the model checker: the server's outages are
moves of the exploration, met again in state after state, so this logger passes errors only
(lower its level to see every fault the tier logs)."""
INJECTED_FAULTS_LOG.setLevel(logging.ERROR)

GARBAGE = b"garbage"
"""The label a failed copy leaves behind."""

# engine request statuses
UNARRIVED, WAITING, LOADING, RUNNING, DONE = range(5)
_STATUS = ("unarrived", "waiting", "loading", "running", "done")


@dataclass(frozen=True)
class Scope:
    """What one exploration covers.

    Attributes:
        name: the scope's name (``statecore check --scope NAME``).
        prompts: one prompt (token ids) per request; shared prefixes share offload keys.
        workers: worker ranks; every job needs a report from each.
        sliding_window: None for one full-attention group; else a second, sliding-window
            group with this window in tokens.
        gpu_blocks: GPU blocks of the engine's pool (the null block 0 comes on top).
        cpu_slots: slots of the CPU tier.
        depth: the exploration's depth bound (actions from the initial state).
        tokens_per_block: block size (tokens); one block per chunk.
        max_output: tokens each request generates before it finishes by itself.
        max_batched_tokens: token budget per engine step (smaller: chunked prefill).
        max_faults: worker faults (fail, lose, late, duplicate) along one trace.
        max_resets: ``reset_cache`` calls along one trace.
        foreign: indices of requests this connector never hears of (another connector's, as
            in a multi-connector setup): the engine schedules them, the scheduler only sees
            them in the step's output.
        free_order: ``"lifo"``: a just-freed GPU block is the next one handed out (reuse as
            soon as possible, the harshest order for fences); ``"fifo"``: vLLM's free-block
            queue, freed blocks join the tail and allocation takes the head, so a block freed
            early (a sliding-window block that left the window) is handed out before the
            blocks a request freed later (at its finish).
        redis: a shared secondary tier (the real tiering manager and RedisTier over a server
            double) below the CPU tier.
        redis_known_keys: the shared tier's ``max_known_keys`` (None: the tier's default); a
            bound below the lookups the requests have pending makes their answers compete.
        manager_errors: the manager may raise from a completion after applying it, or from
            a store offer, lookup or schedule end before changing anything, or from a finish,
            typed or untyped (``("okerr", rank, job, typed)`` and ``("steperr", call,
            typed)``, faults; INV-MGR-ERROR).
        prefix_caching_hint: the scheduler is told that the engine has a GPU prefix cache
            (``SchedulerConfig.enable_prefix_caching``), so it defers a request whose hit
            chunks another request is loading. The world's engine has no prefix cache; the
            hint is on by default so that the deferral is explored, and off where the world
            is compared with vLLM run without its prefix cache.
        description: one line for the docs.
    """

    name: str
    prompts: tuple[tuple[int, ...], ...]
    workers: int = 1
    sliding_window: int | None = None
    gpu_blocks: int = 4
    cpu_slots: int = 2
    depth: int = 8
    tokens_per_block: int = 2
    max_output: int = 2
    max_batched_tokens: int = 64
    max_faults: int = 1
    max_resets: int = 1
    foreign: tuple[int, ...] = ()
    free_order: str = "lifo"
    redis: bool = False
    redis_known_keys: int | None = None
    manager_errors: bool = False
    prefix_caching_hint: bool = True
    description: str = ""

    @property
    def num_groups(self) -> int:
        """KV-cache groups: 1, or 2 with a sliding window."""
        return 1 if self.sliding_window is None else 2

    def config(self) -> SchedulerConfig:
        """The scheduler configuration of this scope."""
        tpb = self.tokens_per_block
        groups: tuple[GroupConfig, ...] = (GroupConfig(tpb),)
        if self.sliding_window is not None:
            groups += (GroupConfig(tpb, self.sliding_window),)
        return SchedulerConfig(
            groups=groups,
            blocks_per_chunk=1,
            num_workers=self.workers,
            stall_timeout_s=10.0,
            stall_check_interval_s=1.0,
            enable_prefix_caching=self.prefix_caching_hint,
        )


_LAYOUT = TierLayout("statecore-check", "f16", (2, 2, 1, 1), 1)
"""The layout of the world's engine (and of its peer of the same layout)."""

_OTHER_LAYOUT = TierLayout("statecore-check", "bf16", (2, 2, 1, 1), 1)
"""The layout of the peer engine whose bytes are not interchangeable with the world's."""

_INLINE = InlineExecutor()

_TIER_CONFIGS: dict[tuple[TierLayout, int | None], RedisTierConfig] = {}


def _tier_config(layout: TierLayout, known_keys: int | None = None) -> RedisTierConfig:
    """The shared tier's configuration for ``layout``: lookup answers trusted for two engine
    steps (the default 32 would only multiply the states by the answers' ages), at most
    ``known_keys`` of them kept (None: the tier's default)."""
    cfg = _TIER_CONFIGS.get((layout, known_keys))
    if cfg is None:
        cfg = RedisTierConfig(
            url="redis://server-double", layout=layout, prefix="check", lookup_ttl_steps=2
        )
        if known_keys is not None:
            cfg = replace(cfg, max_known_keys=known_keys)
        _TIER_CONFIGS[layout, known_keys] = cfg
    return cfg


_SERVER_ACTIONS = frozenset(("down", "up", "corrupt", "evict", "peer", "foreign"))

_STEP_CALLS = (
    "prepare_store",
    "prepare_load",
    "lookup_many",
    "on_schedule_end",
    "on_request_finished",
)
"""The manager calls a ``("steperr", call, typed)`` step makes raise (its first one)."""

_COMPLETIONS = frozenset({"complete_store", "complete_load"})


Clock = SimClock
"""The injected clock, the simulator's (only :meth:`World.jump` moves it)."""


JUMP_S = 11.0
"""One clock jump: past the stall timeout (10 s) plus the check interval (1 s)."""


class LabelBackend:
    """A :class:`~statecore.worker.TransferBackend` that moves labels, when the world says so.

    ``submit`` records the job and its copy plan; nothing runs by itself. ``wait`` (a flush)
    runs the copies of the waited jobs now; :meth:`finish` runs a job's copy (or scribbles
    garbage for a failure) and queues its result for the worker's next ``poll``.
    """

    __slots__ = ("cpu", "done", "gpu", "submitted")

    def __init__(self, gpu: list[bytes], cpu: list[bytes]) -> None:
        self.gpu = gpu
        self.cpu = cpu
        # job id -> [is_store, plan, executed]
        self.submitted: dict[int, list[Any]] = {}
        self.done: list[TransferResult] = []

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Record the job and its plan (the worker's own block-mapping arithmetic)."""
        gpu, cpu = job_specs(job, is_store)
        plan = plan_block_copies(gpu.block_ids, gpu.group_sizes, gpu.block_indices, cpu.slots, 1)
        self.submitted[job_id] = [is_store, tuple(plan), False]

    def _copy(self, entry: list[Any], ok: bool) -> None:
        is_store, plan, _ = entry
        for _group, block, slot, _sub in plan:
            if is_store:
                self.cpu[slot] = self.gpu[block] if ok else GARBAGE
            else:
                self.gpu[block] = self.cpu[slot] if ok else GARBAGE
        entry[2] = True

    def wait(self, job_ids: Any) -> None:
        """The worker blocks until these jobs are done: their copies happen now."""
        for job_id in job_ids:
            entry = self.submitted.get(job_id)
            if entry is not None and not entry[2]:
                self._copy(entry, True)

    def finish(self, job_id: int, ok: bool) -> tuple[Any, ...]:
        """The job ends now (its copy runs unless a flush already ran it); returns its plan."""
        entry = self.submitted.pop(job_id)
        if not entry[2]:  # a job a flush waited for already ran: its outcome is only reported
            self._copy(entry, ok)
        self.done.append(TransferResult(job_id, ok, 0, 0.0, entry[0]))
        return entry[1] if entry[0] else ()

    def poll(self) -> list[TransferResult]:
        """The results :meth:`finish` queued."""
        out, self.done = self.done, []
        return out

    def shutdown(self) -> None:
        """Nothing to release."""


class EngineRequest:
    """The engine's side of one request."""

    __slots__ = (
        "aborted",
        "blocks",
        "covered",
        "epoch",
        "foreign",
        "holding",
        "idx",
        "load",
        "load_done",
        "load_failed",
        "load_job",
        "outputs",
        "req",
        "resumed",
        "scheduled_once",
        "status",
        "tokens",
    )

    def __init__(
        self, idx: int, prompt: tuple[int, ...], tpb: int, n_groups: int, foreign: bool = False
    ) -> None:
        self.idx = idx
        self.foreign = foreign
        self.tokens = list(prompt)
        self.req = Request(f"r{idx}", len(prompt), len(prompt))
        extend_block_hashes(self.req.block_hashes, self.tokens, tpb)
        self.status = UNARRIVED
        self.blocks: list[list[int]] = [[] for _ in range(n_groups)]
        self.load: tuple[int, int] | None = None
        self.load_job = -1  # the scheduler's id of the load this request waits on
        self.load_failed = False  # a rank reported it failed, or it stalled
        self.load_done = False  # the engine learnt that its load ended: promoted in step 1b
        self.holding = False  # in vLLM's kv_holding_waiting queue (statecore.sim.step)
        self.outputs = 0
        self.resumed = False
        self.scheduled_once = False
        self.aborted = False
        self.epoch = 0  # the world's reset count at arrival (INV-STORE-COMPLETE)
        self.covered = 0  # tokens an admission with a load covered (never offered again)


def _guarded(world: World, call: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except StatecoreError as exc:
        world.errors.append(f"{call} raised {type(exc).__name__} into the engine: {exc}")
    except Exception as exc:
        world.errors.append(f"{call} raised an untyped {type(exc).__name__}: {exc!r}")
    return None


class World:
    """The whole stack of one scope, in one state (see the module docstring)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        cfg = scope.config()
        self.n_groups = scope.num_groups
        self.tpb = scope.tokens_per_block
        self.window = scope.sliding_window
        self._groups: tuple[tuple[int, int | None], ...] = tuple(
            (g.tokens_per_block, g.sliding_window) for g in cfg.groups
        )
        self.clock = Clock()
        self.manager = CPUOffloadingManager(scope.cpu_slots, "lru")
        self.announced: set[OffloadKey] = set()
        """The CPU tier's stored/removed events replayed so far (INV-EVENTS)."""
        self.top: Any = self.manager  # what the scheduler drives (under the observer)
        self.tiering: TieringOffloadingManager | None = None
        self.tier: RedisTier | None = None
        self.server: ServerDouble | None = None
        self.peer_keys: tuple[OffloadKey, ...] = ()
        cpu0: list[bytes] | LabelPool | None = None
        if scope.redis:
            cpu0 = self._shared_tier(scope)
        # the simulator's observer of the manager: INV-EVICT on every prepare_store, the keys
        # the stack knows of (INV-STORE-COMPLETE); snapshots copy it with the world
        self.observed = ObservedManager(self.top)
        self.sched = OffloadingScheduler(
            cfg,
            self.observed,  # type: ignore[arg-type]
            self.clock,
            checked=False,
        )
        n_blocks = scope.gpu_blocks + 1
        self.gpu: list[list[bytes]] = [[b""] * n_blocks for _ in range(scope.workers)]
        self.cpu: list[Any] = [[b""] * scope.cpu_slots for _ in range(scope.workers)]
        if cpu0 is not None:
            self.cpu[0] = cpu0
        self.backends = [LabelBackend(self.gpu[r], self.cpu[r]) for r in range(scope.workers)]
        self.workers = [OffloadingWorker(b, rank=r) for r, b in enumerate(self.backends)]
        self.reqs = [
            EngineRequest(i, p, self.tpb, self.n_groups, i in scope.foreign)
            for i, p in enumerate(scope.prompts)
        ]
        self.waiting: list[int] = []
        self.running: list[int] = []
        # the free-block list: _take() hands out block 1 first in either order
        self.fifo = scope.free_order == "fifo"
        if scope.free_order not in ("lifo", "fifo"):
            raise ValueError(f"scope {scope.name}: free_order {scope.free_order!r}")
        self.free: list[int] = (
            list(range(1, scope.gpu_blocks + 1))
            if self.fifo
            else list(range(scope.gpu_blocks, 0, -1))
        )
        # INV-OWN: the request each GPU block was last handed to (-1: never), and the blocks
        # handed out in the current step (empty between steps)
        self.owner: list[int] = [-1] * (scope.gpu_blocks + 1)
        self.handed_now: set[int] = set()
        # INV-STORE-COMPLETE: finished requests whose final store the next step builds
        self.completeness: list[tuple[int, tuple[OffloadKey, ...], int]] = []
        self.preempted_next: set[int] = set()
        self.inflight: set[int] = set()
        """vLLM's prefills in flight: requests admitted with a load or with prompt tokens not
        yet scheduled, until their prefill is wholly scheduled (or they are preempted or
        done); an asynchronous load's admission keeps free the blocks they still need."""
        self.self_reserved: int | None = None
        """The request the last step refused only for its own in-flight reservation
        (:meth:`engine_jam`); not part of the state: each step sets it anew."""
        self.failed_ends: list[tuple[int, int]] = []
        """Loads the scheduler ended with invalid blocks, (request, computed tokens left), not
        yet learnt by the engine: it learns them at the end of the next step
        (:mod:`statecore.sim.step`)."""
        self.finished_since: set[int] = set()
        self.delivered: list[tuple[int, int, bool]] = []
        self.faults = 0
        self.resets = 0
        self.errors: list[str] = []
        self.reset_answer = ResetAnswer()  # what the last reset said, until delivered
        self.shut = False
        """The engine shut the connector down (``shutdown``/``shuterr``): nothing follows."""

    def release(self) -> None:
        """Break the reference cycles of this state (the scheduler's records and effects
        point back at the scheduler), so that it is freed as soon as it is dropped rather than
        by the cyclic garbage collector. The world is unusable afterwards: the explorer calls
        this on each restored state it is done with."""
        vars(self.sched).clear()

    def _shared_tier(self, scope: Scope) -> LabelPool:
        """The tiering manager, the RedisTier and its server double (scope ``redis``)."""
        if scope.workers != 1:
            raise ValueError(f"scope {scope.name}: a shared tier needs exactly one worker")
        first = EngineRequest(0, scope.prompts[0], self.tpb, 1)
        self.peer_keys = tuple(
            make_offload_key(h, 0) for h in first.req.block_hashes[: len(first.tokens) // self.tpb]
        )
        width = 1 + len(FOREIGN) + len(self.peer_keys[0])
        pool = LabelPool(scope.cpu_slots, width)
        self.server = ServerDouble()
        self.tier = RedisTier(
            _tier_config(_LAYOUT, scope.redis_known_keys),
            pool,
            executor=_INLINE,
            client=self.server,
            name="redis",
        )
        # the faults are the checker's own moves: their warnings would repeat in every state
        self.tier.fault_log.logger = INJECTED_FAULTS_LOG
        self.tier.fault_log.clock = self.clock
        self.tiering = TieringOffloadingManager(self.manager, [self.tier])
        self.top = self.tiering
        return pool

    def _pool(self) -> LabelPool:
        pool = self.cpu[0]
        if not isinstance(pool, LabelPool):
            raise ValueError(f"scope {self.scope.name} has no shared tier")
        return pool

    def _peer_namespace(self, layout: TierLayout) -> bytes:
        """The key namespace of a peer engine of ``layout`` (as its own RedisTier names it)."""
        tier = RedisTier(_tier_config(layout), self._pool(), executor=_INLINE, client=self.server)
        return tier.namespace

    def peer_store(self, layout: TierLayout, i: int) -> None:
        """Another engine of ``layout`` (its own RedisTier, same server) stores chunk ``i`` of
        the first prompt; an engine of another layout holds other bytes (``foreign:`` + key)."""
        key = self.peer_keys[i]
        pool = LabelPool(1, self._pool().width)
        pool[0] = key if layout is _LAYOUT else FOREIGN + key
        peer = RedisTier(_tier_config(layout), pool, executor=_INLINE, client=self.server)
        peer.submit_store(0, [key], [0])
        peer.get_finished()

    # -- labels ---------------------------------------------------------------------------------

    def expected(self, r: EngineRequest, g: int, i: int, upto: int) -> bytes:
        """The label block ``i`` of group ``g`` of ``r`` holds once ``upto`` tokens are in."""
        tpb = self.tpb
        hashes = r.req.block_hashes
        if (i + 1) * tpb <= upto and i < len(hashes):
            return make_offload_key(hashes[i], g)
        parent = hashes[i - 1] if i else ROOT_HASH
        part = chain_hash(parent, r.tokens[i * tpb : upto])
        return b"partial:" + make_offload_key(part, g)

    def _skippable(self, g: int, i: int, computed: int) -> bool:
        """Whether block ``i`` of group ``g`` is out of the window once ``computed`` tokens
        are computed: the next token attends to the last ``window`` tokens, so vLLM 0.33
        skips ``computed - window + 1`` of them (its ``remove_skipped_blocks``)."""
        w = self.window
        return g == 1 and w is not None and (i + 1) * self.tpb <= computed - w + 1

    def _verify(self, r: EngineRequest, computed: int, what: str) -> None:
        tpb = self.tpb
        n = computed // tpb  # whole blocks only: compute rewrites a partial block's label
        for g in range(self.n_groups):
            blocks = r.blocks[g]
            for i in range(min(n, len(blocks))):
                b = blocks[i]
                if not b or self._skippable(g, i, computed):
                    continue
                want = self.expected(r, g, i, (i + 1) * tpb)
                for rank in range(self.scope.workers):
                    got = self.gpu[rank][b]
                    if got != want:
                        self.errors.append(
                            f"INV-DATA: {what}: request {r.req.request_id} group {g} block "
                            f"#{i} (GPU block {b}, rank {rank}) holds {_label(got)}, "
                            f"expected {_label(want)}"
                        )
                        return

    # -- enabled actions ------------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """Every move the environment can make now."""
        if self.shut:
            return []
        out: list[Action] = [("step",)]
        s = self.sched
        if s.jobs or s.stalled_jobs or s._finished_loads or s._invalid_blocks:
            # otherwise a jump changes only the clock: a self-loop of the canonical state
            out.append(("jump",))
        for r in self.reqs:
            st = r.status
            if st == UNARRIVED:
                out.append(("arrive", r.idx))
                if self.scope.manager_errors and self.faults < self.scope.max_faults:
                    out += [("arriveerr", r.idx, True), ("arriveerr", r.idx, False)]
            elif st != DONE:
                if st == RUNNING:
                    out.append(("preempt", r.idx))
                    if r.req.num_computed_tokens == r.req.num_tokens - 1:
                        out.append(("finish", r.idx))
                if not r.aborted:
                    out.append(("abort", r.idx))
        if self.resets < self.scope.max_resets:
            out.append(("reset",))
            if self.scope.manager_errors and self.faults < self.scope.max_faults:
                out += [("reseterr", True), ("reseterr", False)]
        if self.scope.manager_errors and self.faults < self.scope.max_faults:
            out += [("takeerr", True), ("takeerr", False)]
            out += [("statserr", True), ("statserr", False)]
            if not (s.jobs or s._awaiting_signal):  # else the manager is not asked
                out += [("pendingerr", True), ("pendingerr", False)]
        if self.scope.manager_errors and self.quiescent() is None:
            # an engine shuts down once it has drained (a raising shutdown is a fault)
            out.append(("shutdown",))
            if self.faults < self.scope.max_faults:
                out += [("shuterr", True), ("shuterr", False)]
        faults_left = self.faults < self.scope.max_faults
        for rank, be in enumerate(self.backends):
            for job_id in be.submitted:
                out.append(("ok", rank, job_id))
                if faults_left:
                    out += [("fail", rank, job_id), ("lose", rank, job_id), ("late", rank, job_id)]
                    if self.scope.manager_errors:
                        out += [("okerr", rank, job_id, True), ("okerr", rank, job_id, False)]
        if faults_left:
            if self.scope.manager_errors:
                out += [("steperr", c, t) for c in _STEP_CALLS for t in (True, False)]
            for rep in self.delivered:
                out.append(("dup", *rep))
            for job_id in s.jobs:
                out.append(("over", job_id))
        if self.server is not None:
            out += self._server_actions(faults_left)
        return out

    def _server_actions(self, faults_left: bool) -> list[Action]:
        """The shared tier's environment: the server goes down or comes back, a value is
        corrupted or evicted, a peer engine (same layout, or another) stores one of the first
        prompt's chunks. A store that would change nothing (the value is there, the server is
        down) is not offered."""
        srv, tier = self.server, self.tier
        if srv is None or tier is None:
            return []
        out: list[Action] = []
        if srv.down:
            out.append(("up",))
        elif faults_left:
            out.append(("down",))
        data = srv.data
        ours = tier.namespace
        other = self._peer_namespace(_OTHER_LAYOUT)
        for i, key in enumerate(self.peer_keys):
            if ours + key in data:
                if faults_left:
                    out += [("corrupt", i), ("evict", i)]
            elif not srv.down:
                out.append(("peer", i))
            if not srv.down and other + key not in data:
                out.append(("foreign", i))
        return out

    def apply(self, action: Action) -> None:
        """Apply one move (see the module docstring); errors land in :attr:`errors`."""
        kind = action[0]
        if kind == "step":
            if self.engine_has_work():
                self.step()
        elif kind == "steperr":
            self._armed("typed" if action[2] else "untyped", self.step, calls={action[1]})
        elif kind == "jump":
            self.jump()
        elif kind == "arrive":
            self.arrive(self.reqs[action[1]])
        elif kind == "takeerr":
            self._armed(
                "typed" if action[1] else "untyped", self._take_events, calls={"take_events"}
            )
        elif kind == "statserr":
            kind_ = "typed" if action[1] else "untyped"
            self._armed(
                kind_, _guarded, self, "get_stats", self.sched.get_stats, calls={"get_stats"}
            )
        elif kind == "pendingerr":
            kind_ = "typed" if action[1] else "untyped"
            self._armed(
                kind_,
                _guarded,
                self,
                "has_pending_push_work",
                self.sched.has_pending_push_work,
                calls={"has_pending_work"},
            )
        elif kind == "shutdown":
            self.shut_down()
        elif kind == "shuterr":
            self._armed("typed" if action[1] else "untyped", self.shut_down, calls={"shutdown"})
        elif kind == "arriveerr":
            kind_ = "typed" if action[2] else "untyped"
            self._armed(kind_, self.arrive, self.reqs[action[1]], calls={"on_new_request"})
        elif kind == "finish":
            self.finish(self.reqs[action[1]])
        elif kind == "abort":
            self.abort(self.reqs[action[1]])
        elif kind == "preempt":
            self.preempt(self.reqs[action[1]])
        elif kind == "reset":
            self._reset_happened()
            self.reset_answer.reset(_guarded(self, "reset_cache", self.sched.reset))
        elif kind == "reseterr":
            self._reset_happened()
            self._armed(
                "typed" if action[1] else "untyped",
                lambda: self.reset_answer.reset(_guarded(self, "reset_cache", self.sched.reset)),
                calls={"reset_cache"},
            )
        elif kind in ("ok", "fail", "lose", "late"):
            self.report(kind, action[1], action[2])
        elif kind == "okerr":
            self.report("ok", action[1], action[2], "typed" if action[3] else "untyped")
        elif kind == "dup":
            _, rank, job_id, ok = action
            self.duplicate(rank, job_id, ok)
        elif kind == "over":
            self.over_report(action[1])
        elif kind in _SERVER_ACTIONS and self.server is not None and self.tier is not None:
            if kind == "down":
                self.faults += 1
                self.server.down = True
            elif kind == "up":
                self.server.down = False
            elif kind in ("corrupt", "evict"):
                self.faults += 1
                rkey = self.tier.namespace + self.peer_keys[action[1]]
                if kind == "corrupt":
                    self.server.corrupt(rkey)
                else:
                    del self.server.data[rkey]
            else:
                self.peer_store(_LAYOUT if kind == "peer" else _OTHER_LAYOUT, action[1])
        else:
            raise ValueError(f"unknown action {action!r}")
        obs = self.observed
        if obs.violations:
            self.errors += obs.violations
            obs.violations.clear()
        if self.shut:
            return  # nothing is taken from a connector that was shut down
        # taken after every action, through the scheduler as an engine takes them (events and
        # allocation statistics would only grow); the CPU tier's are replayed for INV-EVENTS
        self._take_events()
        _guarded(self, "get_stats", self.sched.get_stats)
        self._prune_delivered()

    def _reset_happened(self) -> None:
        """The operator resets: what the reset drops must be offered again, covers by loads
        included (INV-STORE-COMPLETE)."""
        self.resets += 1
        for r in self.reqs:
            r.covered = 0

    def shut_down(self) -> None:
        """The engine shuts the connector down (the last move), under INV-MGR-ERROR
        (:func:`~statecore.sim.engine.shutdown_observed`)."""
        bad = shutdown_observed(self.sched, self.observed)
        if bad is not None:
            self.errors.append(bad)
        self.shut = True

    def _take_events(self) -> None:
        events = _guarded(self, "take_events", self.sched.take_events)
        oracles.replay_events_into(self.announced, events or (), Medium.CPU)

    def _prune_delivered(self) -> None:
        if self.delivered:
            live, stalled = self.sched.jobs, self.sched.stalled_jobs
            self.delivered = [d for d in self.delivered if d[1] in live or d[1] in stalled]

    # -- worker moves ---------------------------------------------------------------------------

    def report(self, kind: str, rank: int, job_id: int, manager_error: str | None = None) -> None:
        """A rank's job ends: delivered, failed, lost or late; with ``manager_error``
        (``"typed"``/``"untyped"``) the manager raises from the completion this delivery
        causes (a fault only when it completes the job)."""
        if kind != "ok":
            self.faults += 1
        plan = self.backends[rank].finish(job_id, kind != "fail")
        job = self.sched.jobs.get(job_id)
        if plan and job is not None and kind != "fail":
            # a store that succeeded wrote, in each slot, the chunk of its key (the label of a
            # chunk is its key); a store the scheduler already wrote off is not checked
            cpu = self.cpu[rank]
            for key, (_, block, slot, _) in zip(job.keys, plan, strict=False):
                if cpu[slot] != key:
                    self.errors.append(
                        f"INV-DATA: store job {job_id} completed on rank {rank} but CPU slot "
                        f"{slot} (from GPU block {block}) holds {_label(cpu[slot])} for key "
                        f"{_label(key)}"
                    )
                    break
        meta = self.workers[rank].build_worker_metadata()
        if kind == "lose":
            return
        if kind == "late":
            self.jump()
        if manager_error is None:
            self.feed(meta)
        else:
            self._armed(manager_error, self.feed, meta, calls=_COMPLETIONS)
        for j in meta.completed:
            self.delivered.append((rank, j, True))
        for j in meta.failed:
            self.delivered.append((rank, j, False))

    def _armed(
        self, kind: str, fn: Callable[..., Any], *args: Any, calls: set[str] | frozenset[str]
    ) -> None:
        """``fn(*args)`` with the manager's next call among ``calls`` raising ``kind``; a
        fault of the trace only when it did."""
        obs = self.observed
        fired = obs.injected_total
        obs.fail_next, obs.fail_calls = kind, frozenset(calls)
        try:
            fn(*args)
        finally:
            obs.fail_next, obs.fail_calls = None, None
        if obs.injected_total != fired:
            self.faults += 1

    def duplicate(self, rank: int, job_id: int, ok: bool) -> None:
        """A delivered report arrives again. It spends a fault only when it changed the state:
        the scheduler ignores a rank it has already heard for that job (it counts the
        duplicate and changes nothing else), and spending the fault budget on that would only
        make a twin of the state it came from, with less budget left for the faults that do
        change something."""
        before = self.key()
        self.feed(_report(rank, job_id, ok))
        if self.key() != before:
            self.faults += 1  # the report counted: a fault of this trace

    def over_report(self, job_id: int) -> None:
        """A count-only report (no rank: a merged report, a legacy worker) claims one more
        completion of a live job than it still waits for (a duplicate merged in). It spends a
        fault only when the scheduler applied it."""
        job = self.sched.jobs[job_id]
        pending, failed = job.pending, job.failed
        self.feed(WorkerMetadata(completed={job_id: job.pending + 1}))
        if self.sched.jobs.get(job_id) is not job or (job.pending, job.failed) != (pending, failed):
            self.faults += 1  # the report counted: a fault of this trace
        # else it was rejected whole and changed nothing (but counters): spending the fault
        # budget on it would only make a twin of the state it came from

    def jump(self) -> None:
        """The clock passes the stall timeout; the stall check runs."""
        self.clock.now += JUMP_S
        self.feed(None)

    def feed(self, meta: WorkerMetadata | None) -> None:
        """``update_connector_output``, then the engine applies the loads that ended."""
        failed = meta.failed if meta is not None else {}
        for inj in self.observed.injected:
            if inj.call == "prepare_load":  # a load that failed before it started
                self.reqs[int(inj.req_id[1:])].load_failed = True
        res, other, bad = update_observed(self.sched, self.observed, meta)
        if bad is not None:
            self.errors.append(bad)
        if other is not None:
            _guarded(self, "update_connector_output", reraise, other)
        stalled = self.sched.stalled_jobs
        for r in self.reqs:
            if r.status == LOADING and (r.load_job in failed or r.load_job in stalled):
                r.load_failed = True
        if res is not None:
            self.errors.extend(output_answer_errors(res))
            self.errors.extend(self.reset_answer.output(res))
            self._loads_ended(res.finished_loads, res.invalid_block_ids)

    def _loads_ended(self, finished: frozenset[str], invalid: frozenset[int]) -> None:
        """The scheduler says these loads ended (``invalid``: the blocks they left invalid).
        A valid one is learnt now; one with invalid blocks at the end of the next step
        (:attr:`failed_ends`), as vLLM's engine learns it from the workers."""
        tpb = self.tpb
        for rid in sorted(finished):
            r = self.reqs[int(rid[1:])]
            if r.status != LOADING or r.load is None or r.load_done:
                self.errors.append(f"finished_loads names {rid}, which is not waiting on a load")
                continue
            start, n = r.load
            first_invalid: int | None = None
            for g in range(self.n_groups):
                blocks = r.blocks[g]
                for i in range(start // tpb, -(-(start + n) // tpb)):
                    if blocks[i] in invalid:
                        if first_invalid is None or i * tpb < first_invalid:
                            first_invalid = i * tpb
                        break
            valid_end = start + n if first_invalid is None else max(first_invalid, start)
            self._verify(r, valid_end, "load ended")
            if first_invalid is None:
                self._learn_load_end(r, valid_end)
                continue
            if not r.load_failed:
                self.errors.append(
                    f"INV-FAIL-STATE: the load of {rid} ended with invalid blocks although no "
                    "worker reported it failed and it did not stall (the engine fails the "
                    "request under vLLM's default kv_load_failure_policy)"
                )
            self.failed_ends.append(
                (r.idx, vllm_step.load_end(start, n, first_invalid, self.n_groups))
            )

    def _learn_load_end(self, r: EngineRequest, computed: int) -> None:
        """The engine learns that ``r``'s load ended with ``computed`` tokens valid; an
        aborted request is freed, another waits for its promotion (:meth:`_promote`)."""
        r.req.num_computed_tokens = computed
        r.load_done = True
        if r.aborted:
            self._retire(r)

    def _promote(self, r: EngineRequest) -> None:
        """Step 1b reaches ``r`` after its load ended: with nothing valid its blocks are freed
        (it starts over with a lookup); a whole prompt loaded computes its last token again."""
        if r.req.num_computed_tokens == 0:
            self._free_blocks(r)
        r.req.num_computed_tokens = min(r.req.num_computed_tokens, r.req.num_tokens - 1)
        r.load = None
        r.load_done = False
        r.load_failed = False
        r.status = WAITING

    # -- engine moves ---------------------------------------------------------------------------

    def arrive(self, r: EngineRequest) -> None:
        """A request arrives."""
        r.status = WAITING
        r.epoch = self.resets
        self.waiting.append(r.idx)
        if not r.foreign:
            _guarded(self, "on_new_request", self.sched.on_new_request, r.req)

    def finish(self, r: EngineRequest) -> None:
        """A decoding request stops (stop string) between steps."""
        self._drop_skipped(r)  # vLLM frees them before it tells the connector
        if not r.foreign:
            _guarded(self, "request_finished", self.sched.request_finished, r.req)
            self._note_finished(r)
        self.finished_since.add(r.idx)
        self._retire(r)

    def _note_finished(self, r: EngineRequest) -> None:
        """INV-STORE-COMPLETE: a request that finished (not aborted) is checked after the next
        step built its final store (unless a reset discarded that store first)."""
        req = r.req
        if req.is_aborted:
            return  # an abort: nothing is promised
        if req.request_id not in self.observed.registered:
            return  # the manager never took the request (its on_new_request raised)
        n_off = min(max(req.num_prompt_tokens, req.num_tokens - 1), req.num_computed_tokens)
        keys = oracles.store_complete_keys(
            req.block_hashes, n_off, r.covered, self._groups, self.tpb, 1
        )
        if keys:
            self.completeness.append((r.idx, tuple(keys), self.resets))

    def _check_owners(self, meta: ConnectorMetadata) -> None:
        """INV-OWN (a) on every store job of this step's metadata."""
        ids = [r.req.request_id for r in self.reqs]
        owners = [(ids[o],) if o >= 0 else () for o in self.owner]
        flush = meta.jobs_to_flush
        own = oracles.own_violation
        for j, job in meta.store_jobs.items():
            src = job.src
            blocks = src.block_ids if isinstance(src, GPULoadStoreSpec) else ()
            bad = own(j, job.req_id, blocks, owners, self.handed_now, j in flush)
            if bad is not None:
                self.errors.append(bad)
                return

    def _check_completeness(self) -> None:
        pending, self.completeness = self.completeness, []
        obs = self.observed
        unusable = self.sched.manager_reset_pending
        for idx, keys, epoch in pending:
            if epoch != self.resets or unusable:
                continue  # a reset discarded the final store, or the manager took nothing
            bad = oracles.store_complete_violation(
                self.reqs[idx].req.request_id, keys, obs.known, obs.refused
            )
            if bad is not None:
                self.errors.append(bad)

    def abort(self, r: EngineRequest) -> None:
        """A request is aborted; while it loads it keeps its blocks until the load ended."""
        r.aborted = True
        r.req.is_aborted = True
        self._drop_skipped(r)  # vLLM frees them before it tells the connector
        if not r.foreign:
            _guarded(self, "request_finished", self.sched.request_finished, r.req)
        self.finished_since.add(r.idx)
        if r.status != LOADING or r.load_done:  # a load not yet ended keeps the blocks
            self._retire(r)

    def preempt(self, r: EngineRequest) -> None:
        """A running request is preempted between steps."""
        self._preempt(r)
        self.preempted_next.add(r.idx)

    def _free_blocks(self, r: EngineRequest) -> None:
        for blocks in r.blocks:
            self.free.extend(b for b in blocks if b)
        r.blocks = [[] for _ in range(self.n_groups)]

    def _retire(self, r: EngineRequest) -> None:
        if r.idx in self.running:
            self.running.remove(r.idx)
        if r.idx in self.waiting:
            self.waiting.remove(r.idx)
        self._free_blocks(r)
        self.inflight.discard(r.idx)
        r.status = DONE

    def _preempt(self, r: EngineRequest) -> None:
        self.running.remove(r.idx)
        self._free_blocks(r)
        self.inflight.discard(r.idx)
        r.req.num_computed_tokens = 0
        r.status = WAITING
        r.resumed = True
        self.waiting.insert(0, r.idx)

    def _need(self, r: EngineRequest, upto: int, computed: int) -> list[list[int]]:
        """Positions (per group) that need a fresh block to hold tokens up to ``upto``."""
        n = -(-upto // self.tpb)
        out: list[list[int]] = []
        for g in range(self.n_groups):
            blocks = r.blocks[g]
            out.append(
                [
                    i
                    for i in range(n)
                    if (i >= len(blocks) or not blocks[i]) and not self._skippable(g, i, computed)
                ]
            )
        return out

    def _allocate(self, r: EngineRequest, need: list[list[int]], upto: int) -> list[list[int]]:
        """Hand ``r`` a fresh block at each position of ``need``; every group's list then
        reaches ``upto`` tokens, the positions out of the window holding the null block 0 (as
        vLLM's block lists do). Returns the new ids per group."""
        new: list[list[int]] = []
        n = -(-upto // self.tpb)
        for g, positions in enumerate(need):
            blocks = r.blocks[g]
            got: list[int] = []
            for i in positions:
                while len(blocks) <= i:
                    blocks.append(0)
                b = self.free.pop(0) if self.fifo else self.free.pop()
                self.owner[b] = r.idx
                self.handed_now.add(b)
                blocks[i] = b
                got.append(b)
            while len(blocks) < n:
                blocks.append(0)
            new.append(got)
        return new

    def _drop_skipped(self, r: EngineRequest) -> None:
        """Free the sliding-window blocks no future token attends to (vLLM does so)."""
        if self.window is None:
            return
        computed = r.req.num_computed_tokens
        blocks = r.blocks[1]
        for i, b in enumerate(blocks):
            if b and self._skippable(1, i, computed):
                self.free.append(b)
                blocks[i] = 0

    def engine_has_work(self) -> bool:
        """Whether the engine's loop steps at all: vLLM 0.33's ``Scheduler.has_requests``,
        asked before every step.

        Requests waiting or running, finishes or preemptions not yet sent to the workers, or
        the connector's ``has_pending_push_work``. When it answers no, the engine idles until a
        request arrives: what the workers still hold (copies in flight, a flush they have not
        been sent) stays there, and the liveness check finds it if nothing else would ever
        send it.
        """
        return vllm_step.has_requests(
            any(r.status in (WAITING, LOADING, RUNNING) for r in self.reqs),
            bool(self.finished_since or self.preempted_next),
            lambda: bool(_guarded(self, "has_pending_push_work", self.sched.has_pending_push_work)),
        )

    def step(self) -> None:
        """One engine step in vLLM 0.33's order (:mod:`statecore.sim.step`): the running
        requests, then (when none was preempted) the waiting ones."""
        sched = self.sched
        self.observed.refused.clear()
        # the failed loads this step's metadata echoes: the engine learns them at its end
        echoed, self.failed_ends = self.failed_ends, []
        self.self_reserved = None
        pass_: _Pass = vllm_step.StepPass(self.scope.max_batched_tokens)
        running = [self.reqs[i] for i in self.running]
        vllm_step.schedule(
            pass_,
            lambda p: vllm_step.schedule_running(running, p, self),
            self._step_waiting,
        )
        scheduled = pass_.scheduled
        reqs = self.reqs
        if self.inflight:  # a prefill scheduled to its end is no longer in flight
            for r, n, _, _ in scheduled:
                if r.req.num_computed_tokens + n >= r.req.num_tokens:
                    self.inflight.discard(r.idx)
        listed, as_new = vllm_step.listed(pass_)
        output = SchedulerOutput(
            scheduled=tuple(
                ScheduledRequest(r.req.request_id, nb, n, False) for r, n, nb, _ in listed
            ),
            new_req_ids=frozenset(r.req.request_id for r in as_new),
            finished_req_ids=frozenset(reqs[i].req.request_id for i in self.finished_since),
            preempted_req_ids=frozenset(
                [r.req.request_id for r in pass_.preempted]
                + [reqs[i].req.request_id for i in self.preempted_next]
            ),
        )
        self.finished_since = set()
        self.preempted_next = set()
        meta = _guarded(self, "build_connector_meta", sched.build_connector_meta, output)
        if meta is None:
            meta = ConnectorMetadata()
        else:
            self.errors.extend(self.reset_answer.built(meta))
        if meta.store_jobs:
            self._check_owners(meta)
        self.handed_now.clear()
        if self.completeness:
            self._check_completeness()
        self.observed.refused.clear()  # used only by that check: empty between steps
        # pickled to the workers, as vLLM's multiprocess executor does
        sent = _guarded(self, "pickling the step's metadata", as_sent, meta) or meta
        for w in self.workers:
            _guarded(self, "worker.start_step", w.start_step, sent)
        for r, n, _, _ in scheduled:
            if r.status == RUNNING:
                self._compute(r, n)
        for w in self.workers:
            _guarded(self, "worker.end_step", w.end_step, sent)
        for r, n, _, _ in scheduled:
            if r.status == RUNNING:
                self._after_compute(r, n)
        self.feed(None)
        for idx, computed in echoed:
            r = self.reqs[idx]
            if r.status == LOADING and not r.load_done:
                self._learn_load_end(r, computed)

    def _step_waiting(self, pass_: _Pass) -> None:
        """Step 1b of :mod:`statecore.sim.step`: admit waiting requests into the step; those
        it skips go to the front of their queue."""
        skipped: list[int] = []
        self._admit_waiting(pass_, skipped)
        if skipped:
            reqs = self.reqs
            for idx in skipped:
                r = reqs[idx]
                r.holding = vllm_step.holds_kv(r.req.num_computed_tokens, r.status == LOADING)
            self.waiting = vllm_step.requeue_skipped(self.waiting, skipped)

    def _admit_waiting(self, pass_: _Pass, skipped: list[int]) -> None:
        """Step 1b's pass over the waiting requests (those it skips into ``skipped``)."""
        sched = self.sched
        reqs = self.reqs
        for idx in vllm_step.waiting_order(self.waiting, lambda i: reqs[i].holding):
            r = reqs[idx]
            budget = pass_.budget
            if budget <= 0:
                break
            if idx in self.preempted_next:
                skipped.append(idx)
                continue
            if r.status == LOADING:
                if not r.load_done:
                    skipped.append(idx)
                    continue
                self._promote(r)
            if r.foreign:
                computed = r.req.num_computed_tokens if any(r.blocks) else 0
            elif r.load is None and not any(r.blocks):
                res = _guarded(
                    self, "get_num_new_matched_tokens", sched.get_num_new_matched_tokens, r.req, 0
                )
                if res is None or res[0] is None:
                    skipped.append(idx)
                    continue
                ext, is_async = res
                if ext > 0 and is_async:
                    need = self._need(r, ext, ext)
                    blocks = vllm_step.admission_blocks(
                        sum(map(len, need)),
                        sum(map(len, self._need(r, r.req.num_tokens, ext))),
                        self._inflight_reserved(),
                    )
                    if blocks > len(self.free):
                        if idx in self.inflight:
                            self._note_self_reserve(r, need, ext, blocks)
                        break
                    self._allocate(r, need, ext)
                    created = _guarded(
                        self,
                        "update_state_after_alloc",
                        sched.update_state_after_alloc,
                        r.req,
                        tuple(tuple(b) for b in r.blocks),
                        ext,
                    )
                    r.status = LOADING
                    r.req.num_computed_tokens = ext  # vLLM counts them from the admission
                    self.inflight.add(idx)
                    r.load = (0, ext)
                    r.covered = max(r.covered, ext)
                    # the load job the scheduler says it created (-1: none, and an error
                    # recorded when the call raised)
                    r.load_job = created.job_id if created is not None else -1
                    skipped.append(idx)
                    continue
                computed = 0
            else:
                computed = r.req.num_computed_tokens
            n = min(r.req.num_tokens - computed, budget)
            need = self._need(r, computed + n, computed)
            blocks = vllm_step.admission_blocks(
                sum(map(len, need)), sum(map(len, self._need(r, r.req.num_tokens, computed)))
            )
            while blocks > len(self.free) and not self.running:
                # nothing runs that could free blocks: requests that hold blocks but wait
                # (their load ended) give them back and start over, newest first
                victim = next(
                    (
                        self.reqs[v]
                        for v in reversed(self.waiting)
                        if v != idx and self.reqs[v].status == WAITING and any(self.reqs[v].blocks)
                    ),
                    None,
                )
                if victim is None:
                    break
                self._free_blocks(victim)
                victim.req.num_computed_tokens = 0
                pass_.preempted.add(victim)
            if blocks > len(self.free):
                break
            self._allocate(r, need, computed + n)
            if not r.foreign:
                _guarded(
                    self,
                    "update_state_after_alloc",
                    sched.update_state_after_alloc,
                    r.req,
                    tuple(tuple(b) for b in r.blocks),
                    0,
                )
            r.req.num_computed_tokens = computed
            self.waiting.remove(idx)
            self.running.append(idx)
            r.status = RUNNING
            r.holding = False
            if computed + n < r.req.num_tokens:
                self.inflight.add(idx)
            if not r.scheduled_once:
                pass_.new.add(r)
            pass_.scheduled.append(
                (r, n, tuple(tuple(b) for b in r.blocks), r.resumed and r.scheduled_once)
            )
            r.scheduled_once = True
            r.resumed = False
            pass_.budget -= n

    def _note_self_reserve(
        self, r: EngineRequest, need: list[list[int]], ext: int, blocks: int
    ) -> None:
        """An asynchronous load's admission of ``r`` was refused, ``r`` being a prefill in
        flight itself (its last load ended with nothing valid): whether it would have fitted
        without its own reservation (:meth:`engine_jam`)."""
        own = sum(
            vllm_step.remaining_blocks(-(-r.req.num_tokens // self.tpb), len(r.blocks[g]), 0)
            for g in range(self.n_groups)
        )
        without = vllm_step.admission_blocks(
            sum(map(len, need)),
            sum(map(len, self._need(r, r.req.num_tokens, ext))),
            self._inflight_reserved() - own,
        )
        if without <= len(self.free) < blocks:
            self.self_reserved = r.idx

    def engine_jam(self) -> str | None:
        """What jams the engine for good, when it is vLLM 0.33's own admission rule and not
        the connector: nothing runs or loads (a request whose load ended may wait behind the
        jammed one, unpromoted), everything the workers were told of is sent,
        nothing of the stack is in flight, and the last step refused an asynchronous load
        only because vLLM's in-flight reserve counts the request against itself (a request
        whose load ended with nothing valid stays a prefill in flight; in a pool smaller
        than twice its sequence it is never admitted again). None otherwise."""
        idx = self.self_reserved
        if idx is None or self.running or self.finished_since or self.preempted_next:
            return None
        if any(r.status == LOADING and not r.load_done for r in self.reqs):
            return None  # a load still in flight (one that ended waits behind the jam)
        if self._in_flight() is not None:
            return None
        r = self.reqs[idx]
        return (
            f"request {r.req.request_id} waits for good: vLLM's in-flight reserve counts it "
            f"against its own admission ({len(self.free)} GPU blocks free)"
        )

    def _inflight_reserved(self) -> int:
        """Blocks the prefills in flight (:attr:`inflight`) still need for their whole
        sequence (:func:`statecore.sim.step.remaining_blocks`): what vLLM keeps free when it
        admits a load."""
        reqs, tpb, w = self.reqs, self.tpb, self.window
        out = 0
        for r in map(reqs.__getitem__, self.inflight):
            required = -(-r.req.num_tokens // tpb)
            skipped = max(0, r.req.num_computed_tokens - w + 1) // tpb if w is not None else 0
            for g in range(self.n_groups):
                out += vllm_step.remaining_blocks(
                    required, len(r.blocks[g]), skipped if g == 1 else 0
                )
        return out

    # -- the running requests, as statecore.sim.step.schedule_running asks -------------------

    def is_running(self, r: EngineRequest) -> bool:
        """Whether ``r`` is running (:class:`~statecore.sim.step.RunningModel`)."""
        return r.status == RUNNING

    def token_counts(self, r: EngineRequest) -> tuple[int, int]:
        """``r``'s computed tokens and its tokens so far."""
        return r.req.num_computed_tokens, r.req.num_tokens

    def free_out_of_window(self, r: EngineRequest) -> None:
        """Free ``r``'s sliding-window blocks no future token attends to."""
        self._drop_skipped(r)

    def blocks_needed(self, r: EngineRequest, upto: int, computed: int) -> int:
        """Fresh blocks ``r`` needs for ``upto`` tokens, every group together."""
        return sum(map(len, self._need(r, upto, computed)))

    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self.free)

    def preempt_now(self, r: EngineRequest) -> None:
        """Preempt ``r`` inside the step (its blocks freed, back at the head of the queue)."""
        self._preempt(r)

    def allocate(self, r: EngineRequest, upto: int, computed: int) -> tuple[tuple[int, ...], ...]:
        """Give ``r`` the blocks for ``upto`` tokens; returns the new ids per group."""
        new = self._allocate(r, self._need(r, upto, computed), upto)
        return tuple(tuple(b) for b in new)

    def _compute(self, r: EngineRequest, n: int) -> None:
        start = r.req.num_computed_tokens
        self._verify(r, start, "before compute")
        end = start + n
        tpb = self.tpb
        for g in range(self.n_groups):
            blocks = r.blocks[g]
            for i in range(start // tpb, -(-end // tpb)):
                b = blocks[i]
                if not b:
                    continue
                label = self.expected(r, g, i, min(end, (i + 1) * tpb))
                for rank in range(self.scope.workers):
                    self.gpu[rank][b] = label

    def _after_compute(self, r: EngineRequest, n: int) -> None:
        req = r.req
        req.num_computed_tokens += n
        if req.num_computed_tokens < req.num_tokens:
            return
        r.tokens.append(100 + r.outputs)
        r.outputs += 1
        req.num_tokens += 1
        extend_block_hashes(req.block_hashes, r.tokens, self.tpb)
        if r.outputs >= self.scope.max_output:
            self._drop_skipped(r)  # vLLM frees them before it tells the connector
            if not r.foreign:
                _guarded(self, "request_finished", self.sched.request_finished, req)
                self._note_finished(r)
            self.finished_since.add(r.idx)
            self._retire(r)

    # -- checks ---------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        """Everything wrong with this state: errors raised into the engine, data errors,
        every scheduler ``INV-*`` predicate and the CPU manager's own bookkeeping."""
        out = list(self.errors)
        for code, msg in oracles.scheduler_violations(self.sched):
            out.append(f"{code}: {msg}")
            break
        try:
            self.manager.check_invariants()
        except StatecoreError as exc:
            out.append(f"manager: {exc}")
        bad = self._events_violation()
        if bad is not None:
            out.append(bad)
        for r in self.reqs:
            if r.status in (WAITING, RUNNING) and any(r.blocks) and r.load is None:
                before = len(self.errors)
                self._verify(r, r.req.num_computed_tokens, "at rest")
                out += self.errors[before:]
                del self.errors[before:]
        return out

    def _events_violation(self) -> str | None:
        """INV-EVENTS on the CPU tier: the replay of its events (taken after every action)
        against the keys it holds readable."""
        ready = set(self.manager.ready_keys())
        bad = oracles.events_violation(self.announced, ready)
        if bad is not None:
            self.announced = ready  # report each divergence once
        return bad

    def quiescent(self) -> str | None:
        """None when nothing is left anywhere; else what is left (for liveness)."""
        for r in self.reqs:
            if r.status not in (UNARRIVED, DONE):
                return f"request {r.req.request_id} is still {_STATUS[r.status]}"
        s = self.sched
        if s.requests:
            return f"scheduler still tracks {sorted(s.requests)}"
        t = self.tiering
        if t is not None and t.tracked_requests():
            return f"the tiering manager still tracks {sorted(t.tracked_requests())}"
        return self._in_flight()

    def _in_flight(self) -> str | None:
        """What of the stack is still in flight (jobs, pins, copies, pending push work), for
        :meth:`quiescent` and :meth:`engine_jam`; None when nothing."""
        s = self.sched
        if s.jobs or s.stalled_jobs:
            return f"jobs left: live {sorted(s.jobs)}, stalled {sorted(s.stalled_jobs)}"
        if s.has_pending_push_work():
            return "the scheduler still has pending push work"
        for key in self.manager.present_keys():
            ref = self.manager.ref_count(key)
            if ref:
                what = "write-pending" if ref < 0 else f"pinned {ref} times"
                return f"CPU key {_label(key)} is left {what}"
        for rank, (w, be) in enumerate(zip(self.workers, self.backends, strict=True)):
            if w.deferred or w.in_flight or be.submitted:
                return f"rank {rank} still has jobs {sorted(set(w.deferred) | set(be.submitted))}"
        t = self.tiering
        if t is not None and t.in_flight_jobs():
            return f"the tiering manager has {t.in_flight_jobs()} tier jobs in flight"
        return None

    # -- canonical form -------------------------------------------------------------------------

    def key(self) -> tuple[Any, ...]:
        """The canonical, hashable form of the whole state (see the module docstring)."""
        s = self.sched
        now = self.clock.now
        stalled = s.stalled_jobs
        live = s.jobs
        batch = s._batch
        ids: set[int] = {*live, *stalled, *batch.flush, s.stale_threshold, s.next_job_id}
        for w, be in zip(self.workers, self.backends, strict=True):
            ids.update(w._deferred)
            ids.update(be.submitted)
        for d in self.delivered:
            ids.add(d[1])
        reqs_ = self.reqs
        for r in reqs_:
            if r.load is not None:
                ids.add(r.load_job)
        ren = {j: n for n, j in enumerate(sorted(ids))}
        chunk = OffloadPolicy.CHUNK_LEVEL
        reqs = tuple(
            [
                (
                    rid,
                    state,
                    tuple(sorted([ren[j] for j in jobs])) if jobs else (),
                    tuple(
                        [
                            (tuple(keys), tuple(block_ids), cursor, skip)
                            for keys, block_ids, cursor, skip in map(_group_fields, groups)
                        ]
                    ),
                    max_load,
                    max_offload,
                    num_local,
                    num_scheduled,
                    n_hashes,
                    deferred_since is None,  # only whether it is set is ever read
                    signalled,
                    registered,
                    store_floor,
                    store_cap,
                    policy is chunk,
                )
                for (
                    rid,
                    state,
                    jobs,
                    groups,
                    max_load,
                    max_offload,
                    num_local,
                    num_scheduled,
                    n_hashes,
                    deferred_since,
                    signalled,
                    registered,
                    store_floor,
                    store_cap,
                    policy,
                ) in map(_record_fields, s.requests.values())
            ]
        )
        # timestamps: the clock only moves by jumps longer than the stall timeout, so all a
        # comparison can see is whether a jump happened since (1) or not (0)
        jobs = tuple(
            [
                (
                    ren[j.job_id],
                    j.req.req_id,
                    *_job_fields(j),
                    now > j.created_at,
                    now > j.stalled_at if j.job_id in stalled else False,
                    *_job_flags(j),
                )
                for j in (*live.values(), *stalled.values())
            ]
        )
        fence = s.fence_index
        loading = s.loading_keys
        sched_key = (
            reqs,
            jobs,
            len(stalled),
            ren[s.stale_threshold],
            ren[s.next_job_id],
            tuple(sorted([(b, tuple(sorted([ren[j] for j in js]))) for b, js in fence.items()]))
            if fence
            else (),
            tuple(sorted(loading.items())) if loading else (),
            tuple(sorted([ren[j] for j in batch.flush])) if batch.flush else (),
            tuple(sorted(batch.allocated)),
            tuple(s._awaiting_signal),
            tuple(sorted(s._finished_loads)),
            tuple(sorted(s._invalid_blocks)),
            now > s._table.last_stall_check,
            s._manager_reset_pending,
            # errors caught and not yet raised, injected and not yet judged (INV-MGR-ERROR)
            tuple([type(exc).__name__ for exc, _ in s._manager_failures]),
            tuple([(i.call, type(i.error).__name__) for i in self.observed.injected]),
        )
        m = self.manager
        ends = m._schedule_ends
        quarantine = m._quarantine
        mgr_key = (
            tuple(m._entries.items()),
            tuple(m.policy.evictable_blocks),  # type: ignore[attr-defined]
            tuple(m._free),
            m._high_water,
            tuple(sorted(self.observed.known)),
            tuple(sorted(self.observed.registered)),
            tuple([(slot, rel - ends) for slot, rel in quarantine.items()]) if quarantine else (),
        )
        workers_key = tuple(
            [
                (
                    tuple([(ren[j], _transfer_key(job)) for j, job in w._deferred.items()])
                    if w._deferred
                    else (),
                    tuple([(ren[j], v) for j, v in w._inflight.items()]) if w._inflight else (),
                    tuple([(ren[j], e[0], e[1], e[2]) for j, e in be.submitted.items()])
                    if be.submitted
                    else (),
                    tuple(gpu),
                    tuple(cpu),
                )
                for w, be, gpu, cpu in zip(
                    self.workers, self.backends, self.gpu, self.cpu, strict=True
                )
            ]
        )
        resets = self.resets
        engine_key = (
            tuple(
                [
                    (
                        r.status,
                        tuple([tuple(b) for b in r.blocks]),
                        r.req.num_computed_tokens,
                        r.req.num_tokens,
                        r.load,
                        r.resumed,
                        r.scheduled_once,
                        r.aborted,
                        ren[r.load_job] if r.load is not None else -1,
                        r.load_failed,
                        r.load_done,
                        r.holding,
                        r.epoch == resets,
                        r.covered,
                    )
                    for r in reqs_
                ]
            ),
            tuple(self.failed_ends),
            tuple(sorted(self.inflight)),
            tuple(self.waiting),
            tuple(self.running),
            tuple(self.free),
            tuple(self.owner),
            tuple(sorted(self.preempted_next)),
            tuple(sorted(self.finished_since)),
            tuple([(a, ren[j], ok) for a, j, ok in self.delivered]),
            tuple([(i, k, e == resets) for i, k, e in self.completeness]),
            self.faults,
            resets,
            self.shut,
        )
        if self.tiering is None:
            return (sched_key, mgr_key, workers_key, engine_key)
        return (sched_key, mgr_key, workers_key, engine_key, self._tier_key())

    def _tier_key(self) -> tuple[Any, ...]:
        """The shared tier's part of :meth:`key`: the server's values and state, the tiering
        manager's jobs, promotions and requests, the RedisTier's lookup answers (their ages
        capped where a lookup can no longer tell them apart), queries and jobs; the tiering
        manager's job ids relative to its next one."""
        t, tier, srv = self.tiering, self.tier, self.server
        if t is None or tier is None or srv is None:
            return ()
        nxt = t._next_job_id
        step = tier._step
        cap = tier.config.lookup_ttl_steps + 1
        return (
            tuple(sorted(srv.data.items())),
            srv.down,
            tuple(
                [
                    (j - nxt, tj.tier, tj.keys, tj.is_promotion, tj.ctx.req_id)
                    for j, tj in t._jobs.items()
                ]
            ),
            tuple(
                [
                    tuple([(rid, tuple(p.keys), tuple(p.slots)) for rid, p in per.items()])
                    for per in t._pending_promotions
                ]
            ),
            t._polled_this_step,
            tuple(sorted(t._hits_this_step)),
            tuple(
                [
                    (rid, st.pending_primary_stores, st.is_finished, st.request_level_tiers)
                    for rid, st in t._req_state.items()
                ]
            ),
            tuple(sorted(t._finalized)),
            tuple([(k, p, min(step - at, cap)) for k, (p, at) in tier._known.items()]),
            tuple(tier._to_query),
            tuple(sorted(tier._querying)),
            # who awaits which key and the answers held for them (_awaits is the inverse)
            tuple(sorted([(k, tuple(sorted(w))) for k, w in tier._awaited.items()])),
            tuple(sorted(tier._held.items())),
            tuple([(keys, _outcome(fut)) for keys, fut in tier._queries]),
            tuple(sorted(tier._storing)),
            tuple(
                [
                    (j - nxt, rj.is_store, rj.keys, rj.written, _outcome(rj.future))
                    for j, rj in tier._jobs.items()
                ]
            ),
        )

    def describe(self) -> dict[str, str]:
        """A readable summary, one entry per entity (for counterexample diffs)."""
        out: dict[str, str] = {}
        for r in self.reqs:
            if r.status == UNARRIVED:
                continue
            blocks = "/".join(",".join(map(str, b)) for b in r.blocks)
            out[f"engine {r.req.request_id}"] = (
                f"{_STATUS[r.status]} computed={r.req.num_computed_tokens}/{r.req.num_tokens}"
                f" blocks=[{blocks}]" + (" aborted" if r.aborted else "")
            )
        s = self.sched
        for rid in s.requests:
            rec = s.requests[rid]
            out[f"scheduler {rid}"] = (
                f"{s.request_state(rid)} jobs={sorted(rec.jobs)} cursors="
                f"{[gs.cursor for gs in rec.groups]}"
            )
        for jid, job in s.jobs.items():
            kind = "store" if job.is_store else "load"
            out[f"job {jid}"] = (
                f"{kind} of {job.req.req_id} blocks={list(job.blocks)} pending={job.pending}"
                f" failed={job.failed}" + (" flushed" if job.flushed else "")
            )
        for jid, job in s.stalled_jobs.items():
            out[f"job {jid}"] = f"stalled, {job.pending} reports outstanding"
        for key in self.manager.present_keys():
            out[f"cpu {_label(key)}"] = (
                f"slot {self.manager.slot_of(key)} ref {self.manager.ref_count(key)}"
            )
        for rank, (w, be) in enumerate(zip(self.workers, self.backends, strict=True)):
            if w.deferred or be.submitted:
                out[f"rank {rank}"] = (
                    f"deferred={list(w.deferred)} submitted="
                    f"{[(j, 'ran' if e[2] else 'queued') for j, e in be.submitted.items()]}"
                )
            for b in range(1, len(self.gpu[rank])):
                if self.gpu[rank][b]:
                    out[f"rank {rank} gpu block {b}"] = _label(self.gpu[rank][b])
            for slot, lab in enumerate(self.cpu[rank]):
                if lab:
                    out[f"rank {rank} cpu slot {slot}"] = _label(lab)
        if self.server is not None and self.tier is not None:
            ours = self.tier.namespace
            out["server"] = "down" if self.server.down else "up"
            for rkey, value in self.server.data.items():
                who = "ours" if rkey.startswith(ours) else "other layout"
                out[f"server {_label(rkey[-len(self.peer_keys[0]) :])} ({who})"] = (
                    f"{len(value)} bytes, crc {zlib.crc32(value):08x}"
                )
            for key, (present, at) in self.tier._known.items():
                age = self.tier._step - at
                out[f"redis answer {_label(key)}"] = (
                    f"{'present' if present else 'absent'}, age {age}"
                )
            for key, waiters in self.tier._awaited.items():
                held = self.tier._held.get(key)
                out[f"redis awaited {_label(key)}"] = f"by {','.join(sorted(waiters))}, " + (
                    "no answer yet" if held is None else f"held {'present' if held else 'absent'}"
                )
        out["clock"] = f"{self.clock.now:g}s"
        return out


def _outcome(fut: Future[Any]) -> Any:
    """A finished future as plain data: its result, or its exception's type."""
    if not fut.done():
        return None
    exc = fut.exception()
    if exc is not None:
        return type(exc).__name__
    result = fut.result()
    return tuple(result) if isinstance(result, list) else result


_record_fields = operator.attrgetter(
    "req_id",
    "state",
    "jobs",
    "groups",
    "max_load_tokens",
    "max_offload_tokens",
    "num_local_computed",
    "num_scheduled",
    "n_hashes",
    "deferred_since",
    "signalled",
    "registered",
    "store_floor",
    "store_cap",
    "policy",
)
"""The fields of a scheduler request record that :meth:`World.key` reads, in one C call."""

_group_fields = operator.attrgetter("keys", "block_ids", "cursor", "skip")

_job_fields = operator.attrgetter("is_store", "keys", "blocks", "pending", "failed", "seen")

_job_flags = operator.attrgetter(
    "fenced", "deferred_fence", "deferred_registered", "flushed", "state"
)


def _transfer_key(job: TransferJob) -> tuple[Any, ...]:
    """A transfer job as plain tuples (hashing the dataclasses runs Python code)."""
    out: list[Any] = [job.req_id]
    for spec in (job.src, job.dst):
        if isinstance(spec, GPULoadStoreSpec):
            out += [spec.block_ids, spec.group_sizes, spec.block_indices]
        elif isinstance(spec, CPULoadStoreSpec):
            out.append(spec.slots)
        else:
            out.append(spec)
    return tuple(out)


def _report(rank: int, job_id: int, ok: bool) -> WorkerMetadata:
    m = WorkerMetadata(rank=rank)
    (m.mark_completed if ok else m.mark_failed)(job_id)
    return m


_NAMES: dict[bytes, str] = {}


def _label(lab: bytes) -> str:
    """A short readable name for a label or key."""
    if not lab:
        return "empty"
    if lab == GARBAGE:
        return "GARBAGE"
    prefix = lab[:8] if lab.startswith((b"partial:", FOREIGN)) else b""
    body = lab[len(prefix) :]
    name = _NAMES.get(body)
    if name is None:
        name = _NAMES[body] = f"{body[:3].hex()}/g{int.from_bytes(body[-4:], 'big')}"
    return (prefix[:-1].decode() + " " if prefix else "") + name


def format_action(action: Action) -> str:
    """An action in words."""
    kind = action[0]
    text = {
        "step": "engine step",
        "jump": "clock jumps past the stall timeout",
        "reset": "operator: reset_cache",
        "reseterr": "operator: reset_cache, the manager's reset raising (typed={1})",
        "arrive": "request r{1} arrives",
        "arriveerr": "request r{1} arrives; the manager's on_new_request raises (typed={2})",
        "takeerr": "the engine takes the KV events; the manager's take_events raises (typed={1})",
        "statserr": "the engine takes the connector's stats; the manager's get_stats raises "
        "(typed={1})",
        "pendingerr": "the engine asks whether to keep stepping; the manager's "
        "has_pending_work raises (typed={1})",
        "shutdown": "the engine, drained, shuts the connector down",
        "shuterr": "the engine, drained, shuts the connector down; the manager's shutdown "
        "raises (typed={1})",
        "finish": "request r{1} finishes (stop)",
        "abort": "request r{1} is aborted",
        "preempt": "request r{1} is preempted",
        "ok": "rank {1} completes job {2}, report delivered",
        "okerr": "rank {1} completes job {2}, report delivered; the manager raises from the "
        "completion (typed={3})",
        "steperr": "engine step in which the manager's first {1} raises (typed={2})",
        "fail": "rank {1} fails job {2} (garbage written), failure reported",
        "lose": "rank {1} completes job {2}, the report is lost",
        "late": "rank {1} completes job {2}, the report arrives after the stall timeout",
        "dup": "rank {1}'s report for job {2} (ok={3}) is delivered again",
        "over": "a count-only report claims one more completion of job {1} than outstanding",
        "down": "the shared tier's server goes down",
        "up": "the shared tier's server comes back",
        "corrupt": "a value on the server (chunk {1} of r0, our layout) is corrupted",
        "evict": "the server evicts a value (chunk {1} of r0, our layout)",
        "peer": "an engine of the same layout stores chunk {1} of r0 on the server",
        "foreign": "an engine of another layout stores chunk {1} of r0 on the server",
    }.get(kind, repr(action))
    return text.format(*action)
