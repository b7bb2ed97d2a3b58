"""Property-based fuzzing of every endpoint, over real HTTP, against the colocated engine on a
tiny random model: no 5xx, every error JSON in OpenAI's shape, every stream well formed, and
afterwards the server healthy and no KV slot leaked (``check_integrity``, free + cached ==
total, no admission place held).

Bodies mix valid values with hostile ones (integers past int64/uint64, NaN-free extremes,
lone surrogates, unknown and output-changing fields, wrong types). Derandomized and bounded
(``max_examples``) so it runs in well under a minute here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.server import ServerConfig
from tests.server.conftest import check_idle, colocated_app, serve

MAX_MODEL_LEN = 32
VOCAB = 49152
KEY = "fuzz-key"

_BIG = [2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]
_ODD_TEXT = ["", "\ud800", "a\udc00b", "\x00", "🎉" * 3, "x" * 300]

# Valid values: most requests run on the engine.
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
ids = st.integers(0, VOCAB - 1)
_valid_sampling = dict(
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 50),
    seed=st.integers(0, 2**63 - 1),
    stop=st.one_of(words, st.lists(words, max_size=3)),
    stop_token_ids=st.lists(ids, max_size=3),
    ignore_eos=st.booleans(),
    logit_bias=st.dictionaries(ids.map(str), st.floats(-100, 100), max_size=3),
)
_valid_openai = dict(
    model=st.just("tiny"),
    max_tokens=st.integers(1, 6),
    stream=st.booleans(),
    cache_salt=words,
    user=words,
    n=st.just(1),
    **_valid_sampling,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={
        "content": st.one_of(
            words, st.lists(st.builds(lambda t: {"type": "text", "text": t}, words), max_size=2)
        ),  # fmt: skip
        "name": words,
    },
)
completion_base = st.builds(
    lambda p, rest: {"prompt": p, **rest},
    st.one_of(words, st.lists(ids, min_size=1, max_size=8)),
    st.fixed_dictionaries({}, optional=dict(_valid_openai, best_of=st.just(1))),
)
chat_base = st.builds(
    lambda m, rest: {"messages": m, **rest},
    st.lists(_message, min_size=1, max_size=3),
    st.fixed_dictionaries({}, optional=_valid_openai),
)
generate_base = st.builds(
    lambda prompt, rest: {**prompt, **rest},
    st.one_of(
        st.builds(lambda t: {"text": t}, words),
        st.builds(lambda i: {"input_ids": i}, st.lists(ids, min_size=1, max_size=8)),
    ),
    st.fixed_dictionaries({}, optional=dict(
        stream=st.booleans(),
        cache_salt=words,
        sampling_params=st.fixed_dictionaries({}, optional=dict(_valid_sampling, max_new_tokens=st.integers(1, 6))),  # fmt: skip
    )),
)  # fmt: skip

# Hostile values: integers past int64/uint64, extremes, lone surrogates, wrong types.
ints = st.one_of(st.integers(-2, 12), st.sampled_from(_BIG))
floats = st.one_of(st.floats(-3, 3), st.sampled_from([1e-9, 2.0001, 1e308, -1e308]))
texts = st.one_of(st.text(max_size=12), st.sampled_from(_ODD_TEXT))
anything = st.one_of(
    st.none(), st.booleans(), ints, floats, texts, st.lists(ints, max_size=3),
    st.dictionaries(texts, ints, max_size=2),
)  # fmt: skip
_FIELDS = [
    "prompt", "messages", "input_ids", "text", "sampling_params", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stop_token_ids", "logit_bias", "ignore_eos", "stream", "stream_options", "n", "best_of",
    "logprobs", "echo", "presence_penalty", "repetition_penalty", "min_tokens", "cache_salt",
    "model", "tools", "response_format", "zzz_unknown",
]  # fmt: skip
hostile_value = st.one_of(
    anything,
    st.lists(st.one_of(ints, texts), max_size=4),
    st.lists(st.fixed_dictionaries({"role": texts, "content": anything}), max_size=2),
    st.dictionaries(st.sampled_from(["0", "5", str(VOCAB), "-1", "x", "05"]), floats, max_size=3),
)
mutations = st.dictionaries(st.sampled_from(_FIELDS), hostile_value, max_size=2)


def _mutated(path: str, base: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    return st.tuples(st.just(path), st.builds(lambda b, m: {**b, **m}, base, mutations))


raw = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
    st.one_of(
        st.binary(max_size=40), st.sampled_from([b"", b"{", b"[]", b"null", b'{"prompt": "\xff"}'])
    ),  # fmt: skip
)
gets = st.tuples(
    st.sampled_from(["/v1/models", "/health", "/metrics", "/v1/completions", "/nope"]),
    st.none(),
)
requests = st.one_of(
    _mutated("/v1/completions", completion_base),
    _mutated("/v1/chat/completions", chat_base),
    _mutated("/generate", generate_base),
    raw,
    gets,
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[tuple[str, Any, Any]]:
    config = ServerConfig(api_key=(KEY,), max_body_bytes=64 * 1024)
    client, app = colocated_app(
        tiny_llama_dir, config, max_total_tokens=1024, max_model_len=MAX_MODEL_LEN
    )
    try:
        with serve(app) as url:
            yield url, client, app
    finally:
        client.shutdown()


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.text[:200]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", r.text[-300:]
        for event in events[:-1]:
            payload = json.loads(event[len("data: ") :])
            assert "error" not in payload, payload
    elif r.request.method == "POST":
        out = r.json()
        assert out["output_ids"] if "output_ids" in out else out["usage"]["completion_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fuzz_every_endpoint(server: tuple[str, Any, Any]) -> None:
    url, client, app = server
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=30, headers=headers) as http:

        @settings(
            max_examples=120,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests)
        def one(request: tuple[str, Any]) -> None:
            path, body = request
            if body is None:
                r = http.get(path)
            elif isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, content=json.dumps(body).encode())
            _check_answer(r)

        one()
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1

    check_idle(client, app)
