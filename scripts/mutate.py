"""Sampled mutation testing of statecore's core modules: Cosmic Ray's mutants, a forking runner.

    python scripts/mutate.py --sample 300 --seed 1           # 300 mutants over the core
    python scripts/mutate.py --per-module 10 --seed 1        # 10 mutants of every core module
    python scripts/mutate.py --sample 30 --seed 1 --module statecore/managers/cpu.py
    python scripts/mutate.py --report SESSION.sqlite         # print a finished session again

Needs the ``mutate`` extra (``pip install -e '.[mutate]'``: Cosmic Ray). Not part of
``scripts/test.sh``: the first run on a version of the sources spends about two minutes
measuring which killer runs which function (then cached), and each survivor costs the killers
that reach it.

Theory of operation. Cosmic Ray (``cosmic-ray init``) lists every mutation its core
operators can make in the core modules (:data:`CORE_MODULES`): comparisons flipped, ``and``
and ``or`` swapped, ``not`` added or removed, numbers changed by one, ``True``/``False``
swapped, ``break``/``continue`` swapped, loops run zero times, arithmetic operators replaced,
decorators removed, exception types replaced. One source position with one operator family
is a *site*; a site often has many variants (``+`` becomes ``-``, ``*``, ``//``...), so the
sample draws **sites** uniformly at random (``random.Random(seed)``, sites and variants in a
fixed order) and one variant per site, which keeps the arithmetic operators from dominating
the score. Mutants inside type annotations are left out of the draw (each core module
postpones annotations: they never run). The rest of the session is marked skipped; a drawn
mutant listed in :data:`EQUIVALENT` is marked equivalent with its reason.

The killers are the real tests, :data:`FAST_TESTS` (the fast subset: scheduler, managers,
lifecycle, the worker's core tests), then the ``statecore`` commands of :data:`CLI_KILLERS`
(the model checker on its smallest scope, short seeded fuzz campaigns with the LRU, tiering
and ARC managers). They run under the derandomized Hypothesis profile ``mutate`` (no example
database), so every run sees the same examples. Cosmic Ray still makes each mutant (its
operators rewrite the source text) and keeps the results (its session database), but this
script runs them, because starting an interpreter and collecting the tests for each mutant
cost more than the tests that kill it:

1. One pytest session collects the killers once (a profiler notes every core function run
   while importing and collecting).
2. A coverage pass, in a forked child, runs every killer once under a profiler and records
   which core functions it runs and how long it takes (cached under the system temp folder,
   named by a hash of the sources and tests).
3. Each mutant runs in a child forked from the collected session. When the mutation lies in
   the body of a function reachable by name (a module function or a method) that did not run
   before the fork, the child swaps that function's ``__code__`` for the mutated one and runs
   only the killers that run the function, fastest first, stopping at the first failure: a
   killer that never calls the function cannot tell the mutant apart. Otherwise (module level,
   class bodies, decorators, default values, code run at import) the mutant runs in a fresh
   interpreter that imports the mutated source from memory and runs the killers that touch
   the module, then, if none failed, the others in a second one. Nothing is written to the
   source tree.

A mutant is *killed* when a killer fails, *timeout* when its run passes the time limit (an
endless loop is a bug the engine would hang on: it counts as killed, and is listed apart),
*survived* when every killer that reaches it passes. ``--confirm`` runs each survivor again
in a fresh interpreter against every killer. The score of a module is (killed + timeout) /
(killed + timeout + survived); equivalent mutants are listed with their reasons, not scored.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import hashlib
import importlib.abc
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CORE_MODULES: tuple[str, ...] = (
    "statecore/scheduler/core.py",
    "statecore/scheduler/state.py",
    "statecore/scheduler/jobs.py",
    "statecore/scheduler/planning.py",
    "statecore/scheduler/effects.py",
    "statecore/scheduler/records.py",
    "statecore/scheduler/answers.py",
    "statecore/kernels.py",
    "statecore/lifecycle/machines.py",
    "statecore/lifecycle/table.py",
    "statecore/managers/cpu.py",
    "statecore/managers/tiering.py",
    "statecore/managers/policies.py",
    "statecore/worker.py",
)
"""The modules mutated: the core (the lifecycle package without its diagram writer, which only
draws)."""

FAST_TESTS: tuple[str, ...] = (
    "tests/scheduler",
    "tests/managers",
    "tests/lifecycle",
    "tests/worker/test_worker_core.py",
    "tests/worker/test_worker_strength.py",
)
"""The fast test subset the killers run (each mutant's own folder first)."""

EQUIVALENT: dict[tuple[str, ...], str] = {
    # (module, operator name prefix, stripped original line[, stripped mutated line]): reason
    # (without the mutated line, every variant of that operator on that line is equivalent)
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Gt_GtE",
        "return storable if storable > cursor else cursor",
    ): "when storable == cursor both branches return the same value",
    # ReportKind numbers: a variant that makes two members share a value turns one into an
    # alias of the other (IntEnum), which identity checks see; only these two keep them apart
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "LIVE = 0",
        "LIVE = -1",
    ): "ReportKind values stay distinct; members are compared by identity, numbers unread",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "DUPLICATE = 4",
        "DUPLICATE = 5",
    ): "ReportKind values stay distinct; members are compared by identity, numbers unread",
    # found by exhaustive site runs over scheduler, kernels and policies
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceBinaryOperator_Add_Div",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * tpc[g]",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) / 1) * tpc[g]",
    ): "a lower store floor only runs the store path on more steps, which then finds nothing new",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceBinaryOperator_Mul_RShift",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * tpc[g]",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) >> tpc[g]",
    ): "a lower store floor only runs the store path on more steps, which then finds nothing new",
    (
        "statecore/scheduler/planning.py",
        "core/NumberReplacer",
        "if bpc == 1:",
        "if bpc == 0:",
    ): "the general path (slices of blocks_per_chunk blocks) gives the same chunks and blocks",
    (
        "statecore/scheduler/effects.py",
        "core/NumberReplacer",
        "gs.skip = 0",
        "gs.skip = -1",
    ): "skip is only read through max(cursor, skip) with cursor >= 0: -1 behaves as 0",
    (
        "statecore/scheduler/jobs.py",
        "core/NumberReplacer",
        "self.stale_threshold = 0",
        "self.stale_threshold = -1",
    ): "a negative job id is classified unknown before the threshold is read: -1 acts as 0",
    (
        "statecore/scheduler/state.py",
        "core/NumberReplacer",
        "key=lambda g: -(self._window[g] or 0),",
    ): "only sliding groups are sorted and their window is never None: the fallback never runs",
    (
        "statecore/scheduler/core.py",
        "core/NumberReplacer",
        "allocated.discard(0)  # the null block is never handed to an owner",
    ): "block 0 is never in the fence index nor in the window index: keeping it changes nothing",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_Eq_Lt",
        "if hits == 0:",
    ): "an early out: with hits == 0 the cap drops to the computed tokens and the next pass"
    " returns 0 from its empty range",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "if hits == 0:",
    ): "hits is never negative: <= 0 is == 0",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "if bpc == 1:",
    ): "blocks_per_chunk >= 1 (config): <= 1 is == 1",
    (
        "statecore/scheduler/jobs.py",
        "core/ReplaceAndWithOr",
        "if not job.deferred_registered and job.deferred_fence:",
    ): "fence_add of no blocks does nothing, and adding a job to a block's set twice is a no-op",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.skip = 0",
        "self.skip = -1",
    ): "skip is only read through max(cursor, skip) with cursor >= 0: -1 behaves as 0",
    (
        "statecore/scheduler/planning.py",
        "core/NumberReplacer",
        "if hits == 0:",
        "if hits == -1:",
    ): "hits is never -1; a 0 let through lowers max_hit to tpc * start <= num_computed, so the "
    "next group (or the next pass) returns 0 before any lookup",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.store_floor = 0",
        "self.store_floor = 1",
    ): "a floor of 1 only skips steps with no offloadable token, where nothing is storable",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.store_cap = 1 << 62",
        "self.store_cap = 1 << 61",
    ): "any cap above every possible token count",
    (
        "statecore/scheduler/core.py",
        "core/ReplaceTrueWithFalse",
        "for gs, adm, ids in zip(rec.groups, admitted, new_ids, strict=True):",
    ): "one allocated list and one scheduled list per group, both validated to the group count",
    (
        "statecore/scheduler/core.py",
        "core/ReplaceTrueWithFalse",
        "for gs, n in zip(rec.groups, storable, strict=True):",
    ): "storable holds one count per group, built by the loop over the same groups",
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "if r == MISS:",
    ): "MISS is 0, the least lookup result (pre: 0 <= r): r <= MISS exactly when r == MISS",
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "if r == MISS:",
    ): (
        "r comes from int() of a LookupResult: a small int, cached by CPython, so `is` agrees with "
        "`==`"
    ),
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "if r == RETRY:",
    ): (
        "r comes from int() of a LookupResult: a small int, cached by CPython, so `is` agrees with "
        "`==`"
    ),
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "elif r == HIT_PENDING and first_pending is None:",
    ): (
        "r comes from int() of a LookupResult: a small int, cached by CPython, so `is` agrees with "
        "`==`"
    ),
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "blocked = blocked or r == HIT_PENDING",
    ): (
        "r comes from int() of a LookupResult: a small int, cached by CPython, so `is` agrees with "
        "`==`"
    ),
    (
        "statecore/kernels.py",
        "core/ReplaceBinaryOperator_BitOr_BitXor",
        "return live | stalled, next_job_id",
    ): "live and stalled job ids are disjoint (a stalled job has left the live map): | and ^ agree",
    (
        "statecore/managers/policies.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "return ref + 1, evictable - 1 if ref == 0 else evictable",
    ): "pre: ref >= 0, so ref <= 0 exactly when ref == 0",
    (
        "statecore/managers/policies.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "return ref - 1, evictable + 1 if ref == 1 else evictable",
    ): "pre: ref >= 1, so ref <= 1 exactly when ref == 1",
    (
        "statecore/managers/policies.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "if src == 1:",
    ): "a victim's list is 1 or 2: src <= 1 exactly when src == 1",
    (
        "statecore/managers/policies.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "if src == 1:",
    ): "src is the literal 1 or 2 (small ints, cached by CPython): `is` agrees with `==`",
    (
        "statecore/managers/policies.py",
        "core/ReplaceComparisonOperator_Eq_GtE",
        "if len(out) == n:",
    ): "out grows by one from below n (n >= 1 here): it first reaches n exactly",
    (
        "statecore/managers/policies.py",
        "core/NumberReplacer",
        "return usage, write, max(usage - write, 0.0)",
        "return usage, write, max(usage - write, -1.0)",
    ): "write_pending <= busy (pre), so usage - write >= 0 and the floor never applies",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.num_scheduled = 0",
    ): "set by every scheduling before the store path reads it; finished requests never read it",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.n_hashes = 0  # block hashes already turned into keys",
        "self.n_hashes = -1  # block hashes already turned into keys",
    ): (
        "-1 only skips the 'no new hashes' shortcut once, for a request without hashes (no keys "
        "either way)"
    ),
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.num_local_computed = 0",
        "self.num_local_computed = -1",
    ): (
        "-1 and 0 both pass the block-count check of an allocation before any lookup"
        " (ceil(-1 / tpb) == 0); a lookup sets it"
    ),
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.store_floor = 0",
        "self.store_floor = -1",
    ): "the store floor is a lower bound that only enables the decode shortcut; -1 behaves as 0",
    (
        "statecore/scheduler/core.py",
        "core/NumberReplacer",
        "rec.store_floor = 0",
        "rec.store_floor = -1",
    ): "the store floor is a lower bound that only enables the decode shortcut; -1 behaves as 0",
    (
        "statecore/scheduler/state.py",
        "core/NumberReplacer",
        "req.store_floor = 0",
        "req.store_floor = -1",
    ): "the store floor is a lower bound that only enables the decode shortcut; -1 behaves as 0",
    (
        "statecore/scheduler/effects.py",
        "core/NumberReplacer",
        "req.store_floor = 0",
        "req.store_floor = -1",
    ): "the store floor is a lower bound that only enables the decode shortcut; -1 behaves as 0",
    (
        "statecore/scheduler/planning.py",
        "core/NumberReplacer",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * tpc[g]",
        "((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 0) * tpc[g]",
    ): "a lower store floor only runs the store path on more steps, which then finds nothing new",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.store_cap = 1 << 62",
        "self.store_cap = 1 << 63",
    ): "any cap above every possible token count",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.store_cap = 1 << 62",
        "self.store_cap = 2 << 62",
    ): "any cap above every possible token count",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.hashes_ok = 0  # block hashes already validated (a prefix of the view's list)",
    ): "its only constructor call (_track) overwrites it with len(block_hashes) at once",
    (
        "statecore/scheduler/records.py",
        "core/NumberReplacer",
        "self.stalled_at = 0.0",
    ): "stall_job writes it before the ledger (its only reader) holds the job",
    (
        "statecore/scheduler/answers.py",
        "core/ReplaceTrueWithFalse",
        "@dataclass(frozen=True, slots=True)",
        "@dataclass(frozen=True, slots=False)",
    ): "frozen already refuses every attribute assignment; slots only save memory",
    (
        "statecore/scheduler/effects.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "elif job.pending == 0:",
    ): "pending never goes below 0 (apply_report's post-condition)",
    (
        "statecore/scheduler/core.py",
        "core/ReplaceAndWithOr",
        "if fence and batch.allocated:",
    ): "with either side empty, the intersection loop below finds nothing",
    (
        "statecore/scheduler/core.py",
        "core/ReplaceComparisonOperator_LtE",
        "if len(batch.allocated) <= len(fence)",
    ): "only picks which side of the intersection is iterated; both give the same blocks",
    (
        "statecore/scheduler/planning.py",
        "core/NumberReplacer",
        "if cut < 0 or tuple(offer[cut:]) != kept:",
    ): (
        "a shortcut's bound: with cut 0 the filter by key runs and gives the same chunks; a cut"
        " of -1 never matches a kept tuple one longer than the offer, so the filter runs too"
    ),
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_Lt_LtE",
        "if cut < 0 or tuple(offer[cut:]) != kept:",
    ): "with cut 0 the filter by key runs instead of the shortcut and gives the same chunks",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_Gt_GtE",
        "chunks = offered[skip:] if skip > 0 else offered",
    ): "offered[0:] is offered",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_LtE_Lt",
        "if end <= start:  # (start + 1) * tpc > num_computed: nothing loadable",
    ): "an early out: with end == start the lookup range is empty and an empty scan answers 0 too",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_LtE_Eq",
        "if end <= start:  # (start + 1) * tpc > num_computed: nothing loadable",
    ): "an early out: with end < start the lookup range is empty and an empty scan answers 0 too",
    (
        "statecore/scheduler/planning.py",
        "core/ReplaceComparisonOperator_LtE_Is",
        "if end <= start:  # (start + 1) * tpc > num_computed: nothing loadable",
    ): (
        "an early out: whenever `is` differs from `<=` the lookup range is empty and an empty scan "
        "answers 0 too"
    ),
    (
        "statecore/managers/cpu.py",
        "core/ReplaceTrueWithFalse",
        "entries.update(zip(to_store, slots, strict=True))  # write-pending: the slot itself",
    ): "slots always holds len(to_store) ids: both allocation paths return exactly n",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_NotEq_IsNot",
        "if self._evictable != len(self._entries):",
    ): "equal counts mean every entry has ref 0: the loop it lets run quarantines nothing",
    (
        "statecore/lifecycle/table.py",
        "core/ReplaceComparisonOperator_Eq_Lt",
        "if len(guards) == 1 and guards[0][1]:",
    ): "guards is non-empty here: `<= 1` is `== 1`, `< 1` only skips the one-guard shortcut "
    "(the wrapper returns the same truth, and callers test truth only)",
    (
        "statecore/worker.py",
        "core/ReplaceTrueWithFalse",
        "len(c) // (p * blocks_per_chunk) for c, p in zip(self.cpu, page_bytes, strict=True)",
    ): "the constructor refuses len(cpu) != len(page_bytes) a few lines above",
    (
        "statecore/lifecycle/table.py",
        "core/NumberReplacer",
        "if len(guards) == 1 and guards[0][1]:",
        "if len(guards) == 1 and guards[ -1][1]:",
    ): "with one guard, guards[-1] is guards[0]",
    (
        "statecore/lifecycle/table.py",
        "core/NumberReplacer",
        "return guards[0][0]",
        "return guards[ -1][0]",
    ): "reached with exactly one guard only: guards[-1] is guards[0]",
    (
        "statecore/lifecycle/table.py",
        "core/NumberReplacer",
        "if len(guards) == 1 and guards[0][1]:",
        "if len(guards) == 0 and guards[0][1]:",
    ): "guards is non-empty here: the one-guard shortcut is skipped, and the wrapper returns "
    "the same truth (callers test truth only)",
    (
        "statecore/lifecycle/table.py",
        "core/ReplaceComparisonOperator_Is_Eq",
        "return all(bool(f(rec)) is e for f, e in guards)",
    ): "both sides are bools: `==` and `is` agree",
    (
        "statecore/managers/cpu.py",
        "core/NumberReplacer",
        "if to_store and (set(map(type, to_store)) != _BYTES_ONLY or min(map(len, to_store)) < 4):",
        "if to_store and (set(map(type, to_store)) != _BYTES_ONLY or min(map(len, to_store)) < 5):",
    ): "4-byte keys only take the slow path, whose full check accepts them",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceBinaryOperator_Sub_Mul",
        "bad = bool(set(map(type, keys)) - _BYTES_ONLY) or (",
    ): "set * set raises TypeError, caught as `bad`: the full check runs and accepts good keys",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_Lt_LtE",
        "bool(keys) and min(map(len, keys)) < 4",
    ): "4-byte keys only take the slow path, whose full check accepts them",
    (
        "statecore/managers/cpu.py",
        "core/NumberReplacer",
        "last_release = 0",
    ): "the first quarantined release passed `release > schedule_ends >= 0`, so it is >= 1: "
    "comparing it with 0, 1 or -1 never fires",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_Eq_LtE",
        "if ref == 0:",
        "if ref <= 0:",
    ): "ref is never negative at either site (a pinnable key is ready; an unpin of a pinned key "
    "leaves >= 0): `<= 0` is `== 0`",
    (
        "statecore/managers/cpu.py",
        "core/NumberReplacer",
        "if tracker.get(key, 0) >= threshold:",
    ): "the tracker exists only for thresholds >= 2: an unseen key's default 0, 1 or -1 is below",
    (
        "statecore/managers/tiering.py",
        "core/ReplaceTrueWithFalse",
        "@dataclass(slots=True)",
    ): "private bookkeeping classes (_TierJob, _PendingPromotion, _RequestState) that never leave "
    "the module and are only assigned their declared fields: slots change memory, not behaviour",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_IsNot_NotEq",
        "if type(flag) is not bool:",
    ): "types compare by identity: `!=` and `is not` agree",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceTrueWithFalse",
        "entries.update(zip(changed, [e + _ONE for e in got], strict=True))  # ref -1 -> 0",
    ): "changed is list(keys) and got is one entry per key: equal lengths by construction",
    (
        "statecore/managers/tiering.py",
        "core/ReplaceComparisonOperator_Gt_NotEq",
        "if state is not None and state.pending_primary_stores > 0:",
    ): "the pending primary-store count is only decremented when > 0 (or reset to 0): never "
    "negative, so `!= 0` is `> 0`",
    (
        "statecore/worker.py",
        "core/ReplaceTrueWithFalse",
        "for g, (n, idx) in enumerate(zip(group_sizes, block_indices, strict=True)):",
    ): "the lengths were compared two lines above (SpecError): zip never sees unequal lists",
    (
        "statecore/worker.py",
        "core/NumberReplacer",
        "last = max((i for i, (j, _) in enumerate(q) if j in wanted), default=-1)",
        "last = max((i for i, (j, _) in enumerate(q) if j in wanted), default=- 2)",
    ): "range(last + 1) is empty for a default of -1 or -2: no job runs either way",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_GtE_Eq",
        "if count == 0 and len(tracker) >= self.max_tracker_size:",
        "if count == 0 and len(tracker) == self.max_tracker_size:",
    ): "the reuse tracker never exceeds its configured bound (the oldest key goes before each new "
    "one at the bound), so `>=` is `==`",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceComparisonOperator_Lt_NotEq",
        "while len(slots) < n:",
        "while len(slots) != n:",
    ): "the loop is entered with len(slots) < n and adds at most one slot a pass: it stops at n "
    "either way",
    (
        "statecore/managers/cpu.py",
        "core/ReplaceBinaryOperator_Sub_Add",
        "bad = bool(set(map(type, keys)) - _BYTES_ONLY) or (",
    ): "set + set raises TypeError, caught as `bad`: the full check runs and accepts good keys",
    (
        "statecore/managers/tiering.py",
        "core/NumberReplacer",
        "self._next_job_id = 0",
    ): "tier job ids are opaque tokens a tier echoes back: only their uniqueness matters",
    (
        "statecore/managers/tiering.py",
        "core/NumberReplacer",
        "self._next_job_id += 1",
        "self._next_job_id += 2",
    ): "tier job ids are opaque tokens a tier echoes back: stepping by 2 keeps them unique",
    (
        "statecore/managers/tiering.py",
        "core/ReplaceComparisonOperator_Gt_NotEq",
        "or self._num_pending_promotions > 0",
    ): "the pending-promotion count only grows by one or is reset to 0: never negative",
    (
        "statecore/lifecycle/machines.py",
        "core/NumberReplacer",
        "name for name, value in vars(LifecycleEffects).items()"
        ' if callable(value) and name[0] != "_"',
    ): "the protocol's callables are public hooks (no `_` at 0, 1 or -1) or dunders (`_` at all "
    "three): every variant picks the same names",
    (
        "statecore/lifecycle/machines.py",
        "core/ReplaceTrueWithFalse",
        'in_flight = State("in flight", initial=True)',
    ): "python-statemachine makes the first declared state initial when none is marked, and "
    "in_flight is declared first: the same machine and table",
    (
        "statecore/lifecycle/table.py",
        "core/ReplaceTrueWithFalse",
        "for lc, was in zip(targets, before, strict=True):",
    ): "before is built from targets at the top of the function: equal lengths, strict never fires",
}
"""Mutants judged equivalent, with a one-line reason each (skipped and reported apart)."""


