"""Engine progress: the engine model drains the waiting requests that hold KV blocks first (as
vLLM 0.33 does), and a jam of the engine model is detected and reported, not silent.

A jam: requests waiting, none running, none of them loading or deferred, so the connector owes
them nothing and nothing will ever free a block. The scenarios are a GPU pool of 64 blocks
shared by two KV-cache groups (``hybrid``) under the default faults: ended and failed loads
leave waiting requests holding blocks. Tried in queue order alone (the engine model before
this check), a first waiting request larger than the free blocks kept every other one waiting
behind it, and the run only warned that fewer requests arrived than were asked for.
"""

from __future__ import annotations

from statecore.sim.engine import SimConfig, SimEngine, SimRequest
from statecore.sim.faults import SimFaults
from statecore.sim.run import SimStack, attach_store_oracle, simulate
from statecore.sim.workload import WorkloadConfig

STEPS = 1500


class QueueOrderEngine(SimEngine):
    """The engine model before vLLM 0.33's rule: waiting requests in queue order only."""

    def _waiting_order(self) -> list[SimRequest]:
        return list(self.waiting)


def _config(seed: int, requests: int = 10**6, steps: int = 10**9) -> SimConfig:
    return SimConfig(
        seed=seed,
        steps=steps,
        num_gpu_blocks=64,
        groups="hybrid",
        workload=WorkloadConfig(num_requests=requests),
        faults=SimFaults.preset("default"),
    )


def _run(engine_cls: type[SimEngine], seed: int) -> SimEngine:
    cfg = _config(seed)
    stack = SimStack(cfg)
    try:
        engine = engine_cls(cfg, stack.scheduler, stack.ranks, stack.kv, stack.clock)
        attach_store_oracle(stack, engine)
        for _ in range(STEPS):
            engine.step()
    finally:
        stack.close()
    return engine


def test_queue_order_jams_where_holders_first_goes_on() -> None:
    old = _run(QueueOrderEngine, 1)
    assert len(old.stats.jams) == 1, old.stats.jams
    assert "none running" in old.stats.jams[0] and "held by" in old.stats.jams[0]
    assert not old.running and old.waiting
    new = _run(SimEngine, 1)
    assert not new.stats.jams
    assert not (new.stats.harness_anomalies or new.stats.hung or new.stats.violations)
    # 146 finish in these steps; the queue-order model finished 92 before it jammed
    assert new.stats.requests_finished > 120 > old.stats.requests_finished


def test_a_jam_is_reported_as_a_warning_and_is_not_the_connectors_failure() -> None:
    # seed 2 jams even with holders first: four waiting requests hold 36 of the 64 blocks
    # and the first needs more than the rest (vLLM, too, never preempts a waiting request)
    report = simulate(_config(2, requests=300, steps=2000))
    assert len(report.engine_jams) == 1, report.engine_jams
    assert report.ok, report.format_text()
    jam = [w for w in report.warnings if "the engine model jammed" in w]
    assert len(jam) == 1 and "raise --gpu-blocks" in jam[0]
