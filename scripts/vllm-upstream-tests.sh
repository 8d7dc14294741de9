#!/usr/bin/env bash
# vLLM 0.33's own offloading tests, unchanged, once against vLLM and once with statecore's CPU
# tier substituted for vLLM's CPU manager (tests/vllm/upstream/statecore_substitute.py, a
# pytest plugin; no test body is edited); prints every test that passes on vLLM and fails on
# statecore, with its reason and class (tests/vllm/upstream/table.py).
#
#   bash scripts/vllm-upstream-tests.sh [--semantics vllm|access] [pytest args...]
#
# Needs the peer venv (scripts/vllm-integration.sh builds it). The vllm-0.33.0 source
# distribution is downloaded once with pip into a cache outside the clone
# ($STATECORE_CACHE, default ~/.cache/statecore); the test files it uses are checked against
# tests/vllm/upstream/SHA256SUMS before anything runs. vLLM's root tests/conftest.py needs
# packages the peer venv lacks: pytest runs with --confcutdir=tests/v1, so only the
# conftest files of tests/v1 and below are loaded (each of them hash-checked). The
# peer-to-peer tier's tests (tiering/p2p) are left out (see below).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${PEER_VENV:-$root/.peer-venv}
cache=${STATECORE_CACHE:-$HOME/.cache/statecore}
semantics=vllm
if [ "${1:-}" = "--semantics" ]; then
  semantics=$2
  shift 2
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "the peer venv is missing: run scripts/vllm-integration.sh first" >&2
  exit 2
fi
mkdir -p "$cache"
sdist=$cache/vllm-0.33.0.tar.gz
if [ ! -f "$sdist" ]; then
  echo "downloading the vllm-0.33.0 source distribution into $cache"
  # pip prepares the sdist's metadata before saving it: vLLM's setup.py needs its build
  # requirements, and without a device it appends +empty to the version unless overridden
  "$venv/bin/pip" install -q setuptools-rust setuptools-scm cmake ninja jinja2
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.33.0 \
    "$venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
    vllm==0.33.0 -d "$cache"
fi
src=$cache/vllm-0.33.0
if [ ! -d "$src/tests" ]; then
  tar -xzf "$sdist" -C "$cache" "vllm-0.33.0/tests"
fi
(cd "$src" && sha256sum --quiet -c "$root/tests/vllm/upstream/SHA256SUMS")
echo "test files match tests/vllm/upstream/SHA256SUMS"
out=$(mktemp -d)
dirs=(tests/v1/kv_offload tests/v1/kv_connector/unit/offloading_connector)
# (p2p: the peer-to-peer tier's sessions and transports need NIXL and open sockets; statecore
# substitutes nothing there)
common=(-q -p no:cacheprovider --confcutdir=tests/v1 --tb=line -o addopts=""
  --ignore=tests/v1/kv_offload/tiering/p2p)
cd "$src"
echo "== vLLM"
"$venv/bin/python" -m pytest "${common[@]}" "${dirs[@]}" --junitxml="$out/vllm.xml" "$@" \
  | tail -1 || true
echo "== statecore (policy semantics: $semantics)"
PYTHONPATH=$root/tests/vllm/upstream STATECORE_POLICY_SEMANTICS=$semantics \
  "$venv/bin/python" -m pytest "${common[@]}" -p statecore_substitute "${dirs[@]}" \
  --junitxml="$out/statecore.xml" "$@" | tail -1 || true
"$venv/bin/python" "$root/tests/vllm/upstream/table.py" "$out/vllm.xml" "$out/statecore.xml" \
  "statecore ($semantics)"
