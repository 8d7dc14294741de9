"""The engine model's sliding-window rules against vLLM 0.33's.

vLLM frees a sliding-window group's blocks once ``computed - window + 1`` tokens are out of
the window, and an asynchronous load with a local prefix hit takes none of the hit's blocks
that fall out of the window of the whole hit (null blocks in their place). A load that then
ends with invalid blocks cannot fall back to the local prefix: its window lies in those null
blocks. vLLM maps invalid block ids to requests with one KV-cache group only; with several
groups the connector reports the load in ``failed_recving`` and the request starts over from
token 0, its blocks freed.

The engine model once truncated such a request to its local prefix: the next scheduling
filled the null holes of that prefix's window with fresh blocks that no step ever wrote, and
a store read them (seed 5, 3 workers, checked mode, 120 requests: a store that completed with
wrong bytes in the sliding-window group).
"""

from __future__ import annotations

import dataclasses

from statecore.sim.engine import SimConfig, SimEngine, SimRequest, Status
from statecore.sim.run import SimStack, attach_store_oracle, simulate
from statecore.sim.workload import WorkloadConfig


def _seed5() -> SimConfig:
    return dataclasses.replace(
        SimConfig(),
        seed=5,
        steps=2500,
        num_workers=3,
        checked=True,
        workload=WorkloadConfig(num_requests=120),
    )


def _first_load_after_a_local_hit(engine: SimEngine) -> SimRequest | None:
    for _ in range(600):
        engine.step()
        for r in engine.by_id.values():
            loading = r.status is Status.LOADING and not r.load_done
            if loading and r.load is not None and r.load[0] > 0:
                return r
    return None


def test_vllm_window_is_the_default() -> None:
    assert SimConfig().vllm_window


def test_a_failed_load_of_a_hybrid_layout_restarts_its_request_from_token_zero() -> None:
    cfg = _seed5()
    assert cfg.vllm_window and len(cfg.kv_groups()) == 2
    stack = SimStack(cfg)
    try:
        engine = SimEngine(cfg, stack.scheduler, stack.ranks, stack.kv, stack.clock)
        attach_store_oracle(stack, engine)
        r = _first_load_after_a_local_hit(engine)
        assert r is not None, "no load after a local prefix hit within 600 steps"
        start, n = r.load or (0, 0)
        tpb = engine.g_tpb[0]
        bad = r.blocks[0][(start + n - 1) // tpb]  # the last loaded full-attention block
        assert bad and start > 0
        engine._loads_ended(engine.step_no, frozenset({r.turn.req_id}), frozenset({bad}))
        # vLLM's engine learns a failed load from the next step's output, whose metadata
        # echoes it to the workers
        assert r.status is Status.LOADING and not r.load_done
        engine.step()
        assert r.load_done and r.req.num_computed_tokens == 0  # not the local prefix `start`
        assert r.has_blocks()  # until the waiting phase reaches it
        engine._promote(r)
        assert not r.has_blocks() and r.status is Status.WAITING
    finally:
        stack.close()


def test_seed5_checked_run_with_vllms_window_rule_is_clean() -> None:
    rep = simulate(_seed5())
    assert rep.ok, rep.format_text()
    assert rep.requests["loads"] > 0
