"""Conditional disaggregation end to end (1P+1D, SmolLM2): a request the coordinator's rule
sends to the decode node alone is prefilled there and answers exactly what HF transformers
does, as does the same request over the transfer path; the rule's choice shows in
``pd_local_prefills``. The same again with speculative decoding on the decode node."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from pd.model.tokenizer import encode_chat, load_tokenizer
from tests.cluster.conftest import LiveCluster
from tests.hf_reference import hf_greedy

MODEL = "SmolLM2-135M-Instruct"
LOCAL_TOKENS = 48  # --local-prefill-tokens of this cluster
MAX_TOKENS = 24
SYSTEM = (
    "You are a patient assistant for a public library. You answer questions about opening "
    "hours, borrowing rules, late fees, reading rooms, printing and the children's corner. "
    "Keep every answer short, friendly and factual, and say so when you do not know."
)
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("pools_whole_after_each_test")]


@pytest.fixture(scope="module", params=[0, 4], ids=["plain", "speculative"])
def live_spec(request, smollm2_dir) -> dict[str, Any]:
    engine = {"speculative_tokens": request.param}
    return dict(
        num_prefill=1, num_decode=1, local_prefill_tokens=LOCAL_TOKENS, engine_kwargs=engine
    )


def _num_local(live: LiveCluster) -> int:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    match = re.search(r"^pd_local_prefills(?:_total)? (\S+)$", text, re.M)
    assert match, "pd_local_prefills missing from /metrics"
    return int(float(match.group(1)))


def _complete(live: LiveCluster, prompt_ids: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_local_and_transferred_prefills_equal_hf(live, smollm2_dir) -> None:
    tok = load_tokenizer(smollm2_dir)
    short = encode_chat(tok, [{"role": "user", "content": "Name a colour."}])
    turn1 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "When do you open on Sundays?"},
    ]
    long = encode_chat(tok, turn1)
    assert len(short) <= LOCAL_TOKENS < len(long)

    before = _num_local(live)
    out = _complete(live, short)  # short: prefilled on the decode node
    assert _num_local(live) == before + 1
    want = tok.decode(hf_greedy(smollm2_dir, short, MAX_TOKENS), skip_special_tokens=True)
    assert out["choices"][0]["text"] == want

    out = _complete(live, long)  # nothing holds it and it is long: the transfer path
    assert _num_local(live) == before + 1
    answer_ids = hf_greedy(smollm2_dir, long, MAX_TOKENS)
    assert out["choices"][0]["text"] == tok.decode(answer_ids, skip_special_tokens=True)

    # The next turn: the decode node holds turn 1 (prompt and answer, cached when it finished),
    # the prefill node only turn 1's prompt, so the decode node prefills the new part itself.
    turn2 = long + answer_ids + encode_chat(tok, [{"role": "user", "content": "And Mondays?"}])
    out = _complete(live, turn2)
    assert _num_local(live) == before + 2
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(long)
    want = tok.decode(hf_greedy(smollm2_dir, turn2, MAX_TOKENS), skip_special_tokens=True)
    assert out["choices"][0]["text"] == want
