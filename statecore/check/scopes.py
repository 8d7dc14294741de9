"""The scopes ``statecore check`` ships, smallest first.

Prompts are token ids with ``tokens_per_block = 2`` and one block per chunk, so ``(1, 2, 3, 4)``
is two chunks and ``(1, 2, 5, 6)`` shares its first chunk. Each scope is the smallest world in
which some class of bug can happen (see ``docs/check.md`` for the table of figures).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from statecore.check.model import Scope

__all__ = ["SCOPES"]

_A = (1, 2, 3, 4)
_B = (1, 2, 5, 6)
_C = (7, 8, 9, 10)
_D = (7, 8)

_USUAL = Scope("", prompts=(), gpu_blocks=3, depth=9)
"""The world most scopes share: three GPU blocks, two CPU slots, one worker, depth 9."""


def _scope(name: str, *, description: str, **fields: Any) -> Scope:
    """The usual world, named, described and changed where ``fields`` say."""
    return replace(_USUAL, name=name, description=description, **fields)


SCOPES: dict[str, Scope] = {
    s.name: s
    for s in (
        _scope(
            "one",
            prompts=(_A, _B),
            description="two requests sharing a chunk, one worker, full attention",
        ),
        _scope(
            "pair",
            prompts=(_A, _B),
            gpu_blocks=4,
            depth=8,
            description="two requests sharing a chunk that fit on the GPU together (both "
            "compute the shared chunk; the CPU tier cannot take both)",
        ),
        _scope(
            "apart",
            prompts=(_A, _C),
            description="two requests sharing nothing (no deferral orders them), one worker",
        ),
        _scope(
            "foreign",
            prompts=(_A, _C),
            foreign=(1,),
            description="a tracked request and one of another connector, one worker",
        ),
        _scope(
            "chunked",
            prompts=(_A, _B),
            depth=10,
            max_batched_tokens=2,
            description="chunked prefill (one block per step): chunks stored one by one",
        ),
        _scope(
            "two",
            prompts=(_A, _B),
            workers=2,
            description="the same on two workers (quorum, per-rank bytes)",
        ),
        _scope(
            "swa",
            prompts=(_A, _B),
            sliding_window=2,
            gpu_blocks=6,
            cpu_slots=4,
            description="full attention + a sliding-window group, one worker",
        ),
        _scope(
            "window",
            prompts=(_A, _D),
            sliding_window=1,
            gpu_blocks=7,
            cpu_slots=6,
            max_output=3,
            free_order="fifo",
            description="a sliding window of half a block and three outputs (a block leaves "
            "the window while its request runs on) with vLLM's FIFO free-block queue",
        ),
        _scope(
            "shared",
            prompts=(_A,),
            redis=True,
            description="one request over a shared Redis tier: the real tiering manager and "
            "RedisTier on a server double that goes down, corrupts or evicts a value, and takes "
            "chunks from engines of the same and of another layout",
        ),
        _scope(
            "shared2",
            prompts=(_A, _B),
            depth=8,
            redis=True,
            description="two requests sharing a chunk over the shared Redis tier",
        ),
        _scope(
            "shared_known",
            prompts=(_A, _B),
            depth=6,
            redis=True,
            redis_known_keys=1,
            description="two requests over the shared Redis tier keeping one lookup answer "
            "(max_known_keys=1): their pending lookups compete for the answers",
        ),
        _scope(
            "manager",
            prompts=(_A, _B),
            manager_errors=True,
            depth=9,
            description="two requests sharing a chunk, one worker; the manager may raise "
            "(typed or untyped) from a completion or a finish it applied, or from a store "
            "offer, a load, a lookup, a schedule end, an operator's reset, a new request it "
            "refused, the taking of its events or stats, or the question whether it has "
            "pending work",
        ),
        _scope(
            "swa2",
            prompts=(_A, _B),
            workers=2,
            sliding_window=2,
            gpu_blocks=6,
            cpu_slots=4,
            depth=10,
            description="full attention + sliding window on two workers",
        ),
    )
}
"""Every shipped scope by name."""
