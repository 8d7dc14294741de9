"""``statecore check``: the explorer has teeth, and the unmodified stack passes.

* every seeded mutant of ``tests/mutants/catalogue.py`` (``MUTANTS`` and ``REDIS_MUTANTS``) is
  found by the smallest shipped scope that can express it (``MUTANT_SCOPES``; one worker and
  full attention unless named), and its shortest counterexample, written as a pytest file,
  replays it;
* the unmodified code passes the same scopes at the same depth;
* the canonical state form identifies what it should (job ids renamed) and nothing more;
* snapshots restore the exact state; the fault-free continuation quiesces.

The depths here keep the whole file within about a minute and a half on a loaded machine; the
full scopes are the documented command ``statecore check --all``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from statecore.check import SCOPES, explore, format_counterexample, pytest_source, replay, snapshot
from statecore.check.cli import main as check_main
from statecore.check.explore import continuation
from statecore.check.model import GARBAGE, RUNNING, World
from statecore.check.shared import LabelPool
from statecore.scheduler import OffloadingScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mutants"))
from catalogue import MUTANTS, REDIS_MUTANTS

ALL_MUTANTS = {**MUTANTS, **REDIS_MUTANTS}
"""The catalogue's mutants and the Redis tier's (found in the scope with the shared tier)."""

TEST_DEPTH = {
    "one": 7,
    "pair": 6,
    "apart": 7,
    "chunked": 6,
    "foreign": 6,
    "two": 6,
    "swa": 6,
    "window": 6,
    "shared": 6,
    "shared_known": 5,
    "manager": 7,
}
"""Depth of each scope in this file (the shipped depth is larger)."""

MUTANT_DEPTH = {
    "jobs_to_flush_dropped": 8,
    "async_load_allocation_not_fenced": 7,
    "preempt_keeps_block_lists": 8,  # a 12-action trace, met on a continuation from depth 8
    "stale_window_block_stored": 7,
    "redis_decode_unverified": 7,
}
"""Mutants whose shortest trace needs a deeper search than :data:`TEST_DEPTH`."""

SCOPE_ORDER = ("one", "apart", "two", "swa")
"""Scopes from smallest to largest: one worker (shared or unrelated prompts), two workers, a
sliding-window group."""

MUTANT_SCOPES = {
    "quorum_of_one": "two",
    "preempt_without_flush": "apart",
    "async_load_allocation_not_fenced": "chunked",
    "untracked_allocation_not_fenced": "foreign",
    "stale_window_block_stored": "window",
    "preempt_keeps_block_lists": "one",
    "over_report_completes_job": "one",
    "evicts_offered_key": "pair",
    "final_store_never_built": "pair",
    "redis_unreadable_keeps_answer": "shared",
    "redis_decode_unverified": "shared",
    "redis_namespace_without_layout": "shared",
    "redis_awaited_answer_evictable": "shared_known",
    "manager_error_mid_completion": "manager",
    "manager_errors_swallowed": "manager",
    "prepare_store_error_escapes": "manager",
    "lookup_and_signal_errors_escape": "manager",
    "prepare_load_error_escapes": "manager",
    "reset_error_escapes": "manager",
    "failed_reset_not_retried": "manager",
    "new_request_error_escapes": "manager",
    "take_events_error_escapes": "manager",
    "get_stats_error_escapes": "manager",
    "pending_work_error_escapes": "manager",
    "shutdown_error_escapes": "manager",
}
"""The smallest scope that can express a mutant, where known and not ``one``; a mutant not
listed is looked for in every scope of :data:`SCOPE_ORDER` in turn."""

NOT_EXPRESSED = {
    "window_loads_pending_chunks": "a window's chunk must be pending while the same chunk of "
    "the full-attention group is readable: the two groups' keys of one chunk stored by "
    "different jobs (one request's offer skips the sliding-window key, a later request's "
    "stores it), beyond the two-request scopes (swa, swa2, window: no finding at full depth; "
    "three-request variants are cut at 150 s); the fuzzer finds it within seconds on every "
    "seed (tests/mutants/test_mutants.py)",
}
"""Mutants no shipped scope can express, with the checker that finds them."""

STALE_LIST_TRACE = [
    ("arrive", 0),
    ("step",),
    ("preempt", 0),
    ("step",),
    ("ok", 0, 0),
    ("step",),
    ("reset",),
    ("abort", 0),
    ("ok", 0, 1),
    ("step",),
    ("step",),
    ("ok", 0, 2),
]
"""A bug that ``statecore check`` found in the scheduler (scope ``one``), now fixed: a
preempted request is re-admitted with a load into new blocks, the cache is reset (its cursor
rewinds), it is aborted while loading; its final store read the block list of its *first*
allocation, whose blocks the load had filled with other chunks: wrong bytes stored under valid
keys. The seeded mutant ``preempt_keeps_block_lists`` re-introduces it."""


UNTRACKED_FIXED = hasattr(OffloadingScheduler, "_untracked_scheduled")
"""Whether the scheduler records the blocks of requests it does not track (bug B of the docs)."""


def _scope(name: str) -> object:
    return dataclasses.replace(SCOPES[name], depth=TEST_DEPTH[name])


@pytest.mark.parametrize("name", sorted(TEST_DEPTH))
def test_unmodified_stack_passes(name: str) -> None:
    """No violation and no liveness failure within the scope."""
    res = explore(_scope(name))  # type: ignore[arg-type]
    if name == "foreign" and not UNTRACKED_FIXED:
        # the scheduler does not record another connector's allocations yet: the checker must
        # find the resulting wrong bytes (a store reading a block handed to that request)
        assert res.counterexample is not None
        assert res.counterexample.violation.startswith("INV-DATA")
        return
    assert res.counterexample is None, format_counterexample(res.scope, res.counterexample)
    # with another connector's allocations recorded (bug B fixed), "foreign" has no
    # wrong-bytes branches left: a smaller state space
    least = 500 if name == "foreign" and UNTRACKED_FIXED else 1000
    assert res.complete and res.states > least and res.depth == TEST_DEPTH[name]


@pytest.mark.parametrize("name", sorted(ALL_MUTANTS))
def test_mutant_found_and_replayed(name: str, tmp_path: Path) -> None:
    """The smallest scope finds the mutant; the counterexample file replays it."""
    if name in NOT_EXPRESSED:
        pytest.skip(NOT_EXPRESSED[name])
    order = (MUTANT_SCOPES[name],) if name in MUTANT_SCOPES else SCOPE_ORDER
    depth = dict(TEST_DEPTH)
    if name in MUTANT_DEPTH:
        depth[order[0]] = MUTANT_DEPTH[name]
    with ALL_MUTANTS[name].apply():
        for scope_name in order:
            scope = dataclasses.replace(SCOPES[scope_name], depth=depth[scope_name])
            res = explore(scope)
            if res.counterexample is not None:
                break
        cex = res.counterexample
        assert cex is not None, f"mutant {name!r} survived scopes {order}: {res.summary()}"
        text = format_counterexample(res.scope, cex)
    assert text.count("\n  1. ") <= 1 and f"{len(cex.trace):3d}. " in text
    path = tmp_path / f"test_check_{scope_name}_{name}.py"
    path.write_text(pytest_source(res.scope, cex, name))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_counterexample_replays()  # reproduces the violation under the mutant
    if not cex.liveness:
        _, violation, _ = replay(res.scope, cex.trace)  # and not without it
        assert violation is None or violation.startswith("replay:"), violation


def test_stale_block_list_bug_fixed() -> None:
    """The counterexample of :data:`STALE_LIST_TRACE` runs clean; under the mutant that keeps
    a preempted request's block lists it reaches the wrong bytes again."""
    _, violation, n = replay(SCOPES["one"], STALE_LIST_TRACE)
    # fixed, the final store from the stale lists is never built: its report has no job
    assert violation == "replay: action ('ok', 0, 2) is not enabled at step 12", violation
    _, violation, n = replay(SCOPES["one"], STALE_LIST_TRACE[:-1])
    assert violation is None, f"after {n} actions: {violation}"
    with MUTANTS["preempt_keeps_block_lists"].apply():
        _, violation, n = replay(SCOPES["one"], STALE_LIST_TRACE)
    assert violation is not None and violation.startswith("INV-DATA: store job"), violation


