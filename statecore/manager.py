"""The offloading-manager contract: the cache directory behind the scheduler.

A manager tracks which chunk keys are offloaded, where they live (slots of the shared CPU
pool, files of a secondary tier), whether they are readable, and which to evict. It never moves
bytes itself: the scheduler turns its answers into transfer jobs, the worker executes them.

The rules every implementation must keep are written in the docstrings of
:class:`OffloadingManager`; ``statecore.specs.conformance`` checks them against any
implementation with a Hypothesis state machine.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statecore._pickling import pickled_by_fields
from statecore.keys import OffloadKey

__all__ = [
    "CPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "Medium",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "TierFilter",
    "TierMatcher",
]


class LookupResult(enum.IntEnum):
    """Answer of :meth:`OffloadingManager.lookup` for one key."""

    MISS = 0
    """Not present in any tier the request may read."""
    HIT = 1
    """Present and readable now: ``prepare_load`` may be called."""
    HIT_PENDING = 2
    """Present but not yet readable (its write or promotion is in flight)."""
    RETRY = 3
    """Location not known yet (an asynchronous lookup is running); ask again later."""


class OffloadPolicy(enum.Enum):
    """Which chunks of a request are offered to ``prepare_store``."""

    CHUNK_LEVEL = "chunk"
    """Only chunks computed by the engine; chunks that were hits are not offered again."""
    REQUEST_LEVEL = "request"
    """Every chunk of the request, hits included (a secondary tier wants them all)."""


class Medium(enum.Enum):
    """Where a tier keeps its bytes."""

    CPU = "CPU"
    STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """Matches tiers by medium; ``None`` is a wildcard."""

    medium: Medium | None = None


@dataclass(frozen=True, slots=True)
class TierFilter:
    """Which secondary tiers a request may load from.

    ``matchers=None`` (the :data:`ALL` default) allows every tier; an empty tuple allows none.
    """

    matchers: tuple[TierMatcher, ...] | None = None

    def allows(self, medium: Medium) -> bool:
        """Whether a tier of ``medium`` may serve this request's loads."""
        if self.matchers is None:
            return True
        return any(m.medium is None or m.medium is medium for m in self.matchers)


TierFilter.ALL = TierFilter()  # type: ignore[attr-defined]


@dataclass(slots=True)
class ReqContext:
    """Per-request context passed with every manager call.

    Attributes:
        req_id: the engine's request id.
        kv_transfer_params: the request's connector parameters, if any.
        load_tier_filter: which secondary tiers may serve its loads.
        scratch: private per-manager storage (a manager may keep its own per-request state here).
        key_positions: each of the request's keys -> the number of tokens up to the end of its
            chunk (vLLM's offload key position), filled by the scheduler as the request's keys
            are built when the manager's :attr:`OffloadingManager.wants_key_positions` is true;
            ``None`` otherwise. A manager reads it to order a request's chunks head to tail.
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    # (shared: frozen, so one instance serves every request and none is built per request)
    load_tier_filter: TierFilter = TierFilter.ALL  # type: ignore[attr-defined]
    scratch: dict[str, Any] = field(default_factory=dict)
    key_positions: dict[OffloadKey, int] | None = None

    def key_position(self, key: OffloadKey) -> int | None:
        """``key``'s end-token position in this request, or ``None`` when not recorded."""
        positions = self.key_positions
        return None if positions is None else positions.get(key)


