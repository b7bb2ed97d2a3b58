"""The prefill -> decode handshake in one process: transfer retries and first-token latency.

One prefill node and one decode node (``pd.node.Node``, each on its own loop thread, no Ray,
the KV over ``--backend``) and a stand-in server (the sealed sockets the cluster client uses)
that sends ``--requests`` requests at ``--rate`` per second, each as the client does:
``DecodeReqMsg`` to the decode node, then ``PrefillReqMsg`` to the prefill node (two sockets,
so the prefill node's transfer request may reach the decode node first). It prints the
transfer requests sent again after a "no room" answer (retries), those the decode node held
until their request came (0 where the code cannot hold), and the first token's latency, from
the server's send to the token in its socket.

    python scripts/bench_handshake.py [--requests 200] [--rate 20] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import msgspec
import zmq

from decode.node import DecodeRole
from pd.core.messages import DecodeReqMsg, PrefillReqMsg, ServerMsg, TokenMsg
from pd.core.sampling_params import SamplingParams
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from transfer.auth import Opener, Sealer, new_secret
from transfer.state import TransferConfig


def _retries(node: Node) -> int:
    """Transfer requests the node sent again after "no room" (counted from its transfers' own
    records where the agent has no counter: the code before it had one)."""
    n = getattr(node.transfer, "num_retries", None)
    records = node.transfer._sender.records.values()
    return n if n is not None else sum(r.num_no_room for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "fake"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=4, help="requests before the measured ones")
    args = ap.parse_args()

    secret, ctx = new_secret(), zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    transfer = TransferConfig(backend=args.backend, secret=secret, linger_s=3600.0)
    engine = EngineConfig(model=args.model, max_total_tokens=65536)
    p = Node(engine, NodeConfig("prefill-0", addr, transfer=transfer), PrefillRole)
    d = Node(engine, NodeConfig("decode-0", addr, transfer=transfer), DecodeRole)
    p_info, d_info = p.start(), d.start()
    push: dict[str, tuple[Any, Sealer]] = {}
    for info in (p_info, d_info):
        sock = ctx.socket(zmq.PUSH)
        sock.connect(info.addr)
        push[info.addr] = (sock, Sealer(secret, info.addr))

    def send(to: str, msg: Any) -> None:
        sock, sealer = push[to]
        sock.send(sealer.seal(msgspec.msgpack.encode(msg)))

    opener, decoder = Opener(secret, addr), msgspec.msgpack.Decoder(ServerMsg)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, TokenMsg] = {}

    def drain(until: float) -> None:
        while (wait := until - time.monotonic()) > 0 and pull.poll(max(1, int(wait * 1000))):
            raw = opener.open(pull.recv())
            msg = None if raw is None else decoder.decode(raw)
            if isinstance(msg, TokenMsg):
                first.setdefault(msg.request_id, time.monotonic())
                if msg.finished:
                    done[msg.request_id] = msg

    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def request(rid: str) -> None:
        prompt = [rng.randrange(100, 20000) for _ in range(args.prompt_len)]
        common = dict(request_id=rid, prompt_ids=prompt, sampling=params, namespace="")
        sent[rid] = time.monotonic()
        send(d_info.addr, DecodeReqMsg(**common, prefill_node=p_info.node_id))
        send(
            p_info.addr,
            PrefillReqMsg(
                **common,
                decode_node=d_info.node_id,
                decode_addr=d_info.addr,
                decode_transfer_addr=d_info.transfer_addr,
            ),
        )

    def wait_done(n: int) -> None:
        deadline = time.monotonic() + 300
        while len(done) < n and time.monotonic() < deadline:
            drain(time.monotonic() + 0.1)

    for i in range(args.warmup):  # one at a time: the first forwards are not measured
        request(f"warmup-{i}")
        wait_done(i + 1)
    base_retries = p.call(lambda: _retries(p))
    base_held = d.call(lambda: getattr(d.transfer, "num_held_requests", 0))
    start = time.monotonic()
    for i in range(args.requests):
        drain(start + i / args.rate)
        request(f"r{i}")
    wait_done(args.warmup + args.requests)
    ttft = sorted(1000 * (first[r] - sent[r]) for r in first if r.startswith("r"))
    held = d.call(lambda: getattr(d.transfer, "num_held_requests", 0)) - base_held
    measured = [m for rid, m in done.items() if rid.startswith("r")]
    errors = sum(m.error is not None for m in measured)
    retries = p.call(lambda: _retries(p)) - base_retries
    print(f"{len(measured)}/{args.requests} finished, {errors} with an error")
    print(f"transfer retries: {retries}   held by the decode node: {held}")
    q = statistics.quantiles(ttft, n=10)
    print(
        f"first-token latency ms: p50 {q[4]:.1f}  p90 {q[8]:.1f}  (mean {statistics.mean(ttft):.1f})"
    )
    for node in (p, d):
        node.shutdown()
    for sock, _ in push.values():
        sock.close(linger=0)
    pull.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
