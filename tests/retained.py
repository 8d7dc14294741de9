"""The retained-state walk shared by the oracles (tests/test_retained_state.py and the vLLM
run in tests/vllm): every sized container that statecore objects reach.

Not a test module: the oracles import it (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from statecore.bench.scheduler import Scenario
from statecore.managers.keyorder import KeyOrder, KeyTable, PyKeyOrder

RETAINED_SCENARIO = Scenario(
    concurrency=16,
    steps=10**9,
    num_prefixes=8,
    prefix_len=32,
    suffix_len=(8, 48),
    output_len=(2, 6),
    followup_turn_len=16,
    max_prompt_len=256,
    cpu_cache_factor=0.5,
)
"""The oracles' workload: short requests, many finishing per step, a CPU tier of half the GPU
cache (evictions early); run until the oracle stops it."""

SIZED = (dict, list, set, frozenset, tuple, OrderedDict, deque, KeyOrder, PyKeyOrder, KeyTable)
"""The container types measured (subclasses too: ``Counter``, ``defaultdict``; the LRU list)."""


def _ours(value: Any) -> bool:
    return type(value).__module__.startswith("statecore") and not callable(value)


def containers(obj: Any, path: str) -> dict[str, int]:
    """Every sized container reachable from ``obj`` through statecore objects' attributes
    (``__dict__`` and ``__slots__``) and through the containers' elements (a dict's values),
    by attribute path (``[]`` for an element: the largest of them is kept)."""
    out: dict[str, int] = {}
    _walk(obj, path, set(), out)
    return out


def _walk(obj: Any, path: str, seen: set[int], out: dict[str, int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    attrs: dict[str, Any] = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    for name, value in attrs.items():
        _reach(value, f"{path}.{name}", seen, out)


def _reach(value: Any, where: str, seen: set[int], out: dict[str, int]) -> None:
    if isinstance(value, SIZED):
        out[where] = max(out.get(where, 0), len(value))
        for item in value.values() if isinstance(value, dict | KeyTable) else value:
            if isinstance(item, SIZED) or _ours(item):
                _reach(item, where + "[]", seen, out)
    elif _ours(value):
        _walk(value, where, seen, out)
