"""The end-to-end suite on vLLM's CPU build (run it with ``scripts/vllm-cpu-e2e.sh``).

Every scenario runs the same workload through a real vLLM engine twice, without a connector
and with statecore's, and compares the outputs token for token and logprob for logprob; each
also checks that statecore loaded tokens into the device cache (a scenario where nothing loads
proves nothing). Without vLLM's CPU build the whole folder is skipped with that reason, and it
fails instead under ``CI=true`` (the script installs it there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401

    _MISSING = ""
except ImportError as exc:  # pragma: no cover - depends on the environment
    _MISSING = f"vLLM's CPU build is not installed ({exc}); run scripts/vllm-cpu-e2e.sh"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without vLLM: fail under CI, skip with the reason elsewhere."""
    if not _MISSING:
        return
    if os.environ.get("CI", "").lower() == "true":
        raise pytest.UsageError(_MISSING)
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.skip(reason=_MISSING))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny full-attention Llama (2 layers, 128 wide, 4 heads of 32)."""
    from statecore.bench.e2e_harness import write_model

    return write_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def sliding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with a 64-token sliding window on even layers: two KV-cache groups."""
    from statecore.bench.e2e_harness import write_model

    return write_model(tmp_path_factory.mktemp("sliding"), sliding_window=64, layers=4)
