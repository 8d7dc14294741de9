"""Build the whole stack for a simulation run and turn the run into a :class:`SimReport`.

The stack is the real one: :class:`~statecore.OffloadingScheduler` over the manager that
``SimConfig.manager`` names (see :func:`make_manager`: a
:class:`~statecore.managers.cpu.CPUOffloadingManager` with the LRU or ARC policy, or a
:class:`~statecore.managers.tiering.TieringOffloadingManager` with three file tiers in
temporary directories: a fast one, a slow one and a failing one), seen by the scheduler
through the oracles' :class:`~statecore.sim.engine.ObservedManager`; one
:class:`~statecore.worker.OffloadingWorker` per rank over the torch adapter on CPU tensors
(each KV-cache group with its own tensors; wrapped so that copies can land late and
transfers can fail), and the shared CPU pool. Only the engine around it is simulated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

from statecore.config import SchedulerConfig
from statecore.errors import InvariantViolation
from statecore.lifecycle import checked_mode
from statecore.manager import OffloadingManager
from statecore.managers.cpu import CPUOffloadingManager
from statecore.pool import CPUPool
from statecore.scheduler import OffloadingScheduler
from statecore.sim.backend import DelayedBackend
from statecore.sim.engine import ObservedManager, SimClock, SimConfig, SimEngine
from statecore.sim.faults import FAULT_KINDS
from statecore.sim.kv import KVCache
from statecore.sim.report import FaultCount, SimReport
from statecore.sim.series import record_steps
from statecore.wire import ConnectorMetadata, WorkerMetadata
from statecore.worker import FaultyBackend, OffloadingWorker, TransferBackend

__all__ = [
    "MANAGERS",
    "RankStackImpl",
    "SimStack",
    "attach_store_oracle",
    "build_stack",
    "leaks",
    "make_manager",
    "parse_manager",
    "simulate",
]

MANAGERS: dict[str, str] = {
    "lru": "the CPU tier alone, LRU eviction",
    "arc": "the CPU tier alone, ARC eviction",
    "request-lru": "the CPU tier alone, vLLM 0.33's request-ranked, position-ordered LRU",
    "request-arc": "the CPU tier alone, vLLM 0.33's ARC (reuse counted once per request)",
    "tiering": "an LRU CPU tier over three file tiers: fast, slow (jobs land steps later), "
    "failing (jobs fail at random)",
}
"""The managers a simulation or a fuzz campaign can run, by name."""


def parse_manager(text: str) -> str:
    """The manager a ``--manager`` argument names (one of :data:`MANAGERS`).

    Raises ``ValueError`` with the known names otherwise. (The one place that parses the
    flag, so that further forms extend it here.)
    """
    name = text.strip().lower()
    if name not in MANAGERS:
        raise ValueError(f"unknown manager {text!r} (known: {', '.join(MANAGERS)})")
    return name


class _StepExecutor(Executor):
    """Runs each task a fixed number of engine steps after submission (a slow tier), or fails
    it with ``OSError`` at a seeded rate (a failing tier); deterministic, no threads."""

    def __init__(self, delay_steps: int, fail_prob: float, rng: random.Random) -> None:
        self.delay = delay_steps
        self.fail_prob = fail_prob
        self.rng = rng
        self.step = 0
        self._queue: list[tuple[int, Future[Any], Callable[[], Any]]] = []
        self.failed = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._queue.append((self.step + self.delay, fut, lambda: fn(*args, **kwargs)))
        if self.delay == 0:
            self.advance(self.step)
        return fut

    def advance(self, step: int) -> None:
        """Run the tasks due at ``step``."""
        self.step = step
        due = [q for q in self._queue if q[0] <= step]
        if not due:
            return
        self._queue = [q for q in self._queue if q[0] > step]
        for _, fut, task in due:
            if self.fail_prob and self.rng.random() < self.fail_prob:
                self.failed += 1
                fut.set_exception(OSError("injected file-tier failure"))
                continue
            try:
                fut.set_result(task())
            except BaseException as exc:  # delivered through the future, as a thread would
                fut.set_exception(exc)

    def pending(self) -> int:
        """Tasks not yet run."""
        return len(self._queue)

    def run_all(self) -> None:
        """Run every queued task now (a tier's ``drain`` waits for them)."""
        self.advance(max((q[0] for q in self._queue), default=self.step))


def _drained_by(tier: Any, ex: _StepExecutor) -> Any:
    """Make ``tier.drain`` run the executor's queued tasks first (it waits on their futures,
    which only a later engine step would otherwise complete)."""
    real = tier.drain

    def drain() -> None:
        ex.run_all()
        real()

    tier.drain = drain
    return tier


class _InlineExecutor(Executor):
    """Runs each task at submission: the file tier stays deterministic in the simulator."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered through the future, as a thread would
            fut.set_exception(exc)
        return fut


class RankStackImpl:
    """One rank: the real worker over fault injection over delayed copies over the adapter."""

    def __init__(self, worker: OffloadingWorker, delayed: DelayedBackend) -> None:
        self.worker = worker
        self.delayed = delayed

    def start_step(self, meta: ConnectorMetadata) -> None:
        """Flush handling and loads."""
        self.worker.start_step(meta)

    def end_step(self, meta: ConnectorMetadata) -> None:
        """Queue the step's stores."""
        self.worker.end_step(meta)

    def report(self) -> WorkerMetadata | None:
        """This rank's report of the step (None when empty)."""
        m = self.worker.build_worker_metadata()
        return None if m.is_empty() else m

    def advance(self, step: int) -> None:
        """Land the copies due at ``step``."""
        self.delayed.advance(step)


def _make_backend(
    kv: KVCache, rank: int, pool: CPUPool, regions: range, bpc: int, copy_impl: str = "auto"
) -> Any:
    """The torch adapter over this rank's KV tensors and pool regions (``copy_impl``: its
    copy mode, see :class:`~statecore.sim.engine.SimConfig`).

    Falls back to the pure-Python :class:`~statecore.worker.MemoryBackend` over the same
    memory when the adapter cannot be imported (``STATECORE_SIM_BACKEND=memory`` forces it).
    """
    if os.environ.get("STATECORE_SIM_BACKEND", "torch") != "memory":
        try:
            adapter: Any = importlib.import_module("statecore.adapters.torch")
        except ImportError:
            adapter = None
        if adapter is not None:
            return adapter.TorchTransferBackend(
                kv.tensors[rank],
                pool,
                bpc,
                pool_regions=list(regions),
                threads=1,
                copy_impl=copy_impl,
                group_tensors=[list(ts) for ts in kv.group_tensors],
            )
    from statecore.worker import MemoryBackend

    backend = MemoryBackend(
        [kv.page_bytes] * kv.num_tensors,
        kv.num_blocks,
        [pool.region(i) for i in regions],
        bpc,
        group_tensors=[list(ts) for ts in kv.group_tensors],
    )
    backend.gpu = [t.numpy().data.cast("B") for t in kv.tensors[rank]]  # type: ignore[misc]
    return backend


class SimStack:
    """Everything a run is made of (exposed for tests and the stateful specs)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        root = random.Random(cfg.seed ^ 0x5EED)
        self.clock = SimClock()
        self.groups = cfg.kv_groups()
        n_tensors = cfg.num_tensors * len(self.groups)  # each group its own tensors
        self.n_tensors = n_tensors
        self.kv = KVCache(
            cfg.num_workers, cfg.num_gpu_blocks, n_tensors, cfg.page_bytes, len(self.groups)
        )
        row = cfg.page_bytes * cfg.blocks_per_chunk
        # one pool holds every rank's regions, so a secondary tier copies whole chunks
        self.pool = CPUPool(cfg.cpu_slots, [row] * (n_tensors * cfg.num_workers))
        self.tmpdirs: list[str] = []
        self.executors: list[_StepExecutor] = []
        self.shut_down = False
        """Whether the run shut the scheduler down (:meth:`SimEngine.shutdown`, under its
        oracle); :meth:`close` does it otherwise."""
        self._manager_rng = random.Random(root.getrandbits(64))
        self.manager = self._make_manager()
        # its own stream: a run without manager errors draws nothing from it
        self.observed = ObservedManager(
            self.manager, random.Random(cfg.seed ^ 0x3A9E), cfg.faults.manager_error
        )
        self.sched_config = SchedulerConfig(
            groups=self.groups,
            blocks_per_chunk=cfg.blocks_per_chunk,
            num_workers=cfg.num_workers,
            stall_timeout_s=cfg.stall_timeout_s,
            stall_check_interval_s=cfg.stall_check_interval_s,
        )
        self.scheduler = OffloadingScheduler(
            self.sched_config,
            self.observed,  # type: ignore[arg-type]
            clock=self.clock,
            checked=cfg.checked,
        )
        self.failures_injected = 0
        self.ranks: list[RankStackImpl] = []
        f = cfg.faults
        for r in range(cfg.num_workers):
            regions = range(r * n_tensors, (r + 1) * n_tensors)
            inner = _make_backend(
                self.kv, r, self.pool, regions, cfg.blocks_per_chunk, cfg.copy_impl
            )
            delayed = DelayedBackend(
                inner, random.Random(root.getrandbits(64)), f.delay_store, f.max_store_delay
            )
            backend: TransferBackend = delayed
            if f.transfer_failure:
                backend = FaultyBackend(delayed, fail_job=self._failer(root.getrandbits(64)))
            self.ranks.append(RankStackImpl(OffloadingWorker(backend, rank=r), delayed))

    def injected_faults(self, engine: SimEngine) -> dict[str, int]:
        """How many faults of each kind (:data:`~statecore.sim.faults.FAULT_KINDS`) were
        injected so far: the report channel's, the transfer failures, the delayed stores and
        the manager errors."""
        counts = dict(engine.channel.injected)
        counts["transfer_failure"] = self.failures_injected
        counts["delay_store"] = sum(r.delayed.delayed_stores for r in self.ranks)
        counts["manager_error"] = self.observed.injected_total
        return counts

    def _failer(self, seed: int) -> Callable[[int], bool]:
        rng = random.Random(seed)
        p = self.cfg.faults.transfer_failure

        def fail(job_id: int) -> bool:
            if rng.random() < p:
                self.failures_injected += 1
                return True
            return False

        return fail

    def close(self) -> None:
        """Release the pool and the temporary directory (and shut the scheduler down unless
        the run did: :meth:`SimEngine.shutdown`)."""
        if not self.shut_down:
            with contextlib.suppress(Exception):
                self.scheduler.shutdown()
        for d in self.tmpdirs:
            shutil.rmtree(d, ignore_errors=True)
        self.tmpdirs = []

    def _make_manager(self) -> OffloadingManager:
        """The manager of this stack (:func:`make_manager`; subclasses bring their own)."""
        return make_manager(self, self._manager_rng)

    def advance(self, step: int) -> None:
        """The slow and failing tiers' clocks."""
        for ex in self.executors:
            ex.advance(step)


def make_manager(stack: SimStack, rng: random.Random) -> OffloadingManager:
    """The manager ``stack.cfg`` names (see :data:`MANAGERS`)."""
    cfg = stack.cfg
    kind = parse_manager(cfg.manager_kind())
    if kind in ("lru", "arc", "request-lru", "request-arc"):
        return CPUOffloadingManager(cfg.cpu_slots, policy=kind)
    from statecore.managers.filetier import FileTier
    from statecore.managers.tiering import TieringOffloadingManager

    tiers = []
    for name, delay, fail in (("fast", 0, 0.0), ("slow", 3, 0.0), ("failing", 0, 0.2)):
        d = tempfile.mkdtemp(prefix=f"statecore-sim-{name}-")
        stack.tmpdirs.append(d)
        if delay or fail:
            step_ex = _StepExecutor(delay, fail, random.Random(rng.getrandbits(64)))
            stack.executors.append(step_ex)
            tiers.append(_drained_by(FileTier(d, stack.pool, executor=step_ex, name=name), step_ex))
        else:
            tiers.append(FileTier(d, stack.pool, executor=_InlineExecutor(), name=name))
    return TieringOffloadingManager(CPUOffloadingManager(cfg.cpu_slots), tiers)


def make_store_oracle(
    stack: SimStack, engine: SimEngine
) -> Callable[[int, Any, tuple[Any, ...]], list[str]]:
    """INV-DATA at store time: a store that completed successfully left exactly its keys'
    bytes in its CPU slots (checked on every rank and tensor). The keys are the ones the
    step's metadata named for the job (``ConnectorMetadata.store_keys``)."""
    from statecore.keys import key_group, key_hash
    from statecore.manager import CPULoadStoreSpec
    from statecore.sim.hashing import block_content

    cfg = stack.cfg
    pool = stack.pool
    m = stack.manager
    primary: Any = getattr(m, "primary", m)
    page = cfg.page_bytes
    group_tensors = stack.kv.group_tensors
    n_tensors = stack.n_tensors

    def check(job_id: int, job: Any, keys: tuple[Any, ...]) -> list[str]:
        dst = job.dst
        if not isinstance(dst, CPULoadStoreSpec):
            return []
        errors: list[str] = []
        if len(keys) != len(dst.slots):
            errors.append(
                f"store job {job_id}: the step's metadata names {len(keys)} keys for its "
                f"{len(dst.slots)} CPU slots"
            )
        for key, slot in zip(keys, dst.slots, strict=False):
            if primary.slot_of(key) != slot or not primary.is_ready(key):
                continue  # failed, stalled, discarded or since evicted: nothing to check
            g = key_group(key)
            chunk = engine.chunk_hashes.get(key_hash(key) + bytes([g]))
            if chunk is None:
                continue
            for r in range(cfg.num_workers):
                for t in group_tensors[g]:
                    want = b"".join(block_content(h, r, t, page) for h in chunk)
                    if bytes(pool.row(r * n_tensors + t, slot)) != want:
                        errors.append(
                            f"store job {job_id} completed but CPU slot {slot} (rank {r}, "
                            f"tensor {t}) holds wrong bytes for key {key.hex()[:12]}"
                        )
        return errors

    return check


def attach_store_oracle(stack: SimStack, engine: SimEngine) -> None:
    """Verify the bytes of every successful store at its completion, and the CPU tier's
    events against its contents (INV-EVENTS) when it emits them."""
    from statecore.managers.tiering import TieringOffloadingManager

    sched = stack.scheduler
    mgr = stack.manager
    cpu = mgr.primary if isinstance(mgr, TieringOffloadingManager) else mgr
    if isinstance(cpu, CPUOffloadingManager) and cpu.enable_events:
        engine.cpu_ready_keys = lambda: set(cpu.ready_keys())
    engine.conn = sched
    engine.live_jobs = lambda: sched.jobs
    engine.stalled_jobs = lambda: sched.stalled_jobs
    engine.observed = stack.observed
    if stack.executors:
        engine.step_hooks.append(stack.advance)
    engine.extra_pending = lambda: bool(
        sched.stalled_jobs or any(ex.pending() for ex in stack.executors)
    )
    engine.store_oracle = make_store_oracle(stack, engine)


def build_stack(cfg: SimConfig) -> tuple[SimStack, SimEngine]:
    """The stack and an engine over it."""
    stack = SimStack(cfg)
    sched = stack.scheduler
    engine = SimEngine(
        cfg, sched, stack.ranks, stack.kv, stack.clock, in_flight=lambda: len(sched.jobs)
    )
    attach_store_oracle(stack, engine)
    return stack, engine


@contextlib.contextmanager
def _maybe_checked(on: bool) -> Iterator[None]:
    if on:
        with checked_mode():
            yield
    else:
        yield


def simulate(cfg: SimConfig, progress: Callable[[int, int], None] | None = None) -> SimReport:
    """Run one simulation and report it."""
    started = time.perf_counter()
    stack, engine = build_stack(cfg)
    recorder = record_steps(stack, engine)
    try:
        with _maybe_checked(cfg.checked):
            engine.run(progress)
            stack.shut_down = True
            engine.shutdown()
        report = _report(cfg, stack, engine)
        report.series.update(recorder.series)
        report.settings = dataclasses.asdict(cfg)
        report.wall_s = time.perf_counter() - started
        return report
    finally:
        stack.close()


def leaks(stack: SimStack, engine: SimEngine) -> list[str]:
    """Everything left behind after a drain (empty when clean)."""
    out: list[str] = []
    s = stack.scheduler
    if s.requests:
        ids = sorted(s.requests)
        states = {rid: s.request_state(rid) for rid in ids[:5]}
        out.append(f"scheduler still tracks {len(ids)} requests: {states}")
    if s.jobs:
        out.append(f"scheduler still has {len(s.jobs)} live jobs: {sorted(s.jobs)[:8]}")
    if s.stalled_jobs:
        out.append(f"stalled-job ledger still holds {sorted(s.stalled_jobs)[:8]}")
    if s.fence_index:
        out.append(f"fence index still holds blocks {sorted(s.fence_index)[:8]}")
    if s.window_index:
        out.append(
            f"window index still lists positions of released requests at "
            f"{len(s.window_index)} blocks {sorted(s.window_index)[:8]}"
        )
    if s.loading_keys:
        out.append(f"{len(s.loading_keys)} chunks still marked as being loaded")
    m = stack.manager
    primary = getattr(m, "primary", m)
    counters = getattr(primary, "counters", None)
    if counters is not None:
        c = counters()
        if c.pinned:
            out.append(f"manager: {c.pinned} keys still pinned")
        if c.write_pending:
            out.append(f"manager: {c.write_pending} keys still write-pending")
    # the manager's own recount (slots tile the capacity, counters agree): a slot it lost
    # shrinks the cache for good, with no byte wrong (O(capacity): once, after the drain)
    recount = getattr(primary, "check_invariants", None)
    if recount is not None:
        try:
            recount()
        except InvariantViolation as exc:
            out.append(f"manager: {exc}")
    tracked = getattr(m, "tracked_requests", None)
    if tracked is not None and tracked():
        out.append(f"tiering manager still tracks requests {tracked()[:5]}")
    in_flight = getattr(m, "in_flight_jobs", None)
    if in_flight is not None and in_flight():
        out.append(f"tiering manager: {in_flight()} secondary-tier jobs in flight")
    for r, rank in enumerate(stack.ranks):
        if rank.worker.in_flight or rank.worker.deferred:
            out.append(
                f"worker {r}: jobs in flight {sorted(rank.worker.in_flight)[:8]}, "
                f"deferred {list(rank.worker.deferred)[:8]}"
            )
        if rank.delayed.pending():
            out.append(f"worker {r}: {rank.delayed.pending()} copies never landed")
    if engine.by_id:
        out.append(f"engine: {len(engine.by_id)} requests never ended")
    held = [b for b in range(1, engine.pool.num_blocks) if engine.pool.ref[b]]
    if held:
        out.append(f"engine: GPU blocks still referenced {held[:8]}")
    return out


def _report(cfg: SimConfig, stack: SimStack, engine: SimEngine) -> SimReport:
    st = engine.stats
    c = stack.scheduler.counters
    rep = SimReport(
        seed=cfg.seed,
        steps=st.steps - st.drain_steps,
        drain_steps=st.drain_steps,
        workers=cfg.num_workers,
        tiering=cfg.manager_kind() == "tiering",
        checked=cfg.checked,
        requests_wanted=cfg.workload.num_requests,
        groups=cfg.groups,
        manager=cfg.manager_kind(),
    )
    rep.requests = {
        "arrived": engine.arrived,
        "finished": st.requests_finished,
        "aborted": st.requests_aborted,
        "aborted_during_load": st.aborted_during_load,
        "preempted": st.preemptions,
        "deferred_lookups": st.deferrals,
        "loads": st.loads_started,
        "foreign": st.foreign_requests,
    }
    rep.tokens = {
        "prompt": st.prompt_tokens,
        "admitted_prompt": engine.admitted_prompt_tokens,
        "local_hits": st.local_hit_tokens,
        "loaded": st.tokens_loaded,
        "recomputed": st.tokens_recomputed,
        "computed": st.tokens_computed,
    }
    adm = engine.admitted_prompt_tokens
    rep.hit_rate = (st.local_hit_tokens + st.tokens_loaded) / adm if adm else 0.0
    rep.external_hit_rate = st.tokens_loaded / adm if adm else 0.0
    rep.bytes_moved = {"GPU->CPU": c.store_bytes, "CPU->GPU": c.load_bytes}
    mstats = stack.manager.get_stats() if cfg.manager_kind() == "tiering" else {}
    for k, v in mstats.items():
        if isinstance(v, int) and "bytes" in k:
            rep.bytes_moved[k] = v
        tier, _, counter = k.partition(".")
        if counter.startswith("failed_jobs_") and isinstance(v, int) and v:
            kind = counter.removeprefix("failed_jobs_").replace("_", "-")
            rep.tier_faults[f"{tier} {kind}"] = v
    rep.jobs = {
        "created": c.jobs_created,
        "loads": c.load_jobs_created,
        "stores": c.store_jobs_created,
        "completed": c.jobs_completed,
        "failed": c.jobs_failed,
        "stalled": c.jobs_stalled,
        "discarded": c.jobs_discarded,
        "stalled_retired": c.stalled_retired,
        "stalled_expired": c.stalled_expired,
        "flushes": c.flushes_requested,
        "store_allocation_failures": c.allocation_failures,
    }
    rep.reports_absorbed = {
        "late": c.late_reports,
        "duplicate": c.duplicate_reports,
        "over": c.over_reports,
        "stale": c.stale_reports,
        "unknown": c.unknown_reports,
        "invalid": c.invalid_report_counts,
    }
    inj = stack.injected_faults(engine)
    observed = {
        "stall": (c.jobs_stalled, "jobs stalled"),
        "late": (c.late_reports, "late reports absorbed"),
        "duplicate": (c.duplicate_reports + c.over_reports, "duplicate/over reports absorbed"),
        "stale": (c.stale_reports, "stale reports absorbed"),
        "unknown": (c.unknown_reports, "unknown-id reports absorbed"),
        "transfer_failure": (c.jobs_failed, "jobs failed"),
        "reset": (c.resets, "resets"),
        "delay_store": (
            sum(r.delayed.forced_by_flush for r in stack.ranks),
            "delayed stores forced by a flush",
        ),
        "manager_error": (c.manager_errors, "manager errors counted"),
    }
    for kind in FAULT_KINDS:
        n, what = observed[kind]
        rep.faults[kind] = FaultCount(inj.get(kind, 0), n, what)
        if inj.get(kind, 0) and not n:
            rep.unobserved_faults.append(kind)
    rep.invariant_violations = list(st.violations)
    rep.data_errors = list(st.data_errors)
    rep.hung_requests = list(st.hung)
    rep.leaked_state = leaks(stack, engine)
    rep.engine_errors = list(st.errors)
    rep.harness_anomalies = list(st.harness_anomalies)
    rep.engine_jams = list(st.jams)
    rep.series = {
        "hit_rate": list(st.hit_rate_series),
        "in_flight_jobs": [float(x) for x in st.in_flight_series],
    }
    return rep
