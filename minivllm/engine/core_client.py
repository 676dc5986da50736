"""The engine core behind a client: in this process, or in a process of its own that talks over ZMQ
sockets (exported from notebooks/12_serving.ipynb). After vLLM V1's `EngineCoreClient`, `InprocClient`,
`MPClient` and `EngineCoreProc` (vllm/v1/engine/core_client.py, core.py)."""
from __future__ import annotations

import asyncio
import atexit
import ctypes
import dataclasses
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from ..config import EngineArgs
from .llm_engine import LLMEngine
from ..metrics.stats import SchedulerStats
from ..sequence import Sequence


class EngineDeadError(RuntimeError):
    """The engine core has stopped (its process died, or a step raised): no request can go on."""


@dataclass
class EngineCoreRequest:
    """What the front end sends for one sequence: its id in the engine core and the checked `Sequence`
    (prompt token ids and sampling parameters; the front end keeps its own copy)."""

    request_id: str
    seq: Sequence


@dataclass
class EngineCoreOutput:
    """What one step did to one sequence (vLLM V1's `EngineCoreOutput`).

    Attributes: request_id; new_token_ids (the tokens this step appended, here one); finish_reason
        ("stop" for an end-of-sequence token, "length", or None: the core's own stopping rules only;
        stop strings and stop token ids are the front end's); new_logprobs (one `(ids, values, rank)`
        row per new token, or None); num_cached_tokens (prompt tokens found in the prefix cache).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    new_logprobs: list | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineCoreOutputs:
    """One step's outputs and the scheduler's state after it (what crosses the output socket)."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() in the engine core when the step ended


@dataclass
class CacheShape:
    """What the front end's `Processor` needs to know of the KV cache: its blocks and their size."""

    num_blocks: int
    block_size: int


@dataclass
class EngineCoreInfo:
    """The engine core's answer at start-up: what the front end checks requests against.

    Attributes: max_model_len (resolved), vocab_size, cache (a `CacheShape`), sampling_fields (the
        `SamplingParams` fields the core's scheduler and model runner act on), has_logprobs (its
        sampler reports log-probabilities).
    """

    max_model_len: int
    vocab_size: int
    cache: CacheShape
    sampling_fields: frozenset
    has_logprobs: bool


