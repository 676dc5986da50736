# GENERATED from solutions/ch01_sequences.py by scripts/make_exercises.py: your work goes here.
"""Chapter 01 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch01_ex1) — decide when a sequence stops: write `check_stop`, the decision an engine makes
right after appending each generated token. Graded by its contract on random token streams:
`pytest -m ch01_ex1 --impl=exercises`.
"""
from minivllm.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> bool:
    """Finish `seq` if its last token ends it; return True when it is finished.

    Call it right after `seq.append_token(...)`. The rules, checked in this order:

    1. the last token is in `eos_token_ids` and `seq.sampling_params.ignore_eos` is False:
       the status becomes `FINISHED_STOPPED` (finish reason "stop");
    2. the completion has `seq.sampling_params.max_tokens` tokens, or the whole sequence (prompt and
       completion) has `max_model_len` tokens: the status becomes `FINISHED_LENGTH_CAPPED` ("length").

    Otherwise leave the sequence unchanged (status included) and return False. Never add or remove tokens.
    """
    # TODO: read seq.last_token, seq.num_completion_tokens, seq.num_tokens and seq.sampling_params
    raise NotImplementedError('ch01_sequences.check_stop: read seq.last_token, seq.num_completion_tokens, seq.num_tokens and seq.sampling_params')
