#!/usr/bin/env bash
# Run the two tests issue 45 names as flaky under load, N rounds, and count passes.
#
#   scripts/flake_rounds.sh [ROUNDS] [BUSY]     # defaults: 20 rounds, 0 extra busy loops
#
# BUSY busy loops run beside the tests (to raise the load average to about 4 on a machine
# that is otherwise idle); each round prints its result and the 1-minute load average.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-20}"
BUSY="${2:-0}"
PY="${PY:-.venv/bin/python}"
TESTS=(
    "tests/rollout/test_executors.py::test_ray_executor_with_a_crashing_actor"
    "tests/envs/swebench/test_swebench_faults.py::test_hostile_siblings_and_dying_sandboxes_leave_a_complete_tree_and_nothing_behind -k overlay"
)
pids=()
for _ in $(seq 1 "$BUSY"); do (while :; do :; done) & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
declare -A passed
for t in "${TESTS[@]}"; do passed[$t]=0; done
for r in $(seq 1 "$ROUNDS"); do
    for t in "${TESTS[@]}"; do
        if "$PY" -m pytest -q -p no:cacheprovider $t >/tmp/flake_round.log 2>&1; then
            passed[$t]=$((passed[$t] + 1)); res=pass
        else
            res=FAIL; tail -30 /tmp/flake_round.log
        fi
        echo "round $r ${t##*::} $res load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
for t in "${TESTS[@]}"; do echo "${t##*::}: ${passed[$t]} of $ROUNDS passed"; done
