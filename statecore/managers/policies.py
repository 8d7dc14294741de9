"""Eviction policies of the CPU tier, and the pure decision kernels they are built from.

A :class:`CachePolicy` only orders keys; the manager owns their state (reference count and
slot). The manager tells the policy about every state change through four hooks:

* ``insert(key)``: a new key, write-pending (not evictable);
* ``mark_evictable(key)``: the key became ready and idle (reference count 0);
* ``mark_non_evictable(key)``: an idle key got pinned (reference count 0 -> 1);
* ``remove(key)``: the key left the cache without being evicted (failed store).

A store job's keys arrive together, so the first two hooks also come in batch form, which
the manager uses on its hot paths: ``insert_many(keys)`` and ``mark_evictable_many(keys)``
must leave the policy exactly as calling ``insert`` / ``mark_evictable`` on each key in
order would (a subclass that overrides one form overrides the other). A load pins its keys
together: a policy may also define ``mark_non_evictable_many(keys)`` (the same rule; the
built-in ones do), and the manager calls ``mark_non_evictable`` on each key where it does
not (the batch form is optional, so a policy written before it still works), and where the
batch form would bypass an override of the single-key hook: inherited from above the class
that overrides it, or with only the single-key hook set on the instance.

Keys are offload keys, exact ``bytes``: the built-in policies keep them in
:class:`~statecore.managers.keyorder.KeyOrder` lists, which raise ``TypeError`` for anything
else and change nothing (the CPU manager checks every key with a typed
:class:`~statecore.errors.InvalidKeyError` before a policy sees it).

``evict(n, protected)`` is atomic: it returns exactly ``n`` victims (all idle, none in
``protected``) and forgets them, or returns ``None`` and changes nothing (INV-EVICT).

The decisions themselves live in small pure functions over ints, lists and sets, each with a
PEP 316 contract (``pre:``/``post:`` lines) that CrossHair checks::

    crosshair check --analysis_kind=PEP316 --per_condition_timeout=4 statecore.managers.policies
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import filterfalse, islice
from typing import Protocol, TypeVar, runtime_checkable

from statecore.keys import OffloadKey
from statecore.manager import ReqContext
from statecore.managers.keyorder import DistinctKeys, KeyOrder, KeyTable

__all__ = [
    "PRESIZE_LIMIT",
    "ARCCachePolicy",
    "CachePolicy",
    "LRUCachePolicy",
    "RequestARCCachePolicy",
    "RequestCachePolicy",
    "RequestLRUCachePolicy",
    "allocation_plan",
    "arc_select_victims",
    "arc_target_after_b1_hit",
    "arc_target_after_b2_hit",
    "lru_select_victims",
    "order_request_keys",
    "pin_counts",
    "request_rank",
    "trim_excess",
    "unpin_counts",
    "usage_gauges",
]

K = TypeVar("K", bound=Hashable)

PRESIZE_LIMIT = 1 << 24
"""The most keys a policy's list is sized for at construction (16,777,216; about 600 MB of
address space, touched only as keys arrive). A larger tier's list grows past it by doubling."""


def _key_order(capacity: int) -> KeyOrder:
    """An empty list of keys sized for a tier of ``capacity`` (up to :data:`PRESIZE_LIMIT`)."""
    return KeyOrder(min(max(capacity, 0), PRESIZE_LIMIT))


# --------------------------------------------------------------------------------------------
# Pure kernels (CrossHair-checked contracts)
# --------------------------------------------------------------------------------------------


def lru_select_victims(
    candidates: Iterable[K], protected: AbstractSet[K], n: int
) -> list[K] | None:
    """Take the first ``n`` candidates not in ``protected``, in candidate order.

    ``candidates`` are idle keys, oldest first; the scan stops as soon as ``n`` are found.
    Returns ``None`` when fewer than ``n`` exist. Where they are distinct by their type (a
    set, a mapping, a :class:`~statecore.managers.keyorder.DistinctKeys` such as the LRU
    list), the scan runs at C speed.

    pre: n >= 0
    post: __return__ is None or len(__return__) == n
    post: __return__ is None or all(k not in protected for k in __return__)
    post: __return__ is None or len(set(__return__)) == len(__return__)
    """
    if n == 0:
        return []
    if isinstance(candidates, Mapping | AbstractSet | DistinctKeys):  # distinct: at C speed
        out = list(islice(filterfalse(protected.__contains__, candidates), n))
        return out if len(out) == n else None
    out = []
    seen: set[K] = set()
    for key in candidates:
        if key in protected or key in seen:
            continue
        seen.add(key)
        out.append(key)
        if len(out) == n:
            return out
    return None


