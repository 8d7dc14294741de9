"""The simulated engine: an LLM serving loop that drives the real statecore stack.

Per step, in the order vLLM's engine uses (see the module docs of :mod:`statecore.sim`):

1. waiting requests, in order: local GPU prefix-cache hit, then
   ``get_num_new_matched_tokens``; ``None`` keeps the request waiting; an asynchronous hit
   allocates blocks, calls ``update_state_after_alloc`` and parks the request until its id
   appears in ``finished_loads``; otherwise the request is allocated and scheduled;
2. running requests: chunked prefill, then one decode token per step; when blocks run out the
   newest running request is preempted (blocks freed, listed in ``preempted_req_ids``);
3. ``build_connector_meta``;
4. every worker rank: ``start_step`` (flush, loads), compute (the scheduled tokens' KV bytes are
   written into their GPU blocks), ``end_step``, ``build_worker_metadata``; the reports pass the
   fault channel, are aggregated and fed to ``update_connector_output``;
5. finished and aborted requests: ``request_finished``, then their blocks are freed at once
   (an aborted request that waits on a load keeps its blocks until the load ended).

After every step: ``scheduler.check_invariants()``, the data oracle over every valid GPU block,
the allocator's own consistency, and INV-LIVE (no request deferred or waiting on a load for
more than a bounded number of steps).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from statecore.errors import InvariantViolation, StatecoreError
from statecore.sim.blocks import BlockPool
from statecore.sim.faults import ReportChannel, SimFaults
from statecore.sim.hashing import ROOT_HASH, extend_block_hashes
from statecore.sim.kv import KVCache
from statecore.sim.workload import Turn, Workload, WorkloadConfig
from statecore.views import Request, ScheduledRequest, SchedulerOutput
from statecore.wire import ConnectorMetadata, WorkerMetadata

__all__ = [
    "ConnectorLike",
    "EngineStats",
    "RankStack",
    "SimClock",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "Status",
]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that shapes one simulation run (the seed fixes the rest).

    Attributes:
        seed: seeds every random stream of the run.
        steps: engine steps before the remaining requests are aborted and the run drains.
        num_workers: worker ranks (each with its own KV tensors and CPU pool).
        workload: the request mix.
        faults: fault probabilities.
        tokens_per_block: GPU block size in tokens (also the hash block size).
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
        tiering: put a file tier (in a temporary directory) behind the CPU tier.
        checked: run the scheduler in checked mode (lifecycle machines beside the tables).
        copy_impl: the torch adapter's copy mode on the CPU tensors: ``"auto"`` (direct
            copies) or ``"staging"`` (the CUDA staging path's code: queued jobs, bounce
            buffers, the host scatter of a store when it completes).
    """

    seed: int = 0
    steps: int = 4000
    num_workers: int = 2
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    faults: SimFaults = field(default_factory=lambda: SimFaults.preset("default"))
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
    tiering: bool = False
    checked: bool = False
    copy_impl: str = "auto"

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
    ) -> None: ...
    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata: ...
    def update_connector_output(self, meta: WorkerMetadata | None) -> Any: ...
    def request_finished(self, request: Any) -> tuple[bool, None]: ...
    def has_pending_push_work(self) -> bool: ...
    def reset_cache(self) -> None: ...
    def check_invariants(self) -> None: ...


class RankStack(Protocol):
    """One worker rank as the engine sees it."""

    def start_step(self, meta: ConnectorMetadata) -> None: ...
    def end_step(self, meta: ConnectorMetadata) -> None: ...
    def report(self) -> WorkerMetadata | None: ...
    def advance(self, step: int) -> None: ...
    def pending_copies(self) -> int: ...


