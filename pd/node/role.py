"""``BaseRole``: what a node's role (prefill or decode) does, behind a small interface.

A ``Node`` owns the loop, the engine core, the transfer agent and the sockets (``NodeParts``);
its role object decides what a message means and what happens around a step. The node calls
the role, never the other way round, except through the parts it was handed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, NamedTuple

from pd.core.messages import NodeMsg, PeerGoneMsg
from pd.engine.core import EngineCore
from pd.engine.scheduler import ScheduledBatch, Scheduler, StepResult
from pd.engine.stats import TransferCounters
from pd.node.links import PeerLinks, ServerLink
from transfer.agent import TransferAgent
from transfer.state import BaseSlotOwner


class NodeParts(NamedTuple):
    """What a role works with (all of it the node's, on the node's loop thread)."""

    node_id: str
    core: EngineCore
    transfer: TransferAgent
    server: ServerLink
    peers: PeerLinks
    slot_owner: BaseSlotOwner | None  # what ``make_slot_owner`` made, if anything
    # ``with guard(request_id):`` -- if the block raises, that request fails alone
    guard: Callable[[str], AbstractContextManager[None]]
    addr: str  # the node's inbox, where peers reach it


class BaseRole(ABC):
    name: ClassVar[str]  # "prefill" | "decode"
    scheduler_cls: ClassVar[type[Scheduler]]
    decodes: ClassVar[bool] = True  # False: no compiled decode steps nor speculation here

    @classmethod
    def make_slot_owner(
        cls, core: EngineCore, server: ServerLink, peers: PeerLinks, addr: str
    ) -> BaseSlotOwner | None:
        """What owns the slots that received KV lands in (the transfer agent is built with
        it, so it is built before the agent, from the node's other parts; ``addr``: the node's
        inbox); None for a role that receives no KV."""
        return None

    @abstractmethod
    def handle(self, msg: NodeMsg) -> None:
        """A message from the server or a peer (``PeerGoneMsg`` goes to ``forget_peer``)."""

    def before_run(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """Called before ``batch``'s forward; what it returns is called with i as layer i's
        K/V of the new tokens is in the pool."""
        return None

    def between_layers(self) -> None:
        """Called between the decoder layers of every forward (with the node's heartbeat): work
        that must not wait for a forward of seconds to end. Nothing by default."""
        return None

    @abstractmethod
    def after_step(self, result: StepResult) -> None:
        """Report what the step produced and move transfers on (called every iteration, also
        when nothing ran)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Forget the request wherever the role or its scheduler holds it; its slots go back
        (at once, or once no transfer can write them). Unknown ids are ignored."""

    @abstractmethod
    def forget_peer(self, msg: PeerGoneMsg) -> None:
        """A peer is gone (its pair groups and sockets are closed, its transfers failed):
        free what was kept for requests that depended on it, telling the server of each."""

    @abstractmethod
    def held_request_ids(self) -> set[str]:
        """Requests the role keeps apart from its scheduler's queues (routes, expected KV)."""

    @property
    def num_expected(self) -> int:
        """Requests the role holds that its scheduler does not hold yet."""
        return 0

    def stats_fields(self) -> dict[str, Any]:
        """The role's own ``NodeStatsMsg`` fields (a prefill node's pulls), if any."""
        return {}

    @abstractmethod
    def transfer_counters(self) -> TransferCounters:
        """The role's KV transfers: open now, and bytes, seconds and count of finished ones."""
