"""Wire messages of the control plane (msgspec Structs, never pickle on a socket).

``SamplingParams`` travels inside them as it is (msgspec encodes the dataclass and re-runs its
checks on decode). ``NodeInfo`` is what a node tells the launcher when it starts (through Ray);
``NodeStatsMsg`` is the one shape of a node's (or the colocated engine's) gauges and counters.
Every frame they travel in is authenticated (``transfer.auth``); on top of that, an address a
node would dial must be a ``tcp://host:port`` (checked on decode, so a bad one is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pd.core.sampling_params import SamplingParams
from transfer.endpoint import parse_endpoint


class TokenLogprobsMsg(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's logprob and its request's ``logprobs`` most likely alternatives
    (``top_ids[i]`` has ``top_logprobs[i]``, most likely first), all from the distribution it
    was drawn from (``pd.executor.sampler.token_logprobs`` says which)."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


def token_bytes(num_tokens: int, logprobs: Sequence[TokenLogprobsMsg]) -> int:
    """About the msgpack size of ``num_tokens`` tokens and their ``logprobs`` (9 bytes a number
    at most), and a message's other fields."""
    num_numbers = num_tokens + sum(2 + 2 * len(lp.top_ids) for lp in logprobs)
    return 64 + 9 * num_numbers


class CacheEventMsg(msgspec.Struct, tag="cache_event", frozen=True, kw_only=True):
    """One change to a prefill node's RadixCache, replayable by the coordinator (PrefixIndex).

    ``tokens`` is the full token path from the namespace root (page-aligned when page_size > 1).
    ``inserted``: the cache now holds that whole path. ``evicted``: the last ``num_evicted``
    tokens of that path are gone (the rest stays). ``reset``: drop everything held for this
    node (``tokens`` is empty); the ``inserted`` events that follow are a full snapshot.
    ``seq`` increases by one per event of a cache, so a consumer detects a gap and asks for a
    snapshot; a ``reset`` may jump ahead (the events it replaces are never sent).
    """

    node_id: str
    seq: int
    kind: str  # "inserted" | "evicted" | "reset"
    namespace: str
    tokens: list[int]
    num_evicted: int = 0


