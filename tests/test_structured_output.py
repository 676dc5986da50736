"""Chapter 15: structured outputs (JSON schemas, regexes, choices, Lark and GBNF grammars, via llguidance).

What is proved here, on a tiny random float64 Llama that carries SmolLM2's tokenizer (vocabulary 49152),
so that the grammars see a real tokenizer while a step costs milliseconds. A random model's free text is
garbage, so every output that conforms does so because of the constraint:
* validity: every output that stops validates, checked independently of llguidance where Python can
  (`jsonschema.validate`, `re.fullmatch`, choice membership) and with an llguidance matcher of our own
  (`LLMatcher` over `llguidance.hf.from_tokenizer`) for the Lark and GBNF grammars; greedy and sampled;
* oracle: greedy tokens equal transformers' `generate(do_sample=False)` with a `LogitsProcessor` that
  masks what an independent matcher disallows, constrained and unconstrained requests in one batch;
* a constraint the free greedy output already meets changes nothing; unconstrained requests beside
  constrained ones get the tokens they get alone;
* sampling under a choice follows the masked, renormalized softmax (chi-square against transformers'
  float64 logits; the same counts reject two wrong distributions);
* chunked prefill, preemption, prefix caching and n > 1 keep outputs valid and greedy tokens unchanged;
* bad constraints raise ValueError at submission and the engine goes on serving (also a hundred
  invalid requests among valid ones); a padded vocabulary's extra ids are never produced; an engine
  with speculative decoding refuses structured requests; `ignore_eos` still stops a finished choice.
Invariants (`engine_helpers.check_invariants`) are checked after every engine step.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

llguidance = pytest.importorskip("llguidance", reason="structured outputs need llguidance (pip install llguidance, "
                                                      "the `structured` extra)")
jsonschema = pytest.importorskip("jsonschema", reason="the JSON outputs are checked with jsonschema")
import llguidance.hf  # noqa: E402
from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: E402

from engine_helpers import check_invariants, hf_greedy, one_thread, run_engine  # noqa: E402
from minivllm.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from serving_helpers import TOKENIZER_FILES, make_tiny_chat_model  # noqa: E402
from spec_helpers import chi_square_pvalue  # noqa: E402

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

SO = StructuredOutputsParams
EOS = 2  # SmolLM2's <|im_end|>: its tokenizer's eos_token_id and its config's
VOCAB = 49152  # SmolLM2's tokenizer
MAX_MODEL_LEN = 256
SEEDS = (1, 2, 3)
PROMPT_TEXTS = ["Hello there", "What is the color of the sky? Answer:", "JSON please: ",
                "The quick brown fox jumps over the lazy dog and then"]

# --- the constraints -----------------------------------------------------------------------------------
# Every constraint is bounded (maxLength, maxItems, enums, bounded repeats), so an output cannot run on:
# each must end with EOS ("stop") well within MAX_TOKENS.

# The properties are listed in alphabetical order here: see test_json_properties_in_schema_order.
PERSON = {"type": "object",
          "properties": {
              "address": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 5},
                                         "floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                          "required": ["city"], "additionalProperties": False},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "kind": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"},
                                 {"type": "null"}]},
              "name": {"type": "string", "maxLength": 6},
              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
          "required": ["name", "age", "address"], "additionalProperties": False}
ITEMS = {"type": "array", "minItems": 1, "maxItems": 3,
         "items": {"type": "object",
                   "properties": {"id": {"type": "integer", "minimum": 10, "maximum": 99},
                                  "ok": {"type": "boolean"},
                                  "tag": {"enum": ["a", "b", 7, None]}},
                   "required": ["id", "ok"], "additionalProperties": False}}
ANY_OF = {"anyOf": [{"type": "integer", "minimum": -20, "maximum": 20}, {"type": "string", "maxLength": 4},
                    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]}
REGEX = r"[a-c]{2,5}"
REGEX_WORDS = r"(cat|dog|[0-9]{1,3})( (and|or) (cat|dog|[0-9]{1,3})){0,2}"
CHOICE = ["red", "green", "blue", "yellow"]
CHOICE_LONG = ["The answer is yes.", "No", "maybe, maybe not", "Ünïcödé ✓"]
# (grammar, a Python regex for the same language: the grammars are bounded, so their languages are regular)
LARK = ('start: "(" atom "," atom ")"\n'
        'atom: NUM | pair\n'
        'pair: "[" NUM ";" NUM "]"\n'
        'NUM: /[0-9]{1,2}/\n',
        r"\((\d{1,2}|\[\d{1,2};\d{1,2}\]),(\d{1,2}|\[\d{1,2};\d{1,2}\])\)")
GBNF = ('root ::= "<" word ("-" word)? ">"\n'
        'word ::= [a-d] [a-d]? [0-9]?\n',
        r"<[a-d][a-d]?[0-9]?(-[a-d][a-d]?[0-9]?)?>")

CONSTRAINTS = {
    "json-person": SO(json=PERSON, disable_any_whitespace=True),
    "json-items": SO(json=json.dumps(ITEMS), disable_any_whitespace=True),  # the schema as JSON text
    "json-anyof": SO(json=ANY_OF, disable_any_whitespace=True),
    "regex": SO(regex=REGEX),
    "regex-words": SO(regex=REGEX_WORDS),
    "choice": SO(choice=CHOICE),
    "choice-long": SO(choice=CHOICE_LONG),
    "lark": SO(grammar=LARK[0]),
    "gbnf": SO(grammar=GBNF[0]),
}
MAX_TOKENS = 160


# --- models and engines ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory):
    """(folder, transformers model): a tiny random float64 Llama (hidden 64, 2 layers) with SmolLM2's
    vocabulary, tokenizer and EOS (`serving_helpers.make_tiny_chat_model`)."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_chat_model(tmp_path_factory.mktemp("so-smol-tiny"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, model


