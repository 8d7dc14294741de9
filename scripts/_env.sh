# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/simulate.sh: make (or reuse) the project environment.
#
# Creates .venv with `python3 -m venv` when it is missing, installs torch 2.13.0 FIRST (pip
# takes the local CPU build of that exact version; an unpinned torch would pull a CUDA build of
# several GB), then the project in editable mode with its test, sim and docs extras.
# The editable install compiles statecore.adapters._hostcopy (the torch adapter's CPU copy
# loop), statecore._viewcheck (the views' accepting checks) and statecore._keyorder (the CPU
# tier's LRU list) in place. A stamp file skips the installs when neither pyproject.toml nor
# those C files have changed since the last one.
#
# First run: it says what it installs and why, then shows pip's progress one line per package
# (Collecting/Downloading/Installing, with the elapsed time); the whole pip log is kept in
# $VENV/pip.log. Set STATECORE_ENV_QUIET=1 to keep only the headings.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${STATECORE_VENV:-$ROOT/.venv}"
TORCH_VERSION="2.13.0"
EXTRAS="test,sim,fuzz,docs"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
export PATH="$VENV/bin:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

stamp="$VENV/.statecore-env"
# pyproject.toml and the C sources of the compiled extensions decide what an install builds
want="torch==$TORCH_VERSION extras=$EXTRAS $(cat pyproject.toml statecore/adapters/_hostcopy.c statecore/_viewcheck.c statecore/_keyorder.c | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
    || ! "$VENV/bin/python" -c "import statecore, torch" >/dev/null 2>&1; then
    env_start=$SECONDS
    echo "==> setting up $VENV (first run, or pyproject.toml changed; a few minutes at most):"
    echo "    1/2 torch==$TORCH_VERSION, CPU build (the simulator's KV tensors, the torch adapter)"
    echo "    2/2 statecore, editable, with extras [$EXTRAS]: test tools (pytest, hypothesis,"
    echo "        crosshair, mypy, ruff), simulator (numpy, matplotlib), docs (mkdocs-material)"
    echo "    full pip log: $VENV/pip.log"
    : >"$VENV/pip.log"
    _pip_progress() {
        # one short line per package pip works on, with the elapsed time; everything to the log
        local line
        while IFS= read -r line; do
            printf '%s\n' "$line" >>"$VENV/pip.log"
            [[ "${STATECORE_ENV_QUIET:-0}" == 1 ]] && continue
            case "$line" in
                Collecting* | Downloading* | "Installing collected"* | "Successfully installed"* | "Building"* | "Obtaining"*)
                    printf '    [%3ss] %.110s\n' "$((SECONDS - env_start))" "$line" ;;
            esac
        done
    }
    echo "==> 1/2 installing torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION" 2>&1 | _pip_progress
    echo "==> 2/2 installing statecore[$EXTRAS] (editable)"
    "$VENV/bin/python" -m pip install -e ".[$EXTRAS]" "torch==$TORCH_VERSION" 2>&1 | _pip_progress
    echo "==> environment ready in $((SECONDS - env_start))s"
    echo "$want" >"$stamp"
fi
