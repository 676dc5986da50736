"""Chapter 15 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 3 (ch15_ex3) — fast-forward tokens. Under a constraint, many tokens are not a choice at all:
once a choice list's first token is sampled, the rest of that choice is forced; a regex's literal part
(`-answer-is-`), a JSON object's next key and its `": "` are forced too. The chapter's engine still runs
a whole step per forced token, to sample the one token its mask allows. llguidance knows the forced
tokens ahead (`LLMatcher.compute_ff_tokens()`: the tokenizer's own split of the text the grammar
forces, as its masks allow in a forced span). Append them right after the sampled token, in the same
step: the sequence then has several tokens whose K/V is not computed yet, which chapter 11's
token-budget scheduler computes in one step, like a prefill chunk (its budget may split them), before
it samples the next free token. The output is the same text in fewer steps (llguidance's "fast-forward
tokens"; SGLang's "jump-forward decoding", Zheng et al., 2024). Write `FastForwardScheduler.fast_forward`
(the whole contract is in its docstring); `postprocess` (given) calls it. Plug it in:

    LLM(model, scheduler_cls=FastForwardScheduler)

(the default assembly then adds chapter 15's sampler, as for `StructuredOutputScheduler`).

Graded by plugging it into the engine on a tiny float64 model with SmolLM2's tokenizer: greedy
requests under choice and regex constraints with long forced parts give the same outputs (text, token
ids, finish reasons) as chapter 15's `StructuredOutputScheduler`, valid under their constraints, in
fewer engine steps, with nothing left forced after a step; also with `max_tokens` and `max_model_len`
cutting a forced run, and with a KV cache too small for all requests (preemption, prefix caching) or a
small token budget: `pytest -m ch15_ex3 --impl=exercises`.
"""
from minivllm.sequence import Sequence
from minivllm.structured_output.scheduler import StructuredOutputScheduler


class FastForwardScheduler(StructuredOutputScheduler):
    """Chapter 15's scheduler that appends the tokens a grammar forces right after each sampled token,
    so the next step computes them all at once. Args and attributes: as `StructuredOutputScheduler`.

    Only the final output is built from every token; chapter 10's output processor looks at a step's
    last token only, so stop strings, `stop_token_ids` and streaming need chapter 14's
    `SpecDecodeOutputProcessor` (`output_processor_cls=...`), which replays a step's tokens one by one.
    """

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
        """Chapter 11's postprocess (append each sampled token, feed it to the grammar, retire the
        finished), then `fast_forward` each sequence that got a token and still runs; one that a
        forced token finished leaves too. A request with `n > 1` forks its completions after its first
        token, so it is not fast-forwarded at its first token."""
        advanced = super().postprocess(seqs, token_ids)
        for seq in advanced:
            if seq.is_finished or (seq.sampling_params.n > 1 and seq.num_completion_tokens == 1):
                continue
            if self.fast_forward(seq) and seq.is_finished:
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
        return advanced

    def fast_forward(self, seq: Sequence) -> int:
        """Append the tokens `seq`'s grammar forces now; returns how many were appended.

        Contract (graded):
        * Called right after `seq`'s sampled token was appended and accepted by its grammar (`seq` is
          running). A sequence without a grammar (`seq.structured_output_request` missing or None), or
          whose grammar has no llguidance `matcher` (`request.grammar.matcher`), gets nothing: return 0.
        * The forced tokens are `matcher.compute_ff_tokens()`, taken once, now. Append them in order,
          each with `seq.append_token` and then `self.check_stop(seq)`: that feeds it to the grammar and
          applies chapter 04's rules (EOS, `max_tokens`, `max_seq_len`) and chapter 15's (a terminated
          grammar). Stop at the first that finishes `seq` (leave its status; `postprocess` retires it).
        * KV slots: the scheduler gives a block to a sequence's newest token only (chapter 11's
          `room_for`: a sequence with several uncomputed tokens is assumed to hold their blocks, as a
          prompt does). So the blocks of the sampled token and of every forced token are taken here,
          as `room_for` takes one: `block_manager.can_append(seq)`, then `block_manager.may_append(seq)`,
          with the token in `seq` (first the sampled token, then each forced one once appended; if the
          sampled token's block is not free, nothing is appended). When the manager cannot hold the next
          forced token, the run stops before it: that token is not appended (nor fed to the grammar),
          and the sequence carries on from there (its next step samples under a mask that allows only
          the forced text, unless the scheduler preempts it as usual). No block is taken beyond `seq`'s tokens.
        * `num_computed_tokens` is left as it is: the next step computes the sampled token and the
          forced ones together.
        """
        # TODO: append each forced token with its KV slot, fed to the grammar by check_stop, until seq finishes
        ### BEGIN SOLUTION
        request = getattr(seq, "structured_output_request", None)
        matcher = getattr(getattr(request, "grammar", None), "matcher", None)
        if matcher is None:
            return 0
        forced, bm = matcher.compute_ff_tokens(), self.block_manager
        if not forced or not bm.can_append(seq):
            return 0
        bm.may_append(seq)  # the sampled token's slot: room_for will not give it one now
        appended = 0
        for token_id in forced:
            seq.append_token(token_id)
            if not bm.can_append(seq):
                seq.token_ids.pop()  # no room: sampled again next step, or preempted
                break
            bm.may_append(seq)
            appended += 1
            if self.check_stop(seq):
                break
        return appended
        ### END SOLUTION
