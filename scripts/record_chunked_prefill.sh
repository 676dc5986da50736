#!/usr/bin/env bash
# Record chapter 11's comparisons (issue 22's targets), each contender beside the other in one run:
#   results/cpu_chunked_prefill_mixed.json  16 streams decoding while 2,048-token prompts arrive (MixedWorkload's
#                                          defaults): chapter 04's prefill-first engine against the default
#                                          engine with a budget of 512 tokens per step (targets: p99 ITL at most
#                                          0.5x, output tok/s at least 0.95x)
#   results/cpu_bench_ch09_vs_ch11.json     the headline workload through the default engine and chapter 09's
#                                          (chapter 04's prefill-first Scheduler) (target: at least 0.97x)
# About 2 and 4 minutes on the 2 cores of an Intel Xeon with AMX. Run it on a quiet machine: other programs
# are the largest source of noise on a CPU. THREADS=N adds `--threads N`.
#
#   scripts/record_chunked_prefill.sh            # or PY=python scripts/record_chunked_prefill.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREAD_ARGS=(${THREADS:+--threads "$THREADS"})

source scripts/record_lib.sh  # record FILE COMMAND...

record results/cpu_chunked_prefill_mixed.json "$PY" -m minivllm bench --workload mixed --mixed-budget 512 \
    "${THREAD_ARGS[@]}" --json
record results/cpu_bench_ch09_vs_ch11.json "$PY" -m minivllm bench --num-requests 64 --input-len 16 512 \
    --output-len 16 256 --compare ch09 "${THREAD_ARGS[@]}" --json
