"""Mixture-of-experts decode on the CPU: pd's grouped experts (each expert chosen in a step runs
once on all its tokens, ``pd.model.decoder.MoE``) beside a per-token loop (each token's experts
run for it alone) and HF transformers, on a random Qwen3-MoE of a few hundred MB built from its
config (no download); and int4 against fp32 on the same weights (greedy agreement, logits).

    python scripts/bench_moe.py [--threads 2] [--steps 16] [--experts 16] [--top-k 4]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

# run as a script, scripts/ is on the path: the decode loops and the cpu name of the engine table
from bench_attention import _cpu_name
from bench_engine import hf_decode, pd_decode

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model import decoder
from pd.model.loader import resolve_model


def make_checkpoint(out: Path, experts: int, top_k: int) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=512, intermediate_size=1024, norm_topk_prob=True,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    smollm2 = resolve_model(None)  # its tokenizer files: the engine reads its eos from them
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, out / name)
    return out


def per_token_forward(self: decoder.MoE, x: torch.Tensor) -> torch.Tensor:
    """The baseline: each token's experts run for that token alone (weights read per token)."""
    probs = torch.softmax(self.gate(x).float(), dim=-1)
    weights, chosen = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(self.top_k):
            out[t] += self.experts[int(chosen[t, j])](x[t : t + 1])[0].float() * weights[t, j]
    return out.to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint(Path(tempfile.mkdtemp(prefix="moe-")), args.experts, args.top_k)
    cfg = {"model": str(model_dir), "max_total_tokens": 8192, "enable_prefix_cache": False}
    fp32 = Engine(EngineConfig(**cfg))
    int4 = Engine(EngineConfig(**cfg, quantization="int4"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = fp32.runner.model_config.vocab_size
    rows = []
    grouped = decoder.MoE.forward
    for batch in (1, 32):
        got = {}
        for name, engine, forward in (
            ("pd fp32, grouped", fp32, grouped),
            ("pd fp32, per-token loop", fp32, torch.compiler.disable(per_token_forward)),
            ("pd int4, grouped", int4, grouped),
        ):
            decoder.MoE.forward = forward  # type: ignore[method-assign]
            got[name] = statistics.median(
                pd_decode(engine, batch, 64, args.steps) for _ in range(2)
            )
        decoder.MoE.forward = grouped  # type: ignore[method-assign]
        got["HF transformers fp32"] = hf_decode(hf, batch, 64, args.steps, vocab)
        rows.append((batch, got))
    # int4 against fp32: greedy agreement and logits on the same prompts
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (16, 48), generator=g).tolist()
    a = [r.token_ids for r in fp32.generate(prompts, params)]
    b = [r.token_ids for r in int4.generate(prompts, params)]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    identical = sum(ra == rb for ra, rb in zip(a, b))
    cpu = _cpu_name()
    print(
        f"\n{cpu}, {args.threads} threads; random Qwen3-MoE: 4 layers, hidden 512, "
        f"{args.experts} experts of 512, top {args.top_k}; decode tokens/s (median of 2 runs of "
        f"{args.steps} steps)\n"
    )
    names = list(rows[0][1])
    print("| batch | " + " | ".join(names) + " | grouped / per-token | grouped / HF |")
    print("|---|" + "---:|" * (len(names) + 2))
    for batch, got in rows:
        ratio = got["pd fp32, grouped"] / got["pd fp32, per-token loop"]
        vs_hf = got["pd fp32, grouped"] / got["HF transformers fp32"]
        cells = " | ".join(f"{got[n]:.1f}" for n in names)
        print(f"| {batch} | {cells} | {ratio:.2f}x | {vs_hf:.2f}x |")
    total = sum(len(r) for r in a)
    print(
        f"\nint4 against fp32, greedy, 16 prompts x 32 tokens: {100 * same / total:.1f}% of "
        f"tokens and {identical} of 16 answers identical"
    )


if __name__ == "__main__":
    main()
