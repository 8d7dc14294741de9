"""The CPU tier: a directory of chunk slots in the shared CPU pool.

Each present key has a slot id and a reference count:

* ``-1``: write-pending (allocated by ``prepare_store``, its write is in flight); lookup
  answers ``HIT_PENDING``; never evicted.
* ``0``: ready and idle; lookup answers ``HIT``; the only evictable state.
* ``n > 0``: ready and pinned by ``n`` readers (loads to the GPU, cascades to a secondary
  tier); never evicted.

Slots are handed out fresh in ascending order first, then recycled last-freed first.

Quarantine (the slot-reuse rule): a slot freed by ``reset_cache`` (it held a write-pending or
pinned key) or by a failed ``complete_store`` may still be written or read by a GPU transfer
until the workers have executed the flush that the scheduler puts in the next step's metadata.
Such a slot is marked *quarantined* until the second ``on_schedule_end`` after it was freed.
Stores and loads the scheduler submits are ordered after that flush by the workers, so
``prepare_store`` may reuse a quarantined slot at once (and the mark is dropped: the slot's
next release is governed by the new key). Only allocations for writers outside the workers
(promotions from a secondary tier, ``prepare_write(skip_quarantined=True)``) skip it.
Quarantined slots are always free slots; they count in ``num_free``.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial
from itertools import compress, filterfalse, takewhile
from operator import add, gt, is_not
from typing import Any

from statecore import validate
from statecore.errors import (
    ConfigError,
    InvariantViolation,
    KeyNotReadyError,
    PinUnderflowError,
    StatecoreError,
    UnknownKeyError,
    describe,
)
from statecore.keys import OffloadKey
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from statecore.managers.keyorder import DistinctKeys, KeyTable
from statecore.managers.policies import (
    BUILTIN_POLICIES,
    PRESIZE_LIMIT,
    CachePolicy,
    RequestCachePolicy,
    allocation_plan,
    pin_counts,
    unpin_counts,
    usage_gauges,
)

__all__ = ["CPUManagerCounters", "CPUOffloadingManager", "WritePendingPinError"]


class WritePendingPinError(PinUnderflowError):
    """``complete_load`` for a key whose write is still pending (it cannot be pinned)."""

    def __init__(self, key: bytes, call: str) -> None:
        super().__init__(key, call, "write-pending, not pinned (ref count -1)")


@dataclass(frozen=True, slots=True)
class CPUManagerCounters:
    """A snapshot of the CPU tier's bookkeeping (for tests, specs and dashboards).

    Attributes:
        capacity: number of slots.
        keys: present keys (any state).
        evictable: keys with reference count 0.
        write_pending: keys with reference count -1.
        pinned: keys with reference count > 0.
        free: slots not holding a key (quarantined ones included).
        high_water: fresh slot ids handed out so far.
        quarantined: free slots that promotions must not take yet (see the module docstring).
        schedule_ends: ``on_schedule_end`` calls so far (the quarantine clock).
    """

    capacity: int
    keys: int
    evictable: int
    write_pending: int
    pinned: int
    free: int
    high_water: int
    quarantined: int = 0
    schedule_ends: int = 0


_BYTES_ONLY = {bytes}
_SEQ = (list, tuple)
_PRESENT = partial(is_not, None)
_MISS, _HIT, _PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING

_Entry = int
"""A present key's reference count and slot in one int: ``(ref + 1) * _ONE + slot``.

