"""Planted contract violations: how reliably the conformance kit catches each kind.

Each entry of :data:`PLANTED` is :class:`~statecore.specs.fifo.FifoManager` with one realistic
bug, the kind a connector author writes by accident. :func:`measure` runs the kit at its default
budget (:data:`~statecore.specs.conformance.DEFAULT_EXAMPLES` cases of
:data:`~statecore.specs.conformance.DEFAULT_STEPS` steps) once per seed against each of them and
against the unmodified manager, and reports how many seeds caught it and the time to detection
(generation until the first failing case; shrinking and the reproduction are timed apart).

The measurement is a command, not part of the default tests (it takes minutes)::

    python -m statecore.specs.planted --seeds 20           # the table of the guide
    python -m statecore.specs.planted --seeds 3 --only evicts-pinned

``tests/managers/test_conformance_kit.py`` runs a small fixed-seed version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from hypothesis import Phase

from statecore.errors import UnknownKeyError
from statecore.keys import OffloadKey
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)

from .conformance import (
    DEFAULT_EXAMPLES,
    DEFAULT_STEPS,
    ConformanceError,
    make_manager_conformance,
    run_conformance,
)
from .fifo import FifoManager

__all__ = ["PLANTED", "Planted", "main", "measure"]

CAPACITY = 4


class HitWhilePending(FifoManager):
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.entries else LookupResult.MISS


class FailedStoreLoadable(FifoManager):
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        super().complete_store(keys, ctx, True)


class LoadNeverReleased(FifoManager):
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:  # validates, releases nothing
            if key not in self.entries:
                raise UnknownKeyError(key, "complete_load")


class LoadsMissingKey(FifoManager):
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        return super().prepare_load([k for k in keys if k in self.entries], ctx)


class OverCapacity(FifoManager):
    def __init__(self, capacity: int = CAPACITY) -> None:
        super().__init__(capacity + 1)
        self.capacity = capacity


class EvictsPinned(FifoManager):
    def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
        out = [k for k, e in self.entries.items() if e.ready and k not in offered][:n]
        return out if len(out) == n else None


class EvictsOffered(FifoManager):
    def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
        out = [k for k, e in self.entries.items() if e.ready and e.pins == 0][:n]
        return out if len(out) == n else None


class EvictsPending(FifoManager):
    def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
        out = [k for k, e in self.entries.items() if e.pins == 0 and k not in offered][:n]
        return out if len(out) == n else None


class ReleaseTwice(FifoManager):
    """Releasing a pin that is not held is silently accepted (a second release of one load)."""

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            e = self.entries.get(key)
            if e is None:
                raise UnknownKeyError(key, "complete_load")
        for key in keys:
            e = self.entries[key]
            e.pins = max(0, e.pins - 1)


class PinsAsFlag(FifoManager):
    """A pin is a flag, not a count: the first of two loads to finish unpins the key."""

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        spec = super().prepare_load(keys, ctx)
        for key in keys:
            self.entries[key].pins = 1
        return spec


class PartialPinOnError(FifoManager):
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        slots: list[int] = []
        for key in keys:  # pins as it goes; a bad key raises with earlier ones pinned
            slots.extend(super().prepare_load([key], ctx).slots)
        return CPULoadStoreSpec(tuple(slots))


class ResetKeepsReady(FifoManager):
    """Drops write-pending and pinned keys (announcing the ready ones) but keeps idle ones."""

    def reset_cache(self) -> None:
        dropped = [k for k, e in self.entries.items() if not e.ready or e.pins]
        announced = tuple(k for k in dropped if self.entries[k].ready)
        if announced:
            self.events.append(OffloadingEvent(announced, Medium.CPU, removed=True))
        for key in dropped:
            self.free.append(self.entries.pop(key).slot)


class NoEvictionEvents(FifoManager):
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        before = len(self.events)
        out = super().prepare_store(keys, ctx)
        del self.events[before:]  # drops the removed event of the evictions
        return out


class FinishDropsPins(FifoManager):
    """Tracks each request's pins and drops them when the request finishes."""

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        spec = super().prepare_load(keys, ctx)
        ctx.scratch.setdefault("fifo-pins", []).extend(keys)
        return spec

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        super().complete_load(keys, ctx)
        held = ctx.scratch.get("fifo-pins", [])
        for key in keys:
            if key in held:
                held.remove(key)

    def on_request_finished(self, ctx: ReqContext) -> None:
        for key in ctx.scratch.pop("fifo-pins", []):
            e = self.entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1


