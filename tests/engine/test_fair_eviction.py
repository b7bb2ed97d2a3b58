"""Fair eviction between tenants through a real colocated Engine: tenant B's flood of unique
long prompts pushes tenant A's hot prefix out of the pool under global LRU, and under fair
eviction B loses its own least recent prompts instead (``pdtools.tenant_flood``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pdtools.tenant_flood import FloodShape, run_flood

pytestmark = pytest.mark.timeout(120)

# a pool of 1,024 slots; each round B sends 1,024 new tokens: the whole pool again
SHAPE = FloodShape(hot_len=128, question_len=8, flood_len=256, flood_per_round=4, num_rounds=4)


def _engine(model_dir: Path, eviction: str) -> Engine:
    cfg = EngineConfig(
        model=str(model_dir),
        max_total_tokens=1024,
        host_cache_tokens=0,  # the device pool alone: an evicted prefix is gone
        cache_eviction=eviction,
    )
    return Engine(cfg)


@pytest.mark.parametrize("eviction", ["fair", "lru"])
def test_a_hot_prefix_survives_another_tenants_flood_only_with_fair_eviction(
    tiny_llama_dir: Path, eviction: str
) -> None:
    engine = _engine(tiny_llama_dir, eviction)
    r = run_flood(engine, SHAPE)
    engine.check_integrity()
    assert r.num_evicted_tokens >= (SHAPE.num_rounds - 1) * 1024 - 1024, r  # under pressure
    assert r.a_cached[0] == 0
    if eviction == "fair":  # B, over its share, evicts its own prompts: A hits every round
        assert r.a_cached[1:] == [SHAPE.hot_len] * (SHAPE.num_rounds - 1), r
        assert r.a_hit_rate == 1.0
    else:  # one global LRU order: B's newer prompts push A's prefix out every round
        assert r.a_cached[1:] == [0] * (SHAPE.num_rounds - 1), r
        assert r.a_hit_rate == 0.0
