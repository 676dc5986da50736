"""Data parallelism: `data_parallel_size` engine cores, each a whole copy of the model in a process of its own
(chapter 12's `MPClient`, tensor parallel inside if asked), behind one client that sends each request to the
least-loaded core (exported from notebooks/13_scaling_out.ipynb). After vLLM V1's `DPLBAsyncMPClient`
(vllm/v1/engine/core_client.py) and `DPCoordinator` (vllm/v1/engine/coordinator.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import pickle
import time
import weakref
from dataclasses import dataclass

import torch

from ..config import resolve_device
from ..engine.async_llm import front_end_processor
from ..engine.core_client import EngineCoreOutputs, EngineCoreRequest, EngineDeadError, MPClient
from ..engine.core_output_processor import CoreOutputProcessor
from ..metrics.stats import SchedulerStats
from ..outputs import RequestOutput
from ..sequence import Sequence
from ..transformers_utils.model_files import has_tokenizer, load_tokenizer, resolve_model
from ..utils.checks import known_arguments
from .executor import ParallelLLMEngine
from .parallel_state import ParallelEngineArgs

WAITING_WEIGHT = 4  # vLLM's DPLBAsyncMPClient: score = waiting * 4 + running
SEND_TIMEOUT_MS = 2000  # a core that cannot take a message this long is dead or stuck


def core_args(args: ParallelEngineArgs, index: int) -> ParallelEngineArgs:
    """Engine core `index`'s settings: a copy of `args` with `data_parallel_size=1`. Each core is a
    tensor-parallel group of its own, so when a rendezvous port is given (`master_port` or `MASTER_PORT`)
    core i's ranks meet at that port + i; without one each core picks a free port."""
    port = args.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    return dataclasses.replace(args, data_parallel_size=1, master_port=None if port is None else port + index)


def core_env(args: ParallelEngineArgs, index: int) -> dict[str, str]:
    """Engine core `index`'s environment variables: this process's, plus the core's share of the machine.

    On a CPU: `OMP_NUM_THREADS` = this process's torch threads // `data_parallel_size` (at least 1), so
    the cores' OpenMP threads do not fight over the same CPU cores. On CUDA: `CUDA_VISIBLE_DEVICES` = the
    core's `tensor_parallel_size` devices (core i gets devices [i * tp, (i + 1) * tp) of those visible
    here), as vLLM gives each data-parallel rank GPUs of its own.
    Raises: ValueError if CUDA has fewer devices than tp * dp, or `device` names one CUDA device."""
    env, dp, tp = dict(os.environ), args.data_parallel_size, args.tensor_parallel_size
    device = resolve_device(args.device)
    if device.type == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // dp))
    elif device.type == "cuda" and dp > 1:
        if device.index is not None:
            raise ValueError(f"device={args.device!r} with data_parallel_size={dp}: give device='cuda', "
                             "each engine core gets CUDA devices of its own")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(ids) < tp * dp:
            raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} CUDA "
                             f"devices; {len(ids)} are visible here")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * tp:(index + 1) * tp])
    return env


class _StartingCore(MPClient):
    """An `MPClient` whose `__init__` starts the engine core's process without waiting for its "ready"
    message: `start_engine_cores` starts every core first, from this thread (a child started from another
    thread would die with that thread: `die_with_parent`'s signal follows the thread that started it),
    then waits for all of them at once (`wait_until_ready`)."""

    info = None  # until `wait_ready`

    def _receive(self, timeout: float | None, expect: str = "outputs"):
        return None if expect == "ready" and self.info is None else super()._receive(timeout, expect)

    def wait_ready(self) -> None:
        """Read the core's "ready" message (it is there, or the core has died). Raises EngineDeadError."""
        self.info = super()._receive(None, expect="ready")


def wait_until_ready(cores: list[_StartingCore], timeout: float) -> None:
    """Wait until every core has loaded the model, `timeout` s at most, watching all of them at once.
    Raises EngineDeadError naming the first core that failed (with its traceback), or those not ready."""
    import zmq

    deadline, pending = time.monotonic() + timeout, dict(enumerate(cores))
    while pending:
        poller = zmq.Poller()
        for core in pending.values():
            poller.register(core.output, zmq.POLLIN)
        ready = dict(poller.poll(200))
        for i, core in list(pending.items()):
            if core.output in ready or not core.is_alive():
                try:
                    core.wait_ready()
                except EngineDeadError as e:
                    raise EngineDeadError(f"data-parallel engine core {i} failed to start: {e}") from None
                del pending[i]
        if pending and time.monotonic() > deadline:
            raise EngineDeadError(f"data-parallel engine cores {sorted(pending)} did not start within {timeout} s")