class PreemptDropsStores(FifoManager):
    """Drops a preempted request's pending stores at the step end (they never complete)."""

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx)
        if out is not None:
            self.owner = getattr(self, "owner", {})
            for key in out.keys_to_store:
                self.owner[key] = ctx.req_id
        return out

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        owner = getattr(self, "owner", {})
        for key, rid in list(owner.items()):
            e = self.entries.get(key)
            if rid in ctx.preempted_req_ids and e is not None and not e.ready:
                self.free.append(self.entries.pop(key).slot)
                del owner[key]


class StoredEventForFailed(FifoManager):
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        pending = [k for k in keys if k in self.entries and not self.entries[k].ready]
        super().complete_store(keys, ctx, success)
        if not success and pending:
            self.events.append(OffloadingEvent(tuple(pending), Medium.CPU, removed=False))


class FailedStoreLeaksSlot(FifoManager):
    """A failed store forgets its keys but never returns their slots."""

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        if success:
            super().complete_store(keys, ctx, success)
            return
        for key in keys:
            e = self.entries.get(key)
            if e is not None and not e.ready:
                del self.entries[key]  # bug: its slot is not put back on the free list


class AssertsWhenFull(FifoManager):
    """An ``assert`` guards a state real calls reach: a store that must evict while a key is
    pinned trips it instead of evicting an idle key (the legal call raises AssertionError)."""

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        new = [k for k in dict.fromkeys(keys) if k not in self.entries]
        pinned = any(e.pins for e in self.entries.values())
        assert not (pinned and len(new) > len(self.free)), "no room while a key is pinned"
        return super().prepare_store(keys, ctx)


class BulkHitAfterRun(FifoManager):
    """A bulk lookup that answers the first MISS after a run of hits as HIT (an off-by-one in
    a prefix scan): per-key lookups are right, ``lookup_many`` is not."""

    def lookup_many(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, until_miss: bool = False
    ) -> list[LookupResult]:
        out = super().lookup_many(keys, ctx, until_miss)
        for j in range(1, len(out)):
            if out[j] == LookupResult.MISS and out[j - 1] == LookupResult.HIT:
                out[j] = LookupResult.HIT
                break
        return out


@dataclass(frozen=True)
class Planted:
    """One planted violation: a name, what it does, the manager class."""

    name: str
    text: str
    cls: Callable[[int], FifoManager]


PLANTED: list[Planted] = [
    Planted("hit-while-pending", "lookup answers HIT while a store is pending", HitWhilePending),
    Planted("failed-store-loadable", "a failed store is made loadable", FailedStoreLoadable),
    Planted("load-never-released", "complete_load releases nothing", LoadNeverReleased),
    Planted("load-missing-key", "prepare_load of a missing key does not raise", LoadsMissingKey),
    Planted("over-capacity", "holds one key over capacity", OverCapacity),
    Planted("evicts-pinned", "evicts a key pinned by a load", EvictsPinned),
    Planted("evicts-offered", "evicts a key offered in the same call", EvictsOffered),
    Planted("evicts-pending", "evicts a key whose store is pending", EvictsPending),
    Planted("release-twice", "a pin released twice is accepted", ReleaseTwice),
    Planted("pins-as-flag", "two loads of one key hold one pin", PinsAsFlag),
    Planted(
        "partial-pin", "prepare_load pins a key, then raises without undoing", PartialPinOnError
    ),
    Planted("reset-keeps-ready", "reset_cache keeps the ready keys", ResetKeepsReady),
    Planted("no-eviction-events", "evictions emit no removed event", NoEvictionEvents),
    Planted("finish-drops-pins", "on_request_finished drops the request's pins", FinishDropsPins),
    Planted(
        "preempt-drops-stores",
        "a preempted request's pending stores are dropped",
        PreemptDropsStores,
    ),
    Planted(
        "stored-event-for-failed", "a failed store is announced as stored", StoredEventForFailed
    ),
    Planted("failed-store-leaks-slot", "a failed store never frees its slot", FailedStoreLeaksSlot),
    Planted(
        "asserts-when-full",
        "a store that must evict while a key is pinned trips an assert",
        AssertsWhenFull,
    ),
    Planted(
        "bulk-hit-after-run",
        "lookup_many answers the first MISS after a run of hits as HIT",
        BulkHitAfterRun,
    ),
]
"""The planted violations, one per kind."""


@dataclass
class Outcome:
    """One run: caught or not, seconds to detection (generation; wall clock and CPU time of
    this process, which differ on a shared machine), seconds in all, the invariant reported."""

    caught: bool
    detect_s: float
    total_s: float
    invariant: str = ""
    detect_cpu_s: float = 0.0


