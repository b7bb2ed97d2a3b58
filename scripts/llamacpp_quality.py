"""llama.cpp's side of ``bench_quant.py --llamacpp``: greedy tokens, perplexity and speed of the
Q4_1 GGUF, run by the side venv's Python (``.venv-llamacpp``: llama-cpp-python and numpy, no
torch and no pd). Reads one JSON job on stdin, writes one JSON result on stdout:

    in:  {"model": path, "threads": n, "prompts": [[id, ...], ...], "num_tokens": n,
          "ppl_ids": [id, ...], "window": n, "decode_prompt_len": n, "decode_steps": n,
          "prefill_len": n, "rounds": n}
    out: {"greedy": [[id, ...], ...], "ppl": x, "decode1_ms": x, "prefill512": x}

Prompts arrive as token ids (pd's tokenizer and chat template), so both engines see the same
input; greedy decoding runs past EOS, as pd's does with ``ignore_eos``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import llama_cpp
import numpy as np

# argmax sampling, as pd's temperature 0 (no top-p/min-p cut can change the argmax)
_GREEDY: dict[str, Any] = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "reset": True}


def greedy(llm: llama_cpp.Llama, prompt: list[int], num_tokens: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt, **_GREEDY):
        out.append(int(token))
        if len(out) == num_tokens:
            break
    return out


def perplexity(llm: llama_cpp.Llama, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping ``window``-token chunks, as pd's."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[: window - 1], dtype=np.float64)  # [window - 1, vocab]
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll += float((log_z - logits[np.arange(window - 1), chunk[1:]]).sum())
        count += window - 1
    return float(np.exp(nll / count))


def decode_ms(llm: llama_cpp.Llama, prompt_len: int, steps: int) -> float:
    """ms per token of one request decoding ``steps`` tokens after a ``prompt_len`` prompt."""
    prompt = [100 + i % 1000 for i in range(prompt_len)]
    gen = llm.generate(prompt, **_GREEDY)
    next(gen)  # the prompt's forward and the first token
    t0 = time.perf_counter()
    for _ in range(steps):
        next(gen)
    return 1000 * (time.perf_counter() - t0) / steps


def prefill_tokens_per_s(llm: llama_cpp.Llama, n: int) -> float:
    ids = [100 + (7 * i) % 5000 for i in range(n)]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return n / (time.perf_counter() - t0)


def main() -> None:
    job: dict[str, Any] = json.load(sys.stdin)
    ctx = max(job["window"], job["prefill_len"], job["decode_prompt_len"] + job["decode_steps"] + 8)
    ctx = max(ctx, max(len(p) for p in job["prompts"]) + job["num_tokens"] + 8)

    def load(logits_all: bool) -> llama_cpp.Llama:
        return llama_cpp.Llama(
            model_path=job["model"],
            n_ctx=ctx,
            n_batch=max(job["window"], job["prefill_len"]),
            n_threads=job["threads"],
            logits_all=logits_all,
            verbose=False,
        )

    llm = load(False)  # as the server runs it: the last position's logits only
    result: dict[str, Any] = {"decode1_ms": float("inf"), "prefill512": 0.0}
    for _ in range(job["rounds"]):
        ms = decode_ms(llm, job["decode_prompt_len"], job["decode_steps"])
        result["decode1_ms"] = min(result["decode1_ms"], ms)
        tps = prefill_tokens_per_s(llm, job["prefill_len"])
        result["prefill512"] = max(result["prefill512"], tps)
    result["greedy"] = [greedy(llm, p, job["num_tokens"]) for p in job["prompts"]]
    del llm
    result["ppl"] = perplexity(load(True), job["ppl_ids"], job["window"])  # every position's
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
