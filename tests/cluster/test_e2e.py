"""End to end over real HTTP with the official openai client: a 2P+1D and a 1P+2D cluster.
The 2P+1D cluster decodes speculatively (4 tokens, in batches up to 8): every answer there must
still be HF's, cold, warm, streamed and 32 at once, its prefix pulled or reused. The 1P+2D
cluster decodes one token a step, its KV in pages of 16 tokens. Between them each test runs
across two prefill nodes and two decode nodes, with and without speculation, on token-level and
paged KV (a 1P+1D cluster, the smallest, adds no path of its own: a cluster start and a pass of
every test). The SDK's structured forms (``parse`` for ten prompts, ``tool_choice="required"``
for ten, tool calls and ``parse`` streamed) run on the 1P+2D cluster only: they test the
server's side, which the other shape shares."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pd.core.sampling_params import SamplingParams
from pd.model.tokenizer import encode_chat, encode_prompt, load_tokenizer
from tests.cluster.conftest import LiveCluster, wait_idle_and_check
from tests.engine.test_sampling_engine import _ref_greedy, _reference
from tests.hf_reference import hf_greedy
from tests.server.test_structured_api import (
    check_parse_ten_prompts,
    check_required_tool_calls_ten_prompts,
    check_stream_helpers,
    check_streamed_tool_calls,
)

MODEL = "SmolLM2-135M-Instruct"
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("pools_whole_after_each_test")]

RAW_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
    "Water boils at",
    "My favourite book is",
    "import numpy as np\n",
    "The French Revolution began in",
]


SPECULATIVE = {"speculative_tokens": 4, "speculative_max_batch": 8}


@pytest.fixture(
    scope="module",
    params=[(2, 1, 1, SPECULATIVE), (1, 2, 16, {})],
    ids=["2p1d-speculative", "1p2d-page16"],
)
def live_spec(request, smollm2_dir) -> dict[str, Any]:
    num_prefill, num_decode, page_size, engine = request.param
    return dict(
        num_prefill=num_prefill, num_decode=num_decode, page_size=page_size, engine_kwargs=engine
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def _client(live: LiveCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


def _only_1p2d(live_spec: dict[str, Any]) -> None:
    shape = (live_spec["num_prefill"], live_spec["num_decode"], live_spec["page_size"])
    if shape != (1, 2, 16) or live_spec["engine_kwargs"]:
        pytest.skip("the SDK's structured forms run on the 1p2d cluster only")


def _hf_text(model_dir, tokenizer, prompt_ids, max_tokens) -> str:
    return tokenizer.decode(hf_greedy(model_dir, prompt_ids, max_tokens), skip_special_tokens=True)


def test_completion_and_chat_equal_hf_greedy(live, smollm2_dir, tokenizer):
    client = _client(live)
    prompt = RAW_PROMPTS[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert out.choices[0].text == _hf_text(
        smollm2_dir, tokenizer, encode_prompt(tokenizer, prompt), 32
    )
    assert out.usage.completion_tokens == 32 or out.choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0
    )
    want = _hf_text(smollm2_dir, tokenizer, encode_chat(tokenizer, messages), 32)
    assert chat.choices[0].message.content == want
    assert "Paris" in want


def test_streaming_equals_non_streaming(live):
    client = _client(live)
    prompt = RAW_PROMPTS[2]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_penalties_and_logprobs_equal_hf_streamed_and_not(live, smollm2_dir, tokenizer):
    """The first token and its logprobs from the prefill node, the rest from the decode node
    (speculatively in 2p1d): HF's greedy answer under vLLM's penalties, logprobs within 1e-4
    of a recomputation from HF's fp32 logits, the same bits on a cache hit and streamed."""
    client = _client(live)
    prompt_ids = encode_prompt(tokenizer, " ".join(RAW_PROMPTS[:4]))  # > a 16-token page
    penalties = {"frequency_penalty": 0.8, "presence_penalty": 0.3}
    params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2, **penalties)
    want = _ref_greedy(smollm2_dir, prompt_ids, params, 12)
    ref = _reference(smollm2_dir, prompt_ids, want, params)
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0, logprobs=2, **penalties
    )
    kw["extra_body"] = {"repetition_penalty": 1.2}
    full = client.completions.create(**kw).choices[0].logprobs
    assert full is not None and full.tokens == [tokenizer.decode([t]) for t in want]
    errors = [abs(v - float(ref[i, t])) for i, (v, t) in enumerate(zip(full.token_logprobs, want))]
    assert max(errors) < 1e-4, errors
    warm = client.completions.create(**kw)  # the prompt cached now, on the prefill node
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert warm.choices[0].logprobs == full
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == full.token_logprobs
    assert [t for s in streamed for t in s.top_logprobs] == full.top_logprobs

    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    chat_kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chat_kw.update(logprobs=True, top_logprobs=3, **penalties)
    chat = client.chat.completions.create(**chat_kw)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    stream = client.chat.completions.create(stream=True, **chat_kw)
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in content]


