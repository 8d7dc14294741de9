"""Whole-stack stateful fuzzing: scheduler + CPU manager + workers + transfer backend.

:class:`StackMachine` is a Hypothesis ``RuleBasedStateMachine`` over the simulator's engine
(:mod:`statecore.sim`) with the real :class:`~statecore.OffloadingScheduler`,
:class:`~statecore.managers.cpu.CPUOffloadingManager`, one
:class:`~statecore.worker.OffloadingWorker` per rank and real bytes in CPU tensors. Instead of
the simulator's seeded fault channel, every engine event and every fault is a rule, so
Hypothesis chooses (and shrinks) the interleaving:

* engine events: a new request (shared system prompts), a schedule step (admission, chunked
  prefill, decode, preemption under memory pressure, compute, workers), finish, abort,
  preemption between steps, ``reset_cache``, blocks handed to a foreign request (another
  connector's: scheduled, computed into, freed);
* worker reports: every report a worker produced in a step becomes a handle in the ``reports``
  bundle; rules consume handles to deliver them on time, as failures, never (a lost report:
  the job stalls), or only after the stall timeout (late); other rules deliver a duplicate of a
  delivered report, a stale report (a job of an epoch before the last reset), a report for a
  never-issued id, a count-only over-report for a live job, and advance the clock past the
  stall timeout;
* the manager's next call of one kind raises, typed or untyped (INV-MGR-ERROR): a job
  completion (after it applied it), a store offer, a load's pinning, a lookup, a schedule
  end (before it changed anything) or a request's finish (after).

The stack is hybrid by default (a full-attention and a sliding-window KV group, see
:data:`statecore.sim.engine.GROUP_PRESETS`), freed GPU blocks are reused first, and the
engine's expectation oracles (INV-OWN, INV-FLUSH-PREEMPT, INV-EVICT, INV-STORE-COMPLETE) run
beside the byte oracle.

After every rule: ``scheduler.check_invariants()`` (every INV-* predicate), the data oracle over
every valid GPU block (INV-DATA), no typed error raised into the engine, INV-LIVE. At the end
of each example the machine drains (every outstanding report delivered, clock advanced, steps
run) and checks that no state leaked (requests, jobs, fences, window-index
positions, pins, write-pending keys).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from statecore.errors import InvariantViolation
from statecore.manager import CPULoadStoreSpec
from statecore.sim.engine import SimConfig, SimEngine, SimRequest, Status
from statecore.sim.faults import SimFaults
from statecore.sim.run import SimStack, attach_store_oracle, leaks
from statecore.sim.workload import Turn, WorkloadConfig
from statecore.wire import WorkerMetadata

__all__ = [
    "MANAGER_ERROR_TARGETS",
    "STACK_CONFIG",
    "ManualChannel",
    "Report",
    "StackHarness",
    "StackMachine",
    "TestStack",
]

MANAGER_ERROR_TARGETS: tuple[frozenset[str], ...] = (
    frozenset({"complete_store", "complete_load"}),
    frozenset({"prepare_store"}),
    frozenset({"prepare_load"}),
    frozenset({"lookup_many"}),
    frozenset({"on_schedule_end"}),
    frozenset({"on_request_finished"}),
    frozenset({"reset_cache"}),
    frozenset({"on_new_request"}),
    frozenset({"take_events"}),
    frozenset({"get_stats"}),
    frozenset({"has_pending_work"}),
    frozenset({"shutdown"}),
)
"""What :meth:`StackHarness.manager_error` arms, by ``(i >> 1) % len(MANAGER_ERROR_TARGETS)``."""

STACK_CONFIG = SimConfig(
    seed=7,
    num_workers=2,
    workload=WorkloadConfig(num_requests=0),  # requests come from the new_request rule
    faults=SimFaults(delay_store=0.5, max_store_delay=3),
    groups="hybrid",
    tokens_per_block=4,
    blocks_per_chunk=2,
    num_gpu_blocks=40,
    cpu_slots=12,
    page_bytes=32,
    num_tensors=2,
    max_batched_tokens=48,
    max_running=6,
    watermark_blocks=2,
    step_seconds=0.5,
    stall_timeout_s=20.0,
    stall_check_interval_s=2.0,
    live_bound_steps=10_000,  # the machine may legitimately sit idle; teardown checks liveness
    foreign_prob=0.0,  # foreign requests come from the foreign rule
    reuse_freed_first=True,
)
"""The small stack the machine drives (tiny blocks so that chunks, reuse and eviction are
frequent)."""


@dataclass(frozen=True, slots=True)
class Report:
    """One worker's report for one job: the unit the machine delivers, drops or delays."""

    rank: int
    job_id: int
    ok: bool

    def meta(self) -> WorkerMetadata:
        """As a one-entry worker metadata."""
        m = WorkerMetadata(rank=self.rank)
        (m.mark_completed if self.ok else m.mark_failed)(self.job_id)
        return m


