"""Pulls: a prefill node takes the KV of a prompt's prefix from another node that holds it.

The coordinator sends a request to a prefill node that lacks a prefix another node (prefill or
decode) holds, with ``PrefillReqMsg.pull`` set, when it estimated pulling that prefix faster
than computing it (``pd.router.pulls``). Both ends use the transfer engine as decode
does: the same sealed control plane and pair groups, the holder as sender.

The life of a pull (R = the requesting prefill node, H = the holder):

1. R: the request arrives with ``pull``. It is held here, not scheduled (``PullSink.start``),
   and R sends ``PullReqMsg`` (the prefix's tokens, the namespace, R's addresses) to H.
2. H (any role, ``PullSource.serve``): matches the tokens in its cache, in that namespace only,
   and locks what it holds; nothing held -> ``PullRefusedMsg``. Else it starts a ``KVSender``
   of those tokens to R (transfer id = the pull id), all layers ready.
3. R's transfer agent asks ``PullSink.reserve``: the tokens must be a prefix of the held
   request's prompt; R locks what it caches of them already (not sent again) and reserves slots
   for the rest (evicting what is unlocked), or refuses (no room: it computes instead).
4. The KV lands: R inserts the prefix into its cache (``cache_finished``: its events tell the
   coordinator) and schedules the request, whose admission now matches the whole prefix. H
   unlocks its prefix when its sender is final, either way.
5. Anything else -> R schedules the request as it is and computes the prefix: H refused, the
   transfer failed, H died (``PeerGoneMsg``) or stalled past ``PullFrom.timeout_s``. A pull
   never fails a request. The transfer's slots go back when the agent releases them (once no
   data thread can write into them), whenever that is.

R reports each pull's outcome and time to the server (``PullDoneMsg``, the decision log).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pd.cache.base import NodeHandle
from pd.core.messages import PullDoneMsg, PullFrom, PullRefusedMsg, PullReqMsg
from pd.core.request import Req
from pd.engine.core import EngineCore
from pd.node.links import PeerLinks, ServerLink
from transfer.agent import TransferAgent
from transfer.sender import KVSender
from transfer.state import BaseSlotOwner, KVPoll, SlotReservation


def pull_id(request_id: str) -> str:
    """The transfer id of the pull made for request ``request_id`` (its wire id)."""
    return f"pull/{request_id}"


@dataclass(eq=False)
class _Pull:
    req: Req  # held here until the pull ends, then scheduled
    src: PullFrom
    started: float
    deadline: float
    why_not: str | None = None  # set when it will not come: compute instead


@dataclass(eq=False)
class _Landing:
    """Slots reserved for a pull's KV, and the cached part of its prefix locked for it."""

    tokens: list[int]
    namespace: str
    node: NodeHandle
    cached: list[int]  # the cache's slots of the locked part
    slots: list[int]  # reserved for the rest


