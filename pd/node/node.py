"""``Node``: one loop thread that drives an engine core for a role, composed of parts.

A node owns an ``EngineCore`` (model runner, KV pool, prefix cache, its role's scheduler), a
``TransferAgent`` over the pool, its sockets (``Inbox``, ``ServerLink``, ``PeerLinks``) and a
role object (``prefill.node.PrefillRole`` or ``decode.node.DecodeRole``, a ``BaseRole``).
``start()`` runs its loop on a thread of its own; one iteration reads

    recv() -> commands -> core.step() -> role.after_step() -> publish()

and the Ray actor methods only talk to that loop through a command queue, so no engine state is
touched from two threads. Nothing in one iteration can leave state that makes the next raise
again: a failed forward fails its batch (``EngineCore.step``), and an error while handling one
request fails that request alone (``guard``).

The stats the loop publishes are its heartbeat: the server declares a node dead when they stop
for ``heartbeat_timeout_s``. A long forward pass beats between its decoder layers (the engine's
layer callback), so a busy loop is told from a stuck one (``pd.node.heartbeat``). Any node's ``PullSource`` answers
another node's ``PullReqMsg`` by sending the KV of the prefix it holds (``pd.node.pulls``), and
the server's ``ResendMsg`` by sending a request's output again from an offset (some of its
token frames were lost, or it was silent: ``pd.node.replay``).
When a peer dies or leaves
(``PeerGoneMsg``), the node closes its pair groups and sockets to that peer and the role frees
what it kept for the peer's requests, and refuses the peer's transfer endpoint until a node
joins there (``PeerUpMsg``: the kernel may give a replacement the gone node's port).

The node outlives the server it was started by (a detached Ray actor, ``pd.fleet.node_actor``):
while no server reads, its messages are dropped after ``server_send_timeout_ms`` instead of
blocking the loop, and a new server ``attach``es to it (the old server's requests are aborted,
messages go to the new address) and rebuilds its mirror of the cache from ``resync_cache``: a
``reset`` and the whole cache as ``inserted`` events, in the event stream itself, so nothing
published before or after the snapshot can overtake it. The same call repairs a mirror that lost
events (a seq gap).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import zmq

from pd.core.addresses import node_addrs
from pd.core.messages import NodeInfo, PeerGoneMsg, PeerUpMsg, PullReqMsg, ResendMsg
from pd.engine.core import EngineCore
from pd.engine.scheduler import Scheduler
from pd.engine.torch_thread import TorchThread
from pd.executor.config import EngineConfig
from pd.node.config import NodeConfig, NodeSettings
from pd.node.heartbeat import Heartbeat, LoopCommands, NodeResources
from pd.node.links import Inbox, PeerLinks, ServerLink
from pd.node.pulls import PullSource
from pd.node.role import BaseRole, NodeParts
from pd.node.staged_owner import StagedSlotOwner
from pd.parallel.group import TensorParallelError
from transfer.agent import TransferAgent
from transfer.inbound import max_frame_bytes

logger = logging.getLogger(__name__)
WARM_TIMEOUT_S = 60.0  # what a start waits for llguidance's tokenizer (seconds, on a busy host)
_PAIR_THREADS = ("kv-pair-", "kv-copy-")  # a pair group's worker and copier (transfer.datapath)


class Node:
    def __init__(
        self, engine_cfg: EngineConfig, node_cfg: NodeConfig, role_cls: type[BaseRole]
    ) -> None:
        addrs = node_addrs(node_cfg.host, node_cfg.node_ip)
        if not role_cls.decodes:
            engine_cfg = dataclasses.replace(
                engine_cfg, compile_buckets="off", speculative_tokens=0
            )
        self.engine_cfg = engine_cfg
        self.node_cfg = node_cfg
        self.node_id = node_cfg.node_id
        self.role_name = role_cls.name
        # built on the thread that will step it (pd.engine.torch_thread: one OpenMP team)
        self._thread = TorchThread(f"{node_cfg.node_id}-loop")
        self.core = self._thread.run(
            lambda: EngineCore(
                engine_cfg,
                node_cfg.node_id,
                role_cls.scheduler_cls,
                node_cfg.machine_nodes,
                staged=True,
            )
        )
        # llguidance's tokenizer, built on the grammar worker meanwhile: a start's memory
        self._grammar_warm = self.core.grammars.warm()
        secret = node_cfg.transfer.secret
        # the largest legitimate frame carries a prompt (or cache path, slots) of max_model_len
        frame_limit = max_frame_bytes(self.core.max_model_len)
        self._ctx = zmq.Context()
        # a message for a peer that is gone must never hold up closing (nor a collected context)
        self._ctx.setsockopt(zmq.LINGER, 0)
        self.inbox = Inbox(
            self._ctx,
            addrs.bind_host,
            addrs.host,
            secret,
            node_cfg.transfer.max_msg_age_s,
            self.node_id,
            frame_limit,
            node_cfg.transfer.max_conns,
        )
        self.server = ServerLink(
            self._ctx, self.node_id, node_cfg.server_addr, secret, node_cfg.server_send_timeout_ms
        )
        self.peers = PeerLinks(self._ctx, secret)
        slot_owner = role_cls.make_slot_owner(self.core, self.server, self.peers, self.inbox.addr)
        # a tensor-parallel node's pool of every head
        staging = self.core.ranks.staging if self.core.ranks is not None else None
        pool = self.core.runner.transfer_pool
        self.transfer = TransferAgent(  # the transfer plane binds the address it advertises
            dataclasses.replace(node_cfg.transfer, host=addrs.host, max_frame_bytes=frame_limit),
            pool.k + pool.v,
            pool.num_layers,
            slot_owner=(
                StagedSlotOwner(slot_owner, staging)
                if staging is not None and slot_owner is not None
                else slot_owner
            ),
        )
        self.role = role_cls(
            NodeParts(
                self.node_id,
                self.core,
                self.transfer,
                self.server,
                self.peers,
                slot_owner,
                self.guard,
                self.inbox.addr,
            )
        )
        self.pull_source = PullSource(self.core, self.transfer, self.peers)
        self._commands = LoopCommands()
        self.heartbeat = Heartbeat(
            lambda: self.node_cfg.stats_interval_s,
            self.role_name,
            self.core,
            self.role,
            self.inbox,
            self.server,
            self.transfer,
            self.peers,
            self.pull_source,
        )
        self._stopped = threading.Event()

    @property
    def addr(self) -> str:
        """The inbox: where the server and prefill nodes send this node messages."""
        return self.inbox.addr

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # -- called from the actor's thread -----------------------------------------------------

    def start(self) -> NodeInfo:
        """Start the event loop; return where to reach this node (once llguidance's tokenizer
        is built, or ``WARM_TIMEOUT_S`` passed: it goes on building on its worker)."""
        futures.wait([self._grammar_warm], WARM_TIMEOUT_S)
        if not self._thread.has_loop:
            self._thread.start(self._loop)
        return self.info()

    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            role=self.role_name,
            addr=self.addr,
            transfer_addr=self.transfer.endpoint,
            num_slots=self.core.allocator.num_slots,
            max_model_len=self.core.max_model_len,
            pid=os.getpid(),
            ray_node_id=self.node_cfg.ray_node_id,
            kv_bytes_per_token=self.core.runner.pool.num_bytes_per_token,
        )

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the loop thread, between steps, and return its result."""
        return self._commands.call(fn, timeout)

    def check_integrity(self) -> dict[str, int]:
        """Assert the slot pool and cache invariants; return the slot accounting."""
        return self.call(self.integrity)

    def num_unfinished(self) -> int:
        return self.call(self.count_unfinished)

    # -- a new server (the old one exited) ---------------------------------------------------

    def settings(self) -> NodeSettings:
        """What this node was started with, the cluster secret included (Ray hands it over as
        it handed it in), for a server that attaches: it starts new nodes the same way (each
        on its own machine, so without this one's address)."""
        node = dataclasses.replace(self.node_cfg, node_ip="", ray_node_id="")
        return NodeSettings(self.engine_cfg, node)

    def attach(self, server_addr: str) -> NodeInfo:
        """Serve the server at ``server_addr`` from now on; every request of the old server is
        aborted (no one waits for its tokens), and its messages not sent yet are dropped."""

        def repoint() -> NodeInfo:
            for request_id in self.request_ids():
                self.role.abort(request_id)
            self.node_cfg = dataclasses.replace(self.node_cfg, server_addr=server_addr)
            self.server.repoint(server_addr)
            return self.info()

        return self.call(repoint)

    def resync_cache(self) -> int:
        """Send the whole cache as events (a ``reset``, then ``inserted`` paths) down the event
        stream; the server's mirror of this node is exact again once it reads them. Returns
        how many were sent (0: this node keeps no prefix cache, and no events)."""

        def send_snapshot() -> int:
            snapshot = getattr(self.core.cache, "take_snapshot", None)
            events = snapshot() if snapshot is not None else []
            self.server.send_all(events)
            return len(events)

        return self.call(send_snapshot)

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.core.grammars.close()
        self.transfer.close()
        self.inbox.close()
        self.server.close()
        self.peers.close()
        self._ctx.term()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self.run_once()
            except TensorParallelError as e:  # a rank is gone: the node goes down as one
                logger.critical("%s: %s; exiting", self.node_id, e)
                os._exit(70)  # the cluster sees the actor die and replaces it
            except Exception:
                logger.exception("%s: loop iteration failed", self.node_id)
                time.sleep(0.05)

    def run_once(self, block: bool = True) -> bool:
        """One loop iteration; True if it ran a batch. ``block``: when idle, wait a little for
        the next message (the loop's way to sleep); tests drive nodes with ``block=False``."""
        self._recv()
        self._commands.run_pending()
        result = self.core.step(before_run=self.role.before_run, on_layer_done=self.heartbeat.beat)
        self.role.after_step(result)
        self.pull_source.progress()
        self.heartbeat.publish()
        busy = result.num_scheduled > 0
        if not busy and block:
            if self.node_cfg.debug_checks and self.count_unfinished() == 0:
                self.integrity()
            # transfers progress on the agent's own socket: look again soon while any is open
            num_transferring = self.role.transfer_counters().num_transferring
            num_transferring += len(self.pull_source)
            self.inbox.wait(1 if num_transferring else self.node_cfg.idle_poll_ms)
        return busy

    def _recv(self) -> None:
        for msg in self.inbox.recv_batch():  # a bounded batch: the step and heartbeat come next
            with self.guard(getattr(msg, "request_id", "")):
                if isinstance(msg, PeerGoneMsg):
                    self._on_peer_gone(msg)
                elif isinstance(msg, PeerUpMsg):
                    self.transfer.reopen_peer(msg.transfer_addr)
                elif isinstance(msg, PullReqMsg):
                    self.pull_source.serve(msg)
                elif isinstance(msg, ResendMsg):  # the server lost some of its tokens
                    sched, held = self.core.scheduler, self.role.held_request_ids()
                    queued = (*sched.waiting, *sched.running)
                    self.server.resend(msg, queued, held, streams=self.role.decodes)
                else:
                    self.role.handle(msg)

    def _on_peer_gone(self, msg: PeerGoneMsg) -> None:
        self.peers.close_peer(msg.addr)
        self.transfer.close_peer(msg.transfer_addr)  # fails its transfers before the role looks
        self.role.forget_peer(msg)

    @contextmanager
    def guard(self, request_id: str) -> Iterator[None]:
        """Run a step of one request's handling: if it raises, that request fails alone."""
        try:
            yield
        except Exception as e:
            logger.exception("%s: handling request %s failed", self.node_id, request_id)
            if request_id:
                self.role.abort(request_id)
                self.server.report_error(request_id, f"{type(e).__name__} on {self.node_id}: {e}")

    # -- accounting -------------------------------------------------------------------------

    def count_unfinished(self) -> int:
        """Requests this node holds anything for (on the loop thread)."""
        return self.scheduler.num_unfinished + self.role.num_expected

    def request_ids(self) -> set[str]:
        """Every request this node holds anything for (on the loop thread)."""
        queued = {r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)}
        return queued | self.role.held_request_ids()

    def integrity(self) -> dict[str, int]:
        """Check the invariants and count what is held (on the loop thread; see
        ``check_integrity``)."""
        core = self.core
        core.scheduler.check_integrity()
        in_use = core.allocator.num_used_slots - core.cache.num_cached_tokens
        res = NodeResources.measure(self.transfer, self.peers)
        return {
            "total": core.allocator.num_slots,
            "free": core.allocator.num_free_slots,
            "cached": core.cache.num_cached_tokens,
            "in_use": in_use,
            "unfinished": self.count_unfinished(),
            "pairs": res.num_pairs,
            "sockets": res.num_sockets,
            "threads": res.num_threads,
            "pair_threads": sum(t.name.startswith(_PAIR_THREADS) for t in threading.enumerate()),
            "transfers": res.num_transfers,
            "pulls_serving": len(self.pull_source),
        }
