"""An out-of-tree vLLM OffloadingSpec for tests/vllm (loaded by name, through
``spec_name`` and ``spec_module_path``, as a user's own spec would be): vLLM's CPU spec under
another name, so its manager is vLLM 0.33's own CPU manager."""

from __future__ import annotations

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class OutOfTreeCPUSpec(CPUOffloadingSpec):
    """vLLM's CPU spec, registered nowhere."""