@pytest.fixture(scope="module")
def tokenizer(smol_tiny):
    from minivllm.transformers_utils.model_files import load_tokenizer

    tok = load_tokenizer(smol_tiny[0])
    assert tok.eos_token_id == EOS and len(tok) == VOCAB
    return tok


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    """llguidance's view of the tokenizer, made here (not the engine's)."""
    return llguidance.hf.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in PROMPT_TEXTS]


def make_llm(folder, **kwargs) -> LLM:
    kwargs = {"dtype": "float64", "device": "cpu", "block_size": 4, "num_kvcache_blocks": 1024,
              "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False, "seed": 0, **kwargs}
    return LLM(str(folder), **kwargs)


@pytest.fixture(scope="module")
def llm(smol_tiny):
    """The plain engine: the default assembly (structured output scheduler and sampler), no prefix caching."""
    return make_llm(smol_tiny[0])


# --- an independent matcher and the checks -------------------------------------------------------------

def lark_of_choice(choices) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def independent_grammar(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for `so`, built here from the constraint (not with minivllm's code)."""
    M = llguidance.LLMatcher
    if so.json is not None:
        schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not so.disable_any_whitespace})
    if so.json_object:
        return M.grammar_from_json_schema('{"type": "object"}',
                                          defaults={"whitespace_flexible": not so.disable_any_whitespace})
    if so.regex is not None:
        return M.grammar_from_regex(so.regex)
    if so.choice is not None:
        return M.grammar_from_lark(lark_of_choice(so.choice))
    text = so.grammar if "::=" not in so.grammar else gbnf_to_lark(so.grammar)
    return M.grammar_from_lark(text)


def independent_matcher(ll_tok, so: StructuredOutputsParams):
    m = llguidance.LLMatcher(ll_tok, independent_grammar(so), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def allowed_ids(matcher) -> list[int]:
    """The token ids `matcher` allows next (its logit bias: nonzero where allowed)."""
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    return torch.nonzero(bias).flatten().tolist()


def check_output(so: StructuredOutputsParams, completion, ll_tok, what: str = "") -> None:
    """A finished ("stop") completion meets `so`: checked by Python (json + jsonschema, re, membership,
    the grammars' regexes), and token by token by an independent llguidance matcher that accepts its
    tokens, is accepting before the EOS and stopped after it."""
    text, ids = completion.text, list(completion.token_ids)
    where = f"{what}: {text!r} {ids}"
    assert completion.finish_reason == "stop", where
    assert ids and ids[-1] == EOS, where
    assert all(0 <= t < VOCAB for t in ids), where
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        jsonschema.validate(json.loads(text), schema)
        if so.disable_any_whitespace:  # no whitespace outside the strings
            assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), where
    elif so.json_object:
        assert isinstance(json.loads(text), dict), where
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), where
    elif so.choice is not None:
        assert text in so.choice, where
    else:
        python_regex = {LARK[0]: LARK[1], GBNF[0]: GBNF[1]}[so.grammar]
        assert re.fullmatch(python_regex, text), where
    m = independent_matcher(ll_tok, so)
    for i, t in enumerate(ids[:-1]):
        assert m.consume_token(t), f"{where}: token {i} ({t}) refused"
    assert m.is_accepting(), f"{where}: incomplete"
    assert m.consume_token(EOS) and m.is_stopped(), where


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def sampled(seed, max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, **kw)


# --- 1. every output that stops validates ----------------------------------------------------------------

