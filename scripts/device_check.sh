#!/usr/bin/env bash
# One prepared run on the GPU machine (H200) for the worker / torch transfer adapter.
#
# Run from the repository root with $OUT set (the device tool sets it), e.g. with a 9-minute
# limit:   bash scripts/device_check.sh
# Everything is tee'd into $OUT/device_log.txt. Each stage has its own timeout and the script
# goes on after a failed stage; a stage is skipped when what is left of the overall budget
# (BUDGET_S, default 480 s; the stage timeouts below add up to less) is under 20 s. The last
# lines print a summary of the stages.
#
# Dry run: on a machine without a CUDA device (or with DRY_RUN=1) every CUDA stage is skipped
# with the reason, the measuring stages only check that they load (--dry-run), and the
# budget is printed: that is how the script is tried on the CPU machine (SKIP_ENV=1 also
# leaves out the environment report, as the test of the dry run does).
#
# Stages (most important first; the measuring ones are scripts/device_stages.py):
#   env           nvidia-smi, python, torch/triton versions, CUDA visible
#   install       make `statecore` importable: pip -e, else a symlink tree for PYTHONPATH
#   registration  a real failed cudaHostRegister in the pool's registration, then a kernel; a
#                 double registration, then a kernel; staging over an unregistered pool;
#                 rebuilding a backend on the same pool after shutdown
#   bytes         load and store byte checks at 64 and 256 KiB pages (Triton and staging)
#   bigpool       a pool region > 4 GiB touched at its far end; registration seconds per GB
#   firstjob      first-job latency per kernel variant (compile at construction, not in jobs)
#   vllm          vLLM-shaped layout: 32 layers, K and V split, two groups, bf16
#   contention    slowdown of a matmul loop on the compute stream while copies run
#   cuda          pytest tests/worker -m cuda (byte-exact round trips, FIFO, stream order)
#   bench         statecore bench transfer --device cuda (Triton and staging)
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_log.txt") 2>&1
BUDGET_S="${BUDGET_S:-480}"
START=$(date +%s)
PY="${PYTHON:-python3}"
declare -a SUMMARY=()

# stage NAME MAX_SECONDS NEEDS(cuda|any) COMMAND...
STAGES_S=0
stage() {
    local name=$1 max=$2 needs=$3
    shift 3
    if [[ $needs == cuda && -n $DRY_REASON ]]; then
        echo "=================== stage $name: SKIPPED ($DRY_REASON)"
        SUMMARY+=("$name: SKIPPED ($DRY_REASON), bound ${max}s")
        return
    fi
    local left=$((BUDGET_S - ($(date +%s) - START) - 5))
    if ((left < 20)); then
        SUMMARY+=("$name: SKIPPED (budget spent)")
        return
    fi
    ((max > left)) && max=$left
    echo "=================== stage $name (timeout ${max}s) $(date -u +%FT%TZ)"
    local t0=$(date +%s)
    # bash -c so that stages may be shell functions (exported below)
    timeout --kill-after=10 "$max" bash -c '"$@"' _ "$@"
    local rc=$?
    SUMMARY+=("$name: rc=$rc in $(($(date +%s) - t0))s (bound ${max}s)")
}

env_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv \
        || echo "nvidia-smi: not available"
    uname -a
    command -v "$PY"
    "$PY" - <<'EOF'
import sys
print("python", sys.version)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
except Exception as exc:
    print("TORCH MISSING OR BROKEN:", exc)
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("TRITON MISSING:", exc)
for mod in ("pytest", "hypothesis", "numpy"):
    try:
        __import__(mod)
        print(mod, "ok")
    except Exception as exc:
        print(mod, "MISSING", exc)
EOF
}

install_statecore() {
    if "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        && (cd /tmp && "$PY" -c "import statecore.adapters.torch, statecore.worker"); then
        echo "statecore installed editable"
        return 0
    fi
    # the checkout's folders are the import package (statecore/, with its adapters and specs)
    echo "pip -e failed; importing statecore from the checkout through PYTHONPATH"
    echo "$PWD" >/tmp/statecore_pythonpath
    (cd /tmp && PYTHONPATH="$PWD" "$PY" -c "import statecore.adapters.torch, statecore.worker")
}

# Why the CUDA stages cannot run here (empty: they can).
DRY_REASON=""
if [[ -n ${DRY_RUN:-} ]]; then
    DRY_REASON="DRY_RUN is set"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    DRY_REASON="no CUDA device: nvidia-smi not found"
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DRY_REASON="no CUDA device: torch.cuda.is_available() is False"
fi

MEASURING=(registration:40 bytes:40 bigpool:50 firstjob:60 vllm:40 contention:45)
BOUNDS=(env:20 install:60 "${MEASURING[@]}" cuda:60 bench:50)
for b in "${BOUNDS[@]}"; do STAGES_S=$((STAGES_S + ${b#*:})); done
echo "device_check: budget BUDGET_S=${BUDGET_S}s; stage bounds add up to ${STAGES_S}s: ${BOUNDS[*]}"
((STAGES_S > BUDGET_S)) && echo "device_check: WARNING stage bounds exceed the budget"
[[ -n $DRY_REASON ]] && echo "device_check: DRY RUN: CUDA stages skipped ($DRY_REASON)"

export PY
export -f env_info install_statecore
if [[ -z ${SKIP_ENV:-} ]]; then
    stage env 20 any env_info
else
    SUMMARY+=("env: SKIPPED (SKIP_ENV is set)")
fi
if [[ -z ${SKIP_INSTALL:-} ]]; then
    stage install 60 cuda install_statecore
fi
if [ -f /tmp/statecore_pythonpath ]; then
    export PYTHONPATH="$(cat /tmp/statecore_pythonpath)${PYTHONPATH:+:$PYTHONPATH}"
fi
for b in "${MEASURING[@]}"; do
    name=${b%%:*} bound=${b#*:}
    if [[ -n $DRY_REASON ]]; then
        # the stage's code must at least load and know its name
        "$PY" scripts/device_stages.py "$name" --dry-run || SUMMARY+=("$name: DRY RUN FAILED")
    fi
    stage "$name" "$bound" cuda "$PY" scripts/device_stages.py "$name" --device cuda
done
stage cuda 60 cuda "$PY" -P -m pytest tests/worker -m cuda -v -p no:cacheprovider
stage bench 50 cuda "$PY" -P -m statecore bench transfer --device cuda --impl all \
    --total-mib 512 --repeat 3 --block-kib 16,64,256

echo "=================== summary ($(($(date +%s) - START))s of budget ${BUDGET_S}s)"
printf '%s\n' "${SUMMARY[@]}"
