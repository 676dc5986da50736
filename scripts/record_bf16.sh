#!/usr/bin/env bash
# Record the bfloat16 engine path on a CPU next to float32: the same workload twice, each run with
# transformers in the same dtype in the same process (`--compare hf`), one JSON line per dtype. Each
# record names its CPU and vector extensions; on a CPU without bfloat16 instructions its `note` says
# that bfloat16 is emulated there.
#
#   scripts/record_bf16.sh                              # small workload -> results/cpu_bf16_small_{float32,bfloat16}.json
#   scripts/record_bf16.sh headline results/cpu_amx    # the README's headline workload (on a CPU with AMX or
#                                                       # AVX512-BF16) -> results/cpu_amx_headline_{float32,bfloat16}.json,
#                                                       # scripts/profile_engine.py's record of each dtype
#                                                       # -> results/cpu_amx_profile_headline_{float32,bfloat16}.json,
#                                                       # and scripts/prefill_attention_lengths.py's record
#                                                       # -> results/cpu_amx_prefill_attention_lengths.json
#
# Small: a few minutes on 2 cores without fast bfloat16. Headline: about 5 minutes per dtype where
# bfloat16 is fast (the profile another minute or two); far longer where it is emulated. Run it on a
# quiet machine: other programs are the largest source of noise on a CPU. THREADS=N adds `--threads N` (on a machine that other
# programs keep busy, THREADS=1 with OMP_NUM_THREADS=1 avoids OpenMP threads waiting on each other).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKLOAD=${1:-small}
PREFIX=${2:-results/cpu_bf16}
THREAD_ARGS=(${THREADS:+--threads "$THREADS"})

source scripts/record_lib.sh  # record FILE COMMAND...

case $WORKLOAD in
    small) ARGS=(--num-requests 8 --input-len 16 128 --output-len 16 64) ;;
    headline) ARGS=(--num-requests 64 --input-len 16 512 --output-len 16 256) ;;
    *) echo "usage: $0 [small|headline] [file prefix]" >&2; exit 2 ;;
esac
for DTYPE in float32 bfloat16; do
    record "${PREFIX}_${WORKLOAD}_${DTYPE}.json" "$PY" -m minivllm bench "${ARGS[@]}" "${THREAD_ARGS[@]}" --dtype "$DTYPE" --compare hf --json
done
if [ "$WORKLOAD" = headline ]; then  # where each dtype's time goes, attention against its bound included
    for DTYPE in float32 bfloat16; do
        "$PY" scripts/profile_engine.py "${ARGS[@]}" "${THREAD_ARGS[@]}" --dtype "$DTYPE" \
            --out "${PREFIX}_profile_${WORKLOAD}_${DTYPE}.json"
    done
    # the prefill kernels alone against the same FLOP bound, by sequence length (a few seconds)
    "$PY" scripts/prefill_attention_lengths.py "${THREAD_ARGS[@]}" --out "${PREFIX}_prefill_attention_lengths.json"
fi
