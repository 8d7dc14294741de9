"""Exhaustive bounded model checking of the real stack: ``statecore check``.

Random fuzzing samples interleavings; this package enumerates them. A :class:`Scope` names a
small world (requests whose prompts share prefixes, worker ranks, KV-cache groups, GPU blocks,
CPU slots, a depth bound and fault budgets); :func:`explore` applies every move of the
environment (engine, workers, clock, operator) to every reachable state breadth-first, driving
the production scheduler, CPU manager and workers (:mod:`statecore.check.model`; in the shared
scopes also the tiering manager and the Redis tier on a server double,
:mod:`statecore.check.shared`), and checks
every state: errors raised into the engine, an abstract byte model (INV-DATA), every ``INV-*``
predicate, and bounded liveness. The first violation has a shortest trace; it is printed with
the state diff of each step and can be written as a pytest file that replays it
(:mod:`statecore.check.explore`). The scopes shipped with the command are in
:mod:`statecore.check.scopes`; ``docs/check.md`` explains what the search covers and what it
does not.
"""

from statecore.check.explore import (
    Counterexample,
    Result,
    explore,
    format_counterexample,
    pytest_source,
    replay,
)
from statecore.check.model import Scope, World
from statecore.check.scopes import SCOPES

__all__ = [
    "SCOPES",
    "Counterexample",
    "Result",
    "Scope",
    "World",
    "explore",
    "format_counterexample",
    "pytest_source",
    "replay",
]
