"""``statecore fuzz --manager package.module:Factory``: the conformance kit on any manager.

:func:`resolve_manager` turns an import path into a factory of fresh managers;
:func:`run_kit` runs the conformance kit (:mod:`statecore.specs.conformance`) against it at a
budget and prints the result, the reproduction of a finding and the coverage report.

``Factory`` is any callable (a class, a function) that takes the capacity in keys as its only
argument and returns an :class:`~statecore.manager.OffloadingManager`, or a vLLM manager
(``vllm.v1.kv_offload``): a vLLM ``OffloadingManager`` is wrapped by
:class:`statecore.adapters.vllm_manager.VllmManagerAdapter`, and a vLLM ``SecondaryTierManager``
class is put under vLLM's tiering manager (:func:`statecore.adapters.vllm_manager.adapt`).
A vLLM manager is checked against the ``vllm`` profile unless ``profile`` says otherwise.
"""

from __future__ import annotations

import builtins
import importlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis.errors import HypothesisException

from statecore.manager import OffloadingManager

from .conformance import (
    DEFAULT_SHRINK_SECONDS,
    MISUSE_ERRORS,
    PROFILES,
    ConformanceError,
    coverage_report,
    make_manager_conformance,
    run_conformance,
)

__all__ = ["is_import_path", "parse_misuse_errors", "resolve_manager", "run_kit"]


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


def _exception_type(name: str) -> type[BaseException] | None:
    if name.lower() == "none":
        return None
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj: Any = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--misuse-error: cannot resolve {name!r}: {exc}") from exc
    else:
        obj = getattr(builtins, name, None)
        if obj is None:
            import statecore.errors as errors_module

            obj = getattr(errors_module, name, None)
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise ValueError(f"--misuse-error: {name!r} is not an exception class")
    return obj


def parse_misuse_errors(
    specs: Sequence[str],
) -> dict[str, type[BaseException] | None]:
    """``--misuse-error`` values as the kit's ``errors=``: ``KIND=Error`` for one misuse kind,
    ``Error`` for every kind; ``Error`` is a builtin (``AssertionError``), a
    ``statecore.errors`` name or ``module:Name``, and ``none`` declares the misuse undetected
    (the kit then does not exercise it). ``ValueError`` on a bad value."""
    out: dict[str, type[BaseException] | None] = {}
    for spec in specs:
        kind, sep, name = spec.partition("=")
        if not sep:
            kind, name = "", spec
        if kind and kind not in MISUSE_ERRORS:
            known = ", ".join(MISUSE_ERRORS)
            raise ValueError(f"--misuse-error {spec!r}: unknown kind {kind!r} (one of {known})")
        exc = _exception_type(name)
        for k in [kind] if kind else list(MISUSE_ERRORS):
            out[k] = exc
    return out


_ADAPTER = "statecore.adapters.vllm_manager"


def _vllm_adapter(obj: object) -> Any:
    """:mod:`statecore.adapters.vllm_manager` when ``obj`` comes from vLLM (or the adapter) and
    vLLM imports; ``None`` otherwise (a statecore manager never imports vLLM, torch or numpy)."""
    module = str(getattr(obj, "__module__", "") or "")
    if module.split(".", 1)[0] != "vllm" and not module.startswith(_ADAPTER):
        return None
    try:
        return importlib.import_module(_ADAPTER)
    except ImportError:
        return None


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
    profile: str | None = None,
    errors: Mapping[str, type[BaseException] | None] | None = None,
) -> int:
    """Run the conformance kit against ``spec``; 0 when it passes, 1 on a finding, 2 on misuse.

    ``profile``: the contract (:data:`~statecore.specs.conformance.PROFILES`); ``None`` picks
    ``vllm`` for a vLLM manager and ``statecore`` otherwise. ``errors``: the misuse errors the
    manager declares (:func:`parse_misuse_errors`).
    """
    stream = out or sys.stdout
    try:
        resolved = resolve_manager(spec)
    except ValueError as exc:
        print(f"statecore fuzz: {exc}", file=sys.stderr)
        return 2
    if profile is not None and profile not in PROFILES:
        print(f"statecore fuzz: --profile {profile!r}: expected one of {', '.join(PROFILES)}")
        return 2
    make = resolved
    vllm_target = False
    adapter = _vllm_adapter(resolved)
    if adapter is not None and adapter.is_vllm_manager(resolved):
        vllm_target = True
        make = lambda n: adapter.adapt(resolved, n)  # noqa: E731
    sample: object = make(capacity)
    if not isinstance(sample, OffloadingManager):
        adapter = _vllm_adapter(type(sample))
        if adapter is not None and adapter.is_vllm_manager(sample):
            vllm_target = True
            make = lambda n: adapter.adapt(resolved(n), n)  # noqa: E731
            sample.shutdown()  # type: ignore[attr-defined]
            sample = make(capacity)
    if type(sample).__module__ == _ADAPTER:  # a factory of statecore.adapters.vllm_manager
        vllm_target = True
    if profile is None:
        profile = "vllm" if vllm_target else "statecore"
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
        profile=profile,
        errors=errors,
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
        f"{profile} profile, "
        f"{elapsed:.1f} s",
        file=stream,
    )
    print(coverage_report(machine), file=stream)
    if failure is not None:
        print(f"\nFAILED: {failure}", file=stream)
        return 1
    print("conformance: no violation found", file=stream)
    return 0
