"""Engine speed beside HF transformers on the same machine, in the same run.

Prefill tokens/s at 512 and 2048 prompt tokens; decode tokens/s at batch 1, 8 and 32, with
pd's compiled decode steps (``--compile-buckets``, one graph per batch size; their compile
times are printed) and eagerly, in the same engine, one after the other.
The HF baseline is a plain forward loop over its own KV cache (no `generate` overhead).

    python scripts/bench_engine.py [--model PATH] [--threads 2] [--decode-steps 32]
        [--compile-buckets 1,8,32 | off] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pd.core.batch import SeqInput
from pd.core.kv_pool import SlotAllocator
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig


def _best(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _prompts(batch: int, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, n), generator=g).tolist()


def pd_prefill(engine: Engine, n: int, repeat: int) -> float:
    runner = engine.runner
    alloc = SlotAllocator(runner.pool.num_slots, 1)
    prompt = _prompts(1, n, runner.model_config.vocab_size)[0]
    slots = alloc.allocate(n)
    return n / _best(lambda: runner.forward([SeqInput(prompt, slots, 0)]), repeat)


def hf_prefill(hf, n: int, vocab: int, repeat: int) -> float:
    ids = torch.tensor(_prompts(1, n, vocab))
    with torch.inference_mode():
        return n / _best(lambda: hf(ids, use_cache=True, logits_to_keep=1), repeat)


def pd_decode(engine: Engine, batch: int, prompt_len: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for p in _prompts(batch, prompt_len, engine.runner.model_config.vocab_size, seed=batch):
        engine.add_request(p, params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    assert not engine.has_unfinished
    return batch * steps / dt


def hf_decode(hf, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    ids = torch.tensor(_prompts(batch, prompt_len, vocab, seed=batch))
    with torch.inference_mode():
        out = hf(ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = hf(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--linear-backend", default="auto", help="pd's, for unquantized weights")
    ap.add_argument("--compile-buckets", default="1,8,32", help="pd's compiled decode steps")
    ap.add_argument("--dtype", default="float32", help="pd's and HF's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    engine = Engine(
        EngineConfig(
            model=args.model,
            max_total_tokens=16384,
            max_running_requests=64,
            enable_prefix_cache=False,
            linear_backend=args.linear_backend,
            compile_buckets=args.compile_buckets,
            dtype=args.dtype,
        )
    )
    graphs = engine.runner.graphs
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(engine.runner.model_dir, dtype=dtype).eval()
    vocab = engine.runner.model_config.vocab_size
    rows = []
    for n in (512, 2048):
        ours, base = pd_prefill(engine, n, args.repeat), hf_prefill(hf, n, vocab, args.repeat)
        rows.append((f"prefill {n} tokens", ours, base))
    decode1 = None
    for b in (1, 8, 32):
        eager = None
        if graphs.compile_seconds:
            graphs.enabled = False
            eager = statistics.median(
                pd_decode(engine, b, args.decode_prompt_len, args.decode_steps) for _ in range(2)
            )
            graphs.enabled = True
        ours = statistics.median(
            pd_decode(engine, b, args.decode_prompt_len, args.decode_steps) for _ in range(2)
        )
        base = statistics.median(
            hf_decode(hf, b, args.decode_prompt_len, args.decode_steps, vocab) for _ in range(2)
        )
        decode1 = decode1 or ours
        rows.append((f"decode batch {b}", ours, base, eager))
    compiled = ", ".join(f"batch {b}: {s:.0f} s" for b, s in graphs.compile_seconds.items())
    print(
        f"threads={args.threads} model={engine.runner.model_dir.name} dtype={args.dtype} "
        f"linear_backend={args.linear_backend}\n"
        f"compiled decode steps: {compiled or 'off'}\n"
    )
    print(
        "| measure | pd tokens/s | HF tokens/s | pd / HF | pd / pd batch 1 | pd eager tokens/s | eager / HF |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ours, base, *eager in rows:
        rel = f"{ours / decode1:.1f}x" if name.startswith("decode") else ""
        e = eager[0] if eager else None
        tail = f"{e:,.0f} | {e / base:.2f}x" if e else " | "
        print(f"| {name} | {ours:,.0f} | {base:,.0f} | {ours / base:.2f}x | {rel} | {tail} |")


if __name__ == "__main__":
    main()
