"""``PrefillScheduler``: the scheduler of a prefill node.

The life of a request on it:

1. ``waiting`` -> admitted as in ``Scheduler``, but reserving only its prompt: a prefill node
   never decodes, so max_tokens costs it nothing. A request sharing an uncached prefix with a
   prompt being prefilled or sent waits for it to be cached.
2. ``running``: the unmatched suffix is prefilled in chunks under the token budget.
3. The first token is sampled. If that ends the request (EOS, max_tokens=1) it is released like
   any finished request. Otherwise the request moves to ``sending`` with its slots as they are
   (its KV may already be on the wire: the node starts the transfer with the last chunk);
   ``take_prefilled`` hands it to the node.
4. ``finish_sending``: the transfer ended (either way); the request is released: its prompt
   goes into the prefix cache (pages another request cached meanwhile are freed only now, when
   no transfer can still read them).
"""

from __future__ import annotations

from typing import Any

from pd.core.request import Req, ReqStatus
from pd.engine.scheduler import HeldSlots, Scheduler


class PrefillScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sending: dict[str, Req] = {}
        self._prefilled: list[Req] = []  # moved to sending since the last take_prefilled()

    @property
    def num_unfinished(self) -> int:
        return super().num_unfinished + len(self._sending)

    @property
    def num_sending(self) -> int:
        return len(self._sending)

    def take_prefilled(self) -> list[Req]:
        """Requests whose prompt KV is ready to send, each handed out once."""
        prefilled, self._prefilled = self._prefilled, []
        return prefilled

    def finish_sending(self, request_id: str) -> Req | None:
        """The request's transfer is over: release its slots. None if it is not sending."""
        req = self._sending.pop(request_id, None)
        if req is not None:
            req.set_status(ReqStatus.FINISHED)  # here; it goes on on its decode node
            self._release(req)
        return req

    def abort(self, request_id: str) -> Req | None:
        req = self._sending.pop(request_id, None)
        if req is None:
            return super().abort(request_id)
        self._prefilled = [r for r in self._prefilled if r is not req]
        req.finish("abort")
        self._release(req)
        return req

    def held_slots(self) -> list[HeldSlots]:
        return super().held_slots() + [(r.slots, r.cache_node) for r in self._sending.values()]

    def _max_len(self, req: Req) -> int:
        return req.num_prompt_tokens

    def _expected_len(self, req: Req) -> int:
        return req.num_prompt_tokens

    def _pending_prompts(self) -> list[tuple[str, list[int]]]:
        # a sent prompt is cached when its transfer ends
        sent = [(r.namespace, r.prompt_ids) for r in self._sending.values()]
        return super()._pending_prompts() + sent

    def _on_first_token(self, req: Req) -> None:
        # not cached yet: a transfer may still read the request's slots (see finish_sending)
        self.running.remove(req)
        req.set_status(ReqStatus.SENDING)
        self._sending[req.request_id] = req
        self._prefilled.append(req)
