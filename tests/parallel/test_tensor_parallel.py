"""Nodes of several ranks (``pd.parallel.group``): real rank processes over gloo.

The tiny model has 4 heads and 2 KV heads, so TP 2 splits the KV heads and TP 4 replicates
them; the kv3 model has SmolLM2's 9 heads over 3 KV heads, which TP 2 splits 1 and 2. Greedy answers at fp32 equal HF's and TP 1's, 16 at once equal one at a time, the host
and disk tiers move every rank's shard, and a rank killed or frozen stops the node with a
clear error within the timeout, leaving no process behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pd.core.batch import SeqInput
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.config import ModelConfig
from pd.model.loader import load_config
from pd.model.sharding import check_divides, kv_heads_of, shard_config
from pd.parallel.group import TensorParallelError
from pd.parallel.plan import decode_plan, encode_forward
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _engine(model_dir: Path, tp: int, **kw: object) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("host_cache_tokens", 0)
    return Engine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, **kw))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_plan_round_trips() -> None:
    seqs = [SeqInput([5, 6, 7], [0, 1, 2], 0), SeqInput([9], [3, 4, 8, 11], 3)]
    plan = decode_plan(encode_forward(seqs, True)[0:])
    assert plan.seqs == [SeqInput([5, 6, 7], [0, 1, 2], 0), SeqInput([9], [3, 4, 8, 11], 3)]
    assert plan.return_all_logits


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_llama_dir: Path) -> None:
    mc = ModelConfig.from_hf(load_config(tiny_llama_dir))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="size 3 does not divide the model's 4 attention heads"):
        check_divides(mc, 3)
    assert shard_config(mc, 4).num_kv_heads == 1  # replicated
    assert [kv_heads_of(2, r, 4) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ValueError, match="does not divide"):
        _engine(tiny_llama_dir, 3)


def test_a_size_that_does_not_divide_the_kv_heads_splits_them_unevenly(tiny_kv3_dir: Path) -> None:
    mc = ModelConfig.from_hf(load_config(tiny_kv3_dir))  # 9 heads, 3 KV heads
    assert [kv_heads_of(3, r, 2) for r in range(2)] == [range(0, 1), range(1, 3)]
    assert [(s.num_heads, s.num_kv_heads) for s in (shard_config(mc, 2, r) for r in (0, 1))] == [
        (3, 1),
        (6, 2),
    ]
    assert shard_config(mc, 3, 2).num_heads == 3
    for size in (4, 5, 6):  # past the 3 KV heads: a multiple of them dividing 9 heads, or not
        with pytest.raises(ValueError, match=f"size {size} does not divide the model's 9 "):
            check_divides(mc, size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, tp", [("llama_kv3", 2), ("llama", 4)], ids=["kv3-tp2", "tp4"])
def test_greedy_equals_hf_and_tp1_batched_and_alone(
    tiny_model_factory: Callable[[str], Path], kind: str, tp: int
) -> None:
    """TP 2 on 3 KV heads (1 and 2 a rank) and TP 4 on 2 (each replicated twice)."""
    model_dir = tiny_model_factory(kind)
    prompts = [_prompt(5 + 7 * i, i) for i in range(16)]
    engine = _engine(model_dir, tp)
    try:
        batched = [r.token_ids for r in engine.generate(prompts, GREEDY)]
        alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts[:4]]
        pids = engine.runner.ranks.pids
        assert len(pids) == tp - 1
    finally:
        engine.runner.close()
    assert not any(_alive(pid) for pid in pids), "a rank outlived its node"
    assert alone == batched[:4]
    for prompt, tokens in zip(prompts, batched):
        assert tokens == hf_greedy(model_dir, prompt, 12, ignore_eos=True)


@pytest.mark.timeout(300)
def test_compiled_steps_speculation_and_int4_give_tp1s_tokens(tiny_llama_dir: Path) -> None:
    """The settings ``pd serve`` ships (int4, compiled decode steps, deterministic) with
    speculation on: TP 2 gives TP 1's greedy tokens, batched as alone."""
    kw = dict(quantization="int4", compile_buckets="1,2", speculative_tokens=3)
    system = _prompt(40, 99)
    prompts = [system + _prompt(4, i) + system[:12] for i in range(3)]  # repeats: drafts hit
    out = {}
    for tp in (1, 2):
        engine = _engine(tiny_llama_dir, tp, **kw)
        try:
            out[tp] = [r.token_ids for r in engine.generate(prompts, GREEDY)]
            assert engine.runner.graphs.num_runs, "no compiled step ran"
            assert engine.generate([prompts[1]], GREEDY)[0].token_ids == out[tp][1]
        finally:
            engine.runner.close()
    assert out[1] == out[2]


