"""``DecodeNode``: receives prefilled requests' KV and decodes them with continuous batching.

The life of a request on a decode node:

1. ``DecodeReqMsg`` from the server -> ``pending`` (checked: a request that can never run is
   answered with an error at once).
2. The prefill node's transfer request arrives -> ``reserve``: the longest prefix of the prompt
   this node still caches from earlier requests (if it has a prefix cache) is locked and not
   sent again; if prompt + max_tokens fit (free + evictable, less what running requests may
   still take), slots for the rest of the prompt are allocated and the remainder is promised;
   else "no room" and the sender retries.
3. The KV lands in those slots; ``PrefilledMsg`` brings the first token -> ``running``.
4. Decode, one token per step for the whole batch; every token goes to the server. The batch
   is bounded by the KV pool (step 2), not by ``max_running_requests``: refusing KV that fits
   would only make the prefill node's handshake time out.
5. Finish (stop token, max_tokens, abort): the tokens and slots go to the prefix cache (or back
   to the pool), so a follow-up turn of a conversation moves only its new tokens. A transfer
   that fails or times out releases its reservation and the server hears of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd.config import EngineConfig
from pd.engine.engine import CacheFactory
from pd.engine.request import Req
from pd.messages import AbortMsg, DecodeReqMsg, PrefilledMsg
from pd.node import BaseNode, NodeConfig
from transfer import BaseSlotOwner, KVPoll, SlotReservation


@dataclass
class _Pending:
    req: Req
    reservation: SlotReservation | None = None  # slots of the tokens the sender moves
    slots: list[int] = field(default_factory=list)  # the whole prompt's: cached prefix + those
    cache_node: Any = None  # locked prefix-cache node of the cached part
    num_promised: int = 0  # slots promised beyond the prompt's (counted in num_pending_reserved)


class DecodeNode(BaseNode, BaseSlotOwner):
    role = "decode"

    def __init__(
        self,
        engine_cfg: EngineConfig,
        node_cfg: NodeConfig,
        cache_factory: CacheFactory | None = None,
    ) -> None:
        self._pending: dict[str, _Pending] = {}
        super().__init__(engine_cfg, node_cfg, cache_factory, slot_owner=self)

    # -- messages ---------------------------------------------------------------------------

    def _on_msg(self, msg: Any) -> None:
        if isinstance(msg, DecodeReqMsg):
            self._on_request(msg)
        elif isinstance(msg, PrefilledMsg):
            self._on_prefilled(msg)
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id)

    def _on_request(self, msg: DecodeReqMsg) -> None:
        try:
            req = self.make_req(msg.request_id, msg.prompt_ids, msg.sampling)
        except ValueError as e:
            self.report_error(msg.request_id, str(e))
            return
        self._pending[msg.request_id] = _Pending(req)

    def _on_prefilled(self, msg: PrefilledMsg) -> None:
        p = self._pending.pop(msg.request_id, None)
        if p is None or p.reservation is None:
            return  # aborted meanwhile: the abort freed everything
        assert self.transfer.poll(msg.request_id) == KVPoll.SUCCESS, "KV announced before it landed"
        req = p.req
        req.slots, req.cache_node = p.slots, p.cache_node
        req.num_cached = len(p.slots) - len(p.reservation.slots)
        req.output_ids = [msg.first_token]
        self.scheduler.num_pending_reserved -= p.num_promised
        self.scheduler.add_prefilled(req)

    def _abort(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            self.scheduler.abort(request_id)
            return
        if p.reservation is None:
            return
        if self.transfer.poll(request_id) == KVPoll.SUCCESS:  # the slots are ours already
            self._unreserve(p)
        else:  # the agent calls release() once no data thread can write into the slots
            self._pending[request_id] = p
            self.transfer.receiver(request_id).abort("aborted by the server")

    def _postprocess(self, produced: list[Req]) -> None:
        for req in produced:
            self.report(req, req.output_ids[-1:])

    # -- BaseSlotOwner: called by the transfer agent from this loop's progress() -------------

    def reserve(
        self, transfer_id: str, num_tokens: int, token_ids: Sequence[int] | None
    ) -> SlotReservation | None:
        p = self._pending.get(transfer_id)
        if p is None or p.reservation is not None:
            return None  # its DecodeReqMsg has not come yet: the sender asks again
        if num_tokens != p.req.num_prompt_tokens:
            raise ValueError(
                f"transfer of {num_tokens} tokens for a {p.req.num_prompt_tokens}-token prompt"
            )
        page = self.allocator.page_size
        match = self.cache.match_prompt(p.req.prompt_ids, p.req.namespace)
        self.cache.inc_lock_ref(match.last_node)
        total = self.allocator.num_pages_for(p.req.max_len) * page
        if total - match.num_tokens > self.scheduler.num_available_tokens():
            self.cache.dec_lock_ref(match.last_node)
            return None
        self.cache.make_room(self.allocator.num_new_pages(match.slots, num_tokens) * page)
        p.slots = self.allocator.extend(match.slots, num_tokens)
        p.cache_node = match.last_node
        p.num_promised = total - self.allocator.num_pages_for(num_tokens) * page
        self.scheduler.num_pending_reserved += p.num_promised
        self.scheduler.num_admitted_tokens += num_tokens
        self.scheduler.num_admitted_cached_tokens += match.num_tokens
        p.reservation = SlotReservation(p.slots[match.num_tokens :], match.num_tokens)
        return p.reservation

    def release(self, transfer_id: str, reservation: SlotReservation) -> None:
        p = self._pending.pop(transfer_id, None)
        if p is None:
            self.allocator.free(reservation.slots)
            return
        self._unreserve(p)
        self.report_error(transfer_id, "KV transfer from the prefill node failed")

    def _unreserve(self, p: _Pending) -> None:
        assert p.reservation is not None
        self.allocator.free(p.reservation.slots)  # the cached prefix stays in the cache
        self.cache.dec_lock_ref(p.cache_node)
        self.scheduler.num_pending_reserved -= p.num_promised
        p.reservation, p.slots, p.cache_node = None, [], None

    # -- accounting -------------------------------------------------------------------------

    def _num_transferring(self) -> int:
        return len(self._pending)

    def _held_slot_lists(self) -> list[tuple[list[int], Any]]:
        return [(p.slots, p.cache_node) for p in self._pending.values() if p.reservation]
