"""AsyncLLM: vLLM's asynchronous engine, the one its server runs (exported from
notebooks/12_serving.ipynb). Each request's `generate()` is an async generator fed through a one-slot
`RequestOutputCollector` by a background output handler that reads the engine core's outputs. After
vLLM V1's `AsyncLLM` (vllm/v1/engine/async_llm.py) and `RequestOutputCollector` (output_processor.py)."""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import AsyncGenerator

from ..config import EngineArgs
from .core_client import EngineDeadError, InprocClient, MPClient
from .core_output_processor import CoreOutputProcessor
from ..metrics.stats import SchedulerStats, StatLoggerBase
from .processor import Processor
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind
from ..transformers_utils.model_files import has_tokenizer, load_tokenizer, resolve_model


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request as one: each completion's new text, tokens and log-probabilities
    appended to what `old` held for the same index; the rest (finish reasons, `finished`) from `new`."""
    # EXERCISE ch12_ex1 (10 points): merge each completion's new text, tokens and logprobs into `old`'s, by index
    ### BEGIN SOLUTION
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        if c.index not in by_index:
            by_index[c.index] = c
            continue
        o = by_index[c.index]
        logprobs = o.logprobs + c.logprobs if o.logprobs is not None and c.logprobs is not None else c.logprobs
        by_index[c.index] = CompletionOutput(c.index, o.text + c.text, o.token_ids + c.token_ids,
                                             c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason)
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids, new.prompt_logprobs,
                         sorted(by_index.values(), key=lambda c: c.index), new.finished, new.num_cached_tokens)
    ### END SOLUTION


class RequestOutputCollector:
    """One slot between the output handler (`put`) and one `generate()` call (`get`). When the handler
    gets ahead of the consumer, DELTA outputs are merged (nothing is lost) and other kinds replaced (the
    newest holds everything). An exception put in is raised by the next `get`.
    Source: vLLM V1's `RequestOutputCollector`."""

    def __init__(self, output_kind: RequestOutputKind):
        # EXERCISE ch12_ex1 (10 points): the slot and the event that wakes a waiting `get`
        ### BEGIN SOLUTION
        self.kind = output_kind
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()
        ### END SOLUTION

    def put(self, output: RequestOutput | Exception) -> None:
        # EXERCISE ch12_ex1 (10 points): fill the slot; merge DELTA outputs, replace others; an exception waiting stays
        ### BEGIN SOLUTION
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):  # an exception already waiting stays
            self.output = merge_delta(self.output, output) if self.kind is RequestOutputKind.DELTA else output
        ### END SOLUTION

    async def get(self) -> RequestOutput:
        # EXERCISE ch12_ex1 (10 points): wait (without spinning) until the slot holds something, then take it
        ### BEGIN SOLUTION
        while self.output is None:
            await self.ready.wait()
        return self._take()
        ### END SOLUTION

    def get_nowait(self) -> RequestOutput | None:
        # EXERCISE ch12_ex1 (10 points): what the slot holds now, or None
        ### BEGIN SOLUTION
        return None if self.output is None else self._take()
        ### END SOLUTION

    def _take(self) -> RequestOutput:
        # EXERCISE ch12_ex1 (10 points): empty the slot; raise an exception taken from it
        ### BEGIN SOLUTION
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output
        ### END SOLUTION


