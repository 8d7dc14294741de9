"""A pytest plugin that substitutes statecore's CPU tier for vLLM 0.33's CPU manager in vLLM's
own tests (scripts/vllm-upstream-tests.sh loads it with ``-p statecore_substitute``; no test
body is edited).

``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` (and the name vLLM's CPU spec imported)
becomes :class:`StatecoreCPUManager`: vLLM's constructor and interface over statecore's
:class:`~statecore.managers.cpu.CPUOffloadingManager`, types converted at the boundary. The
policy semantics follow ``STATECORE_POLICY_SEMANTICS`` (``vllm``, the default, or ``access``,
statecore's former semantics), as the vLLM adapter's ``policy_semantics`` key does.

With ``STATECORE_SUBSTITUTE=scheduler`` it substitutes statecore's connector scheduler side for
vLLM's ``OffloadingConnectorScheduler`` instead (statecore_scheduler.py), with the test's own
spec and manager behind it.

``STATECORE_TREE`` (the script sets it to the clone) makes ``import statecore`` load that tree,
whichever statecore the venv has installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from shims import SHIMS_USED, used
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as vb
from vllm.v1.kv_offload.cpu import manager as vllm_cpu_manager
from vllm.v1.kv_offload.cpu import spec as vllm_cpu_spec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource


class _TreeFinder(importlib.abc.MetaPathFinder):
    """The ``statecore`` package from one source tree, and every module under it from the
    tree too (its parent's path), ahead of any finder an installed statecore brings."""

    def __init__(self, root: Path) -> None:
        self.pkg = root / "statecore"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "statecore":
            return importlib.util.spec_from_file_location(
                fullname, self.pkg / "__init__.py", submodule_search_locations=[str(self.pkg)]
            )
        if fullname.startswith("statecore.") and path is not None:
            return importlib.machinery.PathFinder.find_spec(fullname, path)
        return None


if os.environ.get("STATECORE_TREE"):
    sys.meta_path.insert(0, _TreeFinder(Path(os.environ["STATECORE_TREE"])))


from statecore.manager import ReqContext  # noqa: E402 (after the finder)
from statecore.managers.cpu import CPUOffloadingManager  # noqa: E402

SEMANTICS = os.environ.get("STATECORE_POLICY_SEMANTICS", "vllm")
SUBSTITUTE = os.environ.get("STATECORE_SUBSTITUTE", "cpu")


class _Context:
    """statecore's request context, kept in vLLM's (by type, as vLLM's managers keep state)."""

    def __init__(self, ctx: ReqContext) -> None:
        self.ctx = ctx


class StatecoreCPUManager(vb.OffloadingManager):
    """statecore's CPU tier with vLLM's CPU manager's constructor and interface."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
    ) -> None:
        policy = cache_policy
        if cache_policy_module_path is not None:
            policy = f"{cache_policy_module_path}:{cache_policy}"
        elif SEMANTICS == "vllm" and policy in ("lru", "arc"):
            policy = f"request-{policy}"
        self.medium = vb.Medium.CPU
        self.statecore = CPUOffloadingManager(
            num_chunks,
            policy=policy,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            reuse_counts="offers" if SEMANTICS == "vllm" else "lookups",
        )
        self.store_threshold = store_threshold
        self._info = info.as_config_info() if info is not None else {}

    @property
    def _num_chunks(self) -> int:
        """vLLM's private capacity field (vLLM's CPU primary tier, a subclass of its CPU
        manager, reads it): statecore's capacity in chunks."""
        used("_num_chunks")
        return int(self.statecore.capacity)

    def _ctx(self, vctx: Any) -> ReqContext:
        got = vctx.get_state(_Context)
        if got is None:
            ctx = ReqContext(vctx.req_id, vctx.kv_transfer_params)
            ctx.key_positions = vctx._offload_key_positions  # (shared with the scheduler)
            got = _Context(ctx)
            vctx.set_state(got)
        return got.ctx

    def lookup(self, key: Any, req_context: Any) -> Any:
        return vb.LookupResult[self.statecore.lookup(key, self._ctx(req_context)).name]

    def get_load_source(self, key: Any, req_context: Any) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        spec = self.statecore.prepare_load(list(keys), self._ctx(req_context))
        return CPULoadStoreSpec(list(spec.slots))

    def _prepare_load(self, keys: Any, req_context: Any, *, record_access: bool) -> Any:
        """vLLM's private pin of its CPU manager (vLLM's CPU primary tier pins for a cascade
        read with ``record_access=False``): statecore's ``prepare_load`` (a request's access)
        or ``prepare_read`` (a pin only, the request's recency untouched)."""
        used("_prepare_load")
        ctx = self._ctx(req_context)
        pin = self.statecore.prepare_load if record_access else self.statecore.prepare_read
        return CPULoadStoreSpec(list(pin(list(keys), ctx).slots))

    def touch(self, keys: Any, req_context: Any) -> None:
        self.statecore.touch(list(keys), self._ctx(req_context))

    def complete_load(self, keys: Any, req_context: Any) -> None:
        self.statecore.complete_load(list(keys), self._ctx(req_context))

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        out = self.statecore.prepare_store(list(keys), self._ctx(req_context))
        if out is None:
            return None
        return vb.PrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=CPULoadStoreSpec(list(out.store_spec.slots)),  # type: ignore[attr-defined]
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        self.statecore.complete_store(list(keys), self._ctx(req_context), success)

    def take_events(self) -> Iterator[Any]:
        for ev in self.statecore.take_events():
            yield vb.OffloadingEvent(keys=list(ev.keys), medium=self.medium, removed=ev.removed)

    def reset_cache(self) -> None:
        self.statecore.reset_cache()

    def on_new_request(self, req_context: Any) -> Any:
        got = self.statecore.on_new_request(self._ctx(req_context))
        return vb.RequestOffloadingContext(vb.OffloadPolicy[got.policy.name])

    def on_request_finished(self, req_context: Any) -> None:
        self.statecore.on_request_finished(self._ctx(req_context))

    def config_info(self) -> Iterable[Any]:
        return [self._info]

    def get_stats(self) -> OffloadingConnectorStats:
        got = self.statecore.get_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, got["cpu_cache_usage_perc"])
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, got["write_usage"])
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, got["read_usage"])
        sizes = got["allocation_sizes"]
        assert isinstance(sizes, list)
        for size in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, int(size))
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, got["stores_skipped"])
        return stats


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    """Start the test's record of the name shims it goes through."""
    SHIMS_USED.clear()


def pytest_runtest_teardown(item: Any) -> None:
    """Report the name shims the test went through as its ``statecore_shims`` property
    (written into the JUnit report, where the table reads it)."""
    if SHIMS_USED:
        item.user_properties.append(("statecore_shims", ",".join(sorted(SHIMS_USED))))


def pytest_configure(config: Any) -> None:
    """Substitute statecore's CPU tier (``cpu``) or connector scheduler side (``scheduler``)
    before the test modules import vLLM's."""
    if SUBSTITUTE == "scheduler":
        import statecore_scheduler

        statecore_scheduler.install()
        return
    if SUBSTITUTE != "cpu":
        raise ValueError(f"STATECORE_SUBSTITUTE must be cpu or scheduler, got {SUBSTITUTE!r}")
    vllm_cpu_manager.CPUOffloadingManager = StatecoreCPUManager  # type: ignore[misc]
    vllm_cpu_spec.CPUOffloadingManager = StatecoreCPUManager  # type: ignore[attr-defined]
