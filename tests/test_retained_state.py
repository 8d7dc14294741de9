"""Retained state stays bounded by what is live: the soak's memory oracle, in miniature.

A long run (a soak) must keep the scheduler's and the CPU manager's memory flat: every
container they hold (dicts, lists, sets, queues, at any depth of statecore's own objects) is
keyed by something live - tracked requests, in-flight jobs, CPU slots, GPU blocks - never by
the history of the run (job ids, per-call records, sizes, events that nobody drains). The test
drives the benchmark's standalone engine for many times more jobs than there are live things,
without ever calling ``get_stats`` or ``take_events`` (an engine may never ask), and asserts
every container's length is within the live bound. A container that grows with the number of
jobs, steps or requests seen exceeds the bound long before the run ends, whatever its name.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from statecore.bench.scheduler import HookTimer, RunResult, Scenario, run_standalone

STEPS = 800

SCENARIO = Scenario(
    concurrency=16,
    steps=10**9,
    bulk=True,
    num_prefixes=8,
    prefix_len=32,
    suffix_len=(8, 48),
    output_len=(2, 6),
    followup_turn_len=16,
    max_prompt_len=256,
    cpu_cache_factor=0.5,
)


def _containers(obj: Any, path: str, seen: set[int], out: dict[str, int]) -> None:
    """Every sized container reachable through statecore objects' attributes (dict and
    ``__slots__``), by attribute path."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    attrs: dict[str, Any] = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    for name, value in attrs.items():
        where = f"{path}.{name}"
        if isinstance(value, (dict, list, set, frozenset, tuple, OrderedDict, deque)):
            out[where] = len(value)
        elif type(value).__module__.startswith("statecore") and not callable(value):
            _containers(value, where, seen, out)


def test_every_container_is_bounded_by_live_state_over_a_long_run() -> None:
    sizes: dict[str, int] = {}
    live: dict[str, int] = {}

    def probe(step: int, timer: HookTimer, res: RunResult, submitted: int) -> bool:
        timer.steps.clear()  # the benchmark's own records (not under test)
        if step < STEPS:
            return False
        sched = timer.target
        _containers(sched, "scheduler", set(), sizes)
        live.update(
            submitted=submitted,
            bound=SCENARIO.num_cpu_chunks()
            + SCENARIO.num_gpu_blocks()
            + SCENARIO.concurrency
            + len(sched.jobs),
        )
        return True

    run_standalone(SCENARIO, probe)
    bound = live["bound"]
    # the run saw many times more jobs than there are live things: history shows up
    assert live["submitted"] > 4 * bound, live
    assert "scheduler.manager._entries" in sizes  # the walk reached the manager
    grown = {where: n for where, n in sizes.items() if n > bound}
    assert grown == {}, f"containers beyond the live bound {bound}: {grown}"
