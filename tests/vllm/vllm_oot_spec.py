"""An out-of-tree vLLM OffloadingSpec for tests/vllm (loaded by name, through
``spec_name`` and ``spec_module_path``, as a user's own spec would be): vLLM's CPU spec under
another name, so its manager is vLLM 0.33's own CPU manager; and one that needs no extra-config
key."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class OutOfTreeCPUSpec(CPUOffloadingSpec):
    """vLLM's CPU spec, registered nowhere."""


class FixedCapacitySpec(OffloadingSpec):
    """An out-of-tree spec that needs no extra-config key: its manager is vLLM's CPU manager of
    a fixed number of chunks (the capacity is the spec's business, not the connector's)."""

    def get_manager(self) -> OffloadingManager:
        return CPUOffloadingManager(num_chunks=64)

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        raise NotImplementedError("statecore's workers move the bytes")
