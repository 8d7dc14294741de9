"""vLLM 0.33's engine step, written once: the order in which statecore's engine models step.

statecore has one engine order, vLLM 0.33's, and two engine models that run it: the
simulator's :class:`~statecore.sim.engine.SimEngine` (which the stateful fuzzer,
:mod:`statecore.specs.stack`, drives too) and the model checker's
:class:`~statecore.check.model.World`. Each keeps its own representation of requests and
blocks (the simulator real bytes and a prefix cache, the checker labels and a state designed
to be hashed), and both take from this module the order, the running requests' preemption
rule, the waiting requests' order, the admission rule, the output's listing order and
``has_requests``. ``tests/vllm/test_engine_differential.py`` runs seeded workloads through
each engine model and through vLLM's real ``Scheduler`` and asserts the same connector calls
step by step.

Between steps the engine takes arrivals (``on_new_request``) and aborts (``request_finished``;
the request's blocks are freed at once, unless it waits on a load), and its loop asks
:func:`has_requests` before every step.

One step (vLLM 0.33's ``EngineCore.step``):

1. ``Scheduler.schedule()`` (:func:`schedule`):

   a. the running requests, in running order (:func:`schedule_running`): chunked prefill,
      then one decode token a step; when the free blocks do not cover a request's next
      tokens, the last running request not yet scheduled in this step is preempted (its
      blocks freed, the request back at the head of the waiting queue), the request itself
      last; a request that preempted itself ends this phase;
   b. only when (a) preempted nothing, the waiting requests: the engine's own admission
      (prefix-cache hit, ``get_num_new_matched_tokens``, ``update_state_after_alloc``, an
      asynchronous load parks the request until its load ended);
   c. the ``SchedulerOutput`` (new requests, then resumed ones, listed as new, then running
      ones) to the connector's ``build_connector_meta``;

2. the workers: ``start_step`` (flush, loads), compute, ``end_step``, their reports;
3. ``Scheduler.update_from_output``: the step's outputs first (a request that reached its
   length finishes: ``request_finished``, its blocks freed), then the aggregated report to
   ``update_connector_output`` (loads that ended put their requests back in the waiting
   queue).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = [
    "RunningModel",
    "StepPass",
    "admission_blocks",
    "has_requests",
    "listed",
    "schedule",
    "schedule_running",
    "waiting_order",
]

R = TypeVar("R")
"""An engine model's request."""

B = TypeVar("B")
"""An engine model's block lists of one scheduled request."""

R_contra = TypeVar("R_contra", contravariant=True)
B_co = TypeVar("B_co", covariant=True)


@dataclass(eq=False)
class StepPass(Generic[R, B]):
    """What one step's scheduling has decided so far.

    Attributes:
        budget: tokens the step may still schedule.
        scheduled: per scheduled request: the request, its tokens in this step, the block
            ids it got (what the connector sees as new) and whether it resumes from a
            preemption.
        new: requests scheduled for the first time.
        preempted: requests preempted in this step.
    """

    budget: int
    scheduled: list[tuple[R, int, B, bool]] = field(default_factory=list)
    new: set[R] = field(default_factory=set)
    preempted: set[R] = field(default_factory=set)


class RunningModel(Protocol[R_contra, B_co]):
    """What :func:`schedule_running` asks of an engine model about its running requests."""

    def is_running(self, r: R_contra) -> bool:
        """Whether ``r`` is (still) running."""

    def token_counts(self, r: R_contra) -> tuple[int, int]:
        """``r``'s computed tokens and its tokens so far (prompt and output)."""

    def free_out_of_window(self, r: R_contra) -> None:
        """Free ``r``'s sliding-window blocks that no future token attends to."""

    def blocks_needed(self, r: R_contra, upto: int, computed: int) -> int:
        """Fresh blocks ``r`` needs to hold ``upto`` tokens with ``computed`` computed."""

    def num_free_blocks(self) -> int:
        """Blocks the engine can hand out now."""

    def preempt_now(self, r: R_contra) -> None:
        """Preempt ``r`` inside the step: its blocks freed, back at the head of the waiting
        queue, its computed tokens 0."""

    def allocate(self, r: R_contra, upto: int, computed: int) -> B_co:
        """Give ``r`` the blocks for ``upto`` tokens; returns the ids it got."""


