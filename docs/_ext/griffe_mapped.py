"""Griffe extension: load the folders that pyproject's ``package-dir`` maps into statecore.

``adapters/`` is installed as ``statecore.adapters`` and ``specs/`` as
``statecore.specs``. Griffe finds packages by folder name, so static analysis of
``statecore`` never sees them; this extension reads the mapping from ``pyproject.toml`` and,
once the ``statecore`` package is loaded, visits each mapped folder as a subpackage of it.
Nothing is imported: the code is read statically, so ``statecore.adapters.vllm`` is
documented without vLLM installed.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[2]


def mapped_folders(root: Path = ROOT) -> dict[str, Path]:
    """Dotted package name -> folder, for every ``package-dir`` entry mapped elsewhere."""
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir: dict[str, str] = data["tool"]["setuptools"].get("package-dir", {})
    out: dict[str, Path] = {}
    for name, folder in sorted(package_dir.items()):
        if folder.replace("/", ".") != name:
            out[name] = root / folder
    return out


class MappedPackages(griffe.Extension):
    """Attach mapped folders (``adapters/`` -> ``statecore.adapters``) to their parent."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """After a top-level package is loaded, visit the folders mapped under it."""
        for dotted, folder in mapped_folders().items():
            parent_name, _, child = dotted.rpartition(".")
            if parent_name != pkg.name or child in pkg.members:
                continue
            sub = loader._load_module(child, folder / "__init__.py", submodules=True, parent=pkg)
            pkg.set_member(child, sub)
