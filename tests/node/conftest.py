"""Fixtures of the in-process node tests: the tiny model's config, the server's sockets, and
fresh prefill + decode node pairs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from decode.node import DecodeRole
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from tests.node.harness import SECRET, Server
from transfer.state import TransferConfig

Pair = tuple[Node, Node]


@pytest.fixture(scope="module")
def engine_cfg(tiny_llama_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), max_total_tokens=512, page_size=4)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield Server(ctx, pull, f"tcp://127.0.0.1:{port}")
    pull.close(linger=0)
    ctx.term()


@pytest.fixture
def make_pair(engine_cfg: EngineConfig, server: Server) -> Iterator[Callable[..., Pair]]:
    """``make_pair(**transfer)``: a new prefill node and decode node over the fake transfer
    backend (``TransferConfig`` fields as keywords), shut down after the test."""
    made: list[Node] = []

    def make(**transfer: Any) -> Pair:
        cfg = TransferConfig(backend="fake", secret=SECRET, **{"timeout_s": 5.0, **transfer})
        n = len(made)
        p = Node(engine_cfg, NodeConfig(f"prefill-{n}", server.addr, transfer=cfg), PrefillRole)
        d = Node(engine_cfg, NodeConfig(f"decode-{n}", server.addr, transfer=cfg), DecodeRole)
        made.extend((p, d))
        return p, d

    yield make
    server.close()
    for node in made:
        node.shutdown()
