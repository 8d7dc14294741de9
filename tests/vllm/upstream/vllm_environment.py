"""A pytest plugin loaded in both runs of scripts/vllm-upstream-tests.sh (vLLM and statecore
alike): what vLLM's CI machines have and this one lacks, supplied without editing a test.

vLLM's test fixtures enable the hybrid KV-cache manager explicitly, which vLLM refuses unless the
platform supports it; the peer venv runs vLLM's scheduler side with no accelerator, where vLLM's
platform is ``UnspecifiedPlatform`` and answers no. The platform answers as a GPU platform does
(only the scheduler side runs: no kernel is called). The model the fixtures name
(``facebook/opt-125m``) is resolved offline from the config the script writes into a private
Hugging Face cache.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    """Answer the platform's hybrid KV-cache question as vLLM's GPU platforms do."""
    from vllm.platforms import current_platform

    current_platform.support_hybrid_kv_cache = lambda: True
