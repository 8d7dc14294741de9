"""A vLLM ``OffloadingManager`` seen as a statecore :class:`~statecore.manager.OffloadingManager`.

vLLM's manager interface (``vllm.v1.kv_offload``) and statecore's have the same methods and
same-named types; :class:`VllmManagerAdapter` converts the types at the boundary (keys, request
contexts, lookup results, load/store specs, store outputs, events, schedule-end contexts,
statistics) and forwards every call once, unchanged. It adds no rule and hides no error: what
the vLLM manager raises reaches the caller as is. vLLM's two conventions that statecore's
contract lacks are passed through for the conformance kit's ``vllm`` profile: ``lock`` (the
context manager every caller holds) and ``on_reset_flushed``.

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
from contextlib import AbstractContextManager
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


class VllmLoadStoreSpec(LoadStoreSpec):
    """A vLLM spec of a type other than ``CPULoadStoreSpec``, carried as is."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"VllmLoadStoreSpec({self.spec!r})"


def _spec(spec: Any) -> LoadStoreSpec:
    if isinstance(spec, VllmCPULoadStoreSpec):
        return CPULoadStoreSpec(tuple(int(s) for s in spec.block_ids))
    return VllmLoadStoreSpec(spec)


def _keys(keys: Iterable[OffloadKey]) -> list[Any]:
    return [vb.OffloadKey(bytes(k)) for k in keys]


def _event(ev: Any) -> OffloadingEvent:
    return OffloadingEvent(
        tuple(OffloadKey(bytes(k)) for k in ev.keys), Medium(ev.medium.value), bool(ev.removed)
    )


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
    """A vLLM 0.33 ``OffloadingManager`` behind statecore's manager contract (types only)."""

    def __init__(self, manager: Any) -> None:
        self.vllm = manager
        """The wrapped vLLM manager."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The vLLM manager's ``lock`` (vLLM: every caller holds it around every call)."""
        lock: AbstractContextManager[Any] = self.vllm.lock
        return lock

    def _ctx(self, ctx: ReqContext) -> Any:
        vctx = ctx.scratch.get(_CTX)
        if vctx is None:
            params = dict(ctx.kv_transfer_params) if ctx.kv_transfer_params else None
            vctx = ctx.scratch[_CTX] = vb.ReqContext(ctx.req_id, kv_transfer_params=params)
        return vctx

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult[self.vllm.lookup(vb.OffloadKey(bytes(key)), self._ctx(ctx)).name]

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        return _spec(self.vllm.prepare_load(_keys(keys), self._ctx(ctx)))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.vllm.touch(_keys(keys), self._ctx(ctx))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.vllm.complete_load(_keys(keys), self._ctx(ctx))

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self.vllm.prepare_store(_keys(keys), self._ctx(ctx))
        if out is None:
            return None
        return PrepareStoreOutput(
            tuple(OffloadKey(bytes(k)) for k in out.keys_to_store),
            _spec(out.store_spec),
            tuple(OffloadKey(bytes(k)) for k in out.evicted_keys),
        )

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self.vllm.complete_store(_keys(keys), self._ctx(ctx), success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [_event(ev) for ev in self.vllm.take_events()]

    def reset_cache(self) -> None:
        self.vllm.reset_cache()

    def on_reset_flushed(self) -> None:
        """vLLM: the jobs in flight at the last reset are reported by every worker."""
        self.vllm.on_reset_flushed()

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        answer = self.vllm.on_new_request(self._ctx(ctx))
        policy = OffloadPolicy[answer.policy.name] if answer is not None else None
        return RequestOffloadingContext(policy or OffloadPolicy.CHUNK_LEVEL)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.vllm.on_request_finished(self._ctx(ctx))

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.vllm.on_schedule_end(
            vb.ScheduleEndContext(list(ctx.new_req_ids), list(ctx.preempted_req_ids))
        )

    def has_pending_work(self) -> bool:
        return bool(self.vllm.has_pending_work())

    def get_stats(self) -> dict[str, float | int | list[float]]:
        return _stats(self.vllm.get_stats())

    def shutdown(self) -> None:
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
