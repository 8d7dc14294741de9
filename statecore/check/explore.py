"""Breadth-first exploration of every interleaving of a scope, with counterexamples.

:func:`explore` starts from a scope's initial :class:`~statecore.check.model.World` and applies
every enabled action to every state, level by level up to the scope's depth bound. States are
snapshotted with :mod:`pickle` (a whole-world snapshot restores faster than ``copy.deepcopy``
and far faster than replaying a trace) and deduplicated by the hash of
:meth:`World.key <statecore.check.model.World.key>`. Every new state is checked (errors raised
into the engine, data errors, every ``INV-*`` predicate, the CPU manager's bookkeeping) and,
unless disabled, for bounded liveness: a fault-free continuation (every report delivered,
engine steps, clock jumps) must reach quiescence; states on a continuation that reached it are
remembered so most checks stop after one move.

Because the search is breadth-first and each state remembers the move that first reached it,
the first violation found has a shortest trace. :func:`replay` re-runs a trace from the initial
state, :func:`format_counterexample` prints it with the state diff of every step, and
:func:`pytest_source` writes a runnable pytest file that replays it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from statecore.check import snapshot
from statecore.check.model import Action, Scope, World, format_action

__all__ = [
    "Counterexample",
    "Result",
    "explore",
    "format_counterexample",
    "pytest_source",
    "replay",
]


@dataclass
class Counterexample:
    """A shortest trace to a violation.

    Attributes:
        trace: the actions from the initial state.
        violation: what is wrong in the last state (or, for liveness, what is left).
        liveness: the last state cannot reach quiescence without faults.
    """

    trace: list[Action]
    violation: str
    liveness: bool = False


@dataclass
class Result:
    """The outcome of one exploration.

    Attributes:
        scope: the scope explored.
        states: distinct states reached.
        transitions: actions applied (every enabled action of every explored state).
        depth: deepest level reached.
        seconds: wall time.
        cpu_seconds: CPU time of this process (on a shared machine, the time the explorer
            really had a core).
        complete: every state within the depth bound was explored (no violation, no limit).
        exhausted: the state space closed before the depth bound (no new state at some level).
        counterexample: the first violation found, or None.
        liveness_checks: states whose continuation was run to quiescence (not memoised).
        engine_jams: continuations that ended in a jam of the engine's own making
            (:meth:`~statecore.check.model.World.engine_jam`), with nothing of the stack left
            in flight: counted, not violations.
        engine_jam: one of them, described.
    """

    scope: Scope
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    complete: bool = False
    exhausted: bool = False
    counterexample: Counterexample | None = None
    liveness_checks: int = 0
    engine_jams: int = 0
    engine_jam: str | None = None
    levels: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Distinct states per second (wall time)."""
        return self.states / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_rate(self) -> float:
        """Distinct states per CPU second (one core)."""
        return self.states / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def summary(self) -> str:
        """One line of figures."""
        verdict = (
            "VIOLATION"
            if self.counterexample is not None
            else ("ok (state space closed)" if self.exhausted else "ok" if self.complete else "cut")
        )
        jams = (
            f"; {self.engine_jams} continuations end in an engine jam of vLLM's own making"
            if self.engine_jams
            else ""
        )
        return (
            f"scope {self.scope.name}: {verdict}; {self.states} distinct states, "
            f"{self.transitions} transitions, depth {self.depth}, {self.seconds:.2f} s "
            f"({self.cpu_seconds:.2f} s CPU), {self.rate:.0f} states/s "
            f"({self.cpu_rate:.0f} per CPU second){jams}"
        )


def _drain_action(w: World) -> Action:
    """The next move of the fault-free continuation."""
    for rank, be in enumerate(w.backends):
        for job_id in be.submitted:
            return ("ok", rank, job_id)
    if any(wk.deferred for wk in w.workers):
        return ("step",)
    s = w.sched
    if s.jobs or s.stalled_jobs:
        return ("jump",)  # only lost reports can keep them: let them stall and expire
    return ("step",)


def _drain_bound(scope: Scope) -> int:
    tokens = sum(len(p) for p in scope.prompts) + scope.max_output * len(scope.prompts)
    return 4 * (tokens + 3 * len(scope.prompts) + 8)


