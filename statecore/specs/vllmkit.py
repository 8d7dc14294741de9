"""vLLM's own managers under the conformance kit: manager x profile x seeds, violations.

Runs the kit at its default budget against every vLLM 0.33 manager configuration
(:mod:`statecore.adapters.vllm_manager`: LRU, ARC, LRU with an admission threshold, tiering
without and with the in-memory example tier) under each contract profile, once per seed, and
prints a markdown table: how many seeds found a violation, what was reported, and how often the
runs reached pins, evictions, failed stores and resets. Needs vLLM (the scheduler venv)::

    python -m statecore.specs.vllmkit --seeds 20
    python -m statecore.specs.vllmkit --seeds 3 --only cpu_lru --profile vllm
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from hypothesis import Phase

from .conformance import (
    DEFAULT_EXAMPLES,
    DEFAULT_STEPS,
    MISUSE_ERRORS,
    ConformanceError,
    make_manager_conformance,
    run_conformance,
)

__all__ = ["CONFIGS", "main", "run_one"]

CAPACITY = 4

CONFIGS: dict[str, dict[str, Any]] = {
    "cpu_lru": {"exact": True},
    "cpu_arc": {"exact": True},
    "cpu_lru_threshold": {"exact": True, "admission": True},
    "tiering": {"exact": False},
    "tiering_example": {"exact": False},
}
"""Factory name in :mod:`statecore.adapters.vllm_manager` -> what the kit is told about it."""

_SHOWN = {
    "pins": ("double-pin", "store-while-pinned"),
    "evictions": ("evict",),
    "failed stores": ("store-failed",),
    "resets": ("reset-with-ready", "reset-with-pending", "reset-with-pinned"),
}


def run_one(
    name: str, profile: str, seed: int, examples: int = DEFAULT_EXAMPLES
) -> tuple[str, Counter[str], float]:
    """One run: (the invariant reported or ``""``, the situations reached, seconds)."""
    from statecore.adapters import vllm_manager

    make = getattr(vllm_manager, name)
    errors = None
    if profile == "statecore+assert":  # statecore's rules, misuse declared as vLLM raises it
        profile, errors = "statecore", dict.fromkeys(MISUSE_ERRORS, AssertionError)
    machine = make_manager_conformance(
        lambda: make(CAPACITY),
        CAPACITY,
        profile=profile,
        errors=errors,
        repro_factory=f"statecore.adapters.vllm_manager:{name}({CAPACITY})",
        minimise_seconds=0.5,
        **CONFIGS[name],
    )
    t0 = time.monotonic()
    found = ""
    try:
        run_conformance(
            machine, examples=examples, steps=DEFAULT_STEPS, seed=seed, phases=[Phase.generate]
        )
    except ConformanceError as exc:
        found = exc.invariant
    except Exception as exc:  # a Hypothesis error is a finding too, but say so
        found = type(exc).__name__
    return found, Counter(machine.coverage), time.monotonic() - t0  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m statecore.specs.vllmkit``: print the table; 1 if the vllm profile fails."""
    p = argparse.ArgumentParser(prog="python -m statecore.specs.vllmkit", description=__doc__)
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 per cell")
    p.add_argument("--only", action="append", default=[], help="a configuration's name")
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        help="vllm | statecore | statecore+assert (statecore's rules, misuse raising "
        "AssertionError); default: all three",
    )
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="cases per run")
    args = p.parse_args(argv)
    profiles = args.profile or ["vllm", "statecore", "statecore+assert"]
    print(
        "| vLLM manager | profile | seeds with a violation | reported as | "
        + " | ".join(f"runs reaching {k}" for k in _SHOWN)
        + " | median run s |"
    )
    print("| --- | --- | --- | --- |" + " --- |" * (len(_SHOWN) + 1))
    bad = False
    for name in CONFIGS:
        if args.only and name not in args.only:
            continue
        for profile in profiles:
            outcomes = []
            for seed in range(args.seeds):
                outcomes.append(run_one(name, profile, seed, args.examples))
                found_now, _, took = outcomes[-1]
                print(
                    f"{name} {profile} seed {seed}: {found_now or 'no violation'} ({took:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            found = [o[0] for o in outcomes if o[0]]
            reach = [
                sum(1 for _, cov, _ in outcomes if any(cov[s] for s in sits))
                for sits in _SHOWN.values()
            ]
            secs = sorted(o[2] for o in outcomes)[len(outcomes) // 2]
            kinds = ", ".join(f"{k} ({n})" for k, n in sorted(Counter(found).items())) or "-"
            n = len(outcomes)
            print(
                f"| {name} | {profile} | {len(found)}/{n} | {kinds} | "
                + " | ".join(f"{r}/{n}" for r in reach)
                + f" | {secs:.1f} |",
                flush=True,
            )
            bad |= profile == "vllm" and bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
