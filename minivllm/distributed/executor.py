"""Tensor parallelism in the engine: a process per rank, rank 0 drives (exported from
notebooks/13_scaling_out.ipynb). Rank 0 runs the scheduler, the block manager and the sampler as before;
before each forward pass it sends the step's plan to the other ranks, and all of them run the same pass
over their shard. After vLLM V1's `MultiprocExecutor` and nano-vllm's `ModelRunner` (rank 0 ships each
call to the others)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import weakref

import torch
import torch.distributed as dist

from ..engine.core_client import die_with_parent
from ..engine.llm_engine import LLMEngine
from ..model_executor.layers.parallel_linear import TPGroup
from ..model_executor.model_loader import load_config
from ..model_executor.tensor_parallel import check_tensor_parallel, load_sharded_model
from ..worker.mixed_batch import MixedBatchModelRunner
from ..worker.model_runner import ModelRunner
from .parallel_state import (ParallelEngineArgs, destroy_tensor_parallel, init_tensor_parallel, local_ranks,
                             rendezvous)


def send_plan(tp: TPGroup, method: str, *args) -> None:
    """Rank 0: send `(method, args)` to every other rank (pickled, one broadcast on the control group)."""
    dist.broadcast_object_list([(method, args)], src=0, group=tp.control)


def receive_plan(tp: TPGroup) -> tuple[str, tuple]:
    """Another rank: wait for rank 0's next `(method, args)`."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


class _TensorParallelDriver:
    """Rank 0's side of a model runner: each call that runs the model (`run`, `prompt_logits`) or
    touches the KV cache (`copy_blocks`) is first sent to the other ranks, which make the same call on
    their shard (`WorkerRunner`). The step's sequences travel whole, so every rank sees the same tokens
    even after a preemption (nano-vllm#144: workers that kept only the last token diverged)."""

    def __init__(self, model, block_manager, generator=None, attention_backend: type | None = None):
        self.tp = model.tp_group
        send_plan(self.tp, "init_runner", self.base_runner_cls, block_manager.num_blocks,
                  block_manager.block_size, attention_backend, self.prefill_microbatch_tokens)
        super().__init__(model, block_manager, generator, attention_backend)

    def run(self, seqs, is_prefill: bool):
        # EXERCISE ch13_ex4 (5 points): the other ranks run the same step, then this one (which samples)
        ### BEGIN SOLUTION
        send_plan(self.tp, "run", seqs, is_prefill)
        return super().run(seqs, is_prefill)
        ### END SOLUTION

    def copy_blocks(self, block_pairs) -> None:
        send_plan(self.tp, "copy_blocks", block_pairs)
        super().copy_blocks(block_pairs)

    def prompt_logits(self, token_ids):
        send_plan(self.tp, "prompt_logits", token_ids)
        return super().prompt_logits(token_ids)


class TensorParallelModelRunner(_TensorParallelDriver, ModelRunner):
    """Chapter 04's `ModelRunner` on rank 0 of a tensor-parallel model. Args: as `ModelRunner`."""

    base_runner_cls = ModelRunner  # what the other ranks run


class TensorParallelMixedBatchModelRunner(_TensorParallelDriver, MixedBatchModelRunner):
    """Chapter 11's `MixedBatchModelRunner` on rank 0 of a tensor-parallel model. Args: as it."""

    base_runner_cls = MixedBatchModelRunner


class _NoSampling:
    """A worker's runner samples nothing: rank 0 alone holds the gathered logits."""

    def sample(self, seqs, logits):
        return [None] * len(seqs)


class _CacheShape:
    """What a runner reads of its block manager: the number of blocks and their size."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size


def loaded_everywhere(load):
    """Run `load()` on this rank and tell the others whether it worked (one all-reduce on the default
    gloo group, which fails after the timeout if a rank is gone): every rank raises if one failed."""
    try:
        result, error = load(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        result, error = None, e
    ok = torch.tensor([0 if error else 1])
    dist.all_reduce(ok)
    if error is not None:
        raise error
    if ok.item() != dist.get_world_size():
        raise RuntimeError(f"{dist.get_world_size() - ok.item()} tensor-parallel rank(s) failed to load the model")
    return result


def run_worker(rank: int, world_size: int, addr: str, port: int, device: str, timeout_s: float,
               num_threads: int, watch_parent: bool) -> None:
    """A worker rank's life (rank > 0): join the group, then do what rank 0 sends until "shutdown".
    "load_model" loads this rank's shard; "init_runner" builds a runner of the class rank 0 runs (with
    its KV cache of this rank's heads); any other message is that runner's method. A rank that fails
    (or loses rank 0) leaves the group, so the others' collectives raise instead of waiting."""
    if watch_parent:
        die_with_parent()
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    else:
        torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, world_size, addr, port, device, timeout_s)
    model = runner = None
    try:
        while True:
            method, args = receive_plan(tp)
            if method == "shutdown":
                break
            if method == "load_model":
                model = loaded_everywhere(lambda: load_sharded_model(args[0], args[1], device, tp))
            elif method == "init_runner":
                cls, num_blocks, block_size, backend, microbatch = args
                runner = type(f"Worker{cls.__name__}", (_NoSampling, cls), {"prefill_microbatch_tokens": microbatch})(
                    model, _CacheShape(num_blocks, block_size), None, backend)
            else:
                getattr(runner, method)(*args)
    finally:
        destroy_tensor_parallel()


