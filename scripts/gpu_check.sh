#!/usr/bin/env bash
# The GPU check: every test marked `gpu`, then chapter 09's speedup ladder on Qwen3-0.6B (its config
# shipped in minivllm/model_configs/, dummy bfloat16 weights, nothing downloaded), 256 requests with
# prompt and output lengths uniform in 100-1024, EOS ignored, against transformers' generate; then
# chapter 11's mixed workload on the same model (16 streams decoding while 2,048-token prompts arrive:
# prefill-first against a budget of 512 tokens per step).
#
#   scripts/gpu_check.sh [OUT_DIR]            # OUT_DIR, else $OUT, else results/
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  # the same stages on a CPU with a tiny model, to check the
#                                             # script (OUT_DIR, else $OUT, else a fresh temporary folder)
#
# It runs from the repository root with the machine's own Python (PY; default `python`, else
# `python3`) and installs nothing: PYTHONPATH=. makes the package importable without installing it.
# Chapter 15's GPU test needs llguidance and skips without it: on a machine that cannot reach PyPI, install its
# wheel first (`pip install --no-deps --target DIR llguidance-*.whl`, DIR on PYTHONPATH, which is kept).
# Each stage has a wall-clock cap (PYTEST_CAP, BENCH_CAP, MIXED_CAP, GRAPHS_CAP seconds; defaults 180,
# 230, 90 and 75, so the whole check stays under 10 minutes; the gpu tests took 115 s on an H200;
# LADDER_TIME_LIMIT, default 35, caps each rung of the ladder in seconds), and the ladder rewrites its
# JSON record after every rung, so a stage stopped by its cap still leaves what it finished. STAGES chooses the
# stages (default "pytest ladder mixed graphs").
# Files written into OUT_DIR:
#   gpu_check.log          everything below, in order
#   gpu_pytest.log/.xml    the gpu tests' output and their JUnit XML
#   gpu_bench_ladder.json  the ladder's record (hardware, versions, date, exact command, figures)
#   gpu_bench_ladder.log   the ladder's progress and report
#   gpu_bench_mixed.json   chapter 11's mixed workload: p99/median ITL, mean TTFT, output tok/s, ratios
#   gpu_bench_mixed.log    its progress and report
#   gpu_cuda_graphs.json   chapter 08's decode-step times: eager, graphs, graphs + compiled small ops
#   gpu_cuda_graphs.log    its output
#   gpu_check.json         each stage's command, exit status and seconds; the tests' counts; the ladder's and
#                          the mixed workload's summaries
# and with STAGES naming `profile` (not a default stage: about 3 minutes more; its cap PROFILE_CAP, default 240),
#   gpu_profile_latest.json/.log  scripts/gpu_profile.py's parts of a step (the default runner), compiled modules
#                          against eager, and the default, plain-graph and compiled runners end to end
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python || command -v python3)}
DRY_RUN=0
if [[ ${1:-} == --dry-run ]]; then
    DRY_RUN=1
    shift
fi
if ((DRY_RUN)); then
    OUT_DIR=${1:-${OUT:-$(mktemp -d)}}
else
    OUT_DIR=${1:-${OUT:-results}}
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MINIVLLM_CACHE=${MINIVLLM_CACHE:-${TMPDIR:-/tmp}/minivllm-gpu-check}  # the dummy model's folder
PYTEST_CAP=${PYTEST_CAP:-180}
BENCH_CAP=${BENCH_CAP:-230}
MIXED_CAP=${MIXED_CAP:-90}
GRAPHS_CAP=${GRAPHS_CAP:-75}
STAGES_TO_RUN=" ${STAGES:-pytest ladder mixed graphs} "
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"
DONE_STAGES=()  # name<TAB>exit status<TAB>seconds<TAB>cap<TAB>command, one per stage