def test_shortest_trace_is_shortest() -> None:
    """BFS: no trace shorter than the counterexample reaches a violation."""
    scope = _scope("two")
    with MUTANTS["quorum_of_one"].apply():
        res = explore(scope)  # type: ignore[arg-type]
        assert res.counterexample is not None
        n = len(res.counterexample.trace)
        shorter = explore(dataclasses.replace(scope, depth=n - 1), liveness=False)  # type: ignore[type-var]
    assert shorter.counterexample is None


def test_key_identifies_states_and_snapshots_restore_them() -> None:
    """Equal histories up to job ids and clock readings share a key; others do not; a
    snapshot restores the exact state."""
    scope = SCOPES["one"]
    trace = [("arrive", 0), ("step",), ("step",), ("ok", 0, 0)]
    a, violation, _ = replay(scope, trace)
    assert violation is None and not a.sched.jobs
    assert ("jump",) not in a.actions()  # nothing could time out: a jump would change nothing
    later = snapshot.loads(snapshot.dumps(a))
    later.jump()
    assert later.clock.now > a.clock.now and later.key() == a.key()  # only the time differs
    e, violation, _ = replay(scope, trace[:2])
    assert violation is None and e.sched.jobs and ("jump",) in e.actions()
    later = snapshot.loads(snapshot.dumps(e))
    later.clock.now += 100.0
    assert later.key() != e.key()  # the live store job is now past its stall timeout
    later.jump()
    assert later.sched.stalled_jobs and later.key() != e.key()
    d, _, _ = replay(scope, [("arrive", 0), ("step",), ("reset",), ("step",)])
    assert d.sched.stale_threshold == 1 and d.sched.next_job_id == 2
    restored = snapshot.loads(snapshot.dumps(d))
    assert restored.key() == d.key() and restored is not d
    # the object graph is kept: the scheduler drives the observer of the world's manager
    assert restored.sched.manager is restored.observed
    assert restored.observed._inner is restored.manager
    assert restored.backends[0].gpu is restored.gpu[0]


