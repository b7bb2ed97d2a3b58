"""Clients no well-behaved library would be, for ``scripts/chaos_soak.py``.

HTTP over raw sockets that read only when told to (``loop.sock_recv``: nothing is read ahead
into a buffer): a streaming client that stops reading (``stalled_reader``), one that reads a
few bytes at a time (``slow_reader``), one that sends half a head and goes quiet
(``silent_head``), a client that sends its body a byte at a time (``slow_body``), malformed
and out-of-bounds requests (``hostile_requests``, ``hostile_request``). Peers at the nodes'
own sockets are in ``pdtools.chaos_peers``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from pdtools.chaos_load import Answer, Outcome, Spec, StreamReader, parse_answer, parse_error

STALLED_RCVBUF = 2048  # the stalled client's receive buffer: the server's writes block soon
STALLED_MSS = 536


class RawResponse(NamedTuple):
    status: int | None  # None: the connection closed before a status line
    body: bytes  # de-chunked
    complete: bool  # the whole body came (its length, or the last chunk)
    error: str  # a transport error on the way


def head(url: str, method: str, path: str, headers: dict[str, str], length: int | None) -> bytes:
    """An HTTP/1.1 request head; ``length`` None: a chunked body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {urlsplit(url).netloc}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if rcvbuf is not None:  # before connecting: the window and segment size are agreed then
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        # small segments keep the server's send buffer small too (it is sized in segments)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, STALLED_MSS)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port or 80))
    return sock


async def recv_until(
    sock: socket.socket, deadline: float, until: Callable[[bytes], bool]
) -> tuple[bytes, str]:
    """Read until ``until(data)``, EOF or ``deadline`` (monotonic); (data, transport error)."""
    loop, data = asyncio.get_running_loop(), b""
    while not until(data):
        left = deadline - time.monotonic()
        if left <= 0:
            return data, "deadline"
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), left)
        except asyncio.TimeoutError:
            return data, "deadline"
        except OSError as e:
            return data, f"{type(e).__name__}: {e}"
        if not chunk:
            break
        data += chunk
    return data, ""


def parse_raw(data: bytes, error: str) -> RawResponse:
    """A response read off the wire (perhaps cut short)."""
    header, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return RawResponse(None, b"", False, error or "closed before a response")
    status = int(header.split(b" ", 2)[1])
    fields = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in header.split(b"\r\n")[1:])
    }
    if fields.get(b"transfer-encoding") == b"chunked":
        body, complete = _dechunk(rest)
    else:
        length = int(fields.get(b"content-length", b"-1"))
        body, complete = rest[:length] if length >= 0 else rest, len(rest) >= length
    return RawResponse(status, body, complete, error)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out, pos = b"", 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return out, False
        size = int(data[pos:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return out, True
        start = line_end + 2
        if start + size > len(data):
            return out + data[start:], False
        out += data[start : start + size]
        pos = start + size + 2


def _has_status_line(data: bytes) -> bool:
    return b"\r\n\r\n" in data


async def stalled_reader(
    url: str, spec: Spec, headers: dict[str, str], stall_s: float, deadline_s: float
) -> Outcome:
    """Start ``spec``'s stream with a tiny receive buffer, read its status line, read nothing
    more for ``stall_s``, then read the rest (within ``deadline_s`` of the start)."""
    out = Outcome(spec.name, "stalled", time.monotonic(), 0.0)
    deadline = out.start + deadline_s
    body = json.dumps(spec.request_body(stream=True)).encode()
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    try:
        sock = await connect(url, rcvbuf=STALLED_RCVBUF)
        await loop.sock_sendall(
            sock, head(url, "POST", spec.path, _json_headers(headers), len(body)) + body
        )
        first, error = await recv_until(sock, deadline, _has_status_line)
        if not error:
            await asyncio.sleep(stall_s)  # the stall: the server's writes fill the buffers
            rest, error = await recv_until(sock, deadline, lambda _: False)
            first += rest
    except OSError as e:
        first, error = b"", f"{type(e).__name__}: {e}"
    finally:
        if sock is not None:
            sock.close()
    _fill(out, spec, parse_raw(first, error), stream=True)
    return out


async def slow_reader(
    url: str,
    spec: Spec,
    headers: dict[str, str],
    piece: int,
    interval_s: float,
    deadline_s: float,
) -> Outcome:
    """Stream ``spec`` with a small receive buffer and read it ``piece`` bytes every
    ``interval_s``: slow, but never stalled for as long as the server's write timeout. It reads
    on a thread of its own (a blocking socket): on the soak's event loop, busy with its floods,
    its pace was the loop's lag (~2 KiB/s where it asks for 10), not its own."""
    out = Outcome(spec.name, "slow_reader", time.monotonic(), 0.0)
    body = json.dumps(spec.request_body(stream=True)).encode()
    request = head(url, "POST", spec.path, _json_headers(headers), len(body)) + body
    data, error = await asyncio.to_thread(
        _read_slowly, url, request, piece, interval_s, out.start + deadline_s
    )
    _fill(out, spec, parse_raw(data, error), stream=True)
    return out


def _read_slowly(
    url: str, request: bytes, piece: int, interval_s: float, deadline: float
) -> tuple[bytes, str]:
    """``slow_reader``'s blocking half: (what it read, a transport error or "deadline")."""
    parts = urlsplit(url)
    chunks: list[bytes] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * piece)  # before connecting
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, STALLED_MSS)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect((parts.hostname, parts.port or 80))
            sock.sendall(request)
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(piece)
                if not chunk:
                    return b"".join(chunks), ""
                chunks.append(chunk)
                time.sleep(interval_s)
    except TimeoutError:
        pass
    except OSError as e:
        return b"".join(chunks), f"{type(e).__name__}: {e}"
    return b"".join(chunks), "deadline"


