# GENERATED from solutions/ch04_scheduler.py by scripts/make_exercises.py: your work goes here.
"""Chapter 04 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch04_ex1) — rebuild `Scheduler.schedule`: prefill first (within `max_num_seqs` running
sequences, the `max_num_batched_tokens` budget and what the KV-cache manager can allocate), else
decode every running sequence, preempting the most recently admitted one when a sequence cannot get
room. Graded against minivllm's `Scheduler` and by plugging your class into the engine
(`LLM(..., scheduler_cls=MyScheduler)`), whose outputs must not change:
`pytest -m ch04_ex1 --impl=exercises`.
"""
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceStatus


class MyScheduler(Scheduler):
    """A `Scheduler` whose `schedule` you write yourself (use `self.block_manager`, `self.waiting`,
    `self.running`, `self.max_num_seqs`, `self.max_num_batched_tokens` and `self.preempt`)."""

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return `(seqs, is_prefill)`; see the chapter's three rules."""
        # TODO: admit waiting sequences (prefill); if none, decode the running ones with preemption
        raise NotImplementedError()
