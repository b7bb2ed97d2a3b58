"""Wire messages of the transfer control plane (msgspec Structs over zmq, never pickle).

Each is built with keywords only (``kw_only``). One tagged union, ``ControlMsg``, covers every
frame either side may send; ``decode_msg`` raises ``msgspec.ValidationError``/
``msgspec.DecodeError`` on anything else, and the caller drops the frame and goes on.
"""

from __future__ import annotations

import msgspec

MAX_KEY_CHARS = 256
MAX_KEY_VALUE_BYTES = 64 << 10


class TransferRequestMsg(msgspec.Struct, tag="transfer_request", frozen=True, kw_only=True):
    """Sender -> receiver: reserve ``num_tokens`` slots for ``transfer_id``.

    ``token_ids`` (optional) lets the receiver match a prefix it already holds. The pair group
    to carry the data is named by ``group_prefix`` (one per group incarnation; a new prefix
    means "drop the old group, build this one"); its rendezvous follows as ``PairKeyMsg``s.
    The layout fields let the receiver refuse an incompatible KV pool before any data moves.
    """

    transfer_id: str
    num_tokens: int
    group_prefix: str
    backend: str  # "gloo" | "nccl" | "fake"
    num_layers: int
    elems_per_token: int  # per layer, summed over the layer's buffers (K and V)
    dtype: str
    token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if not 0 < len(self.group_prefix) <= 200:
            raise ValueError(f"bad pair group: prefix of {len(self.group_prefix)} chars")


class TransferReadyMsg(msgspec.Struct, tag="transfer_ready", frozen=True, kw_only=True):
    """Receiver -> sender: slots reserved; only tokens ``[num_cached_tokens:]`` are sent."""

    transfer_id: str
    slots: list[int]
    num_cached_tokens: int = 0


class NoRoomMsg(msgspec.Struct, tag="no_room", frozen=True, kw_only=True):
    """Receiver -> sender: no slots now; the sender may ask again later."""

    transfer_id: str
    num_free_hint: int = -1


class TransferStartMsg(msgspec.Struct, tag="transfer_start", frozen=True, kw_only=True):
    """Sender -> receiver: the payload of ``seq`` is next on the pair group.

    Needed because a receive posted on a gloo pair that times out closes the pair: the
    receiver posts its receives only when data is known to be coming. ``by_dst`` and
    ``segments`` are the sender's ``WirePlan`` (``layout.py``): rows in ascending
    destination-slot order (else token order), cut into pieces of these token counts
    (empty = one piece).
    """

    transfer_id: str
    seq: int
    group_prefix: str
    by_dst: bool = False
    segments: list[int] = []


class TransferDoneMsg(msgspec.Struct, tag="transfer_done", frozen=True, kw_only=True):
    """Receiver -> sender: every layer is scattered into the destination slots."""

    transfer_id: str


class TransferAbortMsg(msgspec.Struct, tag="transfer_abort", frozen=True, kw_only=True):
    """Either way: give up ``transfer_id``; the receiver frees its slots. ``pair_broken``: the
    pair group named for it is gone, so the sender must not put more transfers on it."""

    transfer_id: str
    reason: str = ""
    pair_broken: bool = False


class PairKeyMsg(msgspec.Struct, tag="pair_key", frozen=True, kw_only=True):
    """Either way: a key the pair group ``group_prefix`` set in its rendezvous store
    (``rendezvous.py``): gloo's listening address of a rank, NCCL's unique id."""

    group_prefix: str
    key: str
    value: bytes

    def __post_init__(self) -> None:
        if len(self.key) > MAX_KEY_CHARS or len(self.value) > MAX_KEY_VALUE_BYTES:
            raise ValueError(f"rendezvous key of {len(self.key)} chars, {len(self.value)} bytes")


ControlMsg = (
    TransferRequestMsg
    | TransferReadyMsg
    | NoRoomMsg
    | TransferStartMsg
    | TransferDoneMsg
    | TransferAbortMsg
    | PairKeyMsg
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ControlMsg)


def encode_msg(msg: ControlMsg) -> bytes:
    return _ENCODER.encode(msg)


def decode_msg(data: bytes) -> ControlMsg:
    return _DECODER.decode(data)