def test_32_concurrent_requests_complete_correctly(live, smollm2_dir, tokenizer):
    want = {
        p: _hf_text(smollm2_dir, tokenizer, encode_prompt(tokenizer, p), 12) for p in RAW_PROMPTS
    }

    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=240
        )

        async def one(p: str) -> tuple[str, str]:
            r = await client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            return p, r.choices[0].text

        try:
            return await asyncio.gather(*(one(p) for p in RAW_PROMPTS * 4))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 32
    for prompt, text in results:
        assert text == want[prompt], prompt


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        ({"model": MODEL}, 400),  # missing prompt
        ({"model": MODEL, "prompt": 123}, 400),
        ({"model": "no-such-model", "prompt": "hi"}, 404),
        ({"model": MODEL, "prompt": "hi " * 9000, "max_tokens": 4}, 400),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400),  # n up to 16
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
        ({"model": MODEL, "prompt": ""}, 400),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape_and_queues_nothing(live, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        f"{live.url}/v1/completions", headers={"content-type": "application/json"}, timeout=30, **kw
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "type" in err
    client = live.cluster.client
    assert (
        not client.flights
        and client.coordinator.nodes.load(client.coordinator.nodes.prefill_nodes[0]) == 0
    )


def test_client_disconnect_aborts_and_frees(live):
    body = {
        "model": MODEL,
        "prompt": RAW_PROMPTS[3],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # leave mid-stream: closing the connection must abort the request
    report = wait_idle_and_check(live)
    assert all(r["unfinished"] == 0 for r in report.values())


def test_shared_prefix_groups_stick_to_one_prefill_node(live, tokenizer, monkeypatch):
    coordinator = live.cluster.client.coordinator
    if len(coordinator.nodes.prefill_nodes) < 2:
        pytest.skip("routing needs two prefill nodes")
    routed: dict[str, str] = {}
    route = coordinator.route

    def spy(request_id, prompt_ids, *args, **kwargs):
        r = route(request_id, prompt_ids, *args, **kwargs)
        routed[tokenizer.decode(prompt_ids[:8])] = (
            routed.get(tokenizer.decode(prompt_ids[:8]), "") + r.prefill + ","
        )
        return r

    monkeypatch.setattr(coordinator, "route", spy)
    groups = [f"Group {g}: " + " ".join(f"fact{g}-{i}" for i in range(120)) for g in range(4)]

    async def run() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=240
        )
        try:
            for round_ in range(3):  # every group in every round, concurrently
                await asyncio.gather(
                    *(
                        client.completions.create(
                            model=MODEL,
                            prompt=f"{g} Question {round_}?",
                            max_tokens=2,
                            temperature=0,
                        )
                        for g in groups
                    )
                )
        finally:
            await client.close()

    asyncio.run(run())
    assert len(routed) == 4, routed
    nodes_per_group = [set(v.strip(",").split(",")) for v in routed.values()]
    assert all(len(n) == 1 for n in nodes_per_group), routed
    assert len(set.union(*nodes_per_group)) == 2, f"all groups on one node: {routed}"


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_requests_that_end_at_or_right_after_prefill_free_both_sides(live, max_tokens):
    client = _client(live)
    out = client.completions.create(
        model=MODEL, prompt=RAW_PROMPTS[4], max_tokens=max_tokens, temperature=0
    )
    assert out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length"


def test_metrics_report_cache_hits_transfers_and_latencies(live):
    client = _client(live)
    prompt = "Shared context: " + " ".join(f"item{i}" for i in range(200)) + " Question:"
    for q in ("one", "two"):  # the second request reuses the first one's prefix
        client.completions.create(model=MODEL, prompt=f"{prompt} {q}?", max_tokens=3, temperature=0)
    wait_idle_and_check(live)
    time.sleep(0.5)  # node stats are published a few times a second
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["pd_transfer_count"] >= 2 and values["pd_transfer_bytes"] > 0
    assert values["pd_time_to_first_token_seconds_count"] >= 2
    hits = sum(v for k, v in values.items() if k.startswith("pd_node_cache_hit_tokens"))
    assert hits >= 200, text


def test_cpu_prefill_nodes_openmp_threads_spin_briefly(live):
    """The CPU nodes share the cores: a prefill node's process gets libgomp's spin count for a
    process with more threads than cores, a decode node's keeps the default, unless the
    server's environment chose one (which every node inherits)."""
    from pd.fleet.actors import PREFILL_SPIN_COUNT

    chosen = os.environ.get("GOMP_SPINCOUNT")
    for node_id, node in live.cluster.client.membership.nodes.items():
        environ = Path(f"/proc/{node.pid}/environ").read_bytes().split(b"\0")
        spin = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"GOMP_SPINCOUNT=")]
        expected = chosen or (str(PREFILL_SPIN_COUNT) if node.role == "prefill" else None)
        assert spin == ([expected] if expected else []), (node_id, spin)


