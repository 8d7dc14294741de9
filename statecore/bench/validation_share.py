"""``statecore bench scheduler --validation-share``: what the validation layer costs a step.

Theory of operation. The question is how much of the connector's per-step cost (the sum of
the four per-step hooks, as :mod:`statecore.bench.scheduler` times it) is spent checking the
arguments (:mod:`statecore.validate` and the checks the views run when they are built). It is
answered by an A/B comparison inside one process, in lockstep:

* two copies of the same seeded standalone run (:func:`~statecore.bench.scheduler.run_standalone`)
  run in two threads that take turns step by step, so that machine load, frequency changes
  and other drift hit both copies alike; the copy that goes first alternates every step;
* copy **A** runs statecore as shipped; copy **B** runs with the validation layer's checks
  replaced by pass-throughs for the duration of its turns (a bench-only switch, this
  module's :func:`stubbed_validation`; there is no public way to turn validation off);
* the hooks are timed with the same per-thread clock in both copies, and the two copies take
  identical decisions (the checks never change a well-formed call's outcome; the command
  compares the two copies' counters to make sure), so step ``i`` of A and step ``i`` of B
  did the same work but for the checks: ``A_i - B_i`` is the validation cost of step ``i``;
* the views of each step (a :class:`~statecore.views.SchedulerOutput` and one
  :class:`~statecore.views.ScheduledRequest` per scheduled request) are built by the engine
  loop, outside the hooks; under vLLM the adapter builds them inside ``build_connector_meta``.
  So each copy also rebuilds its step's views at the end of the step, timed, and the
  difference between the copies is reported as the views' checks.

What B replaces: the :mod:`statecore.validate` functions the hooks and the managers call
(``request_id``, ``request_view``, ``scheduler_output``, ``worker_metadata`` (also as
:meth:`~statecore.wire.WorkerMetadata.aggregate` calls it), the key, slot,
context and flag checks), the scheduler's argument check of ``update_state_after_alloc``
(``statecore.scheduler.planning.admitted_lists``, reduced to its tuple conversion) and the
views' ``__post_init__`` checks (:class:`~statecore.views.ScheduledRequest`, the columnar
:class:`~statecore.views.ScheduledColumns` the vLLM adapter builds for running requests,
:class:`~statecore.views.SchedulerOutput`; their C accepting checks,
``statecore._viewcheck``, are called from those ``__post_init__`` and are stubbed with them).
What stays in both copies (so it is not
counted): a handful of inline ``type(x) is int`` tests in the hooks and the CPU manager's
C-speed key checks (``set(map(type, keys))``) on stores.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import statecore.bench.scheduler as bench
import statecore.scheduler.planning as planning
import statecore.validate as validate
import statecore.wire as wire
from statecore.views import ScheduledColumns, ScheduledRequest, SchedulerOutput

__all__ = ["ShareResult", "format_share", "main_share", "merge", "run_share", "stubbed_validation"]


def _request_id(request: Any, call: str) -> str:
    return request.request_id  # type: ignore[no-any-return]


def _request_view(request: Any, call: str, *args: Any, **kwargs: Any) -> str:
    return request.request_id  # type: ignore[no-any-return]


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _admitted_lists(block_ids: Any, n_groups: int, num_external_tokens: Any) -> Any:
    return tuple(tuple(ids) for ids in block_ids)


_STUBS: tuple[tuple[Any, str, Any], ...] = (
    (validate, "request_id", _request_id),
    (validate, "request_view", _request_view),
    (validate, "scheduler_output", _nothing),
    (validate, "worker_metadata", _nothing),
    # the same check, as WorkerMetadata.aggregate calls it
    (wire, "check_worker_metadata", _nothing),
    (validate, "offload_keys", _nothing),
    (validate, "offload_key", _nothing),
    (validate, "slot_list", _nothing),
    (validate, "req_context", _nothing),
    (validate, "flag", _nothing),
    (validate, "connector_metadata", _nothing),
    (validate, "id_collection", _nothing),
    (planning, "admitted_lists", _admitted_lists),
    (ScheduledRequest, "__post_init__", _nothing),
    (ScheduledColumns, "__post_init__", _nothing),
    (SchedulerOutput, "__post_init__", _nothing),
)


def _set_stubbed(on: bool, saved: list[Any], stubs: Sequence[tuple[Any, str, Any]] = ()) -> None:
    for (owner, name, stub), orig in zip(stubs or _STUBS, saved, strict=True):
        setattr(owner, name, stub if on else orig)


@contextlib.contextmanager
def stubbed_validation() -> Iterator[None]:
    """Bench only: the validation checks replaced by pass-throughs inside the block (valid
    input only; a malformed call would then corrupt state). Not thread-aware: the lockstep
    runner switches it between turns while no copy runs."""
    saved = [getattr(owner, name) for owner, name, _ in _STUBS]
    _set_stubbed(True, saved)
    try:
        yield
    finally:
        _set_stubbed(False, saved)


class _Copy:
    """One copy of the run: its thread, its turn events, its per-step records."""

    def __init__(self, sc: bench.Scenario, stubbed: bool, engine: str) -> None:
        self.sc = sc
        self.stubbed = stubbed
        self.engine = engine
        self.go = threading.Event()
        self.done = threading.Event()
        self.finished = False
        self.result: bench.RunResult | None = None
        self.error: BaseException | None = None
        self.views_ns: list[int] = []
        self.steps: list[tuple[int, dict[str, int]]] = []
        self.output: SchedulerOutput | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def step_ends(self, timer: bench.HookTimer) -> None:
        """End of an engine step (after the timer closed it): time the rebuild of the step's
        views in this copy's mode (standalone engine), then hand the turn over."""
        out, self.output = self.output, None
        ns = 0
        if out is not None:
            pc = time.thread_time_ns if self.sc.clock == "thread" else time.perf_counter_ns
            t0 = pc()
            SchedulerOutput(
                scheduled=tuple(
                    ScheduledRequest(
                        s.req_id, s.new_block_ids, s.num_scheduled_tokens, s.resumed_from_preemption
                    )
                    for s in out.scheduled
                ),
                new_req_ids=out.new_req_ids,
                finished_req_ids=out.finished_req_ids,
                preempted_req_ids=out.preempted_req_ids,
                columns=None
                if (c := out.columns) is None
                else ScheduledColumns(
                    c.req_ids, c.new_block_ids, c.num_scheduled_tokens, c.resumed_req_ids
                ),
            )
            ns = pc() - t0
        self.views_ns.append(ns)
        self.steps = timer.steps
        self.done.set()
        self.go.wait()
        self.go.clear()

    def _main(self) -> None:
        _local.copy = self
        self.go.wait()
        self.go.clear()
        try:
            if self.engine == "vllm":
                self.result = bench.run_vllm(self.sc, "statecore")
            else:  # a probe: no end-of-run memory measurement
                self.result = bench.run_standalone(self.sc, lambda *args: False)
        except BaseException as exc:  # reported by the coordinator
            self.error = exc
        self.finished = True
        self.done.set()