def test_continuation_quiesces_and_trace_checks() -> None:
    """From a busy state the fault-free continuation leaves nothing behind."""
    w, violation, _ = replay(SCOPES["two"], [("arrive", 0), ("arrive", 1), ("step",)])
    assert violation is None and w.quiescent() is not None
    left, moves = continuation(w)
    assert left is None and moves and w.quiescent() is None
    _, violation, n = replay(SCOPES["one"], [("ok", 0, 7)])
    assert violation is not None and violation.startswith("replay:") and n == 1


def test_world_rejects_unknown_action() -> None:
    """An unknown action is a programming error of the caller, not a state."""
    with pytest.raises(ValueError, match="unknown action"):
        World(SCOPES["one"]).apply(("teleport",))


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``statecore check`` prints figures, exits 1 on a violation and writes the test file."""
    assert check_main(["--list"]) == 0
    assert "swa" in capsys.readouterr().out
    assert check_main(["--scope", "one", "--depth", "4"]) == 0
    assert "distinct states" in capsys.readouterr().out
    rc = check_main(
        ["--scope", "one", "--mutant", "fence_index_not_consulted", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "violation" in out and "  1. request r0 arrives" in out
    assert (tmp_path / "test_check_one_fence_index_not_consulted.py").is_file()


def test_shared_tier_world() -> None:
    """Scope ``shared``: the pool rows encode the labels the RedisTier copies; a snapshot keeps
    the pool, the tier and the server double together; a server that is down answers MISS
    (the request computes), and a promotion delivers the label the server's value encodes."""
    scope = SCOPES["shared"]
    w, violation, _ = replay(scope, [("peer", 0), ("arrive", 0), ("step",), ("step",)])
    assert violation is None, violation
    pool = w.cpu[0]
    assert isinstance(pool, LabelPool) and w.tier is not None and w.tier.pool is pool
    assert w.peer_keys[0] in list(pool)  # promoted: the slot holds the chunk of its key
    restored = snapshot.loads(snapshot.dumps(w))
    assert restored.key() == w.key()
    assert restored.tier is not None and restored.tier.pool is restored.cpu[0]
    assert restored.backends[0].cpu is restored.cpu[0]
    assert restored.tier.client is restored.server
    row = pool.row(0, 0)
    row[-1] ^= 0xFF  # a byte past the label's end: not an encoding of any label
    assert pool[0] == GARBAGE
    down, violation, _ = replay(scope, [("arrive", 0), ("down",), ("step",), ("step",)])
    assert violation is None and down.reqs[0].status == RUNNING, down.describe()
    left, _ = continuation(down)  # the server stays down: everything still quiesces
    assert left is None and down.server is not None and down.server.down
    with pytest.raises(ValueError, match="exactly one worker"):
        World(dataclasses.replace(scope, workers=2))


def test_the_shared_tiers_injected_outages_do_not_flood_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's outages are moves of the exploration, met again in state after state: the
    tier's fault log writes them under ``statecore.check.injected_faults``, which passes errors
    only, instead of a warning per state (thousands in a run of ``statecore check --all``)."""
    caplog.set_level(logging.DEBUG, logger="statecore.managers.redistier")
    scope = dataclasses.replace(SCOPES["shared"], depth=5)
    res = explore(scope)
    assert res.counterexample is None
    assert res.transitions > 0
    world = World(scope)
    world.apply(("arrive", 0))
    world.apply(("down",))
    for _ in range(2):  # a lookup batch against a server that refuses, then its result
        world.apply(("step",))
    assert world.tier is not None and world.tier.fault_log.down
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
