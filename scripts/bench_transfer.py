"""KV transfer speed between two processes, beside a plain loopback TCP socket, same run.

Moves the KV of a 2,048-token request of the default model (SmolLM2-135M: 30 layers, 3 KV
heads, head_dim 64, fp32 -> ~94 MB) from one process's pool to another's, and times "prefill
done" (sender created) -> "decode can start" (receiver holds the KV) and -> the sender has
the ack. Slot cases (source -> destination):

- ``both one run``: a fresh allocation on both sides (SlotAllocator hands out low slots
  first), the usual case: no copy on either side.
- ``scattered -> one run``: random source slots (a fragmented prefill pool), fresh run on D.
- ``scattered -> scattered``: random slots in random order on both sides, the worst case:
  a gather on P and a scatter on D.

The TCP baseline sends the same bytes with sendall into recv_into and counts until a one-byte
ack comes back. The components line times one thread gathering / scattering the same bytes.

``--kv-cache-dtype int8`` moves the pool of an int8 node instead (codes and a scale per token
and head: 68 bytes a head's row where fp32 takes 256).

    python scripts/bench_transfer.py [--tokens 2048] [--iters 5] [--backend gloo]
        [--kv-cache-dtype auto|int8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

import torch

from pd.core.kv_pool import KVPool, SlotAllocator
from pd.executor import cpu_attention
from transfer.agent import TransferAgent
from transfer.layout import KVLayout
from transfer.state import CallbackSlotOwner, KVPoll, TransferConfig

CASES = {  # name -> (source scattered, destination scattered)
    "both one run": (False, False),
    "scattered -> one run": (True, False),
    "scattered -> scattered": (True, True),
}


def _pool(args: argparse.Namespace, seed: int | None) -> KVPool:
    int8 = args.kv_cache_dtype == "int8"  # the layout alone: rows are filled here, not quantized
    quantize = cpu_attention.quantize if int8 else None
    pool = KVPool(args.layers, 2 * args.tokens, args.heads, args.head_dim, quantize=quantize)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in pool.k + pool.v:
            noise = torch.randint(-128, 128, t.shape, generator=gen) if int8 else None
            t.copy_(noise if noise is not None else torch.randn(t.shape, generator=gen))
    return pool


def _checksum(pool: KVPool, slots: list[int]) -> float:
    """Weighted by token position, so rows that land in the wrong slots change it."""
    idx = torch.tensor(slots)
    w = torch.arange(1, len(slots) + 1, dtype=torch.float64)
    return sum(float(t[idx].double().flatten(1).sum(1) @ w) for t in pool.k + pool.v)


def _receiver(
    args: argparse.Namespace, cfg: TransferConfig, scattered: bool, out: Any, cmd: Any
) -> None:
    torch.set_num_threads(1)
    pool = _pool(args, None)
    alloc = SlotAllocator(pool.num_slots)
    gen = torch.Generator().manual_seed(2)

    def allocate(n: int) -> list[int] | None:
        if not alloc.can_allocate(n):
            return None
        if not scattered:
            return alloc.allocate(n)  # one ascending run on this fresh pool
        free = alloc.allocate(alloc.num_free_slots)  # n random ones of them, in random order
        pick = torch.randperm(len(free), generator=gen)
        alloc.free(sorted((free[i] for i in pick[n:].tolist()), reverse=True))
        return [free[i] for i in pick[:n].tolist()]

    owner = CallbackSlotOwner(allocate, alloc.free)
    agent = TransferAgent(cfg, pool.k + pool.v, pool.num_layers, owner)
    out.put(agent.endpoint)
    for i in range(args.iters + 1):
        r = agent.receiver(f"t{i}")
        while not r.poll().is_final:
            time.sleep(args.poll_ms / 1e3)
        out.put((r.poll().name, time.monotonic(), _checksum(pool, r.slots)))
        alloc.free(sorted(r.slots, reverse=True))  # so the next allocation ascends again
    cmd.get()
    agent.close()


def _tcp_receiver(nbytes: int, port_q: Any) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(port_q.get()):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(b"k")
    conn.close()


def bench_tcp(payload: torch.Tensor, iters: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_receiver, args=(payload.numel() * payload.element_size(), q))
    p.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    q.put(iters + 1)
    data = memoryview(payload.numpy()).cast("B")
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        sock.sendall(data)
        assert sock.recv(1) == b"k"
        times.append(time.perf_counter() - t0)
    sock.close()
    p.join(10)
    return statistics.median(times[1:])


def bench_transfer(
    args: argparse.Namespace, scattered_src: bool, scattered_dst: bool
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out, cmd = ctx.Queue(), ctx.Queue()
    # one config, so both ends hold the same cluster secret
    cfg = TransferConfig(backend=args.backend, timeout_s=60.0, connect_timeout_s=60.0)
    proc = ctx.Process(target=_receiver, args=(args, cfg, scattered_dst, out, cmd))
    proc.start()
    try:
        pool = _pool(args, seed=0)
        agent = TransferAgent(cfg, pool.k + pool.v, pool.num_layers)
        endpoint = out.get(timeout=120)
        gen = torch.Generator().manual_seed(1)
        rows: list[dict[str, float]] = []
        for i in range(args.iters + 1):
            if scattered_src:
                slots = torch.randperm(pool.num_slots, generator=gen)[: args.tokens].tolist()
            else:  # one ascending run (not at slot 0)
                slots = list(range(args.tokens // 2, args.tokens // 2 + args.tokens))
            t0 = time.monotonic()  # prefill done
            snd = agent.sender(f"t{i}", endpoint, args.tokens)
            snd.send(slots)
            t_start = None
            while not (state := snd.poll()).is_final:
                if t_start is None and state == KVPoll.TRANSFERRING:
                    t_start = time.monotonic()
                time.sleep(args.poll_ms / 1e3)
            t_ack = time.monotonic()
            r_state, t_ready, r_sum = out.get(timeout=120)
            assert (state, r_state) == (KVPoll.SUCCESS, "SUCCESS"), (snd.failure, r_state)
            assert abs(r_sum - _checksum(pool, slots)) <= 1e-6 * max(1.0, abs(r_sum)), (
                "data differs"
            )
            t_start = t_start or t0
            rows.append(
                dict(
                    handshake=t_start - t0,
                    data=t_ready - t_start,
                    ready=t_ready - t0,
                    ack=t_ack - t0,
                )
            )
        cmd.put("exit")
        agent.close()
        med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
        return dict(med, first=rows[0]["ack"], nbytes=args.tokens * pool.num_bytes_per_token)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--poll-ms", type=float, default=1.0, help="node loop sleep between polls")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {name: bench_transfer(args, *flags) for name, flags in CASES.items()}
    nbytes = runs["both one run"]["nbytes"]
    mb = nbytes / 1e6
    tcp_s = bench_tcp(torch.zeros(nbytes // 4, dtype=torch.float32), args.iters)
    gather_s, scatter_s = bench_copies(args)
    print(
        f"\nKV of {args.tokens} tokens: {args.layers} layers x {args.heads} KV heads x "
        f"{args.head_dim} dims, {'int8 + scales' if args.kv_cache_dtype == 'int8' else 'fp32'}, "
        f"K+V = {mb:.1f} MB; median of {args.iters} after a "
        f"warm-up; one thread gathers all of it in {1e3 * gather_s:.1f} ms, scatters it in "
        f"{1e3 * scatter_s:.1f} ms (random slots)\n"
    )
    print("| slots (source -> destination) | measure | time (ms) | MB/s | vs TCP |")
    print("|---|---|---:|---:|---:|")
    print(
        f"| | loopback TCP socket, same bytes (sendall -> ack) | {1e3 * tcp_s:.1f} | "
        f"{mb / tcp_s:.0f} | 100% |"
    )
    for case, res in runs.items():
        rows = [
            (f"{args.backend} data (start -> in the receiver's pool)", res["data"]),
            ("prefill done -> decode can start (handshake + data)", res["ready"]),
            ("prefill done -> sender has the ack", res["ack"]),
            ("handshake (prefill done -> data starts)", res["handshake"]),
            ("first transfer incl. pair group set-up (-> ack)", res["first"]),
        ]
        for i, (name, sec) in enumerate(rows):
            rate = f"{mb / sec:.0f} | {100 * tcp_s / sec:.0f}%" if i < 3 else " | "
            print(f"| {case} | {name} | {1e3 * sec:.1f} | {rate} |")


def bench_copies(args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds for one thread to gather, and to scatter, every layer of the KV."""
    pool = _pool(args, seed=0)
    lo = KVLayout(pool.k + pool.v, pool.num_layers)
    idx = torch.randperm(pool.num_slots)[: args.tokens]
    buf = torch.empty(args.tokens * lo.elems_per_token, dtype=lo.dtype)
    times: dict[str, list[float]] = {"gather": [], "scatter": []}
    for _ in range(args.iters):
        for name, op in (("gather", lo.gather), ("scatter", lo.scatter)):
            t0 = time.perf_counter()
            for layer in range(lo.num_layers):
                op(layer, idx, buf)
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["gather"]), statistics.median(times["scatter"])


if __name__ == "__main__":
    main()
