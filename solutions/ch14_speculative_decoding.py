"""Chapter 14 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 3 (ch14_ex3) — `k` adapted per request. The chapter's proposers draft the same `k` tokens for
every request at every step, although prompt lookup is right for some requests (they copy their
input) and wrong for others: a rejected draft costs a verified position and drafting it, for nothing.
Dynamic speculation (Liu et al., "Optimizing Speculative Decoding for Serving Large Language Models
Using Goodput", 2024; vLLM's SmartSpec proposal) drafts fewer tokens for a request whose drafts keep
being rejected and more for one whose drafts are accepted. Write `AdaptiveNgramProposer.propose`:
prompt lookup with a per-request `k_i` in [1, k], lowered by one after a step that rejected a draft of
that request, raised by one after a step that accepted all its drafts (the whole contract is in its
docstring). `AdaptiveNgramModelRunner` (given) plugs it into the engine:

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        model_runner_cls=AdaptiveNgramModelRunner)

Graded by plugging it into the engine (greedy tokens identical to plain decoding and to transformers';
sampled tokens that pass a chi-square test against the model's exact distribution) and by driving it
step by step with scripted acceptances (drafts that are always rejected bring `k_i` down to 1, drafts
that are always accepted bring it back to `k`): `pytest -m ch14_ex3 --impl=exercises`.
"""
from minivllm.sequence import Sequence
from minivllm.spec_decode.model_runner import SpecDecodeModelRunner
from minivllm.spec_decode.ngram_proposer import NgramProposer, ngram_lookup


class AdaptiveNgramProposer(NgramProposer):
    """Prompt lookup (`NgramProposer`) with a number of drafts adapted per request from its acceptance.

    Contract (graded):
    * Each request (a `Sequence`, by `seq_id`) has its own `k_i`, an int in [1, k] (k is
      `num_speculative_tokens`), k until its drafts are first verified. `k_per_seq` (seq_id -> k_i)
      holds it (a request not in it has k_i = k); `current_k(seq_id)` returns it.
    * `propose(seqs, new_token_ids, generators, default_generator)` is called after every step with
      the step's sequences and each one's new tokens (None for a partial prefill), as the chapter's
      proposers are. For each sequence with new tokens `new`, in this order:
        1. `k_i` is updated from the drafts verified in this step. Those are `seq.spec_token_ids` as
           `propose` is called (the scheduler may have trimmed the proposed drafts to its budget, so
           they may be fewer than proposed; preemption clears them). With `m` of them: `m == 0`, `k_i`
           stays; all `m` accepted (`len(new) == m + 1`: the accepted drafts and one token of the
           target's), `k_i = min(k, k_i + 1)`; a draft rejected (`len(new) <= m`), `k_i = max(1, k_i - 1)`.
        2. Its drafts are `ngram_lookup(tokens, min_n, max_n, min(k_i, max_model_len - len(tokens)))`
           with `tokens = seq.token_ids + new` (the tokens it holds once the step's are appended):
           up to `k_i` tokens, none past `max_model_len`.
      A sequence without new tokens gets no drafts and keeps its `k_i`. Returns `(drafts, [None] *
      len(seqs))`: a list of drafts per sequence, in order, and one-hot draft probabilities.
    * `drop(seq_id)` forgets a request (the model runner calls it when the request leaves the engine).

    Args: as `NgramProposer`.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int):
        super().__init__(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, max_model_len)
        self.k_per_seq: dict[int, int] = {}

    def current_k(self, seq_id: int) -> int:
        """`k_i` of request `seq_id`: the number of drafts its next lookup may return (k at first)."""
        return self.k_per_seq.get(seq_id, self.k)

    def drop(self, seq_id: int) -> None:
        """Forget request `seq_id` (it finished or was aborted)."""
        self.k_per_seq.pop(seq_id, None)

    def propose(self, seqs: list[Sequence], new_token_ids: list, generators=None,
                default_generator=None) -> tuple[list, list]:
        """Each sequence's drafts after this step, `k_i` updated first (see the class docstring)."""
        # TODO: per sequence with new tokens: update k_i from its verified drafts, then look up at most k_i
        ### BEGIN SOLUTION
        drafts = []
        for seq, new in zip(seqs, new_token_ids, strict=True):
            if new is None:  # a partial prefill: nothing verified, nothing to draft from yet
                drafts.append([])
                continue
            verified, k_i = len(seq.spec_token_ids), self.current_k(seq.seq_id)
            if verified:
                self.k_per_seq[seq.seq_id] = min(self.k, k_i + 1) if len(new) == verified + 1 else max(1, k_i - 1)
            tokens = seq.token_ids + list(new)
            room = self.max_model_len - len(tokens)
            drafts.append(ngram_lookup(tokens, self.min_n, self.max_n, min(self.current_k(seq.seq_id), room)))
        return drafts, [None] * len(seqs)
        ### END SOLUTION


class AdaptiveNgramModelRunner(SpecDecodeModelRunner):
    """Chapter 14's model runner with an `AdaptiveNgramProposer` in place of the `NgramProposer` that
    `speculative_config={"method": "ngram", ...}` builds (same k, n-gram sizes and length limit); it
    tells the proposer when a request leaves the engine. Pass it as `LLM(..., model_runner_cls=...)`.

    Raises: ValueError, a `speculative_config` of another method (a draft model).
    """

    proposer_cls = AdaptiveNgramProposer

    @classmethod
    def from_engine_args(cls, args, model, block_manager, generator=None) -> "AdaptiveNgramModelRunner":
        config = getattr(args, "speculative_config", None)
        if config is None or config.method != "ngram":
            raise ValueError("AdaptiveNgramModelRunner adapts prompt lookup: it needs speculative_config with "
                             "method='ngram'")
        runner = super().from_engine_args(args, model, block_manager, generator)
        base = runner.proposer
        runner.proposer = cls.proposer_cls(base.k, base.min_n, base.max_n, base.max_model_len)
        return runner

    def drop_generator(self, seq: Sequence) -> None:
        super().drop_generator(seq)
        self.proposer.drop(seq.seq_id)
