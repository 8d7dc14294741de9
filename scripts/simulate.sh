#!/usr/bin/env bash
# The main job: the README's first command.
#
#   bash scripts/simulate.sh [statecore simulate options...]
#
# Makes its own environment (see scripts/_env.sh), then runs the deterministic simulator on its
# defaults (`statecore simulate`), passing any arguments through. Exits non-zero on any
# invariant violation, data error, hung request or leaked state.
set -euo pipefail

# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

exec statecore simulate "$@"
