"""vLLM 0.33's engine step, written once: the order in which statecore's engine models step.

statecore has one engine order, vLLM 0.33's, and two engine models that run it: the
simulator's :class:`~statecore.sim.engine.SimEngine` (which the stateful fuzzer,
:mod:`statecore.specs.stack`, drives too) and the model checker's
:class:`~statecore.check.model.World`. Each keeps its own representation of requests and
blocks (the simulator real bytes and a prefix cache, the checker labels and a state designed
to be hashed), and both take from this module the order, the running requests' preemption
rule, the waiting queues, the admission rule and its in-flight reserve, the output's listing
order and ``has_requests``. The scheduler benchmark's own loop
(``statecore bench scheduler --engine standalone``) takes the rules it needs (one KV-cache
group, no failing loads). ``tests/vllm/test_engine_differential.py`` runs seeded workloads,
with and without failing loads, through each of the three and through vLLM's real
``Scheduler`` and asserts the same connector calls step by step.

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
   b. only when (a) preempted nothing, the waiting requests (:func:`waiting_order`,
      :func:`requeue_skipped`): the engine's own admission (prefix-cache hit,
      ``get_num_new_matched_tokens``, ``update_state_after_alloc``, an asynchronous load
      parks the request until its load ended); a request whose load ended is promoted when
      this phase reaches it (the loaded blocks enter the prefix cache or, with nothing
      valid, every block is freed, and it is tried in the same pass);
   c. the ``SchedulerOutput`` (new requests, then resumed ones, listed as new, then running
      ones) to the connector's ``build_connector_meta``;

2. the workers: ``start_step`` (flush, loads), compute, ``end_step``, their reports;
3. ``Scheduler.update_from_output``: the step's outputs first (a request that reached its
   length finishes: ``request_finished``, its blocks freed), then the aggregated report to
   ``update_connector_output``. A load the connector ends valid is learnt now; one it ends
   with invalid blocks (failed, or stalled) is learnt only from the workers' output of the
   next step, whose metadata echoes it to them (vLLM takes invalid blocks from the workers
   alone): its computed tokens fall back to the first invalid block (to 0 with several
   KV-cache groups, whose block ids vLLM cannot map back), and it is promoted in step 1b
   after that.
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
    "holds_kv",
    "listed",
    "load_end",
    "remaining_blocks",
    "requeue_skipped",
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


def load_end(start: int, n: int, first_invalid: int | None, n_groups: int) -> int:
    """The computed tokens a request keeps when the engine learns that its load of tokens
    ``start .. start + n`` ended (step 3): all of them when no block was invalid
    (``first_invalid`` is None, else the first token of the first invalid block, over every
    KV-cache group); the tokens before that block with one KV-cache group (vLLM's
    ``_update_requests_with_invalid_blocks``, never less than the local prefix ``start``);
    none with several, whose block ids vLLM cannot map back to requests (the connector
    reports the load in ``failed_recving``, and the request restarts from token 0)."""
    if first_invalid is None:
        return start + n
    if n_groups > 1:
        return 0
    return max(first_invalid, start)


def remaining_blocks(required: int, held: int, out_of_window: int) -> int:
    """Blocks of one KV-cache group a prefill in flight still needs for its whole sequence
    (vLLM 0.33's ``get_num_blocks_to_allocate``, the reserve of :func:`admission_blocks`):
    ``required`` blocks cover the sequence; the request already holds ``held`` positions
    (null blocks in place of freed ones count) and needs none for the ``out_of_window``
    leading ones."""
    return max(0, required - max(out_of_window, held))


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


def waiting_order(waiting: Sequence[R], kv_holding: Callable[[R], bool]) -> list[R]:
    """The order step 1b tries the waiting requests in: those in vLLM 0.33's
    ``kv_holding_waiting`` queue first (``kv_holding``), then the others, each in queue
    order. (In queue order alone, a first request too large for the free blocks keeps them
    waiting behind it, with nothing running to free any: a jam.)

    The engine models keep vLLM's two queues as one list, each queue the subsequence of its
    members. A request's queue is decided when it enters one: an arrival or a preempted
    request enters ``waiting``; a request step 1b skips (it waits for its load, its lookup
    was deferred, or its asynchronous load was just admitted) re-enters at the front
    (:func:`requeue_skipped`), in ``kv_holding_waiting`` when :func:`holds_kv` says so. A
    request the phase stops at stays where it is, in its queue, even
    when its blocks were freed meanwhile (a failed load's promotion)."""
    holding = [r for r in waiting if kv_holding(r)]
    if not holding:
        return list(waiting)
    return holding + [r for r in waiting if not kv_holding(r)]


def holds_kv(num_computed_tokens: int, waits_for_load: bool) -> bool:
    """Whether a request step 1b skips re-enters vLLM 0.33's ``kv_holding_waiting`` queue
    (its ``_holds_kv_blocks``): it has computed tokens, or it waits for its load."""
    return num_computed_tokens > 0 or waits_for_load


def requeue_skipped(waiting: Sequence[R], skipped: Sequence[R]) -> list[R]:
    """The waiting list after step 1b: the requests it skipped (a subset of ``waiting``), in
    the order it skipped them, go to the front, as vLLM 0.33 prepends a pass's skipped
    requests to their queues; the engine model then sets each one's queue
    (:func:`waiting_order`)."""
    if not skipped:
        return list(waiting)
    moved = set(skipped)
    return list(skipped) + [r for r in waiting if r not in moved]
