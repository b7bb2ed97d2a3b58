"""A stream whose client never reads, on the colocated engine (which generates whether or not
its client reads): the write timeout's cut aborts the request there and its KV slots come
back. The tiny model is given 4,096 positions (its weights do not depend on them: RoPE) for
answers as long as the issue's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.engine.async_engine import AsyncEngine
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.server import ServerConfig, build_app
from tests.server.conftest import check_idle, serve, wait_for
from tests.server.raw_client import (
    SNDBUF,
    assert_cut_mid_stream,
    client_gone,
    close_all,
    metric,
    read_to_end,
    stalled_streams,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def long_tiny_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4,096 positions."""
    out = tmp_path_factory.mktemp("tiny_4096")
    for path in tiny_llama_dir.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def engine(long_tiny_dir: Path) -> Iterator[AsyncEngine]:
    client = AsyncEngine(lambda: Engine(EngineConfig(model=str(long_tiny_dir))))
    yield client
    client.shutdown()


@pytest.mark.slow
def test_a_stream_cut_off_is_aborted_on_the_engine_and_its_slots_come_back(
    engine: AsyncEngine,
) -> None:
    """Else the engine would run on to 2,000 tokens each."""
    app = build_app(
        engine,
        tokenizer=engine.engine.tokenizer,
        model_name="tiny",
        max_model_len=engine.engine.max_model_len,
        config=ServerConfig(stream_write_timeout_s=1.0),
    )
    with serve(app, sndbuf=SNDBUF) as url:
        stalled = stalled_streams(url, 2)
        wait_for(lambda: client_gone(app, "stalled") == 2, timeout_s=40)
        # released after the abort went to the engine, whose inbox check_idle's call follows
        wait_for(lambda: app.state.server.admission.num_inflight == 0)
        check_idle(engine, app)
        generated = metric(app, "pd_generation_tokens_total")
        received = [read_to_end(sock) for sock in stalled]
    close_all(stalled)
    print(f"2 stalled streams cut after {generated:.0f} tokens (of 2 x 2,000)")
    assert generated < 2 * 2000
    for data in received:
        assert_cut_mid_stream(data)