class EngineCoreProc:
    """An `LLMEngine`'s core driven by messages: add and abort requests, `step`, report outputs.

    The same object serves both clients: `InprocClient` calls it directly, `run_engine_core` calls it
    from the busy loop of the engine core's own process. Args: engine, an `LLMEngine` whose `core`,
    `scheduler`, `block_manager` and `model_runner` are used (its processor and output processor are not:
    the front end checks requests and makes text). After vLLM V1's `EngineCore`.
    """

    def __init__(self, engine: LLMEngine):
        self.engine, self.core = engine, engine.core
        self.sent: dict[str, int] = {}  # request id -> completion tokens already sent
        self.prefix_queries = self.prefix_hits = self.num_steps = 0

    def info(self) -> EngineCoreInfo:
        e = self.engine
        fields = frozenset().union(*(getattr(p, "sampling_fields", ()) for p in (e.scheduler, e.model_runner)))
        return EngineCoreInfo(e.args.max_model_len, e.model.config.vocab_size,
                              CacheShape(e.block_manager.num_blocks, e.block_manager.block_size),
                              fields, hasattr(e.model_runner.sampler, "logprobs"))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.sent[request.request_id] = 0
        self.core.add_request(request.request_id, request.seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # unknown or finished ids are ignored
            self.core.abort_request(rid)
            self.sent.pop(rid, None)

    def has_work(self) -> bool:
        return not self.core.scheduler.is_finished()

    def step(self) -> EngineCoreOutputs:
        """Run one step; an `EngineCoreOutput` per sequence that got a token."""
        seqs = self.core.step()
        self.num_steps += 1
        logprobs = getattr(self.engine.model_runner.sampler, "logprobs", {})
        return EngineCoreOutputs([self.output(s, logprobs) for s in seqs], self.scheduler_stats(), time.monotonic())

    def output(self, seq: Sequence, logprobs: dict) -> EngineCoreOutput:
        rid, sent = seq.request_id, self.sent.get(seq.request_id, 0)
        cached = self.core.num_cached_tokens.get(rid, 0)
        if sent == 0:  # its first token: count its prefix-cache lookup
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += cached
        new = seq.completion_token_ids[sent:]
        rows = [logprobs[seq.seq_id]] if seq.seq_id in logprobs else None
        if seq.is_finished:
            self.sent.pop(rid, None)
            self.core.num_cached_tokens.pop(rid, None)
        else:
            self.sent[rid] = sent + len(new)
        return EngineCoreOutput(rid, new, seq.finish_reason, rows, cached)

    def scheduler_stats(self) -> SchedulerStats:
        sched, bm = self.core.scheduler, self.engine.block_manager
        stats = SchedulerStats(len(sched.running), len(sched.waiting), 1 - bm.num_free_blocks / bm.num_blocks,
                               sched.num_preemptions, self.prefix_queries, self.prefix_hits, self.num_steps)
        self.prefix_queries = self.prefix_hits = 0  # per step
        return stats


def build_engine_core(args: EngineArgs) -> EngineCoreProc:
    """The engine core for `args` (every piece given, e.g. by `defaults.complete_engine_args`)."""
    return EngineCoreProc(LLMEngine(**dataclasses.asdict(args)))


class InprocClient:
    """The engine core in this process (vLLM V1's `InprocClient`): adds and aborts wait in a queue and
    are applied by `get_output` just before it steps, so the thread that calls `get_output` is the only
    one that touches the engine (an asyncio front end calls it in a worker thread: the "engine thread").

    Args: args, an `EngineArgs` with every piece given. Attributes: info (`EngineCoreInfo`), proc.
    """

    def __init__(self, args: EngineArgs):
        self.proc = build_engine_core(args)
        self.info = self.proc.info()
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self.pending.put(("add", pickle.loads(pickle.dumps(request))))  # a copy, as if sent: the front end keeps its own

    def abort_requests(self, request_ids: list[str]) -> None:
        self.pending.put(("abort", list(request_ids)))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Apply what is queued, then step. While there is nothing to run, wait for a message, at most
        `timeout` s (None: for ever): then no outputs. Raises EngineDeadError after `shutdown`."""
        aborted = False
        while not self.stopped:
            try:
                message = self.pending.get(block=not (self.proc.has_work() or aborted), timeout=timeout)
            except queue.Empty:
                if self.proc.has_work():
                    return self.proc.step()
                return EngineCoreOutputs([], self.proc.scheduler_stats() if aborted else None)
            self.stopped, aborted = not handle_message(self.proc, message), aborted or message[0] == "abort"
        raise EngineDeadError("the engine core was shut down")

    async def get_output_async(self) -> EngineCoreOutputs:
        """`get_output` in a worker thread (the engine thread); an idle wait ends after 0.1 s, so the
        thread never outlives the event loop by more."""
        return await asyncio.to_thread(self.get_output, 0.1)

    def is_alive(self) -> bool:
        return not self.stopped

    def shutdown(self) -> None:
        self.pending.put(("shutdown", None))


def handle_message(proc: EngineCoreProc, message: tuple) -> bool:
    """Apply one message from the front end: ("add", EngineCoreRequest), ("abort", [ids]) or
    ("shutdown", None). Returns False for "shutdown"."""
    kind, payload = message
    if kind == "add":
        proc.add_request(payload)
    elif kind == "abort":
        proc.abort_requests(payload)
    return kind != "shutdown"


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (prctl PR_SET_PDEATHSIG), so no engine core
    outlives a crashed or killed front end. Elsewhere `run_engine_core` also polls the parent's id."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, parent_pid: int) -> None:
    """The engine core process's busy loop (vLLM V1's `EngineCoreProc.run_busy_loop`): take every message
    waiting on the input socket (wait for one while idle), step when there is work, send the step's
    `EngineCoreOutputs`. Sends ("ready", `EngineCoreInfo`) first; on any error sends ("error", text) and exits."""
    import zmq

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops us
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    try:
        proc = build_engine_core(args)
        outputs.send(pickle.dumps(("ready", proc.info())))
        running = True
        while running and os.getppid() == parent_pid:
            wait_ms, aborted = 0 if proc.has_work() else 500, False
            while running and inputs.poll(wait_ms):
                message = pickle.loads(inputs.recv())
                running, wait_ms, aborted = handle_message(proc, message), 0, aborted or message[0] == "abort"
            if running and (proc.has_work() or aborted):  # after aborts, idle: the stats still go out
                step = proc.step() if proc.has_work() else EngineCoreOutputs([], proc.scheduler_stats())
                outputs.send(pickle.dumps(("outputs", step), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        outputs.send(pickle.dumps(("error", traceback.format_exc())))
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()


# what the engine core's interpreter runs: its arguments come pickled on stdin
ENGINE_CORE_MAIN = ("import pickle, sys; from minivllm.engine.core_client import run_engine_core; "
                    "run_engine_core(*pickle.load(sys.stdin.buffer))")


class MPClient:
    """The engine core in a process of its own, over two ZMQ sockets on Unix-domain paths (vLLM V1's
    `MPClient`): PUSH requests and aborts in, PULL `EngineCoreOutputs` out. Messages are pickled: both
    ends run this same code, they carry `Sequence`s and dataclasses as they are, and a few hundred bytes
    per step cost microseconds (vLLM uses msgspec with its own types for speed and safety; pickle must
    never read bytes from an untrusted peer, and here the peer is our own child process).

    The child is a fresh interpreter (`subprocess`, `ENGINE_CORE_MAIN`), so it works the same from a
    script, a notebook or a server, and never re-runs the caller's `__main__`.
    Args: args, an `EngineArgs` with every piece given; startup_timeout (s) for the model to load.
    Attributes: info (`EngineCoreInfo`), process (the child's `subprocess.Popen`).
    Raises: EngineDeadError if the engine core fails to start (its traceback in the message).
    """

    def __init__(self, args: EngineArgs, startup_timeout: float = 300.0):
        import zmq

        self.folder = tempfile.TemporaryDirectory(prefix="minivllm-zmq-")
        addresses = [f"ipc://{self.folder.name}/{name}" for name in ("input", "output")]
        self.ctx = zmq.Context()
        self.input, self.output = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.input.bind(addresses[0])
        self.output.bind(addresses[1])
        self.process = subprocess.Popen([sys.executable, "-c", ENGINE_CORE_MAIN], stdin=subprocess.PIPE)
        self.process.stdin.write(pickle.dumps((args, *addresses, os.getpid())))
        self.process.stdin.close()
        atexit.register(self.shutdown)
        self.info = self._receive(startup_timeout, expect="ready")
        self._async_output = None

    def _receive(self, timeout: float | None, expect: str = "outputs"):
        """The next message's payload; EngineDeadError if the process died or sent an error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.output.poll(200):
            if not self.is_alive():
                raise EngineDeadError(f"the engine core process exited (code {self.process.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not answer within {timeout} s")
        return self._payload(self.output.recv(), expect)

    def _payload(self, frame: bytes, expect: str):
        kind, payload = pickle.loads(frame)
        if kind == "error":
            raise EngineDeadError(f"the engine core failed:\n{payload}")
        assert kind == expect, (kind, expect)
        return payload

    def add_request(self, request: EngineCoreRequest) -> None:
        self.input.send(pickle.dumps(("add", request), protocol=pickle.HIGHEST_PROTOCOL))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.input.send(pickle.dumps(("abort", list(request_ids))))

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (waits for them). Raises EngineDeadError."""
        return self._receive(None)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs, awaited on the event loop (zmq.asyncio). Raises EngineDeadError
        when the process has died, checked every 0.2 s while waiting."""
        import zmq.asyncio

        loop = asyncio.get_running_loop()
        if self._async_output is None or self._async_output[0] is not loop:  # one shadow socket per event loop
            self._async_output = (loop, zmq.asyncio.Socket.from_socket(self.output))
        sock = self._async_output[1]
        while not await sock.poll(200):
            if not self.is_alive():
                raise EngineDeadError(f"the engine core process exited (code {self.process.returncode})")
        return self._payload(await sock.recv(), "outputs")

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine core to stop; kill it if it has not within `timeout` s. Idempotent."""
        if self.is_alive():
            try:
                self.input.send(pickle.dumps(("shutdown", None)), flags=1)  # 1 = zmq.NOBLOCK
            except Exception:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        if self.ctx.closed:
            return
        atexit.unregister(self.shutdown)
        for sock in (self.input, self.output):
            sock.close(linger=0)
        self.ctx.term()
        self.folder.cleanup()