@pytest.fixture(scope="module")
def validity_outputs(llm, prompts):
    """One batch: every constraint greedy on every prompt and sampled with three seeds (on the prompts in
    turn), with unconstrained requests."""
    cases, params = [], []
    for k, (name, so) in enumerate(CONSTRAINTS.items()):
        for i, _ in enumerate(prompts):
            cases.append((name, i, None))
            params.append(greedy(structured_outputs=so))
        for j, seed in enumerate(SEEDS):
            cases.append((name, (k + j) % len(prompts), seed))
            params.append(sampled(seed, structured_outputs=so))
    all_prompts = [prompts[i] for _, i, _ in cases] + prompts
    params += [greedy(max_tokens=12)] * len(prompts)
    outs = run_engine(llm.llm_engine, all_prompts, params)
    return cases, outs[:len(cases)], outs[len(cases):]


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_output_validates(name, validity_outputs, ll_tokenizer):
    cases, outs, _ = validity_outputs
    so = CONSTRAINTS[name]
    checked = 0
    for (n, i, seed), out in zip(cases, outs):
        if n == name:
            check_output(so, out.outputs[0], ll_tokenizer, f"{name} prompt {i} seed {seed}")
            checked += 1
    assert checked == len(PROMPT_TEXTS) + len(SEEDS)


def test_constraint_changes_free_output(validity_outputs):
    """The control: without a constraint the tiny model's text meets none of them (so the tests above test
    the constraint, not the model)."""
    _, _, free = validity_outputs
    for out in free:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "length"
        assert not re.fullmatch(REGEX, text) and text not in CHOICE
        with pytest.raises(ValueError):
            json.loads(text)


def test_sampled_outputs_differ(validity_outputs):
    """Seeds give different outputs (the sampled runs explore the grammar, not one path)."""
    cases, outs, _ = validity_outputs
    for name in ("json-person", "regex", "lark"):
        texts = {out.outputs[0].text for (n, _, seed), out in zip(cases, outs) if n == name and seed is not None}
        assert len(texts) > 2, (name, texts)


def test_json_object_and_whitespace(llm, prompts, ll_tokenizer):
    """json_object=True gives a JSON object; disable_any_whitespace=False lets whitespace in (the random
    model then fills it with whitespace: such outputs may run to max_tokens, and each is a valid prefix)."""
    params = [sampled(s, max_tokens=60, structured_outputs=SO(json_object=True, disable_any_whitespace=True))
              for s in range(8)]
    params += [greedy(max_tokens=40, structured_outputs=SO(json={"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a"], "additionalProperties": False}))]
    outs = run_engine(llm.llm_engine, [prompts[i % len(prompts)] for i in range(len(params))], params)
    stopped = 0
    for p, out in zip(params, outs):
        c = out.outputs[0]
        so = p.structured_outputs
        if c.finish_reason == "stop":
            check_output(so, c, ll_tokenizer, "json_object")
            stopped += 1
        else:  # cut by max_tokens: a prefix the grammar accepts
            assert c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
            m = independent_matcher(ll_tokenizer, so)
            assert all(m.consume_token(t) for t in c.token_ids), c
    assert stopped >= 1
    flexible = outs[-1].outputs[0].text
    assert re.search(r"\s", flexible), flexible  # whitespace is allowed and the random model takes it


def test_json_properties_in_schema_order(llm, prompts, ll_tokenizer):
    """The properties come in the order the schema lists them (llguidance's rule, and so vLLM's): a
    schema that asks for "name" before "age" gets "name" first, whether given as a dict or as JSON text.
    (The model answers in that order: with SmolLM2, forcing "age" first makes it guess an age before it
    has written whose.)"""
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 5},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99},
                             "city": {"enum": ["Oslo", "Rome"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    constraints = [SO(json=schema, disable_any_whitespace=True),
                   SO(json=json.dumps(schema), disable_any_whitespace=True)]
    params = [greedy(structured_outputs=so) for so in constraints] + \
        [sampled(s, structured_outputs=constraints[s % 2]) for s in SEEDS]
    outs = run_engine(llm.llm_engine, [prompts[k % len(prompts)] for k in range(len(params))], params)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        check_output(p.structured_outputs, c, ll_tokenizer, "schema order")
        assert list(json.loads(c.text, object_pairs_hook=lambda pairs: [k for k, _ in pairs])) == \
            ["name", "age", "city"], c.text


# --- 2. oracle: transformers' generate with an independent mask ---------------------------------------

class GrammarMask:
    """A transformers `LogitsProcessor` (batch of one): -inf on every token an independent llguidance
    matcher disallows after the tokens generated so far."""

    def __init__(self, ll_tok, so, prompt_len: int):
        self.matcher, self.prompt_len, self.fed = independent_matcher(ll_tok, so), prompt_len, 0

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len:].tolist()
        for t in new[self.fed:]:
            assert self.matcher.consume_token(t)
        self.fed = len(new)
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        allowed[allowed_ids(self.matcher)] = True
        return scores.masked_fill(~allowed, float("-inf"))


@torch.inference_mode()
def hf_constrained_greedy(model, ll_tok, prompt, so, max_new_tokens: int) -> list[int]:
    from transformers import LogitsProcessor, LogitsProcessorList

    mask = GrammarMask(ll_tok, so, len(prompt))
    proc = type("GrammarLogitsProcessor", (LogitsProcessor,), {"__call__": lambda self, i, s: mask(i, s)})()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=EOS,
                         pad_token_id=EOS, logits_processor=LogitsProcessorList([proc]))
    return out[0, len(prompt):].tolist()


