"""The default assembly: which scheduler, block manager, attention backend, model runner, sampler and
output processor `LLM()` builds the engine from.

Written by hand, like `__init__.py`: it is the book's table of contents for the engine. Chapter 04's
`LLMEngine` uses exactly the pieces it is given; this small table, above all of them, says which
pieces `LLM` gives it. Each chapter that adds a piece adds its row here (the chapter shows the row).
The first row whose condition holds wins, so better pieces go first. Chapter 04's own pieces (the
prefill-first `Scheduler`, the contiguous reservation and `ContiguousAttention`) are `LLMEngine`'s
defaults and need no row. `LLM` picks the scheduler first: the rows after it may read `scheduler_cls`.
"""
from __future__ import annotations

from typing import Callable

import torch

from .core.block_manager import BlockManager
from .core.chunked_prefix_caching import ChunkedPrefixCachingBlockManager
from .core.sched.chunked_prefill import ChunkedPrefillScheduler
from .worker.mixed_batch import MixedBatchCUDAGraphModelRunner, MixedBatchModelRunner
from .config import EngineArgs
from .worker.cuda_graph import CUDAGraphModelRunner
from .attention.backends.cpu_attn import CPUPagedAttention
from .attention.backends.flash_attn import FlashAttnPagedAttention
from .attention.backends.triton_attn import TritonPagedAttention
from .engine.output_processor import OutputProcessor
from .attention.paged_attention import PagedAttention
from .core.prefix_caching import PrefixCachingBlockManager
from .sample.sampler import Sampler
from .distributed.executor import (ParallelLLMEngine, TensorParallelMixedBatchModelRunner,
                                   TensorParallelModelRunner)
from .distributed.parallel_state import ParallelEngineArgs
from .distributed.data_parallel import DataParallelLLMEngine
from .sample.rejection_sampler import RejectionSampler
from .spec_decode.config import SpecDecodeEngineArgs
from .spec_decode.engine import SpecDecodeLLMEngine
from .spec_decode.model_runner import SpecDecodeModelRunner
from .spec_decode.output_processor import SpecDecodeOutputProcessor
from .spec_decode.scheduler import SpecDecodeScheduler
from .structured_output.sampler import StructuredOutputSampler
from .structured_output.scheduler import StructuredOutputScheduler


def chunked(args: EngineArgs) -> bool:
    """Whether the engine's scheduler is chapter 11's token-budget scheduler (or a subclass of it)."""
    return isinstance(args.scheduler_cls, type) and issubclass(args.scheduler_cls, ChunkedPrefillScheduler)


def speculative(args: EngineArgs) -> bool:
    """Whether the engine verifies drafts (chapter 14's `speculative_config`)."""
    return getattr(args, "speculative_config", None) is not None


def tensor_parallel(args: EngineArgs) -> bool:
    """Whether the engine splits its model over several ranks (chapter 13's `tensor_parallel_size`)."""
    return getattr(args, "tensor_parallel_size", 1) > 1


# (chapter and name, condition on the engine's settings, scheduler class); when no row fits, the
# engine uses chapter 04's prefill-first `Scheduler`.
SCHEDULERS: list[tuple[str, Callable[[EngineArgs], bool], type]] = [
    ("14 speculative decoding: a sequence's drafts scheduled with its last token",
     lambda args: speculative(args) and getattr(args.model_runner_cls, "runs_mixed_batches", args.model_runner_cls is None),
     SpecDecodeScheduler),
    ("15 structured outputs: grammars compiled on arrival, advanced on each token; 11's token budget",
     lambda args: getattr(args.model_runner_cls, "runs_mixed_batches", args.model_runner_cls is None),
     StructuredOutputScheduler),
    ("11 one token budget: prefill chunks beside decodes",  # unless a given runner cannot run mixed steps
     lambda args: getattr(args.model_runner_cls, "runs_mixed_batches", args.model_runner_cls is None),
     ChunkedPrefillScheduler),
]

# (chapter and name, condition on the engine's settings, block manager class)
BLOCK_MANAGERS: list[tuple[str, Callable[[EngineArgs], bool], type]] = [
    ("11 prefix caching, blocks cached once computed", lambda args: args.enable_prefix_caching and chunked(args),
     ChunkedPrefixCachingBlockManager),
    ("06 prefix caching", lambda args: args.enable_prefix_caching, PrefixCachingBlockManager),
    ("05 paged blocks", lambda args: True, BlockManager),
]

# (chapter and name, condition on (device, dtype), attention backend class)
ATTENTION_BACKENDS: list[tuple[str, Callable[[torch.device, torch.dtype], bool], type]] = [
    ("07 flash-attn's paged kernels (CUDA)", FlashAttnPagedAttention.is_available, FlashAttnPagedAttention),
    ("07 Triton kernels (CUDA)", TritonPagedAttention.is_available, TritonPagedAttention),
    ("05 C++ decode kernel for CPUs", CPUPagedAttention.is_available, CPUPagedAttention),
    ("05 paged attention in plain torch", lambda device, dtype: True, PagedAttention),
]


