"""Pulls between nodes (``pd.node.pulls``): a prefill node takes a prefix's KV from the node that
holds it, and computes it instead whenever the pull does not come (refused, holder gone or
frozen, another tenant's prefix). In-process nodes (tiny model, fake transfer backend), driven
one iteration at a time; the answers are compared with the holder's own."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from decode.node import DecodeRole
from pd.core.messages import DecodeReqMsg, PeerGoneMsg, PrefillReqMsg, PullFrom
from pd.core.sampling_params import SamplingParams
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from tests.node.harness import GREEDY, SECRET, Server, assert_idle, run_until
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(90)
PREFIX = [(7 * i + 3) % 500 + 10 for i in range(48)]  # 12 pages of 4
PROMPT = PREFIX + [901, 902, 903]
OTHER = PREFIX + [911, 912, 913, 914, 915]

Trio = tuple[Node, Node, Node]  # prefill-a, prefill-b, decode


@pytest.fixture
def make_trio(engine_cfg: EngineConfig, server: Server) -> Iterator[Callable[..., Trio]]:
    made: list[Node] = []

    def make() -> Trio:
        cfg = TransferConfig(backend="fake", secret=SECRET, timeout_s=5.0)
        n = len(made)
        a = Node(engine_cfg, NodeConfig(f"pa-{n}", server.addr, transfer=cfg), PrefillRole)
        b = Node(engine_cfg, NodeConfig(f"pb-{n}", server.addr, transfer=cfg), PrefillRole)
        d = Node(engine_cfg, NodeConfig(f"d-{n}", server.addr, transfer=cfg), DecodeRole)
        made.extend((a, b, d))
        return a, b, d

    yield make
    server.close()
    for node in made:
        node.shutdown()


def _pull_request(
    server: Server,
    p: Node,
    d: Node,
    rid: str,
    prompt: list[int],
    holder: Node,
    num_tokens: int,
    *,
    namespace: str = "",
    timeout_s: float = 5.0,
    params: SamplingParams = GREEDY,
) -> None:
    """What the server sends when the coordinator chose a pull from ``holder``."""
    server.send(
        d,
        DecodeReqMsg(
            request_id=rid, prompt_ids=prompt, sampling=params, namespace=namespace,
            prefill_node=p.node_id,
        ),
    )  # fmt: skip
    h, di = holder.info(), d.info()
    pull = PullFrom(
        node_id=h.node_id,
        addr=h.addr,
        transfer_addr=h.transfer_addr,
        num_tokens=num_tokens,
        timeout_s=timeout_s,
    )
    server.send(
        p,
        PrefillReqMsg(
            request_id=rid,
            prompt_ids=prompt,
            sampling=params,
            namespace=namespace,
            decode_node=d.node_id,
            decode_addr=di.addr,
            decode_transfer_addr=di.transfer_addr,
            pull=pull,
        ),
    )


def _idle(server: Server, *nodes: Node) -> None:
    run_until(server, nodes, lambda: all(n.count_unfinished() == 0 for n in nodes))
    run_until(server, nodes, lambda: all(n.integrity()["pulls_serving"] == 0 for n in nodes))
    assert_idle(*nodes)


def _stats(server: Server, node: Node) -> dict[str, int]:
    server.stats.pop(node.node_id, None)
    node.heartbeat.send_stats()
    deadline = time.monotonic() + 5
    while node.node_id not in server.stats and time.monotonic() < deadline:
        server.drain()
        time.sleep(0.001)
    s = server.stats[node.node_id]
    return {"pulls": s.num_pulls, "failed": s.num_pulls_failed, "tokens": s.num_pulled_tokens,
            "served": s.num_pulls_served, "hit": s.num_hit_tokens}  # fmt: skip


def _run(server: Server, p: Node, d: Node, rid: str, prompt: list[int], ns: str = "") -> None:
    """One request through ``p`` and ``d`` in namespace ``ns``, to its end."""
    server.send(d, DecodeReqMsg(request_id=rid, prompt_ids=prompt, sampling=GREEDY,
                                namespace=ns, prefill_node=p.node_id))  # fmt: skip
    di = d.info()
    server.send(p, PrefillReqMsg(request_id=rid, prompt_ids=prompt, sampling=GREEDY,
                namespace=ns, decode_node=d.node_id, decode_addr=di.addr,
                decode_transfer_addr=di.transfer_addr))  # fmt: skip
    run_until(server, (p, d), lambda: rid in server.finished)
    assert server.finished[rid].error is None, server.finished[rid]


def test_a_pulled_prefix_answers_like_the_holder_and_is_not_computed(server, make_trio) -> None:
    a, b, d = make_trio()
    _run(server, a, d, "warm", PROMPT)
    _run(server, a, d, "ref", OTHER)  # the reference: the holder's own answer
    before = _stats(server, b)
    _pull_request(server, b, d, "pulled", OTHER, a, len(PREFIX))
    run_until(server, (a, b, d), lambda: "pulled" in server.finished)
    assert server.finished["pulled"].error is None
    assert server.tokens["pulled"] == server.tokens["ref"]
    assert server.finished["pulled"].num_cached_tokens >= len(PREFIX)  # b's hit, the pulled part
    _idle(server, a, b, d)
    after = _stats(server, b)
    assert after["pulls"] - before["pulls"] == 1 and after["failed"] == before["failed"]
    assert after["tokens"] - before["tokens"] == len(PREFIX)
    assert after["hit"] - before["hit"] >= len(PREFIX)
    assert _stats(server, a)["served"] == 1
    # the prefix is b's own now: a second request there hits it without a pull
    _run(server, b, d, "again", OTHER)
    assert server.tokens["again"] == server.tokens["ref"]
    assert server.finished["again"].num_cached_tokens >= len(PREFIX)
    _idle(server, a, b, d)


# where the holder keeps the prefix (None: nowhere), per fault
_HELD = {"refused": None, "holder_gone": "", "holder_frozen": "", "other_tenant": "tenant-a"}


@pytest.mark.parametrize("fault", list(_HELD))
def test_a_pull_that_does_not_come_is_computed_instead(server, make_trio, fault) -> None:
    a, b, d = make_trio()
    if (ns := _HELD[fault]) is not None:
        _run(server, a, d, f"warm-{fault}", PROMPT, ns)
    _run(server, b, d, f"ref-{fault}", OTHER, "ref")  # b holds it, but under another namespace
    rid = f"pulled-{fault}"
    timeout = 0.5 if fault == "holder_frozen" else 5.0
    _pull_request(server, b, d, rid, OTHER, a, len(PREFIX), timeout_s=timeout)
    driven: tuple[Node, ...] = (a, b, d)
    if fault == "holder_gone":  # b asked; a dies before it reads the ask
        run_until(server, (b,), lambda: len(b.role.pulls) == 1, max_iters=50)
        hi = a.info()
        server.send(
            b, PeerGoneMsg(node_id=hi.node_id, addr=hi.addr, transfer_addr=hi.transfer_addr)
        )
        driven = (b, d)
    elif fault == "holder_frozen":
        driven = (b, d)  # a never reads its ask
    run_until(server, driven, lambda: rid in server.finished)
    assert server.finished[rid].error is None
    assert server.tokens[rid] == server.tokens[f"ref-{fault}"]
    stats = _stats(server, b)
    assert stats["pulls"] == 1 and stats["failed"] == 1 and stats["tokens"] == 0
    _idle(server, *driven)


def test_kv_offered_for_tokens_other_than_the_prefix_asked_for_is_refused(
    server, make_trio
) -> None:
    a, b, d = make_trio()
    _run(server, b, d, "ref-forged", OTHER, "ref")
    _pull_request(server, b, d, "forged", OTHER, a, len(PREFIX))  # a is never driven
    run_until(server, (b,), lambda: len(b.role.pulls) == 1, max_iters=50)
    free = b.core.allocator.num_free_slots
    pid = "pull/forged"
    for num_tokens, tokens in (
        (8, [1] * 8),
        (len(PREFIX) + 4, OTHER[: len(PREFIX) + 4]),
        (8, None),
    ):
        with pytest.raises(ValueError, match="not the prefix asked for|no pull"):
            b.role.pulls.reserve(pid, num_tokens, tokens)
    with pytest.raises(ValueError, match="no pull"):
        b.role.pulls.reserve("pull/nobody", 8, OTHER[:8])
    assert b.core.allocator.num_free_slots == free  # nothing reserved
    run_until(server, (b, d), lambda: "forged" in server.finished)
    assert server.tokens["forged"] == server.tokens["ref-forged"]
    assert _stats(server, b)["failed"] == 1
    _idle(server, b, d)


@pytest.mark.slow
def test_fifty_cycles_of_warm_pull_and_evict_leave_nothing_behind(server, make_trio) -> None:
    """Prefixes warmed on one node and pulled by another, 50 times over pools of 512 slots (so
    older prefixes are evicted on both sides as the cycles go), the holder alternating between
    the other prefill node and the decode node: every answer as computed, and afterwards no
    slot, lock, transfer, held request or extra pair group on any node."""
    a, b, d = make_trio()
    for i in range(50):
        prefix = [(31 * i + 7 * k) % 900 + 20 for k in range(48)]
        prompt = prefix + [950 + i % 40, 7, 8]
        _run(server, a, d, f"warm-{i}", prefix + [3])
        _run(server, b, d, f"ref-{i}", prompt, "ref")  # the cold answer, in another namespace
        holder = a if i % 2 == 0 else d  # d holds warm-{i}'s prompt and output: the prefix too
        _pull_request(server, b, d, f"cycle-{i}", prompt, holder, len(prefix))
        run_until(server, (a, b, d), lambda i=i: f"cycle-{i}" in server.finished)
        assert server.tokens[f"cycle-{i}"] == server.tokens[f"ref-{i}"], i
    _idle(server, a, b, d)
    stats = _stats(server, b)
    assert stats["pulls"] == 50 and stats["failed"] == 0, stats
    assert stats["tokens"] > 0
    for node in (a, b, d):
        report = node.integrity()
        assert report["transfers"] == 0 and report["pulls_serving"] == 0, (node.node_id, report)
        assert report["pairs"] <= 4, (node.node_id, report)  # each way with each of 2 peers
        assert report["free"] + report["cached"] == report["total"], (node.node_id, report)
    assert len(b.role.pulls) == 0 and not b.role.pulls._landing