@dataclass
class ManualChannel:
    """A report channel that delivers nothing by itself: the machine's rules do."""

    injected: dict[str, int] = field(default_factory=dict)
    fresh: list[Report] = field(default_factory=list)

    def job_emitted(self, job_id: int, step: int) -> None:
        """Nothing to track."""

    def reset_happened(self, carried: frozenset[int] = frozenset()) -> None:
        """Nothing to track."""

    def submit(self, rank: int, meta: WorkerMetadata | None, step: int) -> None:
        """Collect the rank's reports as handles."""
        if meta is None:
            return
        for j, n in meta.completed.items():
            self.fresh.extend(Report(rank, j, True) for _ in range(n))
        for j, n in meta.failed.items():
            self.fresh.extend(Report(rank, j, False) for _ in range(n))

    def deliver(self, step: int) -> WorkerMetadata | None:
        """Never anything: reports are delivered by rules."""
        return None


class StackHarness:
    """The whole stack plus the operations the fuzzers apply to it (one method per event).

    :class:`StackMachine` calls these from its rules; the program fuzzer of
    :mod:`statecore.specs.fuzz` calls them from a list of encoded operations (one draw per
    operation, which is what lets a campaign run thousands of operations per second).
    """

    config: ClassVar[SimConfig] = STACK_CONFIG

    def __init__(self, config: SimConfig | None = None) -> None:
        cfg = self.cfg = config or self.config
        self.stack = SimStack(cfg)
        self.channel = ManualChannel()
        self.engine = SimEngine(
            cfg,
            self.stack.scheduler,
            self.stack.ranks,
            self.stack.kv,
            self.stack.clock,
            channel=self.channel,  # type: ignore[arg-type]
            check_each_step=False,
        )
        attach_store_oracle(self.stack, self.engine)
        rng = random.Random(11)
        self.prompts = [[rng.randrange(1000) for _ in range(n)] for n in (9, 14, 20)]
        self.outstanding: list[Report] = []
        self.delivered: list[Report] = []
        self.pre_reset: list[Report] = []
        self.n_req = 0
        self.ops = 0

    # -- helpers -------------------------------------------------------------------------------

    def _feed(self, reports: list[Report]) -> None:
        meta: WorkerMetadata | None = None
        for r in reports:
            meta = r.meta() if meta is None else meta.aggregate(r.meta())
        self.engine.feed(meta)

    def _take(self, rep: Report | int) -> Report | None:
        if isinstance(rep, int):
            if not self.outstanding:
                return None
            return self.outstanding.pop(rep % len(self.outstanding))
        if rep in self.outstanding:
            self.outstanding.remove(rep)
        return rep

    def _active(self, status: Status | None = None) -> list[SimRequest]:
        reqs = sorted(self.engine.by_id.values(), key=lambda r: r.turn.req_id)
        return [r for r in reqs if status is None or r.status is status]

    def _stall_jump(self) -> None:
        self.engine.clock.now += self.cfg.stall_timeout_s + self.cfg.stall_check_interval_s

    # -- engine events -------------------------------------------------------------------------

    def new_request(self, system: int, extra: int, out: int, skip: bool, follow: bool) -> None:
        """A request arrives: a shared system prompt plus its own text."""
        self.ops += 1
        if len(self.engine.by_id) >= 8:
            return
        prompt = list(self.prompts[system % 3])
        if follow:  # a follow-up turn shares a longer prefix
            prompt += list(self.prompts[(system + 1) % 3])
        prompt += [(self.n_req * 31 + i) % 997 for i in range(extra)]
        turn = Turn(f"r{self.n_req}", self.n_req, prompt, out, skip_prefix=skip and extra == 0)
        self.n_req += 1
        self.engine.arrive(turn)

    def step(self) -> list[Report]:
        """One engine step, then the connector's stats as vLLM's engine takes them every
        step; returns the workers' reports (now outstanding)."""
        self.ops += 1
        self.engine.step(admit=False)
        self.engine.take_stats()
        fresh, self.channel.fresh = self.channel.fresh, []
        self.outstanding.extend(fresh)
        return fresh

    def finish(self, i: int) -> None:
        """A running request stops (stop string), between steps."""
        self.ops += 1
        running = self._active(Status.RUNNING)
        if running:
            self.engine.finish(running[i % len(running)])

    def abort(self, i: int) -> None:
        """Any request is aborted (also while it waits on a load)."""
        self.ops += 1
        active = [r for r in self._active() if not r.aborted]
        if active:
            self.engine.abort(active[i % len(active)])

    def foreign(self, i: int) -> None:
        """Another connector's request takes a few blocks in every group (freed later)."""
        self.ops += 1
        self.engine.add_foreign(1 + i % 3, 1 + (i >> 2) % 3)

    def preempt(self, i: int) -> None:
        """A running request is preempted between steps."""
        self.ops += 1
        running = self._active(Status.RUNNING)
        if running:
            self.engine.preempt(running[i % len(running)])

    def reset_cache(self) -> None:
        """``reset_cache`` between steps; every report so far becomes stale."""
        self.ops += 1
        self.engine.stats.resets += 1
        self.engine.reset_cache()
        carried = self.stack.scheduler.jobs  # loads carried over the reset: still live
        self.pre_reset.extend(r for r in self.outstanding if r.job_id not in carried)
        self.pre_reset.extend(r for r in self.delivered if r.job_id not in carried)
        del self.pre_reset[:-64]

    # -- worker reports and faults -------------------------------------------------------------

    def deliver(self, rep: Report | int) -> None:
        """A worker's report arrives."""
        self.ops += 1
        got = self._take(rep)
        if got is not None:
            self._feed([got])
            self.delivered.append(got)
            del self.delivered[:-32]

    def deliver_failed(self, rep: Report | int) -> None:
        """The worker's transfer failed: it reports the job as failed instead."""
        self.ops += 1
        got = self._take(rep)
        if got is not None:
            self._scribble(got)
            failed = Report(got.rank, got.job_id, False)
            self._feed([failed])
            self.delivered.append(failed)

    def _scribble(self, rep: Report) -> None:
        """A failed store may have written part of its slots: make that visible (only while
        the job is in flight, when its partial write would really land)."""
        entry = self.engine._stores.get(rep.job_id)
        job = entry[0] if entry is not None else None
        if job is None or not isinstance(job.dst, CPULoadStoreSpec):
            return
        if rep.job_id not in self.stack.scheduler.jobs:
            return  # a report that arrives after its job ended: its copy landed long ago
        cfg = self.cfg
        for slot in job.dst.slots[:1]:
            for t in range(cfg.num_tensors):
                row = self.stack.pool.row(rep.rank * cfg.num_tensors + t, slot)
                row[:] = b"\xa5" * len(row)

    def lose(self, rep: Report | int) -> None:
        """The report never arrives (the job will stall)."""
        self.ops += 1
        self._take(rep)

    def deliver_late(self, rep: Report | int) -> None:
        """The report arrives only after the stall timeout expired."""
        self.ops += 1
        got = self._take(rep)
        if got is not None:
            self._stall_jump()
            self.engine.feed(None)  # the stall check runs
            self._feed([got])
            self.delivered.append(got)

    def duplicate(self, i: int) -> None:
        """A delivered report arrives a second time, after its job ended.

        Only then: while the job is live (or stalled), a second report from the same rank is
        indistinguishable from another rank's on the wire (counts per job, no rank identity)
        and would complete the job before every rank's copy landed; no scheduler can defend
        against that input, so it is not generated.
        """
        self.ops += 1
        sched = self.stack.scheduler
        ended = [
            r
            for r in self.delivered
            if r.job_id not in sched.jobs and r.job_id not in sched.stalled_jobs
        ]
        if ended:
            self._feed([ended[i % len(ended)]])

    def over_report(self, i: int) -> None:
        """A count-only report claiming one worker more than the job has, for a job whose
        reports are still outstanding (a duplicated aggregate from a lossy transport)."""
        self.ops += 1
        live = [r for r in self.outstanding if r.job_id in self.stack.scheduler.jobs]
        if live:
            job_id = live[i % len(live)].job_id
            self.engine.feed(WorkerMetadata(completed={job_id: self.cfg.num_workers + 1}))

    def stale(self, i: int) -> None:
        """A report for a job of an epoch before the last reset."""
        self.ops += 1
        if self.pre_reset:
            self._feed([self.pre_reset[i % len(self.pre_reset)]])

    def unknown(self, offset: int, negative: bool) -> None:
        """A report for a job id the scheduler never issued."""
        self.ops += 1
        job_id = -1 - offset if negative else self.stack.scheduler.next_job_id + offset
        self._feed([Report(0, job_id, True)])

    def advance_clock(self) -> None:
        """Time passes beyond the stall timeout (the stall check runs)."""
        self.ops += 1
        self._stall_jump()
        self.engine.feed(None)

    def manager_error(self, i: int) -> None:
        """The manager's next call of one kind raises: a typed ``ManagerError`` (even ``i``)
        or an untyped exception, a manager's bug (odd ``i``); the kind is
        ``MANAGER_ERROR_TARGETS[(i >> 1) % len(MANAGER_ERROR_TARGETS)]`` (a completion, after
        the manager applied it; a store offer, a load's pinning, a lookup, a schedule end, a
        reset, a new request's registration, the taking of its events or of its stats, the
        question whether it has pending work, the shutdown that ends the run, before it
        changed anything; a request's finish, after)."""
        self.ops += 1
        obs = self.stack.observed
        obs.fail_next = "untyped" if i & 1 else "typed"
        obs.fail_calls = MANAGER_ERROR_TARGETS[(i >> 1) % len(MANAGER_ERROR_TARGETS)]

    # -- checks --------------------------------------------------------------------------------

    def check(self) -> None:
        """Every invariant, the data oracle, and no error raised into the engine."""
        self.engine.check()
        st_ = self.engine.stats
        for what, items, code in (
            ("violation", st_.violations, ""),
            ("data error", st_.data_errors, "INV-DATA"),
            ("error raised into the engine", st_.errors, "INV-FAIL-STATE"),
            ("hung", st_.hung, "INV-LIVE"),
            ("harness anomaly", st_.harness_anomalies, "INV-REF"),
        ):
            if items:
                if not code:
                    code = items[0].split(": ")[1] if ": " in items[0] else "INV-?"
                raise InvariantViolation(code, f"{what}: {items[0]}")

    def drain_and_check(self) -> None:
        """Deliver what is outstanding, let stalls expire, step until idle; then no leaks; then
        the shutdown, under INV-MGR-ERROR."""
        try:
            eng = self.engine
            for r in self._active():
                if not r.aborted:
                    eng.abort(r)
            self._feed(self.outstanding)
            self.outstanding = []
            for _ in range(40):
                fresh, self.channel.fresh = self.channel.fresh, []
                self._feed(fresh)
                if not (eng._work_pending() or self.stack.scheduler.stalled_jobs or fresh):
                    break
                self._stall_jump()
                eng.step(admit=False)
            self.check()
            found = leaks(self.stack, eng)
            if found:
                raise InvariantViolation("INV-REF", "state leaked after drain: " + found[0])
            self.stack.shut_down = True
            eng.shutdown()  # the run's last call, under INV-MGR-ERROR
            self.check()
        finally:
            self.stack.close()


