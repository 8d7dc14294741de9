"""Offloading managers: the CPU tier, its eviction policies, the tiering manager, secondary tiers.

* :class:`CPUOffloadingManager`: the CPU tier (slot pool, LRU/ARC, reuse filter, events).
* :class:`TieringOffloadingManager`: the CPU tier as primary with cascades to secondary tiers
  and promotions back from them.
* :class:`SecondaryTier`: the protocol of a secondary tier; :class:`MemoryTier` (an in-memory
  double for tests), :class:`FileTier` (chunk files on a file system) and :class:`RedisTier`
  (a Redis/Valkey server or cluster shared by many engine instances) implement it;
  :func:`build_tier` makes one from a plain dict.
"""

from __future__ import annotations

from statecore.managers.cpu import CPUManagerCounters, CPUOffloadingManager, WritePendingPinError
from statecore.managers.filetier import FileTier, InlineExecutor
from statecore.managers.policies import ARCCachePolicy, CachePolicy, LRUCachePolicy
from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout
from statecore.managers.tierconfig import build_tier
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
    "RedisTier",
    "RedisTierConfig",
    "SecondaryTier",
    "TierLayout",
    "TieringOffloadingManager",
    "WritePendingPinError",
    "build_tier",
]
