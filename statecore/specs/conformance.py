"""The conformance kit: a Hypothesis state machine for any offloading manager.

:func:`make_manager_conformance` builds a ``RuleBasedStateMachine`` that drives a manager the
way a scheduler does, next to a small, obviously correct model of what the manager must hold,
and checks the whole contract of :class:`~statecore.manager.OffloadingManager`:

* **calls**: lookups, loads (one key pinned by several loads at once), stores that succeed and
  fail, touches, event draining, resets, and the request lifecycle: ``on_new_request``,
  ``on_schedule_end`` whose context carries the new and the preempted requests, and
  ``on_request_finished`` with completions of the request's loads and stores arriving after it;
* **targeted interleavings** that a uniform choice of rules reaches too rarely: a store under
  maximal pressure while keys are pinned, write-pending or offered again; a reset in the middle
  of loads and stores; a request finished with its jobs still in flight; misuse calls;
* **INV-PIN**: a key pinned by an outstanding load stays ``HIT`` and is never evicted; pins
  count (two loads of one key hold two pins); a release never goes below zero;
* **INV-EVICT**: no victim is pinned, write-pending or offered; in exact mode ``prepare_store``
  refuses exactly when the idle keys cannot make room and evicts exactly the shortfall; a
  refusal changes nothing; no key is handed a location still in use;
* **INV-NO-PARTIAL**: a failed store's key, never stored successfully, is never ``HIT`` and
  never announced in a stored event;
* **typed errors**: misuse (loading an unknown or write-pending key, releasing an unknown or
  unpinned key) raises the declared error and changes nothing (a key the failed call named
  first is not left pinned);
* **events**: checked by default as soon as the manager emits any: stored/removed events must
  replay to the set of ready keys (a diff names what is missing) and name only stored keys;
* the manager's **counters** (:class:`ConformanceCounters`) against the model, and a
  ``self_check`` hook;
* the **slot-reuse rule** (with ``slot_of``): a promotion never takes a slot a flushed GPU
  transfer may still touch;
* **bulk lookups**: ``lookup_many`` answers exactly what ``lookup`` answers key by key (with
  ``until_miss``, up to the first ``MISS``); ``has_pending_work`` and ``get_stats`` every step.

Profiles (:data:`PROFILES`). ``profile="statecore"`` (default) checks statecore's contract;
``profile="vllm"`` checks the contract vLLM's offloading scheduler relies on: the kit then makes
only the calls vLLM's scheduler makes and follows its conventions (misuse raising
``AssertionError``, resets announced by the engine, ``manager.lock``, ``on_reset_flushed``).
The guide lists every rule with its profile.

Reliability. The default budget (:data:`DEFAULT_EXAMPLES` cases of :data:`DEFAULT_STEPS`
steps) was measured against planted violations (:mod:`statecore.specs.planted`): each kind is
caught in 20 of 20 seeds. Shrinking stops after the first bug (``report_multiple_bugs=False``)
and after :data:`DEFAULT_SHRINK_SECONDS`.

Failures. A check raises :class:`ConformanceError`: the invariant, the call that broke it, and
a **reproduction as code**: a standalone pytest function that calls the manager directly with
hex keys, minimised (lines are dropped while it still fails the same way) and verified to fail
on a fresh manager.

Coverage. Every machine class counts which contract situations its runs reached
(:func:`coverage_report`), so a green run can show it exercised, for example, "evict while a key
is pinned by a load".
"""

from __future__ import annotations

import contextlib
import re
import time
import unittest
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, runtime_checkable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.control import current_build_context
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from statecore.errors import (
    KeyNotReadyError,
    PinUnderflowError,
    UnknownKeyError,
)
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from statecore.specs.invariants import replay_events_into

__all__ = [
    "CONTRACT_METHODS",
    "DEFAULT_EXAMPLES",
    "DEFAULT_SHRINK_SECONDS",
    "DEFAULT_STEPS",
    "MISUSE_ERRORS",
    "PROFILES",
    "SITUATIONS",
    "VLLM_MISUSE_ERRORS",
    "ConformanceCounters",
    "ConformanceError",
    "CountsForConformance",
    "LoadJob",
    "ManagerConformanceTests",
    "StoreJob",
    "conformance_settings",
    "coverage_report",
    "make_manager_conformance",
    "replay_events",
    "run_conformance",
    "shrink_time_cap",
]

DEFAULT_EXAMPLES = 300
"""Test cases per run at the default budget."""
DEFAULT_STEPS = 40
"""Steps (rules) per test case at the default budget."""
DEFAULT_SHRINK_SECONDS = 10.0
"""Shrinking stops after this long (the best example so far is reported)."""

MISUSE_ERRORS: Mapping[str, type[BaseException] | tuple[type[BaseException], ...]] = {
    "load-unknown": UnknownKeyError,
    "load-pending": KeyNotReadyError,
    "release-unknown": UnknownKeyError,
    "release-unpinned": PinUnderflowError,
    "release-pending": (PinUnderflowError, KeyNotReadyError),
}
"""The error each misuse must raise by default; ``errors=`` overrides (``None``: not checked)."""

VLLM_MISUSE_ERRORS: Mapping[str, type[BaseException] | tuple[type[BaseException], ...]] = {
    kind: AssertionError for kind in MISUSE_ERRORS
}
"""The ``vllm`` profile's default: vLLM's managers guard their preconditions with ``assert``."""

PROFILES: dict[str, str] = {
    "statecore": "the contract of statecore.OffloadingManager (statecore's scheduler)",
    "vllm": "the contract vLLM's offloading scheduler relies on (vllm.v1.kv_offload)",
}
"""The contracts the kit checks (name -> what it is); see the guide for every rule of each."""

SITUATIONS: dict[str, str] = {
    "store-refused": "prepare_store refused (None): not enough room",
    "evict": "prepare_store evicted keys",
    "evict-with-pinned": "evict while a key is pinned by a load",
    "evict-with-pending": "evict while a key is write-pending",
    "evict-with-offered": "evict while an offered key is present",
    "store-while-pinned": "store while a key is pinned by a load",
    "store-present-only": "prepare_store with every offered key present (nothing to write)",
    "store-failed": "complete_store(success=False)",
    "double-pin": "a key pinned by two loads at once",
    "release-one-of-two": "one of two pins released, the other still held",
    "reset-with-pending": "reset_cache with a store in flight",
    "reset-with-pinned": "reset_cache with a key pinned",
    "reset-with-ready": "reset_cache with ready keys",
    "finish-with-load": "on_request_finished with a load in flight, completed after it",
    "finish-with-store": "on_request_finished with a store in flight, completed after it",
    "step-new-requests": "on_schedule_end announcing new requests",
    "step-preempted": "on_schedule_end announcing preempted requests",
    "step-preempted-with-store": "on_schedule_end announcing a preempted request whose store is "
    "in flight",
    "touch": "touch of present keys",
    "misuse-load-unknown": "prepare_load naming an absent key (after a ready one)",
    "misuse-load-pending": "prepare_load naming a write-pending key (after a ready one)",
    "misuse-release-unknown": "complete_load of an absent key",
    "misuse-release-unpinned": "complete_load of a ready, unpinned key",
    "misuse-release-pending": "complete_load of a write-pending key",
    "load-deferred": "a load deferred: a lookup of the request answered HIT_PENDING or RETRY "
    "(vllm profile)",
    "reset-flushed": "on_reset_flushed after a reset (vllm profile)",
    "events-replayed": "events replayed against the ready keys",
    "bulk-hits-then-miss": "lookup_many over hits followed by a miss",
    "bulk-until-miss": "lookup_many(until_miss=True) cut at a miss before the last key",
    "locations-checked": "store and load locations checked (CPU slots or spec_slots=)",
}
"""Contract situations the kit reports as reached or not (name -> description)."""

_VLLM_ONLY = frozenset({"load-deferred", "reset-flushed"})

CONTRACT_METHODS: dict[str, bool] = {
    "on_new_request": True,
    "lookup": False,
    "lookup_many": True,
    "prepare_load": True,
    "complete_load": True,
    "touch": False,
    "prepare_store": True,
    "complete_store": True,
    "take_events": True,
    "on_schedule_end": True,
    "on_request_finished": True,
    "reset_cache": True,
    "has_pending_work": True,
    "get_stats": True,
    "shutdown": True,
}
"""Every method of :class:`~statecore.manager.OffloadingManager` (name -> whether
:class:`~statecore.scheduler.OffloadingScheduler` calls it); the kit calls each of them and its
coverage report lists how often."""


class ConformanceCounters(TypedDict, total=False):
    """The counters the kit compares with its model; a manager reports any subset.

    Attributes:
        keys: present keys in any state (ready + write-pending).
        write_pending: keys allocated by ``prepare_store`` and not yet completed.
        pinned: keys with at least one pin (a key pinned twice counts once).
        evictable: ready keys with no pin.
        free: free locations (exact mode: ``capacity - keys`` is not assumed; only checked
            against ``quarantined``).
        quarantined: free slots a promotion must not take yet (at most ``free``).
    """

    keys: int
    write_pending: int
    pinned: int
    evictable: int
    free: int
    quarantined: int


