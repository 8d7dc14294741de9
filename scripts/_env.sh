# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/simulate.sh: make (or reuse) the project environment.
#
# Creates .venv with `python3 -m venv` when it is missing, installs torch 2.13.0 FIRST (pip
# takes the local CPU build of that exact version; an unpinned torch would pull a CUDA build of
# several GB), then the project in editable mode with its test, sim and docs extras.
# The editable install compiles statecore.adapters._hostcopy (the torch adapter's CPU copy
# loop) in place. A stamp file skips the installs when neither pyproject.toml nor that C file
# has changed since the last one.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${STATECORE_VENV:-$ROOT/.venv}"
TORCH_VERSION="2.13.0"
EXTRAS="test,sim,docs"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
export PATH="$VENV/bin:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

stamp="$VENV/.statecore-env"
# pyproject.toml and the C source of the compiled copy loop decide what an install builds
want="torch==$TORCH_VERSION extras=$EXTRAS $(cat pyproject.toml adapters/_hostcopy.c | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
    || ! "$VENV/bin/python" -c "import statecore, torch" >/dev/null 2>&1; then
    echo "==> installing torch==$TORCH_VERSION (CPU build), then statecore[$EXTRAS]"
    "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]" "torch==$TORCH_VERSION"
    echo "$want" >"$stamp"
fi
