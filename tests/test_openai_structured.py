"""Chapter 15's constraints through chapter 12's OpenAI-compatible server, as its users send them: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` body field (the `openai` client's
`extra_body`), on `/v1/completions` and `/v1/chat/completions`, against `python -m minivllm serve` on a tiny
random float64 Llama that carries SmolLM2's tokenizer (grammars are compiled over its vocabulary). A random
model's choices are arbitrary, so each check is one the constraint alone guarantees; the schemas, patterns
and token limits are bounded so that every constrained output ends well within `max_tokens`."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("psutil")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serving_helpers import MODEL_NAME, Server, make_tiny_chat_model  # noqa: E402

CHAT = [{"role": "user", "content": "Name a city and its population in thousands, as JSON."}]
CITY = {"type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                       "thousands": {"type": "integer", "minimum": 0, "maximum": 999},
                       "capital": {"type": "boolean"}},
        "required": ["city", "thousands", "capital"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
PATTERN = r"[0-9]{3}-[a-z]{2,4}"
GBNF = 'root ::= ("red" | "green" | "blue") " " [0-9] [0-9]?'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")),
               tmp_path_factory.mktemp("server") / "server.log")
    yield s
    assert s.stop() == 0, Path(s.log.name).read_text()[-3000:]
    assert not s.orphans(), "an engine-core process outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(client, **kwargs):
    kwargs = dict(dict(messages=CHAT, max_tokens=64, temperature=0), **kwargs)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def complete(client, structured_outputs: dict, **kwargs):
    kwargs = dict(dict(prompt="The answer is", max_tokens=32, temperature=0), **kwargs)
    return client.completions.create(model=MODEL_NAME, extra_body={"structured_outputs": structured_outputs},
                                     **kwargs)


def ok(client) -> None:
    """A request that must succeed: the server keeps serving after bad input."""
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# ------------------------------------------------------------------------------ OpenAI's response_format
# JSON lets whitespace run on between any two tokens, and a random model's favourite tokens may be
# whitespace: an object schema alone could fill max_tokens with it. So the object schemas come with vLLM's
# `disable_any_whitespace` option (`structured_outputs` adds options to a response_format, as in vLLM),
# and response_format alone is checked with greedy requests that end.
COMPACT = {"extra_body": {"structured_outputs": {"disable_any_whitespace": True}}}


def test_chat_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = chat(client, response_format=fmt, n=2, temperature=1.0, seed=3, **COMPACT)
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CITY)
        assert not re.search(r"\s", c.message.content), c.message.content


def test_chat_json_schema_streamed(client):
    """A stream's deltas join into one valid document (the schema holds across chunks)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    parts, finish = [], None
    for chunk in chat(client, response_format=fmt, stream=True, **COMPACT):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop", "".join(parts)
    jsonschema.validate(json.loads("".join(parts)), CITY)


@pytest.mark.parametrize("schema", [{"enum": ["Paris", "Rome", "Oslo"]},
                                    {"type": "integer", "minimum": 0, "maximum": 999}])
def test_chat_json_schema_alone(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    c = chat(client, response_format=fmt, max_tokens=32).choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), schema)


def test_chat_json_object(client):
    c = chat(client, response_format={"type": "json_object"}).choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict), c.message.content


def test_text_format_constrains_nothing(client):
    """{"type": "text"} is the default: the same tokens as no response_format."""
    plain = chat(client, max_tokens=8).choices[0].message.content
    assert chat(client, max_tokens=8, response_format={"type": "text"}).choices[0].message.content == plain


