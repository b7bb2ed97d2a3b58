"""``Membership``: which nodes the server's cluster client has (registered: ready or draining),
each one's latest stats, which died and why, how many of each role are being started, and the
watchdog that finds a node dead (``Liveness``).

A node joins in one place (``_register``: its socket, the watchdog, the coordinator, its peers
told ``PeerUpMsg``, waiting requests woken) and leaves in one place (``_drop``: the same undone,
its requests re-routed or failed by ``Flights.on_node_lost``, its peers told ``PeerGoneMsg``,
and, dead, the launcher told to replace it). The public calls may come from any thread and
before the client starts: they run on the client's event loop (``LoopHandoff.call``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from pd.cluster.client_config import ClientConfig
from pd.cluster.event_loop import LoopHandoff
from pd.cluster.flights import Flights
from pd.cluster.liveness import Liveness
from pd.cluster.mirror import MirrorSync
from pd.cluster.sockets import NodeSockets
from pd.core.messages import NodeInfo, NodeStatsMsg, PeerGoneMsg, PeerUpMsg
from pd.router.coordinator import Coordinator

logger = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        nodes: dict[str, NodeInfo],
        coordinator: Coordinator,
        sockets: NodeSockets,
        flights: Flights,
        mirror: MirrorSync,
        handoff: LoopHandoff,
        cfg: ClientConfig,
        ping: Callable[[str], Awaitable[Any]] | None = None,
        on_node_failed: Callable[[str], None] | None = None,
    ) -> None:
        """``nodes``: the table this keeps (``Flights`` reads it, through a read-only view);
        ``ping(node_id)`` asks a node's actor whether it lives (``Liveness``);
        ``on_node_failed(node_id)``: e.g. the launcher starting a replacement."""
        self._nodes = nodes
        self._coordinator = coordinator
        self._sockets = sockets
        self._flights = flights
        self._mirror = mirror
        self._handoff = handoff
        self._stats: dict[str, NodeStatsMsg] = {}  # each node's latest
        self.dead_nodes: dict[str, str] = {}  # node_id -> why
        self._num_starting: Counter[str] = Counter()  # nodes being started, per role
        self._on_node_failed = on_node_failed
        self.liveness = Liveness(
            cfg.heartbeat_timeout_s, cfg.watch_interval_s, cfg.ping_timeout_s, ping, self.fail_node
        )

    @property
    def nodes(self) -> Mapping[str, NodeInfo]:
        """The registered nodes (ready or draining), read-only: the calls below change them."""
        return MappingProxyType(self._nodes)

    @property
    def node_stats(self) -> Mapping[str, NodeStatsMsg]:
        """Each registered node's latest stats, read-only."""
        return MappingProxyType(self._stats)

    # -- from any thread, and before the client starts ---------------------------------------

    def register_node(self, info: NodeInfo, attached: bool = False) -> None:
        """``attached``: the node ran before this server (its cache snapshot is awaited)."""
        self._handoff.call(lambda: self._register(info, attached))

    def drain_node(self, node_id: str) -> None:
        self._handoff.call(lambda: self._coordinator.nodes.drain(node_id))

    def unregister_node(self, node_id: str) -> None:
        """The node leaves (after draining): survivors close what they share with it."""
        self._handoff.call(lambda: self._drop(node_id, "removed", is_dead=False))

    def fail_node(self, node_id: str, why: str) -> None:
        """The node died: re-route or fail its requests (``pd.cluster.client``, step 5)."""
        self._handoff.call(lambda: self._drop(node_id, why, is_dead=True))

    def num_routed_to(self, node_id: str) -> int:
        """Requests in flight that this node serves (or is about to receive)."""
        return self._handoff.call(lambda: self._flights.num_routed_to(node_id))

    def set_decode_only(self, on: bool) -> None:
        """Send every request to a decode node alone (``on``: the prefill pool has no node and
        waits for none) or, off, through a prefill node (``Coordinator.decode_only``)."""
        self._handoff.call(lambda: self._coordinator.set_decode_only(on))

    def begin_start(self, role: str) -> None:
        """A node of ``role`` is being started: requests may wait for it (``is_ready``)."""
        self._handoff.call(lambda: self._num_starting.update((role,)))

    def end_start(self, role: str) -> None:
        self._handoff.call(lambda: self._num_starting.subtract((role,)))

    # -- on the loop ------------------------------------------------------------------------

    def has_role(self, role: str) -> bool:
        """A node of ``role`` is registered."""
        return any(info.role == role for info in self._nodes.values())

    def num_starting(self, role: str) -> int:
        """Nodes of ``role`` being started (not registered yet)."""
        return self._num_starting[role]

    def on_stats(self, msg: NodeStatsMsg) -> None:
        """A registered node's stats: its heartbeat, and the coordinator's costs."""
        self._stats[msg.node_id] = msg
        self.liveness.heard(msg.node_id)
        per_token = max((n.kv_bytes_per_token for n in self._nodes.values()), default=0)
        self._coordinator.costs.update(self._stats.values(), per_token)

    def _register(self, info: NodeInfo, attached: bool) -> None:
        self._nodes[info.node_id] = info
        self._sockets.add_node(info)
        self.liveness.watch(info.node_id)
        if attached:
            self._mirror.expect_snapshot(info.node_id)
        # before any request is routed to it (one socket per node keeps the order): a node
        # refusing a gone node's endpoints takes them back if this one was given them
        up = PeerUpMsg(node_id=info.node_id, addr=info.addr, transfer_addr=info.transfer_addr)
        for other in [n for n in self._nodes if n != info.node_id]:
            self._sockets.tell(other, up)
        if info.role == "prefill":
            self._coordinator.nodes.add_prefill(info.node_id)
        else:
            self._coordinator.nodes.add_decode(info.node_id, info.num_slots)
        self._flights.wake()

    def _drop(self, node_id: str, why: str, is_dead: bool) -> None:
        info = self._nodes.pop(node_id, None)
        if info is None:  # dropped already
            return
        self._coordinator.nodes.remove(node_id)
        self._stats.pop(node_id, None)
        self.liveness.forget(node_id)
        self._mirror.forget(node_id)
        self._sockets.remove_node(node_id)
        if is_dead:
            logger.error("node %s is gone (%s)", node_id, why)
            self.dead_nodes[node_id] = why
        self._flights.on_node_lost(node_id, why)
        gone = PeerGoneMsg(node_id=node_id, addr=info.addr, transfer_addr=info.transfer_addr)
        for other in list(self._nodes):
            self._sockets.tell(other, gone)
        if is_dead and self._on_node_failed is not None:
            self._on_node_failed(node_id)