def start_engine_cores(args: ParallelEngineArgs, engine_cls: type = ParallelLLMEngine,
                       startup_timeout: float = 300.0) -> list[MPClient]:
    """Start `args.data_parallel_size` engine cores (`MPClient(core_args(args, i), engine_cls=engine_cls,
    env=core_env(args, i))`), which load the model at the same time, each in its own process, and wait
    for all of them. If one fails, the others are killed at once (they need not finish loading).

    Raises: ValueError for a bad setting (before any process starts); EngineDeadError naming the first
        core that failed, with its error (the core's traceback)."""
    envs = [core_env(args, i) for i in range(args.data_parallel_size)]
    cores: list[_StartingCore] = []
    try:
        for i, env in enumerate(envs):
            cores.append(_StartingCore(core_args(args, i), startup_timeout, engine_cls, env))
        wait_until_ready(cores, startup_timeout)
    except BaseException:
        for core in cores:
            if core.is_alive():
                core.process.kill()
            core.shutdown()
        raise
    return cores

# ------------------------------------------------------------------------------------------------------
class _LoadBalancer:
    """`DPClient`'s routing (vLLM V1's `DPLBAsyncMPClient.get_core_engine_for_request`): each request goes
    to the live core with the lowest score `waiting * 4 + running` (ties: the lowest index). A core's counts
    are those of its latest `SchedulerStats`, plus the requests sent to it since that report, counted as
    waiting (vLLM counts them the same way between the `DPCoordinator`'s updates). Uses `cores` and
    `dead`, and the tables its `_init_balancer` makes: latest, sent_since_report, owner, num_routed."""

    def _init_balancer(self, n: int) -> None:
        self.latest = [SchedulerStats() for _ in range(n)]  # each core's latest report
        self.sent_since_report = [0] * n
        self.owner: dict[str, int] = {}  # engine-core request id -> the core that runs it
        self.num_routed = [0] * n  # requests sent to each core, in all

    def loads(self) -> list[tuple[int, int] | None]:
        """Each core's `(waiting, running)` as the front end counts them; None for a dead core."""
        return [None if i in self.dead else (s.num_waiting + self.sent_since_report[i], s.num_running)
                for i, s in enumerate(self.latest)]

    def choose_core(self) -> int:
        """The core the next request goes to. Raises EngineDeadError when every core has died."""
        scores = [(load[0] * WAITING_WEIGHT + load[1], i) for i, load in enumerate(self.loads())
                  if load is not None and self.cores[i].is_alive()]
        if not scores:
            raise EngineDeadError(self.all_dead_message())
        return min(scores)[1]

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send `request` to the least-loaded live core and remember that core as its owner."""
        i = self.choose_core()
        self._send(i, self.cores[i].add_request, request)
        self.owner[request.request_id] = i
        self.sent_since_report[i] += 1
        self.num_routed[i] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort each request on the core that owns it (unknown, finished or lost ids are ignored)."""
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            if (i := self.owner.pop(rid, None)) is not None and i not in self.dead:
                by_core.setdefault(i, []).append(rid)
        for i, ids in by_core.items():
            self._send(i, self.cores[i].abort_requests, ids)

    def _send(self, i: int, send, payload) -> None:
        """`send(payload)` to core i. A core that cannot take a message within `SEND_TIMEOUT_MS` (a PUSH
        socket waits for ever once its peer is gone) is dead or stuck: it is killed, and its requests
        fail with it (`get_output` finds it dead)."""
        import zmq

        try:
            send(payload)
        except zmq.Again:
            self.cores[i].process.kill()

    def _received(self, i: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Core i's outputs, tagged with `engine_index=i`, with the merged stats: its finished requests
        are forgotten, its report becomes its load."""
        outputs.engine_index = i
        for out in outputs.outputs:
            if out.finish_reason is not None and self.owner.get(out.request_id) == i:
                del self.owner[out.request_id]
        if outputs.scheduler_stats is not None:
            self.latest[i], self.sent_since_report[i] = outputs.scheduler_stats, 0
            outputs.scheduler_stats = self.merged_stats(i)
        return outputs

# ------------------------------------------------------------------------------------------------------
class _MergedStats:
    """`DPClient`'s view of all its cores as one engine (what `/metrics` shows). Uses `latest` and `dead`."""

    def merged_stats(self, reporter: int | None) -> SchedulerStats:
        """One `SchedulerStats` for all cores, after core `reporter` reported (None: after a core died).

        Gauges: `num_running` and `num_waiting` are summed over the live cores' latest reports;
        `kv_cache_usage` is their mean (every core has a cache of the same size, so the mean is the
        fraction of all live blocks in use). Counters over a core's life (`num_preemptions`, `num_steps`)
        are summed over every core's latest report, a dead core's included, so they never go down. The
        per-step prefix-cache counts come from `reporter` alone (the others' were passed on before)."""
        live = [s for i, s in enumerate(self.latest) if i not in self.dead]
        step = self.latest[reporter] if reporter is not None else SchedulerStats()
        return SchedulerStats(
            num_running=sum(s.num_running for s in live), num_waiting=sum(s.num_waiting for s in live),
            kv_cache_usage=sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0,
            num_preemptions=sum(s.num_preemptions for s in self.latest),
            prefix_cache_queries=step.prefix_cache_queries, prefix_cache_hits=step.prefix_cache_hits,
            num_steps=sum(s.num_steps for s in self.latest))

    def _core_died(self, i: int, error: EngineDeadError) -> EngineCoreOutputs:
        """Core i has died: make sure its process is gone, and return outputs that name its requests as
        failed (`failed_request_ids`, `failure`), with the merged stats of the cores left."""
        core = self.cores[i]
        if core.is_alive():  # it sent an error and is on its way out
            core.process.kill()
        core.process.wait()
        self.dead[i] = f"data-parallel engine core {i} (pid {core.process.pid}) died: {error}"
        failed = [rid for rid, owner in self.owner.items() if owner == i]
        for rid in failed:
            del self.owner[rid]
        return EngineCoreOutputs([], self.merged_stats(None), engine_index=i, failed_request_ids=failed,
                                 failure=self.dead[i])

    def all_dead_message(self) -> str:
        return f"all {len(self.cores)} data-parallel engine cores have died: " + "; ".join(self.dead.values())

# ------------------------------------------------------------------------------------------------------
class _DPOutputs(_LoadBalancer, _MergedStats):
    """`DPClient`'s outputs: the next `EngineCoreOutputs` of any core, the cores taken in turn."""

    def _in_turn(self) -> list[int]:
        """The live cores, starting after the one read last (so a busy core cannot starve the others)."""
        n = len(self.cores)
        return sorted((i for i in range(n) if i not in self.dead), key=lambda i: (i - self.next_core) % n)

    def _take(self, i: int, receive) -> EngineCoreOutputs:
        self.next_core = i + 1
        try:
            return self._received(i, receive())
        except EngineDeadError as e:
            return self._core_died(i, e)

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any core (waits for them). A dead core (its process exited, or it sent an
        error) gives outputs with its requests in `failed_request_ids`, once its last messages are read.
        Raises EngineDeadError when every core has died."""
        import zmq

        while True:
            live = self._in_turn()
            if not live:
                raise EngineDeadError(self.all_dead_message())
            poller = zmq.Poller()
            for i in live:
                poller.register(self.cores[i].output, zmq.POLLIN)
            ready = dict(poller.poll(200))
            for i in live:  # MPClient.get_output raises EngineDeadError once a dead core's socket is empty
                if self.cores[i].output in ready or not self.cores[i].is_alive():
                    return self._take(i, self.cores[i].get_output)

    async def get_output_async(self) -> EngineCoreOutputs:
        """`get_output` on the event loop: one task per core awaits its `get_output_async`; the first to
        finish (in turn, when several have) is returned, the others keep waiting for the next call."""
        loop = asyncio.get_running_loop()
        if self.tasks_loop is not loop:  # a new loop: the old one's unfinished tasks were cancelled with it
            self.tasks = {i: t for i, t in self.tasks.items() if t.done() and not t.cancelled()}
            self.tasks_loop = loop
        while True:
            live = self._in_turn()
            if not live:
                raise EngineDeadError(self.all_dead_message())
            for i in live:
                if i not in self.tasks:
                    self.tasks[i] = loop.create_task(self.cores[i].get_output_async())
            done = [i for i in live if self.tasks[i].done()]
            if done:
                return self._take(done[0], self.tasks.pop(done[0]).result)
            await asyncio.wait([self.tasks[i] for i in live], return_when=asyncio.FIRST_COMPLETED)

# ------------------------------------------------------------------------------------------------------
class DPClient(_DPOutputs):
    """`data_parallel_size` engine cores behind the interface of chapter 12's `MPClient` (vLLM V1's
    `DPLBAsyncMPClient`): each core is an `MPClient` running `engine_cls` (tensor parallel inside when
    `tensor_parallel_size` > 1: tp x dp processes), started at once (`start_engine_cores`); each request
    goes to the least-loaded core (`_LoadBalancer`); outputs come from any core, with the cores' stats
    merged (`merged_stats`). A request's `n` completions are routed one by one, as vLLM does, so they
    may run on different cores (and then do not share their prompt's blocks).

    A core that dies fails only its own requests: the next outputs carry their ids in
    `failed_request_ids` (AsyncLLM's output handler raises `EngineDeadError(failure)` in those requests'
    `generate()`), and the other cores go on serving.

    Args: args, a `ParallelEngineArgs` with every piece given; startup_timeout (s) for each core to load
        the model; engine_cls (see `build_engine_core`).
    Attributes: cores (`MPClient`s), info (core 0's `EngineCoreInfo`: all cores run the same model and
        settings), owner (request id -> core), dead (core -> why), num_routed (requests sent to each core).
    Raises: ValueError for a bad setting; EngineDeadError if a core fails to start (the others are stopped).
    """

    def __init__(self, args: ParallelEngineArgs, startup_timeout: float = 300.0,
                 engine_cls: type = ParallelLLMEngine):
        if not isinstance(args, ParallelEngineArgs):
            raise ValueError(f"DPClient needs a ParallelEngineArgs (it has data_parallel_size), got "
                             f"{type(args).__name__}")
        args.check()
        import zmq

        self.cores = start_engine_cores(args, engine_cls, startup_timeout)
        for core in self.cores:
            core.input.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.info = self.cores[0].info
        self.dead: dict[int, str] = {}
        self._init_balancer(len(self.cores))
        self.next_core, self.tasks, self.tasks_loop = 0, {}, None

    def is_alive(self) -> bool:
        """Whether some core still runs (requests are refused only when none does)."""
        return any(i not in self.dead and core.is_alive() for i, core in enumerate(self.cores))

    def shutdown(self) -> None:
        """Stop every core and its process (and its tensor-parallel ranks). Idempotent."""
        import zmq

        for task in self.tasks.values():
            if not task.done():
                try:
                    task.cancel()
                except RuntimeError:  # its event loop is closed
                    pass
            elif not task.cancelled():
                task.exception()  # read, so asyncio does not log it as never retrieved
        self.tasks = {}
        for core in self.cores:  # ask them all first: each takes about a second to exit
            try:
                if core.is_alive() and not core.ctx.closed:
                    core.input.send(pickle.dumps(("shutdown", None)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # it cannot take the message: `shutdown` kills it
                pass
        for core in self.cores:
            core.shutdown()

# ------------------------------------------------------------------------------------------------------
@dataclass
class DPStepStats:
    """One engine core's step as the front end sees it in the core's outputs (for `run_to_completion`'s
    progress bar, like chapter 04's `StepStats`).

    Attributes: is_prefill (some sequence got its first token), num_seqs (sequences that got a token),
        num_tokens (tokens computed: the uncached prompt tokens of first tokens, one per other token; a
        chunk of a prompt that brought no token is counted with the chunk that does), seconds (the step's
        end, as the core stamped it, minus the latest of its previous step's end and its requests' arrival;
        `time.monotonic()` is one clock for all processes of a machine), engine_index (the core).
    """

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    seconds: float
    engine_index: int


class DPOutputProcessor:
    """`LLMEngine.output_processor`'s interface (`add_request(id, seq) -> id`, `abort_request`, `process`)
    over a `DPClient`: chapter 12's `CoreOutputProcessor` follows each request in this process (text, stop
    strings, n > 1 as n engine-core requests), the client sends them to the cores.

    Args: tokenizer (None: token ids only); client (a `DPClient`). Attributes: front (the
        `CoreOutputProcessor`), client.
    """

    def __init__(self, tokenizer, client: DPClient):
        self.front, self.client = CoreOutputProcessor(tokenizer), client
        self._ids = itertools.count()

    def add_request(self, request_id: str | int | None, seq: Sequence) -> str:
        """Follow a checked sequence and send its completions to the cores; returns its id (a fresh one
        for None). Raises ValueError: the id is in use; EngineDeadError: every core has died."""
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.front.requests)
        for request in self.front.add_request(str(request_id), seq, time.monotonic()):
            self.client.add_request(request)
        return str(request_id)

    def abort_request(self, request_id: str | int) -> None:
        """Stop following a request and abort its completions on their cores (unknown ids are ignored)."""
        core_ids, _ = self.front.abort_request(str(request_id), time.monotonic())
        if core_ids:
            self.client.abort_requests(core_ids)

    def process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """The `RequestOutput`s of one core's outputs; what stopped here is aborted in the core.
        Raises EngineDeadError (naming the core) when requests followed here were lost with their core:
        they are forgotten first, and their completions on other cores aborted."""
        front = self.front
        lost = {front.states[c][0].request_id for c in core_outputs.failed_request_ids if c in front.states}
        for request_id in lost:
            self.abort_request(request_id)
        if lost:
            raise EngineDeadError(f"{core_outputs.failure}; its requests {sorted(lost)} are lost")
        outputs, to_abort, _ = front.process_outputs(core_outputs.outputs, time.monotonic())
        if to_abort:
            self.client.abort_requests(to_abort)
        return outputs

# ------------------------------------------------------------------------------------------------------
class _StepRecords:
    """`DataParallelLLMEngine.stats`: a `DPStepStats` per step of any core. Uses `output_processor.front`."""

    def _step_stats(self, core_outputs: EngineCoreOutputs) -> DPStepStats | None:
        """What a core's step did, read before its outputs are processed; None for messages that are no
        step (the state after aborts, a core's death)."""
        i, front = core_outputs.engine_index, self.output_processor.front
        if not core_outputs.timestamp:
            return None
        start, num_tokens, is_prefill = self._step_ends.get(i, 0.0), 0, False
        for out in core_outputs.outputs:
            if (entry := front.states.get(out.request_id)) is None:
                continue
            seq, start = entry[1].seq, max(start, front.times[out.request_id].arrival)
            if seq.num_completion_tokens == 0:
                is_prefill, num_tokens = True, num_tokens + seq.num_prompt_tokens - out.num_cached_tokens
            else:
                num_tokens += len(out.new_token_ids)
        self._step_ends[i] = core_outputs.timestamp
        seconds = core_outputs.timestamp - start if start else 0.0
        return DPStepStats(is_prefill, len(core_outputs.outputs), num_tokens, max(seconds, 0.0), i)

# ------------------------------------------------------------------------------------------------------
class DataParallelLLMEngine(_StepRecords):
    """The engine `LLM` builds when `data_parallel_size` > 1: a `DPClient` (the engine cores, each in a
    process of its own) with chapter 12's front end in this process (`Processor` from the cores' `info`,
    `CoreOutputProcessor` through `DPOutputProcessor`), behind `LLMEngine`'s interface: `add_request`,
    `step`, `abort_request`, `has_unfinished_requests`, `get_num_unfinished_requests`, `get_tokenizer`,
    `stats`. `step` returns the outputs of one core's step. After vLLM's `LLM` with `data_parallel_size`.

    A request whose core died makes `step` (and so `LLM.generate`) raise EngineDeadError naming the
    core; the engine goes on serving later requests on the cores left.

    Args: **kwargs, the fields of `ParallelEngineArgs` with every piece given (as `LLM` completes them).
    Attributes: args, client, tokenizer, processor, output_processor, stats (`DPStepStats` per step).
    Raises: ValueError for a bad setting; EngineDeadError if a core fails to start.
    """

    args_cls = ParallelEngineArgs
    client_cls = DPClient  # a subclass may record or route otherwise

    def __init__(self, **kwargs):
        fields = {f.name for f in dataclasses.fields(self.args_cls)}
        self.args = args = self.args_cls(**known_arguments(type(self).__name__, kwargs, fields, {}))
        args.check()
        path = resolve_model(args.model)
        self.tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
        self.client = self.client_cls(args)
        self._finalizer = weakref.finalize(self, self.client.shutdown)  # also at exit
        self.output_processor = DPOutputProcessor(self.tokenizer, self.client)
        self.processor = front_end_processor(self.tokenizer, self.client.info, self.output_processor.front)
        self.stats: list[DPStepStats] = []
        self._step_ends: dict[int, float] = {}  # core -> when its latest step ended (its clock)

    def add_request(self, request_id: str | int | None, prompt, sampling_params=None) -> str:
        """Check a request (see `Processor.process`) and send it; returns its id. Raises ValueError."""
        return self.output_processor.add_request(request_id, self.processor.process(prompt, sampling_params))

    def step(self) -> list[RequestOutput]:
        """The outputs of the next step of any core (waits for one). Raises EngineDeadError (see above)."""
        core_outputs = self.client.get_output()
        if (record := self._step_stats(core_outputs)) is not None:
            self.stats.append(record)
        return self.output_processor.process(core_outputs)

    def abort_request(self, request_id: str | int | list) -> None:
        """Stop requests wherever they are (unknown ids are ignored, as in vLLM)."""
        for rid in request_id if isinstance(request_id, (list, tuple, set)) else [request_id]:
            self.output_processor.abort_request(rid)

    def get_tokenizer(self):
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.front.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.front.requests)

    def shutdown(self) -> None:
        """Stop the engine cores (their processes too). Idempotent."""
        self._finalizer()
