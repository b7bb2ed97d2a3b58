"""``PrefillNode``: prefills only what its RadixCache does not hold, then sends the KV.

The life of a request on a prefill node:

1. ``PrefillReqMsg`` arrives -> the scheduler's ``waiting`` queue (a request that can never
   run is answered with an error at once).
2. Admission matches the prompt in the RadixCache and locks the match; the unmatched suffix
   is prefilled in chunks under the token budget.
3. The first token is sampled and streamed to the server. If that already ends the request
   (EOS, max_tokens=1) it is released here. Otherwise the prompt is inserted into the cache
   (``cache_unfinished``: the KV stays locked) and a cache event goes to the server.
4. ``transferring``: a ``KVSender`` moves the prompt's KV to the decode node chosen by the
   coordinator. On success the decode node gets ``PrefilledMsg`` (the first token); on
   failure the server gets an error. Either way the cache lock is dropped and the request's
   own tail slots are freed.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from pd.cache.radix_cache import RadixCache
from pd.config import EngineConfig
from pd.engine.request import Req
from pd.messages import AbortMsg, PrefilledMsg, PrefillReqMsg
from pd.node import BaseNode, NodeConfig
from transfer import KVPoll, KVSender


class _Route(NamedTuple):
    decode_addr: str
    decode_transfer_addr: str


class _Transfer(NamedTuple):
    req: Req
    sender: KVSender
    started: float


class PrefillNode(BaseNode):
    role = "prefill"

    def __init__(self, engine_cfg: EngineConfig, node_cfg: NodeConfig) -> None:
        self._routes: dict[str, _Route] = {}
        self._transfers: dict[str, _Transfer] = {}
        if engine_cfg.enable_prefix_cache:
            super().__init__(engine_cfg, node_cfg, lambda a: RadixCache(a, node_cfg.node_id))
        else:
            super().__init__(engine_cfg, node_cfg, None)

    def _on_msg(self, msg: Any) -> None:
        if isinstance(msg, PrefillReqMsg):
            self._on_request(msg)
        elif isinstance(msg, AbortMsg):
            self._abort(msg.request_id)

    def _on_request(self, msg: PrefillReqMsg) -> None:
        try:
            req = self.make_req(msg.request_id, msg.prompt_ids, msg.sampling, msg.namespace)
            self.scheduler.add(req)
        except ValueError as e:
            self.report_error(msg.request_id, str(e))
            return
        self._routes[msg.request_id] = _Route(msg.decode_addr, msg.decode_transfer_addr)

    def _abort(self, request_id: str) -> None:
        t = self._transfers.pop(request_id, None)
        if t is not None:
            t.sender.abort("aborted by the server")
            self.scheduler.release(t.req)
        else:
            self.scheduler.abort(request_id)
        self._routes.pop(request_id, None)

    def _postprocess(self, produced: list[Req]) -> None:
        for req in self.scheduler.prefilled:
            self._start_transfer(req)
        self.scheduler.prefilled.clear()
        # cache events before tokens: when the coordinator hears a prefill is done, it already
        # knows what that prefill left in this cache
        for event in self.cache.take_events():
            self.send_server(event)
        for req in produced:
            self.report(req, req.output_ids[-1:])
            if req.is_finished:  # done at its first token: the decode node can forget it
                route = self._routes.pop(req.request_id)
                self.send_peer(route.decode_addr, AbortMsg(req.request_id, "finished at prefill"))

    def _start_transfer(self, req: Req) -> None:
        match = self.cache.cache_unfinished(
            req.prompt_ids, req.slots, req.cache_node, req.namespace
        )
        req.slots, req.cache_node = match.slots, match.last_node
        route = self._routes[req.request_id]
        sender = self.transfer.sender(
            req.request_id, route.decode_transfer_addr, req.num_prompt_tokens, req.prompt_ids
        )
        sender.send(req.slots)
        self._transfers[req.request_id] = _Transfer(req, sender, time.monotonic())

    def _progress(self) -> None:
        if not self._transfers:
            return
        self.transfer.progress()
        for rid, t in list(self._transfers.items()):
            state = t.sender.poll()
            if not state.is_final:
                continue
            del self._transfers[rid]
            route = self._routes.pop(rid)
            if state == KVPoll.SUCCESS:
                num_sent = t.req.num_prompt_tokens - t.sender.num_cached_tokens
                self.transfer_bytes += num_sent * self.runner.pool.num_bytes_per_token
                self.transfer_seconds += time.monotonic() - t.started
                self.num_transfers += 1
                self.send_peer(
                    route.decode_addr,
                    PrefilledMsg(rid, t.req.output_ids[0], t.req.num_cached),
                )
            else:
                self.report_error(rid, f"KV transfer to the decode node failed: {t.sender.failure}")
            self.scheduler.release(t.req)

    def _num_transferring(self) -> int:
        return len(self._transfers)

    def _held_slot_lists(self) -> list[tuple[list[int], Any]]:
        return [(t.req.slots, t.req.cache_node) for t in self._transfers.values()]