async def silent_head(
    url: str, partial: bytes, deadline_s: float
) -> tuple[float | None, bytes, int]:
    """Connect, send ``partial`` (a request head cut short) and go quiet: (seconds until the
    server closed the connection, None if not within ``deadline_s``; what it sent; the
    connection's own port)."""
    start = time.monotonic()
    sock = await connect(url)
    port = sock.getsockname()[1]
    try:
        await asyncio.get_running_loop().sock_sendall(sock, partial)
        data, error = await recv_until(sock, start + deadline_s, lambda _: False)
    finally:
        sock.close()
    return (None if error == "deadline" else time.monotonic() - start), data, port


async def slow_body(
    url: str, spec: Spec, headers: dict[str, str], slow_s: float, deadline_s: float
) -> Outcome:
    """Send ``spec`` (not streamed) with its body trickled over ``slow_s``, then read the
    answer."""
    out = Outcome(spec.name, "slow_body", time.monotonic(), 0.0)
    deadline = out.start + deadline_s
    body = json.dumps(spec.request_body(stream=False)).encode()
    loop = asyncio.get_running_loop()
    try:
        sock = await connect(url)
    except OSError as e:
        _fill(out, spec, parse_raw(b"", f"{type(e).__name__}: {e}"), stream=False)
        return out
    error = ""
    try:
        await loop.sock_sendall(
            sock, head(url, "POST", spec.path, _json_headers(headers), len(body))
        )
        pieces = max(1, min(len(body) - 1, int(slow_s * 2)))
        for i in range(pieces):  # a byte every slow_s / pieces, the rest at the end
            await loop.sock_sendall(sock, body[i : i + 1])
            await asyncio.sleep(slow_s / pieces)
        await loop.sock_sendall(sock, body[pieces:])
    except OSError as e:  # the server gave up on the body and closed: its answer may be there
        error = f"{type(e).__name__}: {e}"
    data, read_error = await recv_until(sock, deadline, lambda _: False)
    sock.close()
    _fill(out, spec, parse_raw(data, read_error or error), stream=False)
    return out


def _json_headers(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "Content-Type": "application/json"}


def _fill(out: Outcome, spec: Spec, resp: RawResponse, stream: bool) -> None:
    out.end = time.monotonic()
    out.status = resp.status
    out.hang = resp.error == "deadline"
    if resp.status != 200:
        out.error, out.code = (
            parse_error(resp.body.decode(errors="replace")) if resp.body else (resp.error, "")
        )
        return
    if stream:
        reader = StreamReader(spec.endpoint)
        for line in resp.body.decode(errors="replace").splitlines():
            try:
                reader.feed(line)
            except ValueError:  # an event cut in half by the connection's end
                break
        out.answer, out.complete = reader.answer(), reader.done and not reader.error
        out.error, out.code = reader.error or resp.error, reader.code
    elif resp.complete:
        out.answer, out.complete = parse_answer(spec.endpoint, json.loads(resp.body)), True
    else:
        out.answer, out.error = Answer("", None), resp.error or "body cut short"


