"""Whether this interpreter could have built the project's optional C extensions (shared by
the tests that require them to be built where they can be)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path


def can_build_extensions() -> bool:
    """A C compiler and the Python headers are present (what the optional builds need)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(compiler) is not None and headers.is_file()