_local = threading.local()


def _recording_output(*args: Any, **kwargs: Any) -> SchedulerOutput:
    """Stands in for ``SchedulerOutput`` in the engine loop: builds it and hands it to the
    copy whose thread built it (outside the timed hooks)."""
    out = SchedulerOutput(*args, **kwargs)
    copy: _Copy | None = getattr(_local, "copy", None)
    if copy is not None:
        copy.output = out
    return out


@dataclass
class ShareResult:
    """Per-step figures of one lockstep pair (µs; over the same active steps)."""

    concurrency: int
    steps: int
    hooks_a: list[float]
    hooks_b: list[float]
    views_a: list[float]
    views_b: list[float]
    same_counters: bool


def _end_step(timer: bench.HookTimer, scheduled_tokens: int) -> None:
    _ORIG_END_STEP(timer, scheduled_tokens)
    copy: _Copy | None = getattr(_local, "copy", None)
    if copy is not None:
        copy.step_ends(timer)


_ORIG_END_STEP = bench.HookTimer.end_step


def run_share(
    sc: bench.Scenario, engine: str = "standalone", b_first: bool = False, control: bool = False
) -> ShareResult:
    """Run copies A (as shipped) and B (validation stubbed) of ``sc`` in lockstep, on the
    ``standalone`` engine loop or on vLLM's engine scheduler (``vllm``).

    ``b_first`` swaps the copies' roles in the process (B's thread is started first and takes
    the first turn): with identical copies (nothing stubbed) the first one measures about 1 %
    slower on the loaded development machine, so repeated pairs alternate the roles and the
    pooled figure cancels that bias.

    ``control`` makes it an A/A run: B's turns switch in the original checks instead of the
    pass-throughs (the same switching work, nothing stubbed), so its figure is the method's
    own bias, expected near 0.
    """
    a, b = _Copy(sc, False, engine), _Copy(sc, True, engine)
    first, second = (b, a) if b_first else (a, b)
    saved = [getattr(owner, name) for owner, name, _ in _STUBS]
    stubs = [(o, n, orig) for (o, n, _), orig in zip(_STUBS, saved, strict=True)] if control else []
    # the engine loop's SchedulerOutput and the timer's step end, for the run (bench only)
    patches: tuple[tuple[Any, str, Any], ...] = (
        (bench, "SchedulerOutput", _recording_output),
        (bench.HookTimer, "end_step", _end_step),
    )
    originals = [getattr(owner, name) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        for copy in (first, second):
            copy.thread.start()
        k = 0
        while not (a.finished and b.finished):
            for copy in (first, second) if k % 2 == 0 else (second, first):
                if copy.finished:
                    continue
                _set_stubbed(copy.stubbed, saved, stubs)
                copy.go.set()
                copy.done.wait()
                copy.done.clear()
                _set_stubbed(False, saved)
                if copy.error is not None:
                    raise copy.error
            k += 1
    finally:
        _set_stubbed(False, saved)
        for (owner, name, _), orig in zip(patches, originals, strict=True):
            setattr(owner, name, orig)
        for copy in (a, b):
            if not copy.finished:  # release a copy left waiting (after an error)
                copy.go.set()
    return _pair(sc, a, b)


def _pair(sc: bench.Scenario, a: _Copy, b: _Copy) -> ShareResult:
    last = min(sc.steps, len(a.steps), len(b.steps))
    keep = [
        i
        for i in range(sc.warmup_steps, last)
        if a.steps[i][0] > 0 and a.steps[i][0] == b.steps[i][0]
    ]

    def hooks(c: _Copy) -> list[float]:
        return [sum(c.steps[i][1].values()) / 1e3 for i in keep]

    def views(c: _Copy) -> list[float]:
        return [c.views_ns[i] / 1e3 for i in keep]

    ra, rb = a.result, b.result
    if ra is None or rb is None:
        raise RuntimeError("a copy of the lockstep run did not finish")
    same = ra.counters == rb.counters and ra.outputs == rb.outputs and len(a.steps) == len(b.steps)
    return ShareResult(sc.concurrency, len(keep), hooks(a), hooks(b), views(a), views(b), same)


def _p(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _figures(r: ShareResult, with_views: bool) -> dict[str, float]:
    a = r.hooks_a
    b = r.hooks_b
    if with_views:
        a = [h + v for h, v in zip(a, r.views_a, strict=True)]
        b = [h + v for h, v in zip(b, r.views_b, strict=True)]
    d = [x - y for x, y in zip(a, b, strict=True)]
    share = [x / y for x, y in zip(d, a, strict=True) if y > 0]
    med_a, p99_a, p99_b = statistics.median(a), _p(a, 99), _p(b, 99)
    return {
        "a_median": med_a,
        "b_median": statistics.median(b),
        "a_p99": p99_a,
        "b_p99": p99_b,
        "val_median": statistics.median(d),
        "val_median_pct": 100 * statistics.median(share),
        "val_p99": _p(d, 99),
        "p99_pct": 100 * (p99_a - p99_b) / p99_a if p99_a else 0.0,
    }


def merge(pairs: Sequence[ShareResult]) -> ShareResult:
    """Repeated lockstep pairs of one N as one sample (their steps pooled)."""
    first = pairs[0]
    return ShareResult(
        first.concurrency,
        sum(p.steps for p in pairs),
        [x for p in pairs for x in p.hooks_a],
        [x for p in pairs for x in p.hooks_b],
        [x for p in pairs for x in p.views_a],
        [x for p in pairs for x in p.views_b],
        all(p.same_counters for p in pairs),
    )


def format_share(groups: Sequence[Sequence[ShareResult]], engine: str = "standalone") -> str:
    """The table the command prints: one row per N, its repeated pairs pooled (the range of
    the pairs' own val. % follows when there are several)."""
    head = (
        f"{'':<7}{'steps':>6} {'A median':>9} {'B median':>9} {'val. µs':>8} {'val. %':>7}"
        f" {'A p99':>9} {'B p99':>9} {'p99 %':>6} {'val. p99':>9}  same"
    )
    if any(len(g) > 1 for g in groups):
        head += "  val. % of each pair"
    if engine == "vllm":
        tables = [(False, "vLLM's engine scheduler: the four hooks (they build the views)")]
    else:
        tables = [
            (False, "the four hooks (the standalone engine builds the views outside them)"),
            (True, "the four hooks + building the step's views (inside the hooks under vLLM)"),
        ]
    lines = []
    for with_views, title in tables:
        lines += [f"\n{title}:", head]
        for pairs in groups:
            r = merge(pairs)
            f = _figures(r, with_views)
            line = (
                f"N={r.concurrency:<5}{r.steps:>6} {f['a_median']:>9.1f} {f['b_median']:>9.1f}"
                f" {f['val_median']:>8.1f} {f['val_median_pct']:>6.1f}%"
                f" {f['a_p99']:>9.1f} {f['b_p99']:>9.1f} {f['p99_pct']:>5.1f}%"
                f" {f['val_p99']:>9.1f}  {'yes' if r.same_counters else 'NO'}"
            )
            if len(pairs) > 1:
                each = [_figures(p, with_views)["val_median_pct"] for p in pairs]
                line += "   " + " ".join(f"{x:.1f}" for x in each)
            lines.append(line)
    return "\n".join(lines)


def main_share(a: Any, shape: dict[str, Any], ns: list[int], engine: str) -> int:
    """``statecore bench scheduler --validation-share [R]``: R lockstep pairs per N."""
    repeat = a.validation_share
    control = bool(getattr(a, "validation_control", False))
    if control:
        print("A/A CONTROL: copy B switches in the original checks (nothing is stubbed).")
    print(
        f"validation share ({engine} engine): copies A (as shipped) and B (validation checks "
        "stubbed) of the same\nseeded run in lockstep, one process, turns alternating every "
        f"step; µs per step, {shape['clock']} clock; {repeat} pair(s) per N (roles swapped every"
        " other pair), steps pooled."
        "\nval. µs / val. %: median over steps of A_i - B_i and of (A_i - B_i) / A_i; p99 %: "
        "(p99 A - p99 B) / p99 A;\nval. p99: p99 over steps of A_i - B_i; same: both copies "
        "ended with the same counters and outputs."
    )
    groups = []
    for n in ns:
        sc = bench.Scenario(
            concurrency=n, steps=a.steps, num_workers=a.workers, seed=a.seed, **shape
        )
        groups.append(
            [run_share(sc, engine, b_first=i % 2 == 1, control=control) for i in range(repeat)]
        )
    print(format_share(groups, engine))
    return 0 if all(merge(g).same_counters for g in groups) else 1
