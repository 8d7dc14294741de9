"""Counterexample found by `statecore check --scope one --mutant complete_store_always_success`.

Violation: INV-DATA: load ended: request r1 group 0 block #0 (GPU block 3, rank 0) holds GARBAGE, expected 9b39f6/g0
"""

from statecore.check import replay
from statecore.check.cli import mutant_applied
from statecore.check.model import Scope

SCOPE = Scope(name='one', prompts=((1, 2, 3, 4), (1, 2, 5, 6)), workers=1, sliding_window=None, gpu_blocks=3, cpu_slots=2, depth=9, tokens_per_block=2, max_output=2, max_batched_tokens=64, max_faults=1, max_resets=1, foreign=(), free_order='lifo', redis=False, redis_known_keys=None, manager_errors=False, prefix_caching_hint=True, description='two requests sharing a chunk, one worker, full attention')

TRACE = [
    ('arrive', 0),
    ('step',),
    ('step',),
    ('arrive', 1),
    ('fail', 0, 0),
    ('step',),
    ('ok', 0, 1),
]


def test_counterexample_replays() -> None:
    with mutant_applied('complete_store_always_success'):
        _, violation, n = replay(SCOPE, TRACE)
        assert violation is not None and n == len(TRACE), violation