@dataclass(frozen=True, slots=True)
class RequestOffloadingContext:
    """What a manager answers to :meth:`OffloadingManager.on_new_request`."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass(frozen=True, slots=True)
class ScheduleEndContext:
    """Passed to :meth:`OffloadingManager.on_schedule_end` once per engine step."""

    new_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()


class LoadStoreSpec:
    """Marker base class: where the bytes of a transfer live on one side."""

    __slots__ = ()


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class CPULoadStoreSpec(LoadStoreSpec):
    """Slot ids in the shared CPU pool, one per chunk, co-indexed with the job's keys."""

    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """Result of a successful :meth:`OffloadingManager.prepare_store`.

    Attributes:
        keys_to_store: the subset of the offered keys that must be written, in offered order.
        store_spec: where to write them (co-indexed with ``keys_to_store``).
        evicted_keys: keys evicted to make room (never one of the offered keys).
    """

    keys_to_store: tuple[OffloadKey, ...]
    store_spec: LoadStoreSpec
    evicted_keys: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Keys that became readable (``removed=False``) or were dropped (``removed=True``)."""

    keys: tuple[OffloadKey, ...]
    medium: Medium
    removed: bool


class OffloadingManager(ABC):
    """The contract between the scheduler and a cache directory.

    Every method takes the request's :class:`ReqContext`. The scheduler guarantees, and every
    implementation may rely on:

    * ``prepare_load(keys)`` is called only for keys whose last ``lookup`` answered ``HIT`` in
      the same step; ``complete_load(keys)`` follows exactly once per ``prepare_load``.
    * ``complete_store(keys, success=...)`` is called exactly once per non-empty
      ``prepare_store`` result, with exactly that result's ``keys_to_store``; jobs discarded by
      ``reset_cache`` receive no completion (INV-TERM).
    * ``on_request_finished`` is called exactly once per request, after its last
      ``prepare_store``/``prepare_load``. Completions of earlier submissions may still arrive
      after it (INV-ORDER).

    In return an implementation must keep INV-PIN, INV-EVICT and INV-NO-PARTIAL, and raise
    typed :class:`~statecore.errors.ManagerError` subclasses (leaving its state unchanged) on
    calls that break the preconditions above.

    Slot reuse: a primary slot freed by ``reset_cache`` (it held a write-pending or pinned
    key) or by ``complete_store(success=False)`` may still be written or read by a GPU
    transfer until the workers execute the flush the scheduler puts in the next step's
    metadata. Stores and loads the scheduler builds later are ordered after that flush and may
    reuse the slot at once; a manager that writes primary slots itself (a promotion from a
    secondary tier) must not hand it to such a write before the second ``on_schedule_end``
    after the slot was freed (it answers ``MISS`` or waits instead).

    Request boundaries: a manager learns a request's chunks through the calls that carry its
    context, and its end through ``on_request_finished``. A manager whose
    :attr:`wants_key_positions` is true also gets each key's position in the request
    (:attr:`ReqContext.key_positions`), so it can rank a request's chunks head to tail.
    """

    schedule_end_last: bool = False
    """Whether :meth:`on_schedule_end` should be the last manager call of a step, after the
    step's store preparations and ``on_request_finished`` (vLLM 0.33's manager contract, for
    a manager that ends a step's exclusive region there). Off by default: the scheduler calls
    it after the step's lookups and allocations and before its store jobs are built, the
    step boundary statecore's own tiers count their quarantine clock and lookup answers by."""

    wants_key_positions: bool = False
    """Whether the scheduler should record each request key's position in
    :attr:`ReqContext.key_positions` (off by default: it costs a dict entry per key)."""

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Probe one key. Never changes readiness; may start asynchronous work (a promotion)."""

    def lookup_many(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, until_miss: bool = False
    ) -> list[LookupResult]:
        """:meth:`lookup` of each key in order, in one call (a prompt's chunks).

        With ``until_miss`` the keys after the first ``MISS`` are not looked up: the answer
        ends with that ``MISS``. The default calls :meth:`lookup` per key; an implementation
        may answer in bulk but must leave exactly the effects of those calls (reuse-filter
        counts, promotions started) and raise what they would.
        """
        out: list[LookupResult] = []
        lookup = self.lookup
        for key in keys:
            r = lookup(key, ctx)
            out.append(r)
            if until_miss and r == LookupResult.MISS:
                break
        return out

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all present and ready) for reading; return their location in order.

        Raises :class:`~statecore.errors.UnknownKeyError` or
        :class:`~statecore.errors.KeyNotReadyError` and pins nothing if any key is not ready.
        """

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` as recently used. The default does nothing."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Release the pins of one ``prepare_load``.

        Raises :class:`~statecore.errors.UnknownKeyError` or
        :class:`~statecore.errors.PinUnderflowError` and releases nothing on a bad key.
        """

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate room for the offered keys that are not present yet.

        Keys already present (in any state) are filtered out. Room is made by evicting idle,
        unpinned, ready keys that are not among ``keys`` (INV-EVICT). Returns ``None`` and
        changes nothing when not enough room can be made; returns an output with empty
        ``keys_to_store`` when nothing needs writing. Allocated keys are write-pending (lookup
        answers ``HIT_PENDING``) until ``complete_store``.
        """

    @abstractmethod
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish one store job.

        ``success=True``: write-pending keys become ready and evictable and are announced in a
        stored event. ``success=False``: write-pending keys are dropped and their room freed;
        their bytes never become loadable (INV-NO-PARTIAL); their slots fall under the
        slot-reuse rule (class docstring): a stalled job may still be writing them. Keys that
        are absent or already ready are ignored in both cases.
        """

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the events recorded since the last call. The default records none."""
        return ()

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop every entry.

        The scheduler puts every in-flight job in the next step's flush; until the workers
        have executed it, the slots of write-pending and pinned keys fall under the slot-reuse
        rule (class docstring). Raise only having changed nothing: the scheduler then answers
        no lookup with a hit and calls ``reset_cache`` again at the start of every step
        (``build_connector_meta``) until it returns; the jobs the reset discarded get no
        completion either way.
        """

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sighting of a request; answers its offload policy (default chunk level).

        Raise only having changed nothing: until a later call returns (the scheduler asks
        again at the request's next lookup or store), the request gets no lookup, no store
        offer and no ``on_request_finished``.
        """
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027
        """No more ``prepare_*`` calls will come for the request; completions still may."""

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:  # noqa: B027
        """Once per engine step, after lookups and before store jobs are built (after every
        other call of the step when :attr:`schedule_end_last` is true)."""

    def has_pending_work(self) -> bool:
        """Whether the manager still has asynchronous work that needs engine steps."""
        return False

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """Metrics since the last call: counters add, gauges are current, lists concatenate."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Release resources (threads, files). The manager is not used afterwards."""
