"""At ``pd serve``'s defaults (int4 weights, compiled decode steps for batches of 1, 2 and 4,
conditional disaggregation, pulls, the host tier) a greedy request gets the same answer on every
path: alone and among 16, cold and warm, prefilled on its decode node or on a prefill node, its
prefix pulled from another node or loaded back from the host tier, before and after a drain. The
same with ``--dtype bfloat16``, with ``--quantization int8`` (int8 weights), with
``--kv-cache-dtype int8`` (KV as int8 codes and scales in every pool, tier, transfer and pull;
every other default kept, int4 weights included), and with int8 KV and ``--speculative-tokens 4``
(the decode node drafting up to 4 tokens a step), on the paths where they differ from the
defaults (``EVERY_FORMAT``, ``EVERY_KV_DTYPE``); int8 KV's speculative answers are also the
colocated engine's without speculation.

A cluster per format (Ray, 2 prefill + 1 decode node of the default model, real processes;
int8 weights' and speculation's need one prefill node: they are neither pulled from nor
drained). The reference is
each prompt's answer alone on the idle cluster. A request made cold again is put in a cache
namespace of its own (a salt), so nothing it needs is cached; routing is steered where a path
must be forced (the coordinator's choices, monkeypatched in this process)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import pytest

from pd.model.tokenizer import encode_chat, load_tokenizer
from tests.cluster.conftest import LiveCluster, wait_idle_and_check

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("pools_whole_after_each_test")]

# answers that --no-deterministic changes when they are prefilled in a batch (int4, AMX)
QUESTIONS = [
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 19 times 2?",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Hamlet?",
    "How do I make tea?",
    "Describe the moon.",
]
NOTES = " ".join(f"Note {i}: item {i} weighs {i * 7 % 13} kg." for i in range(30))
MAX_TOKENS = 32


# pd serve's engine defaults, and other weight and KV formats with the rest of them
FORMATS = {
    "defaults": {"quantization": "auto"},
    "bf16": {"quantization": "auto", "dtype": "bfloat16"},  # auto: no quantization for bf16
    "int8": {"quantization": "int8"},
    # int8 KV at the defaults (int4 weights), and with speculative decoding on
    "int8-kv": {"quantization": "auto", "kv_cache_dtype": "int8"},
    "int8-kv-spec": {"quantization": "auto", "kv_cache_dtype": "int8", "speculative_tokens": 4},
}


# Every format answers alike on both kinds of node, alone, batched, cold and warm (what its
# kernels decide). The paths that move KV (a pull, the host tier) run where the KV's dtype
# differs: the defaults' and int8 weights' KV is fp32, bf16's is bf16, int8-kv's is int8 codes
# and scales (speculation changes only the decode node's steps). A drain changes only the
# routing.
EVERY_FORMAT = pytest.mark.parametrize("live_spec", list(FORMATS), indirect=True)
EVERY_KV_DTYPE = pytest.mark.parametrize(
    "live_spec", ["defaults", "bf16", "int8-kv"], indirect=True
)
DEFAULTS = pytest.mark.parametrize("live_spec", ["defaults"], indirect=True)
INT8_KV_SPEC = pytest.mark.parametrize("live_spec", ["int8-kv-spec"], indirect=True)


@pytest.fixture(scope="module")
def live_spec(request) -> dict[str, Any]:
    # and the coordinator's defaults (local prefill up to 128 tokens)
    engine = {**FORMATS[request.param], "compile_buckets": "auto", "max_total_tokens": 1024}
    num_prefill = 1 if request.param in ("int8", "int8-kv-spec") else 2
    return dict(
        num_prefill=num_prefill, num_decode=1, local_prefill_tokens=128, engine_kwargs=engine
    )


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> dict[str, list[int]]:
    tok = load_tokenizer(smollm2_dir)
    out = {q: encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS}
    for i, q in enumerate(QUESTIONS[:3]):  # long: past a local prefill's 128 tokens
        out[f"notes-{i}"] = encode_chat(tok, [{"role": "user", "content": f"{NOTES}\n{q}"}])
    return out


async def _generate(
    http: httpx.AsyncClient, ids: list[int], salt: str | None, max_tokens: int = MAX_TOKENS
) -> list[int]:
    sampling = {"max_new_tokens": max_tokens, "temperature": 0}
    body = {"input_ids": ids, "sampling_params": sampling, "cache_salt": salt}
    r = await http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _answers(
    live: LiveCluster,
    calls: list[list[int]],
    concurrent: bool = False,
    cold: str | None = None,
    max_tokens: int = MAX_TOKENS,
) -> list[Any]:
    """The answers to ``calls``, one after another or all at once; ``cold``: each request in a
    cache namespace of its own (a salt made of ``cold`` and its index), so nothing is cached."""

    async def run() -> list[Any]:
        salts = [None if cold is None else f"{cold}-{i}" for i in range(len(calls))]
        async with httpx.AsyncClient(base_url=live.url, timeout=600) as http:
            if concurrent:
                gen = (_generate(http, i, s, max_tokens) for i, s in zip(calls, salts))
                return list(await asyncio.gather(*gen))
            return [await _generate(http, i, s, max_tokens) for i, s in zip(calls, salts)]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference(live: LiveCluster, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt's answer alone on the idle cluster, cold (the first test's)."""
    cluster: Any = live.cluster
    assert cluster.engine_cfg.compile_buckets == "auto"
    return {name: _answers(live, [ids])[0] for name, ids in prompts.items()}


def _node_sum(live: LiveCluster, field: str, role: str | None = None) -> float:
    time.sleep(0.5)  # node stats are published a few times a second
    nodes = live.cluster.client.stats().nodes  # type: ignore[attr-defined]
    return sum(getattr(n, field) for n in nodes if role in (None, n.role))


