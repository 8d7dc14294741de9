"""A vLLM ``OffloadingManager`` seen as a statecore :class:`~statecore.manager.OffloadingManager`.

vLLM's manager interface (``vllm.v1.kv_offload``) and statecore's have the same methods and
same-named types; :class:`VllmManagerAdapter` converts the types at the boundary (keys, request
contexts, lookup results, load/store specs, store outputs, events, schedule-end contexts,
statistics) and forwards every call once, unchanged. It adds no rule and hides no error: what
the vLLM manager raises reaches the caller as is. vLLM's two conventions that statecore's
contract lacks are passed through for the conformance kit's ``vllm`` profile: ``lock`` (the
context manager every caller holds) and ``on_reset_flushed``. It is statecore's one conversion
of a vLLM manager: :class:`~statecore.adapters.vllm_spec.VllmSpecManager`, an out-of-tree
spec's manager behind statecore's scheduler, is this class with that scheduler's rules on top.

:func:`adapt` wraps what a factory returned: a vLLM ``OffloadingManager`` directly, a vLLM
``SecondaryTierManager`` class (or factory) under a ``TieringOffloadingManager`` whose primary
tier holds the capacity. The ``cpu_*`` and ``tiering*`` functions build vLLM 0.33's own
managers at a capacity (the configurations the conformance guide's table checks)::

    statecore fuzz --manager statecore.adapters.vllm_manager:cpu_lru --profile vllm
    statecore fuzz --manager vllm.v1.kv_offload.tiering.example.manager:ExampleSecondaryTierManager

Every vLLM import lives in this module; ``import statecore`` never needs vLLM.
"""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

try:
    from vllm.v1.kv_offload import base as vb
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPUManager
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "statecore.adapters.vllm_manager needs vLLM 0.33 (pip install vllm==0.33.0); "
        f"importing it failed: {exc}"
    ) from exc

