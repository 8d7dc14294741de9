"""The simulator's named presets that commands list before importing the simulator (which
needs torch and numpy): ``statecore fuzz --manager`` runs with the ``conformance`` extra alone."""

from __future__ import annotations

__all__ = ["GROUP_PRESETS"]

GROUP_PRESETS: dict[str, str] = {
    "full": "one full-attention group",
    "hybrid": "full attention + sliding window of 2.5 blocks (not a multiple of a chunk)",
    "mixed": "full attention + a sliding-window group with twice the tokens per block",
    "hybrid3": "full attention + two sliding windows (2.5 and 5.5 blocks)",
}
"""KV-cache group configurations by name (``SimConfig.groups``, ``--groups``)."""