def test_completion_json_schema(client):
    """/v1/completions takes response_format too (vLLM's extension; the openai client sends it in extra_body)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    r = client.completions.create(model=MODEL_NAME, prompt="{", max_tokens=64, temperature=0, extra_body={
        "response_format": fmt, "structured_outputs": {"disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    jsonschema.validate(json.loads(r.choices[0].text), CITY)


# ---------------------------------------------------------------------------- vLLM's structured_outputs
def test_completion_choice(client):
    r = complete(client, {"choice": CHOICES}, n=3, temperature=1.0, seed=0)
    assert [c.text in CHOICES for c in r.choices] == [True] * 3, [c.text for c in r.choices]


def test_completion_regex(client):
    r = complete(client, {"regex": PATTERN})
    assert re.fullmatch(PATTERN, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_completion_regex_streamed(client):
    text = "".join(c.choices[0].text for c in complete(client, {"regex": PATTERN}, stream=True) if c.choices)
    assert re.fullmatch(PATTERN, text), text


def test_completion_grammar(client):
    r = complete(client, {"grammar": GBNF})
    assert re.fullmatch(r"(red|green|blue) [0-9]{1,2}", r.choices[0].text), r.choices[0].text


def test_chat_structured_outputs(client):
    r = chat(client, extra_body={"structured_outputs": {"json": json.dumps(CITY), "disable_any_whitespace": True}})
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), CITY)
    assert not re.search(r"\s", content.replace("Paris", "").replace("Rome", "").replace("Oslo", "")), content


# --------------------------------------------------------------------------------------- bad requests
BAD_COMPLETIONS = {
    "invalid regex": {"extra_body": {"structured_outputs": {"regex": "([0-9]"}}},
    "invalid grammar": {"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
    # valid without a tokenizer; only the model's tokenizer shows the token is missing (once killed the core)
    "grammar naming a missing special token": {"extra_body": {"structured_outputs": {"grammar": 'start: <|no_such_token|> "a"'}}},
    "invalid schema": {"extra_body": {"structured_outputs": {"json": {"type": "no-such-type"}}}},
    "unknown key": {"extra_body": {"structured_outputs": {"regexp": "[0-9]"}}},
    "empty choice": {"extra_body": {"structured_outputs": {"choice": []}}},
    "two constraints": {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
    "not a dict": {"extra_body": {"structured_outputs": "[0-9]+"}},
    "structural_tag": {"extra_body": {"structured_outputs": {"structural_tag": "{}"}}},
    "two constraints in two fields": {"extra_body": {"response_format": {"type": "json_object"},
                                                     "structured_outputs": {"regex": "[0-9]"}}},
    "unknown response_format type": {"extra_body": {"response_format": {"type": "structural_tag"}}},
}
BAD_CHATS = {
    "unknown type": {"response_format": {"type": "xml"}},
    "json_schema without schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    "json_schema without json_schema": {"response_format": {"type": "json_schema"}},
    "invalid schema": {"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
    "two constraints in two fields": {"response_format": {"type": "json_object"},
                                      "extra_body": {"structured_outputs": {"choice": CHOICES}}},
    "bad option": {"response_format": {"type": "json_object"},
                   "extra_body": {"structured_outputs": {"disable_any_whitespace": "yes"}}},
    "invalid regex": {"extra_body": {"structured_outputs": {"regex": "[0-9"}}},
}


def assert_bad_request(error: pytest.ExceptionInfo) -> None:
    body = error.value.response.json()
    assert error.value.status_code == 400, body
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400, body
    assert body["error"]["message"], body


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_is_400(client, case):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, **BAD_COMPLETIONS[case])
    assert_bad_request(error)
    ok(client)


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_is_400(client, case):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, **BAD_CHATS[case])
    assert_bad_request(error)
    ok(client)


def test_bad_streamed_request_is_400(client):
    """A stream is refused before its first byte, so it is an HTTP error, not an error event."""
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, {"regex": "(("}, stream=True)
    assert_bad_request(error)
    r = complete(client, {"choice": CHOICES})
    assert r.choices[0].text in CHOICES


def test_protocol_mapping():
    """What each body becomes, without a server."""
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from minivllm.sampling_params import StructuredOutputsParams

    def params(cls=ChatCompletionRequest, **body):
        body = dict(body, messages=CHAT) if cls is ChatCompletionRequest else dict(body, prompt="Hi")
        return cls(**body).to_sampling_params(100).structured_outputs

    assert params() is None and params(response_format={"type": "text"}) is None
    assert params(response_format={"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "strict": True}}
    assert params(response_format=fmt) == StructuredOutputsParams(json=CITY)
    assert params(CompletionRequest, structured_outputs={"regex": "a+"}) == StructuredOutputsParams(regex="a+")
    assert params(response_format={"type": "text"}, structured_outputs={"choice": ["a"]}).choice == ["a"]
    compact = params(response_format=fmt, structured_outputs={"disable_any_whitespace": True, "regex": None})
    assert compact == StructuredOutputsParams(json=CITY, disable_any_whitespace=True)
    for bad in ({"response_format": fmt, "structured_outputs": {"regex": "a"}},
                {"structured_outputs": {"regex": "a", "bogus": 1}}, {"structured_outputs": {}}):
        with pytest.raises(ValueError):
            params(**bad)


def test_a_grammar_that_fails_while_generating_ends_its_request_only(server, client):
    """3,000 choices compile, but llguidance refuses the first token (a row of its lexer's table is longer
    than it allows): the engine core aborts that one request, the front end reports it finished with
    "abort", and the server goes on serving (the front end once knew only "stop" and "length", and its
    output handler died on the core's abort, taking every request with it)."""
    choices = [f"option{i}" for i in range(3000)]
    r = complete(client, {"choice": choices}, max_tokens=8)
    assert r.choices[0].finish_reason == "abort" and r.choices[0].text not in choices, r.choices[0]
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok(client)
