"""Wire messages of the transfer control plane (msgspec Structs over zmq, never pickle).

Each is built with keywords only (``kw_only``). One tagged union, ``ControlMsg``, covers every
frame either side may send; ``decode_msg`` raises ``msgspec.ValidationError``/
``msgspec.DecodeError`` on anything else (including a request naming a store no one could
dial), and the caller drops the frame and goes on.
"""

from __future__ import annotations

import msgspec

from transfer.endpoint import check_host


class TransferRequestMsg(msgspec.Struct, tag="transfer_request", frozen=True, kw_only=True):
    """Sender -> receiver: reserve ``num_tokens`` slots for ``transfer_id``.

    ``token_ids`` (optional) lets the receiver match a prefix it already holds. The pair group
    to carry the data is named by the sender's store address and ``group_prefix`` (one per
    group incarnation; a new prefix means "drop the old group, build this one"). The layout
    fields let the receiver refuse an incompatible KV pool before any data moves.
    """

    transfer_id: str
    num_tokens: int
    store_host: str
    store_port: int
    group_prefix: str
    backend: str  # "gloo" | "nccl" | "fake"
    num_layers: int
    elems_per_token: int  # per layer, summed over the layer's buffers (K and V)
    dtype: str
    token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        check_host(self.store_host)
        min_port = 0 if self.backend == "fake" else 1  # the fake backend has no store
        if not min_port <= self.store_port <= 65535 or not 0 < len(self.group_prefix) <= 200:
            raise ValueError(
                f"bad pair group: store port {self.store_port}, "
                f"prefix of {len(self.group_prefix)} chars"
            )


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


ControlMsg = (
    TransferRequestMsg
    | TransferReadyMsg
    | NoRoomMsg
    | TransferStartMsg
    | TransferDoneMsg
    | TransferAbortMsg
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ControlMsg)


def encode_msg(msg: ControlMsg) -> bytes:
    return _ENCODER.encode(msg)


def decode_msg(data: bytes) -> ControlMsg:
    return _DECODER.decode(data)