class PullFrom(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefill node pulls the KV of a prompt's first ``num_tokens`` tokens from: another
    node (prefill or decode) that holds them, chosen by the coordinator because pulling them
    was estimated faster than computing them. Past ``timeout_s`` the node computes them."""

    node_id: str
    addr: str  # the holder's request socket (for PullReqMsg)
    transfer_addr: str  # the holder's transfer control endpoint
    num_tokens: int
    timeout_s: float

    def __post_init__(self) -> None:
        parse_endpoint(self.addr)
        parse_endpoint(self.transfer_addr)
        if self.num_tokens < 1 or not self.timeout_s > 0:
            raise ValueError(f"pull of {self.num_tokens} tokens within {self.timeout_s} s")


class PrefillReqMsg(msgspec.Struct, tag="prefill_req", frozen=True, kw_only=True):
    """Server -> prefill node: prefill this prompt, then hand its KV to ``decode_node``."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str
    decode_node: str  # node id
    decode_addr: str  # the decode node's request socket (for PrefilledMsg)
    decode_transfer_addr: str  # the decode node's transfer control endpoint
    pull: PullFrom | None = None  # first pull this much of the prompt from another node

    def __post_init__(self) -> None:
        parse_endpoint(self.decode_addr)
        parse_endpoint(self.decode_transfer_addr)
        if self.pull is not None and self.pull.num_tokens >= len(self.prompt_ids):
            raise ValueError(
                f"pull of {self.pull.num_tokens} tokens of a {len(self.prompt_ids)}-token prompt"
            )


class PullReqMsg(msgspec.Struct, tag="pull_req", frozen=True, kw_only=True):
    """Prefill node -> the node holding a prefix: send me the KV of ``token_ids`` (in
    ``namespace``) over the transfer engine, as transfer ``pull_id``. The holder sends the
    longest prefix of it that it still holds, or answers ``PullRefusedMsg``."""

    pull_id: str
    namespace: str
    token_ids: list[int]
    requester: str  # node id
    requester_addr: str  # its request socket (for PullRefusedMsg)
    requester_transfer_addr: str  # its transfer control endpoint

    def __post_init__(self) -> None:
        parse_endpoint(self.requester_addr)
        parse_endpoint(self.requester_transfer_addr)


class PullRefusedMsg(msgspec.Struct, tag="pull_refused", frozen=True, kw_only=True):
    """Holder -> requester: nothing of the prefix is held here (any more); compute it."""

    pull_id: str
    reason: str


class DecodeReqMsg(msgspec.Struct, tag="decode_req", frozen=True, kw_only=True):
    """Server -> decode node: a request whose KV will arrive from ``prefill_node``."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str
    prefill_node: str


class LocalReqMsg(msgspec.Struct, tag="local_req", frozen=True, kw_only=True):
    """Server -> decode node: prefill this request here too, then decode it (conditional
    disaggregation: its uncached part is short, or this node holds most of it). ``output_ids``:
    a started request whose decode node died (a failover): the output it had, prefilled after
    the prompt, and decoding goes on from there."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str
    output_ids: list[int] = []


class PrefilledMsg(msgspec.Struct, tag="prefilled", frozen=True, kw_only=True):
    """Prefill node -> decode node: the KV is in your slots; here is the first token."""

    request_id: str
    first_token: int
    num_cached_tokens: int
    first_logprobs: TokenLogprobsMsg | None = None  # when the request asked for logprobs


class AbortMsg(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    request_id: str
    reason: str = "abort"


class PauseMsg(msgspec.Struct, tag="pause", frozen=True, kw_only=True):
    """Server -> decode node: leave the request out of its steps (``is_paused``), its KV kept,
    because its client fell behind (``pd.core.backlog``); or take it back in. Unknown ids are
    ignored."""

    request_id: str
    is_paused: bool


class PeerUpMsg(msgspec.Struct, tag="peer_up", frozen=True, kw_only=True):
    """Server -> every other node: ``node_id`` joined at these addresses. A node refuses a gone
    peer's endpoints for a while (``TransferConfig.linger_s``), and the kernel may give the node
    that replaces it the same port: this takes them back (the gone process no longer holds
    them)."""

    node_id: str
    addr: str  # its request socket
    transfer_addr: str  # its transfer control endpoint


class PeerGoneMsg(msgspec.Struct, tag="peer_gone", frozen=True, kw_only=True):
    """Server -> every surviving node: ``node_id`` died or was removed. Its pair groups and
    sockets are closed, and what was kept for its requests is freed."""

    node_id: str
    addr: str  # its request socket
    transfer_addr: str  # its transfer control endpoint


class ResendMsg(msgspec.Struct, tag="resend", frozen=True, kw_only=True):
    """Server -> node: send the request's output again from ``from_offset`` (the tokens the
    server has), in one ``TokenMsg``: after a gap in its offsets (frames were lost), or when a
    request was silent for a while (a probe). A request still waiting or prefilling there is
    answered without tokens; one the node does not know (any more), with ``is_unknown``."""

    request_id: str
    from_offset: int

    def __post_init__(self) -> None:
        if self.from_offset < 0:
            raise ValueError(f"resend from offset {self.from_offset}")


class TokenMsg(msgspec.Struct, tag="token", frozen=True, kw_only=True):
    """Node -> server: new tokens of a request, all from its decode node once the KV is there
    (a request that ends at its first token is answered by its prefill node). ``offset`` is the
    index in the request's output of its first token (of a message without tokens: the output's
    length so far), so the server drops duplicates and sees gaps (``pd.cluster.token_order``).
    ``error`` is set when the request failed inside the cluster; ``node_id`` says who sent
    it."""

    request_id: str
    offset: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    node_id: str = ""
    can_retry: bool = False  # the error is its KV transfer's, not the request's own
    is_refused: bool = False  # the error is the request's own fault (its grammar): a 400
    logprobs: list[TokenLogprobsMsg] = []  # one per token id, when the request asked for them
    is_unknown: bool = False  # an answer to ResendMsg: the node knows nothing of the request

    def __post_init__(self) -> None:
        if self.offset < 0 or (self.logprobs and len(self.logprobs) != len(self.token_ids)):
            raise ValueError(
                f"token message at offset {self.offset}: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} logprobs"
            )

    def num_bytes(self) -> int:
        """About its frame's size: what a server queues for its reader (``token_bytes``)."""
        return len(self.request_id) + token_bytes(len(self.token_ids), self.logprobs)


class NodeStatsMsg(msgspec.Struct, tag="stats", frozen=True, kw_only=True):
    """Node -> server, a few times a second: what /metrics and the router need, and the node's
    heartbeat (sent by its loop thread, also between the layers of a long forward). The
    colocated engine reports the same shape (role "colocated", no transfers)."""

    node_id: str
    role: str  # "prefill" | "decode" | "colocated"
    num_waiting: int
    num_running: int
    num_transferring: int
    num_slots: int
    num_free_slots: int
    num_cached_tokens: int
    num_hit_tokens: int
    num_miss_tokens: int
    transfer_bytes: int
    transfer_seconds: float  # from each transfer's start to its end (its last forward too)
    num_transfers: int  # KV transfers completed (prefill nodes)
    num_queued_tokens: int  # prompt tokens waiting or being prefilled
    num_dropped_msgs: int = 0  # malformed messages dropped (request and transfer sockets)
    num_rejected_msgs: int = 0  # frames that failed authentication (forged, replayed, stale)
    # of them, per sending address: the few addresses that sent the most (transfer.inbound)
    rejected_by_peer: dict[str, int] = {}
    num_retracted: int = 0  # running requests retracted for want of KV slots (they resume)
    num_pauses: int = 0  # requests left out of its steps because their client fell behind
    # speculative decoding: decode rows that verified a draft, its tokens, and those accepted
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_pairs: int = 0  # open pair groups (as sender and as receiver)
    num_sockets: int = 0  # open zmq sockets
    num_threads: int = 0  # Python threads of the node's process
    rss_bytes: int = 0  # the node process's resident memory
    # the host tier below the KV pool (pd.cache.host_tier): its size and use, cumulative counts
    num_host_slots: int = 0  # 0: no host tier
    num_host_cached_tokens: int = 0
    num_host_hit_tokens: int = 0  # hit tokens loaded back from the host tier (of num_hit_tokens)
    num_host_loads: int = 0
    host_load_bytes: int = 0
    host_load_seconds: float = 0.0
    num_host_skipped: int = 0  # host hits computed instead: timed faster than loading
    # the disk tier below the host tier (pd.cache.disk_tier), shared by the host's nodes
    disk_bytes: int = 0  # what its directory holds, every node's chunks (the shared count)
    num_disk_hit_tokens: int = 0  # hit tokens loaded from disk (of num_hit_tokens)
    num_disk_loads: int = 0  # chunks loaded
    disk_load_bytes: int = 0
    disk_load_seconds: float = 0.0
    num_disk_written: int = 0  # chunks written
    num_disk_rejected: int = 0  # truncated, corrupt, unauthenticated or foreign files removed
    disk_off: int = 0  # 1: the disk tier turned itself off after a file-system error
    # the speed pulls are weighed against: prompt tokens computed in pure prefill batches
    num_prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    # of transfer_seconds, the part after the KV was all computed (overlap does not count)
    transfer_wire_seconds: float = 0.0
    # pulls of a prefix from another node (pd.node.pulls): as the requester, and as the holder
    num_pulls: int = 0  # pulls asked for
    num_pulls_failed: int = 0  # of them, computed instead (refused, holder gone, timed out)
    num_pulled_tokens: int = 0
    pull_bytes: int = 0
    pull_seconds: float = 0.0  # of the pulls that came
    num_pulls_served: int = 0  # prefixes this node sent to a requester
    # KV transfer handshakes: requests sent again after a "no room" answer (as the sender), and
    # requests held until this node knew their request instead of refused (as the receiver)
    num_transfer_retries: int = 0
    num_held_transfers: int = 0


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A started node: where to reach it and what it can hold."""

    node_id: str
    role: str  # "prefill" | "decode"
    addr: str  # its request socket (PULL)
    transfer_addr: str  # its transfer control endpoint (ROUTER)
    num_slots: int
    max_model_len: int
    pid: int = 0  # the node's process
    ray_node_id: str = ""  # the Ray node it was placed on
    kv_bytes_per_token: int = 0  # what moving one token's KV costs (all layers, K and V)

    def __post_init__(self) -> None:
        parse_endpoint(self.addr)
        parse_endpoint(self.transfer_addr)


class PullDoneMsg(msgspec.Struct, tag="pull_done", frozen=True, kw_only=True):
    """Prefill node -> server: how a pull the coordinator chose went (its decision log)."""

    node_id: str
    request_id: str  # the wire id of the request it was for
    holder: str
    num_tokens: int  # asked for
    num_pulled: int  # KV tokens that came (0: it fell back to computing them)
    seconds: float  # from the request's arrival to its prefix in the cache, or the fallback
    error: str | None = None  # why it fell back


NodeMsg = (
    PrefillReqMsg
    | DecodeReqMsg
    | LocalReqMsg
    | PrefilledMsg
    | AbortMsg
    | PauseMsg
    | PeerGoneMsg
    | PeerUpMsg
    | PullReqMsg
    | PullRefusedMsg
    | ResendMsg
)
ServerMsg = TokenMsg | CacheEventMsg | NodeStatsMsg | PullDoneMsg