ORACLE_CONSTRAINTS = ["regex", "regex-words", "choice", "choice-long", "json-items", "json-person", "gbnf"]


def test_greedy_equals_transformers(llm, smol_tiny, prompts, ll_tokenizer):
    _, model = smol_tiny
    cases = [(name, i) for name in ORACLE_CONSTRAINTS for i in range(3)] + [(None, i) for i in range(len(prompts))]
    params = [greedy(structured_outputs=CONSTRAINTS[n]) if n else greedy(max_tokens=10) for n, _ in cases]
    outs = run_engine(llm.llm_engine, [prompts[i] for _, i in cases], params)
    for (name, i), p, out in zip(cases, params, outs):
        ids = list(out.outputs[0].token_ids)
        if name is None:
            expected = hf_greedy(model, prompts[i], p.max_tokens, eos_token_id=EOS)
        else:
            expected = hf_constrained_greedy(model, ll_tokenizer, prompts[i], CONSTRAINTS[name], p.max_tokens)
            assert expected[-1] == EOS, (name, i, expected)  # transformers stopped on EOS, as the engine
        assert ids == expected, (name, i)


def test_mask_changes_transformers_greedy(smol_tiny, prompts, ll_tokenizer):
    """The control for the oracle: transformers' greedy tokens under the mask differ from its free ones."""
    _, model = smol_tiny
    free = hf_greedy(model, prompts[0], 6, eos_token_id=EOS)
    assert hf_constrained_greedy(model, ll_tokenizer, prompts[0], CONSTRAINTS["regex"], 6)[:6] != free


# --- 3. a constraint that the free output already meets changes nothing --------------------------------

FREE_CANDIDATES = ["Hello", "The sky is", "Once upon a time", "My name is", "1, 2, 3,", "Paris is the capital of",
                   "Dear John,", "In 1999 we", "def main():", "The results show that", "Water boils at",
                   "She said that", "Red, green and", "Tomorrow I will", "The cat sat on the", "Hi!"]


@pytest.fixture(scope="module")
def free_greedy(llm, tokenizer):
    """(prompt, free greedy token ids, their text) for the candidate prompts whose 6 free greedy tokens are
    plain text in the tokenizer's own (canonical) tokenization: when a grammar leaves one way on,
    llguidance allows only the canonical tokens of the forced text, so only such an output can come out
    unchanged under a constraint that spells it out."""
    prompts = [tokenizer.encode(t) for t in FREE_CANDIDATES]
    outs = run_engine(llm.llm_engine, prompts, greedy(max_tokens=6))
    found = []
    for prompt, out in zip(prompts, outs):
        ids, text = list(out.outputs[0].token_ids), out.outputs[0].text
        assert len(ids) == 6 and EOS not in ids
        if text.strip() and "\ufffd" not in text and tokenizer.encode(text) == ids:
            found.append((prompt, ids, text))
    assert len(found) >= 2, "too few prompts with a plain-text free greedy output"
    return found[:4]


def test_conforming_constraint_changes_nothing(llm, free_greedy):
    """A constraint that the free greedy output meets: a choice of it (or it with "!" after it, or some
    other text), a regex of exactly it, and a loose regex (a class of its characters, repeated) give the
    same tokens; the first two then end it (only EOS is left)."""
    params, ps = [], []
    for prompt, ids, text in free_greedy:
        chars = "".join(sorted(set(text)))
        params += [greedy(max_tokens=20, structured_outputs=SO(choice=[text, text + "!", "zzz"])),
                   greedy(max_tokens=20, structured_outputs=SO(regex=re.escape(text))),
                   greedy(max_tokens=6, structured_outputs=SO(regex=f"[{re.escape(chars)}]+"))]
        ps += [prompt] * 3
    outs = run_engine(llm.llm_engine, ps, params)
    for k, (prompt, ids, text) in enumerate(free_greedy):
        choice, exact, loose = (o.outputs[0] for o in outs[3 * k: 3 * k + 3])
        assert list(choice.token_ids)[:6] == ids and choice.text in (text, text + "!"), (text, choice)
        assert list(exact.token_ids) == ids + [EOS] and exact.text == text and exact.finish_reason == "stop"
        assert list(loose.token_ids) == ids and loose.finish_reason == "length", (text, loose)


def test_unconstrained_unchanged_beside_constrained(llm, prompts):
    """Free requests (greedy and seeded) alone, then in a batch where constrained requests sit between
    them (the sampler masks rows of the batch, not the batch)."""
    free = [greedy(max_tokens=12), sampled(7, max_tokens=12), greedy(max_tokens=12), sampled(8, max_tokens=12)]
    alone = run_engine(llm.llm_engine, prompts, free)
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(free):
        mixed_prompts += [prompts[i], prompts[i]]
        mixed_params += [greedy(structured_outputs=CONSTRAINTS["regex-words"]), p]
    mixed = run_engine(llm.llm_engine, mixed_prompts + prompts[:1],
                       mixed_params + [sampled(9, structured_outputs=CONSTRAINTS["json-items"])])
    for a, m in zip(alone, mixed[1::2]):
        assert list(a.outputs[0].token_ids) == list(m.outputs[0].token_ids)


