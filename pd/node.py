"""``BaseNode``: what a prefill node and a decode node share.

A node owns a model runner, its KV pool, a prefix cache and a scheduler, a transfer agent over
the pool, and two sockets: a PULL socket it binds (requests from the server, ``PrefilledMsg``
from prefill nodes) and a PUSH socket to the server (tokens, cache events, stats). Its event
loop runs on its own thread and reads as ``recv()`` -> ``schedule()`` -> ``run()`` ->
``postprocess()`` -> ``progress()``; the Ray actor methods only talk to that loop through a
command queue, so no engine state is touched from two threads.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from pd.config import EngineConfig
from pd.engine.engine import CacheFactory, Engine
from pd.engine.request import Req
from pd.messages import NodeMsg, NodeStatsMsg, SamplingMsg, ServerMsg, TokenMsg
from pd.sampling_params import SamplingParams
from transfer import BaseSlotOwner, TransferAgent, TransferConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    server_addr: str  # the server's PULL socket this node pushes to
    host: str = "127.0.0.1"  # where this node's sockets bind; "auto": this machine's Ray IP
    stats_interval_s: float = 0.2
    idle_poll_ms: int = 5
    debug_checks: bool = False  # check_integrity() whenever the node goes idle
    transfer: TransferConfig = field(default_factory=TransferConfig)


def params_from_msg(msg: SamplingMsg) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def params_to_msg(p: SamplingParams) -> SamplingMsg:
    return SamplingMsg(
        p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos
    )


class BaseNode:
    role = "base"

    def __init__(
        self,
        engine_cfg: EngineConfig,
        node_cfg: NodeConfig,
        cache_factory: CacheFactory | None,
        slot_owner: BaseSlotOwner | None = None,
    ) -> None:
        if node_cfg.host == "auto":  # inside a Ray actor on a multi-machine cluster
            import ray

            ip = ray.util.get_node_ip_address()
            node_cfg = dataclasses.replace(
                node_cfg, host=ip, transfer=dataclasses.replace(node_cfg.transfer, host=ip)
            )
        self.node_cfg = node_cfg
        self.node_id = node_cfg.node_id
        self.engine = Engine(engine_cfg, cache_factory, role=self.role)
        self.runner = self.engine.runner
        self.allocator = self.engine.allocator
        self.cache = self.engine.cache
        self.scheduler = self.engine.scheduler
        pool = self.runner.pool
        self.transfer = TransferAgent(
            node_cfg.transfer, pool.k + pool.v, pool.num_layers, slot_owner=slot_owner
        )
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{node_cfg.host}")
        self.addr = f"tcp://{node_cfg.host}:{port}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(node_cfg.server_addr)
        self._peers: dict[str, zmq.Socket[Any]] = {}
        self._decoder = msgspec.msgpack.Decoder(NodeMsg)
        self._encoder = msgspec.msgpack.Encoder()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = (
            queue.SimpleQueue()
        )
        self._next_stats = 0.0
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.num_transfers = 0
        self.num_bad_msgs = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{self.node_id}-loop", daemon=True)
        self._thread.start()

    # -- called from the actor's thread -----------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "role": self.role,
            "addr": self.addr,
            "transfer_addr": self.transfer.endpoint,
            "num_slots": self.allocator.num_slots,
            "max_model_len": self.runner.max_model_len,
        }

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the loop thread, between steps, and return its result."""
        done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._commands.put((fn, done))
        result = done.get(timeout=timeout)
        if isinstance(result, BaseException):
            raise result
        return result

    def check_integrity(self) -> dict[str, int]:
        """Assert the slot pool and cache invariants; return the slot accounting."""
        return self.call(self._check_integrity)

    def num_unfinished(self) -> int:
        return self.call(self._num_unfinished)

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.transfer.close()
        for sock in (self._pull, self._push, *self._peers.values()):
            sock.close(linger=0)
        self._ctx.term()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        # OpenMP keeps its thread count per OS thread: apply the runner's setting here too
        torch.set_num_threads(torch.get_num_threads())
        while not self._stopped.is_set():
            try:
                self._iteration()
            except Exception:
                logger.exception("%s: loop iteration failed", self.node_id)
                time.sleep(0.05)

    def _iteration(self) -> None:
        self._recv()
        self._run_commands()
        batch = self.scheduler.schedule()
        if batch is not None:
            try:
                tokens = self.runner.run(batch.reqs, batch.seqs)
            except Exception as e:  # fail this batch's requests rather than retry forever
                logger.exception("%s: forward failed", self.node_id)
                for req in batch.reqs:
                    self._abort(req.request_id)
                    self.report_error(req.request_id, f"forward failed on {self.node_id}: {e}")
            else:
                self._postprocess(self.scheduler.postprocess(batch, tokens))
        self._progress()
        for event in self.cache.take_events():  # the coordinator mirrors every node's cache
            self.send_server(event)
        self._publish_stats()
        if batch is None:
            if self.node_cfg.debug_checks and self._num_unfinished() == 0:
                self._check_integrity()
            # transfers progress on the agent's own socket: look again soon while any is open
            self._pull.poll(1 if self._num_transferring() else self.node_cfg.idle_poll_ms)

    def _recv(self) -> None:
        while True:
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                self.num_bad_msgs += 1
                logger.warning("%s: dropped a malformed message: %s", self.node_id, e)
                continue
            self._on_msg(msg)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                done.put(fn())
            except Exception as e:  # handed to the caller
                done.put(e)

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + self.node_cfg.stats_interval_s
        self.send_server(
            NodeStatsMsg(
                node_id=self.node_id,
                role=self.role,
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                num_transferring=self._num_transferring(),
                num_slots=self.allocator.num_slots,
                num_free_slots=self.allocator.num_free_slots,
                num_cached_tokens=self.cache.num_cached_tokens,
                num_hit_tokens=self.scheduler.num_admitted_cached_tokens,
                num_miss_tokens=self.scheduler.num_admitted_tokens
                - self.scheduler.num_admitted_cached_tokens,
                transfer_bytes=self.transfer_bytes,
                transfer_seconds=self.transfer_seconds,
                num_transfers=self.num_transfers,
                num_queued_tokens=self.scheduler.num_queued_tokens,
            )
        )

    # -- helpers for the roles --------------------------------------------------------------

    def send_server(self, msg: ServerMsg) -> None:
        self._push.send(self._encoder.encode(msg))

    def send_peer(self, addr: str, msg: Any) -> None:
        sock = self._peers.get(addr)
        if sock is None:
            sock = self._peers[addr] = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
        sock.send(self._encoder.encode(msg))

    def make_req(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingMsg, namespace: str = ""
    ) -> Req:
        return self.engine.make_request(
            prompt_ids, params_from_msg(sampling), request_id, namespace
        )

    def report(self, req: Req, new_tokens: list[int], error: str | None = None) -> None:
        self.send_server(
            TokenMsg(
                request_id=req.request_id,
                token_ids=new_tokens,
                finished=req.is_finished or error is not None,
                finish_reason=req.finish_reason if error is None else "abort",
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached,
                error=error,
            )
        )

    def report_error(self, request_id: str, error: str) -> None:
        self.send_server(TokenMsg(request_id, [], True, "abort", 0, 0, error))

    def _check_integrity(self) -> dict[str, int]:
        self.scheduler.check_integrity(self._held_slot_lists())
        in_use = self.allocator.num_used_slots - self.cache.num_cached_tokens
        return {
            "total": self.allocator.num_slots,
            "free": self.allocator.num_free_slots,
            "cached": self.cache.num_cached_tokens,
            "in_use": in_use,
            "unfinished": self._num_unfinished(),
        }

    # -- what each role fills in ------------------------------------------------------------

    def _on_msg(self, msg: Any) -> None:
        raise NotImplementedError

    def _postprocess(self, produced: list[Req]) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _progress(self) -> None:
        self.transfer.progress()

    def _num_transferring(self) -> int:
        return 0

    def _num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + self._num_transferring()

    def _held_slot_lists(self) -> list[tuple[list[int], Any]]:
        """Slot lists the role holds outside the scheduler (e.g. reservations for incoming KV)."""
        return []
