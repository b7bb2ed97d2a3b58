"""What an engine hands back to its caller, and the interface the HTTP server drives.

Both the in-process engine and the cluster implement ``EngineClient``; the server only ever
sees this interface, so the same HTTP layer serves either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple, Protocol

from pd.core.backlog import Backlog
from pd.core.messages import NodeStatsMsg, TokenLogprobsMsg
from pd.core.sampling_params import SamplingParams


class RequestOutput(NamedTuple):
    """One step of one request: the tokens generated since the last output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (eos / stop token), "length", "abort", or None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from a prefix cache
    error: str | None = None  # set when the request failed inside the engine (finished, "abort")
    logprobs: Sequence[TokenLogprobsMsg] = ()  # one per new token id, when asked for
    is_refused: bool = False  # ``error`` is the request's own fault (e.g. its grammar): a 400


class ClusterStats(NamedTuple):
    """What GET /metrics shows of the engine side: each node's stats (the colocated engine is a
    cluster of one) and the requests waiting for a node."""

    nodes: list[NodeStatsMsg]
    num_queued: int = 0
    num_rejected_msgs: int = 0  # frames the server refused: failed authentication
    # of them, per sending address: the few addresses that sent the most
    rejected_by_peer: dict[str, int] = {}  # noqa: RUF012 - never mutated (a NamedTuple field)
    num_dropped_msgs: int = 0  # authentic frames the server dropped: malformed or failed
    num_reader_restarts: int = 0  # times the server's reader of node messages died
    num_rerouted: int = 0  # requests moved off a dead node before they streamed anything
    num_failed_nodes: int = 0  # nodes found dead
    num_local_prefills: int = 0  # requests prefilled on their decode node (no KV transfer)
    num_pulls_chosen: int = 0  # routes with a pull (the coordinator's PullLog)
    num_pulls_computed: int = 0  # a holder had more, but computing was estimated faster
    num_pull_fallbacks: int = 0  # pulls that did not come: computed instead
    num_stalled_streams: int = 0  # streams ended because their client did not catch up
    num_queued_token_bytes: int = 0  # token messages queued for streams' readers now
    num_duplicate_token_msgs: int = 0  # token messages dropped: their tokens had come
    num_token_gaps: int = 0  # token messages that came after lost ones (pd.cluster.token_order)
    num_token_resends: int = 0  # nodes asked to send a request's output again
    num_failovers: int = 0  # started requests resumed on another decode node (theirs died)


class EngineClient(Protocol):
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        backlog: Backlog | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until one with ``finished=True``: the call returns the iterator itself
        (an async generator function is one such), never an awaitable. Stop strings are the
        caller's job (they need detokenized text); stop token ids, EOS and max_tokens are the
        engine's.
        ``namespace`` scopes prefix-cache sharing (requests share cached prefixes only within
        one). A request that fails inside the engine raises (with the reason). ``backlog``
        (a stream's; its choices share it): count each output's bytes in it until the caller
        reads the output, pause the request while it is paused, and end it raising
        ``ReaderStalled`` when it stalls (``pd.core.backlog``).
        Cancelling the iterator (client gone) must abort the request and free its slots."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its slots are freed. Unknown ids are ignored."""
        ...

    async def is_ready(self) -> bool:
        """True once every node can take requests, or one starts that will (the server
        admits requests only then; they wait for a starting node)."""
        ...

    async def readiness(self) -> str | None:
        """None when every pool has a live, ready node (the colocated engine: its engine),
        else why not (GET /ready answers 503 with it)."""
        ...