@runtime_checkable
class CountsForConformance(Protocol):
    """A manager that reports :class:`ConformanceCounters`; the kit then checks them by itself."""

    def conformance_counters(self) -> ConformanceCounters:
        """The counters now (any subset of the keys of :class:`ConformanceCounters`)."""
        ...


class ConformanceError(AssertionError):
    """A conformance check failed.

    Attributes:
        invariant: the rule broken (``INV-PIN``, ``INV-EVICT``, ``INV-NO-PARTIAL``,
            ``ERRORS``, ``EVENTS``, ``COUNTERS``, ``SLOT-REUSE``, ``CONTRACT``, ...).
        call: the manager call that broke it, as code.
        detail: what was wrong.
        reproduction: a standalone pytest function reproducing it.
    """

    def __init__(self, invariant: str, call: str, detail: str, reproduction: str) -> None:
        self.invariant = invariant
        self.call = call
        self.detail = detail
        self.reproduction = reproduction
        super().__init__(
            f"{invariant}: {detail}\n  broken by: {call}\n\n"
            f"reproduction (standalone pytest):\n\n{reproduction}"
        )


@dataclass(frozen=True, slots=True)
class StoreJob:
    """A non-empty ``prepare_store`` result awaiting its completion."""

    keys: tuple[OffloadKey, ...]
    req: int
    epoch: int
    ctx: ReqContext | None = None


@dataclass(frozen=True, slots=True)
class LoadJob:
    """A ``prepare_load`` awaiting its ``complete_load``."""

    keys: tuple[OffloadKey, ...]
    req: int
    epoch: int
    slots: tuple[int, ...] = ()
    """The pinned slots (CPU load specs), co-indexed with ``keys``."""
    ctx: ReqContext | None = None


def replay_events(events: Iterable[OffloadingEvent]) -> set[OffloadKey]:
    """The set of keys a sequence of stored/removed events leaves announced."""
    view: set[OffloadKey] = set()
    replay_events_into(view, events)
    return view


def _universe(n: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([i + 1]) * 8, i % 2) for i in range(n)]


# -- budget ------------------------------------------------------------------------------------


def conformance_settings(
    examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS, **kw: Any
) -> settings:
    """The kit's default settings: its budget, no deadline, one bug reported, quiet health."""
    base: dict[str, Any] = {
        "max_examples": examples,
        "stateful_step_count": steps,
        "deadline": None,
        "report_multiple_bugs": False,
        "print_blob": False,
        "suppress_health_check": list(HealthCheck),
    }
    base.update(kw)
    return settings(**base)


@contextlib.contextmanager
def shrink_time_cap(seconds: float) -> Iterator[None]:
    """Bound Hypothesis's shrinking to ``seconds`` (it keeps the best example found so far).

    Hypothesis has no public setting for this; its engine reads a module constant, which this
    sets for the duration (a no-op where the constant is gone).
    """
    try:
        from hypothesis.internal.conjecture import engine
    except ImportError:  # pragma: no cover - a Hypothesis without that module
        yield
        return
    old = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if old is None:  # pragma: no cover
        yield
        return
    from hypothesis.reporting import current_reporter, with_reporter

    outer = current_reporter()

    def report(value: object) -> None:
        text = str(value)
        if text.startswith("WARNING: Hypothesis has spent more than five minutes"):
            text = f"(conformance kit: shrinking stopped at its cap of {seconds:g} s)"
        outer(text)

    engine.MAX_SHRINKING_SECONDS = seconds  # type: ignore[assignment]
    try:
        with with_reporter(report):
            yield
    finally:
        engine.MAX_SHRINKING_SECONDS = old


def run_conformance(
    machine: type[RuleBasedStateMachine],
    *,
    examples: int = DEFAULT_EXAMPLES,
    steps: int = DEFAULT_STEPS,
    seed: int | None = None,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    **settings_kw: Any,
) -> None:
    """Run ``machine`` once at a budget; raises :class:`ConformanceError` on a finding.

    ``seed`` fixes the generation (a CI recipe: the same cases on every build); without it
    every run explores new cases.
    """
    factory: Callable[[], RuleBasedStateMachine] = machine
    if seed is not None:
        from hypothesis import seed as seed_decorator

        def factory() -> RuleBasedStateMachine:
            return machine()

        factory = seed_decorator(seed)(factory)
    kw = {"database": None, **settings_kw}
    with shrink_time_cap(shrink_seconds):
        run_state_machine_as_test(
            factory,  # type: ignore[arg-type]
            settings=conformance_settings(examples, steps, **kw),
        )


def coverage_report(machine: type[RuleBasedStateMachine]) -> str:
    """Which contract situations the runs of ``machine`` reached so far, with counts."""
    seen: Counter[str] = Counter(getattr(machine, "coverage", {}))
    profile = getattr(machine, "profile", "statecore")
    lines = [f"contract situations reached ({profile} profile):"]
    missed = []
    for name, text in SITUATIONS.items():
        if profile != "vllm" and name in _VLLM_ONLY:
            continue
        if seen[name]:
            lines.append(f"  {seen[name]:>7}  {text}")
        else:
            missed.append(f"  NOT REACHED  {text}")
    calls: Counter[str] = Counter(getattr(machine, "calls", {}))
    methods = ["contract methods called:"]
    for name, by_scheduler in CONTRACT_METHODS.items():
        who = "" if by_scheduler else "  (not called by the scheduler)"
        if calls[name]:
            methods.append(f"  {calls[name]:>7}  {name}{who}")
        else:
            methods.append(f"  NOT CALLED   {name}{who}")
    notes: Counter[str] = Counter(getattr(machine, "notes", {}))
    return "\n".join(lines + missed + methods + [f"  note: {n}" for n in sorted(notes)])


# -- reproductions -----------------------------------------------------------------------------


class _Raises:
    """``pytest.raises`` for running a reproduction in-process without pytest."""

    def __init__(self, exc: type[BaseException] | tuple[type[BaseException], ...]) -> None:
        self.exc = exc

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, value: Any, tb: Any) -> bool:
        if typ is None:
            raise AssertionError(f"{_DID_NOT_RAISE}: {_exc_src(self.exc)}")
        return issubclass(typ, self.exc)


class _PytestStub:
    raises = _Raises


def _exc_src(exc: type[BaseException] | tuple[type[BaseException], ...]) -> str:
    if isinstance(exc, tuple):
        return "(" + ", ".join(e.__name__ for e in exc) + ")"
    return exc.__name__


def _exc_names(exc: type[BaseException] | tuple[type[BaseException], ...]) -> list[type[Any]]:
    return list(exc) if isinstance(exc, tuple) else [exc]


@dataclass
class _Trace:
    """Names (``k1``, ``k2``, ...) of the keys one test case's calls use, and its error types."""

    keys: dict[OffloadKey, str] = field(default_factory=dict)
    errors: set[type[Any]] = field(default_factory=set)

    def k(self, key: OffloadKey) -> str:
        name = self.keys.get(key)
        if name is None:
            name = self.keys[key] = f"k{len(self.keys) + 1}"
        return name

    def ks(self, keys: Iterable[OffloadKey]) -> str:
        return "[" + ", ".join(self.k(key) for key in keys) + "]"

    def kset(self, keys: Iterable[OffloadKey]) -> str:
        ordered = sorted(self.k(key) for key in keys)
        return "{" + ", ".join(ordered) + "}" if ordered else "set()"


def _setup_source(factory: Callable[[], Any], source: str | None) -> tuple[list[str], str]:
    """(import lines, expression) that build the manager in a reproduction."""
    if source is not None:
        if ":" in source:  # "package.module:Expression(args)"
            module, expr = source.split(":", 1)
            name = expr.split("(", 1)[0].split(".", 1)[0]
            return [f"from {module} import {name}"], expr
        return [], source
    module = str(getattr(factory, "__module__", "") or "")
    qualname = str(getattr(factory, "__qualname__", "") or "")
    if module and qualname and "<" not in qualname and module != "__main__":
        top = qualname.split(".", 1)[0]
        return [f"from {module} import {top}"], f"{qualname}()"
    return [], "make_manager()  # your factory: a fresh manager"


