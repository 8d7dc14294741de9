"""The scheduler side of an offloading connector: :class:`OffloadingScheduler`.

The package's modules, in the order a reader needs them:

* :mod:`~statecore.scheduler.core`: :class:`OffloadingScheduler`, the engine's hooks and
  every decision, each a named method (its module docstring is the map);
* :mod:`~statecore.scheduler.jobs`: the job table (jobs, the stalled ledger, fences, quorum
  counting);
* :mod:`~statecore.scheduler.planning`: lookup and store planning as pure functions;
* :mod:`~statecore.scheduler.effects`: the lifecycle effects, private to the package;
* :mod:`~statecore.scheduler.records`, :mod:`~statecore.scheduler.answers`: the records the
  lifecycles move and the values the engine gets back.

The names below are the package's public interface; the modules are its inside.
"""

from __future__ import annotations

from statecore.scheduler.answers import (
    EMPTY_MAPPING,
    ConnectorOutputResult,
    CreatedLoad,
    ResetResult,
    ResetStatus,
    SchedulerCounters,
)
from statecore.scheduler.core import OffloadingScheduler
from statecore.scheduler.records import GroupState, JobRecord, RequestRecord

__all__ = [
    "EMPTY_MAPPING",
    "ConnectorOutputResult",
    "CreatedLoad",
    "GroupState",
    "JobRecord",
    "OffloadingScheduler",
    "RequestRecord",
    "ResetResult",
    "ResetStatus",
    "SchedulerCounters",
]
