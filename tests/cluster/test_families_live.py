"""Every model family through a live cluster (Ray, 1 prefill + 1 decode node of its tiny
checkpoint, fp32 weights, int8 KV, speculative decoding on, every prompt through the prefill
node and its KV moved as int8 codes and scales): cold and on a cache hit, the greedy tokens of
the colocated engine with the same KV, alone and without speculation, to the bit (that engine's
fp32 KV gives HF transformers' tokens: tests/model/test_families.py). And a Gemma 2 of window 8
behind a 200-token shared system prompt on 2 prefill + 1 decode nodes with small pools and fp32
KV: HF's tokens, and the warm answer is the cold one when the prefix is pulled from the other
prefill node and when it comes back from the host tier."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.cluster.conftest import LiveCluster, start_live_cluster, wait_idle_and_check
from tests.families import FAMILIES, VOCAB, WINDOW

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 10


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(live: LiveCluster, ids: list[int]) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(f"{live.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _hf_answer(model_dir: Any, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=[], output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [lg[0] for lg in out.logits]


def _colocated_answer(model_dir: Any, prompt: list[int]) -> list[int]:
    """The colocated engine's greedy tokens with int8 KV, alone, without speculation."""
    from pd.core.sampling_params import SamplingParams
    from pd.engine.engine import Engine
    from pd.executor.config import EngineConfig

    cfg = EngineConfig(model=str(model_dir), kv_cache_dtype="int8", max_total_tokens=256)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return Engine(cfg).generate([prompt], greedy)[0].token_ids


def _assert_hfs(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:  # only where HF's own choice was a tie
            top2 = logits[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, (i, ours, theirs)
            return
    assert len(ours) == len(theirs)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def live(family: str, family_dir, ray_session: None) -> Iterator[LiveCluster]:
    engine = {
        "quantization": "none",
        "kv_cache_dtype": "int8",
        "speculative_tokens": 4,
        "max_total_tokens": 2048,
    }
    live, stop = start_live_cluster(1, 1, model=str(family_dir(family)), engine_kwargs=engine)
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


def test_cold_and_warm_answers_on_int8_kv_are_the_colocated_engines(
    live: LiveCluster, family: str, family_dir
) -> None:
    assert live.cluster.engine_cfg.kv_cache_dtype == "int8"  # type: ignore[attr-defined]
    prompt = _prompt(5 * WINDOW, seed=len(family))
    cold = _generate(live, prompt)
    warm = _generate(live, prompt)
    assert warm["cached_tokens"] >= len(prompt) - 1
    want = _colocated_answer(family_dir(family), prompt)
    assert cold["output_ids"] == want and warm["output_ids"] == want, (cold, warm, want)
    wait_idle_and_check(live)


@pytest.fixture(scope="module")
def gemma(family_dir, ray_session: None) -> Iterator[LiveCluster]:
    # small pools: a few prompts evict the system prompt down to the host tier
    engine = {"quantization": "none", "max_total_tokens": 512, "host_cache_tokens": 4096}
    live, stop = start_live_cluster(2, 1, model=str(family_dir("gemma2")), engine_kwargs=engine)
    try:
        yield live
    finally:
        stop()  # type: ignore[operator]


def test_gemmas_warm_answer_past_its_window_is_the_cold_one_pulled_or_from_the_host_tier(
    gemma: LiveCluster, family_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = _prompt(200, seed=11)
    prompt = system + [5, 6, 7]
    coordinator = gemma.cluster.client.coordinator  # type: ignore[attr-defined]
    routes: list[Any] = []
    route = coordinator.route
    monkeypatch.setattr(
        coordinator, "route", lambda *a, **k: routes.append(route(*a, **k)) or routes[-1]
    )
    monkeypatch.setattr(coordinator.policy, "_is_local", lambda *a, **k: False)
    monkeypatch.setattr(coordinator.policy, "_is_sooner_local", lambda *a, **k: False)
    cold = _generate(gemma, prompt)["output_ids"]
    _assert_hfs(cold, *_hf_answer(family_dir("gemma2"), prompt))
    wait_idle_and_check(gemma)
    holder = routes[-1].prefill
    # the holder's cache event and the rates the pull is weighed by (that request's stats)
    # reach the coordinator a moment after the answer
    deadline = time.monotonic() + 10
    while (
        coordinator.index(holder).match_len(prompt) < len(system) // 2
        or coordinator.costs.estimate(1) is None
    ):
        assert time.monotonic() < deadline, "no cache event or no rates from the holder"
        time.sleep(0.05)
    pick = coordinator.policy._pick_prefill

    def elsewhere(members, prompt_len, match):  # the node that did not compute it
        pick(members, prompt_len, match)
        other = next(n for n in coordinator.nodes.prefill_nodes if n != holder)
        return other, match.expected_len(coordinator.index(other).bit)

    monkeypatch.setattr(coordinator.policy, "_pick_prefill", elsewhere)
    pulled = _generate(gemma, prompt)
    assert pulled["output_ids"] == cold
    assert routes[-1].prefill != holder and routes[-1].pull is not None, routes
    wait_idle_and_check(gemma)
    monkeypatch.undo()
    # unrelated prompts fill every pool: the system prompt moves down to the host tier
    for seed in range(6):
        _generate(gemma, _prompt(300, seed=100 + seed))
    time.sleep(0.5)  # node stats are published a few times a second
    stats = gemma.cluster.client.stats().nodes  # type: ignore[attr-defined]
    host_hits = sum(n.num_host_hit_tokens for n in stats)
    assert _generate(gemma, prompt)["output_ids"] == cold
    time.sleep(0.5)
    stats = gemma.cluster.client.stats().nodes  # type: ignore[attr-defined]
    assert sum(n.num_host_hit_tokens for n in stats) > host_hits
    wait_idle_and_check(gemma)
