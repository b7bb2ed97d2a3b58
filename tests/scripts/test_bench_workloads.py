"""pdtools/bench_workloads.py: trace prompts whose 512-token blocks follow the hash ids;
multiturn conversations; copy prompts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from pdtools.bench_workloads import (
    COPY_MAX_WORDS,
    COPY_MIN_WORDS,
    COPY_SOURCE,
    TokenText,
    copy_texts,
    make_copy,
)
from pdtools.trace import BLOCK_SIZE, TraceRequest


@pytest.fixture(scope="module")
def words(smollm2_dir: Path) -> TokenText:
    from transformers import AutoTokenizer

    return TokenText(AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True))


def _blocks(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + BLOCK_SIZE] for i in range(0, len(ids), BLOCK_SIZE)]


@pytest.mark.timeout(120)
def test_equal_hash_ids_give_equal_token_blocks(words: TokenText) -> None:
    a = TraceRequest(0, 2 * BLOCK_SIZE + 100, 8, [0, 1, 2])
    b = TraceRequest(10, 3 * BLOCK_SIZE + 7, 8, [0, 1, 5, 6])  # a's next turn
    c = TraceRequest(20, BLOCK_SIZE + 300, 8, [0, 9])
    enc: dict[str, list[list[int]]] = {}
    for name, r in (("a", a), ("b", b), ("c", c)):
        ids = words.encode(words.trace_prompt(r))
        assert len(ids) == r.input_length  # exact: the server sees the trace's lengths
        enc[name] = _blocks(ids)
        assert len(enc[name]) == len(r.hash_ids)
        # block i of the prompt is block(hash_ids[i]) tokenized alone: no merge at the seams
        for i, (h, block) in enumerate(zip(r.hash_ids, enc[name])):
            assert block == words.encode(words.block(h, len(block))), (name, i)
    assert enc["a"][:2] == enc["b"][:2]  # ids 0, 1 shared
    assert enc["a"][0] == enc["c"][0] and enc["a"][1] != enc["c"][1]
    assert enc["a"][2] != enc["b"][2][:100]  # a's partial tail (id 2) is not b's block (id 5)
    assert len({tuple(x) for blocks in enc.values() for x in blocks}) == 6  # ids 0 1 2 5 6 9


def test_a_partial_block_is_a_prefix_of_the_full_one(words: TokenText) -> None:
    full = words.encode(words.block(42))
    assert len(full) == BLOCK_SIZE
    assert words.encode(words.block(42, 37)) == full[:37]
    assert words.block(42) != words.block(43)
    assert words.block(42) == words.block(42)


def test_token_text_needs_one_token_words() -> None:
    class _Chars:  # a tokenizer of single characters: no word is one token
        def __len__(self) -> int:
            return 300

        def decode(self, ids: list[int]) -> str:
            return chr(ids[0])

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, Any]:
            return {"input_ids": [ord(ch) for ch in text]}

    with pytest.raises(ValueError, match="0 one-token words, need 100"):
        TokenText(_Chars())


def test_multiturn_sends_each_conversation_round_by_round(words: TokenText, smollm2_dir) -> None:
    """Every turn's history is the last turn's messages plus a fixed answer; a conversation's
    next turn comes only after every conversation's turn before it."""
    from pdtools.bench_workloads import make_multiturn

    args = argparse.Namespace(
        tokenizer=str(smollm2_dir),
        num_groups=5,
        prompts_per_group=3,
        prefix_len=40,
        max_tokens=8,
        seed=0,
    )
    requests = make_multiturn(args)
    assert len(requests) == 15
    by_system: dict[str, list[list[dict[str, str]]]] = {}
    for i, r in enumerate(requests):
        assert r.path == "/v1/chat/completions" and r.prompt is None
        turn = (len(r.messages) - 1) // 2  # system, then (question, answer) pairs, question
        assert turn == i // 5  # round by round
        by_system.setdefault(r.messages[0]["content"], []).append(r.messages)
    assert len(by_system) == 5  # each conversation its own system prompt
    for turns in by_system.values():
        for before, after in zip(turns, turns[1:]):
            assert after[: len(before)] == before
            assert after[len(before)]["role"] == "assistant"
            assert len(words.encode(" " + after[len(before)]["content"])) == 8
    assert make_multiturn(args) == requests  # seeded


needs_copy_source = pytest.mark.skipif(
    not COPY_SOURCE.is_file(), reason=f"{COPY_SOURCE} not found (Debian's base-files ships it)"
)


def _copy_args(num_prompts: int, seed: int = 0) -> argparse.Namespace:
    return argparse.Namespace(num_prompts=num_prompts, seed=seed)


@needs_copy_source
def test_copy_texts_are_whole_paragraphs_of_100_to_200_words() -> None:
    texts = copy_texts()
    assert len(texts) == len(set(texts)) > 100
    source = " ".join(COPY_SOURCE.read_text().split())
    for text in texts:
        assert COPY_MIN_WORDS <= len(text.split()) <= COPY_MAX_WORDS
        assert " ".join(text.split()) in source  # paragraphs in order, whitespace normalized


@needs_copy_source
def test_copy_prompts_are_seeded_distinct_and_hold_their_text() -> None:
    texts = copy_texts()
    requests = make_copy(_copy_args(40))
    assert len(requests) == 40
    assert make_copy(_copy_args(40)) == requests  # seeded
    assert make_copy(_copy_args(40, seed=1)) != requests
    prompts = []
    for r in requests:
        assert r.path == "/v1/chat/completions" and r.prompt is None and r.max_tokens is None
        [message] = r.messages
        assert message["role"] == "user"
        instruction, text = message["content"].split("\n\n", 1)
        assert instruction.startswith(("Repeat the following text", "Copy the following text"))
        assert text in texts
        prompts.append(message["content"])
    assert len(set(prompts)) == 40
    assert len({p.split("\n\n", 1)[1] for p in prompts}) == 40  # a text per prompt, while any last


@needs_copy_source
def test_copy_reuses_a_text_only_with_another_instruction() -> None:
    num_texts = len(copy_texts())
    most = 3 * num_texts  # three instructions
    prompts = [r.messages[0]["content"] for r in make_copy(_copy_args(most))]
    assert len(set(prompts)) == most
    with pytest.raises(ValueError, match=f"= {most} distinct prompts, asked for {most + 1}"):
        make_copy(_copy_args(most + 1))


@needs_copy_source
def test_bench_serving_selects_the_copy_workload() -> None:
    from scripts.bench_serving import make_requests, parse_args

    warmup, requests = make_requests(parse_args(["--workload", "copy", "--num-prompts", "5"]))
    assert warmup == [] and requests == make_copy(_copy_args(5))