def _operator_family(name: str) -> str:
    """``core/ReplaceBinaryOperator_Add_Sub`` -> ``core/ReplaceBinaryOperator``."""
    return name.split("_", 1)[0]


def _equivalent_reason(
    module: str, operator: str, line: str, mutated_line: Callable[[], str] | None = None
) -> str | None:
    """The reason a mutant is listed equivalent, or None. An entry of four strings matches only
    the variant whose mutated line reads as its fourth (``mutated_line`` makes it, lazily)."""
    for key, reason in EQUIVALENT.items():
        mod, op, text, *after = key
        if mod != module or not operator.startswith(op) or line.strip() != text:
            continue
        if not after or (mutated_line is not None and mutated_line() == after[0]):
            return reason
    return None


def _mutated_line(module: str, operator: str, occurrence: int, lineno: int) -> str:
    mutated = _mutant_source(module, operator, occurrence)
    return "" if mutated is None else mutated.splitlines()[lineno - 1].strip()


# -- the runner: one pytest session, one forked child per mutant --------------------------------

HYPOTHESIS_PROFILE = "mutate"
"""Hypothesis profile of every killer run: derandomized (the same examples for every mutant and
for the coverage run), no example database (a mutant's failing example must not be replayed
against the next one), the ``dev`` profile's example count."""