The reference count is -1 (write-pending: the entry is the slot itself), 0 (idle: ``_ONE``
plus the slot) or n (pinned n times). An int, replaced when the count changes: the cyclic
garbage collector does not track ints, so neither a tier of a million keys (a full
collection's traversal) nor a store job's new keys (the allocations that trigger young
collections, inside the connector's hooks) cost it anything. An object per key, then a
tuple per key, did; those pauses were the tail of the connector's per-step cost."""

_SHIFT = 40
_ONE = 1 << _SHIFT
"""One reference in an entry."""
_MASK = _ONE - 1
MAX_SLOTS = _ONE
"""The most slots a CPU tier may have (slot ids fit under the reference count)."""


def _entry(ref: int, slot: int) -> _Entry:
    """The entry of a key with reference count ``ref`` in ``slot``."""
    return (ref + 1) * _ONE + slot


def _ref(entry: _Entry) -> int:
    """An entry's reference count."""
    return (entry >> _SHIFT) - 1


def _slot(entry: _Entry) -> int:
    """An entry's slot."""
    return entry & _MASK


_TWO = 2 * _ONE
"""Entries below this are write-pending or idle; at or above it, pinned."""
_THREE = 3 * _ONE
# (C-speed maps over entries: operator functions, which also take CrossHair's symbolic ints)
_add_one = partial(add, _ONE)
_drop_one = partial(add, -_ONE)
_below_two = partial(gt, _TWO)
_below_three = partial(gt, _THREE)


def pinned_entries(entries: list[_Entry], evictable: int) -> tuple[list[_Entry], int]:
    """The entries of distinct ready keys after one more pin each, and the evictable count.

    The batch form of :func:`~statecore.managers.policies.pin_counts`, over entries (a pin
    adds one reference: ``_ONE``); the keys that were idle leave the evictable count.

    pre: all(e >= _ONE for e in entries)
    pre: evictable >= sum(1 for e in entries if e < _TWO)
    post: len(__return__[0]) == len(entries)
    post: all(_ref(a) == _ref(e) + 1 for a, e in zip(__return__[0], entries))
    post: all(_slot(a) == _slot(e) for a, e in zip(__return__[0], entries))
    post: __return__[1] == evictable - sum(1 for e in entries if _ref(e) == 0)
    post: __return__[1] >= 0
    """
    return list(map(_add_one, entries)), evictable - sum(map(_below_two, entries))


def unpinned_entries(entries: list[_Entry], evictable: int) -> tuple[list[_Entry], int]:
    """The entries of distinct pinned keys after one pin each is released, and the evictable
    count (the keys whose last pin this was join it).

    The batch form of :func:`~statecore.managers.policies.unpin_counts`, over entries.

    pre: all(e >= _TWO for e in entries)
    pre: evictable >= 0
    post: len(__return__[0]) == len(entries)
    post: all(_ref(a) == _ref(e) - 1 >= 0 for a, e in zip(__return__[0], entries))
    post: all(_slot(a) == _slot(e) for a, e in zip(__return__[0], entries))
    post: __return__[1] == evictable + sum(1 for e in entries if _ref(e) == 1)
    """
    return list(map(_drop_one, entries)), evictable + sum(map(_below_three, entries))


def _batch_form(policy: CachePolicy, hook: str) -> Callable[[list[OffloadKey]], None] | None:
    """``policy``'s optional batch form of ``hook`` (``hook + "_many"``), or ``None``: when the
    policy has none, or its batch form is inherited from above the class that defines ``hook``
    (a subclass that overrides only the single-key hook must have that override called)."""
    many = getattr(policy, hook + "_many", None)
    if many is None:
        return None
    own = getattr(policy, "__dict__", {})
    if hook in own or hook + "_many" in own:  # set on the instance: the batch form only with it
        return many if hook + "_many" in own else None
    mro = type(policy).__mro__
    single_owner = next((c for c in mro if hook in vars(c)), None)
    many_owner = next((c for c in mro if hook + "_many" in vars(c)), None)
    if single_owner is None or many_owner is None:  # (a __getattr__ policy): as it answers
        return many  # type: ignore[no-any-return]
    return many if issubclass(many_owner, single_owner) else None


def _resolve_policy(policy: str | CachePolicy, capacity: int) -> CachePolicy:
    if not isinstance(policy, str):
        if not isinstance(policy, CachePolicy):
            raise ConfigError(
                "CPUOffloadingManager.policy must be 'lru', 'arc', 'package.module:Class' or a "
                f"CachePolicy, got {describe(policy)}",
                "CPUOffloadingManager.policy",
                policy,
            )
        return policy
    builtin = BUILTIN_POLICIES.get(policy)
    if builtin is not None:
        return builtin(capacity)
    if ":" not in policy:
        raise ConfigError(
            f"unknown cache policy {policy!r}: use 'lru', 'arc' or 'package.module:Class'"
        )
    module_name, _, attr = policy.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cache policy {policy!r} cannot be imported: {exc}") from exc
    instance = cls(capacity)
    if not isinstance(instance, CachePolicy):
        raise ConfigError(f"cache policy {policy!r} does not implement CachePolicy")
    return instance


_ACCESS_SCRATCH = "cpu-request-access"
REUSE_COUNTS = ("offers", "lookups")
"""What the reuse filter (``store_threshold``) counts: store offers (vLLM 0.33) or lookups."""


class _RequestAccess:
    """The keys one request observed (loads and store offers), for a request-aware policy."""

    __slots__ = (
        "finished",
        "generation",
        "groups",
        "inserted",
        "owner",
        "reused",
        "seen",
        "store_missed",
    )

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.groups: dict[int, list[OffloadKey]] = {}
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_missed: set[OffloadKey] = set()
        self.finished = False


class CPUOffloadingManager(OffloadingManager):
    """Single-tier manager over ``num_slots`` slots of the shared CPU pool.

    Args:
        num_slots: capacity in chunks (one slot per chunk and group).
        policy: ``"lru"``, ``"arc"``, an import path ``"package.module:Class"`` (constructed
            with the capacity) or a :class:`~statecore.managers.policies.CachePolicy`.
        enable_events: record stored/removed :class:`OffloadingEvent` s (medium CPU).
        store_threshold: with 2 or more, only keys counted at least that many times are
            stored (reuse filter); 0 and 1 disable it.
        max_tracker_size: how many keys the reuse filter remembers (oldest dropped first).
        reuse_counts: what the reuse filter counts: ``"lookups"`` (each lookup of the key;
            the default) or ``"offers"`` (each store offer of the key, as vLLM 0.33 counts:
            the keys of an offer are counted before it is filtered, and keys already tracked
            that the offer names are not dropped to make room for its new ones).

    A request-aware policy (:class:`~statecore.managers.policies.RequestCachePolicy`, such as
    ``"request-lru"`` and ``"request-arc"``) also sees request boundaries: the manager records
    the keys each request loads and offers (in ``ctx.scratch``) and hands them to the policy
    when the request finishes, and asks the scheduler for key positions
    (:attr:`wants_key_positions`).
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_slots: int,
        policy: str | CachePolicy = "lru",
        enable_events: bool = True,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        reuse_counts: str = "lookups",
    ) -> None:
        owner = "CPUOffloadingManager"
        if reuse_counts not in REUSE_COUNTS:
            raise ConfigError(
                f"{owner}.reuse_counts must be 'offers' or 'lookups', got {reuse_counts!r}",
                f"{owner}.reuse_counts",
                reuse_counts,
            )
        validate.config_int(owner, "num_slots", num_slots, 0)
        if num_slots > MAX_SLOTS:
            raise ConfigError(
                f"{owner}.num_slots must be at most {MAX_SLOTS}, got {num_slots}",
                f"{owner}.num_slots",
                num_slots,
            )
        validate.config_bool(owner, "enable_events", enable_events)
        validate.config_int(owner, "store_threshold", store_threshold, 0)
        validate.config_int(owner, "max_tracker_size", max_tracker_size, 1)
        self.capacity = num_slots
        self.policy: CachePolicy = _resolve_policy(policy, num_slots)
        self._pin_many = _batch_form(self.policy, "mark_non_evictable")
        self._request_policy: RequestCachePolicy | None = (
            self.policy if isinstance(self.policy, RequestCachePolicy) else None
        )
        self.wants_key_positions = self._request_policy is not None
        self._generation = 0  # reset_cache count: request state from before is void
        self.reuse_counts = reuse_counts
        self.enable_events = enable_events
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        # key -> _entry(ref, slot), insertion-ordered as a dict, sized once for the tier: no
        # table rebuild while the tier fills or churns (a dict's growth was the one-step stall
        # at the tail of the connector's per-step cost: 0.4 ms at 11,000 keys, 99 ms at 1.4
        # million), and nothing for the collector to traverse
        self._entries: KeyTable = KeyTable(min(num_slots, PRESIZE_LIMIT))
        self._high_water = 0
        self._free: list[int] = []
        self._evictable = 0
        self._write_pending = 0
        self._events: list[OffloadingEvent] = []
        # allocation size -> how many stores allocated that many slots since the last
        # get_stats: bounded by the distinct sizes, not by the stores (an engine that never
        # asks for stats must not make the manager grow with every job)
        self._alloc_sizes: Counter[int] = Counter()
        self._stores_skipped = 0
        # Quarantined free slots -> the schedule-end count from which promotions may take
        # them. Insertion order is release order (every mark is "now + 2").
        self._quarantine: OrderedDict[int, int] = OrderedDict()
        self._schedule_ends = 0
        self._tracker: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        # the tracker counted by lookup, or None (no filter, or it counts offers)
        self._lookup_tracker = self._tracker if reuse_counts == "lookups" else None

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """MISS, HIT_PENDING (write in flight) or HIT; counts the lookup for the reuse filter."""
        if type(key) is not bytes or len(key) < 4:
            validate.offload_key(key, "lookup")
        tracker = self._lookup_tracker
        if tracker is not None:
            count = tracker.pop(key, 0)
            if count == 0 and len(tracker) >= self.max_tracker_size:
                tracker.popitem(last=False)
            tracker[key] = count + 1
        entry = self._entries.get(key)
        if entry is None:
            return LookupResult.MISS
        return LookupResult.HIT if entry >= _ONE else LookupResult.HIT_PENDING

    def lookup_many(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, until_miss: bool = False
    ) -> list[LookupResult]:
        """:meth:`lookup` of each key in order (see the contract); in bulk unless the reuse
        filter counts lookups or a key needs the argument check."""
        if self._lookup_tracker is not None or type(keys) not in _SEQ:
            return super().lookup_many(keys, ctx, until_miss)
        try:  # (an unhashable key: the per-key path raises what lookup raises)
            if until_miss:  # the hits up to the first miss, and only those keys are looked at
                got: list[Any] = list(takewhile(_PRESENT, map(self._entries.get, keys)))
                looked = keys[: len(got) + 1]
            else:
                got = list(map(self._entries.get, keys))
                looked = keys
        except TypeError:
            return super().lookup_many(keys, ctx, until_miss)
        if looked and (set(map(type, looked)) != _BYTES_ONLY or min(map(len, looked)) < 4):
            return super().lookup_many(keys, ctx, until_miss)
        if got and None not in got and min(got) >= _ONE:  # every key ready (a shared prefix)
            out = [_HIT] * len(got)
        else:
            out = [_MISS if e is None else _HIT if e >= _ONE else _PENDING for e in got]
        if until_miss and len(got) < len(keys):
            out.append(_MISS)
        return out

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot holding ``key``, or ``None`` when absent."""
        entry = self._entries.get(key)
        return None if entry is None else entry & _MASK

    def ref_count(self, key: OffloadKey) -> int | None:
        """``key``'s reference count (-1 write-pending, 0 idle, n pinned), ``None`` if absent."""
        entry = self._entries.get(key)
        return None if entry is None else _ref(entry)

    def is_ready(self, key: OffloadKey) -> bool:
        """Whether ``key`` is present and readable."""
        entry = self._entries.get(key)
        return entry is not None and entry >= _ONE

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def present_keys(self) -> list[OffloadKey]:
        """Every present key (any state)."""
        return list(self._entries)

    def ready_keys(self) -> list[OffloadKey]:
        """Every readable key (present and not write-pending): what its stored/removed events
        announce."""
        return [k for k, e in self._entries.items() if e >= _ONE]

    @property
    def num_free(self) -> int:
        """Slots not holding a key."""
        return len(self._free) + self.capacity - self._high_water

    def counters(self) -> CPUManagerCounters:
        """The incrementally maintained counters (O(1))."""
        keys = len(self._entries)
        return CPUManagerCounters(
            capacity=self.capacity,
            keys=keys,
            evictable=self._evictable,
            write_pending=self._write_pending,
            pinned=keys - self._evictable - self._write_pending,
            free=self.num_free,
            high_water=self._high_water,
            quarantined=len(self._quarantine),
            schedule_ends=self._schedule_ends,
        )

    def index_bytes(self) -> int:
        """Bytes of the key table's and the eviction policy's hash tables (``sys.getsizeof``
        of the table and of every dict, set or key list the policy holds; O(the policy's
        attributes)).

        The key table (a :class:`~statecore.managers.keyorder.KeyTable`) and the LRU policy's
        :class:`~statecore.managers.keyorder.KeyOrder` are sized for the capacity at
        construction and count in full from the start (where the C extension is not built,
        the key table is a dict, which grows in steps while the tier fills and once more when
        eviction first churns a full tier)."""
        total = sys.getsizeof(self._entries)
        policy = self.policy
        names: Iterable[str] = getattr(type(policy), "__slots__", ()) or vars(policy)
        for name in names:
            held = getattr(policy, name, None)
            if isinstance(held, dict | set | frozenset | DistinctKeys):
                total += sys.getsizeof(held)
        return total

    @property
    def num_free_for_promotion(self) -> int:
        """Free slots a promotion may take now (free slots that are not quarantined)."""
        return self.num_free - len(self._quarantine)

    def is_quarantined(self, slot: int) -> bool:
        """Whether ``slot`` is free but must not be handed to a promotion yet."""
        return slot in self._quarantine

    def check_invariants(self) -> None:
        """Recount everything from scratch and raise :class:`InvariantViolation` on a mismatch.

        O(capacity): for tests and checked mode, not for the hot path.
        """
        refs = [_ref(e) for e in self._entries.values()]
        if any(r < -1 for r in refs):
            raise InvariantViolation("INV-PIN", "a reference count is below -1")
        idle = sum(1 for r in refs if r == 0)
        pending = sum(1 for r in refs if r == -1)
        if idle != self._evictable:
            raise InvariantViolation(
                "INV-EVICT", f"evictable counter {self._evictable} but {idle} idle keys"
            )
        if pending != self._write_pending:
            raise InvariantViolation(
                "INV-PIN", f"write-pending counter {self._write_pending} but {pending} keys"
            )
        used = [_slot(e) for e in self._entries.values()]
        everything = used + self._free
        if len(set(everything)) != len(everything):
            raise InvariantViolation("INV-EVICT", "a slot is both used and free, or used twice")
        if set(everything) != set(range(self._high_water)) or self._high_water > self.capacity:
            raise InvariantViolation("INV-EVICT", "allocated and free slots do not tile capacity")
        in_use = set(used)
        last_release = 0
        for slot, release in self._quarantine.items():
            if slot in in_use or not 0 <= slot < self.capacity:
                raise InvariantViolation(
                    "INV-EVICT", f"quarantined slot {slot} is not a free slot of this tier"
                )
            if release <= self._schedule_ends or release < last_release:
                raise InvariantViolation(
                    "INV-EVICT",
                    f"quarantined slot {slot} expires at schedule end {release}: expired "
                    f"(now {self._schedule_ends}) or out of release order",
                )
            last_release = release
        evictable_keys = getattr(self.policy, "evictable_keys", None)
        if callable(evictable_keys):
            listed = set(evictable_keys())
            want = {k for k, e in self._entries.items() if _ref(e) == 0}
            if listed != want:
                raise InvariantViolation(
                    "INV-EVICT", "the policy's evictable keys differ from the idle keys"
                )

    # -- loads ----------------------------------------------------------------------------------

    def _validate_pinnable(self, keys: Sequence[OffloadKey], call: str) -> list[int]:
        """The slots of ``keys``, all present and ready; raises (nothing changed) else.

        Validation by lookup: a present key is a valid key (only validated keys are ever
        stored), so the argument checks of :mod:`statecore.validate` run on the error path
        only (a missing key, an unhashable one, ``keys`` not iterable).
        """
        slots: list[int] = []
        get = self._entries.get
        try:
            for key in keys:
                entry = get(key)
                if entry is None:
                    validate.offload_keys(keys, call)
                    raise UnknownKeyError(key, call)
                if entry < _ONE:
                    raise KeyNotReadyError(key, call)
                slots.append(entry & _MASK)
        except TypeError as exc:
            if isinstance(exc, StatecoreError):
                raise
            validate.offload_keys(keys, call)
            raise
        return slots

    def _entries_of(self, keys: Sequence[OffloadKey]) -> list[Any]:
        """Each key's entry (``None`` when absent), at C speed, for the batch paths of loads;
        empty when ``keys`` is not a list or tuple (a one-shot iterable) or holds an
        unhashable key: the per-key path then refuses it with the error it names."""
        if type(keys) not in _SEQ:
            return []
        try:
            return list(map(self._entries.get, keys))
        except TypeError:
            return []

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        """Pin ``keys``; their slot ids, co-indexed with ``keys``. Nothing pinned on error.

        A request-aware policy counts them as reused by the request."""
        spec = self.prepare_read(keys, ctx)
        if self._request_policy is not None:
            self._record_access(keys, ctx, reused=keys)
        return spec

    # -- request access (request-aware policies) ------------------------------------------------

    def _access(self, ctx: ReqContext) -> _RequestAccess:
        """``ctx``'s access record for this manager (a new one after ``reset_cache``)."""
        state = ctx.scratch.get(_ACCESS_SCRATCH)
        if (
            not isinstance(state, _RequestAccess)
            or state.owner is not self
            or state.generation != self._generation
        ):
            state = _RequestAccess(self, self._generation)
            ctx.scratch[_ACCESS_SCRATCH] = state
        return state

    def _record_access(
        self,
        keys: Iterable[OffloadKey],
        ctx: ReqContext,
        reused: Iterable[OffloadKey] = (),
    ) -> None:
        """Note the keys ``ctx``'s request observes (first sightings go to the policy's
        ``on_request_access``) and the ready keys it reuses."""
        policy = self._request_policy
        assert policy is not None  # (callers check)
        state = self._access(ctx)
        seen = state.seen
        new: list[OffloadKey] = []
        if not state.finished:  # (nothing is recorded after the finish: the contract)
            for key in keys:
                if key in seen:
                    continue
                state.groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
                seen.add(key)
                new.append(key)
        if new:
            policy.on_request_access(new, ctx)
        inserted = state.inserted
        # re-reading a key this request inserted (a cascade) is not a second access
        state.reused.update(k for k in reused if k not in inserted)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading; a request-aware policy's record of the request starts."""
        if self._request_policy is not None:
            self._access(ctx)
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Hand the request's accesses to a request-aware policy (once per request)."""
        policy = self._request_policy
        if policy is None:
            return
        state = ctx.scratch.get(_ACCESS_SCRATCH)
        if (
            not isinstance(state, _RequestAccess)
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        positions = ctx.key_positions
        groups: list[tuple[OffloadKey, ...]] = []
        for g in sorted(state.groups):
            keys = state.groups[g]
            if positions is not None and all(k in positions for k in keys):
                keys = sorted(keys, key=positions.__getitem__)
            groups.append(tuple(keys))
        policy.on_request_finished(
            tuple(groups), state.inserted - state.reused, frozenset(state.reused), ctx
        )

    def prepare_read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        """Pin ``keys`` for any reader (GPU load or cascade to a secondary tier)."""
        entries = self._entries
        policy = self.policy
        got = self._entries_of(keys)
        if got and None not in got and min(got) >= _ONE and len(set(keys)) == len(got):
            # the usual load: distinct ready keys (present keys are valid keys); at C speed
            idle = list(compress(keys, map(_below_two, got)))
            if idle:
                if self._pin_many is not None:
                    self._pin_many(idle)
                else:  # a policy without the optional batch form (or that overrides the other)
                    deque(map(policy.mark_non_evictable, idle), 0)
            new, self._evictable = pinned_entries(got, self._evictable)
            entries.update(zip(keys, new, strict=True))
            return CPULoadStoreSpec(tuple([e & _MASK for e in got]))
        slots = self._validate_pinnable(keys, "prepare_load")
        evictable = self._evictable
        for key, slot in zip(keys, slots, strict=True):
            ref = _ref(entries[key])  # (read again: a key listed twice is pinned twice)
            if ref == 0:
                policy.mark_non_evictable(key)
            ref, evictable = pin_counts(ref, evictable)
            entries[key] = _entry(ref, slot)
        self._evictable = evictable
        return CPULoadStoreSpec(tuple(slots))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Release one pin of each key. Nothing released on error."""
        self.complete_read(keys, ctx)

    def complete_read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Release the pins of one :meth:`prepare_read`."""
        call = "complete_load"
        entries = self._entries
        get = entries.get
        got = self._entries_of(keys)
        if got and None not in got and min(got) >= _TWO and len(set(keys)) == len(got):
            # the usual completion: distinct pinned keys, each released once; at C speed
            new, self._evictable = unpinned_entries(got, self._evictable)
            entries.update(zip(keys, new, strict=True))
            idle = list(compress(keys, map(_below_three, got)))
            if idle:  # (in key order, as the per-key path marks them)
                self.policy.mark_evictable_many(idle)
            return
        try:  # validation by lookup, as in _validate_pinnable
            for key in keys:
                entry = get(key)
                if entry is None:
                    validate.offload_keys(keys, call)
                    raise UnknownKeyError(key, call)
                if entry < _ONE:
                    raise WritePendingPinError(key, call)
                if entry < 2 * _ONE:
                    raise PinUnderflowError(key, call)
        except TypeError as exc:
            if isinstance(exc, StatecoreError):
                raise
            validate.offload_keys(keys, call)
            raise
        if len(set(keys)) != len(keys):
            for key, n in Counter(keys).items():
                if _ref(entries[key]) < n:
                    raise PinUnderflowError(key, call)
        policy = self.policy
        evictable = self._evictable
        for key in keys:
            entry = entries[key]  # (read again: a key listed twice is unpinned twice)
            ref, evictable = unpin_counts(_ref(entry), evictable)
            entries[key] = _entry(ref, entry & _MASK)
            if ref == 0:
                policy.mark_evictable(key)
        self._evictable = evictable

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Tell the policy ``keys`` were used (the first key ends up most recent)."""
        validate.offload_keys(keys, "touch")
        self.policy.touch(keys)

    # -- stores ---------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate write-pending slots for the new keys, evicting idle keys if needed."""
        return self.prepare_write(keys, ctx)

    def prepare_write(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        bypass_reuse_filter: bool = False,
        protected: AbstractSet[OffloadKey] = frozenset(),
        skip_quarantined: bool = False,
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_store` with options for composite managers.

        ``bypass_reuse_filter`` admits every key (promotions); ``protected`` keys are never
        evicted, besides ``keys`` themselves (e.g. keys that answered HIT this step);
        ``skip_quarantined`` never hands out a quarantined slot (allocations for writers the
        workers do not order, i.e. promotions): room is made among the other free slots, by
        eviction if needed, and ``None`` is returned when that is impossible.
        """
        entries = self._entries
        tracker = self._tracker
        skipped = 0
        if tracker is not None:
            validate.offload_keys(keys, "prepare_store")
            if self._lookup_tracker is None and not bypass_reuse_filter:
                self._count_offer(keys, tracker)
        if self._request_policy is not None:
            return self._prepare_write_for_request(
                keys, ctx, bypass_reuse_filter, protected, skip_quarantined
            )
        if tracker is not None and not bypass_reuse_filter:
            threshold = self.store_threshold
            admitted: list[OffloadKey] = []
            for key in keys:
                if tracker.get(key, 0) >= threshold:
                    admitted.append(key)
                else:
                    skipped += 1
            candidates: Iterable[OffloadKey] = admitted
        else:
            candidates = keys
        try:
            # present keys first (the usual offer is a prompt whose shared prefix is present),
            # then the new ones deduplicated in offered order: the same keys, in the same
            # order, as deduplicating first, without a dictionary of every offered key
            to_store = list(dict.fromkeys(filterfalse(entries.__contains__, candidates)))
        except TypeError:  # not iterable, or an unhashable key
            validate.offload_keys(keys, "prepare_store")
            raise
        # present keys are valid keys; only the new ones need the argument check (C speed)
        if to_store and (set(map(type, to_store)) != _BYTES_ONLY or min(map(len, to_store)) < 4):
            validate.offload_keys(keys, "prepare_store")
        return self._allocate(to_store, keys, ctx, protected, skip_quarantined, skipped)

    def _count_offer(
        self, keys: Sequence[OffloadKey], tracker: OrderedDict[OffloadKey, int]
    ) -> None:
        """Count one store offer of ``keys`` in the reuse filter (``reuse_counts="offers"``).

        Tracked keys the offer names are counted (once per listing) and made the newest; its
        untracked keys enter with a count of 1, dropping the oldest entries the offer does not
        name to make room, and are not tracked when only such entries would have to go.
        """
        named: set[OffloadKey] = set()
        for key in keys:
            count = tracker.pop(key, None)
            if count is not None:
                tracker[key] = count + 1
                named.add(key)
        droppable = len(tracker) - len(named)
        limit = self.max_tracker_size
        for key in keys:
            if key in tracker:
                continue
            if len(tracker) >= limit:
                if droppable == 0:
                    continue
                tracker.popitem(last=False)
                droppable -= 1
            tracker[key] = 1

    def _prepare_write_for_request(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        bypass_reuse_filter: bool,
        protected: AbstractSet[OffloadKey],
        skip_quarantined: bool,
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_write` for a request-aware policy: the offer is recorded as the
        request's access (its absent keys as store misses, its ready present keys as reuses)
        before room is made, as vLLM 0.33 records it."""
        try:  # (C speed: exact bytes keys of at least 4 bytes; the checks otherwise)
            bad = set(map(type, keys)) != _BYTES_ONLY or min(map(len, keys)) < 4
        except TypeError:  # not iterable, or a key without a length
            bad = True
        if bad:
            validate.offload_keys(keys, "prepare_store")
        policy = self._request_policy
        assert policy is not None  # (the caller checks)
        entries = self._entries
        get = entries.get
        to_store: list[OffloadKey] = []
        ready: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            entry = get(key)
            if entry is None:
                to_store.append(key)
            elif entry >= _ONE:
                ready.append(key)
        skipped = 0
        tracker = self._tracker
        if tracker is not None and not bypass_reuse_filter:
            threshold = self.store_threshold
            admitted = [k for k in to_store if tracker.get(k, 0) >= threshold]
            skipped = len(to_store) - len(admitted)
            to_store = admitted
        state = self._access(ctx)
        missed = [k for k in to_store if k not in state.store_missed]
        if missed:  # (ARC learns from its ghosts before the insertion drops them)
            policy.on_store_miss(missed, ctx)
            state.store_missed.update(missed)
        recorded = set(to_store).union(ready)
        self._record_access([k for k in keys if k in recorded], ctx, reused=ready)
        out = self._allocate(to_store, keys, ctx, protected, skip_quarantined, skipped)
        if out is not None:
            state.inserted.update(out.keys_to_store)
        return out

    def _allocate(
        self,
        to_store: list[OffloadKey],
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        protected: AbstractSet[OffloadKey],
        skip_quarantined: bool,
        skipped: int,
    ) -> PrepareStoreOutput | None:
        """Room for the new keys ``to_store`` (distinct, absent) of the offer ``keys``."""
        entries = self._entries
        n = len(to_store)
        if n == 0:
            self._stores_skipped += skipped
            return PrepareStoreOutput((), CPULoadStoreSpec(()), ())
        # (counted whether or not room is made, as vLLM's allocation-size histogram counts)
        self._alloc_sizes[n] += 1
        quarantine = self._quarantine
        avoid = skip_quarantined and bool(quarantine)
        need = n - (self.num_free_for_promotion if avoid else self.num_free)
        victims: list[OffloadKey] = []
        if need > 0:
            if need > self._evictable:
                return None
            chosen = self.policy.evict(need, frozenset(keys).union(protected))
            if chosen is None:
                return None
            victims = chosen
            self._free.extend([e & _MASK for e in map(entries.pop, victims)])  # idle: ref 0
            self._evictable -= len(victims)
            if self.enable_events:
                self._events.append(OffloadingEvent(tuple(victims), Medium.CPU, removed=True))
        if avoid:
            slots = self._take_unquarantined(n)
        else:
            fresh, recycled = allocation_plan(self.capacity, self._high_water, len(self._free), n)
            slots = list(range(self._high_water, self._high_water + fresh))
            self._high_water += fresh
            if recycled:  # last freed first: the free list's tail, reversed (as pops would)
                free = self._free
                slots.extend(reversed(free[-recycled:]))
                del free[-recycled:]
            if quarantine:
                # Reused by a store the workers order after the flush: the mark is moot.
                for slot in slots:
                    quarantine.pop(slot, None)
        entries.update(zip(to_store, slots, strict=True))  # write-pending: the slot itself
        if self._request_policy is not None:
            self._request_policy.insert_for_request(to_store, ctx)
        else:
            self.policy.insert_many(to_store)
        self._write_pending += n
        self._stores_skipped += skipped
        return PrepareStoreOutput(tuple(to_store), CPULoadStoreSpec(tuple(slots)), tuple(victims))

    def _take_unquarantined(self, n: int) -> list[int]:
        """``n`` free slots that are not quarantined: fresh ids first, then recycled LIFO.

        The caller made sure that many exist. Quarantined fresh ids passed over move to the
        free list (they stay free and quarantined); cost O(n + quarantined slots passed).
        """
        quarantine = self._quarantine
        free = self._free
        slots: list[int] = []
        high_water = self._high_water
        capacity = self.capacity
        while len(slots) < n and high_water < capacity:
            if high_water in quarantine:
                free.append(high_water)
            else:
                slots.append(high_water)
            high_water += 1
        self._high_water = high_water
        if len(slots) < n:
            passed: list[int] = []
            while len(slots) < n:
                slot = free.pop()
                if slot in quarantine:
                    passed.append(slot)
                else:
                    slots.append(slot)
            passed.reverse()
            free.extend(passed)
        return slots

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Make write-pending ``keys`` ready (success) or drop them and free their slots."""
        self.complete_write(keys, ctx, success)

    def complete_write(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        quarantine: bool = True,
    ) -> list[OffloadKey]:
        """:meth:`complete_store`; returns the keys it changed (made ready, or dropped).

        On failure the dropped keys' slots are quarantined (a stalled GPU store may still be
        writing them) unless ``quarantine=False``: the writer is known to be done (a promotion
        whose result arrived).
        """
        flag: object = success
        if type(flag) is not bool:
            validate.flag(flag, "complete_store", "success")
        try:  # C speed: every key is bytes (absent ones are ignored, so they must be keys)
            bad = bool(set(map(type, keys)) - _BYTES_ONLY) or (
                bool(keys) and min(map(len, keys)) < 4
            )
        except TypeError:  # not iterable (None, a number, ...)
            bad = True
        if bad:
            validate.offload_keys(keys, "complete_store")
        entries = self._entries
        get = entries.get
        policy = self.policy
        changed: list[OffloadKey]
        stored: tuple[OffloadKey, ...] | None = None
        got: list[Any] = list(map(get, keys))
        if (
            success
            and got
            and None not in got
            and min(got) >= 0
            and max(got) < _ONE
            and len(set(keys)) == len(got)
        ):  # the usual case: a store job's own keys, all write-pending, each listed once
            changed = list(keys)
            entries.update(zip(changed, [e + _ONE for e in got], strict=True))  # ref -1 -> 0
            policy.mark_evictable_many(changed)
            if type(keys) is tuple:  # (a job's keys: the event shares them, no second copy)
                stored = keys
        else:
            changed = []
            for key in keys:
                entry = get(key)  # (read again: a key listed twice changes once)
                if entry is None or not 0 <= entry < _ONE:  # not write-pending
                    continue
                changed.append(key)
                slot = entry
                if success:
                    entries[key] = _ONE + slot
                else:
                    del entries[key]
                    policy.remove(key)
                    self._free.append(slot)
                    if quarantine:
                        self._quarantine_slot(slot)
            if success:
                policy.mark_evictable_many(changed)
        self._write_pending -= len(changed)
        if success:
            self._evictable += len(changed)
            if changed and self.enable_events:
                event_keys = tuple(changed) if stored is None else stored
                self._events.append(OffloadingEvent(event_keys, Medium.CPU, removed=False))
        return changed

    # -- housekeeping ---------------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drop every key (any state); announce the ready ones as removed.

        Slots of write-pending and pinned keys are quarantined (see the module docstring);
        earlier quarantine marks survive. The reuse filter's lookup counts survive (they
        describe traffic, not cache content).
        """
        if self.enable_events:
            ready = tuple(self.ready_keys())
            if ready:
                self._events.append(OffloadingEvent(ready, Medium.CPU, removed=True))
        if self._evictable != len(self._entries):
            for entry in self._entries.values():
                if _ref(entry) != 0:  # write-pending or pinned: a transfer may be in flight
                    self._quarantine_slot(_slot(entry))
        self._entries.clear()
        self.policy.clear()
        self._generation += 1
        self._free.clear()
        self._high_water = 0
        self._evictable = 0
        self._write_pending = 0

    def _quarantine_slot(self, slot: int) -> None:
        quarantine = self._quarantine
        quarantine.pop(slot, None)  # re-insert: insertion order stays release order
        quarantine[slot] = self._schedule_ends + 2

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Advance the quarantine clock; release the slots whose quarantine is over.

        A slot quarantined after schedule end ``n`` is released at end ``n + 2``: the first
        end belongs to the step whose metadata carries the flush, by the second the workers
        have executed it.
        """
        self._schedule_ends += 1
        quarantine = self._quarantine
        now = self._schedule_ends
        if quarantine and quarantine[next(reversed(quarantine))] <= now:
            quarantine.clear()  # the usual case: every mark is over
            return
        while quarantine:
            slot = next(iter(quarantine))
            if quarantine[slot] > now:
                break
            del quarantine[slot]

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """Gauges ``cpu_cache_usage_perc`` (pinned + write-pending, as a fraction),
        ``write_usage``, ``read_usage``; ``allocation_sizes`` since the last call (one entry
        per store that asked for slots, whether or not room was made, as vLLM counts; grouped
        by size in first-seen order: kept as a count per size, so a caller that never asks
        costs no memory per store); and ``stores_skipped`` since the last call when the reuse
        filter is on."""
        busy = len(self._entries) - self._evictable
        usage, write, read = usage_gauges(self.capacity, busy, self._write_pending)
        stats: dict[str, float | int | list[float]] = {
            "cpu_cache_usage_perc": usage,
            "write_usage": write,
            "read_usage": read,
            "allocation_sizes": [],
        }
        if self._alloc_sizes:
            stats["allocation_sizes"] = list(map(float, self._alloc_sizes.elements()))
            self._alloc_sizes = Counter()
        if self._tracker is not None:
            stats["stores_skipped"] = self._stores_skipped
            self._stores_skipped = 0
        return stats
