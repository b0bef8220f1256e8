#!/usr/bin/env bash
# The reference rows of docs/evaluation.md: the built-in agents on every shipped protocol,
# and SmolLM2-135M-Instruct zero-shot through the engine (HF) on subsets of them.
#
#   scripts/eval_reference.sh [OUT] [PART]     PART: reference (default), smollm2, all
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
if [ "$PART" = smollm2 ] || [ "$PART" = all ]; then
    # zero-shot, sampled at temperature 1 through HFEngine; subsets (a deviation each
    # report states): a 135M model's episodes run to the step cap
    run "$OUT/webshop-test/smollm2-hf" branchgym/WebShop-v0 --agent smollm2 --tasks 100 --max-envs 16
    run "$OUT/alfworld-thor-unseen/smollm2-hf" branchgym/ALFWorld-v0 --agent smollm2 --tasks 30 --max-envs 10
fi