CLI_KILLERS: tuple[tuple[str, ...], ...] = (
    ("check", "--scope", "one", "--time-limit", "5", "--no-liveness"),
    ("fuzz", "--seconds", "2", "--seed", "1"),
    ("fuzz", "--seconds", "2", "--seed", "1", "--manager", "tiering"),
    ("fuzz", "--seconds", "2", "--seed", "1", "--manager", "arc"),
)
"""The ``statecore`` commands run after the tests, as pseudo-tests named ``statecore ...``."""

CACHE = Path(tempfile.gettempdir()) / "statecore-mutate-cache"
"""Where the coverage map is kept, named by a hash of the sources and tests it was made from."""


def _prepare_environment() -> None:
    """The environment every killer runs in (the parent's, inherited by each child)."""
    os.environ.pop("CI", None)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["STATECORE_HYPOTHESIS_PROFILE"] = HYPOTHESIS_PROFILE
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.dont_write_bytecode = True
    from hypothesis import settings

    settings.register_profile(
        HYPOTHESIS_PROFILE, max_examples=30, deadline=None, derandomize=True, database=None
    )


def _module_name(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _core_paths() -> dict[str, str]:
    return {str(ROOT / m): m for m in CORE_MODULES}


class _Tracer:
    """Records which core functions run (``module:qualname`` of the outermost named function;
    nested functions, lambdas and comprehensions count as their enclosing function)."""

    def __init__(self) -> None:
        self.paths = _core_paths()
        self.hits: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code
            module = self.paths.get(code.co_filename)
            if module is not None:
                self.hits.add(module + ":" + code.co_qualname.split(".<locals>", 1)[0])

    def start(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


FuncSpans = dict[str, tuple[tuple[int, int], tuple[int, int]]]


def _functions(module: str) -> FuncSpans:
    """Every function reachable by attribute from the module (top level, or methods of
    top-level classes, nested classes included): qualname -> span of its body. A name defined
    twice (a property's setter, a conditional definition) is left out: it is ambiguous."""
    tree = ast.parse((ROOT / module).read_text())
    found: FuncSpans = {}
    twice: set[str] = set()

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + node.name
                if name in found:
                    twice.add(name)
                first = node.body[0]
                end = (node.end_lineno or first.lineno, node.end_col_offset or 0)
                found[name] = ((first.lineno, first.col_offset), end)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")

    walk(tree.body, "")
    return {k: v for k, v in found.items() if k not in twice}


def _enclosing(module: str, pos: tuple[int, int], cache: dict[str, FuncSpans]) -> str | None:
    """The qualname of the function whose body holds ``pos``, or None (module level, class
    body, decorator, default value, signature)."""
    if module not in cache:
        cache[module] = _functions(module)
    for name, (start, end) in cache[module].items():
        if start <= pos < end:
            return name
    return None


def _find_code(code: CodeType, qualname: str) -> CodeType | None:
    for const in code.co_consts:
        if isinstance(const, CodeType):
            if const.co_qualname == qualname:
                return const
            inner = _find_code(const, qualname)
            if inner is not None:
                return inner
    return None


def _live_function(module: str, qualname: str) -> FunctionType | None:
    """The function object the imported module runs for ``qualname``, unwrapped from
    staticmethod, classmethod, property and ``functools.wraps`` wrappers; None if not found."""
    obj: object = sys.modules.get(_module_name(module))
    for part in qualname.split("."):
        if obj is None:
            return None
        space = getattr(obj, "__dict__", {})
        obj = space.get(part)
    for _ in range(5):
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = next(
                (
                    f
                    for f in (obj.fget, obj.fset, obj.fdel)
                    if isinstance(f, FunctionType) and f.__code__.co_qualname == qualname
                ),
                None,
            )
        elif isinstance(obj, FunctionType) and obj.__code__.co_qualname == qualname:
            return obj
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        elif hasattr(obj, "func"):
            obj = obj.func  # functools.cached_property
        else:
            return None
    return None


class _Failures:
    """A pytest plugin that keeps the first failing report."""

    def __init__(self) -> None:
        self.first: str | None = None
        self.failed: set[str] = set()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
            if self.first is None:
                text = str(report.longreprtext).strip().splitlines()
                self.first = f"{report.nodeid} ({report.when}): {text[-1] if text else ''}"


def _run_cli_killer(argv: Sequence[str]) -> str | None:
    from statecore.cli import main as statecore

    rc: int = statecore(list(argv))
    return None if rc == 0 else f"statecore {' '.join(argv)} (exit {rc})"


def _run_items(items: list[Any], names: list[str], failures: _Failures) -> str | None:
    """Run the named pytest items (and ``statecore ...`` killers) in order; the first failure."""
    by_id = {item.nodeid: item for item in items}
    chosen = [by_id[n] for n in names if n in by_id]
    for i, item in enumerate(chosen):
        nxt = chosen[i + 1] if i + 1 < len(chosen) else None
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt)
        if failures.first is not None:
            if nxt is not None:
                item.session._setupstate.teardown_exact(None)
            return failures.first
    for name in names:
        if name.startswith("statecore "):
            killed = _run_cli_killer(name.split()[1:])
            if killed is not None:
                return killed
    return None


def _fork(work: Callable[[], str], timeout: float) -> str:
    """Run ``work`` in a forked child (its own process group, output discarded) and return its
    one-line answer; ``"timeout"`` if it ran past ``timeout`` seconds, ``"crash ..."`` if it
    died."""
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            answer = work()
        except BaseException as exc:
            answer = f"error {type(exc).__name__}: {exc}"
            code = 1
        os.write(write, answer.encode()[:8000])
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + timeout
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.monotonic() > deadline:
            break
        else:
            time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the child's leftovers (servers it started), or itself
    if status is None:
        os.waitpid(pid, 0)
        os.close(read)
        return "timeout"
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode(errors="replace")
    if not answer:
        return f"crash (wait status {status})"
    return answer


def _source_hash() -> str:
    digest = hashlib.sha256()
    digest.update(repr((FAST_TESTS, CLI_KILLERS, HYPOTHESIS_PROFILE)).encode())
    for folder in ("statecore", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _coverage(items: list[Any], failures: _Failures) -> dict[str, Any]:
    """Per killer: the core functions it runs and its duration (cached on disk by the hash of
    the sources; computed in a forked child, every killer run once under a profiler)."""
    path = CACHE / f"coverage-{_source_hash()}.json"
    if path.exists():
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached

    def trace() -> str:
        from statecore.progress import Progress

        tracer = _Tracer()
        result: dict[str, Any] = {"killers": {}, "failed": []}
        bar = Progress("coverage run", total=len(items), unit="killers")
        tracer.start()
        for i, item in enumerate(items):
            bar.update(i)
            nxt = items[i + 1] if i + 1 < len(items) else None
            tracer.hits = set()
            t0 = time.perf_counter()
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt)
            result["killers"][item.nodeid] = (time.perf_counter() - t0, sorted(tracer.hits))
        for argv in CLI_KILLERS:
            tracer.hits = set()
            t0 = time.perf_counter()
            killed = _run_cli_killer(argv)
            name = "statecore " + " ".join(argv)
            result["killers"][name] = (time.perf_counter() - t0, sorted(tracer.hits))
            if killed:
                failures.failed.add(name)
        tracer.stop()
        bar.close()
        result["failed"] = sorted(failures.failed)
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
        return "done"

    print("coverage run (once per version of the sources; a few minutes)...", flush=True)
    t0 = time.monotonic()
    answer = _fork(trace, 3600)
    if answer != "done":
        raise RuntimeError(f"coverage run failed: {answer}")
    print(f"coverage run: {time.monotonic() - t0:.0f} s", flush=True)
    cached = json.loads(path.read_text())
    return cached


def _diff(module: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(), after.splitlines(), f"a/{module}", f"b/{module}", lineterm="", n=1
    )
    return "\n".join(list(lines)[2:])


def _mutant_source(module: str, operator_name: str, occurrence: int) -> str | None:
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    source = (ROOT / module).read_text()
    mutated: str | None = mutate_code(source, get_operator(operator_name)(), occurrence)
    return mutated


class _Run:
    """The pytest plugin of the parent: after collection it runs the coverage pass and then
    every pending mutant, each in a forked child, and records the results in the session."""

    def __init__(self, session: Path, cap: float, prefork: _Tracer, confirm: bool) -> None:
        self.confirm = confirm
        self.session = session
        self.cap = cap
        self.prefork = prefork
        self.failures = _Failures()

    def pytest_runtestloop(self, session: Any) -> bool:
        self.prefork.stop()
        ran_early = set(self.prefork.hits)
        print(f"{len(ran_early)} core functions ran at import or collection", flush=True)
        items = list(session.items)
        cov = _coverage(items, self.failures)
        broken = set(cov["failed"])
        if broken:
            print(f"killers failing without a mutant (not used): {sorted(broken)}", flush=True)
        killers = {k: v for k, v in cov["killers"].items() if k not in broken}
        order = sorted(killers, key=lambda k: (k.startswith("statecore "), killers[k][0]))
        _execute(
            self.session, self.cap, items, killers, order, ran_early, self.failures, self.confirm
        )
        return True


def _execute(
    session_path: Path,
    cap: float,
    items: list[Any],
    killers: dict[str, tuple[float, list[str]]],
    order: list[str],
    ran_early: set[str],
    failures: _Failures,
    confirm: bool,
) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    covering: dict[str, list[str]] = defaultdict(list)
    for name in order:
        for key in killers[name][1]:
            covering[key].append(name)
    spans: dict[str, FuncSpans] = {}
    t_start = time.monotonic()
    with use_db(str(session_path), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=_order)
        for n, item in enumerate(pending, 1):
            (m,) = item.mutations
            module = Path(m.module_path).as_posix()
            if module.startswith(str(ROOT)):
                module = Path(module).relative_to(ROOT).as_posix()
            t0 = time.monotonic()
            original = (ROOT / module).read_text()
            mutated = _mutant_source(module, m.operator_name, m.occurrence)
            if mutated is None:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NO_TEST))
                continue
            diff = _diff(module, original, mutated)
            qual = _enclosing(module, tuple(m.start_pos), spans)
            plan = None
            if qual is not None and f"{module}:{qual}" not in ran_early:
                plan = _patch_plan(module, qual, original, mutated)
            if plan is not None:
                live, code = plan
                names = covering.get(f"{module}:{qual}", [])
                expected = sum(killers[k][0] for k in names)
                how = "patched"

                def work(
                    live: FunctionType = live, code: CodeType = code, names: list[str] = names
                ) -> str:
                    live.__code__ = code
                    first = _run_items(items, names, failures)
                    return "survived" if first is None else f"killed by {first}"

                limit = min(cap, 20 + 4 * expected)
                answer = _fork(work, limit) if names else "survived"
                if answer == "timeout" and limit < cap:
                    # a load spike must not pass for a hang: a timeout counts only when the
                    # run also overruns three times the limit (the cap at most)
                    answer = _fork(work, min(cap, 3 * limit))
                if not names:
                    answer = "survived (no killer runs this function)"
                if confirm and answer.startswith("survived"):
                    how = "patched, confirmed"
                    answer = _subprocess_run(module, mutated, order, cap)
            else:
                how = "reloaded"
                mine = [k for k in order if any(h.startswith(module + ":") for h in killers[k][1])]
                rest = [k for k in order if k not in mine]
                # two runs: collecting only the killers that touch the module makes most kills
                # quick; the rest (a constant another module reads) only for the survivors
                answer = _subprocess_run(module, mutated, mine, cap) if mine else "survived"
                if answer.startswith("survived"):
                    answer = _subprocess_run(module, mutated, rest, cap)
            dt = time.monotonic() - t0
            if answer == "timeout":
                outcome, output = TestOutcome.KILLED, "timeout"
            elif answer.startswith("survived"):
                outcome, output = TestOutcome.SURVIVED, answer
            else:
                outcome, output = TestOutcome.KILLED, answer
            db.set_result(
                item.job_id,
                WorkResult(
                    worker_outcome=WorkerOutcome.NORMAL,
                    test_outcome=outcome,
                    output=f"{output}\n[{how}, {dt:.1f} s]",
                    diff=diff,
                ),
            )
            word = "TIMEOUT" if answer == "timeout" else outcome.value.upper()
            print(
                f"[{n}/{len(pending)}] {word:8} {dt:6.1f}s {how:8} {module}:{m.start_pos[0]} "
                f"{m.operator_name}",
                flush=True,
            )
    print(f"wall time of the mutants: {time.monotonic() - t_start:.0f} s", flush=True)


