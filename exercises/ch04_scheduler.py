# GENERATED from solutions/ch04_scheduler.py by scripts/make_exercises.py: your work goes here.
"""Chapter 04 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch04_ex1) — another scheduling policy: shortest prompt first. The chapter's `Scheduler`
admits waiting sequences first come, first served, so a short request can wait behind a long one at
the head of the queue. Write `MyScheduler.schedule_prefill` (and `_admit`, which admits one
sequence) so that a prefill step admits the waiting sequences in order of increasing `num_tokens`
(ties: their order in `waiting`), under the same limits — at most `max_num_seqs` running, at most
`max_num_batched_tokens` tokens in the step, and only what the KV-cache manager `can_allocate` —
stopping at the first that does not fit. When nothing is admitted, the inherited `schedule_decode`
decodes every running sequence as the chapter's `Scheduler` does. Graded by the contract on random
operation sequences (no admitted prompt longer than one left waiting; a prefill whenever the
shortest waiting sequence fits; the limits and the KV-cache invariants hold; nothing hangs) and by
plugging your class into the engine (`LLM(..., scheduler_cls=MyScheduler)`), whose greedy tokens
must equal transformers': `pytest -m ch04_ex1 --impl=exercises`.
"""
from minivllm.core.sched.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceStatus


class MyScheduler(Scheduler):
    """A `Scheduler` that admits the shortest waiting prompts first. It keeps the chapter's `schedule`
    and `schedule_decode`; you write the admission policy, `schedule_prefill`, and `_admit`."""

    def _admit(self, seq: Sequence) -> None:
        """Give a waiting `seq` (anywhere in `self.waiting`) its KV blocks from `self.block_manager`,
        mark it `SequenceStatus.RUNNING`, and move it from `waiting` to the end of `running`."""
        # TODO: take its blocks, then change its status and its queue
        raise NotImplementedError('ch04_scheduler._admit: take its blocks, then change its status and its queue')

    def schedule_prefill(self) -> list[Sequence]:
        """Admit waiting sequences (with `self._admit`) in order of increasing `num_tokens`, ties in
        queue order, while the limits allow: at most `self.max_num_seqs` running, at most
        `self.max_num_batched_tokens` tokens computed in the step (a sequence counts its tokens minus
        its `num_cached_tokens`, known only after `_admit`; the check before admitting uses all its
        tokens), and only what `self.block_manager.can_allocate`. Stop at the first that does not fit.
        Return the admitted sequences in the order admitted (empty if none)."""
        # TODO: walk the waiting sequences shortest first; admit each that fits, stop at the first that does not
        raise NotImplementedError('ch04_scheduler.schedule_prefill: walk the waiting sequences shortest first; admit each that fits, stop at the first that does not')