from statecore.errors import ManagerError
from statecore.keys import OffloadKey
from statecore.manager import (
    CPULoadStoreSpec,
    LoadStoreSpec,
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

__all__ = [
    "VllmLoadStoreSpec",
    "VllmManagerAdapter",
    "adapt",
    "cpu_arc",
    "cpu_lru",
    "cpu_lru_threshold",
    "is_vllm_manager",
    "tiering",
    "tiering_example",
    "tiering_over",
]

_CTX = "vllm-req-context"  # ReqContext.scratch slot holding the request's vLLM ReqContext
_NO_LOCK: AbstractContextManager[None] = nullcontext()


class VllmLoadStoreSpec(LoadStoreSpec):
    """A vLLM spec of a type other than ``CPULoadStoreSpec``, carried as is."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"VllmLoadStoreSpec({self.spec!r})"


def _keys(keys: Iterable[Any]) -> tuple[OffloadKey, ...]:
    """vLLM's keys as statecore's: the same bytes (a chunk's block hash and its 4-byte group
    index), so statecore's keys go to vLLM as they are."""
    return tuple(OffloadKey(bytes(k)) for k in keys)


def _event(ev: Any) -> OffloadingEvent:
    return OffloadingEvent(_keys(ev.keys), Medium[ev.medium.name], bool(ev.removed))


def _stats(stats: Any) -> dict[str, float | int | list[float]]:
    """vLLM's ``OffloadingConnectorStats`` (or ``None``) as statecore's flat metrics dict."""
    out: dict[str, float | int | list[float]] = {}
    data = getattr(stats, "data", None)
    series = data.get("data", {}) if isinstance(data, dict) else {}
    for name, by_labels in series.items():
        for labels, value in by_labels.items():
            key = f"{name}{{{','.join(map(str, labels))}}}" if labels else str(name)
            out[key] = list(value) if isinstance(value, list) else value
    return out


class VllmManagerAdapter(OffloadingManager):
    """A vLLM 0.33 ``OffloadingManager`` behind statecore's manager contract (types only).

    statecore's one conversion of a vLLM manager: every call is forwarded once and what it
    raises reaches the caller as is. :class:`~statecore.adapters.vllm_spec.VllmSpecManager`
    (an out-of-tree spec's manager behind statecore's scheduler) is this class with the rules
    that scheduler needs on top; its docstring lists each difference.

    * statecore's :class:`~statecore.manager.ReqContext` -> one vLLM ``ReqContext`` per
      request, kept in its ``scratch`` for the request's lifetime, with the request's
      ``kv_transfer_params`` and sharing its key positions (:attr:`wants_key_positions`:
      vLLM's scheduler records them, and a manager may rank a request's chunks by them);
    * keys are the same bytes both sides; lookup results, policies, schedule-end contexts and
      events by name; store outputs field by field;
    * vLLM's ``CPULoadStoreSpec`` (chunk ids) -> statecore's
      :class:`~statecore.manager.CPULoadStoreSpec` (slots), any other spec
      :class:`VllmLoadStoreSpec`;
    * vLLM's statistics -> statecore's flat metrics dict (:meth:`get_stats`).

    vLLM's two conventions that statecore's contract lacks are passed through: :attr:`lock`
    (the caller holds it around every call but :meth:`shutdown`, as the conformance kit's
    ``vllm`` profile does) and :meth:`on_reset_flushed`.

    Args:
        manager: the vLLM manager.
    """

    schedule_end_last = True
    """vLLM 0.33's contract: ``on_schedule_end`` is a step's last manager call (what statecore's
    scheduler honours; the conformance kit calls the manager directly)."""

    wants_key_positions = True

    def __init__(self, manager: Any) -> None:
        self.vllm = manager
        """The wrapped vLLM manager."""

    @property
    def manager(self) -> Any:
        """The wrapped vLLM manager (:attr:`vllm`)."""
        return self.vllm

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The vLLM manager's ``lock`` (vLLM: every caller holds it around every call)."""
        lock: AbstractContextManager[Any] = self.vllm.lock
        return lock

    def _held(self) -> AbstractContextManager[Any]:
        """What each forwarded call holds: nothing (the caller holds :attr:`lock`)."""
        return _NO_LOCK

    def _load_store_spec(self, spec: Any, call: str, n_keys: int) -> LoadStoreSpec:
        """vLLM's spec of ``n_keys`` keys (from ``call``) as statecore's. A
        :class:`~statecore.errors.ManagerError` it raises refuses the spec: the call is undone
        (its pins released, its room given back) before the error reaches the caller."""
        if isinstance(spec, VllmCPULoadStoreSpec):
            return CPULoadStoreSpec(tuple(int(s) for s in spec.block_ids))
        return VllmLoadStoreSpec(spec)

    def _ctx(self, ctx: ReqContext) -> Any:
        """The request's vLLM ``ReqContext`` (made at its first call, kept in ``scratch``)."""
        vctx = ctx.scratch.get(_CTX)
        if vctx is None:
            params = ctx.kv_transfer_params
            vctx = vb.ReqContext(ctx.req_id, dict(params) if params is not None else None)
            if ctx.key_positions is not None:  # (shared: positions recorded later count too)
                vctx._offload_key_positions = ctx.key_positions
            ctx.scratch[_CTX] = vctx
        return vctx

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """vLLM's answer, by name."""
        vctx = self._ctx(ctx)
        with self._held():
            got = self.vllm.lookup(key, vctx)
        return LookupResult[got.name]

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """vLLM's load spec, converted (:meth:`_load_store_spec`)."""
        vkeys, vctx = list(keys), self._ctx(ctx)
        with self._held():
            spec = self.vllm.prepare_load(vkeys, vctx)
        try:
            return self._load_store_spec(spec, "prepare_load", len(vkeys))
        except ManagerError:  # refused: the pins the call took are released
            with self._held():
                self.vllm.complete_load(vkeys, vctx)
            raise

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Forwarded."""
        vctx = self._ctx(ctx)
        with self._held():
            self.vllm.touch(list(keys), vctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Forwarded."""
        vctx = self._ctx(ctx)
        with self._held():
            self.vllm.complete_load(list(keys), vctx)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """vLLM's output, its spec converted (:meth:`_load_store_spec`)."""
        vctx = self._ctx(ctx)
        with self._held():
            out = self.vllm.prepare_store(list(keys), vctx)
        if out is None:
            return None
        to_store = _keys(out.keys_to_store)
        try:
            spec = self._load_store_spec(out.store_spec, "prepare_store", len(to_store))
        except ManagerError:  # refused: the room the call allocated is given back
            with self._held():
                self.vllm.complete_store(list(to_store), vctx, False)
            raise
        return PrepareStoreOutput(to_store, spec, _keys(out.evicted_keys))

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Forwarded."""
        vctx = self._ctx(ctx)
        with self._held():
            self.vllm.complete_store(list(keys), vctx, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """vLLM's events (drained whole inside the call), converted."""
        with self._held():
            events = list(self.vllm.take_events())
        return [_event(ev) for ev in events]

    def reset_cache(self) -> None:
        """Forwarded."""
        with self._held():
            self.vllm.reset_cache()

    def on_reset_flushed(self) -> None:
        """vLLM: the jobs in flight at the last reset are reported by every worker."""
        with self._held():
            self.vllm.on_reset_flushed()

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """vLLM's answer, its policy by name."""
        vctx = self._ctx(ctx)
        with self._held():
            got = self.vllm.on_new_request(vctx)
        return RequestOffloadingContext(OffloadPolicy[got.policy.name])

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Forwarded."""
        vctx = self._ctx(ctx)
        with self._held():
            self.vllm.on_request_finished(vctx)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Forwarded as vLLM's ``ScheduleEndContext``."""
        vctx = vb.ScheduleEndContext(list(ctx.new_req_ids), list(ctx.preempted_req_ids))
        with self._held():
            self.vllm.on_schedule_end(vctx)

    def has_pending_work(self) -> bool:
        """vLLM's answer."""
        with self._held():
            return bool(self.vllm.has_pending_work())

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """vLLM's statistics since the last call, as statecore's flat metrics dict (a series
        with labels as ``name{label,...}``)."""
        with self._held():
            stats = self.vllm.get_stats()
        return _stats(stats)

    def shutdown(self) -> None:
        """Forwarded (never under the lock: vLLM's rule)."""
        self.vllm.shutdown()


def is_vllm_manager(obj: object) -> bool:
    """Whether ``obj`` is a vLLM manager or secondary tier (instance or class) :func:`adapt`
    takes."""
    if isinstance(obj, vb.OffloadingManager | SecondaryTierManager):
        return True
    return isinstance(obj, type) and issubclass(obj, SecondaryTierManager)


def adapt(obj: Any, capacity: int) -> OffloadingManager:
    """``obj`` as a statecore manager: a vLLM ``OffloadingManager`` wrapped, a vLLM
    ``SecondaryTierManager`` class put under a tiering manager of ``capacity`` primary chunks
    (:func:`tiering_over`); a statecore manager is returned as is."""
    if isinstance(obj, OffloadingManager):
        return obj
    if isinstance(obj, vb.OffloadingManager):
        return VllmManagerAdapter(obj)
    if isinstance(obj, type) and issubclass(obj, SecondaryTierManager):
        return tiering_over(capacity, obj)
    raise TypeError(
        f"{type(obj).__name__} is neither a statecore nor a vLLM OffloadingManager "
        "(nor a vLLM SecondaryTierManager class)"
    )


# -- vLLM 0.33's own managers at a capacity ----------------------------------------------------


def cpu_lru(capacity: int) -> VllmManagerAdapter:
    """vLLM's ``CPUOffloadingManager`` with the LRU policy and events."""
    return VllmManagerAdapter(VllmCPUManager(capacity, "lru", enable_events=True))


def cpu_arc(capacity: int) -> VllmManagerAdapter:
    """vLLM's ``CPUOffloadingManager`` with the ARC policy and events."""
    return VllmManagerAdapter(VllmCPUManager(capacity, "arc", enable_events=True))


def cpu_lru_threshold(capacity: int) -> VllmManagerAdapter:
    """vLLM's LRU ``CPUOffloadingManager`` with an admission threshold of 2 (a key is stored
    the second time it is offered)."""
    return VllmManagerAdapter(
        VllmCPUManager(capacity, "lru", enable_events=True, store_threshold=2)
    )


TierFactory = Callable[[Any, memoryview, str], Any]
"""Builds a secondary tier: ``(offloading_spec, primary_kv_view, tier_type) -> tier``."""


def tiering_over(
    capacity: int, *tiers: TierFactory, cache_policy: str = "lru"
) -> VllmManagerAdapter:
    """vLLM's ``TieringOffloadingManager`` over a primary CPU tier of ``capacity`` chunks (one
    page each, in a shared-memory region removed at shutdown) and the secondary tiers the
    factories build (no offloading spec: ``None``)."""
    region = SharedOffloadRegion(
        f"statecore-kit-{uuid.uuid4().hex}", capacity, None, mmap.PAGESIZE, mmap.PAGESIZE
    )
    primary = CPUPrimaryTierOffloadingManager(
        capacity, region, cache_policy=cache_policy, enable_events=True
    )
    view = primary.get_kv_memoryview()
    built = [make(None, view, f"tier{i}") for i, make in enumerate(tiers)]
    return VllmManagerAdapter(TieringOffloadingManager(primary, built))


def tiering(capacity: int) -> VllmManagerAdapter:
    """vLLM's ``TieringOffloadingManager`` with no secondary tier."""
    return tiering_over(capacity)


def tiering_example(capacity: int) -> VllmManagerAdapter:
    """vLLM's ``TieringOffloadingManager`` over vLLM's in-memory example secondary tier."""
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

    return tiering_over(capacity, ExampleSecondaryTierManager)