def test_next_turn_of_a_conversation_moves_only_new_kv(live, smollm2_dir, tokenizer):
    """The decode node keeps what it decoded: turn 2 reuses turn 1's KV there, so only the new
    tokens cross from the prefill node, and the answer is still HF's."""
    client = _client(live)
    turn1 = [{"role": "user", "content": "Give me three facts about the Moon."}]
    a1 = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=24, temperature=0)
    wait_idle_and_check(live)
    time.sleep(0.5)  # let turn 1's transfer reach the published stats
    stats_before = live.cluster.client.stats()
    turn2 = turn1 + [
        {"role": "assistant", "content": a1.choices[0].message.content},
        {"role": "user", "content": "And one about the Sun?"},
    ]
    a2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=24, temperature=0)
    assert a2.choices[0].message.content == _hf_text(
        smollm2_dir, tokenizer, encode_chat(tokenizer, turn2), 24
    )
    wait_idle_and_check(live)
    time.sleep(0.5)  # node stats are published a few times a second
    after = live.cluster.client.stats()
    sent = sum(n.transfer_bytes for n in after.nodes) - sum(
        n.transfer_bytes for n in stats_before.nodes
    )
    prompt2 = len(encode_chat(tokenizer, turn2))
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    assert 0 < sent < (prompt2 // 2) * bytes_per_token, (sent, prompt2)
    decode_hits = sum(n.num_hit_tokens for n in after.nodes if n.role == "decode")
    assert decode_hits > prompt2 // 2


def test_generate_endpoint_token_ids_in_and_out(live, smollm2_dir, tokenizer):
    ids = encode_prompt(tokenizer, RAW_PROMPTS[5])
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    r = httpx.post(f"{live.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(smollm2_dir, ids, 16)


def test_a_prefix_routed_away_from_its_holder_is_pulled_and_answers_like_hf(
    live, smollm2_dir, tokenizer, monkeypatch
):
    """Load sends a warm prompt to the prefill node that lacks its prefix (forced here): that
    node pulls the prefix's KV from the holder instead of computing it, the choice and both
    estimates are in the decision log with the pull's measured time, and the answer is HF's."""
    coordinator = live.cluster.client.coordinator
    if len(coordinator.nodes.prefill_nodes) < 2:
        pytest.skip("a pull between prefill nodes needs two")
    context = "Reference notes: " + " ".join(f"note{i} is {i * 7 % 13}" for i in range(80))
    first = encode_prompt(tokenizer, f"{context}\nQuestion one:")
    routes = []
    route = coordinator.route
    monkeypatch.setattr(
        coordinator, "route", lambda *a, **kw: routes.append(route(*a, **kw)) or routes[-1]
    )
    out = httpx.post(
        f"{live.url}/generate",
        json={"input_ids": first, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        timeout=120,
    )
    assert out.status_code == 200, out.text
    wait_idle_and_check(live)
    holder = routes[-1].prefill
    deadline = time.monotonic() + 10  # both rates measured (the stats of that request)
    while coordinator.costs.estimate(1) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pick = coordinator.policy._pick_prefill

    def elsewhere(members, prompt_len, match):  # as if the holder were the busier node
        node_id, _ = pick(members, prompt_len, match)
        other = next(n for n in coordinator.nodes.prefill_nodes if n != holder)
        return other, match.expected_len(coordinator.index(other).bit)

    monkeypatch.setattr(coordinator.policy, "_pick_prefill", elsewhere)
    second = encode_prompt(tokenizer, f"{context}\nQuestion two: what is note7?")
    body = {"input_ids": second, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    got = httpx.post(f"{live.url}/generate", json=body, timeout=120).json()
    assert got["output_ids"] == hf_greedy(smollm2_dir, second, 12)
    d = coordinator.pulls.decisions[-1]
    assert d.choice == "pull" and d.node != holder and routes[-1].pull is not None, d
    assert d.num_tokens > 300  # the first pull is tried whatever the estimates (then measured)
    deadline = time.monotonic() + 10  # the node's report of the pull reaches the server
    while d.pull_s is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.error is None and d.num_pulled == d.num_tokens, d
    assert got["cached_tokens"] >= d.num_tokens  # the pulled part, a hit where it was computed


def test_speculative_decoding_streams_every_accepted_token_like_hf(live, smollm2_dir, tokenizer):
    """A prompt whose answer repeats its text (drafts are accepted): every accepted token
    reaches the client once and in order, streamed and not, with the usage counted."""
    cluster = live.cluster
    if not cluster.engine_cfg.speculative_tokens:
        pytest.skip("this cluster does not speculate")
    client = _client(live)
    prompt = "Repeat exactly: one two three four five six seven eight. " * 3 + "Repeat exactly:"
    ids = encode_prompt(tokenizer, prompt)
    want = hf_greedy(smollm2_dir, ids, 40, ignore_eos=True)
    before = sum(n.num_accepted_draft_tokens for n in cluster.client.stats().nodes)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                   "ignore_eos": True}}  # fmt: skip
    got = httpx.post(f"{live.url}/generate", json=body, timeout=120).json()
    assert got["output_ids"] == want
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = tokenizer.decode(want, skip_special_tokens=True)
    assert full.choices[0].text == text == "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens == 40
    wait_idle_and_check(live)
    time.sleep(0.5)  # node stats are published a few times a second
    after = sum(n.num_accepted_draft_tokens for n in cluster.client.stats().nodes)
    assert after - before >= 20, (before, after)  # it did speculate, and drafts were accepted


def test_n_choices_share_one_prefill_node_and_equal_hf_greedy(
    live, smollm2_dir, tokenizer, monkeypatch
):
    """n=3 greedy over the cluster: three identical choices equal to HF's greedy text,
    streamed by index; every choice went to the same prefill node (the one that holds the
    prompt), and usage counts the prompt once."""
    coordinator = live.cluster.client.coordinator
    prefill_of: dict[str, str] = {}
    route = coordinator.route

    def spy(request_id, prompt_ids, *args, **kwargs):
        r = route(request_id, prompt_ids, *args, **kwargs)
        prefill_of[request_id] = r.prefill
        return r

    monkeypatch.setattr(coordinator, "route", spy)
    prompt = "Choices: " + " ".join(f"word{i}" for i in range(60))
    prompt_ids = tokenizer.encode(prompt)
    want_ids = hf_greedy(smollm2_dir, prompt_ids, 6)
    want = tokenizer.decode(want_ids, skip_special_tokens=True)
    client = _client(live)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3)
    assert [c.text for c in done.choices] == [want] * 3
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt_ids)
    assert (
        done.usage.completion_tokens
        == sum(len(tokenizer.encode(c.text, add_special_tokens=False)) for c in done.choices)
        or done.usage.completion_tokens == 18
    )
    nodes = {v for k, v in prefill_of.items() if k.startswith(done.id)}
    assert len([k for k in prefill_of if k.startswith(done.id)]) == 3 and len(nodes) == 1, (
        prefill_of
    )
    parts: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3, stream=True
    ):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert parts == {0: want, 1: want, 2: want}


@pytest.mark.slow
def test_sdk_parse_gives_a_parsed_object_for_ten_prompts(live, live_spec):
    """``beta.chat.completions.parse`` with a Pydantic model, ten prompts at once."""
    _only_1p2d(live_spec)
    check_parse_ten_prompts(_client(live), MODEL)


def test_sdk_tool_choice_required_gives_a_parsed_call_for_ten_prompts(live, live_spec):
    _only_1p2d(live_spec)
    check_required_tool_calls_ten_prompts(_client(live), MODEL)


@pytest.mark.slow
def test_sdk_streamed_tool_calls_and_parse_equal_the_non_streamed(live, live_spec):
    """Tool calls streamed (plain, n=2, named; the SDK's ``stream`` helper with a strict
    Pydantic tool) add up to the non-streamed greedy answer; streamed ``parse`` parses."""
    _only_1p2d(live_spec)
    client = _client(live)
    check_streamed_tool_calls(client, MODEL)
    check_stream_helpers(client, MODEL)