# --- 4. sampling under a choice follows the masked, renormalized softmax -------------------------------

CHI_CHOICE = ["red", "green", "blue", "yellow"]  # each one token in SmolLM2's vocabulary
CHI_TEMPERATURE = 0.3  # the tiny model's logits are close together; this spreads the distribution out
CHI_REQUESTS, CHI_N = 10, 100  # 1000 first tokens (the controls fail with p < 1e-20 at this size)


def test_choice_sampling_distribution(llm, smol_tiny, prompts, tokenizer, ll_tokenizer):
    _, model = smol_tiny
    so = SO(choice=CHI_CHOICE)
    assert all(len(tokenizer.encode(c)) == 1 for c in CHI_CHOICE)
    allowed = allowed_ids(independent_matcher(ll_tokenizer, so))
    # llguidance lets a choice be spelled in any tokenization: its prefixes ("r", "re", "gre", ...) too
    assert set(tokenizer.encode(c)[0] for c in CHI_CHOICE) < set(allowed) and EOS not in allowed
    prompt = prompts[1]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].to(torch.float64)
    probs = (logits[allowed] / CHI_TEMPERATURE).softmax(-1)
    params = [SamplingParams(n=CHI_N, temperature=CHI_TEMPERATURE, seed=1000 * r, max_tokens=1,
                             structured_outputs=so) for r in range(CHI_REQUESTS)]
    outs = run_engine(llm.llm_engine, [prompt] * CHI_REQUESTS, params)
    firsts = [c.token_ids[0] for o in outs for c in o.outputs]
    assert len(firsts) == CHI_REQUESTS * CHI_N
    assert set(firsts) <= set(allowed), sorted(set(firsts) - set(allowed))
    counts = torch.tensor([firsts.count(t) for t in allowed], dtype=torch.float64)
    total = float(counts.sum())
    p, dof = chi_square_pvalue(counts, probs * total)
    assert p > 1e-4, (p, dof, counts.tolist(), (probs * total).tolist())
    # controls: the same counts reject uniform over the allowed tokens, and the softmax without temperature
    uniform = torch.full_like(probs, total / len(allowed))
    assert chi_square_pvalue(counts, uniform)[0] < 1e-6
    no_temperature = logits[allowed].softmax(-1) * total
    assert chi_square_pvalue(counts, no_temperature)[0] < 1e-6


# --- 5. chunked prefill, preemption, prefix caching, n > 1 ------------------------------------------------

SCENARIOS = {
    # 8 tokens a step, at most 5 per prompt chunk: every prompt (10-40 tokens) is cut into chunks
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4, long_prefill_token_threshold=5),
    # 40 blocks of 4 = 160 tokens: the longest sequence fits alone, the batch does not
    "preemption": dict(num_kvcache_blocks=40, max_model_len=160),
    # the prompts share a 24-token prefix (6 blocks)
    "prefix_caching": dict(enable_prefix_caching=True),
}
SCENARIO_CONSTRAINTS = ["json-items", "regex-words", "choice-long", "lark", "gbnf", None]


@pytest.fixture(scope="module")
def scenario_case(prompts, tokenizer):
    """(prompts, params, constraint names): 12 greedy requests, 8 prompts of which 4 share 24 tokens."""
    shared = tokenizer.encode("You are a helpful assistant. Answer in exactly the format you are given, and say "
                              "nothing else at all, not one word:")
    assert len(shared) >= 24
    ps = [shared[:24] + p for p in prompts] + prompts
    names = [SCENARIO_CONSTRAINTS[k % len(SCENARIO_CONSTRAINTS)] for k in range(12)]
    params = [greedy(max_tokens=100, structured_outputs=CONSTRAINTS[n]) if n else greedy(max_tokens=30)
              for n in names]
    return [ps[k % len(ps)] for k in range(12)], params, names


