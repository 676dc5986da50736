#!/usr/bin/env bash
# Rerun every recorded run in results/ that chapter 09 and the README read, on this machine.
# Run it on a quiet machine (nothing else busy: other programs are the largest source of noise on a
# CPU). Each command warms up before its clock starts, so a first compile of the C++ kernel is not
# timed. About 40 minutes on the 2 cores of the recorded runs; each command prints the CPU it runs on.
#
#   scripts/record_results.sh            # or PY=python scripts/record_results.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

source scripts/record_lib.sh  # record FILE COMMAND...

HEADLINE=(--num-requests 64 --input-len 16 512 --output-len 16 256)
record results/cpu_bench_headline.json "$PY" -m minivllm bench "${HEADLINE[@]}" --compare hf --json
record results/cpu_bench_headline_hf16.json "$PY" -m minivllm bench "${HEADLINE[@]}" --compare hf --hf-batch-size 16 --json
record results/cpu_bench_headline_hf64.json "$PY" -m minivllm bench "${HEADLINE[@]}" --compare hf --hf-batch-size 64 --json
record results/cpu_bench_shared_prefix.json "$PY" -m minivllm bench "${HEADLINE[@]}" --shared-prefix 0.9 --json
"$PY" scripts/profile_engine.py --out results/cpu_profile_headline.json
"$PY" scripts/cpu_gemm_ab.py --out results/cpu_gemm_ab.json  # chapter 02's GEMM against oneDNN's, by rows
"$PY" scripts/prefill_attention_lengths.py --out results/cpu_prefill_attention_lengths.json  # chapter 05's prefill kernel, by length
"$PY" scripts/overlap_probe.py --out results/cpu_overlap_probe.json  # does this CPU overlap reads with arithmetic?
PY=$PY scripts/record_chunked_prefill.sh  # chapter 11: the mixed workload, and the headline against chapter 09's engine
"$PY" scripts/readme_figures.py  # README's figures table, from the records just written
