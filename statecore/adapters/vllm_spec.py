"""An out-of-tree vLLM ``OffloadingSpec``'s manager behind statecore's scheduler.

vLLM loads an out-of-tree spec from ``spec_name`` and ``spec_module_path`` in
``kv_connector_extra_config``; so does statecore's adapter (:func:`load_spec`, through vLLM's
own ``OffloadingSpecFactory``, on the configuration vLLM's connector would build). The spec's
manager (``spec.get_manager()``) then runs behind statecore's scheduler through
:class:`VllmSpecManager`: statecore's one conversion of a vLLM manager
(:class:`~statecore.adapters.vllm_manager.VllmManagerAdapter`, which the conformance kit
uses) with the rules statecore's scheduler needs on top (the class docstring lists them).

The spec's own workers (``get_handlers`` / ``get_worker``) are not used: statecore's workers
move the bytes.

vLLM is imported here (in :func:`load_spec`) and by :mod:`statecore.adapters.vllm_manager`;
``import statecore`` never needs vLLM.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from statecore.adapters.vllm_manager import VllmManagerAdapter
from statecore.errors import ConfigError, ManagerError
from statecore.manager import CPULoadStoreSpec, LoadStoreSpec, ScheduleEndContext

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["VllmSpecManager", "load_spec", "spec_manager"]

# The on_schedule_end after a reset, counting from 1, by which the workers have run the reset's
# flush (statecore's slot-reuse rule, OffloadingManager's docstring): VllmSpecManager sends the
# vLLM manager on_reset_flushed just before it.
_RESET_FLUSHED_AFTER = 2


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


class VllmSpecManager(VllmManagerAdapter):
    """A vLLM ``OffloadingManager`` behind statecore's scheduler (see the module docstring).

    The conversions are :class:`~statecore.adapters.vllm_manager.VllmManagerAdapter`'s; what
    statecore's scheduler needs on top, and so what differs from the conformance kit's
    wrapper, is this class and nothing else:

    * **lock**: each call holds the manager's ``lock`` (but :meth:`shutdown`), as vLLM's
      callers do; statecore's scheduler knows no lock. (The kit's wrapper leaves the lock to
      its caller: the kit holds it.) Do not hold :attr:`lock` around a call: it need not be
      reentrant.
    * **specs**: statecore's workers move the bytes, so the manager must place chunks in CPU
      slots: a load or store spec other than vLLM's ``CPULoadStoreSpec`` is refused with
      :class:`~statecore.errors.ManagerError` naming it, the call undone first (the load's
      pins released, the store's room given back), so the typed error changes nothing. The
      scheduler takes that lookup as a miss and that offer as no room, counts the error and
      raises it after the step in checked mode. A store with nothing to write needs no CPU
      spec. (The kit's wrapper carries another spec as
      :class:`~statecore.adapters.vllm_manager.VllmLoadStoreSpec`.)
    * **statistics**: :meth:`get_stats` takes the manager's (vLLM's managers keep them until
      asked) and reports none: they are vLLM's connector metrics, not statecore's. (The kit's
      wrapper reports them converted.)
    * **reset flush**: statecore's scheduler does not wait for the workers' reports of the
      jobs a reset flushed; it promises they ran by the second ``on_schedule_end`` after the
      reset. The manager gets ``on_reset_flushed`` just before
      that one (``on_schedule_end`` stays the step's last call). (The kit calls
      :meth:`on_reset_flushed` itself.)

    Args:
        manager: the vLLM manager (``OffloadingSpec.get_manager()``).
    """

    def __init__(self, manager: Any) -> None:
        super().__init__(manager)
        self._ends_to_flushed = 0  # schedule ends until the last reset's flush ran (0: none)

    def _held(self) -> AbstractContextManager[Any]:
        """The manager's ``lock``, for one call."""
        return self.lock

    def _load_store_spec(self, spec: Any, call: str, n_keys: int) -> LoadStoreSpec:
        """vLLM's CPU spec as CPU slots; an empty store's spec as no slots; any other refused."""
        got = super()._load_store_spec(spec, call, n_keys)
        if isinstance(got, CPULoadStoreSpec):
            return got
        if n_keys == 0 and call == "prepare_store":
            return CPULoadStoreSpec(())
        raise ManagerError(
            f"vLLM manager's {call} returned a {type(spec).__name__}: statecore's workers "
            "transfer to and from CPU slots only (vLLM's CPULoadStoreSpec)"
        )

    def reset_cache(self) -> None:
        """Forwarded; the manager's ``on_reset_flushed`` is then due at the second
        ``on_schedule_end``."""
        super().reset_cache()
        self._ends_to_flushed = _RESET_FLUSHED_AFTER

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Forwarded, preceded by ``on_reset_flushed`` when the last reset's flush has run."""
        if self._ends_to_flushed:
            self._ends_to_flushed -= 1
            if not self._ends_to_flushed:
                self.on_reset_flushed()
        super().on_schedule_end(ctx)

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """None: the manager's statistics are taken and dropped (vLLM's connector metrics)."""
        with self._held():
            self.vllm.get_stats()
        return {}
