# GENERATED from solutions/ch11_chunked_prefill.py by scripts/make_exercises.py: your work goes here.
"""Chapter 11 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 3 (ch11_ex3) — short prompts overtake long ones. Under the chapter's token budget two long
prompts being prefilled side by side take the whole budget step after step, and a short prompt that
arrives behind them waits until they are done. vLLM V0's scheduler capped how many prompts are
partially prefilled at once (`SchedulerConfig.max_num_partial_prefills`) and how many of those may be
long (`max_long_partial_prefills`), so that a short prompt finds room at once. Write
`MyScheduler.schedule`, the chapter's `ChunkedPrefillScheduler.schedule` with both limits (the whole
contract is in its docstring). Graded in a scheduler-only simulation with a fake model runner (a
short prompt that arrives while long ones are being prefilled gets its first token before they do;
the limits, the budget and the KV-cache invariants hold every step; everything finishes) and by
plugging your class into the engine (`LLM(..., scheduler_cls=MyScheduler)`), whose greedy tokens
must equal transformers': `pytest -m ch11_ex3 --impl=exercises`.
"""
from minivllm.core.sched.chunked_prefill import ChunkedPrefillScheduler
from minivllm.sequence import Sequence, SequenceStatus


class MyScheduler(ChunkedPrefillScheduler):
    """A `ChunkedPrefillScheduler` that limits the prefills of a step (vLLM V0's
    `max_num_partial_prefills` and `max_long_partial_prefills`).

    Definitions (given, as methods below):
        in prefill: a sequence that must compute more than its newest generated token, i.e. not
            `num_prompt_tokens <= num_computed_tokens == num_tokens - 1` (a prompt being computed, in
            one step or several, or a preempted sequence being recomputed). A step's prefills are the
            scheduled sequences that were in prefill when the step was planned.
        long: a sequence whose prompt has more than `long_prefill_token_threshold` tokens
            (`num_prompt_tokens > long_prefill_token_threshold`; with a threshold of 0 no prompt is
            long). vLLM V0 counts the tokens still to compute instead; for a prompt not found in the
            prefix cache that is the same.

    Args: as `ChunkedPrefillScheduler`, and
        max_num_partial_prefills: at most this many prefills in one step (>= 1; default: the class
            attribute, which `from_engine_args` uses: set it on a subclass to configure the engine).
        max_long_partial_prefills: at most this many of them long (1 <= it <= max_num_partial_prefills).
    Raises:
        ValueError: a limit out of those ranges, naming it and its value.
    """

    max_num_partial_prefills = 2
    max_long_partial_prefills = 1

    def __init__(self, *args, max_num_partial_prefills: int | None = None,
                 max_long_partial_prefills: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_num_partial_prefills is not None:
            self.max_num_partial_prefills = max_num_partial_prefills
        if max_long_partial_prefills is not None:
            self.max_long_partial_prefills = max_long_partial_prefills
        if not 1 <= self.max_num_partial_prefills:
            raise ValueError(f"max_num_partial_prefills={self.max_num_partial_prefills} must be >= 1")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills={self.max_long_partial_prefills} must be between 1 and "
                             f"max_num_partial_prefills={self.max_num_partial_prefills}")

    def in_prefill(self, seq: Sequence) -> bool:
        """Whether `seq` must compute more than its newest generated token (see the class docstring)."""
        return not seq.num_prompt_tokens <= seq.num_computed_tokens == seq.num_tokens - 1

    def is_long(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt is long: more than `long_prefill_token_threshold` tokens (0: none is)."""
        return 0 < self.long_prefill_token_threshold < seq.num_prompt_tokens

    def schedule(self) -> tuple[list[Sequence], bool]:
        """This step's `(seqs, is_prefill)`, as `ChunkedPrefillScheduler.schedule`, with two limits.

        Contract (graded):
        * Running sequences first, in admission order, each after `room_for` made room for its newest
          token (preemption as in the chapter: once a sequence has been preempted, stop), each given
          `num_new_tokens(seq, budget)` tokens with `schedule_tokens`; decodes are never held back. A
          running sequence in prefill is skipped this step (it keeps its place and its blocks) when
          the step already has `max_num_partial_prefills` prefills, or when it is long and the step
          already has `max_long_partial_prefills` long prefills.
        * Then waiting sequences, from the head of `waiting`, while the budget lasts, a seat is free
          (`len(running) < max_num_seqs`), nothing was preempted this step and the step has fewer than
          `max_num_partial_prefills` prefills: a long one while the step already has
          `max_long_partial_prefills` long prefills is passed over (it stays where it is in `waiting`)
          and the next is tried; the first that cannot be allocated ends admission. A newcomer is
          allocated its blocks, starts at its prefix-cache hit (`num_computed_tokens =
          num_cached_tokens`) and is admitted as in the chapter (without chunking, a prompt that does
          not fit the budget left ends admission; a partial prefill calls `discard_unwritten`), then
          moves from `waiting` to the end of `running` as RUNNING.
        * Never more than `max_num_batched_tokens` tokens, `long_prefill_token_threshold` per sequence
          with chunking on; `is_prefill` is False only when every sequence computes just its newest
          generated token.
        """
        # TODO: the chapter's schedule, counting the step's prefills and long prefills as you go
        raise NotImplementedError("ch11_chunked_prefill.schedule: the chapter's schedule, counting the step's prefills and long prefills as you go")