class Status(enum.Enum):
    """Where a simulated request is in the engine."""

    WAITING = "waiting"
    LOADING = "waiting for remote KV"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class SimRequest:
    """Engine-side state of one request."""

    turn: Turn
    req: Request
    tokens: list[int]
    arrival: int
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    scheduled_once: bool = False
    resumed: bool = False
    aborted: bool = False
    abort_at: int | None = None
    load: tuple[int, int] | None = None
    load_since: int = 0
    deferred_since: int | None = None
    hung: bool = False


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
    harness_anomalies: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    data_errors: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hit_rate_series: list[float] = field(default_factory=list)
    in_flight_series: list[int] = field(default_factory=list)


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
        self.check_each_step = check_each_step
        self.store_oracle: Callable[[int, Any], list[str]] | None = None
        self._load_job_of: dict[str, int] = {}  # request -> its emitted load job
        self._failed_jobs: set[int] = set()  # jobs a delivered report failed
        """Verifies the stored bytes of a store job that completed successfully."""
        self.live_jobs: Callable[[], Any] = lambda: ()
        self._stores: dict[int, Any] = {}
        self.chunk_hashes: dict[bytes, tuple[bytes, ...]] = {}
        self._preempted_next: set[str] = set()
        self.pool = BlockPool(cfg.num_gpu_blocks, on_evict=kv.dont_care)
        self.tpb = cfg.tokens_per_block
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.by_id: dict[str, SimRequest] = {}
        self.finished_since_last: set[str] = set()
        self.stats = EngineStats()
        self.step_no = 0
        self._live_bound = cfg.live_bound()
        self._cum_hit = 0
        self._cum_prompt = 0
        self.arrived = 0
        self.extra_pending: Callable[[], bool] = lambda: False
        """More work the drain must wait for (e.g. the scheduler's stalled-job ledger)."""

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
        if self.by_id or self.channel.pending():
            return True
        if any(s.pending_copies() for s in self.stacks) or self.extra_pending():
            return True
        return bool(self.conn.has_pending_push_work())

    # -- one step ------------------------------------------------------------------------------

    def step(self, admit: bool = True) -> None:
        """One engine step (see the module docstring)."""
        cfg, f = self.cfg, self.cfg.faults
        k = self.step_no
        self.clock.now += cfg.step_seconds
        self.kv.dirty = True
        if f.reset and self.rng.random() < f.reset:
            self.channel.injected["reset"] += 1
            self.stats.resets += 1
            self._guard("reset_cache", self.conn.reset_cache)
            # loads carried over the reset stay live: their reports are not stale
            self.channel.reset_happened(frozenset(getattr(self.conn, "jobs", ())))
        if admit:
            for turn in self.workload.arrivals(k):
                self._arrive(turn, k)
        for r in list(self.by_id.values()):
            if r.abort_at is not None and r.abort_at <= k and not r.aborted:
                self.abort(r)

        scheduled, new_ids, preempted = self._schedule(k)
        output = SchedulerOutput(
            scheduled=tuple(
                ScheduledRequest(r.turn.req_id, (tuple(blocks),), n, resumed)
                for r, n, blocks, resumed in scheduled
            ),
            new_req_ids=frozenset(new_ids),
            finished_req_ids=frozenset(self.finished_since_last),
            preempted_req_ids=frozenset(preempted | self._preempted_next),
        )
        self.finished_since_last = set()
        self._preempted_next = set()
        meta = self._guard("build_connector_meta", self.conn.build_connector_meta, output)
        if meta is None:
            meta = ConnectorMetadata()
        for job_id in (*meta.load_jobs, *meta.store_jobs):
            self.channel.job_emitted(job_id, k)
        for job_id, job in meta.load_jobs.items():
            self._load_job_of[job.req_id] = job_id
        if self.store_oracle is not None:
            for job_id, job in meta.store_jobs.items():
                self._stores[job_id] = job

        for s in self.stacks:
            s.advance(k)
            s.start_step(meta)
        for r, n, _, _ in scheduled:
            self._compute(r, n)
        for rank, s in enumerate(self.stacks):
            s.end_step(meta)
            self.channel.submit(rank, s.report(), k)
        self.feed(self.channel.deliver(k))
        self._after_compute(k, scheduled)
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
        result = self._guard("update_connector_output", self.conn.update_connector_output, report)
        if result is not None:
            self._loads_ended(self.step_no, result.finished_loads, result.invalid_block_ids)
        if self._stores:
            self._stores_ended()

    def _register_chunks(self, hashes: Sequence[bytes]) -> None:
        bpc = self.cfg.blocks_per_chunk
        reg = self.chunk_hashes
        for end in range(len(hashes) - (len(hashes) % bpc), 0, -bpc):
            last = hashes[end - 1]
            if last in reg:
                break
            reg[last] = tuple(hashes[end - bpc : end])

    def _stores_ended(self) -> None:
        live = self.live_jobs()
        oracle = self.store_oracle
        for job_id in [j for j in self._stores if j not in live]:
            job = self._stores.pop(job_id)
            if oracle is not None:
                for err in oracle(job_id, job):
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
            self._guard("request_finished", self.conn.request_finished, r.req)
            self.finished_since_last.add(r.turn.req_id)
            self._retire(r, completed=True)

    def arrive(self, turn: Turn) -> SimRequest:
        """Submit ``turn`` now."""
        self._arrive(turn, self.step_no)
        return self.by_id[turn.req_id]

    def check(self) -> None:
        """Run the after-step checks now (invariants, data oracle, INV-LIVE)."""
        self._check(self.step_no)

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

    # -- arrivals, aborts, finish --------------------------------------------------------------

    def _arrive(self, turn: Turn, k: int) -> None:
        tokens = list(turn.prompt)
        req = Request(
            request_id=turn.req_id,
            num_prompt_tokens=len(tokens),
            num_tokens=len(tokens),
            skip_reading_prefix_cache=turn.skip_prefix,
        )
        extend_block_hashes(req.block_hashes, tokens, self.tpb)
        self._register_chunks(req.block_hashes)
        r = SimRequest(turn, req, tokens, k)
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
        self._guard("request_finished", self.conn.request_finished, r.req)
        self.finished_since_last.add(r.turn.req_id)
        if r.status is Status.LOADING:
            self.stats.aborted_during_load += 1
            return  # blocks held until the load ended
        self._retire(r, completed=False)

    def _retire(self, r: SimRequest, completed: bool) -> None:
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        r.status = Status.DONE
        del self.by_id[r.turn.req_id]
        self.workload.turn_ended(r.turn, self.step_no, completed)

    # -- scheduling ----------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.tpb)

    def _schedule(
        self, k: int
    ) -> tuple[list[tuple[SimRequest, int, list[int], bool]], set[str], set[str]]:
        cfg = self.cfg
        budget = cfg.max_batched_tokens
        scheduled: list[tuple[SimRequest, int, list[int], bool]] = []
        new_ids: set[str] = set()
        preempted: set[str] = set()
        running_before = list(self.running)

        # 1. waiting requests, in order
        stop = False
        for r in list(self.waiting):
            if stop or budget <= 0 or len(self.running) >= cfg.max_running:
                break
            if r.status is Status.LOADING or r.turn.req_id in self._preempted_next:
                continue  # waits for its load / was preempted between steps: not this step
            local: list[int] = []
            if not r.blocks:
                req = r.req
                if not req.skip_reading_prefix_cache:
                    local = self.pool.computed_blocks(
                        req.block_hashes, (req.num_tokens - 1) // self.tpb
                    )
                n_local = len(local) * self.tpb
                res = self._guard(
                    "get_num_new_matched_tokens",
                    self.conn.get_num_new_matched_tokens,
                    req,
                    n_local,
                )
                if res is None:
                    continue
                ext, is_async = res
                if ext is None:
                    self.stats.deferrals += 1
                    if r.deferred_since is None:
                        r.deferred_since = k
                    continue
                r.deferred_since = None
                if ext > 0 and is_async:
                    need = self._blocks_for(n_local + ext) - len(local)
                    if self._room(local) - need < cfg.watermark_blocks:
                        break
                    self.pool.touch(local)
                    fresh = self.pool.allocate(need) or []
                    r.blocks = local + fresh
                    self._guard(
                        "update_state_after_alloc",
                        self.conn.update_state_after_alloc,
                        req,
                        (tuple(r.blocks),),
                        ext,
                    )
                    r.status = Status.LOADING
                    r.load = (n_local, ext)
                    r.load_since = k
                    if self.rng.random() < cfg.workload.abort_during_load_prob:
                        r.abort_at = k + 1
                    self.stats.loads_started += 1
                    self._count_hits(r, n_local, ext)
                    continue
                computed = n_local
            else:
                computed = r.req.num_computed_tokens
            n = min(r.req.num_tokens - computed, budget)
            need = self._blocks_for(computed + n) - len(r.blocks) - len(local)
            if self._room(local) - need < cfg.watermark_blocks:
                break
            first_time = not r.blocks
            self.pool.touch(local)
            fresh = self.pool.allocate(need) or []
            r.blocks = r.blocks + local + fresh
            self._guard(
                "update_state_after_alloc",
                self.conn.update_state_after_alloc,
                r.req,
                (tuple(r.blocks),),
                0,
            )
            if first_time and r.load is None:
                self._count_hits(r, computed, 0)
            r.req.num_computed_tokens = computed
            self.waiting.remove(r)
            self.running.append(r)
            r.status = Status.RUNNING
            if not r.scheduled_once:
                new_ids.add(r.turn.req_id)
            scheduled.append((r, n, list(r.blocks), r.resumed and r.scheduled_once))
            r.scheduled_once = True
            r.resumed = False
            budget -= n

        # 2. running requests: chunked prefill, then decode
        done: set[int] = set()
        for r in running_before:
            if r.status is not Status.RUNNING or budget <= 0:
                continue
            computed = r.req.num_computed_tokens
            n = min(r.req.num_tokens - computed, budget)
            if n <= 0:
                continue
            need = self._blocks_for(computed + n) - len(r.blocks)
            while need > self.pool.num_free:
                victim = next(
                    (
                        v
                        for v in reversed(running_before)
                        if v.status is Status.RUNNING and id(v) not in done and v is not r
                    ),
                    r,
                )
                self._preempt(victim)
                preempted.add(victim.turn.req_id)
                if victim is r:
                    break
            if r in self.waiting:  # preempted itself: nothing left to preempt
                continue
            fresh = self.pool.allocate(need) or []
            r.blocks.extend(fresh)
            scheduled.append((r, n, fresh, False))
            done.add(id(r))
            budget -= n
        return scheduled, new_ids, preempted

    def _room(self, local: Sequence[int]) -> int:
        """Free blocks left once the local prefix hits ``local`` are taken off the free list."""
        ref = self.pool.ref
        return self.pool.num_free - sum(1 for b in local if ref[b] == 0)

    def _count_hits(self, r: SimRequest, local: int, ext: int) -> None:
        self.stats.local_hit_tokens += local
        self._cum_hit += local + ext
        self._cum_prompt += r.req.num_prompt_tokens

    def _preempt(self, r: SimRequest) -> None:
        self.stats.preemptions += 1
        self.running.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        r.req.num_computed_tokens = 0
        r.status = Status.WAITING
        r.resumed = True
        self.waiting.insert(0, r)

    # -- compute and outputs -------------------------------------------------------------------

    def _compute(self, r: SimRequest, n: int) -> None:
        tpb, kv, hashes = self.tpb, self.kv, r.req.block_hashes
        start = r.req.num_computed_tokens
        end = start + n
        for i in range(start // tpb, self._blocks_for(end)):
            b = r.blocks[i]
            block_end = (i + 1) * tpb
            if end >= block_end:
                kv.write_full(b, hashes[i])
            else:
                parent = hashes[i - 1] if i else ROOT_HASH
                kv.write_partial(b, parent, r.tokens[i * tpb : end])
        self.stats.tokens_computed += n

    def _after_compute(
        self, k: int, scheduled: list[tuple[SimRequest, int, list[int], bool]]
    ) -> None:
        tpb = self.tpb
        for r, n, _, _ in scheduled:
            if r.status is not Status.RUNNING:
                continue  # aborted meanwhile (cannot happen inside a step) or preempted
            req = r.req
            start = req.num_computed_tokens
            req.num_computed_tokens = start + n
            for i in range(start // tpb, (start + n) // tpb):
                self.pool.cache(r.blocks[i], req.block_hashes[i])
            if req.num_computed_tokens < req.num_tokens:
                continue
            tok = self.workload.next_token()
            r.tokens.append(tok)
            r.turn.output.append(tok)
            req.num_tokens += 1
            extend_block_hashes(req.block_hashes, r.tokens, tpb)
            self._register_chunks(req.block_hashes)
            if len(r.turn.output) >= r.turn.max_output:
                self.stats.requests_finished += 1
                self._guard("request_finished", self.conn.request_finished, req)
                self.finished_since_last.add(r.turn.req_id)
                self._retire(r, completed=True)

    def _loads_ended(self, k: int, finished: frozenset[str], invalid: frozenset[int]) -> None:
        tpb = self.tpb
        claimed: set[int] = set()
        for rid in sorted(finished):
            r = self.by_id.get(rid)
            if r is None or r.status is not Status.LOADING or r.load is None:
                self.stats.harness_anomalies.append(
                    f"step {k}: finished_loads names {rid!r}, which is not waiting on a load"
                )
                continue
            start, n = r.load
            hashes = r.req.block_hashes
            valid_end = start + n
            first, last = start // tpb, self._blocks_for(start + n)
            job_id = self._load_job_of.pop(rid, None)
            for i in range(first, last):
                if r.blocks[i] in invalid:
                    valid_end = min(valid_end, i * tpb)
                    claimed.update(r.blocks[i:last])
                    self._unexplained_invalid(k, rid, job_id)
                    break
            for i in range(first, valid_end // tpb):
                b = r.blocks[i]
                for e in self.kv.verify_loaded(k, b, hashes[i]):
                    self.stats.data_errors.append(f"{e} (request {rid})")
                self.pool.cache(b, hashes[i])
            self.stats.loads_finished += 1
            self.stats.tokens_loaded += max(0, valid_end - start)
            self.stats.tokens_recomputed += start + n - max(valid_end, start)
            self._cum_hit -= start + n - max(valid_end, start)
            computed = max(valid_end, start)
            if computed >= r.req.num_tokens:
                computed = r.req.num_tokens - 1
            r.req.num_computed_tokens = computed
            r.load = None
            r.status = Status.WAITING
            if r.aborted:
                self._retire(r, completed=False)
        stray = invalid - claimed
        if stray:
            self.stats.harness_anomalies.append(
                f"step {k}: invalid_block_ids {sorted(stray)[:8]} belong to no ended load"
            )

    def _unexplained_invalid(self, k: int, rid: str, job_id: int | None) -> None:
        """A load ended with invalid blocks: only a failure or a stall may explain it.

        Under vLLM's default ``kv_load_failure_policy`` ("fail") the engine aborts such a
        request, so a load invalidated for any other reason (a cache reset) fails a user
        request: an engine error.
        """
        if job_id is None:
            return  # never sent to the workers (the engine never waited on a transfer)
        if job_id in self._failed_jobs or job_id in getattr(self.conn, "stalled_jobs", {}):
            return
        self.stats.errors.append(
            f"step {k}: request {rid}: load job {job_id} ended with invalid blocks though no "
            "rank failed it and it did not stall (vLLM's default kv_load_failure_policy "
            "'fail' would fail the request)"
        )

    # -- checks --------------------------------------------------------------------------------

    def _check(self, k: int) -> None:
        try:
            self.conn.check_invariants()
        except InvariantViolation as exc:
            self.stats.violations.append(f"step {k}: {exc}")
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
            elif r.deferred_since is not None and k - r.deferred_since > bound:
                r.hung = True
                self.stats.hung.append(
                    f"{r.turn.req_id}: lookup deferred since step {r.deferred_since} (> {bound})"
                )
