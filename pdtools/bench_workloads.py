"""The requests each scripts/bench_serving.py workload sends (prompts, chat turns, a replayed
trace, texts to copy).

Exact token counts come from ``TokenText``: text made of words that are each one token of the
model's tokenizer (with their leading space), so n words are n tokens and texts concatenate
without merging across the seam: a 512-word block stays a 512-token block inside any prompt.
"""

from __future__ import annotations

import argparse
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from pdtools.trace import BLOCK_SIZE, TraceRequest

_WORDS = (
    "the of and to in is for on that with as by at from this be are it an or was which have "
    "data model cache token prefix server request stream latency memory layer batch decode "
    "prefill node cluster router shared value system network time first second result paper "
    "method large small fast slow question answer example number table figure section"
).split()
_TOPICS = ("the cache", "latency", "the first section", "memory", "the main result", "routing")
COPY_SOURCE = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it
COPY_MIN_WORDS, COPY_MAX_WORDS = 100, 200
_COPY_INSTRUCTIONS = (
    "Repeat the following text exactly.",
    "Copy the following text word for word.",
    "Repeat the following text exactly, but write every '{word}' as '{upper}'.",
)

Prompt = str | list[int]  # text, or token ids (/v1/completions takes both)


class Request(NamedTuple):
    """One request to send: a completion prompt or chat messages, and when to send it."""

    prompt: Prompt | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None  # None: the run's --max-tokens
    send_at_s: float | None = None  # seconds after the run's start; None: as soon as allowed

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


def load_tokenizer(name: str | None) -> Any:
    """--tokenizer's HF directory, else pd's default model's (ids must be valid for it)."""
    if name:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    from pd.model.tokenizer import load_tokenizer as load_default

    return load_default(None)


class TokenText:
    """Deterministic text of an exact token count: each word is one token, space included."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        words = []
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            w = text[1:]
            if text.startswith(" ") and 4 <= len(w) <= 10 and w.isascii() and w.isalpha():
                words.append(text)
        # a word stands alone as one token; sorted so that the text depends on the vocab only
        self.words = sorted(w for w in words if len(self.encode(w)) == 1)
        if len(self.words) < 100:
            raise ValueError(f"the tokenizer has {len(self.words)} one-token words, need 100")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text(self, seed: int | str, num_tokens: int) -> str:
        """``num_tokens`` words drawn by ``seed``; a shorter count gives a prefix of a longer."""
        rng = random.Random(seed)
        return "".join(rng.choice(self.words) for _ in range(num_tokens))

    def block(self, hash_id: int, num_tokens: int = BLOCK_SIZE) -> str:
        return self.text(f"block {hash_id}", num_tokens)

    def trace_prompt(self, r: TraceRequest) -> str:
        """Block i is block(hash_ids[i]); the last one holds the rest of input_length."""
        last = r.input_length - BLOCK_SIZE * (len(r.hash_ids) - 1)
        sizes = [BLOCK_SIZE] * (len(r.hash_ids) - 1) + [last]
        return "".join(self.block(h, n) for h, n in zip(r.hash_ids, sizes))


def make_cached_prefix(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, prompts): every prompt is the same --prefix-len ids + fresh ones."""
    rng = random.Random(args.seed)
    vocab = len(load_tokenizer(args.tokenizer))
    assert vocab > 1000, vocab  # ids below 1000 hold the special tokens; skip them

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    prefix = ids(args.prefix_len)
    warmup = prefix + ids(args.suffix_len)
    return warmup, [prefix + ids(args.suffix_len) for _ in range(args.num_prompts)]


def make_prompts(args: argparse.Namespace) -> list[str]:
    """shared-prefix and fixed: words, or random ids' text with --tokenizer."""
    rng = random.Random(args.seed)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
        vocab = len(tok)

        def text(n: int) -> str:  # random ids decode to n-ish tokens of noise
            return tok.decode([rng.randrange(1000, vocab) for _ in range(n)])
    else:

        def text(n: int) -> str:
            return " ".join(rng.choice(_WORDS) for _ in range(n))

    if args.workload == "fixed":
        return [text(args.prefix_len + args.suffix_len)] * args.num_prompts
    prompts = []
    for g in range(args.num_groups):
        prefix = f"[group {g}] " + text(args.prefix_len)
        prompts += [prefix + " " + text(args.suffix_len) for _ in range(args.prompts_per_group)]
    rng.shuffle(prompts)  # interleave groups so routing and eviction matter
    return prompts


def make_chat(args: argparse.Namespace) -> list[Request]:
    """--num-groups system prompts of exactly --prefix-len tokens, --prompts-per-group
    different questions each, groups interleaved."""
    words = TokenText(load_tokenizer(args.tokenizer))
    requests = []
    for g in range(args.num_groups):
        system = "You answer questions about this text:" + words.text(
            f"system {g}", args.prefix_len
        )
        for q in range(args.prompts_per_group):
            topic = _TOPICS[q % len(_TOPICS)]
            question = f"Question {q + 1}: what does the text say about {topic}? Be brief."
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            requests.append(Request(messages=messages))
    random.Random(args.seed).shuffle(requests)
    return requests


