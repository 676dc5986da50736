"""Record chapter 15's CPU figures: the cost of structured outputs with the default model (SmolLM2-135M-Instruct),
constrained and plain runs side by side in one process.

    python scripts/record_structured_output.py [--out results/cpu_structured_output.json]

* decode step with 8 constrained requests (a JSON schema) against the same 8 unconstrained (target:
  <= 10 % overhead), runs interleaved, median of full-batch decode steps;
* grammar compilation per request against a request's end-to-end time (target: <= 5 %), and the
  one-off tokenizer conversion;
* how often the model's JSON parses and matches a schema, free and constrained (temperature 0.7).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jsonschema
import torch

from minivllm.benchmarks.env import environment, write_json
from minivllm.benchmarks.structured_output import structured_output_cost
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams

PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton", "Frida Kahlo",
          "Nelson Mandela", "Rosalind Franklin"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def valid(text: str) -> tuple[bool, bool]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, SCHEMA)
        return True, True
    except jsonschema.ValidationError:
        return True, False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/cpu_structured_output.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes=1 << 27, seed=0)
    manager = llm.llm_engine.scheduler.structured_output_manager
    t = time.perf_counter()
    llm.generate("Hi", SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json_object=True)),
                 use_tqdm=False)
    first_request_s = time.perf_counter() - t
    print("cost: 8 constrained vs 8 plain requests", file=sys.stderr)
    cost = structured_output_cost(llm, [f"Tell a story about {p}." for p in PEOPLE], max_tokens=64, repeats=args.repeats)
    prompts = [[{"role": "user", "content": f"Give {p}'s name and age at death as a JSON object with keys \"name\" "
                                            "and \"age\". Answer with JSON only."}] for p in PEOPLE]
    parse = {}
    for name, so in (("free", None), ("constrained", StructuredOutputsParams(json=SCHEMA))):
        outs = llm.chat(prompts, SamplingParams(temperature=0.7, max_tokens=48, seed=1, structured_outputs=so), use_tqdm=False)
        checks = [valid(o.outputs[0].text) for o in outs]
        parse[name] = {"parses": sum(a for a, _ in checks), "matches_schema": sum(b for _, b in checks), "of": len(checks)}
    record = {"model": "SmolLM2-135M-Instruct (default), float32", "threads": args.threads,
              "backend": "llguidance", "cost": cost, "json_parse": parse,
              "first_structured_request_s": first_request_s, "first_compile_with_tokenizer_conversion_ms": 1e3 * manager.compile_seconds,
              "targets": {"step_overhead": cost["step_overhead"], "setup_share": cost["setup_share"]},
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "environment": environment(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "wall_seconds": time.perf_counter() - t0}
    write_json(record, args.out)
    print(f"decode step overhead {cost['step_overhead']:+.1%} (8 constrained vs 8 plain), grammar setup "
          f"{cost['setup_share']:.3%} of a request's end-to-end time; JSON parses free {parse['free']['parses']}/8, "
          f"constrained {parse['constrained']['parses']}/8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
