"""``statecore fuzz --seconds N``: a time-boxed whole-stack fuzzing campaign.

Hypothesis generates *programs*: byte strings, two bytes per operation, decoded into the
operations of :class:`~statecore.specs.stack.StackHarness` (engine events, worker reports and
every fault). One draw per program keeps the generator's cost far below the stack's, so the
campaign runs thousands of operations per second; Hypothesis still shrinks a failing program
(deleting and simplifying operations) to a short reproduction, printed as harness calls.
Every operation is followed by every invariant check and the data oracle; every program ends
with a drain and a leak check.

``--mode stateful`` runs :class:`~statecore.specs.stack.StackMachine` (the
``RuleBasedStateMachine``) instead, with the same checks (slower per step: Hypothesis draws
each rule and argument separately).

``--manager package.module:Factory`` runs the manager conformance kit
(:mod:`statecore.specs.conformance`) against ``Factory(capacity)`` instead
(``--capacity``, ``--examples``, ``--steps``, ``--seed``), and prints its coverage report.

Exit status: 0 when nothing was found, 1 with the shrunk reproduction printed otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from statecore.sim.presets import GROUP_PRESETS

if TYPE_CHECKING:  # the whole-stack harness needs torch and numpy (statecore[fuzz]); the
    # conformance kit (--manager) runs without them (statecore[conformance])
    from .stack import StackHarness

__all__ = ["OPS", "campaign", "decode", "harness_factory_for", "main", "run_program"]

_Op: TypeAlias = "tuple[str, Callable[[StackHarness, int], Any]]"

_OP_TABLE: list[tuple[int, _Op]] = [
    (8, ("step", lambda h, a: h.step())),
    (9, ("deliver", lambda h, a: h.deliver(a))),
    (
        4,
        (
            "new_request",
            lambda h, a: h.new_request(
                a % 3, (a >> 2) % 15, 1 + (a >> 6) % 6, a % 97 == 0, bool(a & 2)
            ),
        ),
    ),
    (1, ("finish", lambda h, a: h.finish(a))),
    (1, ("abort", lambda h, a: h.abort(a))),
    (1, ("preempt", lambda h, a: h.preempt(a))),
    (1, ("deliver_failed", lambda h, a: h.deliver_failed(a))),
    (1, ("lose", lambda h, a: h.lose(a))),
    (1, ("deliver_late", lambda h, a: h.deliver_late(a))),
    (1, ("duplicate", lambda h, a: h.duplicate(a))),
    (1, ("stale", lambda h, a: h.stale(a))),
    (1, ("unknown", lambda h, a: h.unknown(a % 6, bool(a & 64)))),
    (1, ("advance_clock", lambda h, a: h.advance_clock())),
    (1, ("foreign", lambda h, a: h.foreign(a))),
    (1, ("over_report", lambda h, a: h.over_report(a))),
    (1, ("manager_error", lambda h, a: h.manager_error(a))),
]
OPS: list[_Op] = [op for weight, op in _OP_TABLE for _ in range(weight)]
"""Operation of each opcode (weights by repetition); a rare reset is opcode-independent."""

_RESET_EVERY = 251  # a 16-bit word with this residue (and a set top bit) resets the cache


def decode(program: bytes) -> list[tuple[str, int]]:
    """The operations a program stands for: (name, argument) pairs."""
    out: list[tuple[str, int]] = []
    for i in range(0, len(program) - 1, 2):
        word = program[i] << 8 | program[i + 1]
        if word == 0:
            continue  # padding: the shrinker zeroes the operations a failure does not need
        if word % _RESET_EVERY == 0:
            out.append(("reset_cache", 0))
            continue
        name, _ = OPS[program[i + 1] % len(OPS)]
        out.append((name, program[i]))
    return out


_BY_NAME: dict[str, Callable[[StackHarness, int], Any]] = {name: fn for name, fn in OPS}
_BY_NAME["reset_cache"] = lambda h, a: h.reset_cache()


def run_program(program: bytes, harness: StackHarness | None = None) -> int:
    """Run ``program`` on a fresh stack, checking after every operation; drain at the end.

    Returns the number of operations executed. Raises
    :class:`~statecore.errors.InvariantViolation` (or whatever the stack raised) on a finding.
    """
    if harness is None:
        from .stack import StackHarness

        harness = StackHarness()
    h = harness
    ops = decode(program)
    try:
        for name, arg in ops:
            _BY_NAME[name](h, arg)
            h.check()
    except BaseException:
        h.stack.close()
        raise
    h.drain_and_check()
    return len(ops)


def format_program(program: bytes) -> str:
    """A failing program as the harness calls it makes (a reproduction script)."""
    lines = ["h = StackHarness()"]
    for name, arg in decode(program):
        if name in ("step", "advance_clock", "reset_cache"):
            lines.append(f"h.{name}()")
        elif name == "new_request":
            a = arg
            lines.append(
                f"h.new_request(system={a % 3}, extra={(a >> 2) % 15}, out={1 + (a >> 6) % 6}, "
                f"skip={a % 97 == 0}, follow={bool(a & 2)})"
            )
        elif name == "unknown":
            lines.append(f"h.unknown(offset={arg % 6}, negative={bool(arg & 64)})")
        else:
            lines.append(f"h.{name}({arg})")
        lines.append("h.check()")
    lines.append("h.drain_and_check()")
    return "\n".join(lines)


def _settings(examples: int, seed_phases: bool) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink] if seed_phases else [Phase.generate],
    )


def harness_factory_for(manager: str = "lru", groups: str = "hybrid") -> Callable[[], StackHarness]:
    """A harness factory over :data:`~statecore.specs.stack.STACK_CONFIG` with ``manager``
    (see :func:`statecore.sim.run.parse_manager`) and the KV-group preset ``groups``."""
    from statecore.sim.engine import kv_groups
    from statecore.sim.run import parse_manager

    from .stack import STACK_CONFIG, StackHarness

    cfg = dataclasses.replace(STACK_CONFIG, manager=parse_manager(manager), groups=groups)
    kv_groups(groups, cfg.tokens_per_block)  # an unknown preset fails here, not per program
    return lambda: StackHarness(cfg)


def campaign(
    seconds: float,
    max_ops: int = 400,
    examples_per_round: int = 8,
    harness_factory: Callable[[], StackHarness] | None = None,
    out: Any = None,
    seed: int | None = None,
    shrink_seconds: float = 30.0,
    on_program: Callable[[int, int], None] | None = None,
) -> tuple[int, int, float, str | None]:
    """Fuzz for ``seconds``; returns (operations, programs, elapsed, failure report or None).

    With ``seed``, round ``i`` of the campaign runs Hypothesis with seed ``seed + i`` (a
    campaign replays from its seed as far as the time box allows); without, Hypothesis picks.
    Shrinking a failure takes at most ``shrink_seconds`` more (then the smallest failing
    program so far is reported); ``shrink_seconds=0`` reports the first failing program as
    found (the time to the first finding, as the mutant tests measure it). A failure's report
    says when it was found and how long shrinking took, separately. ``on_program(operations,
    programs)`` is called after every passing program (progress).
    """
    if harness_factory is None:
        from .stack import StackHarness

        harness_factory = StackHarness
    make_harness = harness_factory
    out = out or sys.stdout
    counted = {"ops": 0, "programs": 0}
    failing: list[bytes] = []
    deadline = time.monotonic() + seconds
    shrink_until = [float("inf")]
    found_at = [0.0]
    caught: list[BaseException] = []

    @given(st.binary(min_size=max_ops, max_size=2 * max_ops))
    def prop(program: bytes) -> None:
        if failing and time.monotonic() > shrink_until[0]:
            if program == failing[0] and caught:
                raise caught[0]  # Hypothesis replays the smallest failure: report it again
            return  # shrinking time is up: this candidate counts as passing
        try:
            counted["ops"] += run_program(program, make_harness())
            counted["programs"] += 1
        except BaseException as exc:
            if not failing:
                found_at[0] = time.monotonic()
                shrink_until[0] = found_at[0] + shrink_seconds
            failing[:] = [program]
            caught[:] = [exc]
            raise
        if on_program is not None:
            on_program(counted["ops"], counted["programs"])

    prop = _settings(examples_per_round, shrink_seconds > 0)(prop)
    t0 = time.monotonic()
    rnd = 0
    while time.monotonic() < deadline:
        run = prop if seed is None else hypothesis.seed(seed + rnd)(prop)
        rnd += 1
        try:
            run()
        except (Exception, HypothesisException) as exc:
            program = failing[0] if failing else b""
            now = time.monotonic()
            timing = (
                f"found after {found_at[0] - t0:.1f} s ({counted['programs']} programs passed "
                f"before it); shrinking took {now - found_at[0]:.1f} s"
                if failing
                else f"failed after {now - t0:.1f} s"
            )
            report = (
                f"FAILED: {type(exc).__name__}: {exc}\n{timing}\n\n"
                f"shrunk reproduction ({len(program) // 2} operations, "
                f"program={program!r}):\n\n{format_program(program)}"
            )
            return counted["ops"], counted["programs"], time.monotonic() - t0, report
    return counted["ops"], counted["programs"], time.monotonic() - t0, None


def _stateful_campaign(seconds: float, steps: int) -> tuple[int, int, float, str | None]:
    from hypothesis.stateful import run_state_machine_as_test

    from .stack import StackMachine

    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    before = StackMachine.steps_run
    rounds = 0
    while time.monotonic() < deadline:
        try:
            run_state_machine_as_test(
                StackMachine,
                settings=settings(_settings(5, True), stateful_step_count=steps),
            )
        except (Exception, HypothesisException) as exc:
            return (
                StackMachine.steps_run - before,
                rounds,
                time.monotonic() - t0,
                (
                    f"FAILED: {type(exc).__name__}: {exc}\n(the shrunk rule sequence is printed "
                    "above by Hypothesis)"
                ),
            )
        rounds += 5
    return StackMachine.steps_run - before, rounds, time.monotonic() - t0, None


def _manager_kit(args: argparse.Namespace) -> int:
    """``--manager package.module:Factory``: the conformance kit against a third-party manager."""
    from .conformance import DEFAULT_EXAMPLES, DEFAULT_SHRINK_SECONDS, DEFAULT_STEPS
    from .thirdparty import parse_misuse_errors, run_kit

    try:
        errors = parse_misuse_errors(args.misuse_error) if args.misuse_error else None
    except ValueError as exc:
        print(f"statecore fuzz: {exc}", file=sys.stderr)
        return 2
    shrink = DEFAULT_SHRINK_SECONDS if args.shrink_seconds is None else args.shrink_seconds
    return run_kit(
        args.manager,
        args.capacity,
        args.examples or DEFAULT_EXAMPLES,
        args.steps or DEFAULT_STEPS,
        args.seed,
        exact=not args.composite,
        shrink_seconds=shrink,
        admission=args.admission,
        eviction=args.eviction,
        profile=args.profile,
        errors=errors,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore fuzz``."""
    from statecore.cli import command_parser, float_above, int_range

    p = command_parser("statecore fuzz", (__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--seconds",
        metavar="S",
        type=float_above(0.0),
        default=60.0,
        help="campaign length in seconds",
    )
    p.add_argument(
        "--max-ops",
        metavar="N",
        type=int_range(1),
        default=400,
        help="operations per program at most",
    )
    p.add_argument(
        "--mode",
        choices=("program", "stateful"),
        default="program",
        help="generator: whole programs, or Hypothesis's stateful rule machine",
    )
    p.add_argument(
        "--manager",
        metavar="NAME|MODULE:FACTORY",
        default="lru",
        help="the manager in the whole-stack loop: lru | arc | tiering (LRU CPU tier over a "
        "fast, a slow and a failing file tier); or package.module:Factory to run the manager "
        "conformance kit against FACTORY(capacity)",
    )
    p.add_argument(
        "--groups",
        metavar="NAME",
        choices=tuple(GROUP_PRESETS),
        default="hybrid",
        help="KV-cache groups of the whole-stack loop: " + " | ".join(GROUP_PRESETS),
    )
    p.add_argument(
        "--capacity", metavar="N", type=int_range(0), default=4, help="--manager: capacity in keys"
    )
    p.add_argument(
        "--examples", metavar="N", type=int_range(1), default=None, help="--manager: test cases"
    )
    p.add_argument(
        "--steps", metavar="N", type=int_range(1), default=None, help="--manager: steps per case"
    )
    p.add_argument(
        "--seed", metavar="N", type=int, default=None, help="fixed Hypothesis seed (CI, replays)"
    )
    p.add_argument(
        "--shrink-seconds",
        metavar="S",
        type=float,
        default=None,
        help="--manager: shrinking time cap (default 10)",
    )
    p.add_argument(
        "--composite",
        action="store_true",
        help="--manager: may hold more than its store results say (a tiering manager)",
    )
    p.add_argument(
        "--admission",
        action="store_true",
        help="--manager: may decline offered keys or refuse a store it has room for",
    )
    p.add_argument(
        "--eviction",
        choices=("fifo", "lru"),
        default=None,
        help="--manager: declared victim order, checked on every eviction",
    )
    p.add_argument(
        "--profile",
        choices=("statecore", "vllm"),
        default=None,
        help="--manager: the contract checked (default: vllm for a vLLM manager, else statecore)",
    )
    p.add_argument(
        "--misuse-error",
        metavar="[KIND=]ERROR",
        action="append",
        default=[],
        help="--manager: the error a misuse raises (AssertionError, module:Name, or none), for "
        "one kind (load-unknown, load-pending, release-unknown, release-unpinned, "
        "release-pending) or all; repeatable",
    )
    try:
        args = p.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # usage errors and --help: their status, not an exception
        return exc.code if isinstance(exc.code, int) else 2
    if ":" in args.manager:  # package.module:Factory: the conformance kit
        return _manager_kit(args)
    try:
        factory = harness_factory_for(args.manager, args.groups)
    except ValueError as exc:
        print(f"statecore fuzz: {exc}", file=sys.stderr)
        return 2
    from statecore.progress import Progress

    with Progress("statecore fuzz", unit="programs") as bar:
        if args.mode == "program":
            ops, programs, elapsed, failure = campaign(
                args.seconds,
                args.max_ops,
                harness_factory=factory,
                seed=args.seed,
                on_program=lambda ops, n: bar.update(n, f"{ops} steps, {args.seconds:g} s box"),
            )
        else:
            ops, programs, elapsed, failure = _stateful_campaign(args.seconds, args.max_ops)
    rate = ops / elapsed if elapsed > 0 else 0.0
    print(
        f"statecore fuzz ({args.mode}, manager {args.manager}, groups {args.groups}): {ops} "
        f"whole-stack steps in {programs} runs, {elapsed:.1f} s, {rate:.0f} steps/s"
    )
    if failure is not None:
        print(failure)
        return 1
    print("no invariant violation, data error, hang or leak found")
    return 0