class AsyncLLM:
    """The asynchronous engine: `generate()` per request, an output handler for all of them.

    Args:
        args: an `EngineArgs` with every piece given (`defaults.complete_engine_args`).
        multiprocess: run the engine core in its own process (`MPClient`, the default, as vLLM's
            server does) or in this one, stepped by a worker thread (`InprocClient`).
        stat_loggers: `StatLoggerBase`s whose `record` gets every batch's stats.
    Attributes: tokenizer, processor (the front end's `Processor`), output_processor
        (`CoreOutputProcessor`), engine_core (the client), max_model_len, scheduler_stats (the latest).
    Raises: EngineDeadError if the engine core does not start; ValueError for a bad setting.
    """

    def __init__(self, args: EngineArgs, multiprocess: bool = True, stat_loggers: list[StatLoggerBase] = ()):
        path = resolve_model(args.model)
        self.tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
        self.engine_core = MPClient(args) if multiprocess else InprocClient(args)
        info = self.engine_core.info
        self.output_processor = CoreOutputProcessor(self.tokenizer)
        fields = self.output_processor.sampling_fields - (set() if info.has_logprobs else {"logprobs"})
        fields -= set() if self.tokenizer is not None else {"stop"}
        self.processor = Processor(self.tokenizer, info.vocab_size, info.max_model_len, info.cache,
                                   info.sampling_fields | fields)
        self.max_model_len = info.max_model_len
        self.stat_loggers = list(stat_loggers)
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.scheduler_stats = SchedulerStats()
        self.output_handler: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None
        self._ids = itertools.count()

    @property
    def errored(self) -> bool:
        """Whether the engine core has died (the server's /health answers 503 then)."""
        return self.dead_error is not None or not self.engine_core.is_alive()

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine core is dead."""
        if self.errored:
            raise self.dead_error or EngineDeadError("the engine core is not running")

    async def generate(self, prompt, sampling_params=None, request_id: str | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs as its `output_kind` asks, until it has finished.

        The request is checked (`check_health`, `processor.process`, its id not in use), followed by the
        output processor (`output_processor.add_request`, which gives the `EngineCoreRequest`s to send),
        given a `RequestOutputCollector` in `collectors` under its id, and sent to `engine_core`; the
        output handler is started (`_start_output_handler`). Closing the generator or cancelling the task
        that iterates it aborts the request (`_abort`), and its collector always leaves `collectors`.
        Raises: ValueError for a bad prompt or parameter or an id in use (before anything is queued);
            EngineDeadError when the engine core has died (also while waiting for outputs).
        """
        # EXERCISE ch12_ex1 (10 points): check, follow and send the request, then yield from its collector; abort unless finished
        ### BEGIN SOLUTION
        await self.check_health()
        seq = self.processor.process(prompt, sampling_params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        requests = self.output_processor.add_request(request_id, seq, time.monotonic())
        collector = self.collectors[request_id] = RequestOutputCollector(seq.sampling_params.output_kind)
        self._start_output_handler()
        for request in requests:
            self.engine_core.add_request(request)
        finished = False
        try:
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            self.collectors.pop(request_id, None)
            if not finished:  # cancelled, closed early, or the engine died
                self._abort(request_id)
        ### END SOLUTION

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its `generate()` yields a last output (finish reason "abort")."""
        out = self._abort(str(request_id))
        collector = self.collectors.get(str(request_id))
        if out is not None and collector is not None:
            collector.put(out)

    def _abort(self, request_id: str) -> RequestOutput | None:
        core_ids, out = self.output_processor.abort_request(request_id, time.monotonic())
        if core_ids and not self.errored:
            self.engine_core.abort_requests(core_ids)
        return out

    def _start_output_handler(self) -> None:
        """Start the output handler on this event loop, unless it runs there (a new loop, as each
        `asyncio.run` makes, gets a new handler: the old one died with its loop)."""
        loop, task = asyncio.get_running_loop(), self.output_handler
        if task is None or task.done() or task.get_loop() is not loop:
            self.output_handler = loop.create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        """Move each step's outputs into the collectors, abort what stopped in the front end, log stats.
        If the engine core dies, every waiting `generate()` raises EngineDeadError."""
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                outputs, to_abort, iteration_stats = self.output_processor.process_outputs(
                    core_outputs.outputs, time.monotonic())
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
                for out in outputs:
                    if (collector := self.collectors.get(out.request_id)) is not None:
                        collector.put(out)
                self.scheduler_stats = core_outputs.scheduler_stats or self.scheduler_stats
                for logger in self.stat_loggers:
                    logger.record(core_outputs.scheduler_stats, iteration_stats)
        except Exception as e:
            self.dead_error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"output handler failed: {e!r}")
            for collector in self.collectors.values():
                collector.put(self.dead_error)

    def shutdown(self) -> None:
        """Stop the output handler and the engine core (its process too). Idempotent."""
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
