"""minivllm: a small vLLM-style inference engine, exported from the chapters in notebooks/.

Hand-written, like `__main__.py`, `defaults.py` and `course/grade.py`; every other module is generated
from a chapter notebook (its first line names the notebook to edit). vLLM's offline API is importable from here:
`from minivllm import LLM, SamplingParams`.
"""
__version__ = "0.1.0"

from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.sequence import Sequence, SequenceStatus  # noqa: E402


def __getattr__(name: str):
    """The engine's classes import torch and transformers: load them on first use, so that
    `import minivllm` (and chapter 01, which needs neither) stays light."""
    if name == "LLM":
        from minivllm.llm import LLM as value
    elif name == "LLMEngine":
        from minivllm.engine.llm_engine import LLMEngine as value
    elif name == "EngineArgs":
        from minivllm.config import EngineArgs as value
    elif name == "RequestOutput":
        from minivllm.outputs import RequestOutput as value
    elif name == "CompletionOutput":
        from minivllm.outputs import CompletionOutput as value
    else:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    return value


__all__ = ["SamplingParams", "Sequence", "SequenceStatus", "LLM", "LLMEngine", "EngineArgs", "RequestOutput",
           "CompletionOutput"]
