"""The colocated engine against HF transformers, and its handling of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pd.core.batch import SeqInput
from pd.core.kv_pool import SlotAllocator
from pd.core.request import Req
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.loader import ModelLoadError
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
TINY = ["tiny_llama_dir", "tiny_llama_tied_dir", "tiny_qwen2_dir", "tiny_llama3_dir"]


def _make_engine(model_dir, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("enable_prefix_cache", False)  # every slot back in the pool after each test
    cfg = EngineConfig(model=str(model_dir), **kw)
    return Engine(cfg)


def _assert_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished
    engine.check_integrity()
    assert engine.allocator.num_free_slots == engine.allocator.num_slots


def _prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("fixture", TINY)
def test_tiny_greedy_matches_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    engine = _make_engine(model_dir)
    prompts = [_prompt(n, seed) for seed, n in enumerate((7, 40, 90))]
    results = engine.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results):
        assert res.token_ids == hf_greedy(model_dir, prompt, 32, ignore_eos=True)
        assert res.finish_reason == "length"
    assert len(set(results[0].token_ids)) > 4, "random weights too flat: greedy repeats itself"
    _assert_no_leak(engine)


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir) -> Engine:
    return _make_engine(smollm2_dir, max_total_tokens=8192)


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_chat_and_raw(smol_engine, smollm2_dir):
    from pd.model.tokenizer import encode_chat, encode_prompt

    tok = smol_engine.tokenizer
    chat = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    raw = encode_prompt(tok, "The three primary colors are")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    for prompt in (chat, raw):
        res = smol_engine.generate([prompt], params)[0]
        assert res.token_ids == hf_greedy(smollm2_dir, prompt, 40)
    answer = smol_engine.generate([chat], params)[0]
    assert "Paris" in tok.decode(answer.token_ids)
    _assert_no_leak(smol_engine)


# the cached prefix: more than a quarter of the new tokens, a quarter, a few (SDPA's ways: an
# explicit mask, padded causal; deterministic, every row on pd's kernel: the same bits)
@pytest.mark.parametrize("cached", [100, 60, 4])
def test_prefix_plus_extend_equals_cold_prefill(smol_engine, cached):
    runner = smol_engine.runner
    alloc = SlotAllocator(runner.pool.num_slots, 1)
    prompt = _prompt(300, seed=3)
    cold_slots = alloc.allocate(300)
    cold = runner.forward([SeqInput(prompt, cold_slots, 0)], return_all_logits=True)
    split_slots = alloc.allocate(cached)
    runner.forward([SeqInput(prompt[:cached], split_slots, 0)])
    alloc.extend(split_slots, 300)
    assert runner.deterministic
    warm = runner.forward([SeqInput(prompt[cached:], split_slots, cached)], return_all_logits=True)
    assert torch.equal(warm, cold[cached:])
    alloc.free(cold_slots)
    alloc.free(split_slots)
    alloc.check_integrity()


@pytest.mark.slow
def test_batch_of_different_lengths_equals_each_alone(smol_engine):
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 33, 120, 260))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batched = smol_engine.generate(prompts, params)
    for prompt, res in zip(prompts, batched):
        assert res.token_ids == smol_engine.generate([prompt], params)[0].token_ids
    _assert_no_leak(smol_engine)


def test_chunked_prefill_and_pages_give_the_same_tokens(tiny_llama_dir):
    prompt = _prompt(150, seed=11)
    want = hf_greedy(tiny_llama_dir, prompt, 16, ignore_eos=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for kw in (
        {"max_prefill_tokens": 32},
        {"page_size": 16},
        {"page_size": 16, "max_prefill_tokens": 40},
    ):
        engine = _make_engine(tiny_llama_dir, **kw)
        assert engine.generate([prompt], params)[0].token_ids == want, kw
        _assert_no_leak(engine)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_llama_dir):
    engine = _make_engine(tiny_llama_dir)
    prompt = _prompt(20, seed=5)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], seeded)
    assert a.token_ids == b.token_ids
    other = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other[0].token_ids != a.token_ids
    greedy = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    top1 = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.7, top_k=1, ignore_eos=True)
    )
    assert top1[0].token_ids == greedy[0].token_ids
    _assert_no_leak(engine)


def test_stop_token_ids_and_max_tokens(tiny_llama_dir):
    engine = _make_engine(tiny_llama_dir)
    prompt = _prompt(12, seed=8)
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    res = engine.generate(
        [prompt],
        SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True),
    )[0]
    assert res.token_ids == free_run[: first + 1] and res.finish_reason == "stop"
    res = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert res.token_ids == free_run[:3] and res.finish_reason == "length"
    _assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_queue_nothing(tiny_llama_dir):
    engine = _make_engine(tiny_llama_dir, max_model_len=128, max_total_tokens=512)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(
        ValueError,
        match=r"prompt \(120 tokens\) \+ max_tokens \(32\) = 152 exceeds the context length \(128\)",
    ):
        engine.add_request(_prompt(120, 1), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 10**9], GREEDY)
    small = _make_engine(tiny_llama_dir, max_total_tokens=64)
    with pytest.raises(ValueError, match="needs 79 KV slots, the pool has 64"):
        small.add_request(_prompt(48, 2), GREEDY)
    assert not engine.has_unfinished and not small.has_unfinished
    _assert_no_leak(engine)


def test_unknown_model_and_corrupt_weights(tiny_llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        Engine(EngineConfig(model=str(tmp_path / "no-such-model")))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=weights.name):
        Engine(EngineConfig(model=str(broken)))


def test_pool_pressure_queues_instead_of_failing(tiny_llama_dir):
    # 8 requests x (40 + 31) slots do not fit in 256 slots at once: they must queue and all finish
    engine = _make_engine(tiny_llama_dir, max_total_tokens=256)
    prompts = [_prompt(40, seed) for seed in range(8)]
    results = engine.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results):
        assert res.token_ids == hf_greedy(tiny_llama_dir, prompt, 32, ignore_eos=True)
    _assert_no_leak(engine)


def test_cli_generate_json(smollm2_dir, capsys):
    from pd.cli import main

    rc = main(
        [
            "generate",
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--json",
            "--max-tokens",
            "16",
            "--max-total-tokens",
            "1024",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["prompt_tokens"] > 5 and len(out["token_ids"]) <= 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_retracted_requests_resume_with_the_same_greedy_tokens(tiny_llama_dir, page_size):
    """A pool too small for every running request's growth: the newest is retracted, its KV
    cached, and it resumes by recomputing only what was evicted; its tokens equal a roomy run."""
    prompts = [_prompt(n, 100 + n) for n in (30, 42, 25, 37)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    roomy = _make_engine(tiny_llama_dir, page_size=page_size).generate(prompts, params)
    tight = _make_engine(
        tiny_llama_dir,
        max_total_tokens=192,
        page_size=page_size,
        new_token_ratio=0.2,
        enable_prefix_cache=True,
    )
    results = tight.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    assert tight.scheduler.stats().num_retracted >= 1
    assert tight.stats().num_retracted == tight.scheduler.stats().num_retracted
    tight.check_integrity()
    assert tight.allocator.num_free_slots + tight.cache.num_cached_tokens == 192


def test_a_paused_request_resumes_with_the_same_tokens_and_others_run_on(tiny_llama_dir):
    """``set_paused`` (its client fell behind): the request is left out of steps, its KV kept,
    while another runs on; resumed, both have the very tokens they have undisturbed, greedy and
    seeded, and an engine with only paused requests has nothing to run."""
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    prompts = [_prompt(n, seed) for seed, n in enumerate((11, 30))]
    alone = _make_engine(tiny_llama_dir)
    want = [r.token_ids for r in alone.generate(prompts, [GREEDY, sampled])]

    engine = _make_engine(tiny_llama_dir)
    paused = engine.add_request(prompts[0], GREEDY)
    other = engine.add_request(prompts[1], sampled)
    got: dict[str, list[int]] = {paused: [], other: []}

    def step() -> None:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)

    while len(got[paused]) < 5:
        step()
    engine.set_paused(paused, True)
    num_paused_at = len(got[paused])
    for _ in range(8):
        step()
    assert len(got[paused]) == num_paused_at, "a paused request made tokens"
    assert len(got[other]) >= 8 + num_paused_at - 1, "the other request did not run on"
    while engine.has_unfinished and got[other] != want[1]:
        step()
    assert engine.has_unfinished and not engine.has_runnable  # only the paused one is left
    held = engine.allocator.num_slots - engine.allocator.num_free_slots
    assert engine.step() == [] and held >= len(prompts[0]) + num_paused_at - 1  # its KV kept
    assert engine.stats().num_pauses == 1
    engine.set_paused(paused, False)
    while engine.has_unfinished:
        step()
    assert [got[paused], got[other]] == want
    _assert_no_leak(engine)


def test_a_request_resumed_from_its_output_goes_on_as_undisturbed_and_a_bad_resume_is_refused(
    tiny_llama_dir,
):
    """A failover's resume (``EngineCore.make_request`` with ``output_ids``): the prompt and the
    output so far are prefilled, and it goes on with the tokens (and logprobs) of the
    undisturbed run, greedy, seeded with penalties and logprobs (its draws skipped), and with
    ``min_tokens``; a resume with nothing left to generate or a token outside the vocabulary is
    refused with the numbers."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(
            max_tokens=20,
            temperature=0.9,
            seed=3,
            frequency_penalty=0.4,
            logprobs=1,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=15, logit_bias=((9, 2.0),)),
    ]
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 21, 14))]
    engine = _make_engine(tiny_llama_dir)
    core = engine.core

    def run(i: int, output_ids: list[int]) -> Req:
        req = core.make_request(prompts[i], params[i], f"r{i}-{len(output_ids)}", "", output_ids)
        core.scheduler.add(req)
        while not req.is_finished:
            core.step()
        return req

    want = [run(i, []) for i in range(len(params))]
    for i, w in enumerate(want):
        k = 7
        req = run(i, w.output_ids[:k])
        assert req.output_ids == w.output_ids and req.num_resumed == k
        assert req.output_logprobs == w.output_logprobs[k:] and req.finish_reason == w.finish_reason
    with pytest.raises(ValueError, match="has 20 output tokens, max_tokens 20"):
        core.make_request(prompts[0], params[0], "r", "", want[0].output_ids)
    with pytest.raises(ValueError, match="token id 99999999 outside the vocabulary"):
        core.make_request(prompts[0], params[0], "r", "", [99999999])
    _assert_no_leak(engine)
