"""Sampled mutation testing of statecore's core modules, on Cosmic Ray.

    python scripts/mutate.py --sample 40 --seed 1            # 40 mutants over the core
    python scripts/mutate.py --per-module 10 --seed 1        # 10 mutants of every core module
    python scripts/mutate.py --report SESSION.sqlite         # print a finished session again

Needs the ``mutate`` extra (``pip install -e '.[mutate]'``: Cosmic Ray). Not part of
``scripts/test.sh``: a survivor costs a whole run of the killers (minutes on a loaded 2-core
machine), so the run is sized by ``--sample``/``--per-module``.

Theory of operation. Cosmic Ray (``cosmic-ray init``) lists every mutation its core
operators can make in the core modules (:data:`CORE_MODULES`): comparisons flipped, ``and``
and ``or`` swapped, ``not`` added or removed, numbers changed by one, ``True``/``False``
swapped, ``break``/``continue`` swapped, loops run zero times, arithmetic operators replaced,
decorators removed, exception types replaced. One source position with one operator family
is a *site*; a site often has many variants (``+`` becomes ``-``, ``*``, ``//``...), so the
sample draws **sites** uniformly at random (``random.Random(seed)``) and one variant per site,
which keeps the arithmetic operators from dominating the score. Every other work item is
marked skipped in the session database, then ``cosmic-ray exec`` runs the sample one mutant
at a time: it rewrites the module on disk (the editable install imports it from here), runs
the killer command, and restores the file.

The killer command is this script with ``--kill``: it finds the mutated module with ``git
diff``, removes its cached bytecode (a mutant of the same size written in the same second
would otherwise load the original's ``.pyc``), and runs, stopping at the first failure:

1. pytest ``-x`` on the fast subset (``tests/scheduler tests/managers tests/lifecycle`` and
   the worker's core tests), the mutated module's own test folder first;
2. ``statecore check`` on the smallest scope (``one``, every interleaving to depth 9 under a
   time limit);
3. ``statecore fuzz`` for a few seconds.

A mutant is *killed* when the killers fail (a timeout counts as killed: the tool reports it
so, and an endless loop is a bug the engine would hang on), *survived* when they pass.
Mutants judged equivalent (no behaviour can tell them from the original) are listed in
:data:`EQUIVALENT` with a one-line reason, by module, operator and the text of the mutated
line; they are skipped and reported apart. The score of a module is killed / (killed +
survived), equivalents excluded.

The working tree's ``statecore/`` must be clean when a run starts (the killer finds the
mutant with ``git diff``); an interrupted run is undone with ``git checkout statecore``.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORE_MODULES: tuple[str, ...] = (
    "statecore/scheduler.py",
    "statecore/kernels.py",
    "statecore/lifecycle/machines.py",
    "statecore/lifecycle/table.py",
    "statecore/managers/cpu.py",
    "statecore/managers/tiering.py",
    "statecore/managers/policies.py",
    "statecore/worker.py",
)
"""The modules mutated: the core the issue names (the lifecycle package without its diagram
writer, which only draws)."""

FAST_TESTS: tuple[str, ...] = (
    "tests/scheduler",
    "tests/managers",
    "tests/lifecycle",
    "tests/worker/test_worker_core.py",
    "tests/worker/test_worker_strength.py",
)
"""The fast test subset the killers run (each mutant's own folder first)."""

FIRST_TESTS: dict[str, tuple[str, ...]] = {
    "statecore/scheduler.py": ("tests/scheduler",),
    "statecore/kernels.py": ("tests/scheduler",),
    "statecore/lifecycle/machines.py": ("tests/lifecycle",),
    "statecore/lifecycle/table.py": ("tests/lifecycle",),
    "statecore/managers/cpu.py": ("tests/managers/test_mgr_cpu.py",),
    "statecore/managers/tiering.py": (
        "tests/managers/test_mgr_tiering.py",
        "tests/managers/test_mgr_strength.py",
    ),
    "statecore/managers/policies.py": (
        "tests/managers/test_mgr_policies.py",
        "tests/managers/test_mgr_strength.py",
    ),
    "statecore/worker.py": (
        "tests/worker/test_worker_core.py",
        "tests/worker/test_worker_strength.py",
    ),
}
"""Tests run first for a mutant of each module (the rest of the subset follows)."""

CHECK_ARGS: tuple[str, ...] = ("--scope", "one", "--time-limit", "10", "--no-liveness")
FUZZ_SECONDS = "5"

EQUIVALENT: dict[tuple[str, str, str], str] = {
    # (module, operator name prefix, stripped text of the original line): reason
    (
        "statecore/kernels.py",
        "core/ReplaceComparisonOperator_Gt_GtE",
        "return storable if storable > cursor else cursor",
    ): "when storable == cursor both branches return the same value",
    (
        "statecore/scheduler.py",
        "core/ReplaceComparisonOperator_LtE_Eq",
        "if max_hit <= num_computed:",
    ): "unreachable as true: the group loop above returns 0 whenever max_hit <= num_computed",
    (
        "statecore/scheduler.py",
        "core/ReplaceComparisonOperator_LtE_Lt",
        "if max_hit <= num_computed:",
    ): "unreachable as true: the group loop above returns 0 whenever max_hit <= num_computed",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "LIVE = 0",
    ): "ReportKind members are compared by identity only; no code reads their numbers",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "STALLED = 1",
    ): "ReportKind members are compared by identity only; no code reads their numbers",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "STALE = 2",
    ): "ReportKind members are compared by identity only; no code reads their numbers",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "UNKNOWN = 3",
    ): "ReportKind members are compared by identity only; no code reads their numbers",
    (
        "statecore/kernels.py",
        "core/NumberReplacer",
        "DUPLICATE = 4",
    ): "ReportKind members are compared by identity only; no code reads their numbers",
}
"""Mutants judged equivalent, with a one-line reason each (skipped and reported apart)."""


