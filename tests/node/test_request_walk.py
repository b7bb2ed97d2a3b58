"""The walk of one request (docs/request.md: steps 3-10, 3b, 9b), message by message: every message
the server and the in-process nodes send and receive is recorded where it crosses a socket
(the send and receive methods of ``Server``, ``ServerLink``, ``PeerLinks``, ``Inbox`` and the
transfer ``ControlPlane``, wrapped; no runtime code changes), and the arrows are checked in
order: who sends what to whom, and that each one is sent only after the one it answers came."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from pd.core.messages import (
    CacheEventMsg,
    DecodeReqMsg,
    LocalReqMsg,
    NodeStatsMsg,
    PrefilledMsg,
    PrefillReqMsg,
    TokenMsg,
)
from pd.core.sampling_params import SamplingParams
from pd.node import Node
from pd.node.links import Inbox, PeerLinks, ServerLink
from tests.node.harness import GREEDY, PROMPTS, Server, assert_idle, run_until, send_request
from transfer.control import ControlPlane
from transfer.messages import (
    TransferDoneMsg,
    TransferReadyMsg,
    TransferRequestMsg,
    TransferStartMsg,
)

pytestmark = pytest.mark.timeout(60)  # each test loads the tiny model twice; a walk is short

BESIDE = (NodeStatsMsg, CacheEventMsg)  # the heartbeat and the cache mirror, not the walk


class Event(NamedTuple):
    is_send: bool
    who: str  # "server", "P" or "D"
    msg: Any


class Arrow(NamedTuple):
    sender: str
    receiver: str
    kind: str  # the message's type name
    sent_at: int  # index of the send in the timeline
    received_at: int  # index of the receipt (-1: the server's, not recorded)
    msg: Any


class Wire:
    """The timeline of every send and receipt of the server, P and D, in the order this
    thread made them (the test drives the nodes one loop iteration at a time)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def arrows(self) -> list[Arrow]:
        """Each message sent (but ``BESIDE``), with who received it: the server gets what a
        ``ServerLink`` sends; a node, what its inbox or control socket read (each receipt
        matched to one send, in order)."""
        out, taken = [], set()
        for i, ev in enumerate(self.events):
            if not ev.is_send or isinstance(ev.msg, BESIDE):
                continue
            kind = type(ev.msg).__name__
            if isinstance(ev.msg, TokenMsg):
                out.append(Arrow(ev.who, "server", kind, i, -1, ev.msg))
                continue
            j = next(
                (j for j in range(i + 1, len(self.events)) if j not in taken and self._gets(j, ev)),
                None,
            )
            assert j is not None, f"{kind} from {ev.who} never arrived: {ev.msg}"
            taken.add(j)
            out.append(Arrow(ev.who, self.events[j].who, kind, i, j, ev.msg))
        return out

    def sent(self, who: str, kinds: type | tuple[type, ...]) -> list[Any]:
        """What ``who`` sent of the types ``kinds``, in order."""
        return [
            e.msg for e in self.events if e.is_send and e.who == who and isinstance(e.msg, kinds)
        ]

    def _gets(self, j: int, send: Event) -> bool:
        ev = self.events[j]
        return not ev.is_send and ev.who != send.who and ev.msg == send.msg


def _record(monkeypatch: pytest.MonkeyPatch, server: Server, p: Node, d: Node) -> Wire:
    """Wrap every socket method that sends or receives a message of the server, P or D."""
    wire = Wire()
    names: dict[int, str] = {id(server): "server"}
    endpoints = {p.transfer.endpoint: "P", d.transfer.endpoint: "D"}
    for name, node in (("P", p), ("D", d)):
        names.update({id(node.server): name, id(node.peers): name, id(node.inbox): name})

    def who(part: Any) -> str | None:
        if isinstance(part, ControlPlane):
            return endpoints.get(part.endpoint)
        return names.get(id(part))

    def on_send(real: Callable[..., Any]) -> Callable[..., Any]:
        def send(self: Any, *args: Any) -> Any:
            if (name := who(self)) is not None:
                wire.events.append(Event(True, name, args[-1]))  # the message is the last one
            return real(self, *args)

        return send

    def on_recv(real: Callable[..., Any]) -> Callable[..., Any]:
        def recv(self: Any) -> Any:
            got = real(self)
            if (name := who(self)) is not None:
                for item in got:
                    msg = item.msg if isinstance(self, ControlPlane) else item
                    wire.events.append(Event(False, name, msg))
            return got

        return recv

    for cls in (Server, ServerLink, PeerLinks, ControlPlane):
        monkeypatch.setattr(cls, "send", on_send(cls.send))
    monkeypatch.setattr(ControlPlane, "reply", on_send(ControlPlane.reply))
    monkeypatch.setattr(Inbox, "recv_batch", on_recv(Inbox.recv_batch))
    monkeypatch.setattr(ControlPlane, "recv_all", on_recv(ControlPlane.recv_all))
    return wire


