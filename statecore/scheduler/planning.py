"""Lookup and store planning: pure functions from the request's groups to a plan.

The scheduler's decisions (:mod:`statecore.scheduler.core`) say *whether* a request looks up,
loads or stores; the functions here work out *what*: which chunks a lookup hits, which blocks
a load fills, which chunks a store offers and which blocks the manager's answer takes. They
change no scheduler state (the one exception, :func:`extend_keys`, appends to the request's
own key lists) and call the manager only where it is passed in (``lookup_many``).

Speed. These run on the engine's step, so the usual case is written to stay in C: a slice
instead of a loop over chunks, ``set(map(type, ...))`` instead of a check per hash,
``itertools.compress`` to filter in one pass, a tuple shared by a job and its transfer. Each
shortcut covers the usual case only and falls back to the plain loop, which gives the same
answer; the comment beside each says which case it takes. Nothing outside this module (and
:func:`~statecore.scheduler.jobs.count_loaders`) plays such tricks.

Units: ``tpc[g]`` tokens per chunk of group ``g``, ``tpb[g]`` tokens per block, ``bpc`` blocks
per chunk (the same for every group), ``hpc[g]`` block hashes per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, le
from typing import Any

from statecore import kernels, validate
from statecore.errors import MetadataError
from statecore.keys import OffloadKey
from statecore.manager import ReqContext
from statecore.scheduler.records import GroupState
from statecore.views import ScheduledRequest, SchedulerOutput

__all__ = [
    "LookupFailed",
    "accepted_store",
    "admitted_lists",
    "ceil_div",
    "extend_keys",
    "hit_chunks_loading",
    "load_plan",
    "lookup_hits",
    "scheduled_entries",
    "store_floor",
    "store_offer",
]

_BYTES_ONLY = {bytes}
_SEQ = (list, tuple)
_INT_VALUE: Any = int.__index__
"""An id as the exact int it equals: raises TypeError for anything that is not an int (or
an int subclass such as bool), and ignores a subclass's own comparison operators."""


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up."""
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# the engine's arguments, read fast


_native_block_lists: Callable[[Any, int], tuple[tuple[int, ...], ...] | None] | None
try:  # the accepting half of admitted_lists in C (optional: built by the install)
    from statecore._viewcheck import block_lists as _native_block_lists
except ImportError:  # pragma: no cover - the extension is optional (no compiler at install)
    _native_block_lists = None


def admitted_lists(
    block_ids: Any, n_groups: int, num_external_tokens: Any
) -> tuple[tuple[int, ...], ...] | None:
    """The block lists of :meth:`OffloadingScheduler.update_state_after_alloc` as tuples, or
    None when an argument is malformed (the validation layer then diagnoses).

    The C check (``statecore._viewcheck.block_lists``, where built) accepts the plain form
    (exact lists/tuples of exact ints >= 0); what it declines the Python check below rules
    on, so what is accepted does not depend on whether the extension is built.
    """
    if type(num_external_tokens) is not int or num_external_tokens < 0:
        return None
    if _native_block_lists is not None:
        fast = _native_block_lists(block_ids, n_groups)
        if fast is not None:
            return fast
    if type(block_ids) not in _SEQ or len(block_ids) != n_groups:
        return None
    out: list[tuple[int, ...]] = []
    try:
        for ids in block_ids:
            if type(ids) not in _SEQ:
                return None
            t = tuple(ids)
            if t and min(map(_INT_VALUE, t)) < 0:
                return None
            out.append(t)
    except TypeError:
        return None
    return tuple(out)


# the fields of a ScheduledRequest, as the tuple scheduled_entries yields (one C call each)
_ENTRY: Callable[[ScheduledRequest], tuple[str, Any, int, bool]] = attrgetter(
    "req_id", "new_block_ids", "num_scheduled_tokens", "resumed_from_preemption"
)


def scheduled_entries(
    output: SchedulerOutput, dormant: set[str]
) -> Iterable[tuple[str, Any, int, bool]]:
    """The step's entries as ``(req_id, new_block_ids, num_scheduled_tokens, resumed)``:
    ``output.scheduled`` first, then its ``columns``, whose entries of a ``dormant`` request
    with no new blocks are left out (they change nothing: see ``_update_req_states``).

    All lazily and in C: a large decode batch, most of whose entries are dormant, costs no
    Python step per dropped entry. An entry is tested when it is reached, so a request that
    turns dormant in the caller's loop drops its later entries of the same step."""
    entries: Iterable[tuple[str, Any, int, bool]] = map(_ENTRY, output.scheduled)
    cols = output.columns
    if cols is None:
        return entries
    resumed = cols.resumed_req_ids
    rids = cols.req_ids
    blocks = cols.new_block_ids
    col_entries: Iterable[tuple[str, Any, int, bool]] = zip(
        rids,
        blocks,
        cols.num_scheduled_tokens,
        # (most steps resume nobody: no membership test per entry then)
        map(resumed.__contains__, rids) if resumed else repeat(False, len(rids)),
        strict=True,
    )
    if dormant:
        # Kept: not dormant, or with new blocks; as booleans, dormant <= has blocks (one
        # call an entry fewer than `not dormant or has blocks`)
        col_entries = compress(
            col_entries,
            map(le, map(dormant.__contains__, rids), map(is_not, blocks, repeat(None))),
        )
    return chain(entries, col_entries)