@pytest.mark.timeout(300)
def test_host_and_disk_tiers_move_every_ranks_shard(tiny_kv3_dir: Path, tmp_path: Path) -> None:
    """Prefixes evicted to the host tier of a TP-2 node (its ranks of 1 and 2 KV heads) come
    back right; its disk chunks (every KV head) warm a TP-1 node started after it."""
    systems = [_prompt(150, 10 + s) for s in range(4)]  # 4 x 150 > the 384-slot pool
    kw = dict(max_total_tokens=384, host_cache_tokens=2048, disk_cache_dir=str(tmp_path))
    asks = [s + _prompt(5, 100 + i) for i, s in enumerate(systems)]
    expected = [hf_greedy(tiny_kv3_dir, p, 12, ignore_eos=True) for p in asks]
    engine = _engine(tiny_kv3_dir, 2, **kw)
    try:
        for s in systems:
            engine.generate([s + [1]], GREEDY)
        results = [engine.generate([p], GREEDY)[0] for p in asks]
        tier = engine.cache.tier_stats
        assert tier is not None and tier.num_loads >= 1
    finally:
        engine.runner.close()
    assert [r.token_ids for r in results] == expected
    assert all(r.num_cached_tokens >= 149 for r in results)
    warm = _engine(tiny_kv3_dir, 1, **kw)  # reads the TP-2 node's chunks up
    result = warm.generate([asks[0]], GREEDY)[0]
    assert result.num_cached_tokens >= 128, "no chunk of the TP-2 node was read"
    assert result.token_ids == expected[0]


@pytest.mark.timeout(300)
def test_int8_kv_on_a_tp2_node_gives_tp1s_answers_through_its_tiers(
    tiny_kv3_dir: Path, tmp_path: Path
) -> None:
    """int8 KV split over ranks of 1 and 2 KV heads (each head's row: its codes and scale):
    the answers of a TP-1 node with int8 KV, cold and loaded back from the host tier, and its
    disk chunks (every head) warm a TP-1 node."""
    systems = [_prompt(150, 20 + s) for s in range(4)]
    kw = dict(max_total_tokens=384, host_cache_tokens=2048, disk_cache_dir=str(tmp_path))
    kw["kv_cache_dtype"] = "int8"
    asks = [s + _prompt(5, 200 + i) for i, s in enumerate(systems)]
    alone = _engine(tiny_kv3_dir, 1, kv_cache_dtype="int8", enable_prefix_cache=False)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in asks]
    engine = _engine(tiny_kv3_dir, 2, **kw)
    try:
        for s in systems:
            engine.generate([s + [1]], GREEDY)
        results = [engine.generate([p], GREEDY)[0] for p in asks]
        assert engine.cache.tier_stats.num_loads >= 1
        batched = engine.generate(asks, GREEDY)
    finally:
        engine.runner.close()
    assert [r.token_ids for r in results] == [r.token_ids for r in batched] == expected
    warm = _engine(tiny_kv3_dir, 1, **kw)
    result = warm.generate([asks[0]], GREEDY)[0]
    assert result.num_cached_tokens >= 128, "no chunk of the TP-2 node was read"
    assert result.token_ids == expected[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_rank_killed_or_frozen_stops_the_node_within_the_timeout(
    tiny_llama_dir: Path, fault: str
) -> None:
    engine = _engine(tiny_llama_dir, 2, tensor_parallel_timeout_s=3.0)
    (pid,) = engine.runner.ranks.pids
    try:
        assert engine.generate([_prompt(9, 1)], GREEDY)[0].finish_reason == "length"
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        # the rank's exit seen before the batch (kill), or the batch's sum fails (either)
        with pytest.raises(RuntimeError, match="rank"):
            engine.generate([_prompt(9, 2)], GREEDY)
        assert time.monotonic() - t0 < 3.0 + 2.0
        assert engine.core.fatal_error is not None
        with pytest.raises(TensorParallelError, match="rank"):  # ... and the node is done
            engine.generate([_prompt(9, 3)], GREEDY)
    finally:
        if fault == "freeze":
            os.kill(pid, signal.SIGCONT)
        engine.runner.close()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


@pytest.mark.timeout(120)
def test_a_rank_frozen_while_the_node_is_idle_is_found_by_its_silence(tiny_llama_dir: Path) -> None:
    """No sum waits on an idle node: a frozen rank is found by its missing heartbeat (a byte
    down a pipe every ``RANK_BEAT_S``), so a cluster's node goes down before work reaches it."""
    from pd.parallel.ranks import RANK_SILENCE_S

    engine = _engine(tiny_llama_dir, 2)
    (pid,) = engine.runner.ranks.pids
    try:
        engine.runner.check_ranks()  # beating
        os.kill(pid, signal.SIGSTOP)
        time.sleep(RANK_SILENCE_S + 0.5)
        with pytest.raises(TensorParallelError, match="rank 1 silent for"):
            engine.core.step()
        assert engine.core.fatal_error is not None
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.runner.close()
