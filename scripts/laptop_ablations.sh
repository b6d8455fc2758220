#!/usr/bin/env bash
# The ablations of the translation chapter: the laptop recipe at a short budget, one change at a time.
#
#   scripts/laptop_ablations.sh            # every run that has no results file yet
#   scripts/laptop_ablations.sh post-norm  # the named runs only
#   STEPS=800 SEEDS="0 1" EXTRA=--amp scripts/laptop_ablations.sh recipe post-norm
#                                          # past the warm-up, two seeds each, in bf16
#
# Each run trains the laptop profile for $STEPS steps (default 400) on the CPU, one thread, two runs at a time
# (a 2-core machine), and evaluates the last checkpoint (no averaging: at this budget the loss is still falling
# fast). batch-1024 halves the tokens per batch and doubles the steps, so that it sees the same tokens. The results
# of the default (400 steps, seed 0) go to book/results/ablation-NAME.json, with the command that made them; other
# budgets or seeds (SEEDS, default 0) to book/results/ablations-STEPS/NAME-seedS.json. EXTRA adds options to every
# run. The checkpoints go to runs/. Needs ANNOTATED_TRANSFORMER_DATA (or a network) and the package installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-400}
JOBS=${JOBS:-2}
SEEDS=${SEEDS:-0}
EXTRA=${EXTRA:-}
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
    local name=$1 seed=$2 tag results
    if [ "$STEPS" = 400 ] && [ "$seed" = 0 ]; then
        tag=ablation-$name results=book/results/ablation-$name.json
    else
        tag=ablation-$STEPS-$name-seed$seed results=book/results/ablations-$STEPS/$name-seed$seed.json
        mkdir -p "book/results/ablations-$STEPS"
    fi
    if [ -f "$results" ] && [ -z "${FORCE:-}" ]; then echo "$results exists (FORCE=1 to redo it)"; return; fi
    rm -rf "runs/$tag"
    # shellcheck disable=SC2086
    "$PYTHON" -m annotated_transformer train --task multi30k --profile laptop --device cpu --no-progress \
        --steps "$STEPS" --eval-every 200 --checkpoint-every 100 --average 1 --no-sweep --seed "$seed" \
        ${RUNS[$name]} $EXTRA --checkpoint-dir "runs/$tag" --results "$results" > "runs/$tag.log" 2>&1 \
        && echo "done: $name, seed $seed" || echo "FAILED: $name, seed $seed (see runs/$tag.log)"
}

mkdir -p runs
for name in "${names[@]}"; do
    [ -n "${RUNS[$name]+set}" ] || { echo "unknown run $name; known: ${ORDER[*]}" >&2; exit 2; }
done
running=0
for seed in $SEEDS; do
    for name in "${names[@]}"; do
        run "$name" "$seed" &
        running=$((running + 1))
        if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
    done
done
wait
