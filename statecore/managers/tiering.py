"""The tiering manager: the CPU tier as primary, secondary tiers below it.

Principles:

* The GPU only talks to the primary. Bytes in a secondary tier are *promoted* into a primary
  slot before they can be loaded.
* A successful primary store cascades to **every** secondary tier; the primary slots stay
  pinned (reference count +1 per tier) until the tier reports the copy done, successful or
  not. A failed primary store cascades nothing (INV-NO-PARTIAL).
* ``pending_primary_stores`` counts a request's primary stores not yet completed. The
  secondary tiers learn that a request finished only once it is finished **and** that count
  is 0, because a later ``complete_store`` still cascades (INV-ORDER).
* A lookup that misses in the primary but hits in an allowed secondary tier allocates the
  primary slot at once (write-pending, so later lookups answer ``HIT_PENDING`` and nothing is
  promoted twice) and queues the promotion; promotions are batched per (tier, request) and
  submitted in ``on_schedule_end``. The promotion's result completes the primary write.
* A promotion never evicts a primary key that answered ``HIT`` earlier in the same step: the
  scheduler may still ``prepare_load`` it.
* A promotion never takes a quarantined primary slot: one freed by ``reset_cache`` or a failed
  ``complete_store`` less than two ``on_schedule_end`` calls ago, which a GPU transfer the
  workers have not flushed yet may still write or read (see :mod:`statecore.managers.cpu`).
  If no other room can be made, the lookup answers ``MISS``.
* Secondary tiers are polled at most once per engine step, by the first of ``lookup``,
  ``prepare_load``, ``prepare_store`` or ``on_schedule_end``.
* Events follow the primary's ``enable_events``: with it off, the tiers' stored/removed events
  are dropped at every ``on_schedule_end`` (and by ``take_events``) instead of waiting for a
  ``take_events`` that an engine without events never makes, so that memory stays flat.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statecore import validate
from statecore.errors import ConfigError, ManagerStateError, describe
from statecore.keys import OffloadKey
from statecore.manager import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.tiers import JobResult, SecondaryTier
from statecore.pool import CPUPool

__all__ = ["TieringOffloadingManager"]


@dataclass(slots=True)
class _TierJob:
    tier: int
    keys: tuple[OffloadKey, ...]
    is_promotion: bool
    ctx: ReqContext


@dataclass(slots=True)
class _PendingPromotion:
    ctx: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: tuple[int, ...] = ()


class TieringOffloadingManager(OffloadingManager):
    """A CPU primary tier with zero or more secondary tiers (see the module docstring).

    Args:
        primary: the CPU tier; its slots are rows of the pool the secondary tiers copy.
        secondaries: the secondary tiers, in lookup order.
    """

    FINALIZED_MEMORY = 65_536
    """How many finalised request ids are remembered to reject a second finish."""

    def __init__(
        self, primary: CPUOffloadingManager, secondaries: Sequence[SecondaryTier] = ()
    ) -> None:
        if not isinstance(primary, CPUOffloadingManager):
            raise ConfigError(
                "TieringOffloadingManager.primary must be a CPUOffloadingManager, got "
                f"{describe(primary)}",
                "TieringOffloadingManager.primary",
                primary,
            )
        given: object = secondaries
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise ConfigError(
                "TieringOffloadingManager.secondaries must be a sequence of SecondaryTier, got "
                f"{describe(secondaries)}",
                "TieringOffloadingManager.secondaries",
                secondaries,
            )
        for i, tier in enumerate(secondaries):
            if not isinstance(tier, SecondaryTier):
                raise ConfigError(
                    f"TieringOffloadingManager.secondaries[{i}] must be a SecondaryTier, got "
                    f"{describe(tier)}",
                    f"TieringOffloadingManager.secondaries[{i}]",
                    tier,
                )
        self.primary = primary
        # (the primary's request-aware policy ranks a request's chunks by their positions)
        self.wants_key_positions = bool(getattr(primary, "wants_key_positions", False))
        self.secondaries: tuple[SecondaryTier, ...] = tuple(secondaries)
        self._jobs: dict[int, _TierJob] = {}
        self._pending_promotions: list[dict[str, _PendingPromotion]] = [
            {} for _ in self.secondaries
        ]
        self._num_pending_promotions = 0
        self._polled_this_step = False
        self._hits_this_step: set[OffloadKey] = set()
        self._req_state: dict[str, _RequestState] = {}
        self._finalized: OrderedDict[str, None] = OrderedDict()
        self._next_job_id = 0
        self._stats: dict[str, int] = {
            "cascades_submitted": 0,
            "cascades_failed": 0,
            "promotions_submitted": 0,
            "promotions_failed": 0,
            "promotions_dropped": 0,
            "unknown_job_results": 0,
        }

    @classmethod
    def from_config(
        cls,
        primary: CPUOffloadingManager,
        pool: CPUPool,
        tiers: Sequence[Mapping[str, Any]],
        layout: Any = None,
    ) -> TieringOffloadingManager:
        """A manager whose secondary tiers are described by plain dicts (``{"kind": "file",
        ...}``, ``{"kind": "redis", ...}``; see :mod:`statecore.managers.tierconfig`)."""
        from statecore.managers.tierconfig import build_tier

        return cls(primary, [build_tier(spec, pool, layout) for spec in tiers])

    # -- introspection --------------------------------------------------------------------------

    def pending_primary_stores(self, req_id: str) -> int:
        """The request's primary stores not yet completed (0 when untracked)."""
        state = self._req_state.get(req_id)
        return 0 if state is None else state.pending_primary_stores

    def tracked_requests(self) -> list[str]:
        """Requests whose state is kept (not yet finalised in the secondary tiers)."""
        return list(self._req_state)

    def in_flight_jobs(self) -> int:
        """Secondary-tier jobs submitted and not yet reported."""
        return len(self._jobs)

    # -- polling --------------------------------------------------------------------------------

    def _poll(self, force: bool = False) -> None:
        if self._polled_this_step and not force:
            return
        self._polled_this_step = True
        for idx, tier in enumerate(self.secondaries):
            for result in tier.get_finished():
                self._on_result(idx, result)

    def _on_result(self, tier_idx: int, result: JobResult) -> None:
        job = self._jobs.get(result.job_id)
        if job is None or job.tier != tier_idx:
            self._stats["unknown_job_results"] += 1
            return
        del self._jobs[result.job_id]
        primary = self.primary
        if job.is_promotion:
            if result.success:
                primary.complete_write(job.keys, job.ctx, True)
                return
            self._stats["promotions_failed"] += 1
            ok = set(result.successful_keys or ())
            if ok:
                primary.complete_write([k for k in job.keys if k in ok], job.ctx, True)
            # The tier has finished writing these slots: no quarantine needed.
            primary.complete_write(
                [k for k in job.keys if k not in ok], job.ctx, False, quarantine=False
            )
        else:
            if not result.success:
                self._stats["cascades_failed"] += 1
            primary.complete_read(job.keys, job.ctx)

    def _new_job(
        self, tier: int, keys: tuple[OffloadKey, ...], promo: bool, ctx: ReqContext
    ) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = _TierJob(tier, keys, promo, ctx)
        return job_id

    def _cascade(self, keys: Sequence[OffloadKey], ctx: ReqContext, tiers: Iterable[int]) -> None:
        if not keys:
            return
        key_tuple = tuple(keys)
        for idx in tiers:
            spec = self.primary.prepare_read(key_tuple, ctx)
            job_id = self._new_job(idx, key_tuple, False, ctx)
            self._stats["cascades_submitted"] += 1
            self.secondaries[idx].submit_store(job_id, key_tuple, spec.slots)

    # -- lookups and loads ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Primary first; a hit in an allowed secondary tier starts a promotion (HIT_PENDING)."""
        validate.offload_key(key, "lookup")
        validate.req_context(ctx, "lookup")
        self._poll()
        result = self.primary.lookup(key, ctx)
        if result is LookupResult.HIT:
            # The scheduler may prepare_load it later in this step: promotions must not evict it.
            self._hits_this_step.add(key)
            return result
        if result is not LookupResult.MISS:
            return result
        retry = False
        allowed = ctx.load_tier_filter
        for idx, tier in enumerate(self.secondaries):
            if not allowed.allows(tier.medium):
                continue
            answer = tier.lookup(key, ctx)
            if answer is LookupResult.HIT:
                return self._start_promotion(idx, key, ctx)
            if answer is not LookupResult.MISS:
                retry = True
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _start_promotion(self, tier_idx: int, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        out = self.primary.prepare_write(
            (key,),
            ctx,
            bypass_reuse_filter=True,
            protected=self._hits_this_step,
            skip_quarantined=True,
        )
        slot = self.primary.slot_of(key)
        if out is None or not out.keys_to_store or slot is None:
            return LookupResult.MISS
        per_req = self._pending_promotions[tier_idx]
        pending = per_req.get(ctx.req_id)
        if pending is None:
            pending = per_req[ctx.req_id] = _PendingPromotion(ctx)
        pending.keys.append(key)
        pending.slots.append(slot)
        self._num_pending_promotions += 1
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """Poll the tiers (once per step), then pin ``keys`` in the primary."""
        validate.offload_keys(keys, "prepare_load")
        self._poll()
        return self.primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpin ``keys`` in the primary only."""
        self.primary.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Touch the primary and every secondary tier."""
        validate.offload_keys(keys, "touch")
        self.primary.touch(keys, ctx)
        for tier in self.secondaries:
            tier.touch(keys, ctx)

    # -- stores ---------------------------------------------------------------------------------

    def _state(self, ctx: ReqContext) -> _RequestState:
        state = self._req_state.get(ctx.req_id)
        if state is None:
            state = self._req_state[ctx.req_id] = _RequestState(ctx)
        return state

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Poll, allocate in the primary, count the pending primary store.

        For tiers that asked for request-level offloading, offered keys already ready in the
        primary are cascaded at once (they will not be stored again).
        """
        validate.offload_keys(keys, "prepare_store")
        validate.req_context(ctx, "prepare_store")
        self._poll()
        state = self._state(ctx)
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        if out.keys_to_store:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            new = set(out.keys_to_store)
            warm = [k for k in dict.fromkeys(keys) if k not in new and self.primary.is_ready(k)]
            self._cascade(warm, ctx, state.request_level_tiers)
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Complete the primary write; on success cascade the keys it made ready to every tier."""
        validate.offload_keys(keys, "complete_store")
        validate.req_context(ctx, "complete_store")
        validate.flag(success, "complete_store", "success")
        changed = self.primary.complete_write(keys, ctx, success)
        if success:
            self._cascade(changed, ctx, range(len(self.secondaries)))
        state = self._req_state.get(ctx.req_id)
        if state is not None and state.pending_primary_stores > 0:
            state.pending_primary_stores -= 1
            self._maybe_finalize(state)

    # -- request lifecycle ------------------------------------------------------------------------

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Create the request's state; REQUEST_LEVEL if any secondary tier asks for it."""
        validate.req_context(ctx, "on_new_request")
        self._finalized.pop(ctx.req_id, None)
        self.primary.on_new_request(ctx)
        state = self._state(ctx)
        level = tuple(
            idx
            for idx, tier in enumerate(self.secondaries)
            if tier.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
        )
        state.request_level_tiers = level
        policy = OffloadPolicy.REQUEST_LEVEL if level else OffloadPolicy.CHUNK_LEVEL
        return RequestOffloadingContext(policy)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Tell the primary now; the secondary tiers once no primary store is pending.

        A request the manager never saw is finalised at once. Raises
        :class:`~statecore.errors.ManagerStateError` (nothing changes) for a request that
        already finished: a second call would re-create it and notify every tier again. The
        last ``FINALIZED_MEMORY`` finalised request ids are remembered for this check;
        ``on_new_request`` with such an id starts a new request under it.
        """
        validate.req_context(ctx, "on_request_finished")
        state = self._req_state.get(ctx.req_id)
        if ctx.req_id in self._finalized or (state is not None and state.is_finished):
            raise ManagerStateError(
                f"request {ctx.req_id!r}",
                "already finished and finalised"
                if state is None
                else f"already finished ({state.pending_primary_stores} primary stores pending)",
                "on_request_finished",
            )
        self.primary.on_request_finished(ctx)
        state = self._state(ctx)
        state.is_finished = True
        self._maybe_finalize(state)

    def _maybe_finalize(self, state: _RequestState) -> None:
        if not state.is_finished or state.pending_primary_stores > 0:
            return
        for tier in self.secondaries:
            tier.on_request_finished(state.ctx)
        del self._req_state[state.ctx.req_id]
        finalized = self._finalized
        finalized[state.ctx.req_id] = None
        if len(finalized) > self.FINALIZED_MEMORY:
            finalized.popitem(last=False)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Poll (if not yet this step), submit the step's promotions, start a new step.

        The primary's ``on_schedule_end`` advances its quarantine clock.
        """
        self._poll()
        self._polled_this_step = False
        self._hits_this_step.clear()
        if self._num_pending_promotions:
            for idx, per_req in enumerate(self._pending_promotions):
                if not per_req:
                    continue
                tier = self.secondaries[idx]
                for pending in per_req.values():
                    keys = tuple(pending.keys)
                    job_id = self._new_job(idx, keys, True, pending.ctx)
                    self._stats["promotions_submitted"] += 1
                    tier.submit_load(job_id, keys, tuple(pending.slots))
                per_req.clear()
            self._num_pending_promotions = 0
        self.primary.on_schedule_end(ctx)
        for tier in self.secondaries:
            tier.on_schedule_end(ctx)
        if not self.primary.enable_events:
            self._drop_tier_events()

    def _drop_tier_events(self) -> None:
        """Events are off (the primary's ``enable_events``): the tiers' are not kept."""
        for tier in self.secondaries:
            tier.take_events()

    def has_pending_work(self) -> bool:
        """Jobs in flight, promotions not yet submitted, or a tier with pending work."""
        return (
            bool(self._jobs)
            or self._num_pending_promotions > 0
            or any(t.has_pending_work() for t in self.secondaries)
        )

    # -- housekeeping ---------------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """The primary's events, then each secondary tier's (none with the primary's
        ``enable_events`` off: the tiers' are dropped then)."""
        events = list(self.primary.take_events())
        if not self.primary.enable_events:
            self._drop_tier_events()
            return events
        for tier in self.secondaries:
            events.extend(tier.take_events())
        return events

    def reset_cache(self) -> None:
        """Drain the tiers, apply their results, finalise finished requests, reset the primary.

        Unsubmitted promotions are dropped; the secondary tiers keep their contents.
        """
        for tier in self.secondaries:
            tier.drain()
        self._poll(force=True)
        self._stats["promotions_dropped"] += self._num_pending_promotions
        for per_req in self._pending_promotions:
            per_req.clear()
        self._num_pending_promotions = 0
        # Jobs a tier did not report even after draining are forgotten: their late results
        # are counted as unknown.
        self._jobs.clear()
        for state in list(self._req_state.values()):
            state.pending_primary_stores = 0
            self._maybe_finalize(state)
        self.primary.reset_cache()
        self._polled_this_step = False
        self._hits_this_step.clear()

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """The primary's stats, the tiering counters, and each tier's stats as ``name.metric``."""
        stats = self.primary.get_stats()
        stats.update(self._stats)
        self._stats = dict.fromkeys(self._stats, 0)
        for idx, tier in enumerate(self.secondaries):
            prefix = f"{getattr(tier, 'name', 'tier')}{idx}."
            for name, value in tier.get_stats().items():
                stats[prefix + name] = value
        return stats

    def shutdown(self) -> None:
        """Shut the secondary tiers down, then the primary."""
        for tier in self.secondaries:
            tier.shutdown()
        self.primary.shutdown()