def test_one_request_walks_the_transfer_path_in_order(server, make_pair, monkeypatch) -> None:
    p, d = make_pair()
    wire = _record(monkeypatch, server, p, d)
    rid, prompt = "walk", PROMPTS[0]
    send_request(server, p, d, rid, prompt)  # as the cluster client does: D first, then P
    run_until(server, (p, d), lambda: rid in server.finished)
    run_until(server, (p, d), lambda: d.count_unfinished() == p.count_unfinished() == 0)

    arrows = wire.arrows()
    walk = [(a.sender, a.receiver, a.kind) for a in arrows]
    assert walk[:7] == [
        ("server", "D", "DecodeReqMsg"),  # 3
        ("server", "P", "PrefillReqMsg"),  # 4
        ("P", "D", "TransferRequestMsg"),  # 5
        ("D", "P", "TransferReadyMsg"),  # 6
        ("P", "D", "TransferStartMsg"),  # 7
        ("D", "P", "TransferDoneMsg"),  # 8
        ("P", "D", "PrefilledMsg"),  # 9
    ]
    assert set(walk[7:]) == {("D", "server", "TokenMsg")}  # 10, and nothing else
    # Order is causal from 5 on: each arrow is sent only once the one before it came (P starts
    # the transfer when it computes the prompt; D answers the request; P sends the data once it
    # has D's slots; D acknowledges when the KV landed; P announces the first token only then,
    # so PrefilledMsg always follows TransferDoneMsg; D streams it only once that came). 3 and 4
    # go on two sockets: D may read 5 before 3, and then holds 5 and answers it when 3 comes.
    for before, after in zip(arrows[1:7], arrows[2:8], strict=True):
        assert before.received_at < after.sent_at, (before.kind, after.kind)
    assert arrows[0].received_at < arrows[3].sent_at  # D answered knowing the request

    first, *rest = (a.msg for a in arrows[7:])
    prefilled = arrows[6].msg
    assert isinstance(prefilled, PrefilledMsg) and isinstance(first, TokenMsg)
    assert first.token_ids == [prefilled.first_token] and not first.finished
    assert [m.finished for m in rest] == [False] * (len(rest) - 1) + [True]  # the last says so
    assert server.tokens[rid] == [t for a in arrows[7:] for t in a.msg.token_ids]
    assert len(server.tokens[rid]) == GREEDY.max_tokens and server.finished[rid].error is None
    ready, request = arrows[3].msg, arrows[2].msg
    assert isinstance(ready, TransferReadyMsg) and isinstance(request, TransferRequestMsg)
    assert request.transfer_id == rid and request.token_ids == prompt  # D may match its cache
    assert len(ready.slots) == len(prompt) - ready.num_cached_tokens
    assert isinstance(arrows[4].msg, TransferStartMsg)
    assert isinstance(arrows[5].msg, TransferDoneMsg)

    # beside the walk: P's cache now holds the prompt (page-aligned), and the server heard it
    inserted = [e for e in wire.sent("P", CacheEventMsg) if e.kind == "inserted"]
    assert any(0 < len(e.tokens) and e.tokens == prompt[: len(e.tokens)] for e in inserted)
    assert any(e.node_id == p.node_id and e.kind == "inserted" for e in server.events)
    assert_idle(p, d)


def test_a_local_request_is_prefilled_and_streamed_by_the_decode_node_alone(
    server, make_pair, monkeypatch
) -> None:
    p, d = make_pair()
    wire = _record(monkeypatch, server, p, d)
    rid = "walk-local"
    local = LocalReqMsg(request_id=rid, prompt_ids=PROMPTS[1], sampling=GREEDY, namespace="")
    server.send(d, local)  # 3b
    run_until(server, (p, d), lambda: rid in server.finished)

    arrows = wire.arrows()
    walk = [(a.sender, a.receiver, a.kind) for a in arrows]
    assert walk[0] == ("server", "D", "LocalReqMsg")  # 3b
    assert set(walk[1:]) == {("D", "server", "TokenMsg")}  # P sends and receives nothing
    assert len(arrows) >= 2 and arrows[-1].msg.finished  # every token from D, the first too
    assert server.tokens[rid] == [t for a in arrows[1:] for t in a.msg.token_ids]
    assert len(server.tokens[rid]) == GREEDY.max_tokens
    assert not wire.sent("P", (PrefillReqMsg, DecodeReqMsg, TransferRequestMsg, TokenMsg))
    assert_idle(p, d)


def test_a_request_done_at_its_first_token_is_answered_by_the_prefill_node(
    server, make_pair, monkeypatch
) -> None:
    p, d = make_pair()
    wire = _record(monkeypatch, server, p, d)
    rid = "walk-one"
    send_request(server, p, d, rid, PROMPTS[2], SamplingParams(max_tokens=1, temperature=0.0))
    run_until(server, (p, d), lambda: rid in server.finished)
    run_until(server, (p, d), lambda: d.count_unfinished() == p.count_unfinished() == 0)

    walk = [(a.sender, a.receiver, a.kind) for a in wire.arrows()]
    assert walk == [
        ("server", "D", "DecodeReqMsg"),  # 3
        ("server", "P", "PrefillReqMsg"),  # 4
        ("P", "server", "TokenMsg"),  # 9b: no transfer starts (max_tokens 1)
        ("P", "D", "AbortMsg"),  # D forgets what it expected
    ]
    assert len(server.tokens[rid]) == 1 and server.finished[rid].error is None
    assert_idle(p, d)
