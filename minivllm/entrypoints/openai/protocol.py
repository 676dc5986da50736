"""The OpenAI API's request bodies and error object, as pydantic models (after vLLM's
`vllm/entrypoints/openai/protocol.py`): OpenAI's fields, vLLM's sampling extras (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`), and `to_sampling_params` to turn a request into minivllm's `SamplingParams`."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import RequestOutputKind, SamplingParams

MAX_LOGPROBS = 20  # most top tokens per position a request may ask for (vLLM's default max_logprobs)


def random_uuid() -> str:
    """A fresh request id suffix (32 hex digits), as vLLM's `random_uuid`."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Fields OpenAI's API has and minivllm does not are ignored, as vLLM does (it logs them)."""

    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    """The inside of OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`; `code` is the HTTP status
    (vLLM's choice) and `type` its name, e.g. "BadRequestError" for 400, "NotFoundError" for 404."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

    include_usage: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share: how to sample, when to stop, whether to stream."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """`SamplingParams` keyword arguments; a field left None keeps SamplingParams' default. Streams ask
        for DELTA outputs, other requests for FINAL_ONLY (as vLLM). Raises ValueError: `logprobs` outside
        [0, MAX_LOGPROBS]."""
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty)
        kwargs = {k: v for k, v in given.items() if v is not None}
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return dict(kwargs, n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                    ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
                    logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output, output_kind=kind)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options: {"include_usage": true}`)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def capped_max_tokens(requested: int | None, default_max_tokens: int) -> int:
    """The request's `max_tokens`, at most `default_max_tokens` (what the context has room for), as vLLM's
    `get_max_tokens`; None means the default."""
    return default_max_tokens if requested is None else min(requested, default_max_tokens)


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`: one prompt (text or token ids); OpenAI's default `max_tokens` is 16."""

    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """This request's `SamplingParams`; `default_max_tokens` (max_model_len - prompt tokens) caps
        `max_tokens`. Raises ValueError: a value out of range, or an OpenAI feature minivllm lacks."""
        if self.echo or self.suffix is not None:
            raise ValueError("echo and suffix are not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n)")
        return SamplingParams(**self.sampling_kwargs(capped_max_tokens(self.max_tokens, default_max_tokens),
                                                     self.logprobs))


class ContentPart(OpenAIBaseModel):
    """A text part of a message's content (minivllm's models read text only)."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """A message; `content` is text or a list of text parts (joined with newlines, as vLLM)."""

    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """`{"role", "content"}` with text content, as a chat template takes it."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: `messages` through the model's chat template. `max_completion_tokens`
    (or the deprecated `max_tokens`) defaults to what the context has room for; `logprobs` is a switch and
    `top_logprobs` how many top tokens per position."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """This request's `SamplingParams` (see `CompletionRequest.to_sampling_params`). Raises ValueError:
        a value out of range, or `top_logprobs` without `logprobs: true`."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self.sampling_kwargs(capped_max_tokens(requested, default_max_tokens), logprobs))

    def conversation(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them."""
        return [m.as_dict() for m in self.messages]


def model_card(served_model_name: str, max_model_len: int) -> dict[str, Any]:
    """One entry of `GET /v1/models`' list (OpenAI's model object, with vLLM's `max_model_len`)."""
    return {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "minivllm",
            "root": served_model_name, "max_model_len": max_model_len}
