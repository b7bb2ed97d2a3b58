"""The HTTP API over a scripted fake engine, in process (httpx ASGITransport)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pd.core.messages import NodeStatsMsg
from pd.core.outputs import ClusterStats
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, SCRIPT_TEXT
from tests.server.fake_engine import FakeEngineClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

MakeApp = Callable[..., tuple[Any, FakeEngineClient]]


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _sse_events(body: str) -> list[Any]:
    """Parse an SSE body; ``[DONE]`` must be raw and last."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    payloads = [e[len("data: ") :] for e in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


async def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with _client(app) as c:
        return await c.post(path, json=body)


async def test_completion_stream_and_non_stream_agree(make_app: MakeApp, tokenizer: Any) -> None:
    app, fake = make_app(num_cached_tokens=2, tokens_per_step=2)
    body = {"model": MODEL_NAME, "prompt": "Say something", "max_tokens": 100, "temperature": 0}
    r = await _post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["model"] == MODEL_NAME
    assert out["choices"] == [
        {"index": 0, "text": SCRIPT_TEXT, "finish_reason": "stop", "logprobs": None}
    ]
    num_prompt = len(tokenizer.encode("Say something"))
    num_out = len(fake.output_ids)
    assert out["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_out,
        "total_tokens": num_prompt + num_out,
        "prompt_tokens_details": {"cached_tokens": 2},
    }

    r = await _post(
        app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    text_events, usage_event = events[:-1], events[-1]
    assert "".join(e["choices"][0]["text"] for e in text_events) == SCRIPT_TEXT
    assert all("\ufffd" not in e["choices"][0]["text"] for e in text_events)
    assert [e["choices"][0]["finish_reason"] for e in text_events][-1] == "stop"
    assert usage_event["choices"] == [] and usage_event["usage"] == out["usage"]
    assert len(fake.requests) == 2 and fake.aborted == []
    _, prompt_ids, params = fake.requests[0]
    assert prompt_ids == tokenizer.encode("Say something")
    assert params.max_tokens == 100 and params.temperature == 0.0


async def test_chat_stream_and_non_stream_agree(make_app: MakeApp, tokenizer: Any) -> None:
    app, fake = make_app()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    body = {"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 200}
    r = await _post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT_TEXT}
    assert out["choices"][0]["finish_reason"] == "stop"
    expected_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    assert fake.requests[0][1] == list(expected_ids)
    assert out["usage"]["prompt_tokens"] == len(expected_ids)

    r = await _post(app, "/v1/chat/completions", {**body, "stream": True})
    events = _sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == SCRIPT_TEXT
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in events)  # no include_usage: no usage chunk


