#!/usr/bin/env bash
# The main job: the README's first command.
#
#   bash scripts/simulate.sh [statecore simulate options...]
#
# Makes its own environment (see scripts/_env.sh), then runs the deterministic simulator on its
# defaults (`statecore simulate`), passing any arguments through. Until the simulator is
# installed in this checkout, it renders the lifecycle diagrams' transition tables instead
# (`statecore diagrams --print`): real output generated from the state machines.
set -euo pipefail

# shellcheck source=scripts/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('statecore.sim.cli') is None)"; then
    exec statecore simulate "$@"
fi
echo "(statecore simulate is not in this checkout yet: printing the lifecycle transition tables)"
exec statecore diagrams --print
