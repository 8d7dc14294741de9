"""Module layering: the wire types sit below the validation layer.

:mod:`statecore.validate` checks the wire types (it imports :mod:`statecore.wire`), so the
wire module must not need the validation layer: the shape check of a report lives beside its
type (:func:`statecore.wire.check_worker_metadata`, re-exported as
``statecore.validate.worker_metadata``) and the error primitives both use live in
:mod:`statecore._argerrors`, which imports only the errors. Read from the source (no import
runs), every ``import`` at any depth counts: one inside a function is a cycle deferred, and a
call-time cost besides.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "statecore"

ALLOWED = {
    "wire": {"statecore._argerrors", "statecore.keys", "statecore.manager"},
    "_argerrors": {"statecore.errors"},
    "_viewerrors": {"statecore._argerrors"},
}
"""A low module -> the statecore modules it may import."""


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported statecore module, whether the import is inside a function) for ``module``."""
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
        out += [(n, id(node) in nested) for n in names if n.startswith("statecore")]
    return out


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
