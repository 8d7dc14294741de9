"""Module layering: the wire types sit below the validation layer, and the sans-IO core
starts no process.

:mod:`statecore.validate` checks the wire types (it imports :mod:`statecore.wire`), so the
wire module must not need the validation layer: the shape check of a report lives beside its
type (:func:`statecore.wire.check_worker_metadata`, re-exported as
``statecore.validate.worker_metadata``) and the error primitives both use live in
:mod:`statecore._argerrors`, which imports only the errors. Read from the source (no import
runs), every ``import`` at any depth counts: one inside a function is a cycle deferred, and a
call-time cost besides.

What starts external processes (a Redis server) lives in :mod:`statecore.services`, used by
the simulator and the benchmarks: no module at statecore's top level starts a process or
imports the services, at any depth.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "statecore"

ALLOWED = {
    "wire": {"statecore._argerrors", "statecore._pickling", "statecore.keys", "statecore.manager"},
    "_argerrors": {"statecore.errors"},
    "_viewerrors": {"statecore._argerrors"},
    "_pickling": set(),
}
"""A low module -> the statecore modules it may import."""


PROCESSES = {"subprocess", "multiprocessing", "statecore.services"}
"""Modules that start processes: none of them is imported at statecore's top level."""

SERVICE_USERS = {"sim", "bench"}
"""The subpackages that may start external services (:mod:`statecore.services`)."""


def _imports(module: str, everything: bool = False) -> list[tuple[str, bool]]:
    """(imported statecore module, whether the import is inside a function) for ``module``
    (a path under statecore/ without ``.py``); ``everything``: not only statecore's modules."""
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    nested = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module]
            if node.module == "statecore":  # from statecore import validate
                names = [f"statecore.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(n, id(node) in nested) for n in names if everything or n.startswith("statecore")]
    return out


def _starts_processes(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROCESSES)


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_a_low_module_imports_only_what_is_below_it(module: str) -> None:
    got = _imports(module)
    assert [name for name, inside in got if inside] == []  # no deferred import
    assert {name for name, _ in got} <= ALLOWED[module]


def test_validate_imports_the_wire_types_and_no_function_imports_late() -> None:
    got = _imports("validate")
    assert ("statecore.wire", False) in got
    assert [name for name, inside in got if inside] == []


def test_the_views_import_their_diagnosis_at_module_level() -> None:
    """The views hand a malformed field to :mod:`statecore._viewerrors`, which sits below
    them and the validation layer: no function of the views imports anything late."""
    got = _imports("views")
    assert ("statecore._viewerrors", False) in got
    assert [name for name, inside in got if inside] == []


def test_no_top_level_module_starts_a_process() -> None:
    """The sans-IO core's modules (statecore's top level: the worker, the wire types, the
    commands' entry points; and the scheduler package) import nothing that starts a process."""
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert "worker" in top and "redisserver" not in top
    top += sorted(f"scheduler/{p.stem}" for p in (ROOT / "scheduler").glob("*.py"))
    assert "scheduler/core" in top
    found = {
        module: name
        for module in top
        for name, _ in _imports(module, everything=True)
        if _starts_processes(name)
    }
    assert found == {}


def test_only_the_simulator_and_the_benchmarks_use_the_services() -> None:
    users = {
        path.relative_to(ROOT).parts[0]
        for path in ROOT.rglob("*.py")
        if path.relative_to(ROOT).parts[0] != "services"
        and any(
            name.startswith("statecore.services")
            for name, _ in _imports(path.relative_to(ROOT).with_suffix("").as_posix())
        )
    }
    assert users and users <= SERVICE_USERS
