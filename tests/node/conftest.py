"""Fixtures of the in-process node tests: the tiny model's config and the server's sockets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from pd.engine.config import EngineConfig
from tests.node.harness import Server


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