# ---------------------------------------------------------------------------------------------
# keys


def extend_keys(
    groups: Sequence[GroupState],
    hashes: Any,
    known: int,
    hpc: Sequence[int],
    suffix: Sequence[bytes],
    tpc: Sequence[int],
    positions: dict[OffloadKey, int] | None,
) -> int | None:
    """Turn block hashes beyond the first ``known`` into the groups' chunk keys (every group,
    or none of them); the number of hashes now read, or None when ``hashes`` is not a
    sequence of bytes-like values (nothing changes then).

    Each chunk's key is its last block's hash followed by the group's suffix (what
    :func:`~statecore.keys.make_offload_key` builds, without its argument checks: done here).
    ``positions``, when the manager ranks chunks by position, gets each new key's end token.
    """
    if type(hashes) is not list and not validate.is_sequence(hashes):
        return None
    n_hashes = len(hashes)
    if n_hashes == known:
        return known
    new: list[tuple[list[OffloadKey], Sequence[Any], int, bool]] = []
    sliceable = type(hashes) is list or type(hashes) is tuple
    for g, gs in enumerate(groups):
        per_chunk = hpc[g]
        have = len(gs.keys)
        whole = n_hashes // per_chunk
        if have < whole:
            # each chunk's key is built from its last hash block: every hpc-th hash
            ends: Sequence[Any]
            if sliceable:
                ends = hashes[have * per_chunk + per_chunk - 1 : whole * per_chunk : per_chunk]
            else:
                ends = [hashes[idx * per_chunk + per_chunk - 1] for idx in range(have, whole)]
            plain = set(map(type, ends)) == _BYTES_ONLY  # the usual case: one C pass
            if not plain:
                for h in ends:
                    if type(h) is not bytes and not isinstance(h, bytes | bytearray | memoryview):
                        return None
            new.append((gs.keys, ends, g, plain))
    for keys, ends, g, plain in new:
        tail = suffix[g]
        have = len(keys)
        if plain:  # (the + operator: twice as fast per key as map(bytes.__add__, ...))
            keys += [h + tail for h in ends]
        else:
            keys.extend([OffloadKey(bytes(h) + tail) for h in ends])
        if positions is not None:  # each chunk's end token (vLLM's key position)
            size = tpc[g]
            ends_at = range((have + 1) * size, (len(keys) + 1) * size, size)
            positions.update(zip(keys[have:], ends_at, strict=True))
    return n_hashes


# ---------------------------------------------------------------------------------------------
# lookup