def make_multiturn(args: argparse.Namespace) -> list[Request]:
    """--num-groups conversations, each with its own system prompt of --prefix-len tokens and
    --prompts-per-group turns; turn t sends the system prompt, the t - 1 earlier questions with
    a fixed answer of --max-tokens tokens each (so the request's prompt is the last turn's
    prompt + its answer + a new question, whatever the server answered), and question t.
    Sent round by round (turn 1 of every conversation, shuffled, then turn 2, ...): between two
    turns of one conversation every other conversation takes a turn, so a pool smaller than
    all the conversations evicts what the next round reuses."""
    words = TokenText(load_tokenizer(args.tokenizer))
    answer_len = args.max_tokens
    rounds: list[list[Request]] = [[] for _ in range(args.prompts_per_group)]
    for g in range(args.num_groups):
        system = "You answer questions about this text:" + words.text(
            f"system {g}", args.prefix_len
        )
        messages = [{"role": "system", "content": system}]
        for t in range(args.prompts_per_group):
            topic = _TOPICS[t % len(_TOPICS)]
            question = f"Question {t + 1}: what does the text say about {topic}? Be brief."
            messages = [*messages, {"role": "user", "content": question}]
            rounds[t].append(Request(messages=messages))
            answer = words.text(f"answer {g} {t}", answer_len).strip()
            messages = [*messages, {"role": "assistant", "content": answer}]
    rng = random.Random(args.seed)
    for turn in rounds:
        rng.shuffle(turn)
    return [r for turn in rounds for r in turn]


def copy_texts(source: Path = COPY_SOURCE) -> list[str]:
    """Every run of consecutive paragraphs of ``source`` that first reaches COPY_MIN_WORDS
    words, if it stays within COPY_MAX_WORDS (a run per start paragraph; GPL-3 gives 116)."""
    if not source.is_file():
        raise FileNotFoundError(f"{source} not found (Debian's base-files ships it)")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", source.read_text())]
    paragraphs = [p for p in paragraphs if p]
    texts = []
    for start in range(len(paragraphs)):
        end, num_words = start, 0
        while end < len(paragraphs) and num_words < COPY_MIN_WORDS:
            num_words += len(paragraphs[end].split())
            end += 1
        if COPY_MIN_WORDS <= num_words <= COPY_MAX_WORDS:
            texts.append("\n\n".join(paragraphs[start:end]))
    return texts


def _copy_instruction(index: int, text: str) -> str:
    """Instruction ``index``; the edit one upper-cases the text's most frequent 4+ letter word."""
    words = Counter(w for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 4)
    word = words.most_common(1)[0][0]
    return _COPY_INSTRUCTIONS[index].format(word=word, upper=word.upper())


def make_copy(args: argparse.Namespace) -> list[Request]:
    """--num-prompts chat requests to repeat (or repeat with one word upper-cased) a text of
    100-200 words: an answer that copies its prompt, for n-gram (prompt-lookup) speculative
    decoding. Texts are shuffled by --seed and all used before any is reused, which it is with
    another instruction, so all prompts differ. A text is 111-374 tokens for SmolLM2: a full
    copy needs --max-tokens 400 (and --no-ignore-eos to stop at its end)."""
    texts = copy_texts()
    num_instructions = len(_COPY_INSTRUCTIONS)
    if args.num_prompts > len(texts) * num_instructions:
        raise ValueError(
            f"copy has {len(texts)} texts × {num_instructions} instructions = "
            f"{len(texts) * num_instructions} distinct prompts, asked for {args.num_prompts}"
        )
    rng = random.Random(args.seed)
    rng.shuffle(texts)
    first = [rng.randrange(num_instructions) for _ in texts]  # each text's first instruction
    requests = []
    for i in range(args.num_prompts):
        round_, t = divmod(i, len(texts))
        text = texts[t]
        instruction = _copy_instruction((first[t] + round_) % num_instructions, text)
        messages = [{"role": "user", "content": f"{instruction}\n\n{text}"}]
        requests.append(Request(messages=messages))
    return requests


def make_trace_requests(args: argparse.Namespace, trace: list[TraceRequest]) -> list[Request]:
    """The trace's requests at timestamp × --time-scale, each prompt checked to tokenize to
    exactly its input_length."""
    words = TokenText(load_tokenizer(args.tokenizer))
    t0 = trace[0].timestamp if trace else 0
    requests = []
    for r in trace:
        prompt = words.trace_prompt(r)
        if (n := len(words.encode(prompt))) != r.input_length:
            raise ValueError(f"trace prompt tokenizes to {n} tokens, not {r.input_length}: {r}")
        send_at = (r.timestamp - t0) / 1000 * args.time_scale
        requests.append(Request(prompt=prompt, max_tokens=r.output_length, send_at_s=send_at))
    return requests
