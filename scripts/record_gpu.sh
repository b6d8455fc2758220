#!/usr/bin/env bash
# Record the book's GPU figures on a machine with one CUDA GPU, in steps that each fit in about ten minutes.
#
#   scripts/record_gpu.sh prepare       # on a machine with the book's environment (jupytext, the data folder)
#   scripts/record_gpu.sh translation   # on the GPU machine: the full Multi30k run ($OUT/results/multi30k-full.json);
#                                       # options are passed on (`translation --compile` for a compiled run)
#   scripts/record_gpu.sh checks        # on the GPU machine: CUDA tests, benchmarks, the copy task in mixed precision,
#                                       # each within CHECK_TIMEOUT seconds (default 540)
#   scripts/record_gpu.sh chapters [NAME...]  # on the GPU machine: chapters as scripts, full profile
#   scripts/record_gpu.sh session [SECONDS]   # on the GPU machine: the checks and chapters, then the benchmark
#                                             # section by section, all within SECONDS (default 540)
#
# `prepare` copies the Multi30k files (from ANNOTATED_TRANSFORMER_DATA) and the chapters, written as plain Python
# scripts, into .gpu/, so that a GPU machine with PyTorch, sentencepiece and sacreBLEU but no network and no
# Jupyter can run everything from a copy of this checkout plus .gpu/. The other steps run the package from the
# checkout with $PYTHON (default: python3) and write results and logs under $OUT (default: .gpu/out), never into
# book/results/, whose records the chapters pin to the sessions that made them: commit the results files that come
# back into a folder of the session's own, book/results/gpu-<GPU>-<date>/, with a README of what ran.
# AT_DEVICE=cpu makes a dry run of a step on a CPU (pass tiny settings, e.g. `translation --steps 20`); it writes
# its checkpoints into $OUT/runs, never into runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-.gpu/out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
step=${1:-}
shift || true

enter_step() {
    mkdir -p "$OUT"
    "$PYTHON" - <<'EOF' | tee "$OUT/environment.txt"
import os, platform, torch, sentencepiece, sacrebleu
dry = os.environ.get("AT_DEVICE", "cuda") == "cpu"  # AT_DEVICE=cpu: a dry run of the steps, with tiny settings
assert dry or torch.cuda.is_available(), "no CUDA device: this step is for a GPU machine"
print(f"{'CPU (dry run)' if dry else torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
      f"Python {platform.python_version()} | sentencepiece {sentencepiece.__version__} | sacrebleu {sacrebleu.__version__}")
EOF
    if [ -d .gpu/multi30k ]; then export ANNOTATED_TRANSFORMER_DATA="$PWD/.gpu/multi30k"; fi
    : "${ANNOTATED_TRANSFORMER_DATA:?set ANNOTATED_TRANSFORMER_DATA, or run 'prepare' first}"
    # a dry run (AT_DEVICE=cpu) never writes into book/results/ or runs/, and runs the benchmarks and the copy
    # task at tiny sizes
    RESULTS="$OUT/results"  # never book/results/: its records stay those of their sessions
    if [ "${AT_DEVICE:-cuda}" = cpu ]; then
        RUNS="$OUT/runs" TINY=(--smoke) COPY=(--steps 30)
    else
        RUNS=runs TINY=() COPY=()
    fi
    mkdir -p "$RESULTS"
    export AT_PROFILE=${AT_PROFILE:-full} AT_DEVICE=${AT_DEVICE:-cuda} ANNOTATED_TRANSFORMER_CACHE="$PWD/.gpu/cache"
}