class LookupFailed(Exception):
    """The manager's ``lookup_many`` raised ``error`` (the lookup is answered as no hit)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def lookup_hits(
    groups: Sequence[GroupState],
    order: Sequence[int],
    tpc: Sequence[int],
    window: Sequence[int | None],
    num_computed: int,
    max_hit: int,
    limit: int,
    budget_tokens: int,
    lookup_many: Callable[..., Sequence[int]],
    ctx: ReqContext,
) -> int | None:
    """How many tokens beyond ``num_computed`` every group can load (0: none), or None when a
    chunk is pending or being located (ask again later).

    ``max_hit`` bounds the hit's end, ``limit`` is an explicit cap met with whole chunks.
    Groups are asked in ``order`` (full attention first, then sliding window by window size,
    descending), each over the chunks from ``num_computed``'s up to the hit so far; a group's
    kernel (:func:`~statecore.kernels.prefix_hits`, :func:`~statecore.kernels.window_hits`)
    answers the same over its own answer's range again, so the passes stop once no group
    lowers the hit (with one group, one pass is all).

    A full-attention group covers the hit with the chunks that hold it, its last one maybe
    in part (the load fills the blocks up to the hit's end, as vLLM's connector does): with
    groups of different chunk sizes the hit need not end on a boundary of every group's
    chunks. Whole chunks only under an explicit cap (``limit``), and for a sliding-window
    group, whose window is counted in whole chunks back from the hit's end.

    Raises :class:`LookupFailed` with what ``lookup_many`` raised.
    """
    defer = False
    changed = True
    single = len(order) == 1
    while changed:
        changed = False
        for g in order:
            size = tpc[g]
            keys = groups[g].keys
            cap = min(max_hit, len(keys) * size)
            start = num_computed // size
            win = window[g]
            if win is not None or cap <= num_computed:
                end = cap // size
            else:
                end = min(-(-cap // size), limit // size, len(keys))
            if end <= start:  # (start + 1) * tpc > num_computed: nothing loadable
                return 0
            try:
                if win is None:  # (up to and with the first miss)
                    results = lookup_many(keys[start:end], ctx, True)
                else:
                    results = lookup_many(keys[start:end], ctx)
            except Exception as exc:
                raise LookupFailed(exc) from exc
            if win is None:
                hits = kernels.prefix_hits(results, budget_tokens // size)
            else:
                hits = kernels.window_hits(results, win)
            if hits is None:
                defer = True
                continue
            if hits == 0:
                return 0
            new_max = size * (start + hits)  # > num_computed: hits >= 1
            if new_max < max_hit:
                max_hit = new_max
                changed = not single
    if defer:
        return None
    # here max_hit > num_computed: a group whose cap is at most num_computed returned 0
    # above, and a lowered max_hit is tpc * (start + hits) > num_computed (hits >= 1)
    return max_hit - num_computed


def hit_chunks_loading(
    groups: Sequence[GroupState],
    order: Sequence[int],
    tpc: Sequence[int],
    num_computed: int,
    hit_end: int,
    loading: AbstractSet[OffloadKey],
) -> bool:
    """Whether a chunk the load up to ``hit_end`` would read is in ``loading`` (a key view:
    another request's load of it is in flight)."""
    for g in order:
        size = tpc[g]
        end = ceil_div(hit_end, size)  # (the chunks the load reads, as above)
        if not loading.isdisjoint(groups[g].keys[num_computed // size : end]):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# load


def load_plan(
    groups: Sequence[GroupState],
    block_ids: Sequence[Sequence[int]],
    num_local: int,
    num_cached: int,
    tpb: Sequence[int],
    tpc: Sequence[int],
    bpc: int,
    req_id: str,
) -> tuple[list[OffloadKey], list[int], list[int], list[int]]:
    """A load of the tokens from ``num_local`` up to ``num_cached``: its keys, the GPU blocks
    it fills (group after group, null blocks skipped at each group's start), and per group
    the number of blocks and the first block's index.

    Raises :class:`~statecore.errors.MetadataError` when a group's blocks or keys cannot hold
    ``num_cached`` tokens."""
    keys: list[OffloadKey] = []
    dst: list[int] = []
    sizes: list[int] = []
    starts: list[int] = []
    for g, gs in enumerate(groups):
        blocks = block_ids[g]
        n_gpu = ceil_div(num_cached, tpb[g])
        end_chunk = ceil_div(num_cached, tpc[g])
        if len(blocks) < n_gpu or len(gs.keys) < end_chunk:
            raise MetadataError(
                f"update_state_after_alloc: request {req_id!r} group {g}: "
                f"{len(blocks)} blocks and {len(gs.keys)} keys cannot hold "
                f"{num_cached} cached tokens"
            )
        start = ceil_div(num_local, tpb[g])
        while start < n_gpu and not blocks[start]:
            start += 1
        dst.extend(blocks[start:n_gpu])
        sizes.append(n_gpu - start)
        starts.append(start)
        if n_gpu > start:
            keys.extend(gs.keys[start // bpc : end_chunk])
    return keys, dst, sizes, starts


# ---------------------------------------------------------------------------------------------
# store


def store_offer(
    groups: Sequence[GroupState], n_off: int, tpc: Sequence[int], bpc: int, chunk_level: bool
) -> tuple[list[int], list[Sequence[int]], list[OffloadKey]]:
    """What a store offers the manager for ``n_off`` offloadable tokens: per group the chunks
    storable now (the new cursor, :func:`~statecore.kernels.storable_chunks`), per group the
    offered chunk indices (from the cursor, or past ``skip`` under the chunk-level policy;
    a ``range`` when none of them has a null block), and the offered keys in that order.

    Null or stale (zeroed) blocks are never stored (INV-SRC-VALID): a chunk holding one is
    not offered."""
    storable: list[int] = []
    per_group: list[Sequence[int]] = []
    offer: list[OffloadKey] = []
    for g, gs in enumerate(groups):
        block_ids = gs.block_ids
        n = kernels.storable_chunks(max(n_off, 0), tpc[g], len(block_ids), bpc, len(gs.keys))
        storable.append(n)
        first = max(gs.cursor, gs.skip) if chunk_level else gs.cursor
        head = block_ids[first * bpc : n * bpc]
        if 0 not in head:  # the usual case: every chunk, its keys one slice
            per_group.append(range(first, n))
            offer += gs.keys[first:n]
            continue
        valid: list[int]
        if bpc == 1:
            valid = list(compress(range(first, n), head))
        else:
            valid = [c for c in range(first, n) if 0 not in block_ids[c * bpc : (c + 1) * bpc]]
        per_group.append(valid)
        offer.extend(map(gs.keys.__getitem__, valid))
    return storable, per_group, offer


def accepted_store(
    groups: Sequence[GroupState],
    per_group: Sequence[Sequence[int]],
    offer: Sequence[OffloadKey],
    kept: tuple[OffloadKey, ...],
    bpc: int,
    sliding: Sequence[bool],
) -> tuple[
    tuple[OffloadKey, ...], tuple[int, ...], list[int], list[int], tuple[int, ...], tuple[int, ...]
]:
    """The store job for the offered chunks the manager ``kept`` (in the offered order): its
    keys, its source blocks (group after group), per group the number of blocks and the first
    block's index, and its sources in sliding-window groups (fenced from creation) and in
    full-attention groups (fenced once the request finishes).

    When what the manager kept is the offer's tail and no key before the tail is one of them
    (the present keys all come first: a prompt whose shared prefix is stored already, or an
    offer kept whole), the accepted chunks are the offer's tail, group by group, and the job's
    keys are ``kept`` itself: no pass over every offered chunk."""
    n_groups = len(groups)
    cut = len(offer) - len(kept)
    accepted: set[OffloadKey] | None = None
    if cut < 0 or tuple(offer[cut:]) != kept:
        accepted = set(kept)
    elif cut:
        accepted = set(kept)
        if accepted.isdisjoint(offer[:cut]):
            accepted = None
    pos = 0  # the offer's index of the group's first offered chunk
    src: list[int] = []
    sizes = [0] * n_groups
    starts = [0] * n_groups
    fenced: list[int] = []
    deferred: list[int] = []
    keys: list[OffloadKey] = []
    for g, offered in enumerate(per_group):
        gs = groups[g]
        chunks: Sequence[int]
        if accepted is None:
            skip = cut - pos
            pos += len(offered)
            chunks = offered[skip:] if skip > 0 else offered
        else:
            chunks = list(
                compress(offered, map(accepted.__contains__, map(gs.keys.__getitem__, offered)))
            )
        if not chunks:
            continue
        block_ids = gs.block_ids
        if isinstance(chunks, range):  # (step 1: consecutive chunks, their blocks a slice)
            blocks = block_ids[chunks.start * bpc : chunks.stop * bpc]
        elif bpc == 1:
            blocks = list(map(block_ids.__getitem__, chunks))
        else:
            blocks = [b for c in chunks for b in block_ids[c * bpc : (c + 1) * bpc]]
        starts[g] = chunks[0] * bpc
        sizes[g] = len(blocks)
        src.extend(blocks)
        (fenced if sliding[g] else deferred).extend(blocks)
        if accepted is not None:
            keys.extend(map(gs.keys.__getitem__, chunks))
    # one tuple for the source blocks, shared by the job, its fences and its transfer (each
    # object of a step's jobs lives until the workers took the metadata: fewer of them,
    # fewer garbage collections triggered inside the hooks)
    blocks_t = tuple(src)
    return (
        kept if accepted is None else tuple(keys),
        blocks_t,
        sizes,
        starts,
        blocks_t if len(fenced) == len(blocks_t) else tuple(fenced),
        blocks_t if len(deferred) == len(blocks_t) else tuple(deferred),
    )


def store_floor(groups: Sequence[GroupState], tpc: Sequence[int], chunk_level: bool) -> int:
    """The fewest offloadable tokens at which a chunk can become storable: below it a
    scheduling skips the store path (the usual decode step)."""
    if len(groups) == 1:  # (no generator for the usual single group)
        gs = groups[0]
        return ((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * tpc[0]
    return min(
        ((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * tpc[g]
        for g, gs in enumerate(groups)
    )
