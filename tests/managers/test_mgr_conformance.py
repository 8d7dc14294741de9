"""The conformance machine of statecore.specs.conformance run against our managers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.keys import OffloadKey
from statecore.manager import CPULoadStoreSpec, ReqContext
from statecore.managers import (
    CPUOffloadingManager,
    LRUCachePolicy,
    MemoryTier,
    TieringOffloadingManager,
)
from statecore.specs.conformance import make_manager_conformance

# statecore's own suite follows the Hypothesis profile (dev/ci/fuzz) rather than the kit's
# default budget, which is sized for a single third-party manager
_EXAMPLES = settings.default.max_examples
_STEPS = 30


def _cpu_counters(m: CPUOffloadingManager) -> Mapping[str, int]:
    return dataclasses.asdict(m.counters())


def _tier_counters(m: TieringOffloadingManager) -> Mapping[str, int]:
    return dataclasses.asdict(m.primary.counters())


def _cpu_conformance(policy: str, capacity: int, **kw: Any) -> Any:
    """The conformance TestCase for a CPU manager with ``policy`` and ``capacity`` slots."""
    return make_manager_conformance(
        lambda: CPUOffloadingManager(capacity, policy),
        capacity=capacity,
        events=True,
        counters=_cpu_counters,
        self_check=CPUOffloadingManager.check_invariants,
        **{"examples": _EXAMPLES, "step_count": _STEPS, **kw},
    ).TestCase


TestCPULRUConformance = _cpu_conformance("lru", 4)
TestCPUARCConformance = _cpu_conformance("arc", 4)
TestCPUZeroCapacityConformance = _cpu_conformance("lru", 0, num_keys=4, step_count=15)


def _tiering() -> TieringOffloadingManager:
    return TieringOffloadingManager(CPUOffloadingManager(4, "lru"), [MemoryTier()])


def _tiering_check(m: TieringOffloadingManager) -> None:
    m.primary.check_invariants()


def _primary_slot(m: TieringOffloadingManager, key: OffloadKey) -> int | None:
    return m.primary.slot_of(key)


TestTieringConformance = make_manager_conformance(
    _tiering,
    capacity=4,
    num_keys=8,
    exact=False,
    counters=_tier_counters,
    self_check=_tiering_check,
    slot_of=_primary_slot,
    examples=_EXAMPLES,
    step_count=_STEPS,
).TestCase


def _tiering_no_secondary_reads() -> TieringOffloadingManager:
    """With no secondary tier the tiering manager must behave exactly like its primary."""
    return TieringOffloadingManager(CPUOffloadingManager(3, "arc"), [])


TestTieringExactConformance = make_manager_conformance(
    _tiering_no_secondary_reads,
    capacity=3,
    events=True,
    counters=_tier_counters,
    self_check=_tiering_check,
    examples=_EXAMPLES,
    step_count=_STEPS,
).TestCase


# -- the machine must catch broken managers (mutants) ------------------------------------------


class _FailedStoreBecomesReady(CPUOffloadingManager):
    """Bug: a failed store is completed as a successful one (INV-NO-PARTIAL)."""

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        super().complete_store(keys, ctx, True)


class _PinIgnoringLRU(LRUCachePolicy):
    """Bug: pinning does not take the key out of the evictable list (INV-EVICT)."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        pass


class _EvictsPinned(CPUOffloadingManager):
    def __init__(self, n: int) -> None:
        super().__init__(n, _PinIgnoringLRU(n))
        self._evictable = 0

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext):  # type: ignore[no-untyped-def]
        self._evictable = len(self.policy.evictable_keys())  # type: ignore[attr-defined]
        return super().prepare_store(keys, ctx)


class _PartialPin(CPUOffloadingManager):
    """Bug: prepare_load pins the keys before it finds the bad one (state changed on error)."""

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        for i in range(len(keys)):
            super().prepare_load(keys[i : i + 1], ctx)
        return CPULoadStoreSpec(tuple(self.slot_of(k) or 0 for k in keys))


class _RefusesEarly(CPUOffloadingManager):
    """Bug: prepare_store gives up when it would have to evict (INV-EVICT)."""

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext):  # type: ignore[no-untyped-def]
        new = [k for k in dict.fromkeys(keys) if k not in self]
        if len(new) > self.num_free:
            return None
        return super().prepare_store(keys, ctx)


class _PromotesIntoQuarantine(CPUOffloadingManager):
    """Bug: promotions take quarantined slots (a flushed GPU transfer may still touch them)."""

    def prepare_write(  # type: ignore[no-untyped-def]
        self, keys, ctx, bypass_reuse_filter=False, protected=frozenset(), skip_quarantined=False
    ):
        return super().prepare_write(keys, ctx, bypass_reuse_filter, protected, False)


# Generation stops at the first failure, so a generous budget costs little when the machine
# works and keeps a miss (a flaky pass of the mutant) improbable.
_MUTANT_SETTINGS = settings(
    max_examples=1500,
    stateful_step_count=30,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    "mutant", [_FailedStoreBecomesReady, _EvictsPinned, _PartialPin, _RefusesEarly]
)
def test_conformance_catches_mutant(mutant: type[CPUOffloadingManager]) -> None:
    machine = make_manager_conformance(lambda: mutant(4), capacity=4, events=True)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=_MUTANT_SETTINGS)


def test_conformance_catches_promotion_into_quarantined_slot() -> None:
    machine = make_manager_conformance(
        lambda: TieringOffloadingManager(_PromotesIntoQuarantine(4), [MemoryTier()]),
        capacity=4,
        num_keys=8,
        exact=False,
        slot_of=_primary_slot,
    )
    with pytest.raises(AssertionError, match="SLOT-REUSE"):
        run_state_machine_as_test(machine, settings=_MUTANT_SETTINGS)