# what a worker's interpreter runs: its arguments come pickled on stdin (works from scripts and notebooks)
WORKER_MAIN = ("import pickle, sys; from minivllm.distributed.executor import run_worker; "
               "run_worker(*pickle.load(sys.stdin.buffer))")


def start_worker(rank: int, world_size: int, addr: str, port: int, device: str, timeout_s: float,
                 num_threads: int, watch_parent: bool = True) -> subprocess.Popen:
    """Start worker `rank` in a fresh interpreter (as chapter 12 starts its engine core)."""
    proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((rank, world_size, addr, port, device, timeout_s, num_threads, watch_parent)))
    proc.stdin.close()
    return proc


class ParallelLLMEngine(LLMEngine):
    """Chapter 04's `LLMEngine` with `tensor_parallel_size` ranks: `load_model` starts this machine's
    other ranks, joins them, and loads rank 0's shard; the model runner (a `_TensorParallelDriver`,
    from `minivllm.defaults`) drives them; `shutdown` stops them (also when the engine is collected
    or the interpreter exits). With one rank it is `LLMEngine`. On a CPU each local rank gets an equal
    share of this process's threads.

    Args: **kwargs, the fields of `ParallelEngineArgs`.
    Raises: ValueError for a model that cannot be split (before any process starts) or a bad setting;
        RuntimeError when a rank fails to start or load, within `distributed_timeout_seconds`.
    """

    args_cls = ParallelEngineArgs

    def load_model(self, path, dtype: torch.dtype, device: torch.device):
        args = self.args
        tp_size = args.tensor_parallel_size
        if tp_size == 1:
            return super().load_model(path, dtype, device)
        check_tensor_parallel(load_config(path), tp_size)  # before any process starts
        ranks = local_ranks(tp_size, args.nnodes, args.node_rank)
        if ranks.start != 0:
            raise ValueError(f"node_rank={args.node_rank}: the engine runs on node 0; start the other nodes' "
                             "ranks with `python -m minivllm worker`")
        addr, port = rendezvous(args)
        threads = max(1, torch.get_num_threads() // len(ranks))
        device_of = lambda r: str(device) if device.type == "cpu" else f"cuda:{r - ranks.start}"  # noqa: E731
        self.workers = [start_worker(r, tp_size, addr, port, device_of(r), args.distributed_timeout_seconds,
                                     threads) for r in ranks[1:]]
        tp_box: list[TPGroup] = []  # filled once this rank has joined
        self._finalizer = weakref.finalize(self, stop_workers, self.workers, tp_box)  # also runs at exit
        if device.type == "cpu":
            torch.set_num_threads(threads)
        tp = init_tensor_parallel(0, tp_size, addr, port, device, args.distributed_timeout_seconds)
        tp_box.append(tp)
        send_plan(tp, "load_model", path, dtype)
        return loaded_everywhere(lambda: load_sharded_model(path, dtype, device, tp))

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group. Idempotent."""
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()


def stop_workers(workers: list[subprocess.Popen], tp_box: list[TPGroup], timeout: float = 10.0) -> None:
    """Send "shutdown" to every rank (if this one joined: `tp_box`), leave the group, and kill any local
    worker still running after `timeout` s."""
    if tp_box:
        try:
            send_plan(tp_box.pop(), "shutdown")
        except Exception:  # noqa: BLE001 - a rank is gone; the kills below still run
            pass
        destroy_tensor_parallel()
    for proc in workers:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_node(tensor_parallel_size: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
             device: str = "cpu", timeout_s: float = 300.0) -> int:
    """Machine `node_rank` > 0 of a tensor-parallel engine: start this machine's ranks, which join rank 0
    (on node 0, where the engine runs) at `master_addr:master_port`, and wait until they end. Returns
    the first non-zero exit code of a rank (0 when the engine shut them down)."""
    ranks = local_ranks(tensor_parallel_size, nnodes, node_rank)
    threads = max(1, torch.get_num_threads() // len(ranks))
    device_of = lambda r: device if device == "cpu" else f"cuda:{r - ranks.start}"  # noqa: E731
    procs = [start_worker(r, tensor_parallel_size, master_addr, master_port, device_of(r), timeout_s, threads)
             for r in ranks]
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return next((c for c in codes if c), 0)