def _patch_plan(
    module: str, qual: str, original: str, mutated: str
) -> tuple[FunctionType, CodeType] | None:
    """The live function and the mutated code object to swap in, or None when the mutant
    cannot be applied by swapping one function's code (it then runs in a fresh interpreter)."""
    live = _live_function(module, qual)
    if live is None:
        return None
    path = str(ROOT / module)
    try:
        before = _find_code(compile(original, path, "exec", dont_inherit=True), qual)
        after = _find_code(compile(mutated, path, "exec", dont_inherit=True), qual)
    except SyntaxError:
        return None
    if before is None or after is None or live.__code__.co_code != before.co_code:
        return None
    if after.co_freevars != live.__code__.co_freevars:
        return None
    return live, after


def _subprocess_run(module: str, mutated: str, names: list[str], cap: float) -> str:
    """Run a mutant a function swap cannot apply: a fresh interpreter imports the mutated
    source (served from memory: the file on disk is not touched) and runs the killers."""
    with tempfile.TemporaryDirectory(prefix="statecore-mutant-") as tmp:
        src = Path(tmp) / "mutant.py"
        src.write_text(mutated)
        lst = Path(tmp) / "killers.txt"
        lst.write_text("\n".join(names))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-mutant", module, str(src)]
        cmd += ["--killers", str(lst)]
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=cap, start_new_session=True
            )
        except subprocess.TimeoutExpired:
            return "timeout"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MUTANT: ")]
    if lines:
        return lines[-1][len("MUTANT: ") :]
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return f"killed by a failed run (exit {proc.returncode}): {tail[-1] if tail else ''}"


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module's mutated source from memory."""

    def __init__(self, name: str, path: Path, source: str) -> None:
        self.name, self.path, self.source = name, path, source

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(compile(self.source, str(self.path), "exec", dont_inherit=True), module.__dict__)


