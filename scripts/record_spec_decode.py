"""Record chapter 14's CPU figures: speculative decoding at batch 1 against plain decoding, side by side
in one process, with the default model (SmolLM2-135M-Instruct), greedy.

    python scripts/record_spec_decode.py [--out results/cpu_spec_decode.json]

* prompt lookup (`ngram`, k = 3 and 5) on an input-grounded workload (rewrite a given text with one
  change) and on free generation (target: >= 1.5x and >= 0.9x output tokens/s);
* a draft model made from the target's first 24 of 30 layers, k = 1..5 on free generation: the
  measured speedup next to Leviathan et al.'s prediction from the measured alpha (accepted drafts over
  tested ones) and draft cost c (whole-request tokens/s of the target over the draft's, each alone;
  target: within +-20 %).
Every run's tokens are compared with plain decoding's (`same_tokens`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from minivllm.benchmarks.env import environment, write_json
from minivllm.benchmarks.spec_decode import (compare_speculation, draft_from_first_layers, free_messages,
                                             predicted_speedup, rewrite_messages)
from minivllm.sampling_params import SamplingParams

NGRAM = {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                          "prompt_lookup_min": 2} for k in (3, 5)}


def strip(runs: dict) -> dict:
    return {name: {k: v for k, v in run.items() if k != "token_ids"} for name, run in runs.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/cpu_spec_decode.json")
    p.add_argument("--draft-layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    engine = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 27)
    print("rewrite workload: plain, ngram k=3, k=5", file=sys.stderr)
    rewrite = compare_speculation(rewrite_messages(), {"plain": None, **NGRAM}, SamplingParams(max_tokens=96, temperature=0), **engine)
    free_params = SamplingParams(max_tokens=64, temperature=0)
    print("free generation: plain, ngram k=3, k=5", file=sys.stderr)
    free = compare_speculation(free_messages(), {"plain": None, **NGRAM}, free_params, **engine)
    with tempfile.TemporaryDirectory() as tmp:
        draft = str(draft_from_first_layers(None, tmp, args.draft_layers))
        print(f"draft model (first {args.draft_layers} layers): alone, then k = 1..5", file=sys.stderr)
        draft_alone = compare_speculation(free_messages(), {"draft alone": None}, free_params, model=draft, **engine)
        sweep = compare_speculation(free_messages(), {"plain": None, **{f"draft k={k}": {"model": draft, "num_speculative_tokens": k}
                                                                         for k in range(1, 6)}}, free_params, **engine)
    c = sweep["plain"]["tokens_per_s"] / draft_alone["draft alone"]["tokens_per_s"]
    for k in range(1, 6):
        run = sweep[f"draft k={k}"]
        run["predicted_speedup"] = predicted_speedup(run["tested_acceptance_rate"], k, c)
        run["measured_over_predicted"] = run["speedup"] / run["predicted_speedup"]
    record = {"model": "SmolLM2-135M-Instruct (default), float32, batch 1, greedy", "threads": args.threads,
              "rewrite_ngram": strip(rewrite), "free_ngram": strip(free),
              "draft_model": {"layers": f"first {args.draft_layers} of 30", "cost_ratio_c": c, "runs": strip(sweep)},
              "targets": {"ngram_rewrite_speedup_k5": rewrite["ngram k=5"]["speedup"],
                          "ngram_free_speedup_k5": free["ngram k=5"]["speedup"],
                          "draft_measured_over_predicted": [sweep[f"draft k={k}"]["measured_over_predicted"] for k in range(1, 6)]},
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "environment": environment(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "wall_seconds": time.perf_counter() - t0}
    write_json(record, args.out)
    t = record["targets"]
    print(f"ngram k=5: rewrite {t['ngram_rewrite_speedup_k5']:.2f}x, free {t['ngram_free_speedup_k5']:.2f}x; draft "
          f"(c={c:.2f}): measured/predicted " + ", ".join(f"{x:.2f}" for x in t["draft_measured_over_predicted"]))
    same = all(r["same_tokens"] for runs in (rewrite, free, sweep) for r in runs.values())
    print("every run's tokens equal plain decoding's" if same else "WARNING: some run's tokens differ from plain decoding's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