def _next_eligible(
    it: Iterator[K], idle: AbstractSet[K], protected: AbstractSet[K], taken: AbstractSet[K]
) -> K | None:
    """Advance ``it`` to its next key that is idle, not protected and not taken; ``None``
    when it is exhausted (ARC victim selection scans each list once, forward only)."""
    for key in it:
        if key in idle and key not in protected and key not in taken:
            return key
    return None


def arc_select_victims(
    t1: Iterable[K],
    t2: Iterable[K],
    t1_size: int,
    target: float,
    n: int,
    idle: AbstractSet[K],
    protected: AbstractSet[K],
) -> list[tuple[K, int]] | None:
    """Choose ``n`` ARC victims as ``(key, list)`` pairs, ``list`` being 1 (T1) or 2 (T2).

    Each victim comes from T1 while the (virtually shrinking) T1 is at least ``int(target)``
    long, from T2 otherwise; when the preferred list has no eligible key the other one is
    used, so eviction succeeds exactly when ``n`` eligible keys exist (INV-EVICT). Eligible:
    in ``idle`` and not in ``protected``. Both lists are scanned oldest first by one forward
    pass each (monotonic, never restarted). Returns ``None`` when fewer than ``n`` exist.

    pre: n >= 0
    pre: t1_size >= 0
    pre: target >= 0
    post: __return__ is None or len(__return__) == n
    post: __return__ is None or all(k in idle and k not in protected for k, _ in __return__)
    post: __return__ is None or all(src in (1, 2) for _, src in __return__)
    post: __return__ is None or len({k for k, _ in __return__}) == len(__return__)
    """
    out: list[tuple[K, int]] = []
    taken: set[K] = set()
    it1 = iter(t1)
    it2 = iter(t2)
    c1: K | None = None
    c2: K | None = None
    done1 = False
    done2 = False
    virtual_t1 = t1_size
    limit = int(target)
    while len(out) < n:
        if c1 is None and not done1:
            c1 = _next_eligible(it1, idle, protected, taken)
            done1 = c1 is None
        if c2 is None and not done2:
            c2 = _next_eligible(it2, idle, protected, taken)
            done2 = c2 is None
        prefer_t1 = virtual_t1 >= limit
        if c1 is not None and (prefer_t1 or c2 is None):
            out.append((c1, 1))
            taken.add(c1)
            c1 = None
            virtual_t1 -= 1
        elif c2 is not None:
            out.append((c2, 2))
            taken.add(c2)
            c2 = None
        else:
            return None
    return out


def arc_target_after_b1_hit(target: float, b1_len: int, b2_len: int, capacity: int) -> float:
    """ARC target for T1 after a hit in ghost list B1: grow by ``max(1, |B2|/|B1|)``, capped.

    pre: 0 <= capacity <= 2**31
    pre: 0 <= target <= capacity
    pre: 1 <= b1_len <= 2**31
    pre: 0 <= b2_len <= 2**31
    post: target <= __return__ <= capacity
    post: __return__ > target or __return__ == capacity
    """
    return min(float(capacity), target + max(1.0, b2_len / b1_len))


def arc_target_after_b2_hit(target: float, b1_len: int, b2_len: int) -> float:
    """ARC target for T1 after a hit in ghost list B2: shrink by ``max(1, |B1|/|B2|)``, floored.

    pre: 0 <= target <= 2**31
    pre: 1 <= b2_len <= 2**31
    pre: 0 <= b1_len <= 2**31
    post: 0 <= __return__ <= target
    post: __return__ < target or __return__ == 0
    """
    return max(0.0, target - max(1.0, b1_len / b2_len))


