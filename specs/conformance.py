"""A Hypothesis conformance machine for any :class:`~statecore.manager.OffloadingManager`.

:func:`make_manager_conformance` builds a ``RuleBasedStateMachine`` that drives a manager the
way a scheduler does (lookups, loads, stores with success and failure, touches, events, resets,
step ends) next to a small, obviously correct model of what the manager must hold, and checks
after every step:

* **INV-PIN**: a key pinned by an outstanding load stays ``HIT``; releases never go below zero;
  ``complete_load`` on an unpinned key raises ``PinUnderflowError`` and releases nothing.
* **INV-EVICT**: no victim is pinned, write-pending or one of the offered keys; in exact mode
  ``prepare_store`` returns ``None`` exactly when the idle, unprotected keys cannot make room,
  and evicts exactly the shortfall; a ``None`` changes nothing.
* **INV-NO-PARTIAL**: a key whose store failed, and which was never stored successfully, is
  never ``HIT`` and never announced in a stored event.
* typed errors: unknown keys, write-pending keys and unpinned keys are rejected with
  ``UnknownKeyError``/``KeyNotReadyError``/``PinUnderflowError`` and leave the state unchanged.
* the manager's own counters (optional) against the model.
* **slot reuse** (optional, with ``slot_of``): a primary slot freed by ``reset_cache`` (it held
  a write-pending or pinned key) or by ``complete_store(success=False)`` may still be touched
  by a GPU transfer until the workers execute the next step's flush, so a key the manager
  starts writing itself (a promotion: ``HIT_PENDING`` without a store from the machine) never
  gets such a slot before the second ``on_schedule_end`` after it was freed. A store the
  machine makes may reuse the slot at once (the workers order it after the flush), which
  ends the slot's quarantine.

Use it from a test module::

    from statecore.specs.conformance import make_manager_conformance
    from mypkg import MyManager

    TestMine = make_manager_conformance(
        lambda: MyManager(capacity=8),
        capacity=8,
        exact=True,          # a plain cache: stores every new key, evicts only when needed
        events=True,         # stored/removed events replay to the set of ready keys
        counters=lambda m: m.counters_dict(),  # optional: evictable, write_pending, keys, pinned
        slot_of=lambda m, key: m.slot_of(key),   # optional: check the slot-reuse rule
    ).TestCase

``exact=False`` is for composite managers that may hold more than their store results say
(a tiering manager promotes keys back from lower tiers): the model then checks only what it
knows for sure (its own pending stores and pins, keys never stored successfully).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from statecore.errors import (
    KeyNotReadyError,
    ManagerError,
    PinUnderflowError,
    UnknownKeyError,
)
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
)

__all__ = ["LoadJob", "StoreJob", "make_manager_conformance"]


@dataclass(frozen=True, slots=True)
class StoreJob:
    """A non-empty ``prepare_store`` result awaiting its completion."""

    keys: tuple[OffloadKey, ...]
    req: int
    epoch: int


@dataclass(frozen=True, slots=True)
class LoadJob:
    """A ``prepare_load`` awaiting its ``complete_load``."""

    keys: tuple[OffloadKey, ...]
    req: int
    epoch: int
    slots: tuple[int, ...] = ()
    """The pinned slots (CPU load specs), co-indexed with ``keys``."""


def _universe(n: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([i + 1]) * 8, i % 2) for i in range(n)]


def make_manager_conformance(
    factory: Callable[[], OffloadingManager],
    capacity: int,
    *,
    exact: bool = True,
    events: bool = False,
    counters: Callable[[Any], Mapping[str, int]] | None = None,
    self_check: Callable[[Any], None] | None = None,
    slot_of: Callable[[Any, OffloadKey], int | None] | None = None,
    num_keys: int | None = None,
    num_requests: int = 2,
    step_count: int = 30,
) -> type[RuleBasedStateMachine]:
    """Build a conformance state machine for the managers ``factory`` returns.

    Args:
        factory: makes a fresh manager (called once per test case).
        capacity: how many keys the manager holds (exact mode checks it).
        exact: the manager is a plain cache: it stores every offered new key, evicts exactly
            the shortfall and only then, and holds nothing its results do not report.
        events: the manager records events; stored/removed events must replay to the set of
            ready keys (exact mode) and never name a key that was never stored.
        counters: returns the manager's counters; any of ``evictable``, ``write_pending``,
            ``pinned`` and ``keys`` present are compared with the model; with ``free`` and
            ``quarantined`` present, quarantined slots must be free ones.
        self_check: called after every step; raises on an internal inconsistency.
        slot_of: the primary slot a present key occupies (``None`` if absent); with it the
            slot-reuse rule is checked on every key the manager writes by itself (needs CPU
            store and load specs).
        num_keys: size of the key universe (default ``3 * capacity``, at least 4).
        num_requests: how many request contexts the calls rotate through.
        step_count: steps per test case.

    Returns:
        The machine class; its ``TestCase`` attribute is a ``unittest.TestCase``.
    """
    universe = _universe(num_keys if num_keys is not None else max(4, 3 * capacity))
    key_st = st.sampled_from(universe)

    class ManagerConformance(RuleBasedStateMachine):
        """Drives one manager against the model (see :mod:`statecore.specs.conformance`)."""

        stores = Bundle("stores")
        loads = Bundle("loads")

        def __init__(self) -> None:
            super().__init__()
            self.sut = factory()
            self.ctxs = [ReqContext(f"req-{i}") for i in range(num_requests)]
            for ctx in self.ctxs:
                self.sut.on_new_request(ctx)
            self.epoch = 0
            self.pending: set[OffloadKey] = set()
            self.pins: Counter[OffloadKey] = Counter()
            self.ready: set[OffloadKey] = set()  # exact mode: present and ready
            self.slots: dict[OffloadKey, int] = {}  # exact mode, CPU specs: key -> slot
            self.ever_stored: set[OffloadKey] = set()
            self.event_view: set[OffloadKey] = set()
            # slot-reuse rule: slots of the machine's pending stores and outstanding loads, and
            # quarantined slot -> number of step ends from which a promotion may take it
            self.ends = 0
            self.pending_slot: dict[OffloadKey, int] = {}
            self.load_slots: Counter[int] = Counter()
            self.quarantine: dict[int, int] = {}

        # -- model helpers ---------------------------------------------------------------------

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

        def _lookup(self, key: OffloadKey, req: int = 0) -> LookupResult:
            got = self.sut.lookup(key, self.ctxs[req])
            if slot_of is not None and got is LookupResult.HIT_PENDING and key not in self.pending:
                slot = slot_of(self.sut, key)
                if slot is not None and slot in self.quarantine:
                    raise AssertionError(
                        f"slot reuse: {key.hex()} is written by the manager into slot {slot}, "
                        f"freed with transfers possibly in flight; safe only from step end "
                        f"{self.quarantine[slot]}, now {self.ends}"
                    )
            want = self._expected(key)
            if want is not None:
                assert got == want, f"lookup({key.hex()}) = {got!r}, model says {want!r}"
            else:
                assert got != LookupResult.HIT or key in self.ever_stored
            return got

        def _absent(self) -> list[OffloadKey]:
            """Keys certainly absent from the manager."""
            if exact:
                return [k for k in universe if k not in self.ready and k not in self.pending]
            return [k for k in universe if k not in self.ever_stored and k not in self.pending]

        def _quarantine(self, slots: Sequence[int]) -> None:
            for slot in slots:
                self.quarantine[slot] = self.ends + 2

        # -- stores ----------------------------------------------------------------------------

        @rule(
            target=stores,
            keys=st.lists(key_st, min_size=1, max_size=4),
            req=st.integers(0, num_requests - 1),
        )
        def prepare_store(self, keys: list[OffloadKey], req: int) -> Any:
            present = self.ready | self.pending
            new = [k for k in dict.fromkeys(keys) if k not in present]
            offered = set(keys)
            idle = [k for k in self.ready if self.pins[k] == 0 and k not in offered]
            need = len(new) - (capacity - len(present))
            out = self.sut.prepare_store(keys, self.ctxs[req])
            if out is None:
                if exact:
                    assert new and need > len(idle), (
                        f"INV-EVICT: prepare_store refused {len(new)} new keys with "
                        f"{capacity - len(present)} free and {len(idle)} evictable"
                    )
                return multiple()
            stored = out.keys_to_store
            assert len(set(stored)) == len(stored), "keys_to_store has duplicates"
            assert set(stored) <= offered, "keys_to_store names a key that was not offered"
            for k in stored:
                assert k not in self.pending and self.pins[k] == 0, (
                    f"prepare_store re-allocated present key {k.hex()}"
                )
            order = [k for k in dict.fromkeys(keys) if k in set(stored)]
            assert list(stored) == order, "keys_to_store is not in offered order"
            if exact:
                assert list(stored) == new, f"exact: expected to store {len(new)} new keys"
            for k in out.evicted_keys:
                assert k not in offered, f"INV-EVICT: evicted offered key {k.hex()}"
                assert self.pins[k] == 0, f"INV-EVICT: evicted pinned key {k.hex()}"
                assert k not in self.pending, f"INV-EVICT: evicted write-pending key {k.hex()}"
                if exact:
                    assert k in self.ready, f"INV-EVICT: evicted unknown key {k.hex()}"
            if exact:
                assert len(out.evicted_keys) == max(0, need) if stored else not out.evicted_keys
            for k in out.evicted_keys:
                self.ready.discard(k)
                self.slots.pop(k, None)
            spec = out.store_spec
            if isinstance(spec, CPULoadStoreSpec):
                assert len(spec.slots) == len(stored)
                assert len(set(spec.slots)) == len(spec.slots), "two keys share a slot"
                if exact:
                    used = set(self.slots.values())
                    for k, s in zip(stored, spec.slots, strict=True):
                        assert 0 <= s < capacity, f"slot {s} out of range"
                        assert s not in used, f"slot {s} handed out while still in use"
                        self.slots[k] = s
                for k, s in zip(stored, spec.slots, strict=True):
                    self.pending_slot[k] = s
                    self.quarantine.pop(s, None)  # reused by a store the workers order
            self.pending.update(stored)
            if not stored:
                return multiple()
            return StoreJob(tuple(stored), req, self.epoch)

        @rule(job=consumes(stores), success=st.booleans())
        def complete_store(self, job: StoreJob, success: bool) -> None:
            if job.epoch != self.epoch:
                return  # discarded by reset_cache: no completion (INV-TERM)
            self.sut.complete_store(job.keys, self.ctxs[job.req], success)
            freed = [self.pending_slot.pop(k) for k in job.keys if k in self.pending_slot]
            if not success:
                self._quarantine(freed)
            for k in job.keys:
                self.pending.discard(k)
                if success:
                    self.ready.add(k)
                    self.ever_stored.add(k)
                else:
                    self.slots.pop(k, None)
            if not success:
                for k in job.keys:
                    got = self._lookup(k, job.req)
                    assert got != LookupResult.HIT or k in self.ever_stored, (
                        f"INV-NO-PARTIAL: failed store's key {k.hex()} is HIT"
                    )

        # -- loads -----------------------------------------------------------------------------

        @rule(target=loads, data=st.data(), req=st.integers(0, num_requests - 1))
        def prepare_load(self, data: st.DataObject, req: int) -> Any:
            pool = sorted(self.ready if exact else self.ever_stored)
            if not pool:
                return multiple()
            picked = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
            keys = [k for k in picked if self._lookup(k, req) == LookupResult.HIT]
            if not keys:
                return multiple()
            spec = self.sut.prepare_load(keys, self.ctxs[req])
            if isinstance(spec, CPULoadStoreSpec):
                assert len(spec.slots) == len(keys), "load spec not co-indexed with keys"
                if exact and self.slots:
                    assert list(spec.slots) == [self.slots[k] for k in keys]
                self.load_slots.update(spec.slots)
            for k in keys:
                self.pins[k] += 1
                if not exact:
                    self.ready.add(k)
            slots = spec.slots if isinstance(spec, CPULoadStoreSpec) else ()
            return LoadJob(tuple(keys), req, self.epoch, tuple(slots))

        @rule(job=consumes(loads))
        def complete_load(self, job: LoadJob) -> None:
            if job.epoch != self.epoch:
                return
            self.sut.complete_load(job.keys, self.ctxs[job.req])
            self.load_slots.subtract(job.slots)
            self.load_slots += Counter()
            self.pins.subtract(job.keys)
            self.pins += Counter()  # drop zero counts

        @rule(
            key=key_st,
            touch=st.lists(key_st, max_size=4),
            req=st.integers(0, num_requests - 1),
        )
        def lookup_and_touch(self, key: OffloadKey, touch: list[OffloadKey], req: int) -> None:
            self._lookup(key, req)
            if touch:
                self.sut.touch(touch, self.ctxs[req])

        @rule(take_events=st.booleans())
        def end_step(self, take_events: bool) -> None:
            self.sut.on_schedule_end(ScheduleEndContext())
            self.ends += 1
            self.quarantine = {s: n for s, n in self.quarantine.items() if n > self.ends}
            if not take_events:
                return
            for ev in self.sut.take_events():
                if ev.removed:
                    self.event_view.difference_update(ev.keys)
                else:
                    for k in ev.keys:
                        assert k in self.ever_stored, (
                            f"INV-NO-PARTIAL: stored event for never-stored key {k.hex()}"
                        )
                    self.event_view.update(ev.keys)
            if events and exact:
                assert self.event_view == self.ready, "events do not replay to the ready keys"

        @rule(dice=st.integers(0, 3))
        def reset_cache(self, dice: int) -> None:
            if dice:  # resets wipe everything: keep them rarer than the other rules
                return
            self.sut.reset_cache()
            self._quarantine([*self.pending_slot.values(), *self.load_slots])
            self.pending_slot.clear()
            self.load_slots.clear()
            self.epoch += 1
            self.pending.clear()
            self.pins.clear()
            self.ready.clear()
            self.slots.clear()

        # -- bad inputs: typed errors, state unchanged (the invariants re-check it) ---------

        def _unpinned_ready(self, req: int) -> list[OffloadKey]:
            """Ready keys nobody pins (exact mode only: a composite manager may hold hidden
            pins, e.g. a tiering manager's cascade reads, which a stray release would drop)."""
            if not exact:
                return []
            return [k for k in sorted(self.ready) if self.pins[k] == 0]

        @rule(
            kind=st.sampled_from(
                ["load-unknown", "load-pending", "release-unknown", "release-unpinned"]
            ),
            data=st.data(),
            req=st.integers(0, num_requests - 1),
        )
        def bad_input(self, kind: str, data: st.DataObject, req: int) -> None:
            absent = self._absent()
            idle = [
                k for k in self._unpinned_ready(req) if self._lookup(k, req) is LookupResult.HIT
            ]
            if kind == "load-unknown" and absent:
                bad = data.draw(st.sampled_from(absent))
                good = idle[:1] if data.draw(st.booleans()) else []
                self._expect(UnknownKeyError, self.sut.prepare_load, [*good, bad], req)
                for k in good:  # the good key must not have been pinned
                    self._expect(PinUnderflowError, self.sut.complete_load, [k], req)
            elif kind == "load-pending" and self.pending:
                key = data.draw(st.sampled_from(sorted(self.pending)))
                good = idle[:1] if data.draw(st.booleans()) else []
                self._expect(KeyNotReadyError, self.sut.prepare_load, [*good, key], req)
                for k in good:
                    self._expect(PinUnderflowError, self.sut.complete_load, [k], req)
            elif kind == "release-unknown" and absent:
                key = data.draw(st.sampled_from(absent))
                self._expect(UnknownKeyError, self.sut.complete_load, [key], req)
            elif kind == "release-unpinned" and (idle or self.pending):
                key = data.draw(st.sampled_from(idle + sorted(self.pending)))
                if key in self.pending:
                    self._expect(
                        (PinUnderflowError, KeyNotReadyError), self.sut.complete_load, [key], req
                    )
                else:
                    self._expect(PinUnderflowError, self.sut.complete_load, [key], req)

        def _expect(
            self,
            exc: type[ManagerError] | tuple[type[ManagerError], ...],
            call: Callable[[Sequence[OffloadKey], ReqContext], object],
            keys: list[OffloadKey],
            req: int,
        ) -> None:
            try:
                call(keys, self.ctxs[req])
            except exc:
                return
            raise AssertionError(f"{call.__name__}({[k.hex() for k in keys]}) did not raise")

        # -- invariants ------------------------------------------------------------------------

        @invariant()
        def pins_and_pending_visible(self) -> None:
            for k in sorted(self.pending):
                self._lookup(k)
            for k in sorted(k for k, n in self.pins.items() if n > 0):
                self._lookup(k)

        @invariant()
        def counters_match(self) -> None:
            if counters is not None:
                c = counters(self.sut)
                pinned = sum(1 for n in self.pins.values() if n > 0)
                idle = sum(1 for k in self.ready if self.pins[k] == 0)
                if exact:
                    want = {
                        "write_pending": len(self.pending),
                        "pinned": pinned,
                        "evictable": idle,
                        "keys": len(self.ready) + len(self.pending),
                    }
                    for name, value in want.items():
                        if name in c:
                            assert c[name] == value, f"counter {name}={c[name]}, model {value}"
                else:
                    assert c.get("write_pending", len(self.pending)) >= len(self.pending)
                    assert c.get("pinned", pinned) >= pinned
                if "free" in c and "quarantined" in c:
                    assert 0 <= c["quarantined"] <= c["free"], "a quarantined slot is in use"
            if self_check is not None:
                self_check(self.sut)

        def teardown(self) -> None:
            self.sut.shutdown()

    ManagerConformance.TestCase.settings = settings(stateful_step_count=step_count, deadline=None)
    return ManagerConformance