def has_requests(unfinished: bool, unsent: bool, pending_push_work: Callable[[], bool]) -> bool:
    """Whether the engine's loop steps again: vLLM 0.33's ``Scheduler.has_requests``.

    Requests not done (``unfinished``), finished or preempted requests the workers have not
    been told of yet (``unsent``), or the connector's ``has_pending_push_work`` (asked only
    when neither holds). What the workers still hold (copies in flight, reports not yet
    delivered) is not asked: vLLM's engine cannot see it, so work a connector fails to
    declare stays behind when the engine idles, and the models' liveness and leak checks find
    it.
    """
    return unfinished or unsent or bool(pending_push_work())


def schedule(
    pass_: StepPass[R, B],
    schedule_running_phase: Callable[[StepPass[R, B]], None],
    schedule_waiting_phase: Callable[[StepPass[R, B]], None],
) -> StepPass[R, B]:
    """Step 1 (a, b) of the module docstring: the running requests, then, only when none was
    preempted, the waiting ones (vLLM 0.33's ``Scheduler.schedule()``)."""
    schedule_running_phase(pass_)
    if not pass_.preempted:
        schedule_waiting_phase(pass_)
    return pass_


def schedule_running(
    running: Sequence[R], pass_: StepPass[R, B], model: RunningModel[R, B]
) -> None:
    """Step 1a of the module docstring: schedule the requests of ``running`` (in order) into
    ``pass_``.

    A request gets its remaining prompt tokens (chunked to the budget) or one decode token.
    While the free blocks do not cover them, the last request of ``running`` that is still
    running and not yet scheduled in this step is preempted, the request itself when no other
    is left; once the request preempted itself, no further running request is scheduled in
    this step (vLLM stops its running loop there).
    """
    order = list(running)
    done: set[int] = set()
    for r in order:
        if pass_.budget <= 0 or not model.is_running(r):
            continue
        computed, total = model.token_counts(r)
        n = min(total - computed, pass_.budget)
        if n <= 0:
            continue
        model.free_out_of_window(r)
        need = model.blocks_needed(r, computed + n, computed)
        while need > model.num_free_blocks():
            victim = next(
                (
                    v
                    for v in reversed(order)
                    if v is not r and id(v) not in done and model.is_running(v)
                ),
                r,
            )
            model.preempt_now(victim)
            pass_.preempted.add(victim)
            if victim is r:
                break
        if not model.is_running(r):
            break
        pass_.scheduled.append((r, n, model.allocate(r, computed + n, computed), False))
        done.add(id(r))
        pass_.budget -= n


def admission_blocks(step: int, whole: int, in_flight: int = 0) -> int:
    """Free blocks an admission needs (step 1b): vLLM 0.33 admits a request only when the
    free blocks hold its whole sequence (``whole``), not only the ``step`` blocks this step's
    tokens fill; an asynchronous load also leaves free what the prefills in flight still
    need (``in_flight``), beside the loaded prefix (its ``step``)."""
    return max(step + in_flight, whole)


def listed(pass_: StepPass[R, B]) -> tuple[list[tuple[R, int, B, bool]], set[R]]:
    """The step's scheduled requests as vLLM 0.33's ``SchedulerOutput`` lists them (step
    1c): new requests, then resumed ones (as new ones too: their whole block lists, no
    resumed flag), then the running ones, each in scheduling order; and the requests it
    lists as new (the new and the resumed ones)."""
    new = pass_.new

    def rank(e: tuple[R, int, B, bool]) -> int:
        return 0 if e[0] in new else 1 if e[3] else 2

    entries = [(r, n, blocks, False) for r, n, blocks, _ in sorted(pass_.scheduled, key=rank)]
    return entries, new | {r for r, _, _, resumed in pass_.scheduled if resumed}


def waiting_order(waiting: Sequence[R], holds_blocks: Callable[[R], bool]) -> list[R]:
    """The order step 1b tries the waiting requests in: those holding KV blocks (a load
    ended, failed or not; they only need their remaining blocks) first, then the others,
    each in queue order, as vLLM 0.33 drains its ``kv_holding_waiting`` queue before
    ``waiting``. (In queue order alone, a first request too large for the free blocks keeps
    them waiting behind it, with nothing running to free any: a jam.)"""
    holding = [r for r in waiting if holds_blocks(r)]
    if not holding:
        return list(waiting)
    return holding + [r for r in waiting if not holds_blocks(r)]
