"""A from-scratch reference manager: a dict-based FIFO cache that keeps the whole contract.

:class:`FifoManager` is the smallest honest implementation of
:class:`~statecore.manager.OffloadingManager` we know how to write, and the model a connector
author can copy: one ``dict`` of entries in insertion order, a list of free slots, a count of
pins per key, an event list. It exists for three reasons:

* it is the example of the conformance guide (``docs/guides/conformance.md``) and the target of
  ``statecore fuzz --manager statecore.specs.fifo:FifoManager``;
* :mod:`statecore.specs.planted` plants one realistic contract violation at a time in it to
  measure how reliably the conformance kit finds each kind;
* it implements the kit's optional counters protocol
  (:class:`~statecore.specs.conformance.ConformanceCounters`).

Theory of operation. A key is *write-pending* from ``prepare_store`` to ``complete_store``,
then *ready*; a ready key with pins > 0 is *pinned*. Room is made by evicting ready, unpinned
keys that are not among the offered ones, oldest stored first (``dict`` order). Every misuse
raises a typed :class:`~statecore.errors.ManagerError` before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from statecore.errors import KeyNotReadyError, PinUnderflowError, UnknownKeyError
from statecore.keys import OffloadKey
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)

from .conformance import ConformanceCounters

__all__ = ["FifoManager"]


class _Entry:
    __slots__ = ("pins", "ready", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ready = False
        self.pins = 0


class FifoManager(OffloadingManager):
    """A CPU-slot cache of ``capacity`` keys, evicting the oldest idle key first.

    Args:
        capacity: number of slots (keys it can hold, in any state).
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.entries: dict[OffloadKey, _Entry] = {}
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self.events: list[OffloadingEvent] = []

    # -- reads ------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """MISS, HIT_PENDING (write in flight) or HIT."""
        e = self.entries.get(key)
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT if e.ready else LookupResult.HIT_PENDING

    def _ready_entries(self, keys: Sequence[OffloadKey], call: str) -> list[_Entry]:
        out = []
        for key in keys:  # validate everything before changing anything
            e = self.entries.get(key)
            if e is None:
                raise UnknownKeyError(key, call)
            if not e.ready:
                raise KeyNotReadyError(key, call)
            out.append(e)
        return out

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        """Pin every key (all must be ready) and return their slots."""
        entries = self._ready_entries(keys, "prepare_load")
        for e in entries:
            e.pins += 1
        return CPULoadStoreSpec(tuple(e.slot for e in entries))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Release one pin per key; every key must hold one."""
        entries = []
        for key in keys:
            e = self.entries.get(key)
            if e is None:
                raise UnknownKeyError(key, "complete_load")
            if e.pins == 0:
                state = "ready but not pinned" if e.ready else "write-pending, not pinned"
                raise PinUnderflowError(key, "complete_load", state)
            entries.append(e)
        for e in entries:
            e.pins -= 1

    # -- writes -----------------------------------------------------------------------------

    def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
        victims: list[OffloadKey] = []
        for key, e in self.entries.items():  # insertion order: oldest first
            if len(victims) == n:
                break
            if e.ready and e.pins == 0 and key not in offered:
                victims.append(key)
        return victims if len(victims) == n else None

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the offered keys not present yet, evicting the oldest idle ones."""
        new = [k for k in dict.fromkeys(keys) if k not in self.entries]
        if not new:
            return PrepareStoreOutput((), CPULoadStoreSpec(()))
        victims = self._victims(max(0, len(new) - len(self.free)), set(keys))
        if victims is None:
            return None  # not enough room: nothing changed
        for key in victims:
            self.free.append(self.entries.pop(key).slot)
        if victims:
            self.events.append(OffloadingEvent(tuple(victims), Medium.CPU, removed=True))
        slots = []
        for key in new:
            e = _Entry(self.free.pop())
            self.entries[key] = e
            slots.append(e.slot)
        return PrepareStoreOutput(tuple(new), CPULoadStoreSpec(tuple(slots)), tuple(victims))

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Make write-pending keys ready (success) or drop them; ignore the others."""
        done = []
        for key in keys:
            e = self.entries.get(key)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                done.append(key)
            else:
                self.free.append(self.entries.pop(key).slot)
        if done:
            self.events.append(OffloadingEvent(tuple(done), Medium.CPU, removed=False))

    # -- housekeeping -----------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def reset_cache(self) -> None:
        """Drop every key; announce the ready ones as removed."""
        ready = tuple(k for k, e in self.entries.items() if e.ready)
        if ready:
            self.events.append(OffloadingEvent(ready, Medium.CPU, removed=True))
        self.entries.clear()
        self.free = list(range(self.capacity - 1, -1, -1))

    def conformance_counters(self) -> ConformanceCounters:
        """The kit's counters (see :class:`~statecore.specs.conformance.ConformanceCounters`)."""
        pending = sum(1 for e in self.entries.values() if not e.ready)
        pinned = sum(1 for e in self.entries.values() if e.pins > 0)
        return ConformanceCounters(
            keys=len(self.entries),
            write_pending=pending,
            pinned=pinned,
            evictable=len(self.entries) - pending - pinned,
        )
