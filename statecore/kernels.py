"""Pure kernels of the scheduler, with contracts.

Every decision the scheduler makes on counts, ids and cursors is one of these small functions,
so that CrossHair can check its PEP 316 contracts (``pre:``/``post:`` lines in the docstring)
symbolically: ``crosshair check --analysis_kind=PEP316 statecore.kernels``. The scheduler calls
exactly these functions on its hot path; nothing is re-implemented beside them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

__all__ = [
    "ReportKind",
    "advance_cursor",
    "apply_report",
    "classify_report",
    "fence_add",
    "fence_remove",
    "prefix_hits",
    "rank_delta",
    "reset_plan",
    "stall_due",
    "storable_chunks",
    "window_hits",
]

# LookupResult values, duplicated as ints so these kernels stay free of imports CrossHair
# would have to model; statecore.manager.LookupResult is an IntEnum with the same values.
MISS, HIT, HIT_PENDING, RETRY = 0, 1, 2, 3


class ReportKind(enum.IntEnum):
    """How a worker report for one job id is treated."""

    LIVE = 0
    """The job is in flight: the report counts towards its quorum."""
    STALLED = 1
    """The job was declared stalled: the report is absorbed (late report)."""
    STALE = 2
    """The job belongs to an epoch before the last reset: the report is inert."""
    UNKNOWN = 3
    """The id was never issued: the report is inert and counted."""
    DUPLICATE = 4
    """The id was issued in this epoch but the job already ended: inert and counted."""


def classify_report(
    job_id: int, stale_threshold: int, next_job_id: int, live: bool, stalled: bool
) -> ReportKind:
    """Classify a report for ``job_id`` (INV-EPOCH).

    A live or stalled job's report is applied even below the threshold: a load carried over
    a reset keeps its id and completes (or stalls) on its reports.

    pre: 0 <= stale_threshold <= next_job_id
    pre: not (live and stalled)
    pre: not (live or stalled) or 0 <= job_id < next_job_id
    post: __return__ != ReportKind.STALE or 0 <= job_id < stale_threshold
    post: live or stalled or not 0 <= job_id < stale_threshold or __return__ == ReportKind.STALE
    post: (__return__ == ReportKind.LIVE) == live
    post: (__return__ == ReportKind.STALLED) == stalled
    post: __return__ != ReportKind.UNKNOWN or job_id >= next_job_id or job_id < 0
    """
    if job_id < 0:
        return ReportKind.UNKNOWN
    if live:
        return ReportKind.LIVE
    if stalled:
        return ReportKind.STALLED
    if job_id < stale_threshold:
        return ReportKind.STALE
    if job_id >= next_job_id:
        return ReportKind.UNKNOWN
    return ReportKind.DUPLICATE


def apply_report(pending: int, ok: int, bad: int) -> tuple[int, int, int, int]:
    """Apply ``ok`` successful and ``bad`` failed worker reports to ``pending`` (INV-QUORUM).

    Failures are accepted first, so an over-report never hides a failure. Returns
    ``(new_pending, accepted_ok, accepted_bad, excess)``; the excess is what exceeded the
    outstanding count (duplicate reports) and is dropped.

    pre: pending >= 0 and ok >= 0 and bad >= 0
    post: __return__[0] >= 0
    post: __return__[0] == pending - __return__[1] - __return__[2]
    post: __return__[1] + __return__[2] + __return__[3] == ok + bad
    post: __return__[3] == max(0, ok + bad - pending)
    post: __return__[2] == min(bad, pending)
    """
    accepted_bad = min(bad, pending)
    accepted_ok = min(ok, pending - accepted_bad)
    excess = ok + bad - accepted_ok - accepted_bad
    return pending - accepted_ok - accepted_bad, accepted_ok, accepted_bad, excess


def over_report(pending: int, ok: int, bad: int) -> bool:
    """Whether a count-only report claims more workers than the job still waits for.

    Without rank identity such a report cannot be told apart from a duplicate of one worker's
    report, so no part of it is trustworthy: it is rejected whole (and counted). Applying the
    outstanding part would complete the job before every worker finished (INV-QUORUM).

    pre: pending >= 0 and ok >= 0 and bad >= 0
    post: __return__ == (ok + bad > pending)
    """
    return ok + bad > pending


def rank_delta(
    seen: int, ok_mask: int, bad_mask: int, num_workers: int
) -> tuple[int, int, int, int, int]:
    """Which ranks of a report are new for a job (INV-QUORUM with rank identity).

    ``seen`` is the mask of ranks that already reported the job. Returns ``(new_seen, ok, bad,
    duplicates, invalid)``: the updated mask, how many ranks newly reported success and
    failure (a rank reporting both counts as a failure), how many rank bits were already
    seen, and how many name a rank that does not exist.

    pre: 0 < num_workers <= 16
    pre: 0 <= seen < 2 ** num_workers
    pre: 0 <= ok_mask < 2 ** 20 and 0 <= bad_mask < 2 ** 20
    post: __return__[0] & seen == seen
    post: 0 <= __return__[0] < 2 ** num_workers
    post: __return__[1] + __return__[2] == bin(__return__[0] & ~seen).count("1")
    post: __return__[1] >= 0 and __return__[2] >= 0
    """
    valid = (1 << num_workers) - 1
    invalid = bin((ok_mask | bad_mask) & ~valid).count("1")
    ok_mask &= valid
    bad_mask &= valid
    fresh_bad = bad_mask & ~seen
    fresh_ok = ok_mask & ~seen & ~fresh_bad
    duplicates = bin((ok_mask | bad_mask) & seen).count("1")
    return (
        seen | fresh_bad | fresh_ok,
        bin(fresh_ok).count("1"),
        bin(fresh_bad).count("1"),
        duplicates,
        invalid,
    )


def advance_cursor(cursor: int, storable: int) -> int:
    """The store cursor after ``storable`` leading chunks were considered (never backwards).

    pre: cursor >= 0 and storable >= 0
    post: __return__ >= cursor and __return__ >= storable
    post: __return__ in (cursor, storable)
    """
    return storable if storable > cursor else cursor


def reset_plan(
    live: frozenset[int], stalled: frozenset[int], next_job_id: int, stale_threshold: int
) -> tuple[frozenset[int], int]:
    """What ``reset_cache`` flushes and the new stale threshold (INV-EPOCH).

    Every live and stalled job is flushed to the workers (loads too), and the threshold moves
    to the next job id, so that every report for a job issued before the reset is inert,
    except a carried load's (it stays live; see :func:`classify_report`).

    pre: 0 <= stale_threshold <= next_job_id
    pre: all(stale_threshold <= j < next_job_id for j in live | stalled)
    post: __return__[0] == live | stalled
    post: __return__[1] == next_job_id
    post: all(j < __return__[1] for j in __return__[0])
    post: __return__[1] >= stale_threshold
    """
    return live | stalled, next_job_id


def stall_due(now: float, created_at: float, timeout: float) -> bool:
    """Whether a job created at ``created_at`` is stalled at ``now``.

    pre: timeout > 0
    post: __return__ == (now - created_at >= timeout)
    """
    return now - created_at >= timeout


def storable_chunks(
    n_offloadable_tokens: int,
    tokens_per_chunk: int,
    n_block_ids: int,
    blocks_per_chunk: int,
    n_keys: int,
) -> int:
    """How many leading chunks of a group may be stored now (INV-CURSOR's bound).

    pre: n_offloadable_tokens >= 0 and n_block_ids >= 0 and n_keys >= 0
    pre: tokens_per_chunk > 0 and blocks_per_chunk > 0
    post: 0 <= __return__ <= n_keys
    post: __return__ * blocks_per_chunk <= n_block_ids
    post: __return__ * tokens_per_chunk <= n_offloadable_tokens
    """
    return min(n_offloadable_tokens // tokens_per_chunk, n_block_ids // blocks_per_chunk, n_keys)


def prefix_hits(results: Sequence[int], budget_chunks: int) -> int | None:
    """Maximal-prefix lookup decision over per-chunk lookup results, in order.

    ``results`` holds the manager's answers from the first chunk on, ending at (and
    including) the first MISS if there is one. Returns the number of leading chunks to load, or
    None to defer: a RETRY anywhere defers; a run of pending chunks longer than
    ``budget_chunks`` defers, a shorter one is cut off (recomputed instead of waited for).

    pre: budget_chunks >= 0
    pre: all(0 <= r <= 3 for r in results)
    post: __return__ is None or 0 <= __return__ <= len(results)
    post: __return__ is None or all(r == HIT for r in results[:__return__])
    """
    if HIT_PENDING not in results and RETRY not in results:  # only hits up to a miss: C speed
        return results.index(MISS) if MISS in results else len(results)
    count = 0
    first_pending: int | None = None
    retry = False
    for r in results:
        if r == MISS:
            break
        if r == RETRY:
            retry = True
        elif r == HIT_PENDING and first_pending is None:
            first_pending = count
        count += 1
    if retry:
        return None
    if first_pending is None:
        return count
    if count - first_pending > budget_chunks:
        return None
    return first_pending


def window_hits(results: Sequence[int], window: int) -> int | None:
    """Sliding-window lookup decision: scan from the right for ``window`` readable chunks.

    Returns the end index (exclusive, counted from the start of ``results``) of the
    rightmost run of ``window`` consecutive HIT chunks, the length of a leading run of HITs
    shorter than ``window`` if no full window exists, 0 for no hit, or None to defer (a RETRY
    or pending chunk inside the run that would be chosen).

    pre: window > 0
    pre: all(0 <= r <= 3 for r in results)
    post: __return__ is None or 0 <= __return__ <= len(results)
    """
    streak = 0
    blocked = False
    for idx in range(len(results) - 1, -1, -1):
        r = results[idx]
        if r in (HIT, HIT_PENDING):
            streak += 1
            blocked = blocked or r == HIT_PENDING
            if streak == window:
                return None if blocked else idx + window
        else:
            if r == RETRY:
                return None
            streak = 0
            blocked = False
    if blocked:
        return None
    return streak


def fence_add(index: dict[int, set[int]], job_id: int, blocks: Iterable[int]) -> None:
    """Register ``job_id`` on every block of ``blocks`` in the fence index.

    pre: all(index[b] for b in index)
    post: all(index[b] for b in index)
    post: all(job_id in index[b] for b in blocks)
    """
    for b in blocks:
        jobs = index.get(b)
        if jobs is None:
            index[b] = {job_id}
        else:
            jobs.add(job_id)


def fence_remove(index: dict[int, set[int]], job_id: int, blocks: Iterable[int]) -> int:
    """Remove ``job_id`` from every block of ``blocks``; drop blocks left without jobs.

    Returns how many (block, job) pairs were missing (a tolerated, counted anomaly: the same
    block id listed twice in a job).

    pre: all(index[b] for b in index)
    post: all(b not in index or job_id not in index[b] for b in blocks)
    post: all(index[b] for b in index)
    """
    missing = 0
    for b in blocks:
        jobs = index.get(b)
        if jobs is None or job_id not in jobs:
            missing += 1
            continue
        jobs.discard(job_id)
        if not jobs:
            del index[b]
    return missing
