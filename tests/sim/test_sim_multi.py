"""Two simulated engine instances sharing one real Redis tier, the server restarted mid-run."""

from __future__ import annotations

import dataclasses

from statecore.sim.engine import SimConfig
from statecore.sim.multi import compare
from statecore.sim.workload import WorkloadConfig
from tests.managers.redis_fixtures import require_server


def test_two_instances_share_the_tier_through_a_server_restart() -> None:
    require_server()
    cfg = dataclasses.replace(
        SimConfig(seed=3), workload=dataclasses.replace(WorkloadConfig(), num_requests=160)
    )
    c = compare(cfg, instances=2, restart=True)
    text = c.format_text()
    for run in (c.single, c.shared, c.private):
        assert run.violations == 0 and run.data_errors == 0, text
        assert run.ok, text
    assert c.shared.server_restarts == 1
    assert c.shared.failed_tier_jobs > 0, "the restart failed no tier job: it proved nothing"
    # chunks one instance stored were promoted by the other, and only with sharing
    assert c.shared.cross_instance_chunks > 0
    assert c.private.cross_instance_chunks == 0
    assert c.shared.hit_rate > c.private.hit_rate, text
