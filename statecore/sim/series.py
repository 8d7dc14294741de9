"""Per-step time series of a simulation run, for ``statecore simulate --plot``.

Theory of operation. :func:`record_steps` wraps the engine's ``step`` method on that one
engine instance so that, after every step (drain steps included), :class:`StepSeries` samples
what the plot shows: load and store jobs in flight (from the scheduler's job table), the CPU
tier's occupancy (from the manager's O(1) counters) and, per fault kind, how many faults were
injected during that step (differences of the harness's cumulative injection counters; resets
among them). Sampling reads state only; it never changes what the run does, so a seed replays
identically with or without it. Each series has one value per step, aligned with the engine's
own ``hit_rate`` and ``in_flight_jobs`` series.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from statecore.sim.faults import FAULT_KINDS

if TYPE_CHECKING:
    from statecore.sim.engine import SimEngine
    from statecore.sim.run import SimStack

__all__ = ["StepSeries", "record_steps"]


class StepSeries:
    """Samples one run's per-step series (see the module docstring)."""

    def __init__(self, stack: SimStack, engine: SimEngine) -> None:
        self.stack = stack
        self.engine = engine
        self.series: dict[str, list[float]] = {
            "loads_in_flight": [],
            "stores_in_flight": [],
            "cpu_occupancy": [],
            **{f"faults_{kind}": [] for kind in FAULT_KINDS},
        }
        self._last = self._injected()

    def _injected(self) -> dict[str, int]:
        return self.stack.injected_faults(self.engine)

    def sample(self) -> None:
        """Append one value to every series (call after each engine step)."""
        jobs: Any = self.stack.scheduler.jobs
        stores = sum(1 for job in jobs.values() if job.is_store)
        self.series["stores_in_flight"].append(float(stores))
        self.series["loads_in_flight"].append(float(len(jobs) - stores))
        manager: Any = self.stack.manager
        primary = getattr(manager, "primary", manager)
        counters = getattr(primary, "counters", None)
        occupancy = 0.0
        if counters is not None:
            c = counters()
            occupancy = 100.0 * c.keys / c.capacity if c.capacity else 0.0
        self.series["cpu_occupancy"].append(occupancy)
        now = self._injected()
        for kind in FAULT_KINDS:
            self.series[f"faults_{kind}"].append(float(now.get(kind, 0) - self._last.get(kind, 0)))
        self._last = now


def record_steps(stack: SimStack, engine: SimEngine) -> StepSeries:
    """Sample ``engine`` after each of its steps from now on; the recorder."""
    recorder = StepSeries(stack, engine)
    step: Callable[..., None] = engine.step

    def step_and_sample(*args: Any, **kwargs: Any) -> None:
        step(*args, **kwargs)
        recorder.sample()

    setattr(engine, "step", step_and_sample)  # noqa: B010 - this instance only
    return recorder
