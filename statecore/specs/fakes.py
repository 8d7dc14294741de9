"""Test doubles: a small, obviously-correct manager that records every call.

:class:`RecordingManager` implements :class:`~statecore.OffloadingManager` with unbounded
capacity by default (or a fixed number of slots, evicting the oldest idle key) and keeps
``calls``, the list of ``(method, req_id, keys, extra)`` tuples it received, so tests can
assert on the exact conversation between scheduler and manager (INV-TERM, INV-ORDER).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from statecore.errors import KeyNotReadyError, PinUnderflowError, UnknownKeyError
from statecore.keys import OffloadKey
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

__all__ = ["Call", "RecordingManager"]


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded manager call."""

    method: str
    req_id: str | None = None
    keys: tuple[OffloadKey, ...] = ()
    extra: Any = None


@dataclass(slots=True)
class _Entry:
    slot: int
    ref: int  # -1 write-pending, 0 ready, n > 0 pinned by n readers


@dataclass
class RecordingManager(OffloadingManager):
    """A dict-backed manager that records calls.

    Args:
        capacity: number of slots (None: unbounded).
        policy: the offload policy answered to ``on_new_request``.
        lookup_override: key -> forced lookup answer (to script HIT_PENDING / RETRY).
    """

    capacity: int | None = None
    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL
    lookup_override: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    entries: dict[OffloadKey, _Entry] = field(default_factory=dict)
    fail_prepare_store: bool = False
    _free: list[int] = field(default_factory=list)
    _next_slot: int = 0
    _events: list[OffloadingEvent] = field(default_factory=list)

    def methods(self, name: str) -> list[Call]:
        """Recorded calls of one method."""
        return [c for c in self.calls if c.method == name]

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        forced = self.lookup_override.get(key)
        if forced is not None:
            return forced
        e = self.entries.get(key)
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if e.ref < 0 else LookupResult.HIT

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        for k in keys:
            e = self.entries.get(k)
            if e is None:
                raise UnknownKeyError(k, "prepare_load")
            if e.ref < 0:
                raise KeyNotReadyError(k, "prepare_load")
        for k in keys:
            self.entries[k].ref += 1
        self.calls.append(Call("prepare_load", ctx.req_id, tuple(keys)))
        return CPULoadStoreSpec(tuple(self.entries[k].slot for k in keys))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is None:
                raise UnknownKeyError(k, "complete_load")
            if e.ref <= 0:
                raise PinUnderflowError(k, "complete_load")
        for k in keys:
            self.entries[k].ref -= 1
        self.calls.append(Call("complete_load", ctx.req_id, tuple(keys)))

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        self.calls.append(Call("prepare_store", ctx.req_id, tuple(keys)))
        if self.fail_prepare_store:
            return None
        new = [k for k in dict.fromkeys(keys) if k not in self.entries]
        evicted: list[OffloadKey] = []
        if self.capacity is not None:
            need = len(self.entries) + len(new) - self.capacity
            if need > 0:
                protected = set(keys)
                idle = [k for k, e in self.entries.items() if e.ref == 0 and k not in protected]
                if len(idle) < need:
                    return None
                evicted = idle[:need]
                for k in evicted:
                    self._free.append(self.entries.pop(k).slot)
                self._events.append(OffloadingEvent(tuple(evicted), Medium.CPU, True))
        slots = []
        for k in new:
            slot = self._alloc()
            self.entries[k] = _Entry(slot, -1)
            slots.append(slot)
        return PrepareStoreOutput(tuple(new), CPULoadStoreSpec(tuple(slots)), tuple(evicted))

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self.calls.append(Call("complete_store", ctx.req_id, tuple(keys), success))
        done = []
        for k in keys:
            e = self.entries.get(k)
            if e is None or e.ref >= 0:
                continue
            if success:
                e.ref = 0
                done.append(k)
            else:
                self._free.append(self.entries.pop(k).slot)
        if done:
            self._events.append(OffloadingEvent(tuple(done), Medium.CPU, False))

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        self.calls.append(Call("reset_cache"))
        self.entries.clear()
        self._free.clear()
        self._next_slot = 0

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        self.calls.append(Call("on_new_request", ctx.req_id))
        return RequestOffloadingContext(self.policy)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.calls.append(Call("on_request_finished", ctx.req_id))

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.calls.append(Call("on_schedule_end", extra=ctx))

    def pinned(self) -> dict[OffloadKey, int]:
        """Keys with readers, and how many."""
        return {k: e.ref for k, e in self.entries.items() if e.ref > 0}

    def write_pending(self) -> list[OffloadKey]:
        """Keys whose store has not completed."""
        return [k for k, e in self.entries.items() if e.ref < 0]
