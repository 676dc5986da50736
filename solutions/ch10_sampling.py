"""Chapter 10 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 2 (ch10_ex2) — locally typical sampling, a sampler filter the chapter does not show: write
`apply_typical_p`. Graded against transformers' `TypicalLogitsWarper` (float64 to 1e-12, float32),
row by row, on random rows: `pytest -m ch10_ex2 --impl=exercises`.

Exercise 3 (ch10_ex3) — incremental detokenization with two offsets (the scheme vLLM used before the
tokenizers library's `DecodeStream`): write `MyIncrementalDetokenizer.decode_next`. Graded on the
default model's tokenizer, on random token streams: `pytest -m ch10_ex3 --impl=exercises`.

Exercise 4 (ch10_ex4) — extend the sampler with transformers' `no_repeat_ngram_size`: write
`apply_no_repeat_ngram`; the given `NoRepeatNGramSampler` applies it. Graded against transformers'
`NoRepeatNGramLogitsProcessor` and `generate(no_repeat_ngram_size=3)`: `pytest -m ch10_ex4 --impl=exercises`.
"""
import torch

from minivllm.sample.sampler import Sampler


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al., TACL 2023) on a batch; a new tensor, dropped tokens -inf.

    For each row: p = softmax(logits), H = -sum(p * log p) (the entropy; tokens of probability 0 add
    nothing). Order the tokens by their distance |-log p - H|, closest first (a stable order: among
    equal distances the smaller token id first). Keep the shortest prefix of that order whose total
    probability reaches the row's `typical_p` (the token that crosses it is kept), drop the rest. A row
    whose `typical_p` is 1 is returned exactly as it was.

    Args:
        logits: `[num_seqs, vocab_size]`, float32 or float64 (the result has the same dtype).
        typical_p: `[num_seqs]`, each in (0, 1].
    """
    # TODO: entropy, distances, a stable sort, a cumulative sum, and a scatter back to the vocabulary order
    ### BEGIN SOLUTION
    logprobs = logits.log_softmax(dim=-1)
    probs = logprobs.exp()
    entropy = -(logprobs * probs).nansum(dim=-1, keepdim=True)
    distance, order = (-logprobs - entropy).abs().sort(dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = (mass_before >= typical_p[:, None]) & (typical_p[:, None] < 1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
    ### END SOLUTION


class MyIncrementalDetokenizer:
    """A completion's text token by token, with two offsets into the token ids (vLLM V0's scheme).

    `token_ids` holds the prompt, then each completion token. Text is only ever computed with
    `tokenizer.decode(ids, skip_special_tokens=True)`. `prefix_offset` and `read_offset` mark a short
    window: the text of `token_ids[prefix_offset:read_offset]` has been returned already; the tokens
    from `read_offset` on have not. The prompt is whole text (it does not end inside a character).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)  # a few prompt tokens of context

    def decode_next(self, token_id: int) -> str:
        """Append `token_id`; return the text it adds after the text returned so far ("" while that text
        would end in U+FFFD, an incomplete character), and move the offsets when text is returned.

        Contract (graded): the concatenation of what `decode_next` returned is always a prefix of what
        decoding prompt and completion together adds after the prompt, never ends in U+FFFD, and equals
        it whenever the completion so far ends on a whole character.
        """
        # TODO: decode the window with and without the unread tokens and return the difference
        ### BEGIN SOLUTION
        self.token_ids.append(token_id)
        seen = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(window) <= len(seen) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return window[len(seen):]
        ### END SOLUTION


def apply_no_repeat_ngram(logits: torch.Tensor, token_ids: list, ngram_size: int) -> torch.Tensor:
    """Ban every token that would complete an n-gram the row's tokens already contain (transformers'
    `no_repeat_ngram_size`; Paulus et al., 2018); a new tensor, banned tokens -inf.

    For row i, with `ids = token_ids[i]` (prompt and output so far) and n = `ngram_size`: once
    len(ids) >= n - 1, every token t such that `ids[-(n-1):] + [t]` occurs as n consecutive tokens of
    `ids` is banned (for n = 1: every token of `ids`). Rows are independent.

    Args:
        logits: `[num_seqs, vocab_size]`, any float dtype.
        token_ids: one list of token ids per row.
        ngram_size: n >= 1.
    """
    # TODO: for each row, find the earlier n-grams that start with the last n - 1 tokens
    ### BEGIN SOLUTION
    banned_rows, banned_ids = [], []
    for row, ids in enumerate(token_ids):
        if len(ids) < ngram_size - 1:
            continue
        tail = list(ids[len(ids) - ngram_size + 1:]) if ngram_size > 1 else []
        for start in range(len(ids) - ngram_size + 1):
            if list(ids[start:start + ngram_size - 1]) == tail:
                banned_rows.append(row)
                banned_ids.append(ids[start + ngram_size - 1])
    logits = logits.clone()
    if banned_rows:
        logits[torch.tensor(banned_rows), torch.tensor(banned_ids)] = float("-inf")
    return logits
    ### END SOLUTION


class NoRepeatNGramSampler(Sampler):
    """Given: chapter 10's `Sampler`, after banning repeated n-grams of `no_repeat_ngram_size` tokens
    (over each sequence's prompt and output). Plug it in with `EngineArgs.sampler_cls`."""

    no_repeat_ngram_size = 3

    def __call__(self, logits, seqs, generators, default_generator):
        logits = apply_no_repeat_ngram(logits, [s.token_ids for s in seqs], self.no_repeat_ngram_size)
        return super().__call__(logits, seqs, generators, default_generator)
