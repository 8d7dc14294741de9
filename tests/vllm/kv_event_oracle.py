"""The KV-event payload oracle: every self-describing ``BlockStored`` event describes the chunk
it announces, and every removal names the whole chunk it removes.

It reads a connector's KV-event stream as :class:`statecore.bench.scheduler.RunResult` keeps
it (``(step, "stored", hashes, parent, token_ids, block_size, medium, group)`` and
``(step, "removed", hashes, medium, group)`` tuples, in order) and checks, with vLLM's own
block hashing (``hash_block_tokens`` over the ``prefix_caching_hash_algo``, published through
``maybe_convert_block_hash``):

* a stored event of a full-attention group that carries a payload lists one block hash per
  ``block_size`` token ids, ``block_size`` is the group's, and its token ids re-hash to those
  hashes, block by block, starting from its parent (the first block of a sequence when the
  parent is None); the parent is a block hash of a chunk the stream describes (parents are
  resolved over the whole stream: vLLM orders a step's events by a set of keys);
* no full-attention group's stored event carries the placeholder payload (the key's hash, no
  tokens, block size 0): the adapter describes every chunk of those groups;
* a removal names hashes announced on its medium, and when it names a chunk's key (the last
  hash of an announced chunk) it names every hash that chunk was announced with.

Lora adapters and multimodal extra keys are not modelled (the engine runs have neither). The
functions read vLLM's hashing, so this module imports vLLM: import it after the caller's own
``pytest.importorskip`` of vLLM.

:data:`PAYLOAD_SCENARIOS` are the engine runs made for the oracle (beside the KV-event runs of
``test_vllm_integration.py``, which call it too): a reset while requests run (their chunks
are stored again) and frequent preemption, both with chunks of two blocks (a payload of
several block hashes), and a CPU tier over a file tier (cascades of evicted chunks;
promotions: chunks a lookup finds that no request of the engine stored since).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.config import CacheConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kvu

from statecore.bench.scheduler import Scenario, run_vllm

Hasher = Callable[[bytes | None, Sequence[int]], bytes]
"""A block hash from its parent's (None: the first block) and its token ids."""