# (chapter and name, condition on (engine settings, device), model runner class); when no row fits,
# the engine uses chapter 04's eager `ModelRunner`.
MODEL_RUNNERS: list[tuple[str, Callable[[EngineArgs, torch.device], bool], type]] = [
    ("14 speculative decoding: verify the drafts, propose the next", lambda args, device: speculative(args) and chunked(args),
     SpecDecodeModelRunner),
    ("13 tensor parallel (rank 0 drives the others), 11 mixed batches",
     lambda args, device: tensor_parallel(args) and chunked(args), TensorParallelMixedBatchModelRunner),
    ("13 tensor parallel (rank 0 drives the others)", lambda args, device: tensor_parallel(args),
     TensorParallelModelRunner),
    ("11 mixed batches, 08 CUDA graphs for decode",
     lambda args, device: chunked(args) and device.type == "cuda" and not args.enforce_eager,
     MixedBatchCUDAGraphModelRunner),
    ("11 mixed batches: prefill chunks beside decodes", lambda args, device: chunked(args), MixedBatchModelRunner),
    ("08 CUDA graphs for decode", lambda args, device: device.type == "cuda" and not args.enforce_eager,
     CUDAGraphModelRunner),
]


# (chapter and name, condition on the engine's settings, sampler class); when no row fits, the model
# runner keeps chapter 04's `sample_batch` (greedy and temperature).
SAMPLERS: list[tuple[str, Callable[[EngineArgs], bool], type]] = [
    ("14 rejection sampler over chapter 10's filtered distribution", speculative, RejectionSampler),
    ("15 the grammar bitmask, then chapter 10's sampler (with 15's scheduler, which advances the grammars)",
     lambda args: isinstance(args.scheduler_cls, type) and issubclass(args.scheduler_cls, StructuredOutputScheduler),
     StructuredOutputSampler),
    ("10 batched sampler: penalties, min-p, top-k, top-p, logprobs", lambda args: True, Sampler),
]

# (chapter and name, condition on the engine's settings, output processor class); when no row fits,
# the engine uses chapter 04's `SimpleOutputProcessor` (the text once a request has finished).
OUTPUT_PROCESSORS: list[tuple[str, Callable[[EngineArgs], bool], type]] = [
    ("14 several tokens per step: a stop inside an accepted run ends it there", speculative, SpecDecodeOutputProcessor),
    ("10 text token by token, stop strings, streaming, n > 1", lambda args: True, OutputProcessor),
]


# The settings `LLM` accepts: chapter 04's `EngineArgs`, chapter 13's parallel ones, chapter 14's
# `speculative_config`.
ENGINE_ARGS: type = SpecDecodeEngineArgs

# (chapter and name, condition on the settings, engine class); when no row fits, `LLM` builds chapter
# 04's `LLMEngine`.
ENGINES: list[tuple[str, Callable[[EngineArgs], bool], type]] = [
    ("13 data parallel: engine cores in processes of their own", lambda args: getattr(args, "data_parallel_size", 1) > 1,
     DataParallelLLMEngine),
    ("14 speculative decoding: drafts verified by the target", speculative, SpecDecodeLLMEngine),
    ("13 tensor parallel ranks (one rank: chapter 04's engine)", lambda args: isinstance(args, ParallelEngineArgs),
     ParallelLLMEngine),
]


def engine_for(args: EngineArgs) -> type:
    """The engine class of the first row of `ENGINES` that fits `args` (None fits: `LLMEngine`)."""
    from .engine.llm_engine import LLMEngine

    return next((cls for _, fits, cls in ENGINES if fits(args)), LLMEngine)


def scheduler_for(args: EngineArgs) -> type | None:
    """The scheduler class of the first row of `SCHEDULERS` that fits (None: chapter 04's `Scheduler`)."""
    return next((cls for _, fits, cls in SCHEDULERS if fits(args)), None)


def block_manager_for(args: EngineArgs) -> type:
    """The block manager class of the first row of `BLOCK_MANAGERS` whose condition holds for `args`."""
    return next(cls for _, holds, cls in BLOCK_MANAGERS if holds(args))


def attention_backend_for(device: torch.device, dtype: torch.dtype) -> type:
    """The attention backend class of the first row of `ATTENTION_BACKENDS` that fits `device` and `dtype`."""
    return next(cls for _, fits, cls in ATTENTION_BACKENDS if fits(device, dtype))


def model_runner_for(args: EngineArgs, device: torch.device) -> type | None:
    """The model runner class of the first row of `MODEL_RUNNERS` that fits (None: chapter 04's `ModelRunner`)."""
    return next((cls for _, fits, cls in MODEL_RUNNERS if fits(args, device)), None)


def sampler_for(args: EngineArgs) -> type | None:
    """The sampler class of the first row of `SAMPLERS` that fits (None: chapter 04's `sample_batch`)."""
    return next((cls for _, fits, cls in SAMPLERS if fits(args)), None)


def output_processor_for(args: EngineArgs) -> type | None:
    """The output processor class of the first row of `OUTPUT_PROCESSORS` that fits (None: chapter 04's)."""
    return next((cls for _, fits, cls in OUTPUT_PROCESSORS if fits(args)), None)


def complete_engine_args(args: EngineArgs) -> EngineArgs:
    """Fill every piece `args` leaves None from the tables above (in place; returns `args`), as `LLM()`
    does: the scheduler first (the model runner's row depends on it), then the block manager, the
    attention backend for the device and dtype, the model runner, the sampler and the output processor.
    Chapter 12's engine core, built in its own process, gets its pieces this way. Raises ValueError for
    a bad setting (`EngineArgs.check`)."""
    from .config import resolve_device, resolve_dtype

    args.check()
    args.scheduler_cls = args.scheduler_cls or scheduler_for(args)
    args.block_manager_cls = args.block_manager_cls or block_manager_for(args)
    device = resolve_device(args.device)
    args.attention_backend = args.attention_backend or attention_backend_for(device, resolve_dtype(args.dtype, device))
    args.model_runner_cls = args.model_runner_cls or model_runner_for(args, device)
    args.sampler_cls = args.sampler_cls or sampler_for(args)
    args.output_processor_cls = args.output_processor_cls or output_processor_for(args)
    return args
