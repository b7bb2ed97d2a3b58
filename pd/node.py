"""``BaseNode``: what a prefill node and a decode node share.

A node owns an ``EngineCore`` (model runner, KV pool, prefix cache, its role's scheduler), a
transfer agent over the pool, and two sockets: a PULL socket it binds (requests from the server,
``PrefilledMsg`` from prefill nodes) and a PUSH socket to the server (tokens, cache events,
stats). Every frame is sealed under the cluster secret (``transfer.auth``); what fails it is
dropped and counted (``num_rejected_msgs`` in the node's stats). ``start()`` runs its event loop on a thread of its own; one iteration reads

    recv() -> commands -> core.step() -> on_step() (the role's) -> progress() -> publish()

and the Ray actor methods only talk to that loop through a command queue, so no engine state is
touched from two threads. Nothing in one iteration can leave state that makes the next raise
again: a failed forward fails its batch (``EngineCore.step``), and an error while handling one
request fails that request alone (``_guard``).

The stats the loop publishes are its heartbeat: the server declares a node dead when they stop
for ``heartbeat_timeout_s``. A long forward pass beats between its decoder layers, so a busy
loop is told from a stuck one. When a peer dies or leaves (``PeerGoneMsg``), the node closes its
pair groups and sockets to that peer and frees what it kept for the peer's requests
(``_forget_peer``).

The node outlives the server it was started by (a detached Ray actor): while no server reads,
its messages are dropped after ``server_send_timeout_ms`` instead of blocking the loop, and a
new server ``attach``es to it (the old server's requests are aborted, messages go to the new
address) and rebuilds its mirror of the cache from ``resync_cache``: a ``reset`` and the whole
cache as ``inserted`` events, in the event stream itself, so nothing published before or after
the snapshot can overtake it. The same call repairs a mirror that lost events (a seq gap).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import zmq

from pd.cluster.addresses import node_addrs
from pd.core.messages import NodeInfo, NodeMsg, PeerGoneMsg, ServerMsg, TokenMsg
from pd.core.request import Req
from pd.engine.config import EngineConfig
from pd.engine.core import EngineCore, TransferCounters
from pd.engine.scheduler import Scheduler, StepResult
from pd.engine.torch_thread import TorchThread
from pd.model.llama import DecoderLayer
from transfer import BaseSlotOwner, TransferAgent, TransferConfig
from transfer.auth import Opener, Sealer

logger = logging.getLogger(__name__)
_PAIR_THREADS = ("kv-pair-", "kv-copy-")  # a pair group's worker and copier (transfer.datapath)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    server_addr: str  # the server's PULL socket this node pushes to
    # where this node's sockets bind ("auto": this machine's Ray IP; see pd.cluster.addresses)
    host: str = "127.0.0.1"
    stats_interval_s: float = 0.2
    idle_poll_ms: int = 5
    # a message the server's socket cannot take for this long is dropped (no server reads:
    # it exited and a new one will attach), and so is every later one until a send succeeds
    server_send_timeout_ms: int = 2000
    debug_checks: bool = False  # check_integrity() whenever the node goes idle
    transfer: TransferConfig = field(default_factory=TransferConfig)  # holds the cluster secret


class NodeSettings(NamedTuple):
    engine: EngineConfig
    node: NodeConfig


class NodeResources(NamedTuple):
    """What a node holds open; leak checks compare these with their idle level."""

    num_pairs: int  # pair groups (as sender and as receiver)
    num_sockets: int  # zmq sockets: request PULL, server PUSH, peer PUSHes, transfer control
    num_threads: int  # Python threads of the process (pair workers and copiers among them)
    num_transfers: int  # transfers not yet final


class BaseNode:
    role = "base"
    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(
        self,
        engine_cfg: EngineConfig,
        node_cfg: NodeConfig,
        slot_owner: BaseSlotOwner | None = None,
    ) -> None:
        addrs = node_addrs(node_cfg.host, _ray_node_ip)
        node_cfg = dataclasses.replace(  # the transfer plane binds the address it advertises
            node_cfg, transfer=dataclasses.replace(node_cfg.transfer, host=addrs.host)
        )
        self.node_cfg = node_cfg
        self.node_id = node_cfg.node_id
        # built on the thread that will step it (pd.engine.torch_thread: one OpenMP team)
        self._thread = TorchThread(f"{node_cfg.node_id}-loop")
        self.core = self._thread.run(
            lambda: EngineCore(engine_cfg, node_cfg.node_id, self.scheduler_cls)
        )
        pool = self.core.runner.pool
        self.transfer = TransferAgent(
            node_cfg.transfer, pool.k + pool.v, pool.num_layers, slot_owner=slot_owner
        )
        self._ctx = zmq.Context()
        # a message for a peer that is gone must never hold up closing (nor a collected context)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self.addr = addrs.endpoint(self._pull.bind_to_random_port(f"tcp://{addrs.bind_host}"))
        secret = node_cfg.transfer.secret
        self._opener = Opener(secret, self.addr, node_cfg.transfer.max_msg_age_s)
        self._push, self._server_sealer = self._server_socket(node_cfg.server_addr)
        self._is_server_gone = False
        self.num_unsent_msgs = 0  # dropped while no server read them
        self._peers: dict[str, tuple[zmq.Socket[Any], Sealer]] = {}
        self.engine_cfg = engine_cfg
        self._decoder = msgspec.msgpack.Decoder(NodeMsg)
        self._encoder = msgspec.msgpack.Encoder()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[Any]]] = (
            queue.SimpleQueue()
        )
        self._next_stats = 0.0
        self.transfer_counters = TransferCounters()
        self.num_bad_msgs = 0
        self._stopped = threading.Event()
        for module in self.core.runner.model.modules():
            if isinstance(module, DecoderLayer):
                module.register_forward_hook(self._on_layer)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def num_rejected_msgs(self) -> int:
        """Frames that failed authentication, on the request and transfer sockets."""
        return self._opener.drops.total + self.transfer.num_rejected_msgs

    # -- called from the actor's thread -----------------------------------------------------

    def start(self) -> NodeInfo:
        """Start the event loop; return where to reach this node."""
        if not self._thread.has_loop:
            self._thread.start(self._loop)
        return self.info()

    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            role=self.role,
            addr=self.addr,
            transfer_addr=self.transfer.endpoint,
            num_slots=self.core.allocator.num_slots,
            max_model_len=self.core.max_model_len,
            pid=os.getpid(),
            ray_node_id=_ray_node_id(),
        )

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

    # -- a new server (the old one exited) ---------------------------------------------------

    def settings(self) -> NodeSettings:
        """What this node was started with, the cluster secret included (Ray hands it over as
        it handed it in), for a server that attaches: it starts new nodes the same way."""
        return NodeSettings(self.engine_cfg, self.node_cfg)

    def attach(self, server_addr: str) -> NodeInfo:
        """Serve the server at ``server_addr`` from now on; every request of the old server is
        aborted (no one waits for its tokens), and its messages not sent yet are dropped."""

        def repoint() -> NodeInfo:
            for request_id in self._request_ids():
                self._abort(request_id)
            self._push.close(linger=0)
            self.node_cfg = dataclasses.replace(self.node_cfg, server_addr=server_addr)
            self._push, self._server_sealer = self._server_socket(server_addr)
            self._is_server_gone = False
            return self.info()

        return self.call(repoint)

    def resync_cache(self) -> int:
        """Send the whole cache as events (a ``reset``, then ``inserted`` paths) down the event
        stream; the server's mirror of this node is exact again once it reads them. Returns
        how many were sent (0: this node keeps no prefix cache, and no events)."""

        def send_snapshot() -> int:
            snapshot = getattr(self.core.cache, "take_snapshot", None)
            events = snapshot() if snapshot is not None else []
            for event in events:
                self.send_server(event)
            return len(events)

        return self.call(send_snapshot)

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.transfer.close()
        for sock in (self._pull, self._push, *(p[0] for p in self._peers.values())):
            sock.close(linger=0)
        self._ctx.term()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self.run_once()
            except Exception:
                logger.exception("%s: loop iteration failed", self.node_id)
                time.sleep(0.05)

    def run_once(self, block: bool = True) -> bool:
        """One loop iteration; True if it ran a batch. ``block``: when idle, wait a little for
        the next message (the loop's way to sleep); tests drive nodes with ``block=False``."""
        self._recv()
        self._run_commands()
        result = self.core.step()
        self._on_step(result)
        self._progress()
        self._publish()
        busy = result.num_scheduled > 0
        if not busy and block:
            if self.node_cfg.debug_checks and self._num_unfinished() == 0:
                self._check_integrity()
            # transfers progress on the agent's own socket: look again soon while any is open
            self._pull.poll(1 if self._num_transferring() else self.node_cfg.idle_poll_ms)
        return busy

    def _recv(self) -> None:
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if (raw := self._opener.open(frame)) is None:
                continue
            try:
                msg = self._decoder.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                self.num_bad_msgs += 1
                logger.warning("%s: dropped a malformed message: %s", self.node_id, e)
                continue
            with self._guard(getattr(msg, "request_id", "")):
                if isinstance(msg, PeerGoneMsg):
                    self._on_peer_gone(msg)
                else:
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

    def _publish(self) -> None:
        self.publish_cache_events()
        if time.monotonic() >= self._next_stats:
            self._publish_stats()

    def _on_layer(self, *_: Any) -> None:
        """A decoder layer finished (forward hook, on the loop thread): beat if it is time."""
        if time.monotonic() >= self._next_stats:
            self._publish_stats()

    def _publish_stats(self) -> None:
        self._next_stats = time.monotonic() + self.node_cfg.stats_interval_s
        counters = self.transfer_counters._replace(
            num_transferring=self._num_transferring(),
            num_dropped_msgs=self.num_bad_msgs + self.transfer.num_dropped_msgs,
        )
        res = self._resources()
        stats = self.core.stats(self.role, counters)
        self.send_server(
            msgspec.structs.replace(
                stats,
                num_rejected_msgs=self.num_rejected_msgs,
                num_pairs=res.num_pairs,
                num_sockets=res.num_sockets,
                num_threads=res.num_threads,
            )
        )

    def _on_peer_gone(self, msg: PeerGoneMsg) -> None:
        if (peer := self._peers.pop(msg.addr, None)) is not None:
            peer[0].close(linger=0)
        self.transfer.close_peer(msg.transfer_addr)  # fails its transfers before the role looks
        self._forget_peer(msg)

    # -- helpers for the roles --------------------------------------------------------------

    @contextmanager
    def _guard(self, request_id: str) -> Iterator[None]:
        """Run a step of one request's handling: if it raises, that request fails alone."""
        try:
            yield
        except Exception as e:
            logger.exception("%s: handling request %s failed", self.node_id, request_id)
            if request_id:
                self._abort(request_id)
                self.report_error(request_id, f"{type(e).__name__} on {self.node_id}: {e}")

    def publish_cache_events(self) -> None:
        """Send the cache events not sent yet (the coordinator mirrors every node's cache)."""
        for event in self.core.cache.take_events():
            self.send_server(event)

    def send_server(self, msg: ServerMsg) -> None:
        frame = self._server_sealer.seal(self._encoder.encode(msg))
        try:  # once a send timed out, the server is gone: drop without waiting until one passes
            self._push.send(frame, zmq.NOBLOCK if self._is_server_gone else 0)
            self._is_server_gone = False
        except zmq.Again:
            self._is_server_gone = True
            self.num_unsent_msgs += 1

    def _server_socket(self, server_addr: str) -> tuple[zmq.Socket[Any], Sealer]:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, self.node_cfg.server_send_timeout_ms)
        push.connect(server_addr)
        return push, Sealer(self.node_cfg.transfer.secret, server_addr)

    def send_peer(self, addr: str, msg: Any) -> None:
        peer = self._peers.get(addr)
        if peer is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            peer = self._peers[addr] = (sock, Sealer(self.node_cfg.transfer.secret, addr))
        peer[0].send(peer[1].seal(self._encoder.encode(msg)))

    def report(self, req: Req, new_tokens: list[int]) -> None:
        self.send_server(
            TokenMsg(
                request_id=req.request_id,
                token_ids=new_tokens,
                finished=req.is_finished,
                finish_reason=req.finish_reason,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                error=req.error,
                node_id=self.node_id,
            )
        )

    def report_error(self, request_id: str, error: str, can_retry: bool = False) -> None:
        """``can_retry``: the request itself is fine (its KV transfer or a peer failed)."""
        msg = TokenMsg(request_id, [], True, "abort", 0, 0, error, self.node_id, can_retry)
        self.send_server(msg)

    def report_step(self, result: StepResult) -> None:
        """Tokens of the requests that produced one, errors of those that failed."""
        for req in result.failed:
            self.report_error(req.request_id, req.error or "failed")
        for req in result.produced:
            self.report(req, req.output_ids[-1:])

    def add_transfer(self, num_bytes: int, seconds: float) -> None:
        c = self.transfer_counters
        self.transfer_counters = c._replace(
            num_bytes=c.num_bytes + num_bytes,
            num_seconds=c.num_seconds + seconds,
            num_done=c.num_done + 1,
        )

    def _check_integrity(self) -> dict[str, int]:
        core = self.core
        core.scheduler.check_integrity()
        in_use = core.allocator.num_used_slots - core.cache.num_cached_tokens
        res = self._resources()
        return {
            "total": core.allocator.num_slots,
            "free": core.allocator.num_free_slots,
            "cached": core.cache.num_cached_tokens,
            "in_use": in_use,
            "unfinished": self._num_unfinished(),
            "pairs": res.num_pairs,
            "sockets": res.num_sockets,
            "threads": res.num_threads,
            "pair_threads": sum(t.name.startswith(_PAIR_THREADS) for t in threading.enumerate()),
            "transfers": res.num_transfers,
        }

    def _resources(self) -> NodeResources:
        return NodeResources(
            num_pairs=self.transfer.num_pairs,
            num_sockets=2 + len(self._peers) + self.transfer.num_sockets,
            num_threads=threading.active_count(),
            num_transfers=self.transfer.num_open_transfers,
        )

    # -- what each role fills in ------------------------------------------------------------

    def _on_msg(self, msg: Any) -> None:
        raise NotImplementedError

    def _on_step(self, result: StepResult) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _forget_peer(self, msg: PeerGoneMsg) -> None:
        """Free what this node keeps for requests that depended on the node that is gone
        (its transfers are failed already), telling the server of each."""

    def _progress(self) -> None:
        self.transfer.progress()

    def _num_transferring(self) -> int:
        return 0

    def _num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + self._num_expected()

    def _num_expected(self) -> int:
        """Requests the role knows of that its scheduler does not hold yet."""
        return 0

    def _request_ids(self) -> set[str]:
        """Every request this node holds anything for (the role adds what it keeps aside)."""
        return {r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)}


def _ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _ray_node_id() -> str:
    """The Ray node this process runs on ("" outside Ray: nodes built in a test's process)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
