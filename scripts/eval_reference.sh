#!/usr/bin/env bash
# The reference rows of docs/evaluation.md: the built-in agents on every shipped protocol,
# and SmolLM2-135M-Instruct zero-shot through the engine (HF) on subsets of them.
#
#   scripts/eval_reference.sh [OUT] [PART]     PART: reference (default), smollm2,
#                                              smollm2-endpoint, all
#
# Each run is resumable: a folder with run.json but no summary.json is finished with
# --resume, a finished one is skipped. Run folders land in OUT (default results/eval).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/eval}
PART=${2:-reference}
BG=${BRANCHGYM:-.venv/bin/branchgym}

run() {  # run FOLDER ARGS...: one branchgym eval, resumed or skipped as needed
    local dir=$1
    shift
    if [ -f "$dir/summary.json" ]; then
        echo "eval_reference: $dir is done"
        return 0
    fi
    local resume=()
    [ -f "$dir/run.json" ] && resume=(--resume)
    echo "eval_reference: $dir"
    "$BG" eval "$@" --out "$dir" --no-progress "${resume[@]}" >"$dir.log" 2>&1 || {
        echo "eval_reference: $dir failed (see $dir.log)" >&2
        return 1
    }
}
mkdir -p "$OUT"/{webshop-test,alfworld-thor-seen,alfworld-thor-unseen,swebench-realistic,texttree-ci}

if [ "$PART" = reference ] || [ "$PART" = all ]; then
    for a in random expert; do
        run "$OUT/texttree-ci/$a" branchgym/TextTreeMDP-v0 --agent "$a" -k 4
        run "$OUT/webshop-test/$a" branchgym/WebShop-v0 --agent "$a"
        run "$OUT/alfworld-thor-seen/$a" branchgym/ALFWorld-v0 --protocol alfworld-thor-seen --agent "$a"
        run "$OUT/alfworld-thor-unseen/$a" branchgym/ALFWorld-v0 --protocol alfworld-thor-unseen --agent "$a"
    done
    run "$OUT/swebench-realistic/gold" branchgym/SWEBench-v0 --agent gold
fi
# SmolLM2-135M-Instruct zero-shot, sampled at temperature 1, on subsets with a 10-step cap
# (a deviation each report states: a 135M model's episodes run to the cap, and on this
# 2-core CPU a full 50-step ALFWorld protocol would take about 14 hours), through the
# engine (HF) and through vLLM's OpenAI-compatible server; the two must agree within
# their intervals.
SMOL=(--tasks 20 --max-steps 10 --max-envs 10)
if [ "$PART" = smollm2 ] || [ "$PART" = all ]; then
    run "$OUT/webshop-test/smollm2-hf" branchgym/WebShop-v0 --agent smollm2 --tasks 20 --max-steps 6 \
        --max-envs 10
    run "$OUT/alfworld-thor-unseen/smollm2-hf" branchgym/ALFWorld-v0 --protocol alfworld-thor-unseen \
        --agent smollm2 "${SMOL[@]}" --dtype bfloat16
    run "$OUT/swebench-realistic/smollm2-hf" branchgym/SWEBench-v0 --agent smollm2 "${SMOL[@]}" \
        --dtype bfloat16
fi
if [ "$PART" = smollm2-endpoint ] || [ "$PART" = all ]; then
    # vLLM's server in .venv-vllm (make vllm-venv), on a free loopback port, stopped at exit
    VLLM_PY=${BRANCHGYM_VLLM_PYTHON:-.venv-vllm/bin/python}
    WEIGHTS=$(.venv/bin/python -c 'from branchgym.agents.policies.models import cache_dir, smollm2; smollm2(); print(cache_dir() / "smollm2-135m-instruct")')
    PORT=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 setsid \
        "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$WEIGHTS" \
        --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --dtype float32 \
        --max-model-len 4096 --enforce-eager --max-num-seqs 10 --disable-uvicorn-access-log \
        >"$OUT/vllm-server.log" 2>&1 &
    SERVER=$!
    trap 'kill -TERM -- -"$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
        kill -0 "$SERVER" 2>/dev/null || { tail -20 "$OUT/vllm-server.log" >&2; exit 1; }
        sleep 1
    done
    EP=(--agent "http://127.0.0.1:$PORT/v1" --model smollm2 --no-request-seeds --max-tokens 48)
    run "$OUT/webshop-test/smollm2-endpoint-noseed" branchgym/WebShop-v0 "${EP[@]}" --tasks 20 \
        --max-steps 6 --max-envs 10
    run "$OUT/alfworld-thor-unseen/smollm2-endpoint" branchgym/ALFWorld-v0 \
        --protocol alfworld-thor-unseen "${EP[@]}" "${SMOL[@]}"
    run "$OUT/swebench-realistic/smollm2-endpoint" branchgym/SWEBench-v0 "${EP[@]}" "${SMOL[@]}"
fi