def run_mutant(module: str, source: Path, killers: Path) -> int:
    """``--run-mutant``: run the killers (pytest node ids, then ``statecore`` commands) in
    this interpreter with ``module`` imported from ``source``; prints ``MUTANT: ...``."""
    import pytest

    _prepare_environment()
    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, _MutantFinder(_module_name(module), ROOT / module, source.read_text()))
    names = [n for n in killers.read_text().splitlines() if n]
    tests = [n for n in names if not n.startswith("statecore ")]
    failures = _Failures()
    answer = None
    if tests:
        rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests], plugins=[failures])
        if rc != 0:
            answer = f"killed by {failures.first or f'pytest exit {int(rc)}'}"
    if answer is None:
        for name in names:
            if name.startswith("statecore "):
                killed = _run_cli_killer(name.split()[1:])
                if killed:
                    answer = f"killed by {killed}"
                    break
    print(f"MUTANT: {answer or 'survived'}", flush=True)
    return 0


def execute(session: Path, cap: float, confirm: bool = False) -> None:
    """Run every pending mutant of ``session``: one pytest session collects the killers once;
    each mutant runs in a child forked from it (see the module docstring)."""
    import pytest

    spec = importlib.util.find_spec("statecore")
    origin = Path(spec.origin if spec and spec.origin else "").resolve()
    if not origin.is_relative_to(ROOT):
        sys.exit(f"statecore is imported from {origin}, not from {ROOT}: run this tree's .venv")
    _prepare_environment()
    sys.path.insert(0, str(ROOT))  # as ``python -m pytest`` would: the tests import ``tests.``
    prefork = _Tracer()
    prefork.start()
    run = _Run(session, cap, prefork, confirm)
    pytest.main(["-q", "-s", "-p", "no:cacheprovider", *FAST_TESTS], plugins=[run, run.failures])


