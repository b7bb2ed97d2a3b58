"""The soak's steady load: a fixed set of requests with known greedy answers.

``make_specs`` gives the requests (chat and completions and ``/generate``, streamed and not,
sharing a long system prompt or document, some with stop strings); ``references`` asks each
once of the unloaded server (twice, and in the other mode, to check the answer is stable);
``send`` runs one request under a deadline and returns an ``Outcome``; ``StreamReader`` turns
SSE lines of any endpoint into an ``Answer`` (the raw-socket clients of ``chaos_hostile`` use it
too).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import httpx

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}

SYSTEM = (
    "You are the support assistant of Lumen Rail, a regional train company. Answer in one or "
    "two short sentences. Facts you may use: trains run every 20 minutes between 5 am and "
    "midnight; a day pass costs 12 euros and a single ticket 3 euros; children under six "
    "travel free; bicycles are allowed outside the rush hours of 7 to 9 am and 4 to 6 pm; "
    "lost items are kept for 30 days at the central station; refunds are given for delays "
    "over 30 minutes through the website; the quiet carriage is always the last one; dogs "
    "travel free on a lead; the night bus replaces trains on Sundays after 11 pm."
)
DOCUMENT = (
    "The river town of Almsford grew around a stone bridge built in 1342. Its market, held "
    "every Thursday since the fifteenth century, sold wool, salt and later clocks, for which "
    "the town became known across the region. In 1861 the railway arrived, the clock "
    "workshops became two factories, and the population tripled within forty years. Both "
    "factories closed in the 1970s; today the old buildings hold a museum of timekeeping, a "
    "library and a school of music, and the Thursday market still fills the bridge square."
)


class Answer(NamedTuple):
    """What a request returned. ``num_tokens``/``token_ids`` None: the endpoint did not say."""

    text: str
    finish_reason: str | None
    num_tokens: int | None = None
    token_ids: tuple[int, ...] | None = None

    def differs_from(self, ref: Answer) -> str | None:
        """Why this full answer is not ``ref`` (None: it is)."""
        if self.text != ref.text:
            return f"text {self.text[:80]!r} != {ref.text[:80]!r}"
        if self.finish_reason != ref.finish_reason:
            return f"finish_reason {self.finish_reason} != {ref.finish_reason}"
        for name in ("num_tokens", "token_ids"):
            mine, theirs = getattr(self, name), getattr(ref, name)
            if mine is not None and theirs is not None and mine != theirs:
                return f"{name} {mine} != {theirs}"
        return None

    def is_prefix_of(self, ref: Answer) -> bool:
        """A stream cut short: what came so far agrees with the reference."""
        ids_ok = self.token_ids is None or ref.token_ids is None
        ids_ok = ids_ok or ref.token_ids[: len(self.token_ids or ())] == self.token_ids
        return ref.text.startswith(self.text) and ids_ok


@dataclass(frozen=True)
class Spec:
    """One request of the workload. ``body`` has no ``stream``: ``request_body`` adds it."""

    name: str
    endpoint: str  # a key of PATHS
    body: dict[str, Any]
    stream: bool

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    def request_body(self, stream: bool | None = None) -> dict[str, Any]:
        stream = self.stream if stream is None else stream
        body = {**self.body, "stream": stream}
        if stream and self.endpoint != "generate":
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def no_max_tokens(self) -> bool:
        """It leaves its length to the server (OpenAI's clients send no ``max_tokens``): the
        rest of the context for chat, 16 tokens for completions (OpenAI's default)."""
        fields = self.body.get("sampling_params", self.body)
        return "max_tokens" not in fields and "max_new_tokens" not in fields

    def with_stop(self, stop: str) -> Spec:
        if self.endpoint == "generate":
            sampling = {**self.body["sampling_params"], "stop": [stop]}
            return replace(
                self, name=f"{self.name}+stop", body={**self.body, "sampling_params": sampling}
            )
        return replace(self, name=f"{self.name}+stop", body={**self.body, "stop": [stop]})


def _chat(
    name: str, question: str, max_tokens: int | None, stream: bool, system: bool = True
) -> Spec:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages.append({"role": "user", "content": question})
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return Spec(name, "chat", _without_none(body), stream)


def _completion(name: str, prompt: str, max_tokens: int | None, stream: bool, **extra: Any) -> Spec:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return Spec(name, "completions", _without_none(body), stream)


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    """``max_tokens`` None: not sent at all (the server's default applies)."""
    return {k: v for k, v in body.items() if v is not None}


def _generate(name: str, text: str, max_tokens: int, stream: bool) -> Spec:
    sampling = {"max_new_tokens": max_tokens, "temperature": 0}
    return Spec(name, "generate", {"text": text, "sampling_params": sampling}, stream)


def make_specs() -> list[Spec]:
    """The steady load's requests (two without ``max_tokens``). Stop strings are added once the
    answers are known (``references``)."""
    return [
        _chat("chat-bikes", "Can I take my bicycle on the 8 am train?", 32, stream=True),
        _chat("chat-price", "How much is a day pass?", 24, stream=False),
        _chat("chat-lost", "I lost my umbrella on a train yesterday. What now?", 40, stream=True),
        _chat("chat-short", "What is the capital of France?", 16, stream=False, system=False),
        _completion("doc-bridge", f"{DOCUMENT}\n\nQ: When was the bridge built?\nA:", 24, False),
        _completion("doc-today", f"{DOCUMENT}\n\nQ: What is in the factories now?\nA:", 32, True),
        _completion("short-fox", "The quick brown fox", 20, stream=True, ignore_eos=True),
        _completion("short-once", "Once upon a time, in a village by the sea,", 28, False),
        _generate("gen-doc", f"{DOCUMENT}\n\nIn one sentence, the town is", 24, stream=False),
        _generate("gen-short", "A list of three colours:", 16, stream=True),
        # no max_tokens, as OpenAI's clients send them: the server books the rest of the context
        _chat("chat-nomax", "Say hello to the passengers.", None, stream=True),
        _completion("short-nomax", "The train to the coast leaves at", None, stream=False),
    ]


def long_spec(max_tokens: int) -> Spec:
    """A long stream (stalled readers take it): many small SSE events."""
    return _completion(
        "long-story", "Tell me a very long story.", max_tokens, True, ignore_eos=True
    )


def stop_for(text: str) -> str | None:
    """A stop string that occurs in ``text`` past its first few characters (None if the text
    is too short to cut)."""
    start = len(text) // 2
    while start < len(text) - 3 and not text[start].isalnum():
        start += 1
    stop = text[start : start + 3]
    return stop if len(stop) == 3 and stop.strip() and start >= 4 else None


@dataclass
class Outcome:
    """One request as the client saw it. ``status`` None: no HTTP answer (transport error or
    a hang); ``answer``: what came, partial when the stream ended early (``complete`` False)."""

    spec: str
    source: str  # steady | flood | slow_body | stalled
    start: float
    end: float
    status: int | None = None
    answer: Answer | None = None
    complete: bool = False  # a stream ended with [DONE], a body was whole
    error: str = ""  # an error answer's or event's message, or the transport error
    code: str = ""  # its OpenAI code (or type)
    hang: bool = False  # no end within the client's deadline
    notes: list[str] = field(default_factory=list)
    request_id: str = ""  # the answer's id (the server's request id), where one came
    cached_tokens: int | None = None  # its usage's cached prompt tokens, where it said

    @property
    def latency(self) -> float:
        return self.end - self.start


class StreamReader:
    """SSE lines of one endpoint's stream -> the answer, an error event, [DONE]."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.text = ""
        self.finish: str | None = None
        self.num_tokens: int | None = None
        self.ids: list[int] | None = [] if endpoint == "generate" else None
        self.done = False
        self.error = ""
        self.code = ""
        self.request_id = ""
        self.cached_tokens: int | None = None

    def feed(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.done = True
            return
        event = json.loads(line[6:])
        self.request_id = self.request_id or str(event.get("id") or "")
        self.cached_tokens = _cached_tokens(event, self.cached_tokens)
        if "error" in event:
            err = event["error"]
            self.error, self.code = err.get("message", ""), err.get("code") or err.get("type", "")
            return
        if self.endpoint == "generate":
            self.text += event.get("text", "")
            assert self.ids is not None
            self.ids.extend(event.get("output_ids", []))
            self.num_tokens = event.get("completion_tokens", self.num_tokens)
            self.finish = event.get("finish_reason") or self.finish
            return
        if event.get("usage"):
            self.num_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content") if self.endpoint == "chat" else None
            self.text += piece or choice.get("text") or ""
            self.finish = choice.get("finish_reason") or self.finish

    def answer(self) -> Answer:
        ids = tuple(self.ids) if self.ids is not None else None
        return Answer(self.text, self.finish, self.num_tokens, ids)


def parse_answer(endpoint: str, body: dict[str, Any]) -> Answer:
    """A non-streamed 200's answer."""
    if endpoint == "generate":
        ids = tuple(body["output_ids"])
        return Answer(body["text"], body["finish_reason"], body["completion_tokens"], ids)
    choice = body["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return Answer(text or "", choice["finish_reason"], body["usage"]["completion_tokens"])


def _cached_tokens(body: dict[str, Any], default: int | None = None) -> int | None:
    """The cached prompt tokens an answer (or a stream's usage event) reports."""
    if "cached_tokens" in body:  # /generate
        return int(body["cached_tokens"])
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details["cached_tokens"]) if "cached_tokens" in details else default


def parse_error(text: str) -> tuple[str, str]:
    """(message, code) of an error body in OpenAI's shape (or the raw text)."""
    try:
        err = json.loads(text)["error"]
        return str(err.get("message", "")), str(err.get("code") or err.get("type") or "")
    except (ValueError, KeyError, TypeError):
        return text[:300], ""


async def send(
    http: httpx.AsyncClient,
    spec: Spec,
    headers: dict[str, str],
    deadline_s: float,
    source: str = "steady",
    stream: bool | None = None,
) -> Outcome:
    """Run ``spec`` (in its mode, or ``stream``); never longer than ``deadline_s``."""
    out = Outcome(spec.name, source, time.monotonic(), 0.0)
    try:
        await asyncio.wait_for(_send(http, spec, headers, out, stream, deadline_s), deadline_s)
    except asyncio.TimeoutError:
        out.hang = True
        out.error = f"no answer within {deadline_s:g} s"
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:  # a body we cannot read
        out.error = f"unreadable answer: {type(e).__name__}: {e}"
    out.end = time.monotonic()
    return out


async def _send(
    http: httpx.AsyncClient,
    spec: Spec,
    headers: dict[str, str],
    out: Outcome,
    stream: bool | None,
    timeout_s: float,
) -> None:
    body = spec.request_body(stream)
    if not body["stream"]:
        r = await http.post(spec.path, json=body, headers=headers, timeout=timeout_s)
        out.status = r.status_code
        if r.status_code == 200:
            answer = r.json()
            out.answer, out.complete = parse_answer(spec.endpoint, answer), True
            out.request_id, out.cached_tokens = str(answer.get("id", "")), _cached_tokens(answer)
        else:
            out.error, out.code = parse_error(r.text)
        return
    async with http.stream("POST", spec.path, json=body, headers=headers, timeout=timeout_s) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error, out.code = parse_error((await r.aread()).decode(errors="replace"))
            return
        reader = StreamReader(spec.endpoint)
        try:
            async for line in r.aiter_lines():
                reader.feed(line)
        finally:
            out.answer, out.complete = reader.answer(), reader.done and not reader.error
            out.error, out.code = reader.error, reader.code
            out.request_id, out.cached_tokens = reader.request_id, reader.cached_tokens


class References(NamedTuple):
    answers: dict[str, Answer]  # spec name -> its greedy answer
    specs: list[Spec]  # the steady load's, stop variants included
    problems: list[str]  # answers that were not stable (the soak cannot judge those)
    seconds: dict[str, float]  # spec name -> how long its first answer took, unloaded


async def references(
    http: httpx.AsyncClient, specs: list[Spec], extra: list[Spec], headers: dict[str, str]
) -> References:
    """Each spec's answer from the unloaded server, asked one at a time: twice in its own mode
    and once in the other (all must agree); then the stop-string variants of the first few
    specs. ``extra`` specs (the long one) are asked once."""
    answers: dict[str, Answer] = {}
    problems: list[str] = []
    seconds: dict[str, float] = {}

    async def ask(spec: Spec, modes: tuple[bool, ...]) -> None:
        got = []
        for stream in modes:
            out = await send(http, spec, headers, 300.0, "reference", stream)
            if out.status != 200 or not out.complete or out.answer is None:
                problems.append(f"{spec.name} (stream={stream}): {out.status} {out.error}")
                return
            got.append(out.answer)
            seconds.setdefault(spec.name, out.latency)
        # the non-streamed chat and completions answers carry no ids: compare what both have
        for other in got[1:]:
            if (why := other.differs_from(got[0])) is not None:
                problems.append(f"{spec.name}: answers differ between tries: {why}")
                return
        answers[spec.name] = got[0]

    for spec in specs:
        await ask(spec, (spec.stream, spec.stream, not spec.stream))
    variants = []
    for spec in specs[:: max(1, len(specs) // 3)]:  # a third of them, every endpoint
        if spec.name in answers and (stop := stop_for(answers[spec.name].text)) is not None:
            variants.append(spec.with_stop(stop))
    for spec in [*variants, *extra]:
        await ask(spec, (spec.stream,) if spec in extra else (spec.stream, not spec.stream))
    steady = [s for s in [*specs, *variants] if s.name in answers]
    return References(answers, steady, problems, seconds)