class _Renamer:
    """Renumbers key names ``kN`` in order of first appearance (after minimisation)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        import re

        def sub(match: re.Match[str]) -> str:
            old = match.group(0)
            if old not in self.names:
                self.names[old] = f"k{len(self.names) + 1}"
            return self.names[old]

        return re.sub(r"\bk\d+\b", sub, text)


def _render(
    trace: _Trace,
    body: list[str],
    check: list[str],
    imports: list[str],
    expr: str,
    capacity: int,
    rename: _Renamer,
) -> str:
    body = [rename(stmt) for stmt in body]
    check = [rename(stmt) for stmt in check]
    text = "\n".join(body + check)
    by_old = {name: key for key, name in trace.keys.items()}
    used = [(new, by_old[old]) for old, new in rename.names.items() if old in by_old]
    used.sort(key=lambda item: int(item[0][1:]))
    errors = sorted({e.__name__ for e in trace.errors if e.__name__ in _names(text, True)})
    words = _names(text, True)
    head = ["import pytest", ""] if "pytest." in text else []
    manager_names = [n for n in ("LookupResult", "ReqContext", "ScheduleEndContext") if n in words]
    if manager_names:
        head.append(f"from statecore.manager import {', '.join(manager_names)}")
    statecore_errors = [e for e in errors if _is_statecore_error(e)]
    if statecore_errors:
        head.append(f"from statecore.errors import {', '.join(statecore_errors)}")
    if "replay_events" in words:
        head.append("from statecore.specs.conformance import replay_events")
    head += imports
    out = [*head, "", "", f"def test_conformance_reproduction() -> None:  # capacity {capacity}"]
    out.append(f"    m = {expr}")
    if "events" in words:
        out.append("    events = []")
    out += [f'    {name} = bytes.fromhex("{key.hex()}")' for name, key in used]
    for stmt in body + check:
        out += ["    " + ln for ln in stmt.split("\n")]
    return "\n".join(out)


def _is_statecore_error(name: str) -> bool:
    import statecore.errors as errors_module

    return hasattr(errors_module, name)


def _names(text: str, any_case: bool = False) -> set[str]:
    import re

    return set(re.findall(r"\b[A-Za-z_]\w*\b" if any_case else r"\b[a-z]\w*\b", text))


def _reproduces(
    factory: Callable[[], Any],
    namespace: dict[str, Any],
    body: list[str],
    check: list[str],
    signature: str,
) -> bool:
    """Whether ``body`` runs cleanly on a fresh manager and ``check`` then fails the same way."""
    ns = dict(namespace)
    ns["m"] = factory()
    ns["events"] = []
    try:
        try:
            exec("\n".join(body), ns)
        except Exception:
            return False
        try:
            exec("\n".join(check), ns)
        except Exception as exc:
            return _signature(exc) == signature
        return False
    finally:
        with contextlib.suppress(Exception):
            ns["m"].shutdown()


_DID_NOT_RAISE = "DID NOT RAISE"


def _signature(exc: BaseException) -> str:
    """How a failure is recognised when the reproduction is replayed (one definition for the
    failure the kit records and the one the minimiser compares): an assertion by the text
    before its first colon (the kit's checks start their message with the rule's code, a
    missing raise with ``DID NOT RAISE``), any other exception by its type."""
    if isinstance(exc, AssertionError):
        return "AssertionError:" + str(exc).split(":", 1)[0]
    return type(exc).__name__


def _minimise(
    factory: Callable[[], Any],
    namespace: dict[str, Any],
    body: list[tuple[str, bool]],
    check: list[str],
    signature: str,
    seconds: float,
) -> tuple[list[str], bool]:
    """Drop removable statements of ``body`` while the reproduction still fails the same way.

    Only statements the model's expectation does not depend on are removable (lookups, touches,
    step ends, event drains, misuse calls, request finishes): the check then still states what
    the contract requires, so a shorter program that fails it is a true reproduction.
    """
    stmts = [text for text, _ in body]
    if not _reproduces(factory, namespace, stmts, check, signature):
        return stmts, False
    deadline = time.monotonic() + seconds
    chunk = max(1, len(body) // 2)
    while chunk >= 1:
        i = len(body) - chunk
        changed = False
        while i >= 0:
            if time.monotonic() > deadline:
                return [text for text, _ in body], True
            piece = body[i : i + chunk]
            if all(removable for _, removable in piece):
                candidate = body[:i] + body[i + chunk :]
                texts = [text for text, _ in candidate]
                if _reproduces(factory, namespace, texts, check, signature):
                    body = candidate
                    changed = True
            i -= chunk
        if not changed:
            chunk //= 2
    return [text for text, _ in body], True


# -- the machine -------------------------------------------------------------------------------


@dataclass
class _Req:
    ctx: ReqContext
    name: str
    finished: bool = False


def make_manager_conformance(
    factory: Callable[[], OffloadingManager],
    capacity: int,
    *,
    exact: bool = True,
    events: bool | None = None,
    counters: Callable[[Any], Mapping[str, int]] | bool | None = None,
    self_check: Callable[[Any], None] | None = None,
    slot_of: Callable[[Any, OffloadKey], int | None] | None = None,
    spec_slots: Callable[[LoadStoreSpec], Sequence[Hashable]] | None = None,
    errors: Mapping[str, type[BaseException] | tuple[type[BaseException], ...] | None]
    | None = None,
    admission: bool = False,
    eviction: str | None = None,
    num_keys: int | None = None,
    num_requests: int = 2,
    step_count: int = DEFAULT_STEPS,
    examples: int = DEFAULT_EXAMPLES,
    repro_factory: str | None = None,
    minimise_seconds: float = 5.0,
    profile: str = "statecore",
) -> type[RuleBasedStateMachine]:
    """Build a conformance state machine for the managers ``factory`` returns.

    Args:
        factory: makes a fresh manager (called once per test case).
        capacity: how many keys the manager holds (exact mode checks it).
        exact: the manager is a plain cache: it stores every offered new key (unless
            ``admission``), evicts exactly the shortfall and only then, and holds nothing its
            results do not report. ``False`` is for composite managers that may hold more than
            their store results say (a tiering manager promotes keys back from lower tiers):
            the model then checks only what it knows for sure.
        events: ``None`` (default): events are checked as soon as the manager emits any;
            ``True``: they must be emitted and checked; ``False``: not checked. In exact mode
            stored/removed events must replay to the ready keys (evictions and resets included).
        counters: returns the manager's counters (any subset of :class:`ConformanceCounters`);
            by default a manager implementing :class:`CountsForConformance` is asked;
            ``False``: no counters are compared.
        self_check: called after every step; raises on an internal inconsistency.
        slot_of: the primary slot a present key occupies (``None`` if absent); with it the
            slot-reuse rule is checked on every key the manager writes by itself.
        spec_slots: the per-key locations of a store or load spec of the manager's own type
            (default: the slots of a ``CPULoadStoreSpec``); locations must be co-indexed with
            the keys, distinct, not in use, and a load must name the location of the store.
        errors: the error each misuse raises, overriding :data:`MISUSE_ERRORS`; ``None`` for
            a misuse the manager does not detect (it is then not exercised).
        admission: the manager may decline to store offered new keys (an admission filter)
            and may refuse a store it has room for; stores it does make are checked exactly.
        eviction: declared victim order, checked on every eviction: ``"fifo"`` (victims are
            the idle, unoffered keys allocated first) or ``"lru"`` (the least recently used
            idle, unoffered keys: a key becomes most recent when its store completes, when its
            last pin is released and when it is touched; ``touch(keys)`` leaves ``keys[0]`` the
            most recent).
        num_keys: size of the key universe (default ``2 * capacity + 2``, at least 4).
        num_requests: how many live requests the calls rotate through.
        step_count: steps per test case.
        examples: test cases per run of the machine's ``TestCase``.
        repro_factory: how the reproduction builds the manager: ``"module:Expr(args)"`` or an
            expression (default: derived from ``factory`` when it is importable).
        minimise_seconds: time spent minimising the final reproduction.
        profile: the contract checked (:data:`PROFILES`): ``"statecore"`` (default) or
            ``"vllm"``, whose calls follow vLLM's scheduler: no key offered twice in one
            ``prepare_store``, lookups only under live requests, a load only of keys whose
            lookup just answered ``HIT`` and none when a lookup of the request answered
            ``HIT_PENDING`` or ``RETRY`` (the request is deferred), misuse calls naming one bad
            key, every call but ``shutdown`` under ``manager.lock``, a reset preceded by an
            event drain and announced by itself (vLLM's ``AllBlocksCleared``) and followed by
            ``on_reset_flushed`` once the jobs in flight at the reset are flushed; misuse
            raises :data:`VLLM_MISUSE_ERRORS` unless ``errors=`` says otherwise.

    Returns:
        The machine class; its ``TestCase`` attribute is a ``unittest.TestCase`` running the
        kit's budget; ``coverage`` counts the situations reached (:func:`coverage_report`).
    """
    if eviction not in (None, "fifo", "lru"):
        raise ValueError(f"eviction={eviction!r}: expected 'fifo', 'lru' or None")
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}: expected one of {', '.join(PROFILES)}")
    vllm = profile == "vllm"
    universe = _universe(num_keys if num_keys is not None else max(4, 2 * capacity + 2))
    key_st = st.sampled_from(universe)
    misuse: dict[str, Any] = dict(VLLM_MISUSE_ERRORS if vllm else MISUSE_ERRORS)
    misuse.update(errors or {})
    imports, expr = _setup_source(factory, repro_factory)
    req_st = st.integers(0, num_requests - 1)

    def locations(spec: LoadStoreSpec) -> Sequence[Hashable] | None:
        if spec_slots is not None:
            return spec_slots(spec)
        if isinstance(spec, CPULoadStoreSpec):
            return spec.slots
        return None

    class ManagerConformance(RuleBasedStateMachine):
        stores = Bundle("stores")
        loads = Bundle("loads")
        coverage: Counter[str] = Counter()
        notes: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        profile: str = "statecore"

        def __init__(self) -> None:
            super().__init__()
            self.trace = _Trace()
            self.body: list[tuple[str, bool]] = []  # (statement, removable by the minimiser)
            self.sut = factory()
            self.epoch = 0
            self.pending: set[OffloadKey] = set()
            self.pins: Counter[OffloadKey] = Counter()
            self.ready: dict[OffloadKey, None] = {}  # exact mode: present and ready
            self.order: dict[OffloadKey, None] = {}  # allocation order of present keys
            self.recency: dict[OffloadKey, None] = {}  # idle keys, least recently used first
            self.loc: dict[OffloadKey, Hashable] = {}  # exact mode: key -> location
            self.ever_stored: set[OffloadKey] = set()
            self.failed: set[OffloadKey] = set()
            self.evicted: set[OffloadKey] = set()  # evicted by a store, not stored since
            self.dropped: set[OffloadKey] = set()  # dropped by reset_cache, not stored since
            self.event_view: set[OffloadKey] = set()
            self._ready_noted: set[OffloadKey] = set()  # readiness at the last _note_changes
            self._changed_by: dict[OffloadKey, tuple[int, str]] = {}  # key -> (body index, call)
            self.events_seen = False
            self.nreq = 0
            self.reqs: list[_Req] = []
            self.new_ids: set[str] = set()
            self.preempted_ids: set[str] = set()
            # slot-reuse rule
            self.ends = 0
            self.pending_slot: dict[OffloadKey, int] = {}
            self.load_slots: Counter[int] = Counter()
            self.quarantine: dict[int, int] = {}
            self.flush_due: int | None = None  # vllm: step end after which the flush is done
            self.counters_fn: Callable[[Any], Mapping[str, int]] | None = None
            if callable(counters):
                self.counters_fn = counters
            elif counters is None and isinstance(self.sut, CountsForConformance):
                self.counters_fn = _protocol_counters
            for _ in range(num_requests):
                self.reqs.append(self._new_req())

        # -- bookkeeping ---------------------------------------------------------------------

        def _see(self, situation: str) -> None:
            type(self).coverage[situation] += 1

        def _new_req(self) -> _Req:
            name = f"r{self.nreq}"
            ctx = ReqContext(f"req-{self.nreq}")
            self.nreq += 1
            self._note_changes()
            self.body.append((f'{name} = ReqContext("{ctx.req_id}")', False))
            self._call(f"m.on_new_request({name})", self.sut.on_new_request, ctx)
            self.new_ids.add(ctx.req_id)
            return _Req(ctx, name)

        def _live(self, i: int) -> _Req:
            """Request slot ``i``, replaced by a new request if it finished."""
            req = self.reqs[i]
            if req.finished:
                req = self.reqs[i] = self._new_req()
            return req

        def _name_of(self, ctx: ReqContext | None) -> str:
            for r in self.reqs:
                if r.ctx is ctx:
                    return r.name
            return f'ReqContext("{ctx.req_id if ctx else "?"}")'

        def _locked(self) -> contextlib.AbstractContextManager[Any]:
            """vllm profile: the manager's ``lock`` (held around every call but shutdown)."""
            if vllm:
                lock = getattr(self.sut, "lock", None)
                if lock is not None:
                    return lock  # type: ignore[no-any-return]
            return contextlib.nullcontext()

        def _call(
            self, src: str, fn: Callable[..., Any], *args: Any, removable: bool = False
        ) -> Any:
            """Call the manager, recording the call; an unexpected exception is a finding."""
            self._note_changes()
            type(self).calls[getattr(fn, "__name__", "?")] += 1
            try:
                with self._locked():
                    result = fn(*args)
            except Exception as exc:
                self.trace.errors.add(type(exc))
                code, why = "CONTRACT", "a legal call must not raise"
                if "complete_load(" in src:
                    code, why = "INV-PIN", "the keys are pinned by this outstanding load"
                elif "prepare_load(" in src:
                    code, why = "INV-PIN", "every key answered HIT: it must be pinnable"
                self._fail(
                    code,
                    src,
                    f"{src} raised {type(exc).__name__}: {exc} ({why})",
                    [src],
                    signature=_signature(exc),
                )
            self.body.append((src, removable))
            return result

        def _fail(
            self,
            code: str,
            call: str,
            detail: str,
            check: list[str],
            signature: str | None = None,
        ) -> None:
            body = list(self.body)
            if signature is None:
                signature = "AssertionError:" + code
            if check and check[-1].startswith("assert ") and signature.startswith("Assert"):
                message = f"{code}: {detail}".replace("\\", "\\\\").replace('"', '\\"')
                check = [*check[:-1], f'{check[-1]}, "{message}"']
            verified = None
            try:
                final = current_build_context().is_final
            except HypothesisException:
                final = True
            if final:
                namespace = {
                    "pytest": _PytestStub,
                    "LookupResult": LookupResult,
                    "ReqContext": ReqContext,
                    "ScheduleEndContext": ScheduleEndContext,
                    "replay_events": replay_events,
                    **{e.__name__: e for e in self.trace.errors},
                    **{name: key for key, name in self.trace.keys.items()},
                }
                keep_events = any("events" in line for line in check)
                keep_steps = code == "SLOT-REUSE"
                if not exact:  # a composite manager's lookups and steps do work: keep all
                    body = [(text, False) for text, _ in body]
                else:
                    body = [
                        (
                            text,
                            removable
                            and not (keep_events and "take_events" in text)
                            and not (keep_steps and "on_schedule_end" in text),
                        )
                        for text, removable in body
                    ]
                stmts, verified = _minimise(
                    factory, namespace, body, check, signature, minimise_seconds
                )
            else:
                stmts = [text for text, _ in body]
            rename = _Renamer()
            repro = _render(self.trace, stmts, check, imports, expr, capacity, rename)
            call, detail = rename(call), rename(detail)
            if verified is False:
                repro = (
                    "# NOTE: replaying these calls on a fresh manager did not fail the same way "
                    "(the manager is not deterministic?)\n" + repro
                )
            raise ConformanceError(code, call, detail, repro)

        def _check(self, ok: bool, code: str, call: str, detail: str, check: list[str]) -> None:
            if not ok:
                self._fail(code, call, detail, check)

        def _kd(self, key: OffloadKey) -> str:
            return f"{self.trace.k(key)} ({key.hex()})"

        # -- model ----------------------------------------------------------------------------

        def _expected(self, key: OffloadKey) -> LookupResult | None:
            if key in self.pending:
                return LookupResult.HIT_PENDING
            if self.pins[key] > 0:
                return LookupResult.HIT
            if exact:
                return LookupResult.HIT if key in self.ready else LookupResult.MISS
            if key not in self.ever_stored:
                return LookupResult.MISS
            return None  # may be anywhere in a lower tier

        def _why(self, key: OffloadKey) -> tuple[str, str]:
            if key in self.pending:
                return "INV-PIN", "its store is pending (write-pending keys answer HIT_PENDING)"
            if self.pins[key] > 0:
                return "INV-PIN", f"it is pinned by {self.pins[key]} outstanding load(s)"
            if key in self.failed and key not in self.ever_stored:
                return "INV-NO-PARTIAL", "its store failed and it was never stored successfully"
            if key in self.ready:
                return "INV-EVICT", "it is ready and was never evicted, dropped or reset"
            if key in self.dropped:
                return "RESET", "reset_cache must drop every entry"
            if key in self.evicted:
                return "INV-EVICT", "prepare_store evicted it (out.evicted_keys)"
            if key in self.failed:
                return "INV-NO-PARTIAL", "its last store failed (complete_store success=False)"
            return "MODEL", "it was never stored"

        def _lookup(
            self, key: OffloadKey, i: int | None = None, removable: bool = True
        ) -> LookupResult:
            index = i if i is not None else 0
            r = self._live(index) if vllm else self.reqs[index]  # vllm: live requests only
            ctx, name = r.ctx, r.name
            src = f"m.lookup({self.trace.k(key)}, {name})"
            type(self).calls["lookup"] += 1
            try:
                with self._locked():
                    got = self.sut.lookup(key, ctx)
            except Exception as exc:
                self.trace.errors.add(type(exc))
                self._fail("CONTRACT", src, f"{src} raised {exc!r}", [src], _signature(exc))
            if slot_of is not None and got is LookupResult.HIT_PENDING and key not in self.pending:
                slot = slot_of(self.sut, key)
                if slot is not None and slot in self.quarantine:
                    self._fail(
                        "SLOT-REUSE",
                        src,
                        f"{self._kd(key)} is written by the manager into slot {slot}, freed "
                        f"with transfers possibly in flight; safe only from step end "
                        f"{self.quarantine[slot]}, now {self.ends}",
                        [f"assert m.lookup({self.trace.k(key)}, {name}) is not None"],
                    )
            want = self._expected(key)
            if want is not None and got != want:
                code, why = self._why(key)
                self._fail(
                    code,
                    src,
                    f"lookup({self._kd(key)}) = {got.name}, expected {want.name}: {why}",
                    [f"assert m.lookup({self.trace.k(key)}, {name}) is LookupResult.{want.name}"],
                )
            if want is None and got == LookupResult.HIT and key not in self.ever_stored:
                self._fail(
                    "INV-NO-PARTIAL",
                    src,
                    f"lookup({self._kd(key)}) = HIT but it was never stored successfully",
                    [f"assert m.lookup({self.trace.k(key)}, {name}) is not LookupResult.HIT"],
                )
            self._note_changes()  # before the lookup joins the body: changes are not its own
            self.body.append((src, removable))
            return got

        def _absent(self) -> list[OffloadKey]:
            """Keys certainly absent from the manager."""
            if exact:
                return [k for k in universe if k not in self.ready and k not in self.pending]
            return [k for k in universe if k not in self.ever_stored and k not in self.pending]

        def _idle(self) -> list[OffloadKey]:
            return [k for k in self.ready if self.pins[k] == 0]

        def _quarantine(self, slots: Iterable[int]) -> None:
            for slot in slots:
                self.quarantine[slot] = self.ends + 2

        # -- stores ---------------------------------------------------------------------------

        def _store(self, keys: list[OffloadKey], i: int) -> StoreJob | None:
            req = self._live(i)
            if vllm:  # vLLM's scheduler offers each key once per prepare_store
                keys = list(dict.fromkeys(keys))
            present = set(self.ready) | self.pending
            new = [k for k in dict.fromkeys(keys) if k not in present]
            offered = set(keys)
            idle = [k for k in self._idle() if k not in offered]
            need = len(new) - (capacity - len(present))
            if any(self.pins[k] for k in self.ready):
                self._see("store-while-pinned")
            if not new:
                self._see("store-present-only")
            src = f"out = m.prepare_store({self.trace.ks(keys)}, {req.name})"
            out = self._call(src, self.sut.prepare_store, keys, req.ctx)
            if out is None:
                self._see("store-refused")
                if exact and not admission:
                    self._check(
                        bool(new) and need > len(idle),
                        "INV-EVICT",
                        src,
                        f"prepare_store refused {len(new)} new key(s) with "
                        f"{capacity - len(present)} free slot(s) and {len(idle)} evictable key(s)",
                        ["assert out is not None"],
                    )
                return None
            self._check(
                isinstance(out, PrepareStoreOutput),
                "CONTRACT",
                src,
                f"prepare_store returned {type(out).__name__}, not PrepareStoreOutput or None",
                ["assert out is None or isinstance(out, PrepareStoreOutput)"],
            )
            stored = list(out.keys_to_store)
            self._check(
                len(set(stored)) == len(stored),
                "CONTRACT",
                src,
                "keys_to_store has duplicates",
                ["assert len(set(out.keys_to_store)) == len(out.keys_to_store)"],
            )
            for k in stored:
                self._check(
                    k in offered,
                    "CONTRACT",
                    src,
                    f"keys_to_store names {self._kd(k)}, which was not offered",
                    [f"assert set(out.keys_to_store) <= set({self.trace.ks(keys)})"],
                )
                self._check(
                    k not in self.pending and self.pins[k] == 0 and not (exact and k in self.ready),
                    "INV-EVICT",
                    src,
                    f"prepare_store re-allocated {self._kd(k)}, which is present",
                    [f"assert {self.trace.k(k)} not in out.keys_to_store"],
                )
            order = [k for k in dict.fromkeys(keys) if k in set(stored)]
            self._check(
                stored == order,
                "CONTRACT",
                src,
                "keys_to_store is not in offered order",
                [f"assert list(out.keys_to_store) == {self.trace.ks(order)}"],
            )
            if exact and not admission:
                self._check(
                    stored == new,
                    "INV-EVICT",
                    src,
                    f"stored {self.trace.ks(stored)}, expected every new offered key "
                    f"{self.trace.ks(new)}",
                    [f"assert list(out.keys_to_store) == {self.trace.ks(new)}"],
                )
            victims = list(out.evicted_keys)
            if victims:
                self._see("evict")
                if any(self.pins[k] for k in self.ready):
                    self._see("evict-with-pinned")
                if self.pending:
                    self._see("evict-with-pending")
                if offered & set(self.ready):
                    self._see("evict-with-offered")
            for k in victims:
                kn = self.trace.k(k)
                self._check(
                    k not in offered,
                    "INV-EVICT",
                    src,
                    f"evicted {self._kd(k)}, one of the offered keys",
                    [f"assert {kn} not in out.evicted_keys"],
                )
                self._check(
                    self.pins[k] == 0,
                    "INV-EVICT",
                    src,
                    f"evicted {self._kd(k)}, pinned by {self.pins[k]} outstanding load(s)",
                    [f"assert {kn} not in out.evicted_keys"],
                )
                self._check(
                    k not in self.pending,
                    "INV-EVICT",
                    src,
                    f"evicted {self._kd(k)}, whose store is still pending",
                    [f"assert {kn} not in out.evicted_keys"],
                )
                if exact:
                    self._check(
                        k in self.ready,
                        "INV-EVICT",
                        src,
                        f"evicted {self._kd(k)}, which is not present",
                        [f"assert {kn} not in out.evicted_keys"],
                    )
            if exact:
                room = max(0, len(stored) - (capacity - len(present)))
                self._check(
                    len(victims) == room,
                    "INV-EVICT",
                    src,
                    f"evicted {len(victims)} key(s) to store {len(stored)} with "
                    f"{capacity - len(present)} free of {capacity}: expected exactly {room}",
                    [f"assert len(out.evicted_keys) == {room}"],
                )
                if eviction is not None and victims:
                    ranked = self.order if eviction == "fifo" else self.recency
                    expect = [k for k in ranked if k in set(idle)][: len(victims)]
                    what = "oldest" if eviction == "fifo" else "least recently used"
                    self._check(
                        victims == expect,
                        "EVICTION-ORDER",
                        src,
                        f"{eviction}: evicted {self.trace.ks(victims)}, expected the {what} "
                        f"idle {self.trace.ks(expect)}",
                        [f"assert list(out.evicted_keys) == {self.trace.ks(expect)}"],
                    )
            for k in victims:
                self.evicted.add(k)
                self.recency.pop(k, None)
                self.ready.pop(k, None)
                self.order.pop(k, None)
                self.loc.pop(k, None)
            spec = out.store_spec
            self._check(
                isinstance(spec, LoadStoreSpec),
                "CONTRACT",
                src,
                f"store_spec is {type(spec).__name__}, not a LoadStoreSpec",
                ["assert isinstance(out.store_spec, LoadStoreSpec)"],
            )
            where = locations(spec)
            if where is None:
                type(self).notes[
                    f"locations not checked: store spec type {type(spec).__name__} "
                    "(pass spec_slots=)"
                ] += 1
            else:
                self._check_locations(src, stored, list(where), victims)
            if isinstance(spec, CPULoadStoreSpec) and len(spec.slots) == len(stored):
                for k, s in zip(stored, spec.slots, strict=True):
                    self.pending_slot[k] = s
                    self.quarantine.pop(s, None)  # reused by a store the workers order
            self.pending.update(stored)
            for k in stored:
                self.order[k] = None
                self.evicted.discard(k)
                self.dropped.discard(k)
            if not stored:
                return None
            return StoreJob(tuple(stored), i, self.epoch, req.ctx)

        def _check_locations(
            self, src: str, stored: list[OffloadKey], where: list[Hashable], victims: list[Any]
        ) -> None:
            self._see("locations-checked")
            self._check(
                len(where) == len(stored),
                "CONTRACT",
                src,
                f"store spec names {len(where)} location(s) for {len(stored)} key(s)",
                [f"assert len(out.store_spec.slots) == {len(stored)}"],
            )
            self._check(
                len(set(where)) == len(where),
                "INV-EVICT",
                src,
                f"two keys share a location: {where}",
                ["assert len(set(out.store_spec.slots)) == len(out.store_spec.slots)"],
            )
            if not exact:
                return
            used = {v: k for k, v in self.loc.items()}
            for k, s in zip(stored, where, strict=True):
                if isinstance(s, int):
                    self._check(
                        0 <= s < capacity,
                        "CONTRACT",
                        src,
                        f"slot {s} of {self._kd(k)} out of range [0, {capacity})",
                        [f"assert all(0 <= s < {capacity} for s in out.store_spec.slots)"],
                    )
                owner = used.get(s)
                self._check(
                    owner is None,
                    "INV-EVICT",
                    src,
                    f"location {s!r} handed to {self._kd(k)} while "
                    f"{self._kd(owner) if owner is not None else '?'} still holds it",
                    [f"assert {s!r} not in out.store_spec.slots"],
                )
                self.loc[k] = s

        @rule(target=stores, keys=st.lists(key_st, min_size=1, max_size=4), req=req_st)
        def prepare_store(self, keys: list[OffloadKey], req: int) -> Any:
            job = self._store(keys, req)
            return multiple() if job is None else job

        @rule(target=stores, data=st.data(), req=req_st, over=st.booleans())
        def pressure_store(self, data: st.DataObject, req: int, over: bool) -> Any:
            """Offer present keys (pinned, pending, idle) with as many new keys as fit (or one
            more): every idle, unoffered key must go, and nothing else."""
            present = sorted(set(self.ready) | self.pending)
            again = data.draw(st.lists(st.sampled_from(present), max_size=3)) if present else []
            absent = [k for k in universe if k not in self.ready and k not in self.pending]
            idle = [k for k in self._idle() if k not in set(again)]
            fit = (capacity - len(present)) + len(idle) + (1 if over else 0)
            new = absent[: max(1, fit)]
            if not new:
                return multiple()
            keys = data.draw(st.permutations(again + new))
            job = self._store(list(keys), req)
            return multiple() if job is None else job

        @rule(target=stores, req=req_st)
        def fill(self, req: int) -> Any:
            """Store and complete new keys until the cache is full of ready keys."""
            present = set(self.ready) | self.pending
            room = capacity - len(present)
            new = [k for k in universe if k not in present][: max(0, room)]
            if not new:
                return multiple()
            job = self._store(new, req)
            if job is not None:
                self._complete_store(job, True)
            return multiple()

        def _complete_store(self, job: StoreJob, success: bool) -> None:
            name = self._name_of(job.ctx)
            src = f"m.complete_store({self.trace.ks(job.keys)}, {name}, success={success})"
            self._call(src, self.sut.complete_store, list(job.keys), job.ctx, success)
            freed = [self.pending_slot.pop(k) for k in job.keys if k in self.pending_slot]
            if not success:
                self._see("store-failed")
                self._quarantine(freed)
            for k in job.keys:
                self.pending.discard(k)
                if success:
                    self.ready[k] = None
                    self.recency.pop(k, None)
                    self.recency[k] = None
                    self.ever_stored.add(k)
                else:
                    self.failed.add(k)
                    self.order.pop(k, None)
                    self.loc.pop(k, None)
            if not success:
                for k in job.keys:
                    self._lookup(k, job.req)

        @rule(job=consumes(stores), success=st.booleans())
        def complete_store(self, job: StoreJob, success: bool) -> None:
            if job.epoch != self.epoch:
                return  # discarded by reset_cache: no completion (INV-TERM)
            self._complete_store(job, success)

        # -- loads ----------------------------------------------------------------------------

        def _load(self, keys: list[OffloadKey], i: int) -> LoadJob | None:
            req = self._live(i)
            if vllm:  # one lookup per key; a request with a pending lookup is deferred
                keys = list(dict.fromkeys(keys))
                answers = [self._lookup(k, i, removable=False) for k in keys]
                if any(a in (LookupResult.HIT_PENDING, LookupResult.RETRY) for a in answers):
                    self._see("load-deferred")
                    return None
                keys = [k for k, a in zip(keys, answers, strict=True) if a == LookupResult.HIT]
            else:
                keys = [k for k in keys if self._lookup(k, i, removable=False) == LookupResult.HIT]
            if not keys:
                return None
            if any(self.pins[k] for k in keys) or len(set(keys)) < len(keys):
                self._see("double-pin")
            src = f"spec = m.prepare_load({self.trace.ks(keys)}, {req.name})"
            spec = self._call(src, self.sut.prepare_load, keys, req.ctx)
            where = locations(spec) if isinstance(spec, LoadStoreSpec) else None
            if where is not None:
                where = list(where)
                self._check(
                    len(where) == len(keys),
                    "CONTRACT",
                    src,
                    f"load spec names {len(where)} location(s) for {len(keys)} key(s)",
                    [f"assert len(spec.slots) == {len(keys)}"],
                )
                if exact:
                    for k, s in zip(keys, where, strict=True):
                        if k in self.loc:
                            self._check(
                                self.loc[k] == s,
                                "CONTRACT",
                                src,
                                f"load of {self._kd(k)} reads location {s!r}, its store wrote "
                                f"{self.loc[k]!r}",
                                [f"assert list(spec.slots) == {[self.loc.get(x) for x in keys]}"],
                            )
            slots: tuple[int, ...] = ()
            if isinstance(spec, CPULoadStoreSpec):
                slots = tuple(spec.slots)
                self.load_slots.update(slots)
            for k in keys:
                self.pins[k] += 1
                self.recency.pop(k, None)
                if not exact:
                    self.ready.setdefault(k, None)
            return LoadJob(tuple(keys), i, self.epoch, slots, req.ctx)

        @rule(target=loads, data=st.data(), req=req_st)
        def prepare_load(self, data: st.DataObject, req: int) -> Any:
            pool = sorted(self.ready if exact else self.ever_stored)
            if vllm:  # write-pending keys too: vLLM's scheduler defers the request
                pool = sorted({*pool, *self.pending})
            if not pool:
                return multiple()
            picked = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
            job = self._load(picked, req)
            return multiple() if job is None else job

        @rule(target=loads, data=st.data(), req=req_st)
        def pin_again(self, data: st.DataObject, req: int) -> Any:
            """A second load of keys that are already pinned (pins count, not flags)."""
            pinned = sorted(k for k, n in self.pins.items() if n > 0)
            if not pinned:
                return multiple()
            picked = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=2))
            job = self._load(picked, req)
            return multiple() if job is None else job

        @rule(target=loads, data=st.data(), req=req_st)
        def pin_twice_release_once(self, data: st.DataObject, req: int) -> Any:
            """Two loads of one key, the first released at once: the second pin must hold."""
            pool = sorted(self.ready) if exact else []
            if not pool:
                return multiple()
            key = data.draw(st.sampled_from(pool))
            first = self._load([key], req)
            second = self._load([key], 1 - req if num_requests > 1 else req)
            if first is not None:
                self.complete_load(first)
            return multiple() if second is None else second

        @rule(job=consumes(loads))
        def complete_load(self, job: LoadJob) -> None:
            if job.epoch != self.epoch:
                return
            name = self._name_of(job.ctx)
            if any(self.pins[k] > 1 for k in job.keys):
                self._see("release-one-of-two")
            src = f"m.complete_load({self.trace.ks(job.keys)}, {name})"
            self._call(src, self.sut.complete_load, list(job.keys), job.ctx)
            self.load_slots.subtract(job.slots)
            self.load_slots += Counter()
            self.pins.subtract(job.keys)
            self.pins += Counter()  # drop zero counts
            for k in job.keys:
                if self.pins[k] == 0 and k in self.ready:  # idle again: most recent
                    self.recency.pop(k, None)
                    self.recency[k] = None

        @rule(key=key_st, touch=st.lists(key_st, max_size=4), req=req_st)
        def lookup_and_touch(self, key: OffloadKey, touch: list[OffloadKey], req: int) -> None:
            r = self._live(req)
            self._lookup(key, req)
            if touch:
                if set(touch) & set(self.ready):
                    self._see("touch")
                for k in reversed(touch):  # the first key ends up the most recent
                    if k in self.recency:
                        self.recency.pop(k)
                        self.recency[k] = None
                self._call(
                    f"m.touch({self.trace.ks(touch)}, {r.name})",
                    self.sut.touch,
                    touch,
                    r.ctx,
                    removable=True,
                )

        @rule(data=st.data(), req=req_st, until_miss=st.booleans())
        def lookup_bulk(self, data: st.DataObject, req: int, until_miss: bool) -> None:
            """``lookup_many`` over present keys then any keys (a prompt's chunks: hits, then
            a miss): the bulk answer must be exactly what the per-key lookups answer."""
            r = self._live(req)
            present = sorted(set(self.ready) | self.pending) if exact else sorted(self.ever_stored)
            head = data.draw(st.lists(st.sampled_from(present), max_size=3)) if present else []
            tail = data.draw(st.lists(key_st, min_size=1, max_size=3))
            self._lookup_many([*head, *tail], req, until_miss, r)

        def _lookup_many(
            self, keys: list[OffloadKey], i: int, until_miss: bool, r: _Req
        ) -> list[LookupResult]:
            flag = ", until_miss=True" if until_miss else ""
            src = f"m.lookup_many({self.trace.ks(keys)}, {r.name}{flag})"
            got = list(
                self._call(src, self.sut.lookup_many, keys, r.ctx, until_miss, removable=True)
            )
            check = f"got = {src}"
            n = len(keys)
            if until_miss:
                first = next(
                    (j for j, a in enumerate(got) if a == LookupResult.MISS and j < n), None
                )
                n = n if first is None else first + 1
                if n < len(keys):
                    self._see("bulk-until-miss")
            self._check(
                len(got) == n,
                "BULK-LOOKUP",
                src,
                f"lookup_many answered {len(got)} result(s) for {len(keys)} key(s), expected {n}"
                + (" (until_miss: the answer ends with the first MISS)" if until_miss else ""),
                [check, f"assert len(got) == {n}"],
            )
            seen_hit = False
            for j, (key, answer) in enumerate(zip(keys, got, strict=False)):
                want = self._expected(key)
                if want is not None and answer != want:
                    _, why = self._why(key)
                    self._fail(
                        "BULK-LOOKUP",
                        src,
                        f"lookup_many answered {getattr(answer, 'name', answer)} for "
                        f"{self._kd(key)} (position {j}); lookup answers {want.name}: {why}",
                        [check, f"assert got[{j}] is LookupResult.{want.name}"],
                    )
                if answer == LookupResult.HIT:
                    seen_hit = True
                elif answer == LookupResult.MISS and seen_hit:
                    self._see("bulk-hits-then-miss")
                if want is None and answer == LookupResult.HIT and key not in self.ever_stored:
                    self._fail(
                        "BULK-LOOKUP",
                        src,
                        f"lookup_many answered HIT for {self._kd(key)}, never stored successfully",
                        [check, f"assert got[{j}] is not LookupResult.HIT"],
                    )
            return got

        # -- requests and steps ---------------------------------------------------------------

        @rule(req=req_st, preempt=st.booleans())
        def request_event(self, req: int, preempt: bool) -> None:
            """Finish request ``req`` (its jobs in flight complete later) or preempt it."""
            if preempt:
                self.preempted_ids.add(self._live(req).ctx.req_id)
            else:
                self._finish(req)

        def _finish(self, req: int) -> None:
            r = self._live(req)
            if any(j.ctx is r.ctx for j in self._open_loads()):
                self._see("finish-with-load")
            if any(j.ctx is r.ctx for j in self._open_stores()):
                self._see("finish-with-store")
            self._call(
                f"m.on_request_finished({r.name})",
                self.sut.on_request_finished,
                r.ctx,
                removable=True,
            )
            r.finished = True
            self.new_ids.discard(r.ctx.req_id)
            self.preempted_ids.discard(r.ctx.req_id)

        @rule(req=req_st, data=st.data(), preempt=st.booleans(), success=st.booleans())
        def work_in_flight(
            self, req: int, data: st.DataObject, preempt: bool, success: bool
        ) -> None:
            """Request ``req`` gets a load and a store in flight, is preempted (and the step
            ends) or finished, and only then do both complete."""
            ready = sorted(self.ready) if exact else []
            load = self._load([data.draw(st.sampled_from(ready))], req) if ready else None
            absent = [k for k in universe if k not in self.ready and k not in self.pending]
            store = self._store(absent[:1], req) if absent else None
            if preempt:
                self.preempted_ids.add(self.reqs[req].ctx.req_id)
                if store is not None:
                    self._see("step-preempted-with-store")
                self.end_step()
                for k in store.keys if store is not None else ():
                    self._lookup(k, req)  # still write-pending
            else:
                self._finish(req)
            if load is not None:
                self.complete_load(load)
            if store is not None:
                self.complete_store(store, success)

        def _open(self, name: str) -> list[Any]:
            jobs = [self.names_to_values[v.name] for v in self.bundle(name)]
            return [j for j in jobs if j.epoch == self.epoch]

        def _open_loads(self) -> list[LoadJob]:
            return self._open("loads")

        def _open_stores(self) -> list[StoreJob]:
            return self._open("stores")

        @rule()
        def end_step(self) -> None:
            new, pre = sorted(self.new_ids), sorted(self.preempted_ids)
            if new:
                self._see("step-new-requests")
            if pre:
                self._see("step-preempted")
                if any(j.ctx.req_id in self.preempted_ids for j in self._open_stores() if j.ctx):
                    self._see("step-preempted-with-store")
            args = []
            if new:
                args.append(f"new_req_ids=frozenset({new!r})")
            if pre:
                args.append(f"preempted_req_ids=frozenset({pre!r})")
            src = f"m.on_schedule_end(ScheduleEndContext({', '.join(args)}))"
            ctx = ScheduleEndContext(frozenset(new), frozenset(pre))
            self._call(src, self.sut.on_schedule_end, ctx, removable=True)
            self.new_ids.clear()
            self.preempted_ids.clear()
            self.ends += 1
            self.quarantine = {s: n for s, n in self.quarantine.items() if n > self.ends}
            if self.flush_due is not None and self.ends >= self.flush_due:
                self._reset_flushed()
            self._drain_events()
            src = "m.has_pending_work()"
            busy = self._call(src, self.sut.has_pending_work, removable=True)
            self._check(
                isinstance(busy, bool),
                "CONTRACT",
                src,
                f"has_pending_work returned {type(busy).__name__}, not bool",
                [f"assert isinstance({src}, bool)"],
            )
            src = "m.get_stats()"
            stats = self._call(src, self.sut.get_stats, removable=True)
            self._check(
                isinstance(stats, Mapping),
                "CONTRACT",
                src,
                f"get_stats returned {type(stats).__name__}, not a mapping",
                [f"assert isinstance({src}, dict)"],
            )

        def _drain_events(self) -> None:
            src = "events += m.take_events()"
            got = list(self._call(src, self.sut.take_events, removable=True))
            if got:
                self.events_seen = True
            for ev in got:
                if ev.removed:
                    self.event_view.difference_update(ev.keys)
                    continue
                for k in ev.keys:
                    self._check(
                        k in self.ever_stored,
                        "INV-NO-PARTIAL",
                        src,
                        f"stored event names {self._kd(k)}, never stored successfully",
                        [f"assert {self.trace.k(k)} not in replay_events(events)"],
                    )
                self.event_view.update(ev.keys)
            checking = events is True or (events is None and self.events_seen)
            if events is True and not self.events_seen and self.ever_stored:
                self._fail(
                    "EVENTS",
                    src,
                    "events=True, but no event was emitted after a successful store",
                    ["assert events"],
                )
            if checking and exact:
                self._see("events-replayed")
                want = set(self.ready)
                if self.event_view != want:
                    extra = self.event_view - want
                    missing = want - self.event_view
                    diff = []
                    if extra:
                        diff.append(
                            f"announced but not ready (missing removed events): "
                            f"{self.trace.ks(sorted(extra))}"
                        )
                    if missing:
                        diff.append(
                            f"ready but not announced (missing stored events): "
                            f"{self.trace.ks(sorted(missing))}"
                        )
                    cause = self._cause(extra | missing)
                    self._fail(
                        "EVENTS",
                        cause,
                        "events do not replay to the ready keys; "
                        + "; ".join(diff)
                        + (f" (seen at {src})" if cause != src else ""),
                        [f"assert replay_events(events) == {self.trace.kset(want)}"],
                    )

        def _note_changes(self) -> None:
            """Attribute every key whose readiness the model changed since the last note to the
            last call recorded (the model follows each call before the next one is made)."""
            ready = set(self.ready)
            changed = ready ^ self._ready_noted
            if changed and self.body:
                at = (len(self.body) - 1, self.body[-1][0])
                for key in changed:
                    self._changed_by[key] = at
            self._ready_noted = ready

        def _cause(self, keys: set[OffloadKey]) -> str:
            """The call that left ``keys`` announced wrongly: the latest call that changed one
            of them from ready to not or back (a store, an eviction, a failed store, a reset),
            or the observing ``take_events`` where none is known."""
            self._note_changes()
            known = [self._changed_by[k] for k in keys if k in self._changed_by]
            if not known:
                return self.body[-1][0] if self.body else "events += m.take_events()"
            return max(known)[1]

        @rule(dice=st.integers(0, 3), data=st.data(), req=req_st)
        def reset_in_flight(self, dice: int, data: st.DataObject, req: int) -> None:
            """A reset while a load and a store are outstanding (their completions never come)."""
            if dice != 3:  # not the simplest value: Hypothesis draws zeros far more often
                return
            ready = sorted(self.ready)
            if ready and not any(n > 0 for n in self.pins.values()):
                self._load([data.draw(st.sampled_from(ready))], req)
            absent = [k for k in universe if k not in self.ready and k not in self.pending]
            if absent and not self.pending:
                self._store(absent[:1], req)
            self.reset_cache(3)

        @rule(dice=st.integers(0, 3))
        def reset_cache(self, dice: int) -> None:
            if dice != 3:  # resets wipe everything: keep them rarer than the other rules
                return
            if self.pending:
                self._see("reset-with-pending")
            if any(n > 0 for n in self.pins.values()):
                self._see("reset-with-pinned")
            if self.ready:
                self._see("reset-with-ready")
            in_flight = bool(self.pending) or any(n > 0 for n in self.pins.values())
            if vllm:  # the engine drains the events, then announces the reset by itself
                self._drain_events()
            self._call("m.reset_cache()", self.sut.reset_cache)
            if vllm:
                self.event_view.clear()
                # the workers report the jobs in flight at the reset one step later at best
                self.flush_due = self.ends + 1 if in_flight else None
                if not in_flight:
                    self._reset_flushed()
            self._quarantine([*self.pending_slot.values(), *self.load_slots])
            self.pending_slot.clear()
            self.load_slots.clear()
            self.epoch += 1
            before = list(self.ready) + sorted(self.pending)
            self.dropped.update(before)
            self.pending.clear()
            self.pins.clear()
            self.ready.clear()
            self.order.clear()
            self.recency.clear()
            self.loc.clear()
            if exact:
                for k in before:  # everything must be gone
                    self._lookup(k)

        def _reset_flushed(self) -> None:
            """vllm profile: ``on_reset_flushed`` (the jobs in flight at the reset are done)."""
            self.flush_due = None
            hook = getattr(self.sut, "on_reset_flushed", None)
            if hook is not None:
                self._see("reset-flushed")
                self._call("m.on_reset_flushed()", hook)

        # -- misuse: typed errors, state unchanged --------------------------------------------

        def _unpinned_ready(self) -> list[OffloadKey]:
            """Ready keys nobody pins (exact mode only: a composite manager may hold hidden
            pins, e.g. a tiering manager's cascade reads, which a stray release would drop)."""
            if not exact:
                return []
            return [k for k in sorted(self.ready) if self.pins[k] == 0]

        @rule(
            kind=st.sampled_from(
                [
                    "load-unknown",
                    "load-pending",
                    "release-unknown",
                    "release-unpinned",
                    "release-pending",
                ]
            ),
            data=st.data(),
            req=req_st,
        )
        def misuse(self, kind: str, data: st.DataObject, req: int) -> None:
            exc = misuse.get(kind)
            if exc is None:
                return
            r = self._live(req)
            absent = self._absent()
            idle = self._unpinned_ready()
            pinned = sorted(k for k, n in self.pins.items() if n > 0)
            if kind.startswith("load-"):
                pool = absent if kind == "load-unknown" else sorted(self.pending)
                if not pool:
                    return
                bad = data.draw(st.sampled_from(pool))
                # ready keys named before the bad one (idle ones first: a pin left on them
                # by the failed call is visible at once)
                candidates = [] if vllm else idle or pinned  # vllm: the bad key alone
                good = (
                    data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=2))
                    if candidates
                    else []
                )
                keys = [*dict.fromkeys(good), bad]
                self._see(f"misuse-{kind}")
                src = f"m.prepare_load({self.trace.ks(keys)}, {r.name})"
                self._expect(exc, src, self.sut.prepare_load, keys, r.ctx)
                for k in dict.fromkeys(good):  # no pin may be left behind
                    if self.pins[k] == 0:
                        csrc = f"m.complete_load({self.trace.ks([k])}, {r.name})"
                        self._expect(
                            misuse.get("release-unpinned") or PinUnderflowError,
                            csrc,
                            self.sut.complete_load,
                            [k],
                            r.ctx,
                            blame=f"{src} raised but left {self._kd(k)} pinned",
                            code="INV-PIN",
                        )
                    else:
                        self._lookup(k, req)
                return
            if kind == "release-unknown":
                pool = absent
            elif kind == "release-unpinned":
                pool = idle
            else:
                pool = sorted(self.pending)
            if not pool:
                return
            key = data.draw(st.sampled_from(pool))
            self._see(f"misuse-{kind}")
            src = f"m.complete_load({self.trace.ks([key])}, {r.name})"
            self._expect(
                exc,
                src,
                self.sut.complete_load,
                [key],
                r.ctx,
                code="INV-PIN" if kind != "release-unknown" else "ERRORS",
            )

        def _expect(
            self,
            exc: type[BaseException] | tuple[type[BaseException], ...],
            src: str,
            call: Callable[[Sequence[OffloadKey], ReqContext], object],
            keys: list[OffloadKey],
            ctx: ReqContext,
            blame: str | None = None,
            code: str = "ERRORS",
        ) -> None:
            self.trace.errors.update(_exc_names(exc))
            type(self).calls[getattr(call, "__name__", "?")] += 1
            stmt = f"with pytest.raises({_exc_src(exc)}):\n    {src}"
            try:
                with self._locked():
                    call(keys, ctx)
            except exc:
                self._note_changes()
                self.body.append((stmt, True))
                return
            except Exception as other:
                self.trace.errors.add(type(other))
                self._fail(
                    "ERRORS",
                    src,
                    f"{src} raised {type(other).__name__}, expected {_exc_src(exc)}",
                    [stmt],
                    signature=_signature(other),
                )
            detail = blame or f"{src} did not raise {_exc_src(exc)}"
            self._fail(code, src, detail, [stmt], signature="AssertionError:" + _DID_NOT_RAISE)

        # -- invariants -----------------------------------------------------------------------

        @invariant()
        def pins_and_pending_visible(self) -> None:
            for k in sorted(self.pending):
                self._lookup(k)
            for k in sorted(k for k, n in self.pins.items() if n > 0):
                self._lookup(k)

        @invariant()
        def counters_match(self) -> None:
            fn = self.counters_fn
            if fn is not None:
                c = fn(self.sut)
                pinned = sum(1 for n in self.pins.values() if n > 0)
                idle = len(self._idle())
                src = "m.conformance_counters()" if fn is _protocol_counters else "counters(m)"
                if exact:
                    want = {
                        "write_pending": len(self.pending),
                        "pinned": pinned,
                        "evictable": idle,
                        "keys": len(self.ready) + len(self.pending),
                    }
                    for name, value in want.items():
                        if name in c and c[name] != value:
                            self._fail(
                                "COUNTERS",
                                src,
                                f"counter {name}={c[name]}, model {value} "
                                f"({_COUNTER_MEANING[name]})",
                                [f'assert {src}["{name}"] == {value}'],
                            )
                else:
                    for name, value in (("write_pending", len(self.pending)), ("pinned", pinned)):
                        if c.get(name, value) < value:
                            self._fail(
                                "COUNTERS",
                                src,
                                f"counter {name}={c[name]} < model {value}",
                                [f'assert {src}["{name}"] >= {value}'],
                            )
                if "free" in c and "quarantined" in c and not 0 <= c["quarantined"] <= c["free"]:
                    self._fail(
                        "COUNTERS",
                        src,
                        f"quarantined={c['quarantined']} not within free={c['free']}",
                        [f'assert {src}["quarantined"] <= {src}["free"]'],
                    )
            if self_check is not None:
                try:
                    self_check(self.sut)
                except Exception as exc:
                    self._fail(
                        "SELF-CHECK",
                        "self_check(m)",
                        f"self_check raised {type(exc).__name__}: {exc}",
                        ["self_check(m)"],
                        signature=_signature(exc),
                    )

        def teardown(self) -> None:
            type(self).calls["shutdown"] += 1
            self.sut.shutdown()

        @classmethod
        def _to_test_case(cls) -> Any:  # type: ignore[override, unused-ignore]
            machine = cls

            class ConformanceTestCase(unittest.TestCase):
                settings = conformance_settings(examples, step_count)

                def runTest(self) -> None:
                    with shrink_time_cap(DEFAULT_SHRINK_SECONDS):
                        run_state_machine_as_test(machine, settings=self.settings)

            ConformanceTestCase.__name__ = cls.__name__ + ".TestCase"
            ConformanceTestCase.__qualname__ = cls.__qualname__ + ".TestCase"
            return ConformanceTestCase

    ManagerConformance.coverage = Counter()
    ManagerConformance.notes = Counter()
    ManagerConformance.calls = Counter()
    ManagerConformance.profile = profile
    return ManagerConformance