class PullSink(BaseSlotOwner):
    """The requesting side, on a prefill node: requests waiting for their prefix, and the slot
    owner the node's transfer agent asks when a holder's KV comes. The agent is built with this
    owner, so the calls that use the agent are handed it."""

    def __init__(self, core: EngineCore, server: ServerLink, peers: PeerLinks, addr: str) -> None:
        self.core = core
        self.server = server
        self._peers = peers
        self._addr = addr  # the node's inbox, where a holder answers
        self._pulls: dict[str, _Pull] = {}  # by pull id
        self._landing: dict[str, _Landing] = {}  # by pull id
        self.num_pulls = 0
        self.num_failed = 0
        self.num_pulled_tokens = 0
        self.pull_seconds = 0.0

    def __len__(self) -> int:
        return len(self._pulls)

    def request_ids(self) -> set[str]:
        return {p.req.request_id for p in self._pulls.values()}

    # -- the node's loop --------------------------------------------------------------------

    def start(self, req: Req, src: PullFrom, transfer: TransferAgent) -> None:
        """Hold ``req`` and ask ``src``'s holder for its prefix (into ``transfer``'s pool)."""
        pid = pull_id(req.request_id)
        now = time.monotonic()
        ask = PullReqMsg(
            pull_id=pid,
            namespace=req.namespace,
            token_ids=req.prompt_ids[: src.num_tokens],
            requester=self.core.node_id,
            requester_addr=self._addr,
            requester_transfer_addr=transfer.endpoint,
        )
        self._peers.send(src.addr, ask)  # if this raises, nothing is held for the request
        self._pulls[pid] = _Pull(req, src, now, now + src.timeout_s)
        self.num_pulls += 1

    def on_refused(self, msg: PullRefusedMsg) -> None:
        if (p := self._pulls.get(msg.pull_id)) is not None and p.why_not is None:
            p.why_not = f"refused by {p.src.node_id}: {msg.reason}"

    def forget_holder(self, node_id: str) -> None:
        """``node_id`` is gone: what was to come from it will not."""
        for p in self._pulls.values():
            if p.src.node_id == node_id and p.why_not is None:
                p.why_not = f"holder {node_id} is gone"

    def abort(self, request_id: str, transfer: TransferAgent) -> bool:
        """Drop a held request (its pull is aborted); False if none is held here."""
        p = self._pulls.pop(pull_id(request_id), None)
        if p is None:
            return False
        self._end_transfer(pull_id(request_id), "the request was aborted", transfer)
        p.req.finish("abort")
        return True

    def progress(self, transfer: TransferAgent) -> list[Req]:
        """Requests whose pull ended (their prefix cached here, or to be computed): the node
        schedules them."""
        if not self._pulls:
            return []
        transfer.progress()
        ready: list[Req] = []
        now = time.monotonic()
        for pid, p in list(self._pulls.items()):
            state = transfer.poll(pid)
            if state == KVPoll.SUCCESS:
                num_pulled = self._land(pid)
                self._report(p, num_pulled, None)
            elif state == KVPoll.FAILED or p.why_not is not None or now > p.deadline:
                why = p.why_not or (
                    "the transfer failed"
                    if state == KVPoll.FAILED
                    else f"not in {p.src.timeout_s} s"
                )
                self._end_transfer(pid, why, transfer)
                self._report(p, 0, why)
            else:
                continue
            del self._pulls[pid]
            ready.append(p.req)
        return ready

    def _land(self, pid: str) -> int:
        """The KV is in the reserved slots: the prefix goes into the cache (and the lock with
        it). Returns the tokens that came."""
        land = self._landing.pop(pid)
        slots = land.cached + land.slots
        self.core.cache.cache_finished(land.tokens, slots, land.node, land.namespace)
        return len(land.slots)

    def _end_transfer(self, pid: str, why: str, transfer: TransferAgent) -> None:
        """Abort the pull's transfer unless it is final; a late request for it is refused (the
        agent keeps a failed record), and reserved slots go back through ``release``."""
        state = transfer.poll(pid)
        if state is None or not state.is_final:
            transfer.receiver(pid).abort(why)
        elif state == KVPoll.SUCCESS:  # came just now, after all: keep it for the next one
            if pid in self._landing:
                self._land(pid)

    def _report(self, p: _Pull, num_pulled: int, error: str | None) -> None:
        seconds = time.monotonic() - p.started
        if error is None:
            self.num_pulled_tokens += num_pulled
            self.pull_seconds += seconds
        else:
            self.num_failed += 1
        self.server.send(
            PullDoneMsg(
                node_id=self.core.node_id,
                request_id=p.req.request_id,
                holder=p.src.node_id,
                num_tokens=p.src.num_tokens,
                num_pulled=num_pulled,
                seconds=seconds,
                error=error,
            )
        )

    def stats_fields(self) -> dict[str, Any]:
        """The pull counters, as ``NodeStatsMsg`` fields."""
        per_token = self.core.runner.pool.num_bytes_per_token
        return {
            "num_pulls": self.num_pulls,
            "num_pulls_failed": self.num_failed,
            "num_pulled_tokens": self.num_pulled_tokens,
            "pull_bytes": self.num_pulled_tokens * per_token,
            "pull_seconds": self.pull_seconds,
        }

    # -- BaseSlotOwner: the transfer agent, from the node's loop ----------------------------

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        p = self._pulls.get(transfer_id)
        if p is None or p.why_not is not None:
            raise ValueError(f"no pull {transfer_id!r} waits here")
        try:
            return self._reserve(p, num_tokens, token_ids)
        except ValueError as e:
            p.why_not = str(e)
            raise

    def _reserve(
        self, p: _Pull, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation:
        prompt = p.req.prompt_ids
        if (
            token_ids is None
            or not 0 < num_tokens <= p.src.num_tokens
            or list(token_ids) != prompt[:num_tokens]
        ):
            raise ValueError(f"the {num_tokens} tokens offered are not the prefix asked for")
        cache, allocator = self.core.cache, self.core.allocator
        m = cache.match_for_peer(prompt[:num_tokens], p.req.namespace)
        need = num_tokens - m.num_tokens
        if need <= 0 or need % allocator.page_size:
            raise ValueError(f"{m.num_tokens} of the {num_tokens} tokens are cached here")
        cache.inc_lock_ref(m.last_node)
        if not cache.make_room(need):
            cache.dec_lock_ref(m.last_node)
            raise ValueError(f"no room for {need} pulled tokens ({allocator.num_free_slots} free)")
        slots = allocator.allocate(need)
        tokens = prompt[:num_tokens]
        self._landing[pull_id(p.req.request_id)] = _Landing(
            tokens, p.req.namespace, m.last_node, m.slots, slots
        )
        return SlotReservation(slots, m.num_tokens)

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        land = self._landing.pop(transfer_id, None)
        self.core.allocator.free(reservation.slots)
        if land is not None:
            self.core.cache.dec_lock_ref(land.node)
        p = self._pulls.get(transfer_id)
        if p is not None and p.why_not is None:
            p.why_not = "the transfer failed"


@dataclass(eq=False)
class _Send:
    sender: KVSender
    node: NodeHandle  # the holder's locked prefix


class PullSource:
    """The holding side, on any node: prefixes being sent to a requester, each locked in the
    cache until its sender is final."""

    def __init__(self, core: EngineCore, transfer: TransferAgent, peers: PeerLinks) -> None:
        self.core = core
        self.transfer = transfer
        self.peers = peers
        self._sends: dict[str, _Send] = {}
        self.num_served = 0

    def __len__(self) -> int:
        return len(self._sends)

    def serve(self, msg: PullReqMsg) -> None:
        if msg.pull_id in self._sends:
            return  # asked twice: the first is under way
        cache = self.core.cache
        m = cache.match_for_peer(msg.token_ids, msg.namespace)
        if m.num_tokens == 0:
            why = f"none of the {len(msg.token_ids)} tokens is cached here"
            self.peers.send(msg.requester_addr, PullRefusedMsg(pull_id=msg.pull_id, reason=why))
            return
        cache.inc_lock_ref(m.last_node)
        try:
            sender = self.transfer.sender(
                msg.pull_id,
                msg.requester_transfer_addr,
                m.num_tokens,
                msg.token_ids[: m.num_tokens],
            )
        except ValueError:
            cache.dec_lock_ref(m.last_node)
            raise
        self._sends[msg.pull_id] = _Send(sender, m.last_node)  # unlocked once it is final
        sender.send(m.slots)

    def progress(self) -> None:
        for pid, s in list(self._sends.items()):
            state = s.sender.poll()
            if state.is_final:
                del self._sends[pid]
                self.core.cache.dec_lock_ref(s.node)
                self.num_served += state == KVPoll.SUCCESS
