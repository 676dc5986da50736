# GENERATED from solutions/ch04_scheduler.py by scripts/make_exercises.py: your work goes here.
"""Chapter 04 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch04_ex1) — another scheduling policy: shortest prompt first. The chapter's `Scheduler`
admits waiting sequences first come, first served, so a short request can wait behind a long one at
the head of the queue. Write `MyScheduler.schedule` so that a prefill step admits the waiting
sequences in order of increasing `num_tokens` (ties: their order in `waiting`), under the same limits
— at most `max_num_seqs` running, at most `max_num_batched_tokens` tokens in the step, and only what
the KV-cache manager `can_allocate` — stopping at the first that does not fit. When nothing is
admitted, decode every running sequence, preempting the most recently admitted one when a sequence
cannot get room (as the chapter's `Scheduler` does). Graded by the contract on random operation
sequences (no admitted prompt longer than one left waiting; a prefill whenever the shortest waiting
sequence fits; the limits and the KV-cache invariants hold; nothing hangs) and by plugging your class
into the engine (`LLM(..., scheduler_cls=MyScheduler)`), whose greedy tokens must equal
transformers': `pytest -m ch04_ex1 --impl=exercises`.
"""
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceStatus


class MyScheduler(Scheduler):
    """A `Scheduler` that admits the shortest waiting prompts first (use `self.block_manager`,
    `self.waiting`, `self.running`, `self.max_num_seqs`, `self.max_num_batched_tokens`, `self.preempt`)."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return `(seqs, is_prefill)`: the sequences to run this step and whether it is a prefill."""
        # TODO: admit waiting sequences shortest first (prefill); if none, decode the running ones
        raise NotImplementedError()