class StackMachine(RuleBasedStateMachine):
    """The whole stack under every engine event and fault (see the module docstring)."""

    reports = Bundle("reports")
    steps_run: ClassVar[int] = 0
    """Rules executed by every instance so far."""

    def __init__(self) -> None:
        super().__init__()
        self.h = StackHarness()

    @precondition(lambda self: len(self.h.engine.by_id) < 8)
    @rule(
        system=st.integers(0, 2),
        extra=st.integers(0, 14),
        out=st.integers(1, 6),
        skip=st.booleans(),
        follow=st.booleans(),
    )
    def new_request(self, system: int, extra: int, out: int, skip: bool, follow: bool) -> None:
        """A request arrives."""
        StackMachine.steps_run += 1
        self.h.new_request(system, extra, out, skip, follow)

    @rule(target=reports)
    def step(self) -> Any:
        """One engine step; the workers' reports become handles."""
        StackMachine.steps_run += 1
        return multiple(*self.h.step())

    @rule(i=st.integers(0, 7))
    def finish(self, i: int) -> None:
        """A running request finishes."""
        StackMachine.steps_run += 1
        self.h.finish(i)

    @rule(i=st.integers(0, 7))
    def abort(self, i: int) -> None:
        """A request is aborted."""
        StackMachine.steps_run += 1
        self.h.abort(i)

    @rule(i=st.integers(0, 7))
    def preempt(self, i: int) -> None:
        """A running request is preempted."""
        StackMachine.steps_run += 1
        self.h.preempt(i)

    @rule(i=st.integers(0, 15))
    def foreign(self, i: int) -> None:
        """Another connector's request takes blocks."""
        StackMachine.steps_run += 1
        self.h.foreign(i)

    @rule(i=st.integers(0, 31))
    def over_report(self, i: int) -> None:
        """A count-only over-report for a live job."""
        StackMachine.steps_run += 1
        self.h.over_report(i)

    @rule()
    def reset_cache(self) -> None:
        """``reset_cache`` between steps."""
        StackMachine.steps_run += 1
        self.h.reset_cache()

    @rule(rep=consumes(reports))
    def deliver(self, rep: Report) -> None:
        """A worker's report arrives."""
        StackMachine.steps_run += 1
        self.h.deliver(rep)

    @rule(rep=consumes(reports))
    def deliver_failed(self, rep: Report) -> None:
        """A worker reports the job failed."""
        StackMachine.steps_run += 1
        self.h.deliver_failed(rep)

    @rule(rep=consumes(reports))
    def lose(self, rep: Report) -> None:
        """A report is lost (the job stalls)."""
        StackMachine.steps_run += 1
        self.h.lose(rep)

    @rule(rep=consumes(reports))
    def deliver_late(self, rep: Report) -> None:
        """A report arrives after the stall timeout."""
        StackMachine.steps_run += 1
        self.h.deliver_late(rep)

    @precondition(lambda self: bool(self.h.delivered))
    @rule(i=st.integers(0, 31))
    def duplicate(self, i: int) -> None:
        """A delivered report arrives again."""
        StackMachine.steps_run += 1
        self.h.duplicate(i)

    @precondition(lambda self: bool(self.h.pre_reset))
    @rule(i=st.integers(0, 63))
    def stale(self, i: int) -> None:
        """A pre-reset report arrives."""
        StackMachine.steps_run += 1
        self.h.stale(i)

    @rule(offset=st.integers(0, 5), negative=st.booleans())
    def unknown(self, offset: int, negative: bool) -> None:
        """A report for a never-issued job id."""
        StackMachine.steps_run += 1
        self.h.unknown(offset, negative)

    @rule()
    def advance_clock(self) -> None:
        """Time passes beyond the stall timeout."""
        StackMachine.steps_run += 1
        self.h.advance_clock()

    @rule(i=st.integers(0, 2 * len(MANAGER_ERROR_TARGETS) - 1))  # every target, both kinds
    def manager_error(self, i: int) -> None:
        """The manager's next call of one kind raises (typed or untyped)."""
        StackMachine.steps_run += 1
        self.h.manager_error(i)

    @invariant()
    def everything_holds(self) -> None:
        """Every invariant, the data oracle, no error raised into the engine."""
        self.h.check()

    def teardown(self) -> None:
        """Drain, then check that no state leaked."""
        self.h.drain_and_check()


TestStack = StackMachine.TestCase
"""The machine as a ``unittest.TestCase`` for pytest (budget from the active profile)."""
TestStack.settings = settings(deadline=None)
