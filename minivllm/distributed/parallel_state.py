"""Processes and their groups: the parallel settings, where the ranks meet (torchrun's rendezvous
conventions) and the tensor-parallel group (exported from notebooks/13_scaling_out.ipynb). After vLLM's
`ParallelConfig` and `vllm/distributed/parallel_state.py`."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import EngineArgs, resolve_device
from ..model_executor.layers.parallel_linear import TPGroup
from ..utils.checks import require_int, require_number

IDLE_TIMEOUT = timedelta(days=365)  # a worker may wait this long for rank 0's next step (an idle server)


@dataclass
class ParallelEngineArgs(EngineArgs):
    """`EngineArgs` with vLLM's parallel settings (its `ParallelConfig`).

    Attributes:
        tensor_parallel_size: ranks that split each layer (1: one process).
        data_parallel_size: engine cores, each with a whole copy of the model (chapter 12's processes).
        nnodes, node_rank: machines the ranks span and this one's index (torchrun's `--nnodes`, `--node-rank`).
        master_addr, master_port: where rank 0 waits for the others (torchrun's names; None: the
            `MASTER_ADDR` / `MASTER_PORT` variables, else this machine and a free port).
        distributed_timeout_seconds: how long a collective may wait for a rank before it raises.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    distributed_timeout_seconds: float = 300.0

    def check(self) -> None:
        """`EngineArgs.check`, then the parallel settings. Raises ValueError naming the setting."""
        super().check()
        self.tensor_parallel_size = require_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        self.data_parallel_size = require_int("data_parallel_size", self.data_parallel_size, minimum=1)
        self.nnodes = require_int("nnodes", self.nnodes, minimum=1)
        self.node_rank = require_int("node_rank", self.node_rank, minimum=0, maximum=self.nnodes - 1)
        if self.master_port is not None:
            self.master_port = require_int("master_port", self.master_port, minimum=1, maximum=65535)
        self.distributed_timeout_seconds = require_number("distributed_timeout_seconds",
                                                          self.distributed_timeout_seconds, minimum=1e-3)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not split evenly over "
                             f"nnodes={self.nnodes}")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs on one machine here; use nnodes > 1 with "
                             "tensor parallelism only")
        device = resolve_device(self.device)
        local = self.tensor_parallel_size // self.nnodes
        if device.type == "cuda" and local > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} puts {local} ranks on this "
                             f"machine but torch sees {torch.cuda.device_count()} CUDA devices (NCCL needs one each)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous(args: ParallelEngineArgs) -> tuple[str, int]:
    """Where rank 0 waits: `master_addr`/`master_port`, else torchrun's `MASTER_ADDR`/`MASTER_PORT`
    variables, else 127.0.0.1 and a free port (one machine only: other machines must be told the port).

    Raises: ValueError if several machines are asked for without a port to meet at."""
    addr = args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = args.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
    if port is None and args.nnodes > 1:
        raise ValueError(f"nnodes={args.nnodes}: give master_port (or MASTER_PORT) so the other machines can join")
    return addr, port or free_port(addr)


def local_ranks(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks on machine `node_rank`: a contiguous block of `tp_size / nnodes` (torchrun's layout)."""
    per_node = tp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def init_tensor_parallel(rank: int, world_size: int, addr: str, port: int, device: torch.device,
                         timeout_s: float) -> TPGroup:
    """Join the ranks (rank 0 listens at `addr:port`; `torch.distributed`'s TCP rendezvous) and return
    this rank's `TPGroup`: collectives on NCCL for CUDA tensors, gloo for CPU ones, each failing after
    `timeout_s`; the step plans on a gloo group that waits as long as an idle engine may.

    Raises: RuntimeError if the other ranks do not all arrive within `timeout_s`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process (shut the other down first)")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    group = dist.new_group(backend="nccl", timeout=timeout) if device.type == "cuda" else dist.group.WORLD
    return TPGroup(rank, world_size, group, control)


def destroy_tensor_parallel() -> None:
    """Leave the groups (every rank calls it at shutdown)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(sys_path: list[str], payload: bytes) -> None:
    import pickle
    import sys
    import traceback

    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # find `fn`'s module as the caller did
    fn, rank, world_size, port, result_path, args = pickle.loads(payload)
    torch.set_num_threads(1)
    try:
        tp = init_tensor_parallel(rank, world_size, "127.0.0.1", port, torch.device("cpu"), 60.0)
        try:
            answer = (True, fn(tp, *args))
        finally:
            destroy_tensor_parallel()
    except BaseException:  # noqa: BLE001 - sent to the caller, which raises it
        answer = (False, traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(answer, f)


# what a rank's interpreter runs: its function and arguments come pickled on stdin
RANK_MAIN = ("import pickle, sys; from minivllm.distributed.parallel_state import _rank_main; "
             "_rank_main(*pickle.load(sys.stdin.buffer))")


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run `fn(tp, *args)` on `world_size` fresh CPU processes joined in one gloo group, one thread each;
    returns each rank's result, by rank. `fn` must be importable (defined in a module, not a notebook
    cell): each rank is a fresh interpreter, as torchrun would start, and finds it by name.

    Raises: RuntimeError with a rank's traceback if it failed, or if the ranks did not all end in time.
    """
    import pickle
    import subprocess
    import sys
    import tempfile
    import time

    port, deadline = free_port(), time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="minivllm-ranks-") as folder:
        paths = [os.path.join(folder, f"rank{r}.pkl") for r in range(world_size)]
        procs = []
        for rank in range(world_size):
            procs.append(subprocess.Popen([sys.executable, "-c", RANK_MAIN], stdin=subprocess.PIPE))
            payload = pickle.dumps((fn, rank, world_size, port, paths[rank], args))
            procs[-1].stdin.write(pickle.dumps((sys.path, payload)))
            procs[-1].stdin.close()
        try:
            for proc in procs:
                proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the ranks did not all end within {timeout_s} s") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        answers = []
        for rank, path in enumerate(paths):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited (code {procs[rank].returncode}) without an answer")
            with open(path, "rb") as f:
                ok, value = pickle.load(f)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            answers.append(value)
    return answers