class Hostile(NamedTuple):
    """A request the server must refuse with a 4xx (``expect``: the statuses it may give)."""

    name: str
    method: str
    path: str
    body: bytes | None  # None: no body
    expect: tuple[int, ...] = (400,)
    key: str = "api"  # api | none | wrong | tenant (an API key on an admin route) | admin
    declared: int | None = None  # a Content-Length to claim (no body sent), else len(body)
    chunked_bytes: int = 0  # a chunked body of this many bytes


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def hostile_requests(
    max_body_bytes: int, max_model_len: int, has_keys: bool, admin_roles: bool
) -> list[Hostile]:
    """The cases for a server with these limits; ``has_keys``: it wants an API key;
    ``admin_roles``: it tells admin keys from tenant keys."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cmpl: dict[str, Any] = {"prompt": "hi", "max_tokens": 4}
    c = "/v1/completions"
    cases = [
        Hostile("JSON cut short", "POST", c, b'{"prompt": "hi", "max_tok'),
        Hostile("JSON array body", "POST", c, b"[1, 2, 3]"),
        Hostile("not JSON", "POST", c, b"hello there"),
        Hostile("temperature NaN", "POST", c, b'{"prompt": "hi", "temperature": NaN}'),
        Hostile("max_tokens -1", "POST", c, _j({**cmpl, "max_tokens": -1})),
        Hostile("max_tokens as a string", "POST", c, _j({**cmpl, "max_tokens": "16"})),
        Hostile("top_p 2", "POST", c, _j({**cmpl, "top_p": 2})),
        Hostile("n 17", "POST", c, _j({**cmpl, "n": 17})),
        Hostile("unknown field", "POST", c, _j({**cmpl, "mirostat": 1})),
        Hostile("33 stop strings", "POST", c, _j({**cmpl, "stop": [f"s{i}" for i in range(33)]})),
        Hostile("stop string of 1025 chars", "POST", c, _j({**cmpl, "stop": ["x" * 1025]})),
        Hostile("logit_bias key not a token", "POST", c, _j({**cmpl, "logit_bias": {"hi": 1}})),
        Hostile("seed 2^64", "POST", c, _j({**cmpl, "seed": 2**64})),
        Hostile("prompt token id 2^64", "POST", c, _j({**cmpl, "prompt": [1, 2**64]})),
        Hostile("integer of 5000 digits", "POST", c, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
        Hostile("JSON nested 3000 deep", "POST", c, b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
        Hostile("lone surrogate", "POST", c, b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
        Hostile("prompt past the context", "POST", c, _j({**cmpl, "prompt": [5] * (max_model_len + 8)})),
        Hostile("empty messages", "POST", "/v1/chat/completions", _j({**chat, "messages": []})),
        Hostile("role tool", "POST", "/v1/chat/completions", _j({**chat, "messages": [{"role": "tool", "content": "x"}]})),
        Hostile("unknown model", "POST", c, _j({**cmpl, "model": "gpt-17"}), expect=(404,)),
        Hostile("GET on a POST route", "GET", c, None, expect=(405,)),
        Hostile("unknown path", "POST", "/v1/nothing", _j(cmpl), expect=(404,)),
        Hostile("declared body over the cap", "POST", c, None, expect=(413,), declared=max_body_bytes + 1),
        Hostile("chunked body over the cap", "POST", c, None, expect=(413,), chunked_bytes=max_body_bytes + (1 << 16)),
        Hostile("scale the decode pool to 0", "POST", "/admin/scale", _j({"decode": 0}), key="admin"),
        Hostile("drain a node that is not there", "POST", "/admin/nodes/prefill-999/drain", None, expect=(404,), key="admin"),
    ]  # fmt: skip
    if has_keys:
        cases.append(Hostile("no API key", "POST", c, _j(cmpl), expect=(401,), key="none"))
        cases.append(Hostile("wrong API key", "POST", c, _j(cmpl), expect=(401,), key="wrong"))
    if admin_roles:  # the server has admin keys: a tenant's key may not even look
        cases.append(
            Hostile("tenant key on /admin/nodes", "GET", "/admin/nodes", None, (403,), "tenant")
        )
    return cases


async def hostile_request(url: str, case: Hostile, keys: dict[str, str | None]) -> RawResponse:
    """Send ``case`` (``keys``: api, admin, wrong -> a key or None) and read the answer."""
    key = keys.get(case.key, keys["api"]) if case.key != "tenant" else keys["api"]
    headers = {"Content-Type": "application/json"}
    if key and case.key != "none":
        headers["Authorization"] = f"Bearer {key}"
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30
    sock = await connect(url)
    error = ""
    try:
        if case.chunked_bytes:
            await loop.sock_sendall(sock, head(url, case.method, case.path, headers, None))
            piece = b"x" * (1 << 16)
            for _ in range(case.chunked_bytes // len(piece) + 1):
                await asyncio.wait_for(
                    loop.sock_sendall(sock, b"%x\r\n%s\r\n" % (len(piece), piece)), 10
                )
            await loop.sock_sendall(sock, b"0\r\n\r\n")
        elif case.declared is not None:  # claimed, never sent: refused on the header alone
            await loop.sock_sendall(sock, head(url, case.method, case.path, headers, case.declared))
        else:
            body = case.body or b""
            await loop.sock_sendall(
                sock, head(url, case.method, case.path, headers, len(body)) + body
            )
    except (OSError, asyncio.TimeoutError) as e:  # refused mid-body: the answer may be there
        error = f"{type(e).__name__}: {e}"
    data, read_error = await recv_until(sock, deadline, lambda _: False)
    sock.close()
    return parse_raw(data, read_error or error)
