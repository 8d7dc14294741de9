"""Packaging: a built wheel and the editable install import the same names.

The wheel is built (no build isolation) from a copy of the working tree, installed with
``pip install --no-deps --no-index --target`` into a temporary folder, and inspected in a
subprocess whose working directory is outside the source tree and whose ``PYTHONPATH`` starts
with that folder. Every module there must come from the wheel (its ``__file__`` under the
folder), so a module missing from the wheel cannot be masked by the editable finder. The same
probe then runs against the editable install; both must list the same modules, with the same
import outcome, and the same ``__all__`` for every package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"statecore": "statecore", "adapters": "adapters", "specs": "specs"}
ROOTS = ("statecore", "statecore.adapters", "statecore.specs")
MUST_IMPORT = (
    "statecore",
    "statecore.lifecycle",
    "statecore.adapters",
    "statecore.specs",
    "statecore.managers",
)

PROBE = r"""
import importlib, json, pkgutil, sys
roots = sys.argv[1].split(",")
out = {"modules": {}, "all": {}, "files": {}}
seen = set()
def visit(name):
    if name in seen:
        return
    seen.add(name)
    if name.endswith(".__main__"):  # importing it would run the command
        out["modules"][name] = "not imported"
        return
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # the outcome is compared, not judged, here
        out["modules"][name] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:200]
        return
    out["modules"][name] = "ok"
    out["files"][name] = getattr(mod, "__file__", None)
    if hasattr(mod, "__all__"):
        out["all"][name] = sorted(mod.__all__)
    for info in pkgutil.iter_modules(getattr(mod, "__path__", []) or []):
        visit(name + "." + info.name)
for root in roots:
    visit(root)
print(json.dumps(out, sort_keys=True))
"""


def _probe(cwd: Path, pythonpath: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(ROOTS)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def _copy_tree(dest: Path) -> Path:
    """Copy what the build reads (top-level files and the package folders) to ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for entry in ROOT.iterdir():
        if entry.is_file():
            shutil.copy2(entry, dest / entry.name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built wheel, installed into a bare folder."""
    src = _copy_tree(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        # no isolation: build with the installed setuptools; -x: the declared `wheel` build
        # requirement is not needed by setuptools >= 70.1 and may be absent
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-x", "--outdir", str(dist)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (wheel,) = dist.glob("statecore-*.whl")
    site = tmp_path_factory.mktemp("site")
    install = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"),
            *("--target", str(site), str(wheel)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    return site


def test_wheel_and_editable_import_the_same_names(wheel_site: Path, tmp_path: Path) -> None:
    wheel = _probe(tmp_path, str(wheel_site))
    editable = _probe(tmp_path, None)

    outside = {
        name: path
        for name, path in wheel["files"].items()
        if path is not None and not Path(path).is_relative_to(wheel_site)
    }
    assert not outside, f"imported from outside the wheel (missing from it?): {outside}"
    for name, path in editable["files"].items():
        assert path is None or not Path(path).is_relative_to(wheel_site), name

    only_editable = sorted(set(editable["modules"]) - set(wheel["modules"]))
    only_wheel = sorted(set(wheel["modules"]) - set(editable["modules"]))
    assert not only_editable, f"modules missing from the wheel: {only_editable}"
    assert not only_wheel, f"modules only in the wheel: {only_wheel}"
    assert wheel["modules"] == editable["modules"]
    assert wheel["all"] == editable["all"]
    for name in MUST_IMPORT:
        assert editable["modules"][name] == "ok", (name, editable["modules"][name])


def test_wheel_ships_type_marker_and_entry_point(wheel_site: Path) -> None:
    assert (wheel_site / "statecore" / "py.typed").is_file()
    (dist_info,) = wheel_site.glob("statecore-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text(encoding="utf-8")
    assert "statecore = statecore.cli:main" in entry_points
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    assert "Requires-Dist: python-statemachine" in metadata


def test_wheel_runs_the_diagrams_command(wheel_site: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(wheel_site)
    result = subprocess.run(
        [sys.executable, "-m", "statecore", "diagrams", "--print"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Request lifecycle" in result.stdout and "worker_report" in result.stdout
