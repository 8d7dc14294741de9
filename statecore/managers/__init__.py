"""Offloading managers: the CPU tier, its eviction policies, the tiering manager, secondary tiers.

* :class:`CPUOffloadingManager`: the CPU tier (slot pool, LRU/ARC, reuse filter, events).
* :class:`TieringOffloadingManager`: the CPU tier as primary with cascades to secondary tiers
  and promotions back from them.
* :class:`SecondaryTier`: the protocol of a secondary tier; :class:`MemoryTier` (an in-memory
  double for tests) and :class:`FileTier` (chunk files on a file system) implement it.
"""

from __future__ import annotations

from statecore.managers.cpu import CPUManagerCounters, CPUOffloadingManager, WritePendingPinError
from statecore.managers.filetier import FileTier, InlineExecutor
from statecore.managers.policies import ARCCachePolicy, CachePolicy, LRUCachePolicy
from statecore.managers.tiering import TieringOffloadingManager
from statecore.managers.tiers import JobResult, MemoryTier, SecondaryTier

__all__ = [
    "ARCCachePolicy",
    "CPUManagerCounters",
    "CPUOffloadingManager",
    "CachePolicy",
    "FileTier",
    "InlineExecutor",
    "JobResult",
    "LRUCachePolicy",
    "MemoryTier",
    "SecondaryTier",
    "TieringOffloadingManager",
    "WritePendingPinError",
]
