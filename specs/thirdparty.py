"""``statecore fuzz --manager package.module:Factory``: the conformance kit on any manager.

:func:`resolve_manager` turns an import path into a factory of fresh managers;
:func:`run_kit` runs the conformance kit (:mod:`statecore.specs.conformance`) against it at a
budget and prints the result, the reproduction of a finding and the coverage report.

``Factory`` is any callable (a class, a function) that takes the capacity in keys as its only
argument and returns an :class:`~statecore.manager.OffloadingManager`.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from hypothesis.errors import HypothesisException

from statecore.manager import OffloadingManager

from .conformance import (
    DEFAULT_SHRINK_SECONDS,
    ConformanceError,
    coverage_report,
    make_manager_conformance,
    run_conformance,
)

__all__ = ["is_import_path", "resolve_manager", "run_kit"]


def is_import_path(spec: str) -> bool:
    """Whether ``spec`` names a third-party factory (``package.module:Factory``)."""
    return ":" in spec


def resolve_manager(spec: str) -> Callable[[int], OffloadingManager]:
    """The factory ``spec`` (``package.module:Factory``) names; ``ValueError`` if it does not.

    The factory is called with the capacity; what it returns must be an
    :class:`~statecore.manager.OffloadingManager` (checked by :func:`run_kit`). The module is
    looked for in the current folder first, then on ``sys.path`` (as ``python -m`` does; an
    installed ``statecore`` script does not put the current folder on its path by itself).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--manager {spec!r}: expected package.module:Factory")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if getattr(exc, "name", None) == module_name.split(".")[0]:
            hint = (
                f" (looked in the current folder {here} and on sys.path: run from the folder "
                "that holds it, or add that folder to PYTHONPATH)"
            )
        raise ValueError(f"--manager {spec!r}: cannot import {module_name!r}: {exc}{hint}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--manager {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--manager {spec!r}: {attr!r} is not callable")
    return obj  # type: ignore[no-any-return]


def run_kit(
    spec: str,
    capacity: int,
    examples: int,
    steps: int,
    seed: int | None,
    exact: bool = True,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    admission: bool = False,
    eviction: str | None = None,
    out: Any = None,
) -> int:
    """Run the conformance kit against ``spec``; 0 when it passes, 1 on a finding, 2 on misuse."""
    stream = out or sys.stdout
    try:
        make = resolve_manager(spec)
    except ValueError as exc:
        print(f"statecore fuzz: {exc}", file=sys.stderr)
        return 2
    sample: object = make(capacity)
    if not isinstance(sample, OffloadingManager):
        print(
            f"statecore fuzz: {spec}({capacity}) returned {type(sample).__name__}, "
            "not an OffloadingManager",
            file=sys.stderr,
        )
        return 2
    sample.shutdown()
    module_name, _, attr = spec.partition(":")
    machine = make_manager_conformance(
        lambda: make(capacity),
        capacity,
        exact=exact,
        admission=admission,
        eviction=eviction,
        step_count=steps,
        examples=examples,
        repro_factory=f"{module_name}:{attr}({capacity})",
    )
    t0 = time.monotonic()
    failure: BaseException | None = None
    try:
        run_conformance(
            machine, examples=examples, steps=steps, seed=seed, shrink_seconds=shrink_seconds
        )
    except (ConformanceError, HypothesisException, Exception) as exc:
        failure = exc
    elapsed = time.monotonic() - t0
    print(
        f"statecore fuzz --manager {spec}: conformance kit, capacity {capacity}, "
        f"{examples} cases x {steps} steps, seed {seed if seed is not None else 'random'}, "
        f"{elapsed:.1f} s",
        file=stream,
    )
    print(coverage_report(machine), file=stream)
    if failure is not None:
        print(f"\nFAILED: {failure}", file=stream)
        return 1
    print("conformance: no violation found", file=stream)
    return 0
