"""``statecore bench scheduler``: the connector's cost per engine step.

The cost of one engine step is the sum of the four per-step connector hooks
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``). The workload is shaped like the vLLM peer scenario: N requests
kept in flight, 128 shared 512-token prefixes each followed by a unique 64-512-token suffix, a
quarter of new requests being follow-up turns (an earlier request's full text plus 64 tokens),
outputs of 16-96 tokens, a GPU cache of 1.1x what N average requests need, a CPU tier of 4x
the GPU blocks, workers reporting loads 2 steps and stores 3 steps after submission.

Two engines run it:

* ``standalone`` (always): a small engine loop in this module (GPU block pool with a prefix
  cache, chunked prefill, one decode token per step, newest-first preemption) over
  statecore's scheduler, CPU manager and worker;
* ``vllm`` (when this Python has vLLM 0.33, e.g. the peer venv): vLLM's real engine
  ``Scheduler`` with vLLM's ``OffloadingConnector`` and with statecore's connector
  (:mod:`statecore.adapters.vllm`), one after the other on the same seeded workload, workers
  simulated (real worker-role connectors, transfer engines replaced by step-delayed ones).

Statistics are over steps ``warmup..steps`` that scheduled tokens (median, p99, max, in
microseconds). Memory per in-flight job is measured with ``tracemalloc`` over the creation
of the job records. This is a command, not a test: nothing here asserts timings.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from statecore.config import GroupConfig, SchedulerConfig
from statecore.managers.cpu import CPUOffloadingManager
from statecore.scheduler import OffloadingScheduler
from statecore.sim.blocks import BlockPool
from statecore.sim.hashing import extend_block_hashes
from statecore.sim.step import admission_blocks, has_requests, waiting_order
from statecore.views import Request, ScheduledColumns, ScheduledRequest, SchedulerOutput
from statecore.wire import TransferJob, WorkerMetadata
from statecore.worker import OffloadingWorker, TransferResult

__all__ = [
    "HOOKS",
    "Collection",
    "GCRecorder",
    "Scenario",
    "StepDelayBackend",
    "Workload",
    "gc_line",
    "gc_summary",
    "main",
    "run_standalone",
    "run_vllm",
    "summarize",
]

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
)
"""The four per-step connector hooks whose sum is the per-step cost."""

BLOCK = 16


@dataclass(frozen=True)
class Scenario:
    """The workload and engine shape (defaults follow the peer scenario)."""

    concurrency: int = 64
    steps: int = 400
    num_prefixes: int = 128
    prefix_len: int = 512
    suffix_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (16, 96)
    followup_prob: float = 0.25
    followup_turn_len: int = 64
    max_prompt_len: int = 4096
    gpu_cache_factor: float = 1.1
    cpu_cache_factor: float = 4.0
    load_delay: int = 2
    store_delay: int = 3
    num_workers: int = 1
    max_num_batched_tokens: int = 8192
    warmup_steps: int = 20
    reset_at: int | None = None
    seed: int = 0
    policy: str = "lru"
    """The standalone CPU tier's eviction policy (``lru``, ``arc``, ``request-lru`` or
    ``request-arc``; the vLLM engine runs use the adapter's default)."""
    reset_with_loads: bool = False
    """Reset at the first step from ``reset_at`` on at which a load is in flight."""
    load_fail_every: int = 0
    """statecore's connector only: rank 0 fails every n-th load it runs (0: never)."""
    failure_policy: str = "fail"
    """vLLM's ``kv_load_failure_policy`` (``"fail"`` or ``"recompute"``)."""
    tiering: bool = False
    """``TieringOffloadingSpec`` with a file-system tier (in a temporary directory)."""
    tier_wait: bool = False
    """vLLM engine runs with ``tiering`` and vLLM's connector: the simulated forward pass of
    each step lasts until vLLM's secondary tiers are idle (every transfer and existence lookup
    submitted so far has finished), as with a model step longer than the tier's I/O. Without
    it the simulated step takes no time, and how far the tiers' I/O threads get between steps
    is up to the machine's thread scheduling: one run of a seed differs from the next."""
    mamba_block: int = 0
    """vLLM engine runs: a hybrid model of two KV-cache groups, full attention and a Mamba
    group in ``align`` cache mode, both with blocks of this many tokens (a multiple of 16),
    requests hashed by 16-token blocks (``prefix_match_unit``): the layout for which vLLM's
    connector looks up partial tails. 0: one full-attention group of 16-token blocks."""
    kv_events: bool = False
    """Enable KV events (self-describing ones) and collect the connector's event stream."""
    extra: tuple[tuple[str, Any], ...] = ()
    """vLLM engine runs: further ``kv_connector_extra_config`` entries, for both connectors
    (an out-of-tree ``spec_name`` and ``spec_module_path``, say)."""
    clock: str = "perf"
    """Timer of the hooks: ``perf`` (wall) or ``thread`` (this thread's CPU time)."""
    active: int = 0
    """Standalone engine: at most this many requests scheduled per step (0: no cap). The
    others stay in flight, tracked by the connector, idle; running ones are served
    round-robin and waiting ones get a share of the slots (the change-proportional mode)."""
    gc_stats: bool = False
    """Record the cyclic garbage collector's collections during the timed steps (generation,
    pause, whether it started inside a hook) and the per-step cost without the in-hook pauses
    (:class:`GCRecorder`). The collector itself runs as it would without this."""
    bulk: bool = False
    """Standalone engine, for soaks: prompt tokens drawn in bulk (``randbytes``, another
    stream than the default's) and running requests handed over as
    :class:`~statecore.views.ScheduledColumns`, so that the engine loop's own cost does not
    bound how far a soak gets."""

    def num_gpu_blocks(self) -> int:
        """GPU blocks: 1.1x what N average requests need, at least two of the largest."""
        avg = (
            self.prefix_len
            + sum(self.suffix_len) / 2
            + self.followup_prob * 300
            + sum(self.output_len) / 2
        )
        need = int(self.concurrency * avg / BLOCK)
        floor = 2 * -(-(self.max_prompt_len + self.output_len[1]) // BLOCK) + 1
        return max(int(need * self.gpu_cache_factor), floor)

    def num_cpu_chunks(self) -> int:
        """CPU tier capacity in chunks."""
        return int(self.num_gpu_blocks() * self.cpu_cache_factor)


class Workload:
    """The seeded request stream: prompts and output lengths."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = random.Random(sc.seed)
        self.prefixes = [self._tokens(sc.prefix_len) for _ in range(sc.num_prefixes)]
        self.done: list[list[int]] = []
        self.next_id = 0

    def _tokens(self, n: int) -> list[int]:
        if self.sc.bulk:  # C speed: 16-bit draws folded into 3..49999
            raw = array("H", self.rng.randbytes(2 * n))
            return [3 + t % 49997 for t in raw]
        r = self.rng.randrange
        return [r(3, 50000) for _ in range(n)]

    def new(self) -> tuple[str, list[int], int]:
        """The next request: (id, prompt tokens, output tokens)."""
        sc, rng = self.sc, self.rng
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.done and rng.random() < sc.followup_prob:
            prompt = rng.choice(self.done) + self._tokens(sc.followup_turn_len)
        else:
            prompt = self.prefixes[rng.randrange(sc.num_prefixes)] + self._tokens(
                rng.randint(*sc.suffix_len)
            )
        return rid, prompt[: sc.max_prompt_len], rng.randint(*sc.output_len)

    def sample(self, req_id: str) -> int:
        """The token request ``req_id`` generates next."""
        return self.rng.randrange(3, 50000)

    def finished(self, text: list[int]) -> None:
        """A request finished with ``text`` (prompt + output): a follow-up base."""
        self.done.append(text)
        if len(self.done) > 512:
            self.done.pop(self.rng.randrange(len(self.done)))


class StepDelayBackend:
    """A statecore transfer backend that reports each job done a fixed number of engine
    steps after submission; ``wait`` completes at once. Moves no bytes."""

    def __init__(
        self, clock: list[int], load_delay: int, store_delay: int, fail_every: int = 0
    ) -> None:
        self.clock = clock
        self.delay = {False: load_delay, True: store_delay}
        self._due: dict[int, tuple[int, bool]] = {}
        self.fail_every = fail_every
        self._loads = 0
        self._failing: set[int] = set()
        self.submitted = 0

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Queue the job (every ``fail_every``-th load will report a failure)."""
        self.submitted += 1
        self._due[job_id] = (self.clock[0] + self.delay[is_store], is_store)
        if not is_store and self.fail_every:
            self._loads += 1
            if self._loads % self.fail_every == 0:
                self._failing.add(job_id)

    def poll(self) -> list[TransferResult]:
        """Jobs whose step has come."""
        now = self.clock[0]
        done = [j for j, (due, _) in self._due.items() if due <= now]
        out = []
        for j in sorted(done):
            ok = j not in self._failing
            self._failing.discard(j)
            out.append(TransferResult(j, ok, 0, 0.0, self._due.pop(j)[1]))
        return out

    def wait(self, job_ids: Any) -> None:
        """Complete those jobs now."""
        for j in job_ids:
            if j in self._due:
                self._due[j] = (-1, self._due[j][1])

    def pending(self) -> int:
        """Jobs not reported yet."""
        return len(self._due)

    def shutdown(self) -> None:
        """Drop everything."""
        self._due.clear()


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class HookTimer:
    """Wraps the four hooks of a connector instance; accumulates ns per step. With ``track``,
    :attr:`current` names the hook running (for :class:`GCRecorder`)."""

    def __init__(
        self,
        target: Any,
        on_call: Callable[[str, tuple[Any, ...], Any], None],
        clock: str = "perf",
        track: bool = False,
    ) -> None:
        self.ns: dict[str, int] = dict.fromkeys(HOOKS, 0)
        self.steps: list[tuple[int, dict[str, int]]] = []
        self.target = target
        self.current: str | None = None
        """The hook running now (kept only with ``track``), for :class:`GCRecorder`."""
        self._engine_ns = 0
        self.in_engine_step = False
        """Whether the engine's own step (vLLM's request intake, ``schedule`` and
        ``update_from_output``) runs now: set by the loop, for :class:`GCRecorder`."""
        # thread CPU time: ratios between runs hold on a loaded machine (no preemption noise)
        pc = time.thread_time_ns if clock == "thread" else time.perf_counter_ns
        self.clock = pc
        for name in HOOKS:
            orig = getattr(target, name)

            def timed(*args: Any, _o: Any = orig, _n: str = name) -> Any:
                t0 = pc()
                res = _o(*args)
                self.ns[_n] += pc() - t0
                on_call(_n, args, res)
                return res

            def tracked(*args: Any, _o: Any = orig, _n: str = name) -> Any:
                self.current = _n
                t0 = pc()
                try:
                    res = _o(*args)
                finally:
                    self.current = None
                self.ns[_n] += pc() - t0
                on_call(_n, args, res)
                return res

            setattr(target, name, tracked if track else timed)

    def engine_part(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as a part of the engine's own step (vLLM runs): timed on this clock
        into the step's engine time (:meth:`take_engine_ns`), :attr:`in_engine_step` meanwhile."""
        self.in_engine_step = True
        t0 = self.clock()
        try:
            return fn(*args)
        finally:
            self._engine_ns += self.clock() - t0
            self.in_engine_step = False

    def take_engine_ns(self) -> int:
        """The engine time of the step's parts since the last call (then zero)."""
        ns, self._engine_ns = self._engine_ns, 0
        return ns

    def end_step(self, scheduled_tokens: int) -> None:
        """Close the step."""
        self.steps.append((scheduled_tokens, self.ns))
        self.ns = dict.fromkeys(HOOKS, 0)


class _NoHooks:
    """The timer's target in a run without a connector: the four hooks, never called."""

    def get_num_new_matched_tokens(self, *args: Any) -> Any:
        return None

    def update_state_after_alloc(self, *args: Any) -> Any:
        return None

    def build_connector_meta(self, *args: Any) -> Any:
        return None

    def update_connector_output(self, *args: Any) -> Any:
        return None


@dataclass(frozen=True, slots=True)
class Collection:
    """One collection of the cyclic garbage collector during a run."""

    step: int
    """Index of the engine step it happened in (as :attr:`HookTimer.steps` counts them)."""
    generation: int
    hook: str | None
    """The connector hook it started in, or None (the engine's own code)."""
    pause_ns: int
    """Its duration on the hooks' clock."""
    in_engine_step: bool = False
    """Whether it started inside the engine's own step (request intake, ``schedule`` or
    ``update_from_output``; vLLM runs: what :func:`engine_step_summary` subtracts)."""


class GCRecorder:
    """Records the cyclic GC's collections while a run's steps are timed (``gc.callbacks``).

    Each collection is attributed to the step it happened in and to the hook it started in
    (:attr:`HookTimer.current`), so that a hook's time can be told apart from the collector's
    pauses that landed in it. Nothing about the collector is changed: a collection starts
    wherever the allocation count crosses its threshold, with or without this recorder.
    Use as a context manager around the timed loop."""

    def __init__(self, timer: HookTimer) -> None:
        self.timer = timer
        self.collections: list[Collection] = []
        self._start: tuple[int, str | None, bool] | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        t = self.timer
        if phase == "start":
            self._start = (t.clock(), t.current, t.in_engine_step)
        elif self._start is not None:
            t0, hook, in_engine = self._start
            self._start = None
            self.collections.append(
                Collection(len(t.steps), int(info["generation"]), hook, t.clock() - t0, in_engine)
            )

    def __enter__(self) -> GCRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def gc_summary(
    collections: Sequence[Collection],
    steps: Sequence[tuple[int, dict[str, int]]],
    warmup: int,
    last: int,
) -> dict[str, Any]:
    """The collections of the steps :func:`summarize` counts (``warmup..last``, tokens > 0):
    per generation, how many, how many started in a hook and their pauses (ms), the longest
    pause of any of them (``max_pause_ms``, wherever it started); and the
    per-step cost (sum of the four hooks) with the in-hook pauses subtracted (median, p99 µs),
    next to how many of the steps at or above the plain p99 had an in-hook pause."""
    counted = {i for i in range(warmup, min(last, len(steps))) if steps[i][0] > 0}
    in_hooks: dict[int, int] = {}
    gens: dict[str, dict[str, Any]] = {}
    for c in collections:
        if c.step not in counted:
            continue
        g = gens.setdefault(
            str(c.generation), {"count": 0, "in_hooks": 0, "hook_pauses_ms": [], "max_pause_ms": 0}
        )
        g["count"] += 1
        g["max_pause_ms"] = max(g["max_pause_ms"], round(c.pause_ns / 1e6, 3))
        if c.hook is not None:
            g["in_hooks"] += 1
            g["hook_pauses_ms"].append(round(c.pause_ns / 1e6, 3))
            in_hooks[c.step] = in_hooks.get(c.step, 0) + c.pause_ns
    totals = {i: sum(steps[i][1].values()) for i in sorted(counted)}
    plain = [ns / 1e3 for ns in totals.values()]
    net = [(ns - in_hooks.get(i, 0)) / 1e3 for i, ns in totals.items()]
    out: dict[str, Any] = {"generations": gens, "steps": len(plain)}
    if plain:
        p99 = _pct(plain, 99)
        out.update(
            median_us=statistics.median(plain),
            p99_us=p99,
            net_median_us=statistics.median(net),
            net_p99_us=_pct(net, 99),
            tail_steps=sum(1 for x in plain if x >= p99),
            tail_steps_with_gc=sum(
                1 for i, ns in totals.items() if ns / 1e3 >= p99 and i in in_hooks
            ),
            hook_pause_share=sum(in_hooks.values()) / max(sum(totals.values()), 1),
        )
    return out


def gc_line(g: dict[str, Any], hooks: bool = True, label: str = "gc") -> str:
    """One line of :func:`gc_summary` for the table, headed ``label`` (``hooks=False``: the
    collections alone, for a run without a connector)."""
    if not g.get("steps"):
        return f"  {label}: no timed steps"
    parts = []
    for gen in sorted(g["generations"]):
        d = g["generations"][gen]
        pauses = d["hook_pauses_ms"]
        span = f", {min(pauses):.1f}-{max(pauses):.1f} ms" if pauses else ""
        longest = f"; longest {d['max_pause_ms']:.1f} ms" if d.get("max_pause_ms") else ""
        parts.append(f"gen{gen} {d['count']} ({d['in_hooks']} in hooks{span}{longest})")
    if not hooks:
        return f"  {label}: {'; '.join(parts) or 'no collections'}"
    return (
        f"  {label}: {'; '.join(parts) or 'no collections'}; in-hook pauses "
        f"{100 * g['hook_pause_share']:.1f}% of hook time; tail steps (>= p99) with one: "
        f"{g['tail_steps_with_gc']}/{g['tail_steps']}; without them median "
        f"{g['net_median_us']:.1f} p99 {g['net_p99_us']:.1f} (p99/median "
        f"{g['net_p99_us'] / max(g['net_median_us'], 1e-9):.2f}; with them "
        f"{g['p99_us'] / max(g['median_us'], 1e-9):.2f})"
    )


def engine_step_summary(
    engine_ns: Sequence[int],
    steps: Sequence[tuple[int, dict[str, int]]],
    warmup: int,
    last: int,
    collections: Sequence[Collection] | None,
) -> dict[str, Any]:
    """The engine's whole step (vLLM's intake of the step's new requests, ``schedule`` and
    ``update_from_output``, the hooks inside them: what an engine core process runs) over
    the steps :func:`summarize` counts: median, p99 (µs); with ``collections``, also how
    many collections started inside it, their pauses, and the median and p99 with those
    pauses subtracted."""
    counted = [i for i in range(warmup, min(last, len(steps), len(engine_ns))) if steps[i][0] > 0]
    if not counted:
        return {"steps": 0}
    plain = [engine_ns[i] / 1e3 for i in counted]
    out: dict[str, Any] = {
        "steps": len(plain),
        "median_us": statistics.median(plain),
        "p99_us": _pct(plain, 99),
    }
    if collections is not None:
        wanted = set(counted)
        paused: dict[int, int] = {}
        pauses: list[float] = []
        for c in collections:
            if c.in_engine_step and c.step in wanted:
                paused[c.step] = paused.get(c.step, 0) + c.pause_ns
                pauses.append(c.pause_ns / 1e6)
        net = [(engine_ns[i] - paused.get(i, 0)) / 1e3 for i in counted]
        out.update(
            collections=len(pauses),
            steps_with_pause=len(paused),
            pause_max_ms=max(pauses, default=0.0),
            pause_share=sum(paused.values()) / max(sum(engine_ns[i] for i in counted), 1),
            net_median_us=statistics.median(net),
            net_p99_us=_pct(net, 99),
        )
    return out


def engine_step_line(label: str, e: dict[str, Any]) -> str:
    """One line of :func:`engine_step_summary`."""
    if not e.get("steps"):
        return f"  engine step, {label}: no timed steps"
    line = (
        f"  engine step, {label}: median {e['median_us']:.1f} p99 {e['p99_us']:.1f} µs "
        f"(p99/median {e['p99_us'] / max(e['median_us'], 1e-9):.2f})"
    )
    if "collections" in e:
        line += (
            f"; collections in it {e['collections']} (in {e['steps_with_pause']} steps, "
            f"up to {e['pause_max_ms']:.1f} ms, {100 * e['pause_share']:.1f}% of its time); "
            f"without them median {e['net_median_us']:.1f} p99 {e['net_p99_us']:.1f}"
        )
    return line


def _pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def summarize(
    steps: Sequence[tuple[int, dict[str, int]]], warmup: int, last: int
) -> dict[str, dict[str, float]]:
    """Median, p99, max (µs) per hook and for the sum, over active steps warmup..last."""
    recs = [ns for tok, ns in steps[warmup:last] if tok > 0]
    rows: dict[str, list[float]] = {name: [] for name in (*HOOKS, "sum of 4 hooks")}
    for ns in recs:
        total = 0
        for name in HOOKS:
            rows[name].append(ns[name] / 1e3)
            total += ns[name]
        rows["sum of 4 hooks"].append(total / 1e3)
    out: dict[str, dict[str, float]] = {}
    for name, xs in rows.items():
        if xs:
            out[name] = {
                "median_us": statistics.median(xs),
                "p99_us": _pct(xs, 99),
                "max_us": max(xs),
                "steps": float(len(xs)),
            }
    return out


@dataclass
class RunResult:
    """One run: counters, per-request outcomes and load traces, timing summary."""

    engine: str
    connector: str
    scenario: Scenario
    summary: dict[str, dict[str, float]]
    counters: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    hits: dict[str, list[int]] = field(default_factory=dict)
    loads: dict[str, list[int]] = field(default_factory=dict)
    leftovers: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    bytes_per_job: float = 0.0
    errors: list[str] = field(default_factory=list)
    """Requests the engine finished with an error (a failed load under ``"fail"``)."""
    stats: dict[str, Any] = field(default_factory=dict)
    """statecore's connector: every ``get_kv_connector_stats`` payload, aggregated."""
    events: list[tuple[Any, ...]] = field(default_factory=list)
    """The connector's KV events in order, as comparable tuples (engine step first)."""
    gc: dict[str, Any] = field(default_factory=dict)
    """With ``Scenario.gc_stats``: :func:`gc_summary` of the run."""
    engine_step: dict[str, Any] = field(default_factory=dict)
    """vLLM runs: :func:`engine_step_summary` (the engine's whole step, hooks included)."""

    def as_json(self) -> dict[str, Any]:
        """The JSON-able form."""
        d = asdict(self)
        d["scenario"] = asdict(self.scenario)
        return d


# --------------------------------------------------------------------------------------------
# Standalone engine (no vLLM)
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Req:
    view: Request
    tokens: list[int]
    max_out: int
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    loading: bool = False
    scheduled_once: bool = False
    resumed: bool = False
    cached: int = 0
    """Leading blocks known to be in the pool's prefix cache (the engine loop registers the
    blocks after them only: its own per-step cost follows what was computed, not N)."""


def _holds_blocks(r: _Req) -> bool:
    """Whether a waiting request holds blocks (its load ended): tried first."""
    return bool(r.blocks)


def _standalone_scheduler(sc: Scenario) -> tuple[OffloadingScheduler, CPUOffloadingManager]:
    cfg = SchedulerConfig(
        groups=(GroupConfig(BLOCK),),
        num_workers=sc.num_workers,
        offload_prompt_only=True,
    )
    manager = CPUOffloadingManager(sc.num_cpu_chunks(), policy=sc.policy, enable_events=False)
    return OffloadingScheduler(cfg, manager), manager


StepProbe = Callable[[int, "HookTimer", "RunResult", int], bool]
"""Called after every standalone step with (step, timer, result, jobs submitted so far);
returning True ends the run at once (no drain)."""


def run_standalone(
    sc: Scenario,
    probe: StepProbe | None = None,
    *,
    workload: Workload | None = None,
    observe: Callable[[OffloadingScheduler], None] | None = None,
) -> RunResult:
    """The scenario on this module's engine loop over statecore's stack.

    Args:
        sc: the scenario.
        probe: called after every step (:data:`StepProbe`).
        workload: the request stream (default: ``Workload(sc)``).
        observe: called with the scheduler before the run (before the timer wraps its
            hooks), e.g. to record the calls the loop makes.
    """
    sched, _ = _standalone_scheduler(sc)
    if observe is not None:
        observe(sched)
    clock = [0]
    backends = [
        StepDelayBackend(clock, sc.load_delay, sc.store_delay) for _ in range(sc.num_workers)
    ]
    workers = [OffloadingWorker(b, rank=i) for i, b in enumerate(backends)]
    res = RunResult("standalone", "statecore", sc, {})
    timer = HookTimer(sched, lambda n, a, r: None, sc.clock, sc.gc_stats)
    pool = BlockPool(sc.num_gpu_blocks(), uncached_first=True)  # vLLM 0.33's free order
    wl = workload or Workload(sc)
    waiting: list[_Req] = []
    running: list[_Req] = []
    live: dict[str, _Req] = {}
    inflight: dict[str, _Req] = {}
    """vLLM's prefills in flight: requests loading, or admitted with prompt tokens not yet
    scheduled; an asynchronous load's admission keeps free the blocks they still need."""
    finished_ids: set[str] = set()
    c = res.counters

    def arrive() -> None:
        rid, prompt, out = wl.new()
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt, BLOCK)
        r = _Req(Request(rid, len(prompt), len(prompt), hashes), list(prompt), out)
        live[rid] = r
        waiting.append(r)
        sched.on_new_request(r.view)

    def free(r: _Req) -> None:
        pool.release(r.blocks)
        r.blocks = []
        r.cached = 0

    def cache(r: _Req, tokens: int) -> None:
        # as vLLM's allocation: the full blocks the scheduled tokens fill enter the prefix
        # cache when they are allocated (a request admitted later in the same step hits
        # them). A block registered earlier stays registered while the request holds it, so
        # only the ones after the first unregistered one are (re)tried: the same effect as
        # trying every full block each step
        blocks, hashes = r.blocks, r.view.block_hashes
        upto = min(len(hashes), len(blocks), tokens // BLOCK)
        first = upto
        for b in range(r.cached, upto):
            blk = blocks[b]
            pool.cache(blk, hashes[b])
            if first == upto and pool.hash_of[blk] is None:
                first = b
        if upto > r.cached:
            r.cached = first

    with GCRecorder(timer) if sc.gc_stats else contextlib.nullcontext() as recorder:
        t0 = time.perf_counter()
        step = 0
        while True:
            if step >= sc.steps and not has_requests(
                bool(live), bool(finished_ids), sched.has_pending_push_work
            ):
                break
            if step > 10 * sc.steps + 1000:
                raise RuntimeError("standalone engine did not drain")
            due = sc.reset_at is not None and step >= sc.reset_at and "resets" not in c
            if due and (
                not sc.reset_with_loads or any(not j.is_store for j in sched.jobs.values())
            ):
                c["resets"] = 1
                sched.reset_cache()
            if step < sc.steps:
                while len(live) < sc.concurrency:
                    arrive()
            budget = sc.max_num_batched_tokens
            scheduled: list[tuple[_Req, int]] = []
            new_ids: set[str] = set()
            preempted: set[str] = set()
            # running requests first (as vLLM): chunked prefill or one decode token; with
            # ``active``, at most that many requests a step, waiting ones keeping a share
            cap = sc.active or len(running) + len(waiting) + 1
            run_cap = max(cap - len(waiting), cap // 2)
            i = 0
            while i < len(running) and budget > 0 and i < run_cap:
                r = running[i]
                v = r.view
                n = min(v.num_tokens - v.num_computed_tokens, budget)
                need = -(-(v.num_computed_tokens + n) // BLOCK) - len(r.blocks)
                while need > 0:
                    got = pool.allocate(need)
                    if got is not None:
                        r.blocks += got
                        r.new_blocks += got
                        break
                    victim = running.pop()
                    inflight.pop(victim.view.request_id, None)
                    free(victim)
                    victim.view.num_computed_tokens = 0
                    victim.resumed = True
                    victim.new_blocks = []
                    preempted.add(victim.view.request_id)
                    waiting.insert(0, victim)
                    c["preemptions"] = c.get("preemptions", 0) + 1
                    if victim is r:
                        break
                if v.request_id in preempted:  # it was the victim (O(1): soak sizes)
                    continue
                cache(r, v.num_computed_tokens + n)
                scheduled.append((r, n))
                budget -= n
                i += 1
            if sc.active:  # round-robin: the next step starts after the last one served
                running = running[i:] + running[:i]
            # waiting requests (statecore.sim.step): only when the running ones preempted
            # nothing, those holding blocks first; FCFS, as vLLM: the first request that does
            # not fit stops admission; an admission needs room for the whole sequence
            still: list[_Req] = []
            blocked = bool(preempted)
            for r in waiting_order(waiting, _holds_blocks) if not blocked else waiting:
                v = r.view
                full = len(running) >= sc.concurrency or len(scheduled) >= cap
                if blocked or r.loading or budget <= 0 or full:
                    still.append(r)
                    continue
                if r.blocks:  # its load ended: schedule the rest
                    n = min(v.num_tokens - v.num_computed_tokens, budget)
                    need = -(-(v.num_computed_tokens + n) // BLOCK) - len(r.blocks)
                    whole = -(-v.num_tokens // BLOCK) - len(r.blocks)
                    if admission_blocks(need, whole) > pool.num_free:
                        still.append(r)
                        blocked = True
                        continue
                    got = pool.allocate(need) if need > 0 else []
                    if got is None:
                        still.append(r)
                        blocked = True
                        continue
                    r.blocks += got
                    r.new_blocks = list(r.blocks)
                    # vLLM's admission tells the connector of every request it admits, a
                    # loaded one with no external tokens left
                    sched.update_state_after_alloc(v, (r.blocks,), 0)
                    cache(r, v.num_computed_tokens + n)
                    if v.num_computed_tokens + n < v.num_tokens:
                        inflight[v.request_id] = r
                    scheduled.append((r, n))
                    new_ids.add(v.request_id)
                    running.append(r)
                    budget -= n
                    continue
                hit = pool.computed_blocks(v.block_hashes, (v.num_tokens - 1) // BLOCK)
                local = len(hit) * BLOCK
                ext, is_async = sched.get_num_new_matched_tokens(v, local)
                if ext is None:
                    still.append(r)
                    continue
                total = local + ext
                n = 0 if is_async else min(v.num_tokens - total, budget)
                need = -(-(total + n) // BLOCK) - len(hit)
                whole = -(-v.num_tokens // BLOCK) - len(hit)
                free_hits = sum(1 for b in hit if pool.ref[b] == 0)  # touching takes them
                reserve = 0
                if is_async:
                    reserve = sum(
                        max(0, -(-q.view.num_tokens // BLOCK) - len(q.blocks))
                        for q in inflight.values()
                    )
                if admission_blocks(need, whole, reserve) + free_hits > pool.num_free:
                    still.append(r)
                    blocked = True
                    continue
                pool.touch(hit)
                got = pool.allocate(need) or []
                r.blocks = hit + got
                r.cached = 0
                r.new_blocks = list(r.blocks)
                v.num_computed_tokens = local
                sched.update_state_after_alloc(v, (r.blocks,), ext)
                if is_async:
                    r.loading = True
                    v.num_computed_tokens = total
                    inflight[v.request_id] = r
                    still.append(r)
                    continue
                v.num_computed_tokens = total
                if total + n < v.num_tokens:
                    inflight[v.request_id] = r
                cache(r, total + n)
                scheduled.append((r, n))
                new_ids.add(v.request_id)
                running.append(r)
                budget -= n
            waiting = still
            if inflight:  # a prefill scheduled to its end is no longer in flight
                for r, n in scheduled:
                    if r.view.num_computed_tokens + n >= r.view.num_tokens:
                        inflight.pop(r.view.request_id, None)
            if sc.bulk:  # running requests in columnar form, as the vLLM adapter hands them
                listed = sorted(  # new, then resumed (statecore.sim.step.listed)
                    ((r, n) for r, n in scheduled if r.view.request_id in new_ids),
                    key=lambda e: e[0].resumed,
                )
                rest = [(r, n) for r, n in scheduled if r.view.request_id not in new_ids]
                columns = ScheduledColumns(
                    [r.view.request_id for r, _ in rest],
                    [(r.new_blocks,) if r.new_blocks else None for r, _ in rest],
                    [n for _, n in rest],
                    frozenset(r.view.request_id for r, _ in rest if r.resumed),
                )
            else:  # as vLLM 0.33 lists them (statecore.sim.step.listed): new, resumed, running
                listed = sorted(
                    scheduled,
                    key=lambda e: (
                        2 if e[0].view.request_id not in new_ids else 1 if e[0].resumed else 0
                    ),
                )
                columns = None
            out = SchedulerOutput(
                scheduled=tuple(
                    ScheduledRequest(
                        r.view.request_id,
                        (tuple(r.new_blocks),),
                        n,
                        r.resumed and r.view.request_id not in new_ids,
                    )
                    for r, n in listed
                ),
                new_req_ids=frozenset(new_ids),
                finished_req_ids=frozenset(finished_ids),
                preempted_req_ids=frozenset(preempted),
                columns=columns,
            )
            finished_ids = set()
            meta = sched.build_connector_meta(out)
            for r, _ in scheduled:
                r.new_blocks = []
                r.resumed = False
            for w in workers:
                w.start_step(meta)
                w.end_step(meta)
            report = WorkerMetadata()
            for w in workers:
                report = report.aggregate(w.build_worker_metadata())
            # vLLM's update_from_output: the step's outputs (finished requests) first, then
            # the workers' report (statecore.sim.step)
            # compute: advance tokens, sample, cache full blocks
            done: list[_Req] = []
            for r, n in scheduled:
                v = r.view
                v.num_computed_tokens += n
                if v.num_computed_tokens >= v.num_tokens:
                    r.tokens.append(wl.sample(v.request_id))
                    v.num_tokens += 1
                    extend_block_hashes(v.block_hashes, r.tokens, BLOCK)
                    if v.num_tokens - v.num_prompt_tokens >= r.max_out:
                        done.append(r)
            if done:  # one pass, not a remove per request (O(N) a step at soak sizes)
                ended = set(map(id, done))
                running = [r for r in running if id(r) not in ended]
            for r in done:
                sched.request_finished(r.view)
                free(r)
                del live[r.view.request_id]
                finished_ids.add(r.view.request_id)
                res.outputs[r.view.request_id] = r.view.num_tokens - r.view.num_prompt_tokens
                wl.finished(list(r.tokens))
            result = sched.update_connector_output(report)
            for rid in result.finished_loads:
                lr = live.get(rid)
                if lr is None:
                    continue
                lr.loading = False
                lr.view.num_computed_tokens = min(
                    lr.view.num_computed_tokens, lr.view.num_tokens - 1
                )
                if result.invalid_block_ids:
                    lr.view.num_computed_tokens = 0
            timer.end_step(sum(n for _, n in scheduled))
            step += 1
            clock[0] += 1
            if probe is not None and probe(step, timer, res, backends[0].submitted):
                break
    res.wall_s = time.perf_counter() - t0
    res.summary = summarize(timer.steps, sc.warmup_steps, sc.steps)
    if recorder is not None:
        res.gc = gc_summary(recorder.collections, timer.steps, sc.warmup_steps, sc.steps)
    res.counters.update(
        {k: v for k, v in sched.counters.as_dict().items() if isinstance(v, int) and v}
    )
    res.leftovers = {
        "requests": len(sched.requests),
        "jobs": len(sched.jobs),
        "stalled": len(sched.stalled_jobs),
        "fences": len(sched.fence_index),
        "backend_pending": sum(b.pending() for b in backends),
    }
    if probe is None and not sc.active:  # (soak and capped runs: not printed)
        res.bytes_per_job = job_record_bytes()
    return res


def job_record_bytes(n: int = 2000) -> float:
    """Bytes retained per in-flight job: ``tracemalloc`` over ``n`` load jobs of 4 chunks.

    Requests are tracked and looked up before the first snapshot, so only what a job adds
    is counted: the job record with its keys/blocks tuples and lifecycle state, its entries
    in the scheduler's indexes (jobs, the request's job set, the keys being loaded). The
    step's metadata is built and dropped before the second snapshot (it is handed to the
    workers, not retained)."""
    cfg = SchedulerConfig(groups=(GroupConfig(BLOCK),), offload_prompt_only=False)
    mgr = CPUOffloadingManager(4 * n + 8, enable_events=False)
    sched = OffloadingScheduler(cfg, mgr)
    hashes = [bytes([i]) * 16 for i in range(4)]
    seed = Request("seed", 64, 64, list(hashes))
    sched.on_new_request(seed)
    sched.get_num_new_matched_tokens(seed, 0)
    sched.update_state_after_alloc(seed, ((1, 2, 3, 4),), 0)
    sched.build_connector_meta(
        SchedulerOutput(scheduled=(ScheduledRequest("seed", ((1, 2, 3, 4),), 64),))
    )
    sched.update_connector_output(WorkerMetadata(completed=dict.fromkeys(sched.jobs, 1)))
    reqs = [Request(f"q{i}", 64, 64, list(hashes)) for i in range(n)]
    for r in reqs:
        sched.on_new_request(r)
        sched.get_num_new_matched_tokens(r, 0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i, r in enumerate(reqs):
        base = 10 + 4 * i
        sched.update_state_after_alloc(r, ((base, base + 1, base + 2, base + 3),), 64)
    meta = sched.build_connector_meta(SchedulerOutput())
    del meta
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    if len(sched.jobs) != n:
        raise RuntimeError(f"expected {n} in-flight jobs, found {len(sched.jobs)}")
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return grown / n


def rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``; else the peak RSS)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class SoakSample:
    """One point of the soak curve: memory and per-step cost over the window that ends here."""

    elapsed_s: float
    step: int
    jobs: int
    rss_mib: float
    traced_mib: float
    """``tracemalloc``'s current traced memory (0 when not tracing)."""
    tracked_requests: int
    tracked_jobs: int
    median_us: float
    p99_us: float
    cpu_fill: float = 0.0
    """The CPU tier's present keys over its capacity: the warm-up ends when it is full."""
    index_mib: float = 0.0
    """The CPU tier's key table and policy tables
    (:meth:`~statecore.managers.cpu.CPUOffloadingManager.index_bytes`): the key table resizes
    once more after the tier is full, when eviction first churns it; the warm-up ends after
    that (the policy's lists are sized once, at construction)."""


def soak_warm(curve: Sequence[SoakSample]) -> tuple[int, str]:
    """Index of the first sample after warm-up, and why: memory grows while the CPU tier
    fills and once more when eviction first churns the full tier (its key table resizes:
    :attr:`SoakSample.index_mib`), so the warm-up ends at the first sample with the
    tier full and those tables at their final size (the last sample when they resized there:
    nothing after the warm-up then); failing that (the tier emptied again by the end), at the
    first one with the tier full; else at the first quarter's end."""
    if curve:
        final = curve[-1].index_mib
        for i, p in enumerate(curve):
            # (within 1 %: a table's resize at least doubles it)
            if p.cpu_fill >= 0.99 and abs(p.index_mib - final) <= 0.01 * final:
                return i, "the CPU tier full, its tables at their final size"
    for i, p in enumerate(curve):
        if p.cpu_fill >= 0.99:
            return i, "the CPU tier full, not at the end"
    return len(curve) // 4, "the first quarter's end; the CPU tier never filled"


def run_soak(
    sc: Scenario, seconds: float, jobs: int, samples: int = 20, trace: bool = False
) -> list[SoakSample]:
    """The standalone engine until ``jobs`` transfer jobs were submitted or ``seconds`` passed,
    sampled about ``samples`` times: RSS (and ``tracemalloc`` with ``trace``), the
    scheduler's table sizes and the hooks' per-step cost (median, p99) since the last sample.
    The benchmark's own per-step records are dropped at each sample so that they do not grow
    with the run."""
    curve: list[SoakSample] = []
    interval = seconds / max(samples, 1)
    t0 = time.perf_counter()
    nxt = [t0 + interval]
    if trace:
        tracemalloc.start()

    def probe(step: int, timer: HookTimer, res: RunResult, submitted: int) -> bool:
        now = time.perf_counter()
        stop = submitted >= jobs or now - t0 >= seconds
        if now < nxt[0] and not stop:
            return False
        nxt[0] = now + interval
        costs = [sum(ns.values()) / 1e3 for tok, ns in timer.steps if tok > 0] or [0.0]
        timer.steps.clear()
        res.outputs.clear()
        sched = timer.target
        cpu = getattr(sched.manager, "primary", sched.manager)
        count = cpu.counters() if hasattr(cpu, "counters") else None
        fill = count.keys / count.capacity if count is not None and count.capacity else 0.0
        index = cpu.index_bytes() if hasattr(cpu, "index_bytes") else 0
        curve.append(
            SoakSample(
                now - t0,
                step,
                submitted,
                rss_bytes() / 2**20,
                tracemalloc.get_traced_memory()[0] / 2**20 if trace else 0.0,
                len(sched.requests),
                len(sched.jobs),
                statistics.median(costs),
                _pct(costs, 99),
                fill,
                index / 2**20,
            )
        )
        return stop

    try:
        run_standalone(sc, probe)
    finally:
        if trace:
            tracemalloc.stop()
    return curve


# --------------------------------------------------------------------------------------------
# vLLM engine (needs vLLM 0.33)
# --------------------------------------------------------------------------------------------


def have_vllm() -> bool:
    """Whether vLLM can be imported here."""
    try:
        importlib.import_module("vllm")
    except Exception:
        return False
    return True


_TINY_MODEL = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "ffn_dim": 64,
    "num_attention_heads": 8,
    "num_hidden_layers": 2,
    "max_position_embeddings": 32768,
    "vocab_size": 50272,
    "word_embed_proj_dim": 64,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}


def _model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "statecore_bench_tinymodel")
    os.makedirs(path, exist_ok=True)
    cfg = os.path.join(path, "config.json")
    text = json.dumps(_TINY_MODEL, sort_keys=True)
    if not os.path.exists(cfg) or open(cfg).read() != text:  # noqa: SIM115
        tmp = f"{cfg}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, cfg)
    return path


def _m(name: str) -> Any:
    return importlib.import_module(name)


class _VllmDelayedEngine:
    """vLLM ``OffloadingWorker`` stand-in: jobs complete a fixed number of steps later."""

    def __init__(self, clock: list[int], load_delay: int, store_delay: int) -> None:
        self.clock = clock
        self.load_delay = load_delay
        self.store_delay = store_delay
        self._due: dict[int, int] = {}
        self._result = _m("vllm.v1.kv_offload.base").TransferResult

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._due[job_id] = self.clock[0] + self.store_delay
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self._due[job_id] = self.clock[0] + (0 if expedited else self.load_delay)
        return True

    def wait(self, job_ids: Any) -> None:
        for j in job_ids:
            if j in self._due:
                self._due[j] = -1

    def get_finished(self) -> list[Any]:
        now = self.clock[0]
        done = sorted(j for j, d in self._due.items() if d <= now)
        for j in done:
            del self._due[j]
        return [self._result(job_id=j, success=True) for j in done]

    def pending(self) -> int:
        return len(self._due)

    def shutdown(self) -> None:
        self._due.clear()


def _wait_for_tiers(manager: Any) -> None:
    """Block until every secondary tier of vLLM's ``TieringOffloadingManager`` is idle: its
    transfers finished (``drain_jobs``) and the existence lookups it has sent to its lookup
    thread answered and applied (as its next ``lookup`` would apply them). Finished jobs stay
    queued for the manager's own next poll. A manager without secondary tiers: nothing. A
    lookup thread that answers nothing for 60 s is a RuntimeError."""
    tiers = getattr(manager, "secondary_tiers", ())
    if not tiers:
        return
    in_flight = _m("vllm.v1.kv_offload.tiering.async_lookup").LookupPhase.IN_FLIGHT
    deadline = time.monotonic() + 60.0
    with manager.lock:
        for tier in tiers:
            tier.drain_jobs()
            lookups = getattr(tier, "_lookup_manager", None)
            if lookups is None:
                continue
            while True:
                lookups.drain_results()
                if all(st.phase is not in_flight for st in lookups._lookup_state.values()):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tier.tier_type} tier: lookups unanswered for 60 s")
                time.sleep(0.0001)


def _chunk_count(spec: Any) -> int:
    for attr in ("slots", "block_ids"):
        ids = getattr(spec, attr, None)
        if ids is not None:
            return len(ids)
    return 0


def run_vllm(sc: Scenario, connector: str, probe: StepProbe | None = None) -> RunResult:
    """The scenario on vLLM's engine ``Scheduler`` with ``connector`` = ``"vllm"`` (vLLM's
    OffloadingConnector), ``"statecore"`` (:class:`StatecoreOffloadingConnector`) or
    ``"none"`` (no KV connector: the engine's own step cost, the baseline of
    :attr:`RunResult.engine_step`; nothing is offloaded).

    ``probe`` is called after every step as in :func:`run_standalone` (the timer's target is
    the scheduler-role connector; jobs submitted by the first worker); returning True ends
    the loop at once (no drain)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch = _m("torch")
    vcfg = _m("vllm.config")
    iface = _m("vllm.v1.kv_cache_interface")
    kvu = _m("vllm.v1.core.kv_cache_utils")
    base = _m("vllm.distributed.kv_transfer.kv_connector.v1.base")
    outputs_mod = _m("vllm.v1.outputs")
    SamplingParams = _m("vllm").SamplingParams
    VRequest = _m("vllm.v1.request").Request
    ngpu, ncpu = sc.num_gpu_blocks(), sc.num_cpu_chunks()
    block = sc.mamba_block or BLOCK
    groups = [
        iface.KVCacheGroupSpec(
            ["layer"],
            iface.FullAttentionSpec(
                block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
    ]
    if sc.mamba_block:
        # the same token span in blocks of mamba_block tokens, and a Mamba state per request
        ngpu = ngpu * BLOCK // block + 4 * sc.concurrency
        ncpu = max(ncpu * BLOCK // block, 1)
        groups.append(
            iface.KVCacheGroupSpec(
                ["mamba"],
                iface.MambaSpec(
                    block_size=block,
                    shapes=((1,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            )
        )
    kcc = iface.KVCacheConfig(num_blocks=ngpu, kv_cache_tensors=[], kv_cache_groups=groups)
    extra: dict[str, Any] = {
        "blocks_per_chunk": 1,
        "eviction_policy": "lru",
        "offload_prompt_only": True,
        "store_threshold": 0,
    }
    page = sum(g.kv_cache_spec.page_size_bytes for g in groups) * sc.num_workers
    align = _m("mmap").PAGESIZE
    extra["cpu_bytes_to_use"] = ncpu * (-(-page // align) * align)
    engine_id = f"bench-{connector}-{os.getpid()}-{id(sc)}"
    tier_dir: Any = None
    if sc.tiering:
        tier_dir = tempfile.TemporaryDirectory(prefix=f"statecore-bench-{connector}-")
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": tier_dir.name}]
        extra["tier_poll_interval_s"] = 0
    if sc.kv_events:
        extra["self_describing_kv_events"] = True
    extra.update(sc.extra)
    common: dict[str, Any] = {
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        "engine_id": engine_id,
        "kv_load_failure_policy": sc.failure_policy,
    }
    ktc: Any
    if connector == "none":
        ktc = None
    elif connector == "vllm":
        ktc = vcfg.KVTransferConfig(kv_connector="OffloadingConnector", **common)
    else:
        ktc = vcfg.KVTransferConfig(
            kv_connector="StatecoreOffloadingConnector",
            kv_connector_module_path="statecore.adapters.vllm",
            **common,
        )
        if sc.tiering:  # the worker's pool, as register_kv_caches would register it
            from statecore.adapters.vllm import register_worker_pool
            from statecore.pool import CPUPool

            register_worker_pool(engine_id, CPUPool(ncpu, [page // sc.num_workers]))
    model = _model_dir()
    cache_config = vcfg.CacheConfig(
        block_size=block,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
        **({"mamba_cache_mode": "align", "prefix_match_unit": BLOCK} if sc.mamba_block else {}),
    )
    cache_config.kv_cache_layout = "LBNHC"
    vc = vcfg.VllmConfig(
        model_config=vcfg.ModelConfig(
            model=model,
            tokenizer=model,
            skip_tokenizer_init=True,
            dtype="float16",
            seed=0,
            max_model_len=16384,
        ),
        scheduler_config=vcfg.SchedulerConfig(
            max_num_seqs=max(sc.concurrency, 1),
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=16384,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=ktc,
        parallel_config=vcfg.ParallelConfig(tensor_parallel_size=sc.num_workers),
        device_config=vcfg.DeviceConfig("cpu"),
        kv_events_config=vcfg.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if sc.kv_events
        else None,
    )
    vc.cache_config.num_gpu_blocks = ngpu
    engine = _m("vllm.v1.core.sched.scheduler").Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=_m("vllm.v1.structured_output").StructuredOutputManager(vc),
        block_size=block,
        hash_block_size=BLOCK,
        log_stats=True,
    )
    conn = engine.connector
    clock = [0]
    role = base.KVConnectorRole.WORKER
    workers: list[Any] = []
    delayed: list[Any] = []
    for rank in range(sc.num_workers if conn is not None else 0):
        if connector == "vllm":
            w = type(conn)(vc, role, kcc)
            eng: Any = _VllmDelayedEngine(clock, sc.load_delay, sc.store_delay)
            w.connector_worker.worker = eng
        else:
            w = type(conn)(vc, role, kcc)
            fail = sc.load_fail_every if rank == 0 else 0
            eng = StepDelayBackend(clock, sc.load_delay, sc.store_delay, fail)
            w.attach_backend(eng, rank=rank)
        workers.append(w)
        delayed.append(eng)
    aggregator = _m("vllm.distributed.kv_transfer.kv_connector.utils").KVOutputAggregator(
        expected_finished_count=sc.num_workers
    )
    hash_fn = _m("vllm.utils.hashing").get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)
    hasher = kvu.get_request_block_hasher(BLOCK, hash_fn)

    res = RunResult("vllm", connector, sc, {})
    c = res.counters

    def on_call(name: str, args: tuple[Any, ...], out: Any) -> None:
        if name == "get_num_new_matched_tokens":
            n, _ = out
            if n is None:
                c["lookups_deferred"] = c.get("lookups_deferred", 0) + 1
            elif n > 0:
                res.hits.setdefault(args[0].request_id, []).append(int(n))
        elif name == "build_connector_meta":
            inner = getattr(out, "inner", out)
            for job in inner.load_jobs.values():
                src = getattr(job, "src_spec", None) or job.src
                res.loads.setdefault(job.req_id, []).append(_chunk_count(src))
            c["load_jobs"] = c.get("load_jobs", 0) + len(inner.load_jobs)
            last_loads[0] = len(inner.load_jobs)
            c["store_jobs"] = c.get("store_jobs", 0) + len(inner.store_jobs)
            c["flushed"] = c.get("flushed", 0) + len(inner.jobs_to_flush or ())

    last_loads = [0]
    if connector == "statecore":  # statecore's own counters, summed over the stats calls
        stats_call = conn.get_kv_connector_stats

        def stats_hook() -> Any:
            st = stats_call()
            for k, v in (st.data if st is not None else {}).items():
                if k.startswith(("cascades", "promotions", "loads_carried", "jobs_failed")):
                    c[k] = c.get(k, 0) + int(v)
            if st is not None:
                merged = type(st)(data=dict(res.stats)).aggregate(st)
                res.stats = dict(merged.data)
            return st

        conn.get_kv_connector_stats = stats_hook
    timer = HookTimer(conn if conn is not None else _NoHooks(), on_call, sc.clock, sc.gc_stats)
    engine_ns: list[int] = []
    if sc.kv_events:
        publish = engine.kv_event_publisher.publish

        def capture(batch: Any) -> None:
            for ev in batch.events:
                if getattr(ev, "medium", None) in ("CPU", "STORAGE"):
                    res.events.append((clock[0], *_event_tuple(ev)))
            publish(batch)

        engine.kv_event_publisher.publish = capture
    wl = Workload(sc)
    token_rng = random.Random(sc.seed + 1)
    live: dict[str, Any] = {}

    def runner_output(req_ids: list[str], sampled: list[list[int]], kvo: Any = None) -> Any:
        """A model runner's output for the step: the requests' sampled tokens (none for
        another rank than the output one) and the rank's connector output."""
        return outputs_mod.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kvo,
        )

    def intake(rid: str, prompt: list[int], out_len: int) -> Any:
        """A new request as the engine core takes it in."""
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
        sp.update_from_generation_config({}, None)
        req = VRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
        )
        engine.add_request(req)
        return req

    tier_manager: Any = None
    if sc.tier_wait and sc.tiering and connector == "vllm":
        tier_manager = conn.connector_scheduler.manager
    gc.collect()
    gc.freeze()
    with GCRecorder(timer) if sc.gc_stats else contextlib.nullcontext() as recorder:
        t0 = time.perf_counter()
        step = 0
        while True:
            if step >= sc.steps and not (engine.has_requests()):
                break
            if step > 10 * sc.steps + 1000:
                raise RuntimeError(f"vLLM engine with {connector} connector did not drain")
            due = sc.reset_at is not None and step >= sc.reset_at and "resets" not in c
            # with reset_with_loads: only once the last step sent a load (still in flight)
            if due and conn is not None and (not sc.reset_with_loads or last_loads[0]):
                c["resets"] = 1
                c["loads_in_flight_at_reset"] = last_loads[0]
                if engine.reset_connector_cache() is False:  # the connector's reset failed
                    c["resets_failed"] = 1
            if step < sc.steps:
                while len(live) < sc.concurrency:
                    rid, prompt, out_len = wl.new()  # (the client's part: not timed)
                    live[rid] = timer.engine_part(intake, rid, prompt, out_len)
            so = timer.engine_part(engine.schedule)
            if so.preempted_req_ids:
                c["preempted"] = c.get("preempted", 0) + len(so.preempted_req_ids)
            meta = so.kv_connector_metadata
            ids = list(so.num_scheduled_tokens)
            sampled: list[list[int]] = []  # a token for each request whose prefill is done
            for rid in ids:
                r = engine.requests[rid]
                done = r.num_computed_tokens >= r.num_tokens
                sampled.append([token_rng.randrange(3, 50000)] if done else [])
            outs: list[Any] = []
            for rank, w in enumerate(workers):
                wmeta = meta
                if connector == "vllm":
                    wmeta = type(meta)(
                        load_jobs=dict(meta.load_jobs),
                        store_jobs=dict(meta.store_jobs),
                        jobs_to_flush=set(meta.jobs_to_flush) if meta.jobs_to_flush else None,
                    )
                w.handle_preemptions(wmeta)
                w.bind_connector_metadata(wmeta)
                w.start_load_kv(None)
                w.wait_for_save()
                tr = w.get_transfer_results(so.finished_req_ids)
                kvo = outputs_mod.KVConnectorOutput(
                    finished_sending=tr.finished_sending or None,
                    finished_recving=tr.finished_recving or None,
                    failed_recving=tr.failed_recving,
                    invalid_block_ids=w.get_block_ids_with_load_errors(),
                    kv_connector_worker_meta=w.build_connector_worker_meta(),
                )
                w.clear_connector_metadata()
                # rank 0 carries the sampled tokens, as the output rank of vLLM's executor
                outs.append(
                    runner_output(ids, sampled, kvo) if rank == 0 else runner_output([], [], kvo)
                )
            # without a connector, the model runner's output alone
            if conn is None:
                report = runner_output(ids, sampled)
            else:
                report = aggregator.aggregate(outs, output_rank=0)
            timer.engine_part(engine.update_from_output, so, report)
            engine_ns.append(timer.take_engine_ns())
            for rid in [r for r, q in live.items() if q.is_finished()]:
                q = live.pop(rid)
                res.outputs[rid] = int(q.num_output_tokens)
                if q.status.name == "FINISHED_ERROR":
                    res.errors.append(rid)
                wl.finished(list(q.all_token_ids))
            timer.end_step(int(so.total_num_scheduled_tokens))
            # The model's forward pass: a real engine's thread waits on the device there with
            # the GIL released, which is when the tiers' I/O threads (vLLM's file tier, its
            # lookup thread) run. The simulated runner takes no time, so it yields the GIL
            # once a step instead; without it those threads starve and vLLM's tiering manager
            # never drains (its cascades to the file tier stay in flight). Untimed. With
            # tier_wait, it lasts until the tiers' I/O is done instead.
            if tier_manager is not None:
                _wait_for_tiers(tier_manager)
            else:
                time.sleep(0)
            if probe is not None and probe(
                step, timer, res, int(getattr(delayed[0], "submitted", 0)) if delayed else 0
            ):
                break
            step += 1
            clock[0] += 1
    res.wall_s = time.perf_counter() - t0
    gc.unfreeze()
    res.summary = summarize(timer.steps, sc.warmup_steps, sc.steps)
    if recorder is not None:
        res.gc = gc_summary(recorder.collections, timer.steps, sc.warmup_steps, sc.steps)
    res.engine_step = engine_step_summary(
        engine_ns,
        timer.steps,
        sc.warmup_steps,
        sc.steps,
        recorder.collections if recorder is not None else None,
    )
    res.counters["requests"] = wl.next_id
    pending = sum(e.pending() for e in delayed)
    if conn is None:
        res.leftovers = {}
    elif connector == "vllm":
        cs = conn.connector_scheduler
        res.leftovers = {
            "requests": len(cs._req_status),
            "jobs": len(cs._jobs),
            "fences": len(cs._block_id_to_pending_jobs),
            "reset_fence": len(cs._reset_fence),
            "backend_pending": pending,
        }
    else:
        s = conn.scheduler
        cpu = getattr(s.manager, "primary", s.manager)
        res.leftovers = {
            "requests": len(s.requests),
            "jobs": len(s.jobs),
            "stalled": len(s.stalled_jobs),
            "fences": len(s.fence_index),
            "backend_pending": pending,
        }
        if hasattr(cpu, "counters"):  # (statecore's CPU tier; not an out-of-tree manager)
            res.leftovers["pinned"] = int(cpu.counters().pinned)
            res.leftovers["write_pending"] = int(cpu.counters().write_pending)
    res.leftovers["engine_requests"] = len(engine.requests)
    if tier_dir is not None:
        if conn is not None:
            conn.shutdown()
        tier_dir.cleanup()
    return res


def _event_tuple(ev: Any) -> tuple[Any, ...]:
    """A KV event as a comparable tuple: kind, hashes, parent, tokens, block size, medium,
    group."""
    if type(ev).__name__ == "BlockStored":
        return (
            "stored",
            tuple(ev.block_hashes),
            ev.parent_block_hash,
            tuple(ev.token_ids),
            ev.block_size,
            ev.medium,
            ev.group_idx,
        )
    return ("removed", tuple(ev.block_hashes), ev.medium, ev.group_idx)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _row(label: str, s: dict[str, dict[str, float]]) -> str:
    t = s.get("sum of 4 hooks", {"median_us": 0.0, "p99_us": 0.0, "max_us": 0.0})
    return f"{label:<34} {t['median_us']:>10.1f} {t['p99_us']:>10.1f} {t['max_us']:>10.1f}"


def _header() -> str:
    return f"{'connector cost per engine step (µs)':<34} {'median':>10} {'p99':>10} {'max':>10}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore bench scheduler``."""
    from statecore.cli import command_parser, int_range, output_file

    p = command_parser("statecore bench scheduler", (__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--concurrency",
        type=int_range(1),
        action="append",
        help="concurrent requests N (repeatable; default 64, 256 and 1024)",
    )
    p.add_argument("--steps", type=int_range(1), default=400, help="engine steps per run")
    p.add_argument("--workers", type=int_range(1, 64), default=1, help="worker ranks")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--engine",
        choices=["auto", "standalone", "vllm", "both"],
        default="auto",
        help="auto: standalone, plus vLLM when importable",
    )
    p.add_argument(
        "--vllm-concurrency",
        type=int_range(1),
        action="append",
        help="N for the vLLM engine runs (default 64 and 256)",
    )
    p.add_argument(
        "--reset-at",
        type=int_range(0),
        metavar="STEP",
        help="reset the connector cache at this engine step",
    )
    p.add_argument(
        "--reset-with-loads",
        action="store_true",
        help="with --reset-at: reset at the first step from STEP on with a load in flight",
    )
    p.add_argument(
        "--gpu-cache-factor",
        type=float,
        default=1.1,
        help="GPU cache size as a multiple of what N average requests need (default 1.1; "
        "below 1: CPU hits, preemption)",
    )
    p.add_argument(
        "--cpu-cache-factor",
        type=float,
        default=4.0,
        help="CPU tier size as a multiple of the GPU blocks (default 4; small: the tier fills "
        "and evicts early, e.g. for a soak's steady state)",
    )
    p.add_argument(
        "--policy",
        choices=["lru", "arc", "request-lru", "request-arc"],
        default="lru",
        help="the standalone CPU tier's eviction policy (request-lru, request-arc: vLLM 0.33's "
        "request-aware semantics, the vLLM adapter's default) (default: lru)",
    )
    p.add_argument(
        "--clock",
        choices=["perf", "thread"],
        default="perf",
        help="hook timer: wall clock (perf) or this thread's CPU time (thread: ratios hold on "
        "a loaded machine)",
    )
    p.add_argument(
        "--active",
        type=int_range(1),
        metavar="K",
        help="change-proportional mode (standalone): at most K requests scheduled per step, "
        "the others in flight and idle; each N is printed next to an uncapped N=K run",
    )
    p.add_argument(
        "--soak",
        action="store_true",
        help="soak (standalone): N concurrent requests (default 10000) until --soak-jobs jobs "
        "or --soak-seconds; prints the memory and per-step cost curve",
    )
    p.add_argument("--soak-jobs", type=int_range(1), default=10**6, help="soak: job target")
    p.add_argument("--soak-seconds", type=float, default=60.0, help="soak: time bound (default 60)")
    p.add_argument("--soak-samples", type=int_range(1), default=20, help="soak: curve points")
    p.add_argument(
        "--tracemalloc", action="store_true", help="soak: also trace Python allocations (slow)"
    )
    p.add_argument(
        "--validation-share",
        type=int_range(1),
        nargs="?",
        const=1,
        metavar="R",
        help="the validation layer's share of the per-step cost, measured in one process "
        "(statecore.bench.validation_share: lockstep A/B, checks stubbed in B; R pairs per N, "
        "steps pooled); standalone engine, or vLLM's with --engine vllm",
    )
    p.add_argument(
        "--validation-control",
        action="store_true",
        help="with --validation-share: an A/A control run (B switches in the original checks, "
        "nothing is stubbed): the method's own bias, expected near 0",
    )
    p.add_argument(
        "--gc-stats",
        action="store_true",
        help="after each row: the cyclic GC's collections during the timed steps per generation "
        "(how many started inside a hook, their pauses) and the per-step cost without the "
        "in-hook pauses; the collector runs as it would without this option",
    )
    p.add_argument(
        "--json", metavar="FILE", type=output_file, help="write every run's summary here"
    )
    a = p.parse_args(list(argv) if argv is not None else None)
    if a.gpu_cache_factor <= 0 or a.cpu_cache_factor <= 0:
        p.error("--gpu-cache-factor and --cpu-cache-factor must be > 0")
    shape = {
        "reset_at": a.reset_at,
        "reset_with_loads": a.reset_with_loads,
        "gpu_cache_factor": a.gpu_cache_factor,
        "cpu_cache_factor": a.cpu_cache_factor,
        "clock": a.clock,
        "policy": a.policy,
    }
    if a.soak:
        return _soak_main(a, shape)
    ns = a.concurrency or [64, 256, 1024]
    if a.validation_share:
        from statecore.bench.validation_share import main_share

        engine = "vllm" if a.engine == "vllm" else "standalone"
        return main_share(a, shape, a.vllm_concurrency or ns if engine == "vllm" else ns, engine)
    if a.active:
        return _active_main(a, shape, ns)
    vns = a.vllm_concurrency or [n for n in ns if n <= 256] or ns
    use_vllm = a.engine in ("vllm", "both") or (a.engine == "auto" and have_vllm())
    use_standalone = a.engine in ("standalone", "both", "auto")
    runs: list[RunResult] = []
    if use_standalone:
        print("standalone engine loop, statecore connector")
        print(_header())
        for n in ns:
            sc = Scenario(
                concurrency=n,
                steps=a.steps,
                num_workers=a.workers,
                seed=a.seed,
                **shape,
                gc_stats=a.gc_stats,
            )
            r = run_standalone(sc)
            runs.append(r)
            print(_row(f"N={n}", r.summary))
            if r.gc:
                print(gc_line(r.gc))
        if runs:
            print(f"memory per in-flight job: {runs[0].bytes_per_job:.0f} B (target <= 1024)")
    if use_vllm:
        print(
            f"\nvLLM {_m('vllm').__version__} engine Scheduler, same scenario, both connectors "
            "(and the engine's whole step: new requests' intake, schedule, update_from_output, "
            "hooks included; also without a connector)"
        )
        print(_header() + f" {'ratio':>7}")
        for n in vns:
            sc = Scenario(
                concurrency=n,
                steps=a.steps,
                num_workers=a.workers,
                seed=a.seed,
                **shape,
                gc_stats=a.gc_stats,
            )
            rn = run_vllm(sc, "none")
            rv = run_vllm(sc, "vllm")
            rs = run_vllm(sc, "statecore")
            runs += [rn, rv, rs]
            print(_row(f"N={n} vLLM OffloadingConnector", rv.summary))
            if rv.gc:
                print(gc_line(rv.gc))
            ratio = rs.summary["sum of 4 hooks"]["median_us"] / max(
                rv.summary["sum of 4 hooks"]["median_us"], 1e-9
            )
            print(_row(f"N={n} statecore", rs.summary) + f" {ratio:>7.2f}")
            if rs.gc:
                print(gc_line(rs.gc))
            for label, r in (("no connector", rn), ("vLLM's", rv), ("statecore", rs)):
                print(engine_step_line(label, r.engine_step))
            if rn.gc:  # where the collector ran without a connector, and how long
                print(gc_line(rn.gc, hooks=False, label="gc without a connector"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.as_json() for r in runs], f, indent=1)
    return 0


def _active_main(a: Any, shape: dict[str, Any], ns: list[int]) -> int:
    k = a.active
    print(f"change-proportional mode: at most {k} requests scheduled per step")
    print(_header() + f" {'ratio':>7}")
    base = Scenario(concurrency=k, steps=a.steps, num_workers=a.workers, seed=a.seed, **shape)
    ref = run_standalone(base)
    ref_med = max(ref.summary["sum of 4 hooks"]["median_us"], 1e-9)
    print(_row(f"N={k} (reference, no cap)", ref.summary) + f" {1.0:>7.2f}")
    runs = [ref]
    for n in ns:
        sc = Scenario(
            concurrency=n,
            steps=a.steps,
            num_workers=a.workers,
            seed=a.seed,
            active=k,
            warmup_steps=max(20, 2 * n // k),
            **shape,
        )
        r = run_standalone(sc)
        runs.append(r)
        ratio = r.summary.get("sum of 4 hooks", {"median_us": 0.0})["median_us"] / ref_med
        print(_row(f"N={n}, {k} active", r.summary) + f" {ratio:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.as_json() for r in runs], f, indent=1)
    return 0


def _soak_main(a: Any, shape: dict[str, Any]) -> int:
    n = (a.concurrency or [10_000])[0]
    sc = Scenario(
        concurrency=n, steps=10**9, num_workers=a.workers, seed=a.seed, bulk=True, **shape
    )
    print(f"soak: N={n}, until {a.soak_jobs} jobs or {a.soak_seconds:g} s (standalone, bulk)")
    curve = run_soak(sc, a.soak_seconds, a.soak_jobs, a.soak_samples, a.tracemalloc)
    cols = (
        "elapsed_s step jobs rss_mib traced_mib requests in_flight median_us p99_us cpu_fill "
        "index_mib"
    )
    print("".join(f"{c:>11}" for c in cols.split()))
    for p in curve:
        vals: tuple[float | int, ...] = (p.elapsed_s, p.step, p.jobs, p.rss_mib, p.traced_mib)
        vals += (p.tracked_requests, p.tracked_jobs, p.median_us, p.p99_us, p.cpu_fill)
        vals += (p.index_mib,)
        print("".join(f"{v:>11.2f}" if isinstance(v, float) else f"{v:>11}" for v in vals))
    first, why = soak_warm(curve)
    if first < len(curve) - 1:  # after warm-up: to the last point
        w, z = curve[first], curve[-1]
        # cost growth: the samples' medians, later half over earlier half (one window's median
        # moves by 10 % from sample to sample on a shared machine)
        post = [p.median_us for p in curve[first:]]
        half = len(post) // 2
        growth = statistics.median(post[half:]) / max(statistics.median(post[:half]), 1e-9)
        print(
            f"after warm-up ({why}; t={w.elapsed_s:.0f}s..{z.elapsed_s:.0f}s): RSS "
            f"{z.rss_mib - w.rss_mib:+.1f} MiB, median per-step cost x{growth:.2f} "
            "(later samples over earlier ones)"
        )
    else:
        print("no samples after warm-up: run longer (--soak-seconds, --soak-jobs)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(p) for p in curve], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