def _config(tmp: Path, timeout: float) -> Path:
    modules = ", ".join(f'"{m}"' for m in CORE_MODULES)
    cfg = tmp / "cosmic-ray.toml"
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{modules}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        'test-command = "false"\n'  # unused: this script runs the killers itself
        "\n[cosmic-ray.distributor]\n"
        'name = "local"\n'
    )
    return cfg


ANNOTATION_REASON = "inside a type annotation (the module has postponed evaluation: never run)"

Span = tuple[int, int, int, int]


def _annotation_spans(module: str) -> list[Span]:
    """Source spans of every type annotation of ``module`` (mutants there are equivalent: every
    core module starts with ``from __future__ import annotations``)."""
    tree = ast.parse((ROOT / module).read_text())
    spans: list[Span] = []
    for node in ast.walk(tree):
        ann: ast.expr | None = None
        if isinstance(node, ast.arg | ast.AnnAssign):
            ann = node.annotation
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            ann = node.returns
        if ann is not None and ann.end_lineno is not None and ann.end_col_offset is not None:
            spans.append((ann.lineno, ann.col_offset, ann.end_lineno, ann.end_col_offset))
    return spans


def _in_annotation(pos: tuple[int, int], spans: list[Span]) -> bool:
    return any((a, b) <= pos < (c, d) for a, b, c, d in spans)