def vllm_block_hasher(algo: str | None = None) -> Hasher:
    """vLLM's block hashing with ``algo`` (default: vLLM's default
    ``prefix_caching_hash_algo``), as its engine hashes a request's blocks (no extra keys)."""
    hash_fn = get_hash_fn_by_name(algo or CacheConfig().prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)  # what the engine does at start-up

    def hasher(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return bytes(kvu.hash_block_tokens(hash_fn, parent, tokens))

    return hasher


def _ext(h: bytes) -> Any:
    return kvu.maybe_convert_block_hash(kvu.BlockHash(h))


def payload_findings(
    events: Iterable[tuple[Any, ...]],
    *,
    block_size: int,
    full_groups: frozenset[int] = frozenset({0}),
    hasher: Hasher | None = None,
) -> list[str]:
    """What is wrong with the payloads of an event stream (empty: nothing).

    Args:
        events: the stream, as ``RunResult.events`` holds it.
        block_size: tokens per block of the full-attention groups (the payload's block size).
        full_groups: the full-attention groups (others carry placeholders by design).
        hasher: the block hashing (default: :func:`vllm_block_hasher`).
    """
    hash_block = hasher or vllm_block_hasher()
    findings: list[str] = []
    stored: list[tuple[int, tuple[Any, ...], Any, tuple[int, ...], str, int]] = []
    # the removals check needs the announcements in order; the re-hash check needs parents
    # first, which a step's set order does not give: it runs after, to a fixed point
    announced: dict[tuple[str, int], dict[Any, tuple[Any, ...]]] = {}
    for ev in events:
        step, kind = ev[0], ev[1]
        if kind == "stored":
            _, _, hashes, parent, tokens, bs, medium, group = ev
            announced.setdefault((medium, group), {})[hashes[-1]] = tuple(hashes)
            if group not in full_groups:
                continue
            if bs == 0 and not tokens:
                findings.append(
                    f"step {step}: {medium} chunk {hashes[-1]} of full-attention group "
                    f"{group} announced with the placeholder payload"
                )
                continue
            if bs != block_size:
                findings.append(
                    f"step {step}: chunk {hashes[-1]} has block size {bs}, not {block_size}"
                )
                continue
            if len(tokens) != len(hashes) * bs:
                findings.append(
                    f"step {step}: chunk {hashes[-1]} lists {len(hashes)} block hashes for "
                    f"{len(tokens)} token ids of blocks of {bs}"
                )
                continue
            stored.append((step, tuple(hashes), parent, tuple(tokens), medium, bs))
            continue
        _, _, hashes, medium, group = ev
        chunks = announced.get((medium, group), {})
        named = set(hashes)
        known = {h for chunk in chunks.values() for h in chunk}
        for h in hashes:
            if h not in known:
                findings.append(f"step {step}: {medium} removal of {h}, never announced")
            elif h in chunks and not set(chunks[h]) <= named:
                missing = [x for x in chunks[h] if x not in named]
                findings.append(
                    f"step {step}: {medium} removal of chunk {h} leaves its announced block "
                    f"hashes {missing} behind"
                )
        for h in hashes:
            chunks.pop(h, None)
    findings += _rehash_findings(stored, hash_block)
    return findings


def _rehash_findings(
    stored: list[tuple[int, tuple[Any, ...], Any, tuple[int, ...], str, int]], hash_block: Hasher
) -> list[str]:
    """Re-hash every described chunk from its parent; parents resolve to a fixed point."""
    findings: list[str] = []
    full: dict[Any, bytes] = {}  # a published block hash -> the hash it publishes
    todo = stored
    while todo:
        waiting = []
        for entry in todo:
            step, hashes, parent, tokens, medium, bs = entry
            if parent is not None and parent not in full:
                waiting.append(entry)
                continue
            prev = None if parent is None else full[parent]
            computed = []
            for i in range(len(hashes)):
                prev = hash_block(prev, tokens[i * bs : (i + 1) * bs])
                computed.append(prev)
            published = [_ext(h) for h in computed]
            if published != list(hashes):
                findings.append(
                    f"step {step}: {medium} chunk {hashes[-1]}: its token ids hash to "
                    f"{published} after parent {parent}, not to the listed {list(hashes)}"
                )
                continue
            full.update(zip(hashes, computed, strict=True))
        if len(waiting) == len(todo):
            findings += [
                f"step {step}: {medium} chunk {hashes[-1]}: parent {parent} was never "
                "announced with a payload that hashes"
                for step, hashes, parent, _, medium, _ in waiting
            ]
            break
        todo = waiting
    return findings


BLOCK_SIZE = 16
"""Tokens per GPU block in the engine runs (``statecore.bench.scheduler``'s vLLM runs)."""

_EVENTS = Scenario(
    concurrency=16,
    steps=200,
    num_prefixes=32,
    gpu_cache_factor=0.8,
    max_prompt_len=1536,
    kv_events=True,
    extra=(("blocks_per_chunk", 2),),
)
PAYLOAD_SCENARIOS: dict[str, Scenario] = {
    # a reset at step 100: its removal events, and the running requests' chunks stored again
    "events_reset": dataclasses.replace(_EVENTS, reset_at=100),
    # a small GPU cache: preempted requests store their recomputed chunks again
    "events_preemption": dataclasses.replace(
        _EVENTS,
        concurrency=32,
        num_prefixes=16,
        prefix_len=256,
        suffix_len=(32, 256),
        output_len=(64, 192),
        max_prompt_len=512,
        gpu_cache_factor=0.35,
    ),
    # a file tier below a CPU tier of half the GPU cache (chunks of one block), and a reset:
    # the CPU tier's evictions cascade to the file tier (a CPU removal, then the file tier's
    # store, in one batch), promotions of chunks evicted, or stored before the reset
    "events_tiering": dataclasses.replace(
        _EVENTS,
        tiering=True,
        cpu_cache_factor=0.5,
        followup_prob=0.0,
        reset_at=100,
        extra=(("blocks_per_chunk", 1),),
    ),
}
"""Engine runs for the payload oracle, by name."""


def scenario_findings(name: str) -> list[str]:
    """Run statecore's connector on :data:`PAYLOAD_SCENARIOS` ``name``; the oracle's findings."""
    res = run_vllm(PAYLOAD_SCENARIOS[name], "statecore")
    if res.errors:
        return [f"{name}: requests failed: {res.errors[:3]}"]
    if not res.events:
        return [f"{name}: no KV events"]
    return payload_findings(res.events, block_size=BLOCK_SIZE)
