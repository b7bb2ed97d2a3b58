"""scripts/bench_workloads.py: trace prompts whose 512-token blocks follow the hash ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench_workloads import TokenText
from make_trace import BLOCK_SIZE, TraceRequest


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
    import argparse

    from bench_workloads import make_multiturn

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
