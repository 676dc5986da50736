"""An OpenAI-compatible HTTP server on `AsyncLLM`: `/v1/completions`, `/v1/chat/completions` (streamed as
server-sent events or not), `/v1/models`, `/health` and `/metrics`, plus `python -m minivllm serve`.
After vLLM's `vllm/entrypoints/openai/api_server.py`, `serving_completion.py`, `serving_chat.py` and
`vllm/entrypoints/utils.py`: the same routes, bodies, chunk shapes and error objects, so OpenAI's own
client (and vLLM's `bench serve`) talk to it unchanged."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from minivllm.config import EngineArgs
from minivllm.engine.core_client import EngineDeadError
from minivllm.engine.processor import chat_prompts
from minivllm.metrics.prometheus import PrometheusStatLogger
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

from .cli_args import add_cli  # noqa: F401 - `serve`'s flags, importable without FastAPI
from .protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse, model_card,
                       random_uuid)

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
MIN_LOGPROB = -9999.0  # what OpenAI sends for -inf (JSON has no infinity)
GRACEFUL_SHUTDOWN_S = 5  # on SIGINT/SIGTERM, how long open streams may go on before they are cut
READY_POLL_S = 0.05


# ---------------------------------------------------------------------------------------------- errors
class ModelNotFoundError(LookupError):
    """A request names a model this server does not serve (HTTP 404)."""


def status_of(error: Exception) -> int:
    """The HTTP status of an error: 400 for bad input (`ValueError`, pydantic's errors included), 404 for
    an unknown model, 503 once the engine core has died, 500 for anything else (a bug)."""
    if isinstance(error, ModelNotFoundError):
        return 404
    if isinstance(error, EngineDeadError):
        return 503
    return 400 if isinstance(error, ValueError) else 500


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object `{"error": {"message", "type", "param", "code"}}` (`code`: the status, as vLLM)."""
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str) -> JSONResponse:
    """`error_body` as a JSON response with that status."""
    return JSONResponse(error_body(status, message), status_code=status)


async def handle_error(request: Request, error: Exception) -> JSONResponse:
    """The app's handler for errors a route raised (see `status_of`)."""
    return error_response(status_of(error), str(error) or type(error).__name__)


async def handle_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that is not JSON or does not fit the request model: 400 (OpenAI's status), not FastAPI's 422."""
    problems = [f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()]
    return error_response(400, "; ".join(problems) or "invalid request")


# ------------------------------------------------------------------------------------ server-sent events
def sse_event(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line; a string (`"[DONE]"`) is sent as it is.
    JSON escapes newlines, so one event is always one `data:` line."""
    # EXERCISE ch12_ex2 (5 points): one `data:` line and a blank line
    ### BEGIN SOLUTION
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
    ### END SOLUTION


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """OpenAI's stream: an event per chunk, then `data: [DONE]`. An error while streaming (the engine core
    died) becomes an error event before `[DONE]`, so the client raises instead of hanging (as vLLM).
    Cancellation (the client went away) is not caught: it reaches the engine, which aborts the request."""
    # EXERCISE ch12_ex2 (5 points): an event per chunk; an error event on failure; then [DONE]
    ### BEGIN SOLUTION
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except Exception as e:  # noqa: BLE001 - any failure ends the stream with an error event
        yield sse_event(error_body(status_of(e), str(e) or type(e).__name__))
    yield sse_event("[DONE]")
    ### END SOLUTION


def stream_chunk(request_id: str, kind: str, created: int, model: str, choices: list[dict],
                 usage: dict | None = None) -> dict[str, Any]:
    """One chunk of a stream (`kind`: "text_completion" or "chat.completion.chunk"); `usage` is null on
    every chunk but the last of a stream with `include_usage` (vllm-project/vllm#7262)."""
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices,
            "usage": usage}