@pytest.fixture(scope="module")
def scenario_reference(llm, scenario_case):
    ps, params, _ = scenario_case
    return run_engine(llm.llm_engine, ps, params)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenarios_keep_greedy_and_validity(scenario, smol_tiny, scenario_case, scenario_reference, ll_tokenizer):
    ps, params, names = scenario_case
    engine = make_llm(smol_tiny[0], **SCENARIOS[scenario]).llm_engine
    outs = run_engine(engine, ps, params)
    for name, p, ref, out in zip(names, params, scenario_reference, outs):
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids), (scenario, name)
        if name is not None:
            check_output(p.structured_outputs, out.outputs[0], ll_tokenizer, f"{scenario} {name}")
    if scenario == "chunked":
        assert max(map(len, ps)) > 8 and max(s.num_tokens for s in engine.core.stats) <= 8
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if scenario == "prefix_caching":
        assert sum(o.num_cached_tokens for o in outs) >= 20
    # sampled requests, with n = 3 completions each, are valid too
    so_names = [n for n in SCENARIO_CONSTRAINTS if n]
    sampled_params = [SamplingParams(n=3, temperature=1.0, seed=50 + k, max_tokens=MAX_TOKENS,
                                     structured_outputs=CONSTRAINTS[n]) for k, n in enumerate(so_names)]
    outs = run_engine(engine, ps[:len(so_names)], sampled_params)
    for name, out in zip(so_names, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            check_output(CONSTRAINTS[name], c, ll_tokenizer, f"{scenario} n=3 {name}")


def test_n_completions_each_valid(llm, prompts, ll_tokenizer):
    """n > 1: each completion has a matcher of its own (one shared would refuse the others' tokens)."""
    names = ["json-person", "regex-words", "choice", "lark", "gbnf"]
    params = [SamplingParams(n=3, temperature=1.0, seed=20 + k, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS[n]) for k, n in enumerate(names)]
    outs = run_engine(llm.llm_engine, [prompts[k % len(prompts)] for k in range(len(names))], params)
    for name, out in zip(names, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            check_output(CONSTRAINTS[name], c, ll_tokenizer, f"n=3 {name}")
        if name != "choice":
            assert len({c.text for c in out.outputs}) > 1, (name, [c.text for c in out.outputs])


# --- 6. bad input at submission -----------------------------------------------------------------------------

INVALID_AT_SUBMISSION = {  # constraints that construct, but do not compile: refused by the engine
    "regex (ab": lambda: SO(regex="(ab"),
    "regex backreference": lambda: SO(regex=r"(a)\1"),
    "json type nonsense": lambda: SO(json={"type": "nonsense"}),
    "json minimum > maximum": lambda: SO(json={"type": "integer", "minimum": 5, "maximum": 3}),
    "json minLength > maxLength": lambda: SO(json={"type": "string", "minLength": 5, "maxLength": 3}),
    "json empty enum": lambda: SO(json={"enum": []}),
    "lark unknown rule": lambda: SO(grammar="start: foo"),
    "gbnf unknown rule": lambda: SO(grammar='root ::= "a" foo'),
}
INVALID_AT_CONSTRUCTION = {  # refused by StructuredOutputsParams (or SamplingParams) itself
    'json=""': dict(json=""),
    "json not JSON": dict(json="{not json"),
    "json a list": dict(json="[1, 2]"),
    "json_object=False": dict(json_object=False),
    "choice []": dict(choice=[]),
    "choice not strings": dict(choice=["a", 1]),
    'grammar ""': dict(grammar=""),
    "grammar blank": dict(grammar="  \n"),
    "two constraints": dict(regex="a", choice=["a"]),
    "none": dict(),
    "structural_tag": dict(structural_tag='{"type": "structural_tag"}'),
}


@pytest.mark.parametrize("case", list(INVALID_AT_SUBMISSION))
def test_invalid_constraint_refused_at_submission(case, llm, prompts):
    so = INVALID_AT_SUBMISSION[case]()
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="structured_outputs|GBNF"):
        engine.add_request(None, prompts[0], greedy(structured_outputs=so))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError):  # LLM.generate: nothing is queued
        llm.generate(prompts[:2], [greedy(max_tokens=3), greedy(structured_outputs=so)], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    out = llm.generate(prompts[:1], greedy(structured_outputs=CONSTRAINTS["choice"]), use_tqdm=False)
    assert out[0].outputs[0].text in CHOICE


@pytest.mark.parametrize("case", list(INVALID_AT_CONSTRUCTION))
def test_invalid_constraint_refused_at_construction(case):
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs=SO(**INVALID_AT_CONSTRUCTION[case]))


def test_guided_decoding_and_wrong_types_refused(llm, prompts):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    p = greedy()
    p.structured_outputs = {"choice": ["a"]}  # set after the checks: checked again at submission
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.llm_engine.add_request(None, prompts[0], p)
    assert not llm.llm_engine.has_unfinished_requests()


def test_hundred_invalid_among_valid(llm, prompts, ll_tokenizer):
    engine = llm.llm_engine
    bad = list(INVALID_AT_SUBMISSION.values())
    valid_names = list(CONSTRAINTS)[:9] + ["choice"]
    valid_ids, refused = {}, 0
    for k in range(110):
        if k % 11 == 5:  # 10 valid requests among 100 invalid ones
            name = valid_names[len(valid_ids)]
            rid = engine.add_request(None, prompts[k % len(prompts)], sampled(k, structured_outputs=CONSTRAINTS[name]))
            valid_ids[rid] = name
        else:
            with pytest.raises(ValueError):
                engine.add_request(None, prompts[k % len(prompts)], greedy(structured_outputs=bad[k % len(bad)]()))
            refused += 1
    assert refused == 100 and len(valid_ids) == 10
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_invariants(engine)
    assert set(done) == set(valid_ids)
    for rid, name in valid_ids.items():
        check_output(CONSTRAINTS[name], done[rid].outputs[0], ll_tokenizer, f"among invalid: {name}")


