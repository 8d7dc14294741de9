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
from native_build import can_build_extensions

ROOT = Path(__file__).resolve().parents[1]
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
    """Copy what the build reads (top-level files and the package folder) to ``dest``; built
    extensions stay behind, so the wheel compiles its own."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for entry in ROOT.iterdir():
        if entry.is_file():
            shutil.copy2(entry, dest / entry.name)
    shutil.copytree(ROOT / "statecore", dest / "statecore", ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the working tree."""
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
    return wheel


@pytest.fixture(scope="module")
def wheel_site(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built wheel, installed into a bare folder."""
    wheel = built_wheel
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
    # the adapters and specs are folders of the package, stubs of the extensions beside them
    for stub in ("_viewcheck.pyi", "_keyorder.pyi", "adapters/_hostcopy.pyi"):
        assert (wheel_site / "statecore" / stub).is_file(), stub
    for module in ("adapters/torch.py", "adapters/vllm.py", "specs/invariants.py"):
        assert (wheel_site / "statecore" / module).is_file(), module
    (dist_info,) = wheel_site.glob("statecore-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text(encoding="utf-8")
    assert "statecore = statecore.cli:main" in entry_points
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    assert "Requires-Dist: python-statemachine" in metadata


@pytest.mark.skipif(
    not can_build_extensions(),
    reason="no C compiler or Python headers: the optional extensions cannot have been built",
)
def test_wheel_ships_the_compiled_extensions_in_their_folders(wheel_site: Path) -> None:
    for folder, name in (("", "_viewcheck"), ("", "_keyorder"), ("adapters", "_hostcopy")):
        assert list((wheel_site / "statecore" / folder).glob(f"{name}.*.so")), name


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


# ---------------------------------------------------------------------------------------------
# The wheel in a fresh virtual environment, with the extras a user would choose (the
# closure of their declared requirements is hard-linked in from this environment; see
# wheel_venv)

TORCH_PIN = "torch==2.13.0"  # pinned: pip takes the local CPU build (never an unpinned torch)
EXTRAS = ("sim", "fuzz")
# command -> the extra that must be enough to run it
COMMAND_EXTRA = {"simulate": "sim", "fuzz": "fuzz"}
# Loaded by every Python of the venv run with PYTHONPATH=<folder of this file>: at exit, write
# the distributions of every third-party top-level module the process imported.
AUDIT = r"""
import atexit, json, os, sys

def _dump():
    from importlib.metadata import packages_distributions
    dists = packages_distributions()
    out = {}
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in sys.builtin_module_names or top in out:
            continue
        if top in dists:
            out[top] = dists[top]
    with open(os.environ["STATECORE_IMPORT_AUDIT"], "w") as f:
        json.dump(out, f)

if os.environ.get("STATECORE_IMPORT_AUDIT"):
    atexit.register(_dump)
"""

# Run in the venv: the distributions each extra of statecore pulls in (the whole closure).
CLOSURE = r"""
import json, re, sys
from importlib.metadata import distribution, PackageNotFoundError
from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def closure(extra):
    seen, todo = set(), [("statecore", extra)]
    while todo:
        name, ext = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        if norm(name) in seen and ext is None:
            continue
        seen.add(norm(name))
        for line in dist.requires or []:
            req = Requirement(line)
            env = {"extra": ext or ""}
            if req.marker is None or req.marker.evaluate(env):
                if norm(req.name) not in seen:
                    todo.append((req.name, None))
                for sub in req.extras:
                    todo.append((req.name, sub))
    return sorted(seen)

print(json.dumps({extra: closure(extra) for extra in sys.argv[1:]}))
"""


def _wheel_requirements(wheel: Path, extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """The wheel's requirements that ``statecore[<extras>]`` installs (base and those extras)."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(name).decode()
    out = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                out.append(str(req))
    return out


def _installed_closure(requirements: list[str]) -> dict[str, Any]:
    """The distributions of this environment that ``requirements`` pull in, recursively."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    found: dict[str, Any] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # pip installs it from the index (see wheel_venv)
        new_extras = set(req.extras) - found.get(key, (None, set()))[1]
        if key in found and not new_extras:
            continue
        extras = found.get(key, (None, set()))[1] | set(req.extras)
        found[key] = (dist, extras)
        for line in dist.requires or []:
            sub = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append(sub)
    return {key: dist for key, (dist, _) in found.items()}


def _link_distribution(dist: Any, site: Path) -> bool:
    """Hard-link an installed distribution's files (its RECORD) into ``site``."""
    files = dist.files
    if not files:
        return False
    for rel in files:
        if str(rel).startswith(".."):  # console scripts of dependencies: not needed
            continue
        src = Path(dist.locate_file(rel))
        if not src.is_file():
            continue
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except FileExistsError:
            pass
        except OSError:  # another file system: copy
            shutil.copy2(src, dst)
    return True


def _pip(python: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def wheel_venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed by pip with the extras ``sim`` and ``fuzz``.

    Installing torch, numpy and matplotlib from scratch takes minutes, so the venv is seeded
    with hard links to the files of exactly the distributions the wheel's *declared*
    requirements pull in, as installed in the test environment (pip itself too): a dependency
    that the extras do not declare is not there. pip then installs the wheel offline
    (``--no-index``), which fails if anything declared is missing, and ``pip check`` passes.
    If the test environment lacks a declared dependency, pip installs it from the index
    instead (torch pinned).
    """
    return _make_venv(built_wheel, tmp_path_factory, EXTRAS)


def _make_venv(
    built_wheel: Path, tmp_path_factory: pytest.TempPathFactory, extras: tuple[str, ...]
) -> Path:
    """A fresh venv with the wheel and ``extras`` (see :func:`wheel_venv`)."""
    import sysconfig

    venv = tmp_path_factory.mktemp("wheel-venv") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    assert Path(sysconfig.get_paths()["purelib"]) != site
    closure = _installed_closure([*_wheel_requirements(built_wheel, extras), "pip"])
    closure.pop("statecore", None)
    for dist in closure.values():
        _link_distribution(dist, site)
    spec = f"{built_wheel}[{','.join(extras)}]"
    install = _pip(python, "--no-index", spec, timeout=300)
    if install.returncode != 0:  # a declared dependency this environment does not have
        install = _pip(python, spec, TORCH_PIN)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    check = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
    return venv


def _run_installed(
    venv: Path, cwd: Path, *argv: str, audit: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if audit is not None:
        hooks = cwd / "audit-hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "sitecustomize.py").write_text(AUDIT, encoding="utf-8")
        env["PYTHONPATH"] = str(hooks)
        env["STATECORE_IMPORT_AUDIT"] = str(audit)
    return subprocess.run(
        [str(venv / "bin" / "statecore"), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _closures(venv: Path, extras: tuple[str, ...] = EXTRAS) -> dict[str, list[str]]:
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CLOSURE, *extras],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    closures: dict[str, list[str]] = json.loads(result.stdout)
    return closures


def _imported_outside(audit: Path, allowed: list[str]) -> dict[str, list[str]]:
    """Imported third-party modules whose distribution the extra does not pull in."""
    import re

    imported: dict[str, list[str]] = json.loads(audit.read_text(encoding="utf-8"))
    ok = set(allowed) | {"pip"}  # the installer itself
    return {
        module: dists
        for module, dists in imported.items()
        if not any(re.sub(r"[-_.]+", "-", d).lower() in ok for d in dists)
    }


def test_installed_wheel_runs_simulate_from_outside_the_repo(
    wheel_venv: Path, tmp_path: Path
) -> None:
    version = _run_installed(wheel_venv, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.startswith("statecore "), version.stderr
    audit = tmp_path / "imports.json"
    png = tmp_path / "run.png"
    run = _run_installed(
        wheel_venv, tmp_path, "simulate", "--requests", "50", "--plot", str(png), audit=audit
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "statecore simulate: PASS" in run.stdout
    assert png.stat().st_size > 10_000
    outside = _imported_outside(audit, _closures(wheel_venv)[COMMAND_EXTRA["simulate"]])
    assert not outside, f"statecore[sim] does not declare what simulate imports: {outside}"


def test_installed_wheel_runs_fuzz_from_outside_the_repo(wheel_venv: Path, tmp_path: Path) -> None:
    audit = tmp_path / "imports.json"
    run = _run_installed(wheel_venv, tmp_path, "fuzz", "--seconds", "5", audit=audit)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no invariant violation" in run.stdout
    outside = _imported_outside(audit, _closures(wheel_venv)[COMMAND_EXTRA["fuzz"]])
    assert not outside, f"statecore[fuzz] does not declare what fuzz imports: {outside}"


def test_installed_wheel_checks_the_docs_it_is_pointed_at(wheel_venv: Path, tmp_path: Path) -> None:
    """From an installed package, diagrams and docs need --out (no guessing at ./docs), and
    check the folder they are given against the package's own machines."""
    docs = ROOT / "docs"
    (tmp_path / "docs").mkdir()  # a ./docs that belongs to someone else: must not be used
    for argv in (["diagrams", "--check"], ["docs", "--check"]):
        result = _run_installed(wheel_venv, tmp_path, *argv)
        assert result.returncode == 2 and "--out DIR" in result.stderr, result.stderr
    ok = _run_installed(
        wheel_venv, tmp_path, "diagrams", "--check", "--out", str(docs / "diagrams")
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ok = _run_installed(wheel_venv, tmp_path, "docs", "--check", "--out", str(docs))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    out = tmp_path / "written"
    wrote = _run_installed(wheel_venv, tmp_path, "diagrams", "--no-svg", "--out", str(out))
    assert wrote.returncode == 0, wrote.stderr
    assert (out / "request.dot").read_text() == (docs / "diagrams" / "request.dot").read_text()


def test_wheel_metadata_declares_license_and_extras_and_no_invented_url(built_wheel: Path) -> None:
    import zipfile

    with zipfile.ZipFile(built_wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(meta_name).decode()
        licenses = [n for n in names if n.endswith("LICENSE")]
        assert licenses and "Apache License" in zf.read(licenses[0]).decode()
    import statecore

    assert f"Version: {statecore.__version__}" in metadata
    for extra in ("sim", "fuzz", "docs", "vllm", "test"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "vllm<0.34,>=0.33" in metadata or "vllm>=0.33,<0.34" in metadata
    assert "Classifier: License" not in metadata or "Apache" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Project-URL: " not in metadata  # there is no public repository to point at


def test_installed_wheel_check_mutant_says_it_needs_a_checkout(
    wheel_venv: Path, tmp_path: Path
) -> None:
    run = _run_installed(wheel_venv, tmp_path, "check", "--mutant", "anything")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--mutant needs a source checkout of statecore" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def conformance_venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and the ``conformance`` extra alone (no torch, no numpy)."""
    return _make_venv(built_wheel, tmp_path_factory, ("conformance",))


MANAGER_MODULE = """
from statecore.managers.cpu import CPUOffloadingManager


def make(capacity):
    return CPUOffloadingManager(capacity)
"""


def test_conformance_extra_runs_the_kit_on_a_module_of_the_current_folder(
    conformance_venv: Path, tmp_path: Path
) -> None:
    (tmp_path / "mymanager.py").write_text(MANAGER_MODULE, encoding="utf-8")
    audit = tmp_path / "imports.json"
    run = _run_installed(
        conformance_venv,
        tmp_path,
        *("fuzz", "--manager", "mymanager:make", "--examples", "5", "--steps", "10"),
        *("--seed", "1"),
        audit=audit,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "conformance: no violation found" in run.stdout
    allowed = _closures(conformance_venv, ("conformance",))["conformance"]
    outside = _imported_outside(audit, allowed)
    assert not outside, f"statecore[conformance] does not declare what the kit imports: {outside}"


@pytest.mark.parametrize(
    ("argv", "extra"),
    [(["simulate"], "sim"), (["fuzz", "--seconds", "1"], "fuzz"), (["tier", "list"], "redis")],
)
def test_a_missing_extra_is_one_line_naming_it(
    conformance_venv: Path, tmp_path: Path, argv: list[str], extra: str
) -> None:
    run = _run_installed(conformance_venv, tmp_path, *argv)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f'pip install "statecore[{extra}]"' in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