def usage_info(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object (tokens; `completion_tokens` summed over the `n` completions)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------------- client disconnects
async def listen_for_disconnect(request: Request) -> None:
    """Return once the client has closed its connection (after the body is read, ASGI's `receive` waits
    for `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def with_cancellation(handler):
    """Run a route `handler(request, raw_request)` against `listen_for_disconnect`: if the client goes
    first, the handler's task is cancelled (so `AsyncLLM.generate` aborts its request) and nothing is sent.
    After vLLM's `with_cancellation` (vllm/entrypoints/utils.py)."""

    @functools.wraps(handler)
    async def wrapper(request, raw_request: Request):
        handler_task = asyncio.create_task(handler(request, raw_request))
        disconnect_task = asyncio.create_task(listen_for_disconnect(raw_request))
        try:
            done, _ = await asyncio.wait([handler_task, disconnect_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            handler_task.cancel()
            disconnect_task.cancel()
        return handler_task.result() if handler_task in done else None

    return wrapper


# ------------------------------------------------------------------------------------------- logprobs
def token_text(tokenizer, token_id: int, logprob) -> str:
    """A token's text in a logprobs object: the engine's decoded token, else the tokenizer's decode."""
    return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])


def finite(logprob: float) -> float:
    """-inf (a token the filters removed) as OpenAI's -9999.0: JSON has no infinity."""
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], text_offset: int) -> dict:
    """The completions API's logprobs object for generated tokens: `tokens`, `token_logprobs`,
    `top_logprobs` (per token `{text: logprob}`: the chosen token and the top ones) and `text_offset`
    (character offsets in the completion, counted from `text_offset`). `logprobs`: per token
    `{token_id: Logprob}` as `CompletionOutput.logprobs`."""
    tokens, chosen, top, offsets = [], [], [], []
    for token_id, step in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id, step[token_id])
        tokens.append(text)
        chosen.append(finite(step[token_id].logprob))
        top.append({token_text(tokenizer, t, lp): finite(lp.logprob) for t, lp in step.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"text_offset": offsets, "token_logprobs": chosen, "tokens": tokens, "top_logprobs": top}


def chat_logprob(tokenizer, token_id: int, logprob) -> dict[str, Any]:
    """One token of the chat API's logprobs: its text, log-probability and UTF-8 bytes."""
    text = token_text(tokenizer, token_id, logprob)
    return {"token": text, "logprob": finite(logprob.logprob), "bytes": list(text.encode())}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], num_top: int) -> dict:
    """The chat API's logprobs object: `{"content": [{token, logprob, bytes, top_logprobs}]}`, where
    `top_logprobs` lists the `num_top` likeliest tokens at that position, likeliest first."""
    content = []
    for token_id, step in zip(token_ids, logprobs):
        ranked = sorted((lp.rank, t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= num_top)
        entry = chat_logprob(tokenizer, token_id, step[token_id])
        content.append(dict(entry, top_logprobs=[chat_logprob(tokenizer, t, lp) for _, t, lp in ranked]))
    return {"content": content}


# ------------------------------------------------------------------------------------ serving state
@dataclass
class ServingState:
    """What the routes share (kept in `app.state.serving`): the engine, the name clients must ask for,
    and the Prometheus registry `/metrics` shows."""

    engine: Any  # an AsyncLLM
    served_model_name: str
    registry: CollectorRegistry


def check_request(state: ServingState, model: str | None) -> None:
    """Raises ModelNotFoundError for another model's name (None means ours, as vLLM), EngineDeadError
    once the engine core has died."""
    if model is not None and model != state.served_model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist.")
    if state.engine.errored:
        raise EngineDeadError("the engine core has died: restart the server")


def default_max_tokens(num_prompt_tokens: int, max_model_len: int) -> int:
    """What the context leaves for generation. Raises ValueError when the prompt leaves nothing."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                         f"has {num_prompt_tokens} tokens, which leaves no room to generate (at most "
                         f"{max_model_len - 1} prompt tokens).")
    return max_model_len - num_prompt_tokens


def prepare(state: ServingState, prompt: dict, request) -> SamplingParams:
    """The request's checked `SamplingParams` for `prompt` (`{"prompt_token_ids", "prompt"?}`), checked
    with the engine's `Processor` before anything is queued. Raises ValueError for bad input."""
    engine = state.engine
    params = request.to_sampling_params(default_max_tokens(len(prompt["prompt_token_ids"]), engine.max_model_len))
    engine.processor.process(prompt, params)
    return params


async def final_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The last output of a FINAL_ONLY `generate` (closing the generator whatever happens)."""
    final = None
    async with contextlib.aclosing(outputs):
        async for final in outputs:
            pass
    assert final is not None and final.finished, "generate ended without a finished output"
    return final


# ----------------------------------------------------------------------------------------- completions
def completion_prompt(tokenizer, prompt: str | list[int]) -> dict:
    """A completions prompt as the engine takes it: text is encoded as `LLM.generate` encodes it."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    return {"prompt_token_ids": list(prompt)}


def completion_choice(state: ServingState, c: CompletionOutput, params: SamplingParams, offset: int = 0) -> dict:
    """One choice of a completion (or of a stream chunk, with `c` a DELTA output and `offset` the length
    of the text sent before it)."""
    logprobs = None
    if params.logprobs is not None and c.logprobs is not None:
        logprobs = completion_logprobs(state.engine.tokenizer, c.token_ids, c.logprobs, offset)
    return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


async def completion_chunks(state: ServingState, prompt: dict, params: SamplingParams, request_id: str,
                            include_usage: bool) -> AsyncIterator[dict]:
    """A completions stream's chunks: one per completion that advanced in an output (DELTA), then with
    `include_usage` a last chunk with no choices and the usage. Raises what `generate` raises."""
    # EXERCISE ch12_ex2 (5 points): a chunk per completion that advanced; with include_usage a last chunk with the usage
    ### BEGIN SOLUTION
    created, sent_text, sent_tokens, num_prompt = int(time.time()), [0] * params.n, [0] * params.n, 0
    async with contextlib.aclosing(state.engine.generate(prompt, params, request_id)) as outputs:
        async for out in outputs:
            num_prompt = len(out.prompt_token_ids)
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                choice = completion_choice(state, c, params, sent_text[c.index])
                sent_text[c.index] += len(c.text)
                sent_tokens[c.index] += len(c.token_ids)
                yield stream_chunk(request_id, "text_completion", created, state.served_model_name, [choice])
    if include_usage:
        yield stream_chunk(request_id, "text_completion", created, state.served_model_name, [],
                           usage_info(num_prompt, sum(sent_tokens)))
    ### END SOLUTION


def completion_response(state: ServingState, final: RequestOutput, params: SamplingParams,
                        request_id: str) -> dict:
    """A non-streamed completion: every choice, and the usage."""
    choices = [completion_choice(state, c, params) for c in final.outputs]
    usage = usage_info(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.served_model_name, "choices": choices, "usage": usage}


async def respond(state: ServingState, prompt: dict, request, request_id: str, chunks, response):
    """Check the request's parameters (`prepare`), then stream its chunks (`chunks(...)` through
    `sse_stream`) or wait for its final output and answer `response(...)` as JSON."""
    params = prepare(state, prompt, request)
    if request.stream:
        stream = chunks(state, prompt, params, request_id, request.include_usage)
        return StreamingResponse(sse_stream(stream), media_type="text/event-stream")
    final = await final_output(state.engine.generate(prompt, params, request_id))
    return JSONResponse(response(state, final, params, request_id))


@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request):
    """`POST /v1/completions`. Raises ModelNotFoundError (404), ValueError (400), EngineDeadError (503)."""
    state: ServingState = raw_request.app.state.serving
    check_request(state, request.model)
    prompt = completion_prompt(state.engine.tokenizer, request.prompt)
    return await respond(state, prompt, request, f"cmpl-{random_uuid()}", completion_chunks, completion_response)


