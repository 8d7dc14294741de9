#!/usr/bin/env bash
# vLLM 0.33's own offloading tests, unchanged, once against vLLM and once with statecore
# substituted (tests/vllm/upstream/statecore_substitute.py, a pytest plugin; no test body is
# edited); prints every test that passes on vLLM and fails on statecore, with its reason and
# class, and every test that passes on statecore only through a name shim (statecore's
# equivalent of a vLLM-internal name the test reads), with its shims
# (tests/vllm/upstream/table.py).
#
#   bash scripts/vllm-upstream-tests.sh [--substitute cpu|scheduler] [--semantics vllm|access]
#        [pytest args...]
#
# --substitute cpu (the default): statecore's CPU tier in place of vLLM's CPU manager, over
# tests/v1/kv_offload and the connector tests. --substitute scheduler: statecore's connector
# scheduler side in place of vLLM's OffloadingConnectorScheduler, with each test's own spec and
# manager (a mock) behind it, over the connector tests (tests/vllm/upstream/
# statecore_scheduler.py). Either way the statecore of this clone is the one tested
# (STATECORE_TREE), whatever the peer venv has installed.
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
substitute=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --semantics) semantics=$2; shift 2 ;;
    --substitute) substitute=$2; shift 2 ;;
    *) break ;;
  esac
done
case "$substitute" in
  cpu | scheduler) ;;
  *) echo "--substitute must be cpu or scheduler, got $substitute" >&2; exit 2 ;;
esac
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
# The connector fixtures name facebook/opt-125m; this machine may have no network, so vLLM
# reads that model's config (its public config.json, written here) from a private Hugging Face
# cache, offline
hub=$cache/hf/hub/models--facebook--opt-125m
rev=0000000000000000000000000000000000000000
mkdir -p "$hub/refs" "$hub/snapshots/$rev"
printf %s "$rev" >"$hub/refs/main"
cat >"$hub/snapshots/$rev/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
 "bos_token_id": 2, "do_layer_norm_before": true, "eos_token_id": 2, "ffn_dim": 3072,
 "hidden_size": 768, "max_position_embeddings": 2048, "num_attention_heads": 12,
 "num_hidden_layers": 12, "pad_token_id": 1, "torch_dtype": "float16", "vocab_size": 50272,
 "word_embed_proj_dim": 768}
JSON
export HF_HOME=$cache/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$root/tests/vllm/upstream STATECORE_TREE=$root
out=$(mktemp -d)
if [ "$substitute" = scheduler ]; then
  dirs=(tests/v1/kv_connector/unit/offloading_connector)
  label="statecore's scheduler"
else
  dirs=(tests/v1/kv_offload tests/v1/kv_connector/unit/offloading_connector)
  label="statecore's CPU tier ($semantics)"
fi
# (p2p: the peer-to-peer tier's sessions and transports need NIXL and open sockets; statecore
# substitutes nothing there)
common=(-q -p no:cacheprovider --confcutdir=tests/v1 --tb=line -o addopts=""
  --ignore=tests/v1/kv_offload/tiering/p2p -p vllm_environment)
cd "$src"
echo "== vLLM"
"$venv/bin/python" -m pytest "${common[@]}" "${dirs[@]}" --junitxml="$out/vllm.xml" "$@" \
  | tail -1 || true
echo "== $label"
STATECORE_SUBSTITUTE=$substitute STATECORE_POLICY_SEMANTICS=$semantics \
  "$venv/bin/python" -m pytest "${common[@]}" -p statecore_substitute "${dirs[@]}" \
  --junitxml="$out/statecore.xml" "$@" | tail -1 || true
"$venv/bin/python" "$root/tests/vllm/upstream/table.py" "$out/vllm.xml" "$out/statecore.xml" \
  "$label"
