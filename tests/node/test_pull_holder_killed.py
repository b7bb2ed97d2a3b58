"""A pull whose holder is killed mid-pull, for real: the holder is a prefill node in a process of
its own (its loop on its own thread, real gloo pair groups), its KV sends slowed down so the
kill (SIGKILL) lands while the prefix's KV is on the wire to the requesting node in this
process. The request computes the prefix instead and answers as it would have; the requesting
node keeps nothing for the pull."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import msgspec
import pytest

from decode.node import DecodeRole
from pd.core.messages import DecodeReqMsg, NodeInfo, PrefillReqMsg
from pd.executor.config import EngineConfig
from pd.node import Node, NodeConfig
from prefill.node import PrefillRole
from tests.node.harness import GREEDY, SECRET, Server, run_until
from tests.node.test_pulls import OTHER, PREFIX, PROMPT, _idle, _pull_request, _run, _stats
from transfer.state import KVPoll, TransferConfig

pytestmark = pytest.mark.timeout(120)
SEND_DELAY_S = 0.4  # per send of the holder's pair: a pull of 3 layers takes a few seconds


def _transfer_cfg() -> TransferConfig:
    return TransferConfig(
        backend="gloo", secret=SECRET, handshake_timeout_s=10.0, timeout_s=5.0,
        connect_timeout_s=10.0,
    )  # fmt: skip


def holder_main(engine_cfg: EngineConfig, node_cfg: NodeConfig, out: Any, cmd: Any) -> None:
    """The holder's process: a prefill node whose pair sends crawl, serving until told."""
    import torch

    from transfer.group import TorchPairGroup

    torch.set_num_threads(1)
    real_isend = TorchPairGroup.isend

    def slow_isend(self: TorchPairGroup, tensor: torch.Tensor) -> Any:
        time.sleep(SEND_DELAY_S)
        return real_isend(self, tensor)

    TorchPairGroup.isend = slow_isend  # type: ignore[method-assign]
    node = Node(engine_cfg, node_cfg, PrefillRole)
    out.put(msgspec.to_builtins(node.start()))
    cmd.get()  # until the test ends (or the process is killed)
    node.shutdown()


class _Remote:
    """What the harness needs of a node that runs in another process."""

    def __init__(self, info: NodeInfo) -> None:
        self._info, self.addr, self.node_id = info, info.addr, info.node_id

    def info(self) -> NodeInfo:
        return self._info


@pytest.mark.slow
def test_a_holder_killed_mid_pull_leaves_the_request_to_compute_its_prefix(
    engine_cfg: EngineConfig, server: Server
) -> None:
    ctx = mp.get_context("spawn")
    out, cmd = ctx.Queue(), ctx.Queue()
    holder_cfg = NodeConfig("pa-proc", server.addr, transfer=_transfer_cfg())
    proc = ctx.Process(target=holder_main, args=(engine_cfg, holder_cfg, out, cmd), daemon=True)
    proc.start()
    b = d = None
    try:
        holder = _Remote(msgspec.convert(out.get(timeout=90), NodeInfo))
        b = Node(engine_cfg, NodeConfig("pb-proc", server.addr, transfer=_transfer_cfg()), PrefillRole)  # fmt: skip
        d = Node(engine_cfg, NodeConfig("d-proc", server.addr, transfer=_transfer_cfg()), DecodeRole)  # fmt: skip
        # the holder prefills PROMPT (its own loop) and sends its KV to d
        server.send(d, DecodeReqMsg(request_id="warm", prompt_ids=PROMPT, sampling=GREEDY,
                                    namespace="", prefill_node=holder.node_id))  # fmt: skip
        di = d.info()
        server.send(holder, PrefillReqMsg(request_id="warm", prompt_ids=PROMPT, sampling=GREEDY,
                    namespace="", decode_node=d.node_id, decode_addr=di.addr,
                    decode_transfer_addr=di.transfer_addr))  # fmt: skip
        run_until(server, (d,), lambda: "warm" in server.finished)
        _run(server, b, d, "ref", OTHER, "ref")  # the answer computed, in another namespace
        _pull_request(server, b, d, "pulled", OTHER, holder, len(PREFIX), timeout_s=60.0)
        run_until(server, (b, d), lambda: b.transfer.poll("pull/pulled") == KVPoll.TRANSFERRING)
        os.kill(proc.pid, signal.SIGKILL)  # the prefix's KV is on the wire
        proc.join(timeout=10)
        run_until(server, (b, d), lambda: "pulled" in server.finished)
        assert server.finished["pulled"].error is None
        assert server.tokens["pulled"] == server.tokens["ref"]
        stats = _stats(server, b)
        assert stats["pulls"] == 1 and stats["failed"] == 1 and stats["tokens"] == 0, stats
        _idle(server, b, d)
        assert b.integrity()["transfers"] == 0 and len(b.role.pulls) == 0
    finally:
        if proc.is_alive():
            cmd.put("exit")
            proc.join(timeout=10)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        for node in (b, d):
            if node is not None:
                node.shutdown()
        server.close()