def continuation(
    w: World,
    good: set[int] | None = None,
    first: list[tuple[Action, int]] | None = None,
    jams: list[str] | None = None,
) -> tuple[str | None, list[Action]]:
    """Run the fault-free continuation from ``w`` (mutated); return (what is left, moves).

    ``None`` means quiescence was reached (or a state known to reach it, when ``good`` is
    given: the states passed are then added to it), or a jam of the engine's own making
    with nothing of the stack left in flight (described in ``jams``, when given). With
    ``first``, the first move and the key hash of the state it reached are appended to it
    (when it raised nothing).
    """
    path: list[int] = []
    moves: list[Action] = []
    for _ in range(_drain_bound(w.scope)):
        left = w.quiescent()
        if left is None:
            if good is not None:
                good.update(path)
            return None, moves
        jam = w.engine_jam() if moves and moves[-1] == ("step",) else None
        if jam is not None:
            if jams is not None:
                jams.append(jam)
            if good is not None:
                good.update(path)
            return None, moves
        action = _drain_action(w)
        w.apply(action)
        moves.append(action)
        if w.errors:
            return w.errors[0], moves
        if good is not None:
            k = hash(w.key())
            if first is not None and not path:
                first.append((action, k))
            if k in good:
                good.update(path)
                return None, moves
            path.append(k)
    left = w.quiescent()
    if left is None:
        if good is not None:
            good.update(path)
        return None, moves
    return f"no quiescence after {len(moves)} fault-free moves: {left}", moves


