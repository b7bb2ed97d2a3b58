"""``Pools``: the launcher's bookkeeping of its two pools (prefill, decode), one record a node.

Each pool has a target size, which only ``set_target`` changes. Each node the launcher started
or attached to is one ``PoolNode`` for good (its id ``role-index`` is never reused): its role and
number in the pool, its Ray actor until that is stopped, whether it ran before this server
(``is_attached``) or was started in place of a dead node (``is_replacement``), and its state:

1. ``STARTING``: its actor was started; it is not registered with the client yet.
   -> ``READY``, or ``GONE`` (the start failed).
2. ``READY``: registered; the coordinator routes requests to it (an attached node starts here).
   -> ``DRAINING``, or ``GONE`` (it died).
3. ``DRAINING``: no new requests; it leaves once those in flight finished (or its drain
   deadline passed), also when it dies meanwhile. -> ``GONE``.
4. ``GONE``: never started, dead, or drained and removed; its actor is stopped.

``PoolNode.set_state`` is the one place a state changes, checked against ``ALLOWED``. Deaths a
pool has not made up for yet are counted per pool (``begin_replacing``, ``joined``). Plain
Python, used on the client's event loop (and before it runs, by ``Cluster.start``).
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pd.cluster.client_config import ROLES
from pd.core.messages import NodeStatsMsg
from pd.core.request import checked_move

_NODE_ID = re.compile(r"^(prefill|decode)-(\d+)$")  # ``PoolNode.node_id``: attach finds these


class NodeState(enum.Enum):
    STARTING = "starting"  # its actor runs; not registered yet
    READY = "ready"  # requests go to it
    DRAINING = "draining"  # leaving once its requests finished
    GONE = "gone"  # its actor is stopped


_S = NodeState
ALLOWED: dict[NodeState, frozenset[NodeState]] = {
    _S.STARTING: frozenset({_S.READY, _S.GONE}),
    _S.READY: frozenset({_S.DRAINING, _S.GONE}),
    _S.DRAINING: frozenset({_S.GONE}),
    _S.GONE: frozenset(),
}


def parse_node_id(node_id: str) -> tuple[str, int] | None:
    """(role, index) of a pd node's id (a Ray actor's name), or None for any other name."""
    match = _NODE_ID.match(node_id)
    return None if match is None else (match[1], int(match[2]))


@dataclass(eq=False)
class PoolNode:
    role: str
    index: int  # the pool's count when it started
    actor: Any = None  # its Ray actor, until stopped (``NodeActors``)
    is_attached: bool = False  # it ran before this server started
    is_replacement: bool = False  # started in place of a dead node
    _state: NodeState = field(default=NodeState.STARTING, init=False)

    @property
    def node_id(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def state(self) -> NodeState:
        return self._state

    def set_state(self, state: NodeState) -> None:
        """The one place a node's state changes; a move ``ALLOWED`` does not list raises."""
        self._state = checked_move(f"node {self.node_id}", self._state, state, ALLOWED)


class Pools:
    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self.target = {"prefill": num_prefill, "decode": num_decode}  # read; set_target writes
        self._nodes: dict[str, PoolNode] = {}  # every node started or attached, by id
        self._ids = {role: itertools.count() for role in ROLES}
        self._num_replacing = dict.fromkeys(ROLES, 0)  # deaths not yet made up for

    def __getitem__(self, node_id: str) -> PoolNode:
        return self._nodes[node_id]

    def nodes(self, state: NodeState | None = None, role: str | None = None) -> list[PoolNode]:
        """The nodes in ``state`` of ``role`` (None: any), in the order they started."""
        every = list(self._nodes.values())  # in one step: check_integrity reads from a thread
        return [n for n in every if state in (None, n.state) and role in (None, n.role)]

    def ready(self, role: str) -> list[str]:
        """The ids of the ``role`` nodes that take requests: registered and not draining."""
        return [n.node_id for n in self.nodes(NodeState.READY, role)]

    def ready_node(self, node_id: str) -> PoolNode:
        """The ``READY`` node ``node_id``; KeyError when there is none."""
        node = self._nodes.get(node_id)
        if node is None or node.state is not NodeState.READY:
            raise KeyError(f"no ready node {node_id!r}")
        return node

    def is_pending(self, role: str) -> bool:
        """A node of ``role`` is starting or draining (a scale is under way)."""
        return any(
            n.state in (NodeState.STARTING, NodeState.DRAINING) for n in self.nodes(role=role)
        )

    def new_node(self, role: str) -> PoolNode:
        """A ``STARTING`` node of ``role``, numbered next in its pool (its actor is not made
        yet)."""
        node = PoolNode(role, next(self._ids[role]))
        self._nodes[node.node_id] = node
        return node

    def adopt(self, node_id: str, role: str, actor: Any) -> PoolNode:
        """A node that ran before this server, ``READY``: the pool's numbers go on after its,
        and its target is at least its attached nodes."""
        parsed = parse_node_id(node_id)
        assert parsed is not None, f"not a node id: {node_id!r}"
        node = PoolNode(role, parsed[1], actor, is_attached=True)
        node.set_state(NodeState.READY)
        self._nodes[node_id] = node
        indexes = [n.index for n in self._nodes.values() if n.is_attached and n.role == role]
        self._ids[role] = itertools.count(max(indexes) + 1)
        self.set_target(role, max(self.target[role], len(indexes)))
        return node

    def joined(self, node_id: str) -> None:
        """The started ``node_id`` registered: ``READY``, in place of a dead node if its pool
        waits for one."""
        node = self._nodes[node_id]
        node.set_state(NodeState.READY)
        if self._num_replacing[node.role]:
            self._num_replacing[node.role] -= 1
            node.is_replacement = True

    def set_target(self, role: str, size: int) -> None:
        self.target[role] = size

    def begin_replacing(self, role: str) -> None:
        """A ``role`` node died and one is to start in its place."""
        self._num_replacing[role] += 1

    def num_replacing(self, role: str) -> int:
        return self._num_replacing[role]

    def victims(self, node_ids: list[str], n: int, stats: Mapping[str, NodeStatsMsg]) -> list[str]:
        """The ``n`` of ``node_ids`` whose removal loses the least: fewest cached tokens, least
        busy (by their latest ``stats``), newest first."""

        def cost(node_id: str) -> tuple[int, int, int]:
            s = stats.get(node_id)
            busy = s.num_running + s.num_waiting if s is not None else 0
            newest_first = -self._nodes[node_id].index
            return (s.num_cached_tokens if s is not None else 0), busy, newest_first

        return sorted(node_ids, key=cost)[: max(n, 0)]