stage() {  # stage NAME CAP LOGFILE COMMAND...: run COMMAND under `timeout CAP`, its output to LOGFILE and the log
    local name=$1 cap=$2 logfile=$3
    shift 3
    echo "== $name (cap ${cap} s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=15 "$cap" "$@" 2>&1 | tee "$logfile" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    ((rc == 124 || rc == 137)) && echo "== $name: stopped by its cap after ${took} s" | tee -a "$LOG"
    echo "== $name: exit status $rc after ${took} s" | tee -a "$LOG"
    local cmdline="$*"
    cmdline=${cmdline//$'\n'/ }  # one line per stage (a `python -c` program spans several)
    DONE_STAGES+=("$name"$'\t'"$rc"$'\t'"$took"$'\t'"$cap"$'\t'"$cmdline")
}

{
    echo "minivllm GPU check$( ((DRY_RUN)) && echo ' (dry run: CPU, tiny model)'), $(date -u +%FT%TZ)"
    echo "into $OUT_DIR"
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
} 2>&1 | tee -a "$LOG"
if ((!DRY_RUN)) && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "no CUDA device here: run scripts/gpu_check.sh --dry-run to check the script on a CPU" | tee -a "$LOG"
    exit 1
fi

if [[ $STAGES_TO_RUN == *" pytest "* ]]; then
    # only the test files that mark tests `gpu` (a decorator or a parameter's marks, not a string that writes
    # one): the others import packages the GPU image lacks (nbformat, llguidance)
    mapfile -t GPU_TESTS < <(grep -lE '^\s*@?pytest\.mark\.gpu\b' tests/test_*.py)
    stage pytest "$PYTEST_CAP" "$OUT_DIR/gpu_pytest.log" \
        "$PY" -m pytest -m gpu "${GPU_TESTS[@]:-tests/}" -q -rA --durations=15 -p no:cacheprovider \
        --continue-on-collection-errors --junitxml="$OUT_DIR/gpu_pytest.xml"
fi

if ((DRY_RUN)); then
    # the dry run checks this script, not chapter 05's C++ kernel: no compilation inside a capped stage
    export MINIVLLM_CPU_KERNEL=0
    MODEL_CONFIG=$OUT_DIR/tiny_qwen3_config.json
    "$PY" -c 'import sys; from minivllm.course.testing import tiny_config
tiny_config("qwen3", tie_word_embeddings=True).to_json_file(sys.argv[1], use_diff=False)' "$MODEL_CONFIG"
    LADDER=(--model-config "$MODEL_CONFIG" --dtype float32 --device cpu --num-requests 6 --input-len 4 24
            --output-len 2 8 --hf-batch-size 6 --time-limit 30)
    MIXED=(--model-config "$MODEL_CONFIG" --dtype float32 --device cpu --mixed-num-decoding 3
           --mixed-decode-output-len 12 --mixed-num-long 2 --mixed-long-input-len 64 --mixed-long-output-len 2
           --mixed-first-arrival-step 2 --mixed-arrival-every 4 --mixed-budget 16)
else
    LADDER=(--model-config qwen3-0.6b --dtype bfloat16 --num-requests 256 --input-len 100 1024
            --output-len 100 1024 --hf-batch-size 256 --time-limit "${LADDER_TIME_LIMIT:-35}")
    MIXED=(--model-config qwen3-0.6b --dtype bfloat16 --mixed-budget 512)  # MixedWorkload's defaults
fi
if [[ $STAGES_TO_RUN == *" ladder "* ]]; then
    stage ladder "$BENCH_CAP" "$OUT_DIR/gpu_bench_ladder.log" \
        "$PY" -m minivllm bench --ladder "${LADDER[@]}" --compare hf --output-json "$OUT_DIR/gpu_bench_ladder.json"
fi

if [[ $STAGES_TO_RUN == *" mixed "* ]]; then
    stage mixed "$MIXED_CAP" "$OUT_DIR/gpu_bench_mixed.log" \
        "$PY" -m minivllm bench --workload mixed "${MIXED[@]}" --output-json "$OUT_DIR/gpu_bench_mixed.json"
fi

if [[ $STAGES_TO_RUN == *" profile "* ]]; then
    PROFILE_ARGS=(--time-limit 25 --stages parts,modules,compiled)
    ((DRY_RUN)) && PROFILE_ARGS=(--dry-run --time-limit 10 --stages parts,modules,compiled)
    stage profile "${PROFILE_CAP:-240}" "$OUT_DIR/gpu_profile_latest.log" \
        "$PY" scripts/gpu_profile.py "${PROFILE_ARGS[@]}" --out "$OUT_DIR/gpu_profile_latest.json"
fi

if [[ $STAGES_TO_RUN == *" graphs "* ]]; then
    # chapter 08's measurement: decode-step times of eager, CUDA graphs, and graphs with compiled small ops
    if ((DRY_RUN)); then
        GRAPH_ARGS='dict(batch_sizes=(1, 2), context_len=16, num_steps=2, device="cpu", dtype=torch.float32)'
    else
        GRAPH_ARGS='dict()'
    fi
    stage graphs "$GRAPHS_CAP" "$OUT_DIR/gpu_cuda_graphs.log" "$PY" -c '
import json, sys, torch
from minivllm.benchmarks.env import write_json
from minivllm.benchmarks.decode_step import decode_step_benchmark
result = decode_step_benchmark(**eval(sys.argv[2]))
result["command"] = sys.argv[3]
write_json(result, sys.argv[1])
print(json.dumps(result, indent=1))
' "$OUT_DIR/gpu_cuda_graphs.json" "$GRAPH_ARGS" "scripts/gpu_check.sh (its graphs stage: decode_step_benchmark(**$GRAPH_ARGS))"
fi

printf '%s\n' ${DONE_STAGES[@]+"${DONE_STAGES[@]}"} | "$PY" -c '
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
from minivllm.benchmarks.env import environment, write_json
out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
stages = []
for line in filter(None, sys.stdin.read().splitlines()):
    name, rc, took, cap, command = line.split("\t", 4)
    stages.append(dict(name=name, exit_status=int(rc), seconds=int(took), cap_s=int(cap),
                       stopped_by_cap=int(rc) in (124, 137), command=command))
summary = dict(kind="gpu_check", dry_run=dry, command=" ".join(["scripts/gpu_check.sh", *(["--dry-run"] if dry else []),
               str(out)]), stages=stages, pytest=None, ladder=None, **environment())
junit = out / "gpu_pytest.xml"
if junit.is_file():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["pytest"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
record = out / "gpu_bench_ladder.json"
if record.is_file():
    r = json.loads(record.read_text())
    summary["ladder"] = dict(best_rung=r.get("best_rung"), best_tok_s=r.get("best_tok_s"), hf_ratio=r.get("hf_ratio"),
                             roofline_ratio=r.get("roofline_ratio"),
                             rungs={k: dict(status=e["status"], tok_s=e.get("tok_s")) for k, e in r["rungs"].items()},
                             hf=r["hf"] and dict(status=r["hf"]["status"], tok_s=r["hf"].get("tok_s")))
mixed = out / "gpu_bench_mixed.json"
if mixed.is_file():
    m = json.loads(mixed.read_text())
    summary["mixed"] = dict(budget=m["budget"], ratios=m["ratios"], meets_targets=m["meets_targets"],
                            **{k: {f: c[f] for f in ("p99_itl_s", "median_itl_s", "mean_ttft_s", "output_tok_s")}
                               for k, c in m["contenders"].items()})
graphs = out / "gpu_cuda_graphs.json"
if graphs.is_file():
    g = json.loads(graphs.read_text())
    summary["graphs"] = dict(batch_sizes=g["batch_sizes"], ms_per_step=g["ms_per_step"],
                             max_abs_logit_diff=g["max_abs_logit_diff"])
write_json(summary, out / "gpu_check.json")
print(json.dumps(dict(stages=[(s["name"], s["exit_status"], s["seconds"]) for s in stages], pytest=summary["pytest"],
                      ladder=summary["ladder"], mixed=summary.get("mixed"), graphs=summary.get("graphs")), indent=1))
' "$OUT_DIR" "$DRY_RUN" 2>&1 | tee -a "$LOG"

for s in "${DONE_STAGES[@]}"; do
    rc=$(cut -f2 <<<"$s")
    ((rc == 0)) || exit 1
done
exit 0