case "$step" in
prepare)
    : "${ANNOTATED_TRANSFORMER_DATA:?set ANNOTATED_TRANSFORMER_DATA to the Multi30k folder}"
    rm -rf .gpu/multi30k .gpu/chapters .gpu/out  # a dry run's checkpoints: too large to carry
    mkdir -p .gpu/multi30k
    cp "$ANNOTATED_TRANSFORMER_DATA"/*.gz .gpu/multi30k/
    ${BOOK_PYTHON:-.venv/bin/python} scripts/chapter_scripts.py write .gpu/chapters >/dev/null
    du -sh .gpu
    echo "carry .gpu to the GPU machine, then run the other steps there"
    ;;
translation)
    enter_step
    # the full-profile command of the translation chapter's "recorded runs" section (with --no-progress for a log);
    # a run that was cut off (by a time limit on the machine, say) continues from its last checkpoint when the
    # step is run again
    resume=()
    if compgen -G "$RUNS/multi30k-full/step_*.pt" >/dev/null; then resume=(--resume); fi
    "$PYTHON" -m annotated_transformer train --task multi30k --profile "$AT_PROFILE" \
        --checkpoint-dir "$RUNS/multi30k-full" --results "$RESULTS/multi30k-full.json" --no-progress \
        "${resume[@]}" "$@" 2>&1 | tee -a "$OUT/translation.log"
    ;;
checks)
    enter_step
    # each part within its own limit (CHECK_TIMEOUT seconds, default 540; exit 124: stopped at it), and a part that
    # fails or times out stops nothing else; the step exits with the first part's failure
    limit=${CHECK_TIMEOUT:-540} status=0
    part() {  # part NAME LOG COMMAND...: run COMMAND within the limit, its output into $OUT/LOG and on screen
        local name=$1 log=$2 rc=0
        shift 2
        timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" || rc=$?
        echo "$name: exit $rc" | tee -a "$OUT/environment.txt"
        if [ "$status" = 0 ]; then status=$rc; fi
    }
    part "CUDA tests" cuda-tests.log "$PYTHON" -m pytest tests -m cuda -q -rs -p no:cacheprovider -p no:nbval
    # eager and compiled, training and decoding (the static cache's compiled step uses CUDA graphs)
    part bench bench.log "$PYTHON" -m annotated_transformer bench "${TINY[@]}" --compile --device "$AT_DEVICE" \
        --json "$RESULTS/bench_gpu.json"
    part "copy task" copy-amp.log "$PYTHON" -m annotated_transformer train --task copy "${COPY[@]}" \
        --device "$AT_DEVICE" --no-progress
    exit "$status"
    ;;
chapters)
    enter_step
    # every chapter runs without the notebook build tools; the few cells that read the book's sources with
    # jupytext say so and skip themselves where it is missing
    "$PYTHON" scripts/chapter_scripts.py run .gpu/chapters "$@" --timeout "${CHAPTER_TIMEOUT:-540}" \
        --report "$OUT/chapters-full.json" 2>&1 | tee "$OUT/chapters.log"
    ;;
session)
    # One call that fits a short loan of a GPU: first, at the same time, the CUDA tests, every chapter but
    # translation (which trains the full profile for minutes: the `translation` step does that work) in the full
    # profile, and the copy task in mixed precision; then the benchmark alone on the GPU, one section at a time,
    # each within its share of the time left. Everything goes to $OUT, in at most 8 files; the benchmark's records
    # (bench_<sections>.json) belong in a folder of the session's own, book/results/gpu-<GPU>-<date>/.
    enter_step
    budget=${1:-540} started=$SECONDS
    left() { echo $((budget - (SECONDS - started))); }
    note() { echo "[$((SECONDS - started)) s] $*" | tee -a "$OUT/environment.txt"; }
    folder=${CHAPTER_DIR:-.gpu/chapters}  # written by `prepare`
    # shellcheck disable=SC2012  # chapter files have plain names
    chapters=${CHAPTERS:-$(ls "$folder" | sed -E 's/^[0-9]+_//; s/\.py$//' | grep -vx translation)}
    first=$(($(left) * 2 / 5))
    note "checks and chapters, within $first s"
    # each part notes its exit status (124: stopped at its time limit), and a failure stops nothing else
    (
        rc=0
        # shellcheck disable=SC2086  # TESTS may name several paths
        OMP_NUM_THREADS=1 timeout "$first" "$PYTHON" -m pytest ${TESTS:-tests} -m cuda -q -rs \
            -p no:cacheprovider -p no:nbval -n 3 >"$OUT/cuda-tests.log" 2>&1 || rc=$?
        note "CUDA tests: exit $rc"
    ) &
    (
        rc=0
        # shellcheck disable=SC2086  # one chapter name per word
        OMP_NUM_THREADS=2 timeout "$first" "$PYTHON" scripts/chapter_scripts.py run "$folder" $chapters \
            --jobs 5 --timeout $((first > 60 ? first - 15 : first * 3 / 4)) --report "$OUT/chapters-full.json" \
            >"$OUT/chapters.log" 2>&1 || rc=$?  # a chapter's own limit ends first
        note "chapters: exit $rc"
    ) &
    (
        rc=0
        timeout "$first" "$PYTHON" -m annotated_transformer train --task copy "${COPY[@]}" \
            --device "$AT_DEVICE" --no-progress >"$OUT/copy.log" 2>&1 || rc=$?
        note "copy task: exit $rc, $(tail -n 1 "$OUT/copy.log")"
        rm -f "$OUT/copy.log"
    ) &
    wait
    # the share of the time left for each section (BENCH_PARTS, "SECTIONS:PERCENT,..."; "decoding@N": the decoding
    # section at batch size N alone). Decoding compiles a step for each batch and length: on one H100 the section
    # took 110 s at batch 1 and 83 s at batch 64 (gpu-h100-2026-11-26), more than one part of a short loan. The
    # default runs what no GPU has measured yet: the profile of the training step, eager and compiled (where its
    # time goes), the shapes section (cuDNN's attention on batches of changing shapes) and the training step,
    # compiled, with the training loop's attention settings. Decoding (gpu-h100-2026-11-26), attention and layers
    # (gpu-h200-2026-11-26) are recorded: at most 8 files come back
    IFS=, read -r -a parts <<<"${BENCH_PARTS:-profile:30,shapes:40,training:100}"
    for part in "${parts[@]}"; do
        sections=${part%:*} limit=$(($(left) * ${part##*:} / 100))
        if [ "$limit" -lt 5 ]; then note "bench $sections: no time left"; continue; fi
        options=() name=${sections// /_}
        if [ "$sections" = training ] || [ "$sections" = profile ]; then options=(--compile); fi
        if [[ $sections == *@* ]]; then
            options=(--batch-sizes "${sections#*@}") name="${sections%@*}_batch${sections#*@}"
            sections=${sections%@*}
        fi
        rc=0
        # shellcheck disable=SC2086  # one section name per word
        timeout "$limit" "$PYTHON" -m annotated_transformer bench "${TINY[@]}" --device "$AT_DEVICE" \
            --only $sections "${options[@]}" --json "$OUT/bench_$name.json" \
            >>"$OUT/bench.log" 2>&1 || rc=$?
        note "bench $sections${options:+ ${options[*]}}: exit $rc (limit $limit s)"
    done
    rmdir "$OUT/results" 2>/dev/null || true  # a dry run's results folder, empty here
    ;;
*)
    sed -n '/^set -euo/q; 2,$p' "$0"  # the header above
    exit 2
    ;;
esac