# --- 7. a vocabulary padded past the tokenizer's ------------------------------------------------------------

PAD = 64


@pytest.fixture(scope="module")
def padded_llm(tmp_path_factory):
    """The tiny model with 64 more output ids than the tokenizer has (as real checkpoints pad theirs to a
    multiple of 64 or 128), their output weights made large (+-5 times a unit vector of the first 32
    hidden dimensions, a final hidden state has entries of order 1) so that they win every free argmax."""
    from minivllm.course.testing import make_tiny_model
    from minivllm.transformers_utils.model_files import resolve_model

    folder, source = tmp_path_factory.mktemp("so-padded"), resolve_model(None)
    model = make_tiny_model(folder, "llama", seed=3, vocab_size=VOCAB + PAD, bos_token_id=1, eos_token_id=EOS)
    with torch.no_grad():
        w = model.lm_head.weight
        eye = torch.eye(PAD // 2, model.config.hidden_size, dtype=w.dtype)
        w[VOCAB:] = 5.0 * torch.cat([eye, -eye])  # the best padded logit is 5 max_k |h_k|: far above the rest
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return make_llm(folder)


def test_padded_vocab_never_produced(padded_llm, prompts, ll_tokenizer):
    engine = padded_llm.llm_engine
    # the control: free decoding does produce the padded ids
    free = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=5, detokenize=False))
    assert all(t >= VOCAB for o in free for t in o.outputs[0].token_ids)
    names = ["json-items", "regex-words", "choice", "lark", "gbnf"]
    cases = [(n, seed) for n in names for seed in (None, 1, 2)]
    params = [greedy(structured_outputs=CONSTRAINTS[n]) if s is None else sampled(s, structured_outputs=CONSTRAINTS[n])
              for n, s in cases]
    outs = run_engine(engine, [prompts[k % len(prompts)] for k in range(len(cases))], params)
    for (name, seed), out in zip(cases, outs):
        check_output(CONSTRAINTS[name], out.outputs[0], ll_tokenizer, f"padded {name} {seed}")  # ids < VOCAB


# --- 8. speculative decoding refuses structured requests ------------------------------------------------

def test_speculative_engine_refuses_structured(smol_tiny, prompts):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = make_llm(smol_tiny[0], speculative_config=spec, num_kvcache_blocks=256)
    engine = llm.llm_engine
    for so in (CONSTRAINTS["choice"], CONSTRAINTS["json-items"]):
        with pytest.raises(ValueError, match="structured_outputs does not work with speculative decoding"):
            engine.add_request(None, prompts[0], greedy(structured_outputs=so))
    assert not engine.has_unfinished_requests()
    out = llm.generate(prompts[:1], greedy(max_tokens=4), use_tqdm=False)  # it goes on serving
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_grammar_that_fails_while_generating_aborts_its_request_with_the_reason(llm, prompts):
    """3,000 choices compile, but llguidance refuses the first token (a row of its lexer's table is longer
    than it allows): that request ends "abort", a warning gives llguidance's reason (the output cannot
    carry it), and the request beside it in the batch finishes as it would alone."""
    so = StructuredOutputsParams(choice=[f"option{i}" for i in range(3000)])
    reason = r"request \S+ is aborted: its grammar refused token \d+: [^\n]+$"  # llguidance's reason, one line
    with pytest.warns(UserWarning, match=reason):
        outs = run_engine(llm.llm_engine, prompts[:2], [greedy(max_tokens=8, structured_outputs=so), greedy(max_tokens=4)])
    assert outs[0].outputs[0].finish_reason == "abort", outs[0].outputs[0]
    alone = run_engine(llm.llm_engine, prompts[1:2], greedy(max_tokens=4))
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


# --- 9. ignore_eos with a choice -------------------------------------------------------------------------------

def test_ignore_eos_choice_stops_when_complete(llm, prompts, ll_tokenizer):
    so = CONSTRAINTS["choice"]
    params = [greedy(max_tokens=50, ignore_eos=True, structured_outputs=so)]
    params += [sampled(s, max_tokens=50, ignore_eos=True, structured_outputs=so) for s in SEEDS]
    params += [greedy(max_tokens=50, ignore_eos=True, structured_outputs=CONSTRAINTS["regex"])]
    outs = run_engine(llm.llm_engine, [prompts[k % len(prompts)] for k in range(len(params))], params)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and len(c.token_ids) < 10, c
        check_output(p.structured_outputs, c, ll_tokenizer, "ignore_eos")


# --- min_tokens longer than the constraint allows -------------------------------------------------------------