_COUNTER_MEANING = {
    "keys": "present keys: ready + write-pending",
    "write_pending": "keys whose store is not completed",
    "pinned": "keys with at least one pin",
    "evictable": "ready keys with no pin",
}


def _protocol_counters(m: Any) -> Mapping[str, int]:
    return dict(m.conformance_counters())


class ManagerConformanceTests:
    """A pytest base class: subclass it as ``Test...`` and set what your manager promises.

    Example::

        class TestMyManager(ManagerConformanceTests):
            capacity = 4

            @staticmethod
            def make_manager() -> MyManager:
                return MyManager(4)

    Class attributes (all but ``make_manager`` and ``capacity`` optional) are the keyword
    arguments of :func:`make_manager_conformance`, plus ``seed`` (``None``: a new exploration on
    every run; an integer: the same cases on every build) and ``examples``.
    """

    capacity: int = 4
    exact: bool = True
    events: bool | None = None
    admission: bool = False
    eviction: str | None = None
    errors: Mapping[str, Any] | None = None
    spec_slots: Callable[[LoadStoreSpec], Sequence[Hashable]] | None = None
    examples: int = DEFAULT_EXAMPLES
    steps: int = DEFAULT_STEPS
    seed: int | None = None

    @staticmethod
    def make_manager() -> OffloadingManager:
        """A fresh manager (override)."""
        raise NotImplementedError("set make_manager on your ManagerConformanceTests subclass")

    @classmethod
    def machine(cls) -> type[RuleBasedStateMachine]:
        """The conformance machine for this class's settings (built once per class)."""
        built: type[RuleBasedStateMachine] | None = cls.__dict__.get("_machine")
        if built is None:
            built = make_manager_conformance(
                cls.make_manager,
                cls.capacity,
                exact=cls.exact,
                events=cls.events,
                admission=cls.admission,
                eviction=cls.eviction,
                errors=cls.errors,
                spec_slots=cls.spec_slots,
                step_count=cls.steps,
                examples=cls.examples,
            )
            cls._machine = built  # type: ignore[attr-defined]
        return built

    def test_conformance(self) -> None:
        """The kit at this class's budget."""
        run_conformance(self.machine(), examples=self.examples, steps=self.steps, seed=self.seed)
