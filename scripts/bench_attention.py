"""Decode attention alone: pd's C++ kernel (``pd.executor.cpu_attention``) beside torch's two ways
of doing it, on the same tensors in the same run.

    python scripts/bench_attention.py [--threads 2] [--dtype bfloat16 | float32] [--layers 30]
        [--heads 9 --kv-heads 3 --head-dim 64]

One layer's attention of B one-token rows over L keys each, for several B and L, each call on
the next of ``--layers`` pools (as a decode step goes through its layers, so that the keys come
from memory rather than from the cache of the call before):
- ``sdpa``: what the eager backend did before the kernel (index_select the keys, one padded
  SDPA call);
- ``inductor``: ``attention.paged_decode_attention`` compiled, what a compiled decode step
  traced before the kernel;
- ``kernel``: ``torch.ops.pd.paged_decode_attention`` (eager; inside a compiled step it is
  the same call).
Microseconds per call, the best of --repeat runs; the ratio columns are sdpa / kernel and
inductor / kernel (above 1: the kernel is faster).

With ``--extend``: the attention of a prefill of N new tokens over P cached ones (one request,
fp32 and bf16), the two ways ``TorchAttentionBackend`` can run it: SDPA with an explicit
[N, P + N] mask, or causal SDPA with P query rows of zeros put before the N (their output
dropped). The backend pads when 4 P <= N.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch
import torch.nn.functional as F

from pd.executor import cpu_attention
from pd.executor.attention import paged_decode_attention


def _time(fn, repeat: int, calls: int = 60) -> float:
    """Best microseconds a call of ``fn(i)`` over ``repeat`` runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeat):
        fn(0)
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _sdpa(q, k_cache, v_cache, idx, mask):
    shape = (*idx.shape, *k_cache.shape[1:])
    flat = idx.view(-1)
    keys = k_cache.index_select(0, flat).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=mask[:, None, None, :], enable_gqa=True
    )
    return out[:, :, 0]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--lengths", default="150,700,2000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layers", type=int, default=30, help="pools the calls go through in turn")
    ap.add_argument("--extend", action="store_true", help="prefill over a cached prefix instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.extend:
        return extend_table(args)
    torch._dynamo.config.recompile_limit = 64  # one graph per (B, L) of the one function
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    if not cpu_attention.available(dtype, cpu, args.heads, args.kv_heads, args.head_dim):
        raise SystemExit("the kernel is not available here (no C++ compiler, or these heads)")
    print(
        f"cpu={_cpu_name()} threads={args.threads} {args.dtype} layers={args.layers} "
        f"heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim}\n"
    )
    print(
        "| rows B | keys L | sdpa us | inductor us | kernel us | sdpa / kernel | inductor / kernel |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for b in (int(x) for x in args.batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            num_slots = b * length + 1
            q = torch.randn(b, args.heads, args.head_dim, generator=g).to(dtype)
            pools = [
                [
                    torch.randn(num_slots, args.kv_heads, args.head_dim, generator=g).to(dtype)
                    for _ in range(2)
                ]
                for _ in range(args.layers)
            ]
            # each row's keys in one run of slots, as the allocator hands out a prompt's
            idx = torch.arange(b * length).view(b, length)
            mask = torch.ones(b, length, dtype=torch.bool)
            inductor = torch.compile(paged_decode_attention, fullgraph=True, dynamic=False)

            def call(i, f, q=q, pools=pools, idx=idx, mask=mask):
                return f(q, *pools[i % len(pools)], idx, mask)

            with torch.inference_mode():
                us = [
                    _time(functools.partial(call, f=f), args.repeat)
                    for f in (_sdpa, inductor, torch.ops.pd.paged_decode_attention)
                ]
            print(
                f"| {b} | {length} | {us[0]:.0f} | {us[1]:.0f} | {us[2]:.0f} | "
                f"{us[0] / us[2]:.2f}x | {us[1] / us[2]:.2f}x |"
            )


def extend_table(args: argparse.Namespace) -> None:
    print(
        f"cpu={_cpu_name()} threads={args.threads} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim}, one layer\n"
    )
    print(
        "| dtype | cached P | new N | mask us | padded causal us | mask / padded | backend pads |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for cached, new in ((4, 640), (64, 640), (160, 640), (320, 640), (640, 640), (620, 20)):
            total = cached + new
            q = torch.randn(1, args.heads, new, args.head_dim, generator=g).to(dtype)
            k, v = (
                torch.randn(1, args.kv_heads, total, args.head_dim, generator=g).to(dtype)
                for _ in range(2)
            )
            mask = torch.ones(new, total, dtype=torch.bool).tril(cached)
            zeros = q.new_zeros(1, args.heads, cached, args.head_dim)

            def masked(q=q, k=k, v=v, mask=mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            def padded(q=q, k=k, v=v, zeros=zeros, cached=cached):
                qp = torch.cat((zeros, q), 2)
                out = F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True)
                return out[:, :, cached:]

            err = (masked() - padded()).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"paths differ by {err}"
            with torch.inference_mode():
                us = [_time(lambda i, f=f: f(), args.repeat, calls=5) for f in (masked, padded)]
            name = "fp32" if dtype == torch.float32 else "bf16"
            print(
                f"| {name} | {cached} | {new} | {us[0]:.0f} | {us[1]:.0f} | "
                f"{us[0] / us[1]:.2f}x | {'yes' if 4 * cached <= new else 'no'} |"
            )


if __name__ == "__main__":
    main()
