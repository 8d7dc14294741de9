"""Mutants of engine-output shapes the engine models do not produce
(:data:`catalogue.ENGINE_OUTPUT_MUTANTS`): the check replays the shape vLLM's real engine
produces and must find each mutant; the control passes on the unmodified code."""

from __future__ import annotations

import pytest
from catalogue import ENGINE_OUTPUT_MUTANTS

from statecore import (
    GroupConfig,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    WorkerMetadata,
)
from statecore.managers import CPUOffloadingManager
from statecore.views import ScheduledColumns


def reset_resume_finding() -> str | None:
    """A request computed and stored, then ``reset_cache``; the next output lists it as
    preempted and schedules it resumed with four new blocks (vLLM's ``reset_prefix_cache``
    with ``reset_running_requests``). Its recomputed chunks must be stored from the resumed
    blocks. Returns what went wrong, or None."""
    sched = OffloadingScheduler(
        SchedulerConfig(groups=(GroupConfig(4),)), CPUOffloadingManager(64), checked=True
    )
    req = Request(
        "a", num_prompt_tokens=16, num_tokens=16, block_hashes=[bytes([i]) * 16 for i in range(4)]
    )
    sched.on_new_request(req)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [[1, 2, 3, 4]], 0)
    meta = sched.build_connector_meta(
        SchedulerOutput(
            scheduled=[ScheduledRequest("a", ((1, 2, 3, 4),), 16, False)],
            new_req_ids=frozenset({"a"}),
        )
    )
    report = WorkerMetadata()
    for job_id in meta.store_jobs:
        report.mark_completed(job_id)
    sched.update_connector_output(report)
    req.num_computed_tokens = 16
    if not sched.reset_cache():
        return "reset_cache failed"
    req.num_computed_tokens = 0
    cols = ScheduledColumns(["a"], [((5, 6, 7, 8),)], [16], frozenset({"a"}))
    meta = sched.build_connector_meta(
        SchedulerOutput(columns=cols, preempted_req_ids=frozenset({"a"}))
    )
    stored = [list(job.src.block_ids) for job in meta.store_jobs.values()]
    if stored != [[5, 6, 7, 8]]:
        return f"the resumed request's chunks were stored from {stored}, not [[5, 6, 7, 8]]"
    return None


def test_control_passes() -> None:
    assert reset_resume_finding() is None


@pytest.mark.parametrize("name", sorted(ENGINE_OUTPUT_MUTANTS))
def test_mutant_is_caught(name: str) -> None:
    with ENGINE_OUTPUT_MUTANTS[name].apply():
        finding = reset_resume_finding()
    assert finding is not None, f"mutant {name} survived"
    assert reset_resume_finding() is None  # restored