def explore(
    scope: Scope,
    *,
    liveness: bool = True,
    max_states: int | None = None,
    time_limit: float | None = None,
    progress: Callable[[Result], None] | None = None,
) -> Result:
    """Explore every interleaving of ``scope`` breadth-first (see the module docstring)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = Result(scope)
    root = World(scope)
    codec = snapshot.Snapshots(root)
    _dumps, _loads = codec.dumps, codec.loads
    k0 = hash(root.key())
    parents: dict[int, tuple[int, Action] | None] = {k0: None}
    good: set[int] = set()
    res.states = 1

    def trace_to(k: int) -> list[Action]:
        out: list[Action] = []
        link = parents[k]
        while link is not None:
            k, action = link
            out.append(action)
            link = parents[k]
        out.reverse()
        return out

    def finish(cex: Counterexample | None) -> Result:
        res.counterexample = cex
        res.seconds = time.perf_counter() - t0
        res.cpu_seconds = time.process_time() - c0
        res.complete = cex is None and not limited
        return res

    limited = False

    bad = root.violations()
    if bad:
        return finish(Counterexample([], bad[0]))
    # a safety failure met on a fault-free continuation has a trace (prefix + continuation)
    # that may not be shortest: keep it and search on until no shorter one can exist
    candidate: Counterexample | None = None

    # the first move of a state's continuation is also one of its actions: the key hash it
    # reached is kept (for the states still to be expanded) so that the expansion need not
    # restore and apply it again when that state is already known
    firsts: dict[int, tuple[Action, int]] = {}
    first: list[tuple[Action, int]] = []
    jams: list[str] = []

    def continue_from(
        trace: list[Action], w: World, k: int | None = None, expand: bool = False
    ) -> Counterexample | None:
        nonlocal candidate
        res.liveness_checks += 1
        left, moves = continuation(w, good, first if expand else None, jams)
        if jams:
            res.engine_jams += len(jams)
            if res.engine_jam is None:
                res.engine_jam = f"{jams[0]} (after {', '.join(map(str, trace + moves))})"
            jams.clear()
        if first:
            if k is not None:
                firsts[k] = first[0]
            first.clear()
        if left is None:
            if k is not None:
                good.add(k)  # it reached quiescence too
            return None
        if not w.errors:
            return Counterexample(trace, left, liveness=True)
        found = Counterexample(trace + moves, w.errors[0])
        if candidate is None or len(found.trace) < len(candidate.trace):
            candidate = found
        return None

    frontier: list[tuple[int, bytes]] = [(k0, _dumps(root))]
    if liveness:
        cex = continue_from([], _loads(frontier[0][1]))
        if cex is not None:
            return finish(cex)
    for level in range(1, scope.depth + 1):
        if candidate is not None and len(candidate.trace) <= level:
            break
        nxt: list[tuple[int, bytes]] = []
        before = res.states
        for k, blob in frontier:
            w = _loads(blob)
            fresh = True  # w is the restored state, no action applied yet
            actions = w.actions()
            known = firsts.pop(k, None)
            for action in actions:
                if known is not None and action == known[0] and known[1] in parents:
                    # the continuation applied this move already: a known state
                    res.transitions += 1
                    if progress is not None and not res.transitions & 8191:
                        progress(res)
                    continue
                if not fresh:
                    w.release()
                    w = _loads(blob)
                fresh = False
                w.apply(action)
                res.transitions += 1
                if progress is not None and not res.transitions & 8191:
                    progress(res)  # within a level too: a deep level takes minutes
                k2 = hash(w.key())
                if k2 in parents:
                    continue
                parents[k2] = (k, action)
                res.states += 1
                bad = w.violations()
                if bad:
                    res.depth = level
                    return finish(Counterexample(trace_to(k2), bad[0]))
                if level < scope.depth:  # the last level is never expanded: no snapshot
                    nxt.append((k2, _dumps(w)))
                if liveness and k2 not in good:
                    # w is consumed: it is restored afresh for the next action
                    cex = continue_from(trace_to(k2), w, k2, level < scope.depth)
                    if cex is not None:
                        res.depth = level
                        return finish(cex)
                if max_states is not None and res.states >= max_states:
                    limited = True
                if time_limit is not None and time.perf_counter() - t0 > time_limit:
                    limited = True
            w.release()
            if limited:
                break
        res.levels.append(res.states - before)
        if res.states > before:
            res.depth = level
        if progress is not None:
            progress(res)
        if limited:
            break
        if res.states == before:
            res.exhausted = True
            break
        frontier = nxt
    return finish(candidate)


def replay(scope: Scope, trace: Sequence[Action]) -> tuple[World, str | None, int]:
    """Apply ``trace`` from the initial state, checking every state on the way.

    Returns the final world, the first violation (None if none) and the number of actions
    applied when it was found. An action that is not enabled in its state is a violation of
    the replay itself (the code changed under the trace).
    """
    w = World(scope)
    bad = w.violations()
    if bad:
        return w, bad[0], 0
    for n, action in enumerate(trace, 1):
        if action not in w.actions():
            return w, f"replay: action {action!r} is not enabled at step {n}", n
        w.apply(action)
        bad = w.violations()
        if bad:
            return w, bad[0], n
    return w, None, len(trace)


def format_counterexample(scope: Scope, cex: Counterexample) -> str:
    """The trace as a numbered list of actions, each with the state diff it caused."""
    lines = [
        f"{'liveness' if cex.liveness else 'safety'} violation in scope {scope.name} "
        f"after {len(cex.trace)} actions:",
        f"  {cex.violation}",
        "",
    ]
    w = World(scope)
    before = w.describe()
    for n, action in enumerate(cex.trace, 1):
        if action not in w.actions():
            lines.append(f"{n:3d}. {format_action(action)}: NOT ENABLED (the code differs)")
            return "\n".join(lines)
        w.apply(action)
        after = w.describe()
        lines.append(f"{n:3d}. {format_action(action)}")
        for name in sorted(set(before) | set(after)):
            old, new = before.get(name), after.get(name)
            if old != new:
                lines.append(f"       {name}: {old or '-'} -> {new or '-'}")
        before = after
    if cex.liveness:
        _, moves = continuation(w)
        lines.append("     fault-free continuation from here (does not quiesce):")
        lines += [f"       {format_action(a)}" for a in moves[:40]]
    return "\n".join(lines)


def pytest_source(scope: Scope, cex: Counterexample, mutant: str | None = None) -> str:
    """A pytest module that replays ``cex``.

    Without a mutant the test asserts the trace runs clean, so it fails until the bug is
    fixed. With a mutant (a seeded bug of ``tests/mutants``) it applies the mutant and asserts
    that the replay reproduces the violation.
    """
    trace = ",\n".join(f"    {a!r}" for a in cex.trace)
    command = f"statecore check --scope {scope.name}" + (f" --mutant {mutant}" if mutant else "")
    violation = cex.violation.replace(chr(34), chr(39))
    imports = ["from statecore.check import replay"]
    if mutant:
        imports.append("from statecore.check.cli import mutant_applied")
    imports.append("from statecore.check.model import Scope")
    head = (
        f'"""Counterexample found by `{command}`.\n\nViolation: {violation}\n"""\n\n'
        + "\n".join(imports)
        + f"\n\nSCOPE = {scope!r}\n\nTRACE = [\n{trace},\n]\n"
    )
    if cex.liveness:
        body = (
            "\n\ndef test_counterexample_replays() -> None:\n"
            "    from statecore.check.explore import continuation\n\n"
            "    world, violation, _ = replay(SCOPE, TRACE)\n"
            "    assert violation is None, violation\n"
            "    left, _ = continuation(world)\n"
            "    assert left is None, left\n"
        )
        if mutant:
            body = body.replace("assert left is None, left", "assert left is not None")
            body = _with_mutant(body, mutant)
        return head + body
    if mutant:
        body = (
            "\n\ndef test_counterexample_replays() -> None:\n"
            "    _, violation, n = replay(SCOPE, TRACE)\n"
            "    assert violation is not None and n == len(TRACE), violation\n"
        )
        return head + _with_mutant(body, mutant)
    return head + (
        "\n\ndef test_counterexample_replays() -> None:\n"
        "    _, violation, _ = replay(SCOPE, TRACE)\n"
        "    assert violation is None, violation\n"
    )


def _with_mutant(body: str, mutant: str) -> str:
    lines = body.split("\n")
    indent = [ln if not ln.strip() else "    " + ln for ln in lines[3:]]
    return "\n".join([*lines[:3], f"    with mutant_applied({mutant!r}):", *indent])