def _operator_family(name: str) -> str:
    """``core/ReplaceBinaryOperator_Add_Sub`` -> ``core/ReplaceBinaryOperator``."""
    return name.split("_", 1)[0]


def _equivalent_reason(module: str, operator: str, line: str) -> str | None:
    for (mod, op, text), reason in EQUIVALENT.items():
        if mod == module and operator.startswith(op) and line.strip() == text:
            return reason
    return None


# -- the killer (run by cosmic-ray for each mutant) ---------------------------------------------


def _mutated_modules() -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", "--", "statecore"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line]


def kill() -> int:
    """Run the killers against the working tree as it is (mutated); non-zero = killed."""
    mutated = _mutated_modules()
    for module in mutated:
        path = ROOT / module
        for pyc in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
            pyc.unlink(missing_ok=True)
    first: list[str] = []
    for module in mutated:
        first.extend(p for p in FIRST_TESTS.get(module, ()) if p not in first)
    ordered = first + [p for p in FAST_TESTS if not any(p == f for f in first)]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)
    # a file given first is not collected again from its folder (pytest skips duplicates)
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *ordered]
    statecore = shutil.which("statecore", path=str(Path(sys.executable).parent)) or "statecore"
    for cmd in (
        pytest,
        [statecore, "check", *CHECK_ARGS],
        [statecore, "fuzz", "--seconds", FUZZ_SECONDS],
    ):
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if rc != 0:
            print(f"KILLED by: {' '.join(cmd[:6])}", flush=True)
            return 1
    return 0


# -- the driver --------------------------------------------------------------------------------


def _config(tmp: Path, timeout: float) -> Path:
    modules = ", ".join(f'"{m}"' for m in CORE_MODULES)
    cfg = tmp / "cosmic-ray.toml"
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{modules}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f'test-command = "{sys.executable} {ROOT / "scripts" / "mutate.py"} --kill"\n'
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


