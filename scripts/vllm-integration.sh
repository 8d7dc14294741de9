#!/usr/bin/env bash
# vLLM integration tests and the side-by-side benchmark need vLLM 0.33 (CPU torch), which
# lives in its own venv (.peer-venv, about 1 minute to build, 3.1 GB; not run by CI).
# Usage: scripts/vllm-integration.sh [--bench] [pytest args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${PEER_VENV:-$root/.peer-venv}
peer=${PEER_DIR:-$root/../shared/peer}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  PEER_VENV=$venv bash "$peer/setup.sh"
fi
"$venv/bin/pip" install -q 'python-statemachine>=3.2,<3.3' pytest hypothesis
"$venv/bin/pip" install -q --no-deps -e "$root"
cd "$root"
if [ "${1:-}" = "--bench" ]; then
  shift
  exec "$venv/bin/python" -m statecore.cli bench scheduler "$@"
fi
exec "$venv/bin/python" -m pytest tests/vllm -q -p no:cacheprovider "$@"
