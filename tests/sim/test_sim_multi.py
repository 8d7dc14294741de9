"""Two simulated engine instances sharing one real Redis tier, the server restarted mid-run."""

from __future__ import annotations

import dataclasses

from statecore.services.redisserver import LocalRedis
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
    assert c.shared.server_restarts == 1  # seen from the server's run_id
    assert c.shared.failed_tier_jobs > 0, "the restart failed no tier job: it proved nothing"
    # every failed job is counted under one kind; a stopped server is "unreachable"
    assert sum(c.shared.failed_by_kind.values()) == c.shared.failed_tier_jobs, text
    assert c.shared.failed_by_kind.get("unreachable", 0) > 0, text
    assert "failed tier jobs by kind (2 instances, shared): unreachable" in text
    assert c.namespace.startswith("statecore-sim-") and c.keys_removed, text
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


def test_an_operators_server_is_left_clean_and_its_restart_is_counted() -> None:
    """A server this module did not start: never stopped by the run, but a restart of it is
    detected (run_id) and counted; the run's keys are removed at the end, or kept if asked."""
    require_server()
    cfg = dataclasses.replace(
        SimConfig(seed=2, steps=400),
        workload=dataclasses.replace(WorkloadConfig(), num_requests=24),
    )
    with LocalRedis() as srv:
        client = srv.client()
        client.set(b"someone-else", b"x")
        c = compare(cfg, 2, srv.url, restart=True)  # an operator's: restart does not apply
        assert c.ok and c.shared.server_restarts == 0 and c.keys_removed
        assert list(client.scan_iter()) == [b"someone-else"]
        kept = compare(cfg, 2, srv.url, keep_keys=True, namespace="kept-run")
        assert kept.keys_removed is None and client.dbsize() > 1
        assert all(k.startswith(b"kept-run-") for k in client.scan_iter() if k != b"someone-else")
        rounds: list[int] = []

        def restart_at_round_20(name: str, done: int, total: int) -> None:
            if name == "shared" and done == 20:
                srv.stop()
                srv.start()
            rounds.append(done)

        again = compare(cfg, 2, srv.url, on_round=restart_at_round_20)
        assert again.shared.server_restarts == 1 and again.single.server_restarts == 0
        assert again.ok and rounds
