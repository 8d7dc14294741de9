#!/usr/bin/env bash
# One prepared run on the GPU machine (H200) for the worker / torch transfer adapter.
#
# Run from the repository root with $OUT set (the device tool sets it), e.g. with an
# 8-minute limit:   bash scripts/device_check.sh
# Everything is tee'd into $OUT/device_log.txt. Each stage has its own timeout and the script
# goes on after a failed stage; stages are skipped when the overall budget (BUDGET_S,
# default 450 s) is nearly spent. The last lines print a summary of the stages.
#
# Stages (most important first):
#   env      nvidia-smi, python, torch/triton versions, CUDA visible, cuda-python attribute
#   install  make `statecore` (with statecore.adapters) importable: pip -e, else a symlink tree
#   smoke    cudaHostRegister on a plain mmap, backend construction, which copy impl is chosen
#   cuda     pytest tests/worker -m cuda
#   bench    statecore bench transfer --device cuda (Triton path, all block sizes)
#   staging  same benchmark, staging fallback, 16 and 64 KiB
#   cpu      pytest tests/worker (the CPU tests too)
set -u -o pipefail
set -x
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_log.txt") 2>&1
BUDGET_S="${BUDGET_S:-450}"
START=$(date +%s)
PY="${PYTHON:-python3}"
declare -a SUMMARY=()

stage() {  # stage NAME MAX_SECONDS COMMAND...
    local name=$1 max=$2
    shift 2
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
    SUMMARY+=("$name: rc=$rc in $(($(date +%s) - t0))s")
}

env_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
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
try:
    from cuda.bindings import runtime as rt
    err, v = rt.cudaDeviceGetAttribute(
        rt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem, 0)
    print("canUseHostPointerForRegisteredMem", err, v)
except Exception as exc:
    print("cuda-python attribute query unavailable:", exc)
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
    echo "pip -e failed; building a symlink tree for PYTHONPATH"
    local shadow=/tmp/statecore_path
    rm -rf "$shadow" && mkdir -p "$shadow/statecore"
    for f in "$PWD"/statecore/*; do ln -s "$f" "$shadow/statecore/"; done
    ln -s "$PWD/adapters" "$shadow/statecore/adapters"
    [ -d "$PWD/specs" ] && ln -s "$PWD/specs" "$shadow/statecore/specs"
    echo "$shadow" >/tmp/statecore_pythonpath
    (cd /tmp && PYTHONPATH="$shadow" "$PY" -c "import statecore.adapters.torch, statecore.worker")
}

smoke() {
    "$PY" -P - <<'EOF'
import logging, mmap
logging.basicConfig(level=logging.INFO)
import torch
cudart = torch.cuda.cudart()
buf = mmap.mmap(-1, 1 << 20)
t = torch.frombuffer(buf, dtype=torch.uint8)
res = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 3)
print("cudaHostRegister on mmap ->", res)
if int(getattr(res, "value", res)) == 0:
    print("cudaHostUnregister ->", cudart.cudaHostUnregister(t.data_ptr()))
from statecore.adapters.torch import TorchTransferBackend
from statecore.pool import CPUPool
cache = torch.zeros((64, 4096), dtype=torch.uint8, device="cuda")
be = TorchTransferBackend([cache], CPUPool(64, [4096]), 1)
print("impl chosen:", be.impl, "pool registered:", be.pool_registered)
be.shutdown()
EOF
}

export PY
export -f env_info install_statecore smoke
stage env 40 env_info
if [ -z "${SKIP_INSTALL:-}" ]; then
    stage install 90 install_statecore
fi
if [ -f /tmp/statecore_pythonpath ]; then
    export PYTHONPATH="$(cat /tmp/statecore_pythonpath)${PYTHONPATH:+:$PYTHONPATH}"
fi
stage smoke 90 smoke
stage cuda 150 "$PY" -P -m pytest tests/worker -m cuda -v -p no:cacheprovider
stage bench 150 "$PY" -P -m statecore bench transfer --device cuda --impl triton \
    --total-mib 1024 --repeat 5
stage staging 70 "$PY" -P -m statecore bench transfer --device cuda --impl staging \
    --total-mib 512 --repeat 3 --block-kib 16,64
stage cpu 60 "$PY" -P -m pytest tests/worker -q -p no:cacheprovider

set +x
echo "=================== summary ($(($(date +%s) - START))s)"
printf '%s\n' "${SUMMARY[@]}"
