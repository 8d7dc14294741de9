"""Two simulated engine instances sharing one real Redis tier, the server restarted mid-run."""

from __future__ import annotations

import dataclasses

from statecore.redisserver import LocalRedis
from statecore.sim.engine import SimConfig
from statecore.sim.multi import compare, run_instances
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


def test_every_request_finishes_when_lookups_outnumber_the_known_keys() -> None:
    """With ``max_known_keys=2`` the waiting requests' lookups outnumber the answers kept; each
    request still reads the answer it waits for and finishes (before the tier held those
    answers, 23 of these 30 requests hung, answered RETRY for ever)."""
    require_server()
    cfg = dataclasses.replace(
        SimConfig(seed=1), workload=dataclasses.replace(WorkloadConfig(), num_requests=30)
    )
    with LocalRedis() as srv:
        rep = run_instances(cfg, srv.url, 2, prefix="known", server=srv, max_known_keys=2)
    for r in rep.instances:
        assert r.ok and not r.hung_requests, r.hung_requests[:3]
        assert r.requests["finished"] + r.requests["aborted"] == r.requests["arrived"]
    assert sum(r.requests["arrived"] for r in rep.instances) == 30
