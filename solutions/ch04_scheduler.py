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
        ### BEGIN SOLUTION
        scheduled, num_batched_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched_tokens + seq.num_tokens > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)
            num_batched_tokens += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False
        ### END SOLUTION
