#!/usr/bin/env bash
# Record chapter 12's serving benchmark: start `python -m minivllm serve` with the default model
# (SmolLM2-135M-Instruct) on a free port, send it a small seeded workload with `python -m minivllm bench
# serve` (vLLM's `vllm bench serve`: TTFT, TPOT, ITL, E2EL, throughput), write
#   results/cpu_serve_<prompts>p_in<input>_out<output>_rate<rate>.json
# and stop the server. The default workload (32 prompts of 80-240 tokens, 24-72 output tokens each, all
# sent at once) takes a few minutes on 2 CPU cores; the client and the server share the cores, as a laptop
# running both would. Run it on a quiet machine: other programs are the largest source of noise on a CPU.
#
#   scripts/record_serve.sh                 # or PY=python NUM_PROMPTS=64 REQUEST_RATE=2 scripts/record_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-160}    # tokens; with RANGE_RATIO 0.5: 80-240
OUTPUT_LEN=${OUTPUT_LEN:-48}   # tokens; with RANGE_RATIO 0.5: 24-72
RANGE_RATIO=${RANGE_RATIO:-0.5}
REQUEST_RATE=${REQUEST_RATE:-inf}
STARTUP_TIMEOUT_S=${STARTUP_TIMEOUT_S:-600}
NAME=smollm2-135m-instruct
OUT=results/cpu_serve_${NUM_PROMPTS}p_in${INPUT_LEN}_out${OUTPUT_LEN}_rate${REQUEST_RATE}.json

LOG=$(mktemp -t minivllm_serve.XXXXXX)
SERVER_CMD=("$PY" -m minivllm serve --port 0 --served-model-name "$NAME")
"${SERVER_CMD[@]}" > "$LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
    kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true
    rm -f "$LOG"
}
trap stop_server EXIT

# the server prints `minivllm serve: listening on http://HOST:PORT` once it accepts connections
URL=
for _ in $(seq "$STARTUP_TIMEOUT_S"); do
    URL=$(sed -n 's|^minivllm serve: listening on \(http://[^ ]*\).*|\1|p' "$LOG" | head -n 1)
    [[ -n $URL ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited:" >&2; cat "$LOG" >&2; exit 1; }
    sleep 1
done
[[ -n $URL ]] || { echo "no listening line after ${STARTUP_TIMEOUT_S} s:" >&2; cat "$LOG" >&2; exit 1; }
echo "== server ${SERVER_CMD[*]} at $URL" >&2

mkdir -p results
"$PY" -m minivllm bench serve --base-url "$URL" --served-model-name "$NAME" --num-prompts "$NUM_PROMPTS" \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio "$RANGE_RATIO" \
    --request-rate "$REQUEST_RATE" --ignore-eos --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,90,99 --result-dir results --result-filename "$(basename "$OUT")" \
    --metadata "server_command=python -m minivllm serve --port 0 --served-model-name $NAME"
