"""What authenticating every zmq frame (``transfer/auth.py``) costs per message, same run.

Per message kind: msgspec encode + decode (what a message costs without authentication, the
baseline) beside seal + open of its bytes (what authentication adds), in microseconds: the
best of ``--repeats`` short runs of ``--iters`` messages (short, so that on a shared machine
some run is not preempted). Then the hot path end to end: ``--stream`` TokenMsgs pushed over
a loopback PUSH -> PULL and decoded, plain and sealed/opened (throughput, preemptions and all).

    python scripts/bench_auth.py [--iters 100] [--repeats 300] [--stream 20000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from pd.core.messages import CacheEventMsg, PrefillReqMsg, ServerMsg, TokenMsg
from pd.core.sampling_params import SamplingParams
from transfer.auth import Opener, Sealer, new_secret

SECRET = new_secret()
TO = "tcp://127.0.0.1:5555"
REQUEST_ID = "cmpl-0123456789abcdef"
MESSAGES = {
    "TokenMsg, 1 token": TokenMsg(
        request_id=REQUEST_ID,
        offset=40,
        token_ids=[31337],
        finished=False,
        finish_reason=None,
        num_prompt_tokens=512,
        num_cached_tokens=256,
    ),
    "PrefillReqMsg, 2k-token prompt": PrefillReqMsg(
        request_id=REQUEST_ID,
        prompt_ids=list(range(1000, 3048)),
        sampling=SamplingParams(),
        namespace="",
        decode_node="decode-0",
        decode_addr="tcp://10.0.0.2:40001",
        decode_transfer_addr="tcp://10.0.0.2:40002",
    ),
    "CacheEventMsg, 16k tokens": CacheEventMsg(
        node_id="prefill-0", seq=7, kind="inserted", namespace="", tokens=list(range(16384))
    ),
}


def _per_msg_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return min(runs)  # the least disturbed run: the machine is shared


def bench_kinds(iters: int, repeats: int) -> None:
    enc = msgspec.msgpack.Encoder()
    print("| message | bytes | encode+decode us | seal+open us | added |")
    print("|---|---|---|---|---|")
    for name, msg in MESSAGES.items():
        data = enc.encode(msg)
        decode = msgspec.msgpack.Decoder(type(msg))
        base = _per_msg_us(lambda: decode.decode(enc.encode(msg)), iters, repeats)  # noqa: B023
        sealer = Sealer(SECRET, TO)
        opener = Opener(SECRET, TO)
        auth = _per_msg_us(lambda: opener.open(sealer.seal(data)), iters, repeats)  # noqa: B023
        print(f"| {name} | {len(data)} | {base:.2f} | {auth:.2f} | {auth / base:.0%} |")


def bench_stream(num_msgs: int, sealed: bool) -> float:
    """TokenMsgs per second through PUSH -> PULL over loopback TCP, decoded on arrival."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    msg = MESSAGES["TokenMsg, 1 token"]
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ServerMsg)

    def send() -> None:
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        sealer = Sealer(SECRET, addr)
        for _ in range(num_msgs):
            data = enc.encode(msg)
            push.send(sealer.seal(data) if sealed else data)
        push.close(linger=10_000)

    opener = Opener(SECRET, addr)
    t0 = time.perf_counter()
    thread = threading.Thread(target=send)
    thread.start()
    for _ in range(num_msgs):
        frame = pull.recv()
        payload = opener.open(frame) if sealed else frame
        assert payload is not None
        dec.decode(payload)
    elapsed = time.perf_counter() - t0
    thread.join()
    pull.close(linger=0)
    ctx.term()
    return num_msgs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--stream", type=int, default=20000)
    args = ap.parse_args()
    bench_kinds(args.iters, args.repeats)
    plain = statistics.median(bench_stream(args.stream, False) for _ in range(3))
    sealed = statistics.median(bench_stream(args.stream, True) for _ in range(3))
    print(f"\nTokenMsg stream over loopback PUSH -> PULL: {plain:,.0f} msg/s plain, "
          f"{sealed:,.0f} msg/s sealed ({sealed / plain:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
