"""Nodes outlive their server: a new server attaches (the old one's requests are aborted, every
message goes to the new address), gets the whole cache as events (``resync_cache``), and a node
whose server stopped reading keeps its loop running. In-process nodes on their own loop threads
(tiny model, fake transfer backend)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from decode.node import DecodeRole
from pd.cache.prefix_index import PrefixIndex
from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from tests.conftest import make_node_stats
from tests.node.harness import GREEDY, PROMPTS, SECRET, Server, send_request
from transfer.state import TransferConfig

pytestmark = pytest.mark.timeout(90)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
FAKE = TransferConfig(backend="fake", timeout_s=5.0, handshake_timeout_s=5.0, secret=SECRET)


@pytest.fixture
def new_server() -> Iterator[Server]:
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    server = Server(ctx, pull, f"tcp://127.0.0.1:{port}")
    yield server
    server.close()
    pull.close(linger=0)
    ctx.term()


@pytest.fixture
def started(engine_cfg: EngineConfig, server: Server) -> Iterator[tuple[Node, Node]]:
    """A pair running their own loops, reporting to ``server``."""
    p = Node(engine_cfg, NodeConfig("prefill-7", server.addr, transfer=FAKE), PrefillRole)
    d = Node(engine_cfg, NodeConfig("decode-7", server.addr, transfer=FAKE), DecodeRole)
    p.start()
    d.start()
    yield p, d
    server.close()
    p.shutdown()
    d.shutdown()


def _until(server: Server, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        server.drain()
        time.sleep(0.005)


def test_a_new_server_attaches_and_rebuilds_its_mirror_from_a_snapshot(
    started, server, new_server, engine_cfg
) -> None:
    p, d = started
    reference = [r.token_ids for r in Engine(engine_cfg).generate(PROMPTS[:2], GREEDY)]
    send_request(server, p, d, "old", PROMPTS[0], LONG)
    _until(server, lambda: len(server.tokens.get("old", [])) >= 2)
    for node in (p, d):  # the old server is gone; its request is nobody's
        info = node.attach(new_server.addr)
        assert info.node_id == node.node_id and info.addr == node.addr
    for node in (p, d):
        report = node.check_integrity()
        assert report["unfinished"] == 0 and report["in_use"] == 0, (node.node_id, report)
    server.drain()
    num_old = server.num_stats
    _until(new_server, lambda: {"prefill-7", "decode-7"} <= set(new_server.stats))
    time.sleep(0.3)
    server.drain()
    assert server.num_stats == num_old and "old" not in server.finished  # nothing more there

    # the snapshot: a reset, then the cached paths; replayed, the mirror is the cache
    num_events = p.resync_cache()

    def prefill_events() -> list:  # the decode node reports its own cache too
        return [e for e in new_server.events if e.node_id == p.node_id]

    _until(new_server, lambda: len(prefill_events()) >= num_events)
    events = prefill_events()[-num_events:]
    assert events[0].kind == "reset" and {e.kind for e in events[1:]} == {"inserted"}
    index = PrefixIndex(engine_cfg.page_size, "prefill-7")
    for event in events:
        assert index.apply(event), event
    assert index.num_cached_tokens == p.core.cache.num_cached_tokens > 0
    page = engine_cfg.page_size
    assert index.match_len(PROMPTS[0]) == (len(PROMPTS[0]) - 1) // page * page

    # the new server's requests run as ever, the first from the cache the old one filled
    hits = p.call(lambda: p.core.cache.stats.num_hit_tokens)
    send_request(new_server, p, d, "new", PROMPTS[0], GREEDY)
    send_request(new_server, p, d, "other", PROMPTS[1], GREEDY)
    _until(new_server, lambda: {"new", "other"} <= set(new_server.finished))
    assert [new_server.tokens["new"], new_server.tokens["other"]] == reference
    assert p.call(lambda: p.core.cache.stats.num_hit_tokens) - hits == index.match_len(PROMPTS[0])


def test_a_node_whose_server_stopped_reading_keeps_its_loop_running(engine_cfg, new_server) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    gone = ctx.socket(zmq.PULL)
    port = gone.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    cfg = NodeConfig("prefill-9", addr, server_send_timeout_ms=100, transfer=FAKE)
    node = Node(engine_cfg, cfg, PrefillRole)
    node.start()
    try:
        gone.close(linger=0)  # the server exits: nobody reads, its queue fills up
        stats = make_node_stats("prefill-9", "prefill", num_slots=1, num_free_slots=1)
        start = time.monotonic()
        node.call(lambda: [node.server.send(stats) for _ in range(3000)], timeout=30)
        assert time.monotonic() - start < 10  # one send waited 0.1 s; the rest were dropped
        assert node.server.num_unsent_msgs >= 1000
        node.attach(new_server.addr)  # the loop still answers: a new server can attach
        _until(new_server, lambda: "prefill-9" in new_server.stats)
    finally:
        node.shutdown()
        ctx.term()


def test_a_started_node_has_built_llguidances_tokenizer(started: tuple[Node, Node]) -> None:
    """Built on the grammar worker while the node starts, waited for before ``start`` says
    where to reach it: its memory (~80 MiB on SmolLM2) is the start's, not a step at the node's
    first guided request, minutes into its life (the soak judges the second half)."""
    for node in started:
        assert "grammar_tokenizer" in vars(node.core.runner), node.node_id
        assert node.core.grammars.num_compiled == 0
