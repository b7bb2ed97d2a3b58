"""``PrefillScheduler``: the scheduler of a prefill node.

The life of a request on it:

1. ``waiting`` -> admitted as in ``Scheduler``, but reserving only its prompt: a prefill node
   never decodes, so max_tokens costs it nothing. A request sharing an uncached prefix with a
   prompt being prefilled or sent waits for it to be cached.
2. ``running``: the unmatched suffix is prefilled in chunks under the token budget.
3. The first token is sampled. If that ends the request (EOS, max_tokens=1) it is released like
   any finished request. Otherwise it is ``SENDING`` with its slots as they are (its KV may
   already be on the wire: the node starts the transfer with the last chunk). From arrival to
   end its record is in the ``outgoing`` queue (``prefill.outgoing.OutgoingQueue``), which
   hands it to the node and ends its transfer.
4. ``release_sent``: the transfer ended (either way); the request is released: its prompt
   goes into the prefix cache (pages another request cached meanwhile are freed only now, when
   no transfer can still read them).
"""

from __future__ import annotations

from typing import Any

from pd.core.request import Req, ReqStatus
from pd.engine.scheduler import HeldSlots, Scheduler
from prefill.outgoing import OutgoingQueue


class PrefillScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, prompt_only=True, **kwargs)  # it never decodes
        self.outgoing = OutgoingQueue(self)  # every request, on its way to its decode node

    @property
    def num_unfinished(self) -> int:
        return super().num_unfinished + len(self.outgoing.sending())

    def release_sent(self, req: Req) -> None:
        """``req`` left ``SENDING`` (its transfer is over, or it was aborted): release it."""
        self.slots.release(req)

    def held_slots(self) -> list[HeldSlots]:
        sending = [(r.slots, r.cache_node) for r in self.outgoing.sending()]
        return super().held_slots() + sending

    def _pending_prompts(self) -> list[tuple[str, list[int]]]:
        # a sent prompt is cached when its transfer ends
        sent = [(r.namespace, r.prompt_ids) for r in self.outgoing.sending()]
        return super()._pending_prompts() + sent

    def _on_first_token(self, req: Req) -> None:
        # not cached yet: a transfer may still read the request's slots (see release_sent)
        self.running.remove(req)
        req.set_status(ReqStatus.SENDING)