def run_one(
    cls: Callable[[int], FifoManager],
    seed: int,
    examples: int = DEFAULT_EXAMPLES,
    steps: int = DEFAULT_STEPS,
    shrink: bool = False,
    counters: bool = True,
) -> Outcome:
    """Run the kit once (one seed) against ``cls(CAPACITY)``."""
    machine = make_manager_conformance(
        lambda: cls(CAPACITY),
        CAPACITY,
        minimise_seconds=0.5,
        counters=None if counters else False,
        repro_factory=f"{__name__}:{getattr(cls, '__name__', 'cls')}({CAPACITY})",
    )
    first: list[float] = []
    first_cpu: list[float] = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    original_fail = machine._fail  # type: ignore[attr-defined]

    def timed_fail(self: object, *args: object, **kw: object) -> None:
        if not first:
            first.append(time.perf_counter() - t0)
            first_cpu.append(time.process_time() - c0)
        original_fail(self, *args, **kw)

    machine._fail = timed_fail
    kw: dict[str, Any] = {} if shrink else {"phases": [Phase.generate]}
    try:
        run_conformance(machine, examples=examples, steps=steps, seed=seed, **kw)
    except ConformanceError as exc:
        return Outcome(
            True,
            first[0] if first else 0.0,
            time.perf_counter() - t0,
            exc.invariant,
            first_cpu[0] if first_cpu else 0.0,
        )
    except Exception as exc:  # a Hypothesis error is a finding too, but say so
        return Outcome(
            True, first[0] if first else 0.0, time.perf_counter() - t0, type(exc).__name__
        )
    return Outcome(False, 0.0, time.perf_counter() - t0)


def measure(
    seeds: Sequence[int],
    only: Sequence[str] = (),
    out: TextIO | None = None,
    shrink: bool = False,
    examples: int = DEFAULT_EXAMPLES,
    counters: bool = True,
    reference: bool = True,
) -> list[tuple[str, list[Outcome]]]:
    """Run every planted violation (and the reference) over ``seeds``; print a markdown table."""
    stream = out or sys.stdout
    rows: list[tuple[str, list[Outcome]]] = []
    texts = {p.name: p.text for p in PLANTED}
    targets: list[tuple[str, Callable[[int], FifoManager]]] = (
        [("reference (unmodified)", FifoManager)] if reference else []
    )
    targets += [(p.name, p.cls) for p in PLANTED if not only or p.name in only]
    print(
        "| planted violation | what it does | caught | median detection s (wall) | "
        "max detection s (wall) | median detection s (CPU) | max detection s (CPU) | "
        "median run s (wall) | reported as |",
        file=stream,
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", file=stream)
    for name, cls in targets:
        outcomes = [run_one(cls, s, examples, shrink=shrink, counters=counters) for s in seeds]
        rows.append((name, outcomes))
        caught = [o for o in outcomes if o.caught]
        det = [o.detect_s for o in caught] or [0.0]
        cpu = [o.detect_cpu_s for o in caught] or [0.0]
        run = [o.total_s for o in outcomes]
        kinds = ", ".join(sorted({o.invariant for o in caught})) or "-"
        what = texts.get(name, "the reference FIFO manager: must pass")
        print(
            f"| {name} | {what} | {len(caught)}/{len(outcomes)} | "
            f"{statistics.median(det):.2f} | {max(det):.2f} | {statistics.median(cpu):.2f} | "
            f"{max(cpu):.2f} | "
            f"{statistics.median(run):.2f} | {kinds} |",
            file=stream,
            flush=True,
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m statecore.specs.planted``: print the detection table."""
    p = argparse.ArgumentParser(prog="python -m statecore.specs.planted", description=__doc__)
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 per violation")
    p.add_argument("--only", action="append", default=[], help="a planted violation's name")
    p.add_argument("--shrink", action="store_true", help="shrink too (total time includes it)")
    p.add_argument(
        "--no-counters", action="store_true", help="do not compare the manager's counters"
    )
    p.add_argument("--no-reference", action="store_true", help="skip the unmodified manager's row")
    args = p.parse_args(argv)
    rows = measure(
        range(args.seeds),
        args.only,
        shrink=args.shrink,
        counters=not args.no_counters,
        reference=not args.no_reference,
    )
    ref = rows[0][1] if not args.no_reference else []
    planted = rows[1:] if not args.no_reference else rows
    missed = [name for name, outs in planted if not all(o.caught for o in outs)]
    bad = any(o.caught for o in ref)
    print(f"reference passes: {not bad}; violations missed in some seed: {missed or 'none'}")
    return 1 if bad or missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
