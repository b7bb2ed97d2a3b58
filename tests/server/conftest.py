"""Fixtures of the HTTP server tests: the SmolLM2 tokenizer, a scripted fake engine, an app
builder, and helpers for the tests that run the colocated engine on a tiny model."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pd.server import ServerConfig, ServerMetrics, build_app
from tests.server.fake_engine import FakeEngineClient

if TYPE_CHECKING:
    from pd.server.http.listener import Listener

MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 256
# Tokenizes to ids whose text splits "42", the CJK pair and the emoji across tokens.
SCRIPT_TEXT = "Hello world! The answer is 42. 世界 🎉 Done."


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on asyncio only, as the server does."""
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> Any:
    """The one place tests/server get their tokenizer from."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)


@pytest.fixture(scope="session")
def script_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))


@pytest.fixture
def make_app(tokenizer: Any, script_ids: list[int]) -> Callable[..., tuple[Any, FakeEngineClient]]:
    """``make_app(**fake_kwargs) -> (app, fake)``; fake_kwargs go to FakeEngineClient, plus
    ``stats_fn`` / ``extra_health`` / ``config`` (a ServerConfig) / ``max_model_len`` for
    build_app."""

    def make(
        stats_fn: Any = None,
        extra_health: Any = None,
        config: ServerConfig | None = None,
        max_model_len: int = MAX_MODEL_LEN,
        **fake_kwargs: Any,
    ) -> tuple[Any, FakeEngineClient]:
        fake_kwargs.setdefault("output_ids", script_ids)
        fake_kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
        fake = FakeEngineClient(**fake_kwargs)
        app = build_app(
            fake,
            tokenizer=tokenizer,
            model_name=MODEL_NAME,
            max_model_len=max_model_len,
            config=config,
            metrics=ServerMetrics(),
            stats_fn=stats_fn,
            extra_health=extra_health,
        )
        return app, fake

    return make


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(0.01)


def colocated_app(
    model_dir: Path, config: ServerConfig | None = None, **engine_kwargs: Any
) -> tuple[Any, Any]:
    """``(client, app)``: an AsyncEngine over ``model_dir`` and the server over it (the caller
    shuts the client down)."""
    from pd.engine.async_engine import AsyncEngine
    from pd.engine.engine import Engine
    from pd.executor.config import EngineConfig

    client = AsyncEngine(lambda: Engine(EngineConfig(model=str(model_dir), **engine_kwargs)))
    engine = client.engine
    app = build_app(
        client,
        tokenizer=engine.tokenizer,
        model_name="tiny",
        max_model_len=engine.max_model_len,
        config=config,
    )
    return client, app


def check_idle(client: Any, app: Any) -> None:
    """Nothing running, no slot leaked (free + cached == total), no admission place held."""

    def check(engine: Any) -> None:
        assert not engine.has_unfinished
        engine.check_integrity()
        s = engine.stats()
        assert s.num_free_slots + s.num_cached_tokens == s.num_slots, s

    client.call(check)
    admission = app.state.server.admission
    # a stream's place comes back once its response is over on the server's side, which may
    # be a moment after the client has read its last event
    wait_for(lambda: (admission.num_inflight, admission.num_queued) == (0, 0), 2.0)


@contextmanager
def serve(
    app: Any, timeout_s: float = 10.0, sndbuf: int | None = None, listener: Listener | None = None
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free loopback port; yield its base URL.
    ``sndbuf``: the send buffer of each connection's socket (inherited from the listening
    one). Loopback sizes it at 4 MiB from the start (its 64 KiB segments), so a client that
    stops reading is felt only after megabytes; over a network it starts near 2 x 10 segments
    and grows with the congestion window. ``listener``: its connections, as ``pd serve``'s."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    protocol = {} if listener is None else {"http": listener.protocol, "ws": "none"}
    config = uvicorn.Config(app, log_level="warning", lifespan="off", **protocol)  # type: ignore
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during start-up"
        assert time.monotonic() < deadline, f"uvicorn did not start within {timeout_s} s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
        assert not thread.is_alive(), f"uvicorn did not stop within {timeout_s} s"


@contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """ERROR records logged inside the block, by pd and by uvicorn (whose loggers do not
    propagate; enter the block once the server runs: uvicorn's start-up resets them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [
        logging.getLogger(),
        logging.getLogger("uvicorn"),
        logging.getLogger("uvicorn.error"),
    ]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