def select(session: Path, sample: int, per_module: int, seed: int) -> tuple[int, int]:
    """Keep a seeded sample of sites (one variant each) pending; skip the rest.

    Returns ``(kept, equivalent)``."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    rng = random.Random(seed)
    lines: dict[str, list[str]] = {}
    annotations = {m: _annotation_spans(m) for m in CORE_MODULES}
    sites: dict[tuple[str, int, int, str], list[str]] = defaultdict(list)
    skip: list[str] = []
    equivalent: dict[str, str] = {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in db.work_items:
            (m,) = item.mutations
            module = Path(m.module_path).as_posix()
            if module.startswith(str(ROOT)):
                module = Path(module).relative_to(ROOT).as_posix()
            line = _line(module, m.start_pos[0], lines)
            reason = _equivalent_reason(module, m.operator_name, line)
            if _in_annotation(tuple(m.start_pos), annotations.get(module, [])):
                reason = ANNOTATION_REASON
            if reason is not None:
                equivalent[item.job_id] = reason
                continue
            key = (module, m.start_pos[0], m.start_pos[1], _operator_family(m.operator_name))
            sites[key].append(item.job_id)
        ordered = sorted(sites)
        if per_module:
            chosen: list[tuple[str, int, int, str]] = []
            for module in CORE_MODULES:
                mine = [s for s in ordered if s[0] == module]
                chosen.extend(rng.sample(mine, min(per_module, len(mine))))
        else:
            chosen = rng.sample(ordered, min(sample, len(ordered)))
        keep = {rng.choice(sorted(sites[s])) for s in chosen}
        for jobs in sites.values():
            skip.extend(j for j in jobs if j not in keep)
        db.set_multiple_results(
            skip, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED)
        )
        for job_id, reason in equivalent.items():
            db.set_result(
                job_id,
                WorkResult(output=f"EQUIVALENT: {reason}", worker_outcome=WorkerOutcome.SKIPPED),
            )
    return len(keep), len(equivalent)


def report(session: Path) -> int:
    """Print the per-module scores and every survivor; returns the number of survivors."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    survivors: list[tuple[str, str, str]] = []
    reasons: dict[str, int] = defaultdict(int)
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            (m,) = item.mutations
            module = Path(m.module_path).as_posix()
            if module.startswith(str(ROOT)):
                module = Path(module).relative_to(ROOT).as_posix()
            c = counts[module]
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                if (result.output or "").startswith("EQUIVALENT"):
                    c["equivalent"] += 1
                    reasons[(result.output or "")[len("EQUIVALENT: ") :]] += 1
                continue
            if result.worker_outcome != WorkerOutcome.NORMAL:
                c["error"] += 1
            elif result.test_outcome == TestOutcome.KILLED:
                c["killed"] += 1
                if result.output == "timeout":
                    c["timeout"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                c["survived"] += 1
                survivors.append(
                    (module, f"{m.operator_name} line {m.start_pos[0]}", result.diff or "")
                )
            else:
                c["incompetent"] += 1
        pending = db.num_work_items - db.num_results
    print(f"{'module':34} {'killed':>6} {'surv.':>6} {'t/o':>4} {'err':>4} {'score':>7}")
    total_k = total_s = 0
    for module in CORE_MODULES:
        c = counts.get(module, {})
        k, s = c.get("killed", 0), c.get("survived", 0)
        total_k, total_s = total_k + k, total_s + s
        score = f"{100 * k / (k + s):6.1f}%" if k + s else "     - "
        print(
            f"{module:34} {k:6} {s:6} {c.get('timeout', 0):4} "
            f"{c.get('error', 0) + c.get('incompetent', 0):4} {score}"
        )
    overall = f"{100 * total_k / (total_k + total_s):6.1f}%" if total_k + total_s else "-"
    print(f"{'overall':34} {total_k:6} {total_s:6} {'':4} {'':4} {overall}")
    print(f"not yet run: {pending}; equivalent mutants skipped (all variants, not sampled):")
    for reason, n in sorted(reasons.items()):
        print(f"  {n:5}  {reason}")
    for module, where, diff in survivors:
        print(f"\nSURVIVED {module} {where}\n{diff}")
    return len(survivors)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", type=int, default=20, help="mutants over all core modules")
    p.add_argument("--per-module", type=int, default=0, help="mutants per core module instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    p.add_argument("--session", type=Path, help="session database (default: a temp file)")
    p.add_argument("--report", type=Path, metavar="SESSION", help="print a session and exit")
    p.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kill:
        return kill()
    if args.report:
        report(args.report)
        return 0
    if _mutated_modules():
        print("statecore/ has uncommitted changes: commit or stash them first", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="statecore-mutate-"))
    cfg = _config(tmp, args.timeout)
    session = args.session or tmp / "session.sqlite"
    cr = shutil.which("cosmic-ray", path=str(Path(sys.executable).parent)) or "cosmic-ray"
    subprocess.run([cr, "init", str(cfg), str(session)], cwd=ROOT, check=True)
    kept, eq = select(session, args.sample, args.per_module, args.seed)
    print(f"seed {args.seed}: {kept} mutants sampled, {eq} equivalent skipped; session {session}")
    sys.stdout.flush()
    try:
        subprocess.run([cr, "exec", str(cfg), str(session)], cwd=ROOT, check=True)
    finally:
        subprocess.run(["git", "checkout", "--", "statecore"], cwd=ROOT, check=False)
    report(session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