def test_min_tokens_never_breaks_the_constraint(llm, prompts, ll_tokenizer, tokenizer):
    """min_tokens past the end of a constraint: where the grammar allows only EOS, min_tokens does not
    mask it (the constraint wins). The output is the whole constrained text, ends with EOS and "stop",
    and every token is one the grammar accepts; also for a constraint whose only output is empty."""
    for so in (SO(choice=["red"]), SO(regex="abcdef"), SO(json={"type": "boolean"}), SO(regex=""), SO(regex="a{0}")):
        for p in (greedy(max_tokens=20, min_tokens=5, structured_outputs=so),
                  sampled(0, max_tokens=20, min_tokens=5, structured_outputs=so)):
            out = run_engine(llm.llm_engine, prompts[:1], p)[0].outputs[0]
            m = independent_matcher(ll_tokenizer, so)
            assert all(m.consume_token(t) for t in out.token_ids), (so, out.text, list(out.token_ids))
            assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id, (so, out)
            assert out.text == tokenizer.decode(out.token_ids[:-1]), (so, out.text, list(out.token_ids))
            check_output(so, out, ll_tokenizer, "min_tokens")


def test_grammar_only_the_tokenizer_can_refuse(llm, prompts):
    """A Lark grammar naming a special token the tokenizer lacks compiles without a tokenizer; the check
    at submission compiles with the model's tokenizer, so it is refused there (and not in the engine
    loop), by LLM.generate with other requests in the same call, and the engine goes on."""
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(grammar='start: <|no_such_token|> "a"'))
    with pytest.raises(ValueError, match="no_such_token"):
        llm.generate(prompts[:2], [greedy(max_tokens=4), bad], use_tqdm=False)
    with pytest.raises(ValueError, match="no_such_token"):
        llm.llm_engine.add_request(None, prompts[0], bad)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(prompts[:1], greedy(max_tokens=4), use_tqdm=False)[0].finished


# --- the default model -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_json(default_model_dir):
    """SmolLM2-135M-Instruct answers a chat prompt with JSON that meets a schema (greedy and sampled)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    llm = LLM(default_model_dir, max_model_len=512, kv_cache_memory_bytes=1 << 27, seed=0)
    ll_tok = llguidance.hf.from_tokenizer(llm.get_tokenizer())
    msgs = [[{"role": "user", "content": f"Give {p}'s name and age at death as JSON."}]
            for p in ("Ada Lovelace", "Alan Turing")]
    so = SO(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=so),
              SamplingParams(temperature=0.8, seed=1, max_tokens=80, structured_outputs=so)]
    for p in params:
        for out in llm.chat(msgs, p, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)
            assert list(json.loads(c.text, object_pairs_hook=lambda pairs: [k for k, _ in pairs])) == ["name", "age"]
            m = independent_matcher(ll_tok, so)
            assert all(m.consume_token(t) for t in c.token_ids) and m.is_stopped()


def test_vllm_structured_outputs_example_runs_by_changing_the_import(llm, ll_tokenizer):
    """vLLM's examples/offline_inference/structured_outputs.py, retold with minivllm's import: a choice, a
    regex with a stop string, a pydantic model's JSON schema and the simplified SQL grammar in GBNF; the
    calls use vLLM's keyword names (`prompts=`, `sampling_params=`)."""
    from enum import Enum

    from pydantic import BaseModel

    class CarType(str, Enum):
        sedan, suv, truck, coupe = "sedan", "SUV", "Truck", "Coupe"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    sql = ('root ::= select_statement\n'
           'select_statement ::= "SELECT " column " from " table " where " condition\n'
           'column ::= "col_1 " | "col_2 "\ntable ::= "table_1 " | "table_2 "\n'
           'condition ::= column "= " number\nnumber ::= "1 " | "2 "\n')
    cases = [(StructuredOutputsParams(choice=["Positive", "Negative"]), {}, "Classify this sentiment: vLLM is wonderful!"),
             (StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), {"stop": ["\n"], "max_tokens": 50},
              "Generate an email address for Alan Turing, who works in Enigma. End in .com and new line."),
             (StructuredOutputsParams(json=CarDescription.model_json_schema(), disable_any_whitespace=True),
              {"max_tokens": 200}, "Generate a JSON with the brand, model and car_type of the most iconic car"),
             (StructuredOutputsParams(grammar=sql), {"max_tokens": 50},
              "Generate an SQL query to show the 'username' and 'email' from the 'users' table.")]
    for so, extra, prompt in cases:
        out = llm.generate(prompts=prompt, sampling_params=SamplingParams(structured_outputs=so, **extra))[0].outputs[0]
        if so.choice is not None:
            assert out.text in so.choice
        elif so.regex is not None:
            assert out.finish_reason == "length" or re.fullmatch(r"\w+@\w+\.com", out.text), out.text
        elif so.json is not None:
            assert out.finish_reason == "length" or CarDescription.model_validate_json(out.text)
        else:
            assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", out.text), out.text
