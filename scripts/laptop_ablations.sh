#!/usr/bin/env bash
# The ablations of the translation chapter: the laptop recipe at a short budget, one change at a time.
#
#   scripts/laptop_ablations.sh            # every run that has no results file yet
#   scripts/laptop_ablations.sh post-norm  # the named runs only
#
# Each run trains the laptop profile for $STEPS steps (default 400) on the CPU, one thread, two runs at a time
# (a 2-core machine), and evaluates the last checkpoint (no averaging: at this budget the loss is still falling
# fast). batch-1024 halves the tokens per batch and doubles the steps, so that it sees the same tokens. The results
# go to book/results/ablation-NAME.json, with the command that made them; the checkpoints to runs/ablation-NAME/.
# Needs ANNOTATED_TRANSFORMER_DATA (or a network) and the package installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-400}
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

declare -A RUNS=(
    [recipe]=""
    [post-norm]="--no-norm-first"
    [xavier-embeddings]="--embedding-init xavier"
    [post-norm-xavier]="--no-norm-first --embedding-init xavier"
    [all-dropout]="--attention-dropout 0.2 --activation-dropout 0.2"
    [factor-1]="--factor 1.0"
    [warmup-200]="--warmup 200"
    [vocab-4000]="--vocab-size 4000"
    [batch-1024]="--max-tokens 1024 --steps $((2 * STEPS))"
)
ORDER=(recipe post-norm-xavier post-norm xavier-embeddings all-dropout factor-1 warmup-200 vocab-4000 batch-1024)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ORDER[@]}")

run() {
    local name=$1 results="book/results/ablation-$1.json"
    if [ -f "$results" ] && [ -z "${FORCE:-}" ]; then echo "$results exists (FORCE=1 to redo it)"; return; fi
    rm -rf "runs/ablation-$name"
    # shellcheck disable=SC2086
    "$PYTHON" -m annotated_transformer train --task multi30k --profile laptop --device cpu --no-progress \
        --steps "$STEPS" --eval-every 200 --checkpoint-every 100 --average 1 --no-sweep ${RUNS[$name]} \
        --checkpoint-dir "runs/ablation-$name" --results "$results" > "runs/ablation-$name.log" 2>&1 \
        && echo "done: $name" || echo "FAILED: $name (see runs/ablation-$name.log)"
}

mkdir -p runs
for name in "${names[@]}"; do
    [ -n "${RUNS[$name]+set}" ] || { echo "unknown run $name; known: ${ORDER[*]}" >&2; exit 2; }
done
running=0
for name in "${names[@]}"; do
    run "$name" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
