"""Seeded mutants: each breaks the real code in one place; the CI harness budget must catch it.

Each test applies one deliberate bug with ``monkeypatch`` and asserts that the verification
harness fails: first the simulator on two small seeded runs, then, if those pass, a short
whole-stack fuzz campaign. A mutant that survives means the harness lost its teeth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from statecore.specs.fuzz import campaign

from statecore import kernels
from statecore.keys import OffloadKey
from statecore.manager import ReqContext
from statecore.managers.cpu import CPUOffloadingManager
from statecore.scheduler import OffloadingScheduler
from statecore.sim.engine import SimConfig
from statecore.sim.run import simulate
from statecore.sim.workload import WorkloadConfig
from statecore.wire import ConnectorMetadata

FUZZ_SECONDS = 20.0


def _sim_config(seed: int) -> SimConfig:
    return dataclasses.replace(
        SimConfig(), seed=seed, steps=1500, workload=WorkloadConfig(num_requests=200)
    )


def harness_finding() -> str | None:
    """What the CI harness reports (None: the harness passed)."""
    for seed in (0, 1):
        try:
            rep = simulate(_sim_config(seed))
        except Exception as exc:  # the stack blew up inside the engine loop: caught
            return f"simulate seed {seed} raised {type(exc).__name__}: {exc}"
        if not rep.ok:
            found = (
                rep.invariant_violations
                + rep.data_errors
                + rep.hung_requests
                + rep.leaked_state
                + rep.engine_errors
                + rep.harness_anomalies
            )
            return f"simulate seed {seed}: {found[0]}"
    _, _, _, failure = campaign(FUZZ_SECONDS)
    return failure


def _rewind_keeping_jobs(self: OffloadingScheduler, req: Any) -> None:
    for gs in req.groups:  # seed 004: the per-request in-flight set is NOT cleared
        gs.cursor = 0
        gs.skip = 0


def _apply_quorum_one(pending: int, ok: int, bad: int) -> tuple[int, int, int, int]:
    acc_bad = min(bad, pending)
    acc_ok = min(ok, pending - acc_bad)
    return 0, acc_ok, acc_bad, 0  # the first worker's report completes the job


_real_classify = kernels.classify_report


def _classify_raising(
    job_id: int, stale_threshold: int, next_job_id: int, live: bool, stalled: bool
) -> kernels.ReportKind:
    if stalled and not live:
        raise KeyError(job_id)  # upstream before stall handling: a late report crashes
    return _real_classify(job_id, stale_threshold, next_job_id, live, stalled)


def _fence_add_noop(index: dict[int, set[int]], job_id: int, blocks: Any) -> None:
    return None  # the fence index is never consulted: nothing is ever in it


_real_complete_store = CPUOffloadingManager.complete_store


def _complete_store_always_ok(
    self: CPUOffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext,
    success: bool = True,
) -> None:
    _real_complete_store(self, keys, ctx, True)  # failed/stalled stores become loadable


_real_build = OffloadingScheduler.build_connector_meta


def _build_without_flushes(self: OffloadingScheduler, output: Any) -> ConnectorMetadata:
    meta = _real_build(self, output)  # the workers are never told to wait for reused blocks
    return dataclasses.replace(meta, jobs_to_flush=frozenset())


MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "jobs_to_flush_dropped": lambda mp: mp.setattr(
        OffloadingScheduler, "build_connector_meta", _build_without_flushes
    ),
    "reset_keeps_request_job_sets": lambda mp: mp.setattr(
        OffloadingScheduler, "rewind_request", _rewind_keeping_jobs
    ),
    "quorum_of_one": lambda mp: mp.setattr(kernels, "apply_report", _apply_quorum_one),
    "late_report_after_stall_raises": lambda mp: mp.setattr(
        kernels, "classify_report", _classify_raising
    ),
    "fence_index_not_consulted": lambda mp: mp.setattr(kernels, "fence_add", _fence_add_noop),
    "complete_store_always_success": lambda mp: mp.setattr(
        CPUOffloadingManager, "complete_store", _complete_store_always_ok
    ),
}


def test_harness_passes_without_mutants() -> None:
    """The control: the unmodified stack passes the same budget (so catches are real)."""
    for seed in (0, 1):
        rep = simulate(_sim_config(seed))
        assert rep.ok, rep.format_text()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness fails with the mutant applied."""
    MUTANTS[name](monkeypatch)
    finding = harness_finding()
    assert finding is not None, f"mutant {name!r} survived the CI harness budget"
