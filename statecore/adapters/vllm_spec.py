"""An out-of-tree vLLM ``OffloadingSpec``'s manager behind statecore's scheduler.

vLLM loads an out-of-tree spec from ``spec_name`` and ``spec_module_path`` in
``kv_connector_extra_config``; so does statecore's adapter (:func:`load_spec`, through vLLM's
own ``OffloadingSpecFactory``, on the configuration vLLM's connector would build). The spec's
manager (``spec.get_manager()``) then runs behind statecore's scheduler through
:class:`VllmSpecManager`, which converts the types at the boundary and forwards every call
once, holding the manager's ``lock`` as vLLM's callers do:

* statecore's :class:`~statecore.manager.ReqContext` -> one vLLM ``ReqContext`` per request
  (kept in ``ctx.scratch``), sharing the request's key positions;
* lookup results, request offloading policies, schedule-end contexts and events by name;
* vLLM's ``CPULoadStoreSpec`` (chunk ids of the CPU tier) -> statecore's
  :class:`~statecore.manager.CPULoadStoreSpec` (slots of statecore's CPU pool, which the
  worker role builds with the capacity vLLM's CPU spec computes).

statecore's workers move the bytes, so the manager must place chunks in CPU slots: a load or
store spec of another type is refused with :class:`~statecore.errors.ManagerError` naming it
(the scheduler answers that lookup as a miss, that offer as no room, and raises the error
after the step). The spec's own workers (``get_handlers`` / ``get_worker``) are not used.

Every vLLM import lives in this module; ``import statecore`` never needs vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from statecore.errors import ConfigError, ManagerError
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

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["VllmSpecManager", "load_spec", "spec_manager"]

_CTX = "vllm-spec-ctx"


def load_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Any:
    """The ``OffloadingSpec`` vLLM's connector would build for this configuration.

    Raises :class:`~statecore.errors.ConfigError` when vLLM cannot load or build it.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        config = build_offloading_config(vllm_config, kv_cache_config)
        return OffloadingSpecFactory.create_spec(config)
    except Exception as exc:  # an import error, a missing class, the spec's own refusal
        raise ConfigError(
            f"statecore connector: the out-of-tree OffloadingSpec could not be built: {exc}"
        ) from exc


def spec_manager(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmSpecManager:
    """The manager of the out-of-tree spec the configuration names, converted."""
    return VllmSpecManager(load_spec(vllm_config, kv_cache_config).get_manager())


def _cpu_spec(spec: Any, call: str) -> CPULoadStoreSpec:
    """vLLM's CPU load/store spec as statecore's (chunk ids -> slots)."""
    ids = getattr(spec, "block_ids", None)
    if ids is None or type(spec).__name__ != "CPULoadStoreSpec":
        raise ManagerError(
            f"vLLM manager's {call} returned a {type(spec).__name__}: statecore's workers "
            "transfer to and from CPU slots only (vLLM's CPULoadStoreSpec)"
        )
    return CPULoadStoreSpec(tuple(int(i) for i in ids))


class VllmSpecManager(OffloadingManager):
    """A vLLM ``OffloadingManager`` as statecore's (see the module docstring).

    Args:
        manager: the vLLM manager (``OffloadingSpec.get_manager()``).
    """

    wants_key_positions = True
    schedule_end_last = True  # (vLLM 0.33: on_schedule_end is a step's last manager call)

    def __init__(self, manager: Any) -> None:
        from vllm.v1.kv_offload import base as vb

        self.manager = manager
        self._vb = vb

    def _ctx(self, ctx: ReqContext) -> Any:
        got = ctx.scratch.get(_CTX)
        if got is None:
            got = self._vb.ReqContext(
                ctx.req_id,
                kv_transfer_params=(
                    dict(ctx.kv_transfer_params) if ctx.kv_transfer_params is not None else None
                ),
            )
            if ctx.key_positions is not None:  # (shared: positions recorded later count too)
                got._offload_key_positions = ctx.key_positions
            ctx.scratch[_CTX] = got
        return got

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """vLLM's answer, by name."""
        with self.manager.lock:
            got = self.manager.lookup(key, self._ctx(ctx))
        return LookupResult[got.name]

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """vLLM's load spec as CPU slots."""
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), self._ctx(ctx))
        return _cpu_spec(spec, "prepare_load")

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Forwarded."""
        with self.manager.lock:
            self.manager.touch(list(keys), self._ctx(ctx))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Forwarded."""
        with self.manager.lock:
            self.manager.complete_load(list(keys), self._ctx(ctx))

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """vLLM's output, its spec as CPU slots."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), self._ctx(ctx))
        if out is None:
            return None
        to_store = tuple(out.keys_to_store)
        spec = _cpu_spec(out.store_spec, "prepare_store") if to_store else CPULoadStoreSpec(())
        return PrepareStoreOutput(to_store, spec, tuple(out.evicted_keys))

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Forwarded."""
        with self.manager.lock:
            self.manager.complete_store(list(keys), self._ctx(ctx), success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """vLLM's events, converted."""
        with self.manager.lock:
            events = list(self.manager.take_events() or ())
        return [
            OffloadingEvent(tuple(ev.keys), Medium[ev.medium.name], bool(ev.removed))
            for ev in events
        ]

    def reset_cache(self) -> None:
        """Forwarded."""
        with self.manager.lock:
            self.manager.reset_cache()

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """vLLM's answer, its policy by name."""
        with self.manager.lock:
            got = self.manager.on_new_request(self._ctx(ctx))
        return RequestOffloadingContext(OffloadPolicy[got.policy.name])

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Forwarded."""
        with self.manager.lock:
            self.manager.on_request_finished(self._ctx(ctx))

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Forwarded as vLLM's ``ScheduleEndContext``."""
        with self.manager.lock:
            self.manager.on_schedule_end(
                self._vb.ScheduleEndContext(ctx.new_req_ids, ctx.preempted_req_ids)
            )

    def has_pending_work(self) -> bool:
        """vLLM's answer (``False`` where the manager has no such method)."""
        pending = getattr(self.manager, "has_pending_work", None)
        return bool(pending()) if callable(pending) else False

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """None: vLLM's statistics objects are its connector's, not statecore's metrics."""
        return {}

    def shutdown(self) -> None:
        """Forwarded."""
        shutdown = getattr(self.manager, "shutdown", None)
        if callable(shutdown):
            shutdown()