async def test_max_tokens_gives_length_and_defaults_to_16(make_app: MakeApp) -> None:
    app, fake = make_app(output_ids=list(range(100, 140)))
    out = (await _post(app, "/v1/completions", {"prompt": "x", "max_tokens": 5})).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    out = (await _post(app, "/v1/completions", {"prompt": [1, 2, 3]})).json()
    assert out["usage"]["completion_tokens"] == 16 and fake.requests[1][1] == [1, 2, 3]
    # chat without a limit gets the rest of the context
    await _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
    assert fake.requests[2][2].max_tokens == MAX_MODEL_LEN - len(fake.requests[2][1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
async def test_stop_string_spanning_two_tokens(
    make_app: MakeApp, tokenizer: Any, stream: bool, include: bool
) -> None:
    app, fake = make_app(delay_s=0.001)
    pieces = [tokenizer.decode([i]) for i in fake.output_ids]
    assert pieces[1:3] == [" world", "!"], pieces  # "ld!" spans tokens 1 and 2
    body = {"prompt": "p", "max_tokens": 50, "stop": ["nothing", "ld!"], "stream": stream}
    body["include_stop_str_in_output"] = include
    r = await _post(app, "/v1/completions", body)
    if stream:
        events = _sse_events(r.text)
        text = "".join(e["choices"][0]["text"] for e in events)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert text == ("Hello world!" if include else "Hello wor")
    assert finish == "stop"
    request_id = fake.requests[0][0]
    assert fake.aborted == [request_id] and fake.finished == []


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_a_stop_string_ends_the_answer_at_the_same_token_however_tokens_are_grouped(
    make_app: MakeApp, path: str
) -> None:
    # a speculative step sends several tokens in one output: the answer keeps those up to the
    # one that completed the stop string ("ld!" ends at token 2), not the rest of the group
    answers = []
    for per_step in (1, 2, 4):
        app, _ = make_app(tokens_per_step=per_step)
        if path == "/generate":
            params = {"max_new_tokens": 50, "stop": ["ld!"]}
            out = (await _post(app, path, {"input_ids": [1, 2], "sampling_params": params})).json()
            answers.append((out["text"], out["output_ids"], out["completion_tokens"]))
        else:
            out = (
                await _post(app, path, {"prompt": "p", "max_tokens": 50, "stop": ["ld!"]})
            ).json()
            answers.append((out["choices"][0]["text"], None, out["usage"]["completion_tokens"]))
    assert answers[0][0] == "Hello wor" and answers[0][2] == 3, answers
    assert answers[1:] == answers[:1] * 2, answers


async def test_generate_endpoint(make_app: MakeApp, tokenizer: Any) -> None:
    app, fake = make_app(num_cached_tokens=3)
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = (await _post(app, "/generate", body)).json()
    assert out["output_ids"] == fake.output_ids[:4]
    assert out["text"] == tokenizer.decode(fake.output_ids[:4])
    assert (out["finish_reason"], out["prompt_tokens"], out["cached_tokens"]) == ("length", 4, 3)
    r = await _post(app, "/generate", {**body, "stream": True})
    events = _sse_events(r.text)
    assert [i for e in events for i in e["output_ids"]] == out["output_ids"]
    assert "".join(e["text"] for e in events) == out["text"]
    assert events[-1]["finish_reason"] == "length"
    out = (
        await _post(app, "/generate", {"text": "Hello", "sampling_params": {"max_tokens": 2}})
    ).json()
    assert fake.requests[-1][1] == tokenizer.encode("Hello") and len(out["output_ids"]) == 2


_LONG = "word " * (MAX_MODEL_LEN + 10)
_MSGS = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body, status, param)
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty id list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("batched prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("prompt too long", "/v1/completions", {"prompt": _LONG}, 400, "prompt"),
    ("prompt+max_tokens too long", "/v1/completions", {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("max_tokens 0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "a", "max_tokens": "16"}, 400, "max_tokens"),
    ("n 17", "/v1/completions", {"prompt": "a", "n": 17}, 400, "n"),
    ("temperature -1", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("temperature 2.5", "/v1/completions", {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p 1.5", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("top_k -2", "/v1/completions", {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("stop int", "/v1/completions", {"prompt": "a", "stop": 3}, 400, "stop"),
    ("stop list of int", "/v1/completions", {"prompt": "a", "stop": ["x", 3]}, 400, "stop"),
    ("empty stop", "/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, 400, "echo"),
    ("logprobs 6", "/v1/completions", {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("chat no messages", "/v1/chat/completions", {}, 400, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, "messages"),
    ("chat content int", "/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, 400, "messages"),
    ("chat image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, 400, "messages"),
    ("chat model", "/v1/chat/completions", {"messages": _MSGS, "model": "other"}, 404, "model"),
    ("chat n 0", "/v1/chat/completions", {"messages": _MSGS, "n": 0}, 400, "n"),
    ("chat max_completion_tokens 0", "/v1/chat/completions", {"messages": _MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("generate neither", "/generate", {"sampling_params": {}}, 400, "input_ids"),
    ("generate both", "/generate", {"input_ids": [1], "text": "a"}, 400, "input_ids"),
    ("generate empty ids", "/generate", {"input_ids": []}, 400, "input_ids"),
    ("generate ids not ints", "/generate", {"input_ids": ["a"]}, 400, "input_ids"),
    ("generate temperature", "/generate", {"input_ids": [1], "sampling_params": {"temperature": 9}}, 400, "sampling_params"),
    ("generate bad stop id", "/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, 400, "stop_token_ids"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [b[1:] for b in BAD_REQUESTS],
    ids=[b[0] for b in BAD_REQUESTS],
)
async def test_bad_requests_are_4xx_in_openai_shape_and_never_queued(
    make_app: MakeApp, path: str, body: Any, status: int, param: str | None
) -> None:
    app, fake = make_app()
    r = await _post(app, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if status == 404:
        assert err["code"] == "model_not_found"
    assert fake.requests == []


async def test_context_length_error_says_the_numbers(make_app: MakeApp) -> None:
    app, _ = make_app()
    r = await _post(app, "/v1/completions", {"prompt": [1] * 200, "max_tokens": 100})
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert all(str(n) in err["message"] for n in (MAX_MODEL_LEN, 300, 200, 100)), err["message"]


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'"prompt"'], ids=["broken", "empty", "array", "string"]
)
async def test_invalid_json_body_is_400(make_app: MakeApp, raw: bytes) -> None:
    app, fake = make_app()
    async with _client(app) as c:
        r = await c.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert fake.requests == []


async def test_unknown_route_and_method_use_openai_shape(make_app: MakeApp) -> None:
    app, _ = make_app()
    async with _client(app) as c:
        assert (await c.get("/v1/nothing")).json()["error"]["message"]
        r = await c.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_engine_failure_is_500_in_openai_shape(make_app: MakeApp) -> None:
    app, fake = make_app(fail_after=2)
    r = await _post(app, "/v1/completions", {"prompt": "a"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert fake.aborted == [fake.requests[0][0]]
    r = await _post(app, "/v1/completions", {"prompt": "a", "stream": True})
    events = _sse_events(r.text)
    assert events[-1]["error"]["type"] == "server_error"
    async with _client(app) as c:
        text = (await c.get("/metrics")).text
    assert 'pd_requests_total{finish_reason="error"} 2.0' in text
    assert "pd_server_running_requests 0.0" in text


async def test_models_health_readiness_and_metrics(make_app: MakeApp) -> None:
    def node(node_id: str, role: str, **kw: Any) -> NodeStatsMsg:
        zero = dict.fromkeys(
            ("num_waiting", "num_running", "num_transferring", "num_cached_tokens",
             "num_hit_tokens", "num_miss_tokens", "num_queued_tokens", "transfer_bytes",
             "num_transfers"), 0,
        )  # fmt: skip
        fields = {**zero, "transfer_seconds": 0.0, **kw}
        return NodeStatsMsg(node_id=node_id, role=role, **fields)

    stats = ClusterStats(
        [
            node("prefill-0", "prefill", num_waiting=2, num_slots=120, num_free_slots=90,
                 num_hit_tokens=75, num_miss_tokens=25, transfer_bytes=4096,
                 transfer_seconds=0.25, num_transfers=3),
            node("decode-0", "decode", num_running=5, num_slots=40, num_free_slots=30),
        ],
        num_queued=1,
    )  # fmt: skip
    app, fake = make_app(ready=False, stats_fn=lambda: stats, extra_health=lambda: {"nodes": 2})
    async with _client(app) as c:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        r = await c.get("/health")  # liveness: the process serves HTTP
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = await c.get("/ready")  # an open API: everyone is an admin, and sees the node list
        assert r.status_code == 503
        assert r.json() == {
            "status": "unavailable",
            "reason": "the fake engine is not ready",
            "nodes": 2,
        }
        fake.ready = True
        assert (await c.get("/health")).json() == {"status": "ok"}
        r = await c.get("/ready")
        assert r.status_code == 200 and r.json() == {"status": "ready", "nodes": 2}

        await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        text = (await c.get("/metrics")).text
    for name in (
        "pd_time_to_first_token_seconds",
        "pd_time_per_output_token_seconds",
        "pd_e2e_request_latency_seconds",
    ):
        assert f"{name}_count 1.0" in text, name
    assert "pd_generation_tokens_total 4.0" in text
    assert 'pd_requests_total{finish_reason="length"} 1.0' in text
    assert 'pd_node_cache_hit_rate{node="prefill-0"} 0.75' in text
    assert 'pd_node_slot_usage{node="decode-0",role="decode"} 0.25' in text
    assert 'pd_node_queue_depth{node="prefill-0",role="prefill"} 2.0' in text
    assert "pd_transfer_bytes 4096.0" in text
    assert "pd_coordinator_queue_depth 1.0" in text
