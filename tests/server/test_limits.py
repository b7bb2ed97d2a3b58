"""Hostile input is a 4xx in OpenAI's shape and reaches no engine; fields that would change the
output are implemented or refused by name; what common clients send is accepted."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from pd.server import ServerConfig
from tests.server.conftest import MODEL_NAME
from tests.server.fake_engine import FakeEngineClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]
_MSGS = [{"role": "user", "content": "hi"}]
_C, _CHAT, _GEN = "/v1/completions", "/v1/chat/completions", "/generate"


def _raw(text: str) -> bytes:
    return text.encode()


# (name, path, body: dict or raw bytes, status, param). RELIABILITY.md lists these cases.
HOSTILE: list[tuple[str, str, Any, int, str | None]] = [
    ("lone surrogate in prompt", _C, _raw('{"prompt": "a\\ud800b"}'), 400, None),
    ("lone low surrogate in chat", _CHAT, _raw('{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400, None),
    ("invalid UTF-8 in body", _C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("NaN temperature", _C, _raw('{"prompt": "a", "temperature": NaN}'), 400, "temperature"),
    ("1e400 temperature", _C, _raw('{"prompt": "a", "temperature": 1e400}'), 400, "temperature"),
    ("JSON nested 3000 deep", _C, _raw('{"prompt": ' + "[" * 3000 + "]" * 3000 + "}"), 400, None),
    ("5000-digit max_tokens", _C, _raw('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}"), 400, None),
    ("seed 2**64", _C, {"prompt": "a", "seed": 2**64}, 400, "seed"),
    ("seed 2**63", _C, {"prompt": "a", "seed": 2**63}, 400, "seed"),
    ("seed -1", _C, {"prompt": "a", "seed": -1}, 400, "seed"),
    ("top_k 2**64", _C, {"prompt": "a", "top_k": 2**64}, 400, "top_k"),
    ("top_k 2**31", _CHAT, {"messages": _MSGS, "top_k": 2**31}, 400, "top_k"),
    ("max_tokens 2**64", _C, {"prompt": "a", "max_tokens": 2**64}, 400, "max_tokens"),
    ("prompt id 2**64", _C, {"prompt": [1, 2**64]}, 400, "prompt"),
    ("input id -2**63", _GEN, {"input_ids": [-(2**63)]}, 400, "input_ids"),
    ("stop_token_id 2**64", _C, {"prompt": "a", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("generate seed 2**64", _GEN, {"text": "a", "sampling_params": {"seed": 2**64}}, 400, "sampling_params"),
    ("33 stop strings", _C, {"prompt": "a", "stop": [f"s{i}" for i in range(33)]}, 400, "stop"),
    ("stop string of 1025 chars", _C, {"prompt": "a", "stop": ["x" * 1025]}, 400, "stop"),
    ("1025 stop_token_ids", _C, {"prompt": "a", "stop_token_ids": [5] * 1025}, 400, "stop_token_ids"),
    ("1025 messages", _CHAT, {"messages": _MSGS * 1025}, 400, "messages"),
    ("role tool without tool_call_id", _CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("role function", _CHAT, {"messages": [{"role": "function", "content": "x"}]}, 400, "messages"),
    ("tool_calls on a user", _CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages"),
    ("malformed tools with a stream", _CHAT, {"messages": _MSGS, "stream": True, "tools": [{"type": "retrieval"}]}, 400, "tools"),
    ("a stream naming no tool", _CHAT, {"messages": _MSGS, "stream": True, "tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("tools bad parameters", _CHAT, {"messages": _MSGS, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, 400, "tools"),
    ("tool_choice with response_format", _CHAT, {"messages": _MSGS, "tool_choice": "required", "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("8 MB prompt of 4M ids", _C, _raw('{"prompt": [' + ",".join(["1"] * 4_000_000) + "]}"), 413, None),
    ("prompt longer than any fit", _C, {"prompt": "x" * 2_000_000}, 400, "prompt"),
    ("chat longer than any fit", _CHAT, {"messages": [{"role": "user", "content": "y" * 2_000_000}]}, 400, "messages"),
    ("empty cache_salt", _C, {"prompt": "a", "cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt of 1025 chars", _C, {"prompt": "a", "cache_salt": "s" * 1025}, 400, "cache_salt"),
    ("logit_bias key not an id", _C, {"prompt": "a", "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("logit_bias key 1_0", _C, {"prompt": "a", "logit_bias": {"1_0": 1}}, 400, "logit_bias"),
    ("logit_bias id out of vocab", _C, {"prompt": "a", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("logit_bias value 101", _C, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias token twice", _C, {"prompt": "a", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),
    ("1025 logit_bias tokens", _C, {"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ("unknown field", _C, {"prompt": "a", "foo": 1}, 400, "foo"),
    ("unknown nested field", _GEN, {"text": "a", "sampling_params": {"mirostat": 1}}, 400, "sampling_params"),
    ("min_tokens over max_tokens", _C, {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("repetition_penalty 0", _C, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("repetition_penalty -1", _CHAT, {"messages": _MSGS, "repetition_penalty": -1.0}, 400, "repetition_penalty"),
    ("presence_penalty 2.5", _CHAT, {"messages": _MSGS, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty -3", _GEN, {"text": "a", "sampling_params": {"frequency_penalty": -3}}, 400, "sampling_params"),
    ("frequency_penalty 2.01", _C, {"prompt": "a", "frequency_penalty": 2.01}, 400, "frequency_penalty"),
    ("min_p 1.5", _C, {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("min_p -0.1", _CHAT, {"messages": _MSGS, "min_p": -0.1}, 400, "min_p"),
    ("best_of 2", _C, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("top_logprobs without logprobs", _CHAT, {"messages": _MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs 21", _CHAT, {"messages": _MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs -1", _CHAT, {"messages": _MSGS, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("completions logprobs 6", _C, {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("completions echo with logprobs", _C, {"prompt": "a", "echo": True, "logprobs": 1}, 400, "echo"),
    ("response_format bad schema", _CHAT, {"messages": _MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format"),
    ("response_format no name", _CHAT, {"messages": _MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "response_format"),
    ("response_format xml", _C, {"prompt": "a", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("guided_json not JSON", _C, {"prompt": "a", "guided_json": "{bad"}, 400, "guided_json"),
    ("guided_regex unclosed", _C, {"prompt": "a", "guided_regex": "(ab"}, 400, "guided_regex"),
    ("guided_choice empty", _CHAT, {"messages": _MSGS, "guided_choice": []}, 400, "guided_choice"),
    ("guided_grammar bad lark", _C, {"prompt": "a", "guided_grammar": "start: ((("}, 400, "guided_grammar"),
    ("two structured outputs", _C, {"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_regex"),
    ("structured_outputs two kinds", _C, {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("tool_choice required", _CHAT, {"messages": _MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    ("return_logprob", _GEN, {"text": "a", "return_logprob": True}, 400, "return_logprob"),
    ("skip_special_tokens false", _C, {"prompt": "a", "skip_special_tokens": False}, 400, "skip_special_tokens"),
]  # fmt: skip


async def _post(app: Any, path: str, body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            return await c.post(path, content=body, headers=headers)
        return await c.post(path, json=body)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
async def test_hostile_input_is_4xx_and_never_queued(
    make_app: MakeApp, path: str, body: Any, status: int, param: str | None
) -> None:
    app, fake = make_app(config=ServerConfig(max_body_bytes=4 * 2**20))
    err = assert_openai_error(await _post(app, path, body), status)
    assert err["param"] == param, err
    assert fake.requests == []


async def test_refusals_name_the_field(make_app: MakeApp) -> None:
    app, _ = make_app()
    r = await _post(app, _C, {"prompt": "a", "logit_bias": {"5": 101}, "best_of": 3})
    msg = r.json()["error"]["message"]
    assert "best_of=3 with n=1 is not supported" in msg and "best_of must equal n" in msg
    r = await _post(app, _C, {"prompt": "a", "echo": True, "logprobs": 2})
    assert (
        "pd never runs a cached prompt prefix through the model again"
        in r.json()["error"]["message"]
    )
    r = await _post(app, _C, {"prompt": "a", "frobnicate": True})
    assert "frobnicate: unknown field" in r.json()["error"]["message"]
    r = await _post(app, _C, {"prompt": "a", "max_tokens": 2**64})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert str(2**64) in r.json()["error"]["message"]


# What SGLang's bench_serving.py and vLLM's benchmark request builders send (read with the
# search tool: sglang python/sglang/bench_serving.py, vllm vllm/benchmarks/lib/
# endpoint_request_func.py and the older benchmarks/backend_request_func.py).
CLIENTS: list[tuple[str, str, dict[str, Any]]] = [
    ("sglang completions", _C, {"model": MODEL_NAME, "prompt": "Hi", "temperature": 0.0, "best_of": 1, "max_tokens": 4, "stream": True, "ignore_eos": True}),
    ("sglang chat", _CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.0, "max_tokens": 4, "stream": True}),
    ("sglang generate", _GEN, {"text": "Hi", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}, "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1}),
    ("vllm completions", _C, {"model": MODEL_NAME, "prompt": "Hi", "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("vllm chat", _CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ("openai chat with tools, streamed", _CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}], "tool_choice": "auto", "parallel_tool_calls": False}),
    ("vllm legacy completions", _C, {"model": MODEL_NAME, "prompt": "Hi", "temperature": 0.0, "best_of": 1, "max_tokens": 4, "logprobs": None, "stream": True}),
    ("harmless extras", _CHAT, {"messages": [{"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 4, "n": 1, "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True, "tool_choice": "none", "tools": [], "response_format": {"type": "text"}, "logit_bias": {}, "logprobs": False, "seed": 7, "presence_penalty": 0, "frequency_penalty": 0.0}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in CLIENTS], ids=[c[0] for c in CLIENTS])
async def test_common_clients_are_accepted(make_app: MakeApp, path: str, body: Any) -> None:
    app, fake = make_app()
    r = await _post(app, path, body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
    assert len(fake.requests) == 1 and fake.requests[0][2].max_tokens == 4


async def test_logit_bias_and_seed_reach_the_engine(make_app: MakeApp) -> None:
    app, fake = make_app()
    body = {"prompt": "a", "seed": 2**63 - 1, "top_k": 2**31 - 1}
    body["logit_bias"] = {"17": -100, "5": 2.5, "0": 100}
    r = await _post(app, _C, body)
    assert r.status_code == 200, r.text
    params = fake.requests[0][2]
    assert params.logit_bias == ((0, 100.0), (5, 2.5), (17, -100.0))
    assert (params.seed, params.top_k) == (2**63 - 1, 2**31 - 1)
    r = await _post(app, _GEN, {"text": "a", "sampling_params": {"logit_bias": {"3": 1}}})
    assert r.status_code == 200 and fake.requests[1][2].logit_bias == ((3, 1.0),)


async def test_body_over_the_cap_is_413_declared_or_chunked(make_app: MakeApp) -> None:
    app, fake = make_app(config=ServerConfig(max_body_bytes=1000))
    body = json.dumps({"prompt": "a" * 2000}).encode()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        declared = await c.post(_C, content=body, headers={"content-type": "application/json"})

        async def chunks() -> Any:
            for i in range(0, len(body), 100):
                yield body[i : i + 100]

        chunked = await c.post(_C, content=chunks())
        small = await c.post(_C, json={"prompt": "a", "max_tokens": 2})
        text = (await c.get("/metrics")).text
    for r in (declared, chunked):
        err = assert_openai_error(r, 413)
        assert err["code"] == "request_too_large" and "at most 1000" in err["message"]
    assert "content-length" not in {k.lower() for k in chunked.request.headers}
    assert small.status_code == 200 and len(fake.requests) == 1
    assert 'pd_server_rejected_requests_total{reason="body_too_large"} 2.0' in text


async def test_bodies_being_received_are_capped_together(make_app: MakeApp) -> None:
    """A body holds its Content-Length from its start (a chunked one, what came so far) until
    it is in: one that would take the bodies in flight past their cap is 429 at once, or as
    soon as its chunks pass it; the bytes come back as each body is in."""
    config = ServerConfig(max_body_bytes=1000, max_body_bytes_in_flight=1500)
    app, fake = make_app(config=config)
    body = json.dumps({"prompt": "a" * 900, "max_tokens": 2}).encode()
    json_type = {"content-type": "application/json"}
    in_flight = anyio.Event()
    release = anyio.Event()

    async def held_back() -> Any:
        yield body[:100]
        in_flight.set()
        await release.wait()
        yield body[100:]

    async def chunks() -> Any:
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        slow: list[httpx.Response] = []

        async def post_slow() -> None:
            headers = {**json_type, "content-length": str(len(body))}
            slow.append(await c.post(_C, content=held_back(), headers=headers))

        async with anyio.create_task_group() as tg:
            tg.start_soon(post_slow)
            await in_flight.wait()
            declared = await c.post(_C, content=body, headers=json_type)
            chunked = await c.post(_C, content=chunks(), headers=json_type)
            small = await c.post(_C, json={"prompt": "a", "max_tokens": 2})
            release.set()
        again = await c.post(_C, content=body, headers=json_type)
        text = (await c.get("/metrics")).text
    for r in (declared, chunked):
        err = assert_openai_error(r, 429)
        assert err["code"] == "server_overloaded" and "cap of 1500" in err["message"], err
        assert r.headers["retry-after"] == "1"
    # ``again`` fits only if both the slow body's 930 bytes and the chunked one's 600 came back
    assert [r.status_code for r in (small, *slow, again)] == [200, 200, 200]
    assert len(fake.requests) == 3
    assert 'pd_server_rejected_requests_total{reason="bodies_in_flight"} 2.0' in text


async def test_unexpected_errors_are_500_json(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _ = make_app()

    def broken(*_: Any) -> Any:
        raise KeyError("boom")

    monkeypatch.setattr(app.state.server, "new_choices", broken)
    err = assert_openai_error(await _post(app, _C, {"prompt": "a"}), 500)
    assert err["type"] == "server_error" and "boom" in err["message"]
    assert app.state.server.admission.num_inflight == 0  # its place came back


async def test_openapi_documents_the_request_bodies(make_app: MakeApp) -> None:
    app, _ = make_app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        doc = (await c.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for path, model in ((_C, "CompletionRequest"), (_CHAT, "ChatCompletionRequest"), (_GEN, "GenerateRequest")):  # fmt: skip
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": f"#/components/schemas/{model}"}
    assert {"prompt", "logit_bias", "cache_salt"} <= set(schemas["CompletionRequest"]["properties"])
    assert "ChatMessage" in schemas and "GenerateSamplingParams" in schemas