def trim_excess(length: int, capacity: int) -> int:
    """How many oldest entries a ghost list of ``length`` must drop to fit ``capacity``.

    pre: length >= 0
    pre: capacity >= 0
    post: 0 <= __return__ <= length
    post: length - __return__ <= capacity
    post: __return__ == 0 or length - __return__ == capacity
    """
    return max(0, length - capacity)


def allocation_plan(capacity: int, high_water: int, free_len: int, n: int) -> tuple[int, int]:
    """Split an allocation of ``n`` slots into (fresh ids, recycled ids).

    Fresh ids (``high_water``, ``high_water + 1``, ...) are taken first while capacity allows,
    then recycled ids from the end of the free list.

    pre: 0 <= high_water <= capacity
    pre: free_len >= 0
    pre: 0 <= n <= free_len + capacity - high_water
    post: __return__[0] + __return__[1] == n
    post: __return__[0] == min(n, capacity - high_water)
    post: 0 <= __return__[1] <= free_len
    """
    fresh = min(n, capacity - high_water)
    return fresh, n - fresh


def pin_counts(ref: int, evictable: int) -> tuple[int, int]:
    """Reference count and evictable count after one more reader pins a ready key.

    pre: ref >= 0
    pre: evictable >= (1 if ref == 0 else 0)
    post: __return__[0] == ref + 1
    post: __return__[1] == (evictable - 1 if ref == 0 else evictable)
    post: __return__[1] >= 0
    """
    return ref + 1, evictable - 1 if ref == 0 else evictable


def unpin_counts(ref: int, evictable: int) -> tuple[int, int]:
    """Reference count and evictable count after one reader releases its pin.

    pre: ref >= 1
    pre: evictable >= 0
    post: __return__[0] == ref - 1 >= 0
    post: __return__[1] == (evictable + 1 if ref == 1 else evictable)
    """
    return ref - 1, evictable + 1 if ref == 1 else evictable


def usage_gauges(capacity: int, busy: int, write_pending: int) -> tuple[float, float, float]:
    """(cache usage, write usage, read usage) as fractions of ``capacity``.

    ``busy`` counts the slots that are pinned or write-pending (not free, not evictable).

    pre: capacity >= 0
    pre: 0 <= write_pending <= busy <= capacity
    post: all(0.0 <= g <= 1.0 for g in __return__)
    post: __return__[2] == max(__return__[0] - __return__[1], 0.0)
    """
    if capacity == 0:
        return 0.0, 0.0, 0.0
    usage = busy / capacity
    write = write_pending / capacity
    return usage, write, max(usage - write, 0.0)


# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------


