"""Request and job lifecycles, and their compiled dispatch tables.

``REQUEST`` and ``JOB`` are compiled once, at import. The ``R_*``/``J_*`` constants are the
state indices and the ``RE_*``/``JE_*`` constants the event indices of those tables; they are
read from the compiled tables, never written by hand.
"""

from __future__ import annotations

from statecore.lifecycle.machines import (
    EFFECT_HOOKS,
    JobLifecycle,
    LifecycleEffects,
    RequestLifecycle,
    effects_class,
)
from statecore.lifecycle.table import (
    CompiledLifecycle,
    TransitionInfo,
    checked_mode,
    compile_lifecycle,
)

__all__ = [
    "EFFECT_HOOKS",
    "JOB",
    "REQUEST",
    "CompiledLifecycle",
    "JobLifecycle",
    "LifecycleEffects",
    "RequestLifecycle",
    "TransitionInfo",
    "checked_mode",
    "compile_lifecycle",
    "effects_class",
]

REQUEST: CompiledLifecycle = compile_lifecycle(RequestLifecycle, "request", "req_id")
"""The compiled request lifecycle."""
JOB: CompiledLifecycle = compile_lifecycle(JobLifecycle, "job", "job_id")
"""The compiled job lifecycle."""

_rs, _re = REQUEST.state_index, REQUEST.event_index
R_NO_TRANSFER = _rs["no_transfer"]
R_LOADING = _rs["loading"]
R_STORING = _rs["storing"]
R_PREEMPTED = _rs["preempted_draining"]
R_FINISHED_PENDING = _rs["finished_pending_final"]
R_FINISHED_DRAINING = _rs["finished_draining"]
R_RELEASED = _rs["released"]
RE_LOOKUP = _re["lookup"]
RE_ALLOC_LOAD = _re["alloc_load"]
RE_STORE_CREATED = _re["store_created"]
RE_JOB_ENDED = _re["job_ended"]
RE_PREEMPT = _re["preempt"]
RE_FINISH = _re["finish"]
RE_SIGNAL_FINISHED = _re["signal_finished"]
RE_RESET = _re["reset"]

_js, _je = JOB.state_index, JOB.event_index
J_IN_FLIGHT = _js["in_flight"]
J_PARTIAL = _js["partial"]
J_CARRIED = _js["carried"]
J_STALLED = _js["stalled"]
J_COMPLETED = _js["completed"]
J_FAILED = _js["failed"]
J_RETIRED = _js["retired"]
J_DISCARDED = _js["discarded"]
JE_WORKER_REPORT = _je["worker_report"]
JE_STALL_TIMEOUT = _je["stall_timeout"]
JE_RESET = _je["reset"]