def _spy_routes(coordinator: Any, monkeypatch: pytest.MonkeyPatch, local: bool) -> list[Any]:
    """The coordinator's routes from now on, every request prefilled on its decode node
    (``local``) or through a prefill node."""
    routes: list[Any] = []
    route = coordinator.route
    monkeypatch.setattr(
        coordinator, "route", lambda *a, **k: routes.append(route(*a, **k)) or routes[-1]
    )
    monkeypatch.setattr(coordinator.policy, "_is_local", lambda *a, **k: local)
    monkeypatch.setattr(coordinator.policy, "_is_sooner_local", lambda *a, **k: local)
    return routes


@EVERY_FORMAT
@pytest.mark.parametrize("where", ["prefill node", "decode node"])
def test_a_prompt_computed_on_either_node_answers_alike(
    live, prompts, reference, monkeypatch, where
):
    """Alone, the short prompts were prefilled on the decode node and the long ones on a
    prefill node; each again, cold, on the other kind of node."""
    coordinator = live.cluster.client.coordinator
    routes = _spy_routes(coordinator, monkeypatch, local=where == "decode node")
    names = [n for n in prompts if n.startswith("notes") == (where == "decode node")]
    got = _answers(live, [prompts[n] for n in names], cold=where)
    assert got == [reference[n] for n in names]
    assert all((r.prefill is None) == (where == "decode node") for r in routes), routes


@EVERY_FORMAT
def test_warm_answers_and_sixteen_at_once_equal_the_cold_ones_alone(live, prompts, reference):
    hits = _node_sum(live, "num_hit_tokens")
    names = list(prompts)
    assert _answers(live, [prompts[n] for n in names]) == [reference[n] for n in names]
    assert _node_sum(live, "num_hit_tokens") - hits > sum(len(prompts[n]) for n in names) // 2
    sixteen = QUESTIONS * 2
    for cold in ("sixteen", None):  # prefilled together from nothing, then warm
        got = _answers(live, [prompts[q] for q in sixteen], concurrent=True, cold=cold)
        assert got == [reference[q] for q in sixteen], cold


@EVERY_KV_DTYPE
def test_a_prefix_pulled_from_another_node_answers_as_computed(
    live, prompts, reference, monkeypatch
):
    """A long prompt computed on one prefill node is sent to the other, which pulls its KV."""
    coordinator = live.cluster.client.coordinator
    routes = _spy_routes(coordinator, monkeypatch, local=False)
    name = "notes-1"
    _answers(live, [prompts[name]], cold="pulled")  # computed where it is routed on its own
    holder = routes[-1].prefill
    pick = coordinator.policy._pick_prefill

    def elsewhere(members, prompt_len, match):  # as if the holder were the busier node
        pick(members, prompt_len, match)
        other = next(n for n in coordinator.nodes.prefill_nodes if n != holder)
        return other, match.expected_len(coordinator.index(other).bit)

    monkeypatch.setattr(coordinator.policy, "_pick_prefill", elsewhere)
    assert _answers(live, [prompts[name]], cold="pulled") == [reference[name]]
    d = coordinator.pulls.decisions[-1]
    assert d.choice == "pull" and d.node != holder and routes[-1].pull is not None, d
    wait_idle_and_check(live)
    deadline = time.monotonic() + 10  # the node's report of the pull reaches the server
    while d.pull_s is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.error is None and d.num_pulled == d.num_tokens, d


@EVERY_KV_DTYPE
def test_prefixes_loaded_back_from_the_host_tier_answer_as_computed(live, prompts, reference):
    """Unrelated prompts fill every pool, so the earlier prefixes move down to the host tier;
    asked again, they are loaded back from there."""
    filler = [[(997 * i + 31 * j) % 40000 + 100 for j in range(300)] for i in range(10)]
    _answers(live, filler, concurrent=True, max_tokens=1)
    host_hits = _node_sum(live, "num_host_hit_tokens")
    names = list(prompts)
    assert _answers(live, [prompts[n] for n in names]) == [reference[n] for n in names]
    assert _node_sum(live, "num_host_hit_tokens") > host_hits


@DEFAULTS
def test_after_a_prefill_node_drains_the_answers_are_the_same(live, prompts, reference):
    coordinator = live.cluster.client.coordinator
    prefill = coordinator.nodes.prefill_nodes
    assert len(prefill) == 2
    r = httpx.post(f"{live.url}/admin/nodes/{prefill[0]}/drain", timeout=30)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while len(coordinator.nodes.prefill_nodes) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert coordinator.nodes.prefill_nodes == prefill[1:]
    names = list(prompts)
    assert _answers(live, [prompts[n] for n in names]) == [reference[n] for n in names]
    got = _answers(live, [prompts[n] for n in names], concurrent=True, cold="drained")
    assert got == [reference[n] for n in names]


@INT8_KV_SPEC
def test_int8_kvs_speculative_answers_are_the_colocated_engines_without_speculation(
    live, prompts, reference
):
    """The decode node drafted tokens (n-grams of the prompt), and every reference answer (each
    prompt alone, cold, decoded speculatively on int8 KV) equals the colocated engine's with the
    cluster's weights and KV, all prompts in one batch, no speculation, eager steps."""
    from pd.core.sampling_params import SamplingParams
    from pd.engine.engine import Engine

    assert _node_sum(live, "num_draft_tokens", "decode") > 0
    cfg = dataclasses.replace(live.cluster.engine_cfg, speculative_tokens=0, compile_buckets="off")
    assert cfg.kv_cache_dtype == "int8" and cfg.quantization == "auto"
    engine = Engine(cfg)
    names = list(prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    got = engine.generate([prompts[n] for n in names], greedy)
    assert [r.token_ids for r in got] == [reference[n] for n in names]