@runtime_checkable
class CachePolicy(Protocol):
    """What the CPU manager needs from an eviction policy (see the module docstring).

    A policy class is constructed with the tier's capacity: ``Policy(capacity)``.
    """

    def insert(self, key: OffloadKey) -> None:
        """A new, write-pending key."""

    def insert_many(self, keys: Sequence[OffloadKey]) -> None:
        """``insert`` of each of ``keys``, in order (one store job's new keys)."""

    def remove(self, key: OffloadKey) -> None:
        """``key`` left the cache without eviction (its store failed)."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` became ready and idle (reference count 0)."""

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_evictable`` of each of ``keys``, in order (one store job's completion)."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The idle ``key`` was pinned by a reader."""

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` were used; the first key ends up the most recent."""

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[OffloadKey] | None:
        """Exactly ``n`` idle victims not in ``protected`` (forgotten), or ``None`` (no change)."""

    def clear(self) -> None:
        """Forget every key."""


class LRUCachePolicy:
    """Least recently used, over an ordered list of the idle keys only.

    Only evictable (reference count 0) keys are in :attr:`evictable_blocks`, oldest first. A
    key enters it at the most recent end each time it becomes idle: when its store completes
    and when its last reader releases it. ``touch`` moves idle keys to the recent end.

    The list is a :class:`~statecore.managers.keyorder.KeyOrder` sized for the capacity (up
    to :data:`PRESIZE_LIMIT` keys) once, at construction: it never rebuilds a table while the
    tier fills or churns, and the collector does not traverse it.
    """

    __slots__ = ("capacity", "evictable_blocks")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evictable_blocks = _key_order(capacity)

    def insert(self, key: OffloadKey) -> None:
        """A new key is write-pending: not evictable, nothing to record."""

    def insert_many(self, keys: Sequence[OffloadKey]) -> None:
        """New keys are write-pending: nothing to record."""

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key``."""
        self.evictable_blocks.discard(key)

    def mark_evictable(self, key: OffloadKey) -> None:
        """Append ``key`` at the most recent end."""
        self.evictable_blocks.append(key)

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """Append ``keys`` at the most recent end, in order (the last one most recent): the
        list ends as ``mark_evictable`` of each key in order leaves it (the keys not in
        ``keys`` keep their order, then ``keys`` follow ordered by their last occurrence)."""
        self.evictable_blocks.append_many(keys)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Take ``key`` out of the evictable list."""
        self.evictable_blocks.discard(key)

    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_non_evictable`` of each key (one load's idle keys)."""
        self.evictable_blocks.discard_many(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Move idle ``keys`` to the recent end, the first key last (most recent)."""
        self.evictable_blocks.touch(keys)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[OffloadKey] | None:
        """The ``n`` least recent idle keys not in ``protected``, or ``None``."""
        victims = lru_select_victims(self.evictable_blocks, protected, n)
        if victims is None:
            return None
        self.evictable_blocks.discard_many(victims)
        return victims

    def clear(self) -> None:
        """Forget every key."""
        self.evictable_blocks.clear()

    def evictable_keys(self) -> list[OffloadKey]:
        """The idle keys, oldest first (introspection for checks)."""
        return list(self.evictable_blocks)


class ARCCachePolicy:
    """Adaptive replacement cache: T1 (seen once), T2 (seen again), ghosts B1 and B2.

    ``target_t1_size`` (starts at 0) adapts on ghost hits during ``touch``: a hit in B1 raises
    it by ``max(1, |B2|/|B1|)`` (capped at capacity), a hit in B2 lowers it by
    ``max(1, |B1|/|B2|)`` (floored at 0). A touch of a ready key in T1 promotes it to T2; a
    touch of a write-pending key in T1 only refreshes it (its store is not a second use).
    Evicted T1 keys become B1 ghosts, T2 keys B2 ghosts; ghost lists are trimmed, oldest
    first, to the capacity.

    The four lists are :class:`~statecore.managers.keyorder.KeyOrder` s, each sized for the
    capacity (up to :data:`PRESIZE_LIMIT` keys) once, as the LRU policy's list is.
    """

    __slots__ = ("_idle", "_pending", "b1", "b2", "capacity", "t1", "t2", "target_t1_size")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.t1 = _key_order(capacity)
        self.t2 = _key_order(capacity)
        self.b1 = _key_order(capacity)
        self.b2 = _key_order(capacity)
        self.target_t1_size = 0.0
        self._idle: set[OffloadKey] = set()
        self._pending: set[OffloadKey] = set()

    def insert(self, key: OffloadKey) -> None:
        """Add ``key`` to T1 (write-pending) and drop it from the ghost lists."""
        if key not in self.t1:  # (a key listed already keeps its place, as in a dict)
            self.t1.append(key)
        self._pending.add(key)
        self.b1.discard(key)
        self.b2.discard(key)

    def insert_many(self, keys: Sequence[OffloadKey]) -> None:
        """``insert`` of each key, in order."""
        t1 = self.t1
        for key in keys:
            if key not in t1:
                t1.append(key)
        self._pending.update(keys)
        for ghosts in (self.b1, self.b2):
            if ghosts:
                ghosts.discard_many(keys)

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (no ghost is kept)."""
        if not self.t1.discard(key):
            self.t2.discard(key)
        self._idle.discard(key)
        self._pending.discard(key)

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` is ready and idle."""
        self._idle.add(key)
        self._pending.discard(key)

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_evictable`` of each key."""
        self._idle.update(keys)
        self._pending.difference_update(keys)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key`` is pinned."""
        self._idle.discard(key)

    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_non_evictable`` of each key."""
        self._idle.difference_update(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` (processed last to first) and adapt the target."""
        for key in reversed(keys):
            if key in self.t1:
                if key in self._pending:
                    self.t1.append(key)  # (present: moved to the recent end)
                else:
                    self.t1.discard(key)
                    self.t2.append(key)
            elif key in self.t2:
                self.t2.append(key)
            elif key in self.b1:
                self.target_t1_size = arc_target_after_b1_hit(
                    self.target_t1_size, len(self.b1), len(self.b2), self.capacity
                )
                self.b1.append(key)
            elif key in self.b2:
                self.target_t1_size = arc_target_after_b2_hit(
                    self.target_t1_size, len(self.b1), len(self.b2)
                )
                self.b2.append(key)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[OffloadKey] | None:
        """``n`` idle victims chosen by :func:`arc_select_victims`, or ``None`` (no change)."""
        chosen = arc_select_victims(
            self.t1, self.t2, len(self.t1), self.target_t1_size, n, self._idle, protected
        )
        if chosen is None:
            return None
        victims: list[OffloadKey] = []
        for key, src in chosen:
            if src == 1:
                self.t1.discard(key)
                self.b1.append(key)
            else:
                self.t2.discard(key)
                self.b2.append(key)
            self._idle.discard(key)
            victims.append(key)
        for ghosts in (self.b1, self.b2):
            excess = trim_excess(len(ghosts), self.capacity)
            if excess:
                ghosts.discard_many(list(islice(ghosts, excess)))  # the oldest ghosts
        return victims

    def clear(self) -> None:
        """Forget every key and ghost; the target returns to 0."""
        for order in (self.t1, self.t2, self.b1, self.b2):
            order.clear()
        self._idle.clear()
        self._pending.clear()
        self.target_t1_size = 0.0

    def evictable_keys(self) -> list[OffloadKey]:
        """The idle keys, T1 then T2, oldest first (introspection for checks)."""
        return [k for k in (*self.t1, *self.t2) if k in self._idle]


# --------------------------------------------------------------------------------------------
# Request-aware policies (vLLM 0.33's semantics)
# --------------------------------------------------------------------------------------------

_POS_BITS = 40
_POS_MAX = (1 << _POS_BITS) - 1


def request_rank(rank: int, position: int | None) -> int:
    """One int ordering chunks as vLLM's ``(rank, -position)`` pairs do: by ``rank``, then
    tail before head (a larger position first); ``None`` (no position) sorts after every
    position of the same rank. Positions beyond 2**40 - 1 tokens count as that.

    pre: rank >= 0
    post: __return__ >= 0
    post: (__return__ >> 40) == rank
    """
    low = _POS_MAX if position is None else _POS_MAX - min(max(position, 0), _POS_MAX)
    return (rank << _POS_BITS) | low


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], positions: Mapping[OffloadKey, int] | None
) -> list[OffloadKey]:
    """One head-to-tail order across a request's groups: the groups' keys in turn, sorted by
    position when every key has one (a stable sort: equal positions keep group order)."""
    keys = [key for group in key_groups for key in group]
    if positions is not None and all(key in positions for key in keys):
        keys.sort(key=positions.__getitem__)
    return keys


@runtime_checkable
class RequestCachePolicy(CachePolicy, Protocol):
    """A policy that sees request boundaries (vLLM 0.33's CachePolicy hooks).

    The CPU manager calls, for such a policy (one with ``on_request_finished``), besides the
    :class:`CachePolicy` hooks:

    * ``on_store_miss(keys, ctx)``: keys a request offers that are absent, once per request
      and key, before they are inserted (ARC adapts its target to ghost hits here);
    * ``on_request_access(keys, ctx)``: keys the request observes for the first time (loads,
      store offers), present or about to be inserted;
    * ``insert_for_request(keys, ctx)`` instead of ``insert_many(keys)``;
    * ``on_request_finished(key_groups, insertion_only, reused, ctx)`` once per request: its
      keys per group, head to tail; the keys it only inserted and the ready keys it reused.
    """

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Absent keys offered for storing (once per request and key)."""

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Keys the request observes for the first time."""

    def insert_for_request(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``insert_many(keys)`` for the storing request ``ctx``."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        """One request-scoped access, applied when the request ends."""


_RANK_SCRATCH = "policy-request-rank"


class RequestLRUCachePolicy:
    """vLLM 0.33's LRU: request-ranked and position-ordered.

    Every key has a rank; the idle key of smallest rank is evicted first. A request gets one
    rank at its first access (shared by all its steps); the keys it stores, and the present
    keys it observes, take that rank paired with their position, so a prefix's tail ranks
    below its head (evicted first) and an unfinished request's prefix ranks with the request,
    above everything finished before the request began. When the request finishes its keys
    take fresh ranks, tail first, head last: the head is the most recent. A use outside a
    request (``touch``, ``insert`` without a context) takes a fresh rank.

    Ranks live in a :class:`~statecore.managers.keyorder.KeyTable` (key -> rank, see
    :func:`request_rank`); idle keys in a :class:`~statecore.managers.keyorder.KeyOrder` used
    as a set; the eviction order in a heap of ``(rank, key)`` whose stale entries (the key is
    no longer idle, or was ranked again) are skipped when popped and dropped when the heap
    grows past twice the idle keys.
    """

    __slots__ = ("_evictable", "_generation", "_heap", "_next", "_ranks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ranks = KeyTable(min(max(capacity, 0), PRESIZE_LIMIT))
        self._evictable = _key_order(capacity)
        self._heap: list[tuple[int, OffloadKey]] = []
        self._next = 0
        self._generation = 0

    # -- ranks ----------------------------------------------------------------------------------

    def _fresh(self) -> int:
        self._next += 1
        return request_rank(self._next, None)

    def _request_rank(self, ctx: ReqContext) -> int:
        state = ctx.scratch.get(_RANK_SCRATCH)
        if state is None or state[0] is not self or state[1] != self._generation:
            self._next += 1
            state = (self, self._generation, self._next)
            ctx.scratch[_RANK_SCRATCH] = state
        rank: int = state[2]
        return rank

    def _push(self, keys: Sequence[OffloadKey]) -> None:
        """Enter the idle ``keys``' current ranks in the heap (one push each: a rebuild would
        cost every idle key, a one-step stall on a large tier)."""
        if not keys:
            return
        ranks = self._ranks
        heap = self._heap
        push = heapq.heappush
        for key in keys:
            push(heap, (ranks[key], key))
        self._compact()

    def _rebuild(self) -> None:
        ranks = self._ranks
        self._heap = [(ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _compact(self) -> None:
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild()

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        """Fresh ranks for the present ``keys``, in order (the last one most recent)."""
        ranks = self._ranks
        evictable = self._evictable
        moved: list[OffloadKey] = []
        for key in keys:
            if key in ranks:
                ranks[key] = self._fresh()
                if key in evictable:
                    moved.append(key)
        self._push(moved)

    # -- CachePolicy ----------------------------------------------------------------------------

    def insert(self, key: OffloadKey) -> None:
        """A new key outside any request: a fresh rank."""
        self._ranks[key] = self._fresh()

    def insert_many(self, keys: Sequence[OffloadKey]) -> None:
        """``insert`` of each key, in order."""
        for key in keys:
            self._ranks[key] = self._fresh()

    def insert_for_request(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """New keys stored by ``ctx``'s request: its rank and their positions (a key without
        a position takes a fresh rank)."""
        ranks = self._ranks
        for key in keys:
            position = ctx.key_position(key)
            if position is None:
                ranks[key] = self._fresh()
            else:
                ranks[key] = request_rank(self._request_rank(ctx), position)

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key``."""
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` is idle: it enters the heap at its rank."""
        self._evictable.append(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._compact()

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_evictable`` of each key."""
        for key in keys:
            self.mark_evictable(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key`` is pinned (its heap entry goes stale)."""
        self._evictable.discard(key)

    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_non_evictable`` of each key."""
        self._evictable.discard_many(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Fresh ranks for present ``keys``, the first key most recent."""
        self._refresh(reversed(list(keys)))

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Nothing: LRU does not learn from misses."""

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Present keys observed by the request take its rank at their position, unless they
        rank higher already."""
        request = self._request_rank(ctx)
        ranks = self._ranks
        evictable = self._evictable
        moved: list[OffloadKey] = []
        positions = ctx.key_positions
        if positions is None:
            return
        for key in keys:
            if key not in ranks:  # (the usual offer: new keys, ranked when inserted)
                continue
            position = positions.get(key)
            if position is None:
                continue
            rank = request_rank(request, position)
            if ranks[key] >= rank:
                continue
            ranks[key] = rank
            if key in evictable:
                moved.append(key)
        self._push(moved)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        """The request's keys take fresh ranks, tail first: its head ends most recent."""
        self._refresh(reversed(order_request_keys(key_groups, ctx.key_positions)))

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> list[OffloadKey] | None:
        """The ``n`` idle keys of smallest rank not in ``protected``, or ``None`` (no change)."""
        if n == 0:
            return []
        heap = self._heap
        ranks = self._ranks
        evictable = self._evictable
        chosen: list[tuple[int, OffloadKey]] = []
        taken: set[OffloadKey] = set()
        deferred: list[tuple[int, OffloadKey]] = []
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks.get(key) != rank or key in taken:
                continue  # stale (pinned since, ranked again) or a duplicate entry
            if key in protected:
                deferred.append(entry)
                continue
            chosen.append(entry)
            taken.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(heap, entry)
            return None
        victims = [key for _, key in chosen]
        evictable.discard_many(victims)
        for key in victims:
            del ranks[key]
        self._compact()
        return victims

    def clear(self) -> None:
        """Forget every key; requests' ranks from before are void."""
        self._ranks.clear()
        self._evictable.clear()
        self._heap = []
        self._next = 0
        self._generation += 1

    def evictable_keys(self) -> list[OffloadKey]:
        """The idle keys (introspection for checks)."""
        return list(self._evictable)

    def eviction_order(self) -> list[OffloadKey]:
        """The idle keys, first victim first (introspection for tests; O(n log n))."""
        ranks = self._ranks
        return sorted(self._evictable, key=lambda k: (ranks[k], k))


class RequestARCCachePolicy(ARCCachePolicy):
    """vLLM 0.33's ARC: reuse counted, and the target adapted, once per request.

    As :class:`ARCCachePolicy`, but a request's accesses act when it finishes: a ready key it
    reused moves from T1 to T2 (or to T2's recent end) once, however many times the request
    loaded it; a key it only inserted keeps its list and moves to that list's recent end; the
    request's keys are applied tail first, so its head ends most recent. A ghost hit adapts
    the target when the request offers the absent key for storing, once per request and key,
    before the insertion drops the ghost.
    """

    __slots__ = ()

    def insert_for_request(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``insert_many(keys)`` (ARC ranks no request)."""
        self.insert_many(keys)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Adapt the target to each ghost among the offered absent keys (last to first)."""
        for key in reversed(keys):
            if key in self.b1:
                self.target_t1_size = arc_target_after_b1_hit(
                    self.target_t1_size, len(self.b1), len(self.b2), self.capacity
                )
                self.b1.append(key)
            elif key in self.b2:
                self.target_t1_size = arc_target_after_b2_hit(
                    self.target_t1_size, len(self.b1), len(self.b2)
                )
                self.b2.append(key)

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Nothing until the request finishes."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only: AbstractSet[OffloadKey],
        reused: AbstractSet[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        """Apply the request's accesses, tail first (see the class docstring)."""
        t1, t2 = self.t1, self.t2
        for key in reversed(order_request_keys(key_groups, ctx.key_positions)):
            if key in insertion_only:
                if key in t1:
                    t1.append(key)
                elif key in t2:
                    t2.append(key)
            elif key in reused:
                if key in t1:
                    t1.discard(key)
                    t2.append(key)
                elif key in t2:
                    t2.append(key)


BUILTIN_POLICIES: dict[
    str,
    type[LRUCachePolicy]
    | type[ARCCachePolicy]
    | type[RequestLRUCachePolicy]
    | type[RequestARCCachePolicy],
] = {
    "lru": LRUCachePolicy,
    "arc": ARCCachePolicy,
    "request-lru": RequestLRUCachePolicy,
    "request-arc": RequestARCCachePolicy,
}
"""Policies known by name: ``lru`` and ``arc`` order by each access (statecore's own
semantics); ``request-lru`` and ``request-arc`` by request (vLLM 0.33's), the vLLM adapter's
default."""
