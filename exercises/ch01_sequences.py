# GENERATED from solutions/ch01_sequences.py by scripts/make_exercises.py: your work goes here.
"""Chapter 01's extend exercise. Your answer goes between the TODO lines; see the chapter notebook
(the rebuild exercises ch01_ex1, the sequence, and ch01_ex2, the sampling filters, are in the
chapter's export cells). It takes plain strings: it needs neither of them.

Exercise 3 (ch01_ex3) — stop strings, as vLLM checks them. Section 5.4's rules stop a sequence on a
token id; a request's `SamplingParams.stop` strings stop it on its *text*, which the tokens only make
together: a stop string may start in the middle of a token and end several tokens later. After each
step the engine decodes the new tokens, appends their text to the output and asks
`check_stop_strings` whether a stop string now ends in the new characters; if one does, the sequence
finishes ("stop", with the string as vLLM's `stop_reason`) and its text is cut before the string (after
it with `include_stop_str_in_output`). It looks only at the new characters and the `len(stop) - 1`
before them: a string wholly in the text already checked would have stopped the sequence then, and
searching the whole text at every step costs time quadratic in the output's length. Graded on fixed
cases that tell each rule apart, on random texts streamed in random pieces against every occurrence
of every stop string (hypothesis), and on the default model's tokenizer decoding an answer token by
token: `python -m minivllm.course.grade ch01_ex3`.
"""
from __future__ import annotations


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """The stop string that ends in the newest `new_char_count` characters of `output_text`, and where
    to cut the text (after vLLM's `check_stop_strings`, vllm/v1/engine/detokenizer.py).

    An occurrence of a stop string `s` at index `i` counts when it ends among the new characters:
    `i + len(s) > len(output_text) - new_char_count`. Of the occurrences that count, the one that
    starts first wins (the text is cut at the first stop string it holds); of two that start at the
    same index, the one listed first in `stop`. (vLLM's loop returns the first string *listed* that
    occurs; minivllm's engine, chapter 10, and this contract take the first in the text.) Only the new
    characters and the `len(s) - 1` before them can hold an occurrence that counts: search there only.

    Args:
        output_text: the completion's text so far, the new characters at its end.
        new_char_count: how many characters at the end of `output_text` are new, an int in
            `[0, len(output_text)]` (0: nothing new, so no stop).
        stop: the stop strings, each non-empty (`SamplingParams` checked them); may be empty.
        include_stop_str_in_output: keep the stop string in the text (cut after it) or not (cut before).
    Returns:
        `(the stop string, the length to cut output_text to)`: the occurrence's start index, or its end
        (`start + len(s)`) with `include_stop_str_in_output`; None when no occurrence counts.
    Raises:
        ValueError: `new_char_count` not an int (bools are not ints) in `[0, len(output_text)]`.
    """
    # TODO: check new_char_count (ValueError), then search each stop string from len(s) - 1 characters before the new ones
    raise NotImplementedError('ch01_sequences.check_stop_strings: check new_char_count (ValueError), then search each stop string from len(s) - 1 characters before the new ones')