def _line(module: str, lineno: int, cache: dict[str, list[str]]) -> str:
    if module not in cache:
        cache[module] = (ROOT / module).read_text().splitlines()
    return cache[module][lineno - 1]


def select(
    session: Path, sample: int, per_module: int, seed: int, modules: Sequence[str] = ()
) -> tuple[int, int]:
    """Keep a seeded sample of sites (one variant each) pending; skip the rest.

    Mutants inside type annotations are left out of the draw (never executed: every core
    module postpones annotation evaluation). A drawn mutant listed in :data:`EQUIVALENT` is
    marked equivalent with its reason instead of being run. Returns ``(kept, equivalent)``."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    rng = random.Random(seed)
    lines: dict[str, list[str]] = {}
    annotations = {m: _annotation_spans(m) for m in CORE_MODULES}
    sites: dict[tuple[str, int, int, str], list[str]] = defaultdict(list)
    skip: list[str] = []
    reasons: dict[str, str] = {}
    variant: dict[str, tuple[str, int]] = {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in db.work_items:
            (m,) = item.mutations
            module = Path(m.module_path).as_posix()
            if module.startswith(str(ROOT)):
                module = Path(module).relative_to(ROOT).as_posix()
            if _in_annotation(tuple(m.start_pos), annotations.get(module, [])):
                skip.append(item.job_id)
                continue
            reason = _equivalent_reason(
                module,
                m.operator_name,
                _line(module, m.start_pos[0], lines),
                lambda m=m, module=module: _mutated_line(
                    module, m.operator_name, m.occurrence, m.start_pos[0]
                ),
            )
            if reason is not None:
                reasons[item.job_id] = reason
            key = (module, m.start_pos[0], m.start_pos[1], _operator_family(m.operator_name))
            sites[key].append(item.job_id)
            variant[item.job_id] = (m.operator_name, m.occurrence)  # job ids are random
        ordered = sorted(s for s in sites if not modules or s[0] in modules)
        if per_module:
            chosen: list[tuple[str, int, int, str]] = []
            for module in modules or CORE_MODULES:
                mine = [s for s in ordered if s[0] == module]
                chosen.extend(rng.sample(mine, min(per_module, len(mine))))
        else:
            chosen = rng.sample(ordered, min(sample, len(ordered)))
        keep = {rng.choice(sorted(sites[s], key=variant.__getitem__)) for s in chosen}
        for jobs in sites.values():
            skip.extend(j for j in jobs if j not in keep)
        db.set_multiple_results(
            skip, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED)
        )
        equivalent = [j for j in keep if j in reasons]
        for job_id in equivalent:
            db.set_result(
                job_id,
                WorkResult(
                    output=f"EQUIVALENT: {reasons[job_id]}", worker_outcome=WorkerOutcome.SKIPPED
                ),
            )
    return len(keep), len(equivalent)


def _order(item: Any) -> tuple[str, int, int, str, int]:
    (m,) = item.mutations
    return (str(m.module_path), *m.start_pos, m.operator_name, m.occurrence)


def _where(item: Any) -> tuple[str, str]:
    (m,) = item.mutations
    module = Path(m.module_path).as_posix()
    if module.startswith(str(ROOT)):
        module = Path(module).relative_to(ROOT).as_posix()
    return module, f"line {m.start_pos[0]} {m.operator_name} #{m.occurrence} (job {item.job_id})"


def report(session: Path) -> int:
    """Print the per-module table, then every survivor, timeout and equivalent mutant of the
    sample; returns the number of survivors."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    survivors: list[tuple[str, str, str, str]] = []
    timeouts: list[tuple[str, str, str]] = []
    equivalents: list[tuple[str, str, str]] = []
    seconds = 0.0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            module, where = _where(item)
            c = counts[module]
            output = result.output or ""
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                if output.startswith("EQUIVALENT"):
                    c["equivalent"] += 1
                    equivalents.append((module, where, output[len("EQUIVALENT: ") :]))
                continue
            if "[" in output and output.endswith(" s]"):
                with contextlib.suppress(ValueError):
                    seconds += float(output.rsplit(", ", 1)[1][:-3])
            if result.worker_outcome != WorkerOutcome.NORMAL:
                c["error"] += 1
            elif result.test_outcome == TestOutcome.KILLED:
                if output.startswith("timeout"):
                    c["timeout"] += 1
                    timeouts.append((module, where, result.diff or ""))
                else:
                    c["killed"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                c["survived"] += 1
                survivors.append((module, where, output.splitlines()[0], result.diff or ""))
            else:
                c["error"] += 1
        pending = db.num_work_items - db.num_results
    head = (
        f"{'module':34} {'killed':>6} {'t/o':>4} {'surv.':>5} {'equiv':>5} {'err':>4} {'score':>7}"
    )
    print(head)
    tot: dict[str, int] = defaultdict(int)
    for module in CORE_MODULES:
        c = counts.get(module, {})
        for k in ("killed", "timeout", "survived", "equivalent", "error"):
            tot[k] += c.get(k, 0)
        print(_row(module, c))
    print(_row("overall", tot))
    print("score = (killed + timeout) / (killed + timeout + survived); equivalents excluded")
    run = sum(tot[k] for k in ("killed", "timeout", "survived", "error"))
    if run:
        print(f"mutants run: {run}, {seconds:.0f} s in all, {seconds / run:.1f} s each on average")
    if pending:
        print(f"not yet run: {pending}")
    print(f"\nEQUIVALENT ({len(equivalents)}):")
    for module, where, reason in equivalents:
        print(f"  {module} {where}: {reason}")
    print(f"\nTIMEOUT ({len(timeouts)}, counted as killed):")
    for module, where, diff in timeouts:
        print(f"  {module} {where}\n{_indent(diff)}")
    print(f"\nSURVIVED ({len(survivors)}):")
    for module, where, how, diff in survivors:
        print(f"  {module} {where}: {how}\n{_indent(diff)}")
    return len(survivors)


def _indent(diff: str) -> str:
    return "\n".join("      " + line for line in diff.splitlines() if not line.startswith("@@"))


def _row(name: str, c: Any) -> str:
    k, t, s = c.get("killed", 0), c.get("timeout", 0), c.get("survived", 0)
    score = f"{100 * (k + t) / (k + t + s):6.1f}%" if k + t + s else "     - "
    return f"{name:34} {k:6} {t:4} {s:5} {c.get('equivalent', 0):5} {c.get('error', 0):4} {score}"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=int, default=20, help="mutants over all core modules")
    p.add_argument("--per-module", type=int, default=0, help="mutants per core module instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample")
    p.add_argument(
        "--module",
        action="append",
        default=[],
        choices=CORE_MODULES,
        help="draw from this core module only (repeatable)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per mutant at most (see docs)"
    )
    p.add_argument("--session", type=Path, help="session database (default: a temp file)")
    p.add_argument("--report", type=Path, metavar="SESSION", help="print a session and exit")
    p.add_argument("--resume", type=Path, metavar="SESSION", help="run a session's pending mutants")
    p.add_argument(
        "--confirm",
        action="store_true",
        help="run each survivor again in a fresh interpreter against every killer",
    )
    p.add_argument("--run-mutant", nargs=2, metavar=("MODULE", "SOURCE"), help=argparse.SUPPRESS)
    p.add_argument("--killers", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_mutant:
        return run_mutant(args.run_mutant[0], Path(args.run_mutant[1]), args.killers)
    if args.report:
        report(args.report)
        return 0
    t0 = time.monotonic()
    if args.resume:
        session = args.resume
    else:
        tmp = Path(tempfile.mkdtemp(prefix="statecore-mutate-"))
        cfg = _config(tmp, args.timeout)
        session = args.session or tmp / "session.sqlite"
        cr = shutil.which("cosmic-ray", path=str(Path(sys.executable).parent)) or "cosmic-ray"
        subprocess.run([cr, "init", str(cfg), str(session)], cwd=ROOT, check=True)
        kept, eq = select(session, args.sample, args.per_module, args.seed, args.module)
        head = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        print(f"seed {args.seed} at {head}: {kept} mutants drawn ({eq} listed equivalent)")
        print(f"session {session}", flush=True)
    execute(session, args.timeout, args.confirm)
    report(session)
    print(f"\nsession {session}; wall time {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
