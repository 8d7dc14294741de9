"""``statecore check``: explore every interleaving of one or more scopes.

Prints, per scope, the distinct states, transitions, depth reached, time and states per
second; on a violation, the shortest counterexample (numbered actions with the state diff of
each step), and writes it as a pytest file that replays it. Exits 1 when any scope has a
violation, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from statecore.check.explore import Result, explore, format_counterexample, pytest_source
from statecore.check.scopes import SCOPES
from statecore.cli import float_above, int_range, run_module

__all__ = ["MutantUnavailable", "add_arguments", "find_mutant", "main", "mutant_applied", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``statecore check``."""
    p.add_argument(
        "--scope",
        action="append",
        choices=sorted(SCOPES),
        help="scope to explore (repeatable; default: one); --list describes them",
    )
    p.add_argument("--all", action="store_true", help="explore every shipped scope")
    p.add_argument("--list", action="store_true", help="list the scopes and exit")
    p.add_argument("--depth", type=int_range(0), help="override the depth bound of the scope(s)")
    p.add_argument(
        "--mutant",
        help="apply a seeded mutant of tests/mutants/catalogue.py (MUTANTS or REDIS_MUTANTS) "
        "while exploring",
    )
    p.add_argument("--no-liveness", action="store_true", help="skip the bounded liveness check")
    p.add_argument(
        "--time-limit", type=float_above(0), help="stop each scope after this many seconds"
    )
    p.add_argument("--max-states", type=int_range(1), help="stop each scope after this many states")
    p.add_argument(
        "--out", default=".", help="folder for the pytest file that replays a counterexample"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


@contextlib.contextmanager
def mutant_applied(name: str | None) -> Iterator[None]:
    """Apply the catalogue mutant ``name`` (None: nothing) for the duration of the block.

    The catalogue lives in the checkout's ``tests/mutants``; it is looked up from the current
    directory upwards, then beside this package (:func:`find_mutant`).
    """
    if name is None:
        yield
        return
    mutant = find_mutant(name)
    with mutant.apply():
        yield


class MutantUnavailable(Exception):
    """``--mutant`` cannot be used: no source checkout, or no such mutant (a usage error)."""


def find_mutant(name: str) -> Any:
    """The catalogue's mutant ``name``; :class:`MutantUnavailable` (with the one-line reason)
    when there is no source checkout to take the catalogue from, or no such mutant."""
    here = Path.cwd().resolve()
    candidates = [d / "tests" / "mutants" for d in (here, *here.parents)]
    candidates.append(Path(__file__).resolve().parents[2] / "tests" / "mutants")
    for d in candidates:
        if (d / "catalogue.py").is_file():
            if str(d) not in sys.path:
                sys.path.insert(0, str(d))
            break
    else:
        raise MutantUnavailable(
            "--mutant needs a source checkout of statecore: the seeded mutants live in its "
            f"tests/mutants/catalogue.py, not found from {here} upwards (an installed wheel "
            "does not ship them); run from the checkout"
        )
    import catalogue  # type: ignore[import-not-found]

    mutants: dict[str, Any] = {**catalogue.MUTANTS, **getattr(catalogue, "REDIS_MUTANTS", {})}
    if name not in mutants:
        raise MutantUnavailable(f"unknown mutant {name!r}; known: {', '.join(sorted(mutants))}")
    return mutants[name]


def _figures(res: Result) -> dict[str, Any]:
    cex = res.counterexample
    return {
        "scope": res.scope.name,
        "states": res.states,
        "transitions": res.transitions,
        "depth": res.depth,
        "depth_bound": res.scope.depth,
        "seconds": round(res.seconds, 3),
        "cpu_seconds": round(res.cpu_seconds, 3),
        "states_per_second": round(res.rate),
        "states_per_cpu_second": round(res.cpu_rate),
        "complete": res.complete,
        "closed": res.exhausted,
        "new_states_per_level": res.levels,
        "violation": None if cex is None else cex.violation,
        "trace_length": None if cex is None else len(cex.trace),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore check``."""
    return run_module(__name__, argv)


def run(args: argparse.Namespace) -> int:
    """Explore the chosen scopes (see the module docstring)."""
    if args.list:
        for s in SCOPES.values():
            groups = "full" if s.sliding_window is None else "full + sliding window"
            print(
                f"{s.name:6s} {len(s.prompts)} requests, {s.workers} workers, {groups}, "
                f"{s.gpu_blocks} GPU blocks, {s.cpu_slots} CPU slots, depth {s.depth}: "
                f"{s.description}"
            )
        return 0
    names = list(SCOPES) if args.all else (args.scope or ["one"])
    if args.mutant is not None:
        try:
            find_mutant(args.mutant)
        except MutantUnavailable as exc:
            print(f"statecore check: {exc}", file=sys.stderr)
            return 2
    from statecore.progress import Progress

    failed = False
    out: list[dict[str, Any]] = []
    for name in names:
        scope = SCOPES[name]
        if args.depth is not None:
            scope = dataclasses.replace(scope, depth=args.depth)
        with (
            mutant_applied(args.mutant),
            Progress(f"statecore check ({scope.name})", unit="states") as bar,
        ):
            res = explore(
                scope,
                liveness=not args.no_liveness,
                max_states=args.max_states,
                time_limit=args.time_limit,
                progress=lambda r, bound=scope.depth: bar.update(  # type: ignore[misc]
                    r.states, f"depth {r.depth} of {bound}, {r.transitions} transitions"
                ),
            )
            text = (
                None
                if res.counterexample is None
                else format_counterexample(scope, res.counterexample)
            )
        out.append(_figures(res))
        if not args.json:
            print(res.summary())
        if res.counterexample is not None:
            failed = True
            suffix = f"_{args.mutant}" if args.mutant else ""
            path = Path(args.out) / f"test_check_{scope.name}{suffix}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(pytest_source(scope, res.counterexample, args.mutant))
            if not args.json:
                print(text)
                print(f"replay: pytest {os.path.relpath(path)}")
            out[-1]["test_file"] = str(path)
    if args.json:
        print(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