# ------------------------------------------------------------------------------------ chat completions
def chat_choice_logprobs(state: ServingState, c: CompletionOutput, params: SamplingParams) -> dict | None:
    """A chat choice's logprobs object, or None when the request did not ask for logprobs."""
    if params.logprobs is None or c.logprobs is None:
        return None
    return chat_logprobs(state.engine.tokenizer, c.token_ids, c.logprobs, params.logprobs)


def chat_role_chunks(request_id: str, created: int, model: str, n: int) -> list[dict]:
    """A chat stream's first chunks: one per choice, with the role only (and empty content, as OpenAI)."""
    return [stream_chunk(request_id, "chat.completion.chunk", created, model,
                         [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]) for i in range(n)]


async def chat_chunks(state: ServingState, prompt: dict, params: SamplingParams, request_id: str,
                      include_usage: bool) -> AsyncIterator[dict]:
    """A chat stream's chunks: the role chunks at the first output, then one per completion that advanced
    (`delta.content`), then with `include_usage` the usage chunk. Raises what `generate` raises."""
    created, model, kind = int(time.time()), state.served_model_name, "chat.completion.chunk"
    sent_tokens, num_prompt, first = [0] * params.n, 0, True
    async with contextlib.aclosing(state.engine.generate(prompt, params, request_id)) as outputs:
        async for out in outputs:
            if first:
                for chunk in chat_role_chunks(request_id, created, model, params.n):
                    yield chunk
                first = False
            num_prompt = len(out.prompt_token_ids)
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                sent_tokens[c.index] += len(c.token_ids)
                yield stream_chunk(request_id, kind, created, model, [
                    {"index": c.index, "delta": {"content": c.text}, "logprobs": chat_choice_logprobs(state, c, params),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
    if include_usage:
        yield stream_chunk(request_id, kind, created, model, [], usage_info(num_prompt, sum(sent_tokens)))


def chat_response(state: ServingState, final: RequestOutput, params: SamplingParams, request_id: str) -> dict:
    """A non-streamed chat completion: one assistant message per choice, and the usage."""
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_choice_logprobs(state, c, params), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in final.outputs]
    usage = usage_info(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.served_model_name, "choices": choices, "usage": usage}


@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    """`POST /v1/chat/completions`: the messages through the model's chat template (`chat_prompts`).
    Raises ModelNotFoundError (404), ValueError (400), EngineDeadError (503)."""
    state: ServingState = raw_request.app.state.serving
    check_request(state, request.model)
    prompt = chat_prompts(state.engine.tokenizer, request.conversation(), request.add_generation_prompt)[0]
    return await respond(state, prompt, request, f"chatcmpl-{random_uuid()}", chat_chunks, chat_response)


# ------------------------------------------------------------------------------- models, health, metrics
async def show_available_models(raw_request: Request) -> JSONResponse:
    """`GET /v1/models`: the one model served."""
    state: ServingState = raw_request.app.state.serving
    return JSONResponse({"object": "list", "data": [model_card(state.served_model_name, state.engine.max_model_len)]})


async def health(raw_request: Request) -> Response:
    """`GET /health`: 200 while the engine core lives, 503 once it has died (as vLLM)."""
    try:
        await raw_request.app.state.serving.engine.check_health()
    except EngineDeadError:
        return Response(status_code=503)
    return Response(status_code=200)


async def metrics(raw_request: Request) -> Response:
    """`GET /metrics`: the app's Prometheus registry in the text format."""
    return Response(generate_latest(raw_request.app.state.serving.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(engine, served_model_name: str, registry: CollectorRegistry) -> FastAPI:
    """The OpenAI-compatible app for `engine` (an `AsyncLLM`).

    `registry` is what `/metrics` shows: the caller makes it and the `PrometheusStatLogger(registry,
    served_model_name)` it gives the engine in `stat_loggers` (the engine records to its loggers from the
    start, so the logger must exist before the engine; see `serve_http`). Bad input is answered 400 with
    OpenAI's error object (FastAPI's 422 for bodies that do not validate included), an unknown model 404,
    a dead engine 503, a bug 500: each with OpenAI's error object.
    """
    app = FastAPI(title="minivllm", docs_url=None, redoc_url=None)
    app.state.serving = ServingState(engine, served_model_name, registry)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    for error in (ValueError, ModelNotFoundError, EngineDeadError, Exception):  # Exception: a bug, 500
        app.add_exception_handler(error, handle_error)
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/models", show_available_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


# ------------------------------------------------------------------------------ python -m minivllm serve
def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` the `serve` flags ask for, with every piece filled (`defaults.complete_engine_args`)."""
    from minivllm.defaults import complete_engine_args

    return complete_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=args.seed))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to `(host, port)`; port 0 lets the OS pick a free one (read it
    back with `getsockname`). Raises OSError when the address is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve_until_stopped(server, sock: socket.socket) -> None:
    """Run uvicorn's `server` on `sock` until it stops (SIGINT/SIGTERM); once it accepts connections,
    print `minivllm serve: listening on http://HOST:PORT` (tests read the port from it)."""
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(READY_POLL_S)
    if server.started:
        host, port = sock.getsockname()[:2]
        print(f"minivllm serve: listening on http://{host}:{port}", flush=True)
    await serving


async def serve_http(args: argparse.Namespace) -> None:
    """Start the engine (its core in a process of its own unless `--no-multiprocess`), then serve until
    stopped; the engine is shut down however this ends, so no engine-core process outlives the server."""
    import uvicorn

    from minivllm.engine.async_llm import AsyncLLM

    engine_args = engine_args_from_cli(args)
    name = args.served_model_name or str(args.model or "default")
    registry = CollectorRegistry()
    engine = AsyncLLM(engine_args, multiprocess=args.multiprocess,
                      stat_loggers=[PrometheusStatLogger(registry, name)])
    try:
        app = build_app(engine, name, registry)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        await serve_until_stopped(uvicorn.Server(config), bind_socket(args.host, args.port))
    finally:
        engine.shutdown()


def run_server(args: argparse.Namespace) -> int:
    """`python -m minivllm serve`: serve until SIGINT or SIGTERM, then stop the engine core; exit status 0.
    Uvicorn handles both signals while it serves and raises them again after its graceful shutdown: both
    raise KeyboardInterrupt here (SIGTERM would otherwise kill the process before the engine is stopped)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(serve_http(args))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
