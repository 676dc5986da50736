"""The front end's output processor: `RequestOutput`s from the engine core's `EngineCoreOutput`s, with the
text, stop strings and stop tokens made in the front end (exported from notebooks/12_serving.ipynb).
After vLLM V1's `OutputProcessor.process_outputs` (vllm/v1/engine/output_processor.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .core_client import EngineCoreOutput, EngineCoreRequest
from ..metrics.stats import FinishedRequestStats, IterationStats
from .output_processor import (OutputRequests, ParentRequest, RequestState, advance, child_sampling_params,
                               completion_ids, make_state, request_output)
from ..outputs import RequestOutput
from ..sequence import Sequence, SequenceStatus

CORE_FINISH = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH_CAPPED}


@dataclass
class RequestTimes:
    """When a completion arrived and got its tokens (`time.monotonic()`, s), for TTFT and ITL."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class CoreOutputProcessor:
    """Follows each request in the front end: a copy of each of its `n` sequences (the engine core holds
    the other copy), fed by the `EngineCoreOutput`s, with chapter 10's `RequestState`, `advance` and
    `request_output` making text, log-probabilities and outputs. A request's `n` completions go to the
    core as `n` requests (`completion_ids`): they share the prompt's blocks through the prefix cache.

    Args: tokenizer (None: token ids only). Attributes: sampling_fields (those it acts on), requests
        (request id -> `ParentRequest`), states (completion id -> its request and state), times.
    """

    sampling_fields = OutputRequests.sampling_fields - {"prompt_logprobs"}

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode = tokenizer and (lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.requests: dict[str, ParentRequest] = {}
        self.states: dict[str, tuple[ParentRequest, RequestState]] = {}
        self.times: dict[str, RequestTimes] = {}
        self.num_cached_tokens: dict[str, int] = {}
        self.aborted: list[FinishedRequestStats] = []  # reported with the next batch's stats

    def add_request(self, request_id: str, seq: Sequence, arrival: float) -> list[EngineCoreRequest]:
        """Follow a checked request; returns what to send to the engine core, one per completion.
        Raises ValueError: the id is in use."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        p, parent = seq.sampling_params, ParentRequest(request_id, seq.sampling_params.n, None)
        seqs = [seq] + [Sequence(seq.prompt_token_ids, child_sampling_params(p, i), seq.block_size, seq.prompt)
                        for i in range(1, p.n)]
        self.requests[request_id] = parent
        for index, (cid, s) in enumerate(zip(completion_ids(request_id, p.n), seqs)):
            s.request_id = cid
            parent.states.append(state := make_state(s, index, self.tokenizer))
            self.states[cid], self.times[cid] = (parent, state), RequestTimes(arrival)
        return [EngineCoreRequest(s.request_id, s) for s in seqs]

    def abort_request(self, request_id: str, now: float) -> tuple[list[str], RequestOutput | None]:
        """Stop following a request: the completion ids to abort in the engine core, and the request's
        last output (its unfinished completions end with "abort"), or None for an unknown id."""
        parent = self.requests.get(request_id)
        if parent is None:
            return [], None
        running = [s.seq for s in parent.states if not s.seq.is_finished]
        for seq in running:
            seq.status = SequenceStatus.FINISHED_ABORTED
        out = request_output(parent, {s.seq_id for s in running}, self.num_cached_tokens.get(request_id, 0))
        self._finish_request(parent, now)
        return [s.request_id for s in running], out

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float
                        ) -> tuple[list[RequestOutput], list[str], IterationStats]:
        """One step's outputs: the `RequestOutput`s to deliver (as each request's `output_kind` asks), the
        completion ids the engine core must abort (a stop string or stop token found here), and what the
        step did for the metrics. Outputs of requests no longer followed (aborted) are dropped."""
        stats, touched, stepped, to_abort = IterationStats(), {}, set(), []
        for out in outputs:
            if out.request_id not in self.states:
                continue
            parent, state = self.states[out.request_id]
            if self._apply(state, out) and out.finish_reason is None:
                to_abort.append(out.request_id)  # finished here, still running in the engine core
            self._record(out, state, parent, now, stats)
            touched[parent.request_id], _ = parent, stepped.add(state.seq.seq_id)
        results = [request_output(p, stepped, self.num_cached_tokens.get(p.request_id, 0)) for p in touched.values()]
        for r in results:
            if r is not None and r.finished:
                self._finish_request(self.requests[r.request_id], now)
        stats.finished_requests += self.aborted
        self.aborted = []
        return [r for r in results if r is not None], to_abort, stats

    def _apply(self, state: RequestState, out: EngineCoreOutput) -> bool:
        """Append `out`'s tokens to the front end's copy, stopping at a stop string or stop token (the
        rest of `out` is dropped); returns whether the completion stopped here."""
        seq = state.seq
        for k, token in enumerate(out.new_token_ids):
            seq.append_token(token)
            if k == len(out.new_token_ids) - 1 and out.finish_reason is not None:
                seq.status = CORE_FINISH[out.finish_reason]
            reason = advance(state, {seq.seq_id: out.new_logprobs[k]} if out.new_logprobs else {}, self.tokenizer,
                             self.decode)
            if reason is not None:
                seq.status, state.stop_reason = SequenceStatus.FINISHED_STOPPED, reason
                return True
        return False

    def _record(self, out: EngineCoreOutput, state: RequestState, parent: ParentRequest, now: float,
                stats: IterationStats) -> None:
        """Add what one `EngineCoreOutput` did to `stats` (TTFT, ITL per token, finished completions)."""
        seq, times = state.seq, self.times[out.request_id]
        num_new = len(out.new_token_ids)
        stats.num_generation_tokens += num_new
        if times.first_token is None:
            times.first_token = now
            stats.time_to_first_token.append(now - times.arrival)
            stats.num_prompt_tokens += seq.num_prompt_tokens
            self.num_cached_tokens.setdefault(parent.request_id, out.num_cached_tokens)
            times.last_token, num_new = now, num_new - 1
        if num_new > 0:  # vllm#27485: a gap that brought k tokens is k inter-token latencies of gap / k
            stats.inter_token_latency += [(now - times.last_token) / num_new] * num_new
        times.last_token = now
        if seq.is_finished:
            stats.finished_requests.append(self._finished_stats(out.request_id, seq, now))

    def _finished_stats(self, completion_id: str, seq: Sequence, now: float) -> FinishedRequestStats:
        times = self.times.pop(completion_id)
        ttft = None if times.first_token is None else times.first_token - times.arrival
        return FinishedRequestStats(seq.finish_reason, now - times.arrival, seq.num_prompt_tokens,
                                    seq.num_completion_tokens, ttft)

    def _finish_request(self, parent: ParentRequest, now: float) -> None:
        """Forget a request; its completions not yet counted as finished are counted as aborted."""
        for state in parent.states:
            cid = state.seq.request_id
            if cid in self.times:
                self.aborted.append(self._finished_stats(cid, state.seq, now))
            self.states.pop(cid, None)
        self.requests.pop(parent.request_id, None)
        self.num_cached_tokens.pop(parent.request_id, None)
