"""One tenant floods, another keeps a hot prefix: the workload of fair eviction's test and of
``scripts/bench_tenants.py``, through a real colocated ``Engine``.

Each round, tenant A sends its hot prefix (a system prompt) and a new question, then tenant B
sends ``flood_per_round`` unique long prompts, each generating one token. A's hit rate is the
cached tokens of its requests after the first over the hot prefix's length: 1.0 when its prefix
survived every flood, 0.0 when each flood pushed it out of the pool. A and B are two API keys'
namespaces as ``pd serve`` derives them (isolated per key, the default).
"""

from __future__ import annotations

import random
from typing import NamedTuple

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.server.http.auth import cache_namespace

TENANT_A = cache_namespace("tenant-a-key", None)
TENANT_B = cache_namespace("tenant-b-key", None)
_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class FloodShape(NamedTuple):
    hot_len: int  # tokens of A's hot prefix
    question_len: int  # tokens of each of A's questions after it
    flood_len: int  # tokens of each of B's prompts
    flood_per_round: int  # B's prompts per round
    num_rounds: int


class FloodResult(NamedTuple):
    a_cached: list[int]  # cached_tokens of each of A's requests
    hot_len: int
    num_b_tokens: int  # prompt tokens B sent
    num_evicted_tokens: int  # what the device pool evicted meanwhile

    @property
    def a_hit_rate(self) -> float:
        """A's cached tokens over its hot prefix, its first (cold) request left out."""
        rest = self.a_cached[1:]
        return sum(min(c, self.hot_len) for c in rest) / (self.hot_len * len(rest))


def run_flood(engine: Engine, shape: FloodShape, seed: int = 0, vocab: int = 49152) -> FloodResult:
    """Run the rounds on ``engine`` (idle, its cache empty or not) one request at a time."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    hot = ids(shape.hot_len)
    evicted_before = engine.cache.stats.num_evicted_tokens
    a_cached: list[int] = []
    num_b = 0
    for _ in range(shape.num_rounds):
        a_cached.append(_generate(engine, hot + ids(shape.question_len), TENANT_A))
        for _ in range(shape.flood_per_round):
            _generate(engine, ids(shape.flood_len), TENANT_B)
            num_b += shape.flood_len
    evicted = engine.cache.stats.num_evicted_tokens - evicted_before
    return FloodResult(a_cached, shape.hot_len, num_b, evicted)


def _generate(engine: Engine, prompt: list[int], namespace: str) -> int:
    """One request to its end; its cached prompt tokens."""
    rid = engine.add_request(prompt, _ONE_TOKEN, namespace=namespace)
    cached = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid:
                cached = out.num_cached_tokens
    return cached
