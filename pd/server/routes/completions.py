"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json

from pd.core.messages import TokenLogprobsMsg
from pd.executor.grammar import grammar_error
from pd.model.tokenizer import chat_template
from pd.server.checks import Prepared, RequestChecks
from pd.server.generation import Choices, Generation, Step
from pd.server.http.errors import APIError
from pd.server.openai.logprobs import chat_logprobs, completion_logprobs
from pd.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pd.server.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from pd.server.openai.tool_stream import ToolCallStream
from pd.server.openai.tools import Tools, calls_as_content
from pd.server.routes.common import json_body, parse_body, serve_generation

router = APIRouter()


def usage_of(choices: Choices) -> Usage:
    """The prompt counted once, the completion tokens of every choice."""
    return Usage.make(
        choices.num_prompt_tokens, choices.num_completion_tokens, choices.num_cached_tokens
    )


def prepare_completion(checks: RequestChecks, body: bytes, api_key: str | None) -> Prepared:
    req: CompletionRequest = parse_body(CompletionRequest, body)
    req.check_supported()
    checks.check_model(req.model)
    prompt = req.single_prompt
    if isinstance(prompt, str):
        prompt_ids = checks.encode(prompt, "prompt")
    else:
        prompt_ids = checks.prompt_ids(prompt, "prompt")
    return _prepare_openai(checks, req, prompt_ids, req.sampling_kwargs(), api_key, "prompt")


def prepare_chat(checks: RequestChecks, body: bytes, api_key: str | None) -> Prepared:
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    req.check_supported()
    checks.check_model(req.model)
    tools = Tools.of(req.tools, req.tool_choice, req.parallel_tool_calls)
    fields = req.sampling_kwargs()
    if tools is not None and tools.is_forced:
        if fields["grammar"]:
            raise APIError(
                f"tool_choice={json.dumps(req.tool_choice)} and a structured output each "
                "constrain the answer: send one",
                param="tool_choice",
            )
        fields["grammar"] = tools.grammar()
        if error := grammar_error(fields["grammar"]):
            raise APIError(f"the tools' parameters do not compile: {error}", param="tools")
    shown_tools = req.tools if tools is not None else None
    messages = calls_as_content(
        [m.template_dict() for m in req.messages], chat_template(checks.tokenizer, shown_tools)
    )
    prompt_ids = checks.apply_chat_template(messages, shown_tools)
    return _prepare_openai(checks, req, prompt_ids, fields, api_key, "messages", tools)


def _prepare_openai(
    checks: RequestChecks,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    fields: dict[str, Any],
    api_key: str | None,
    param: str,
    tools: Tools | None = None,
) -> Prepared:
    return checks.prepare(
        prompt_ids,
        fields,
        param=param,
        max_tokens=req.requested_max_tokens,
        logit_bias=req.logit_bias,
        priority=req.priority,
        api_key=api_key,
        cache_salt=req.cache_salt,
        stream=req.stream,
        include_usage=req.include_usage,
        n=req.n,
        tools=tools,
    )


# Stands for a chunk's text while its JSON is encoded once (``_StreamRenderer._text_chunk``):
# NUL characters, which encode as escapes that no id or model name's encoding holds alone.
_TEXT_MARK = "\x00pd-text\x00"
_ENCODED_MARK = to_json(_TEXT_MARK).decode()


class _StreamRenderer:
    """Chunks and the usage chunk of an OpenAI stream; subclasses give the choice shape.

    A chunk of text alone (no finish, no logprobs, no tool calls: all a stream's chunks but
    its first and last) is its choice's JSON encoded once with a mark for the text, the
    text's encoding put in its place: the same bytes as the chunk's model would encode, at
    the cost of encoding the text. Every chunk of a stream has the stream's ``created``."""

    chunk_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, model_name: str, choices: Choices) -> None:
        self.model_name = model_name
        self.choices = choices
        self.created = int(time.time())
        # choice index -> its text chunk's JSON before and after the text (None: not split)
        self._text_chunks: dict[int, tuple[str, str] | None] = {}

    def _text_chunk(self, index: int, text: str) -> str | None:
        """The JSON of choice ``index``'s chunk of ``text`` alone (None: build the model)."""
        if (parts := self._text_chunks.get(index, ())) == ():
            choice = self._choice(index, _TEXT_MARK, None, None)
            encoded = self._chunk_model([choice]).model_dump_json().split(_ENCODED_MARK)
            parts = self._text_chunks[index] = (
                (encoded[0], encoded[1]) if len(encoded) == 2 else None
            )
        if parts is None:
            return None
        return f"{parts[0]}{to_json(text).decode()}{parts[1]}"

    def _chunk_model(self, choices: list[Any], usage: Usage | None = None) -> BaseModel:
        return self.chunk_model(
            id=self.choices.request_id,
            model=self.model_name,
            created=self.created,
            choices=choices,
            usage=usage,
        )

    def _choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any) -> Any:
        raise NotImplementedError

    def _logprobs(self, gen: Generation, index: int, lps: Sequence[TokenLogprobsMsg]) -> Any:
        raise NotImplementedError

    def chunk(self, index: int, step: Step) -> BaseModel | str | None:
        """A step's chunk, for choice ``index``: its text, and its tokens' logprobs when asked
        for (a step whose tokens make no text yet still carries them)."""
        if not step.text and step.finish_reason is None and not step.logprobs:
            return None
        gen = self.choices.gens[index]
        want = gen.params.logprobs is not None
        if not want and step.finish_reason is None:
            if (encoded := self._text_chunk(index, step.text)) is not None:
                return encoded
        logprobs = self._logprobs(gen, index, step.logprobs) if want else None
        choice = self._choice(index, step.text, step.finish_reason, logprobs)
        return self._chunk_model([choice])

    def usage(self) -> BaseModel:
        return self._chunk_model([], usage_of(self.choices))


class CompletionRenderer(_StreamRenderer):
    chunk_model = CompletionResponse

    def __init__(self, model_name: str, choices: Choices) -> None:
        super().__init__(model_name, choices)
        # each choice's: where its next chunk's tokens start (``text_offset``)
        self._text_offsets: dict[int, int] = {}

    def _choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index, text=text, finish_reason=finish_reason, logprobs=logprobs
        )

    def _logprobs(
        self, gen: Generation, index: int, lps: Sequence[TokenLogprobsMsg]
    ) -> CompletionLogprobs:
        offset = self._text_offsets.get(index, 0)
        out = completion_logprobs(gen.tokenizer, lps, offset)
        self._text_offsets[index] = offset + sum(len(t) for t in out.tokens)
        return out

    def first(self) -> BaseModel | None:
        return None

    def final(self) -> BaseModel:
        choices = self.choices
        out = []
        for index, gen in enumerate(choices.gens):
            want = gen.params.logprobs is not None
            logprobs = self._logprobs(gen, index, gen.output_logprobs) if want else None
            out.append(self._choice(index, gen.text, gen.finish_reason, logprobs))
        return CompletionResponse(
            id=choices.request_id, model=self.model_name, choices=out, usage=usage_of(choices)
        )


class ChatRenderer(_StreamRenderer):
    chunk_model = ChatCompletionChunk

    def __init__(self, model_name: str, choices: Choices) -> None:
        super().__init__(model_name, choices)
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice -> its calls, with tools

    def chunk(self, index: int, step: Step) -> BaseModel | str | None:
        """With tools, a step's content and ``tool_calls`` (``pd.server.openai.tool_stream``); the
        last step's ``finish_reason`` is ``"tool_calls"`` when the choice made a call."""
        gen = self.choices.gens[index]
        if gen.tools is None:
            return super().chunk(index, step)
        calls = self._tool_streams.setdefault(index, ToolCallStream(gen.tools))
        out = calls.feed(step.text, step.finish_reason is not None)
        finish_reason = step.finish_reason
        if finish_reason is not None and calls.is_called:
            finish_reason = "tool_calls"
        if not (out.content or out.tool_calls or finish_reason or step.logprobs):
            return None
        want = gen.params.logprobs is not None
        delta = DeltaMessage(content=out.content or None, tool_calls=out.tool_calls or None)
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(gen, index, step.logprobs) if want else None,
        )
        return self._chunk_model([choice])

    def _choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: ChatLogprobs | None
    ) -> ChatChunkChoice:
        delta = DeltaMessage(content=text) if text or logprobs else DeltaMessage()
        return ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs
        )

    def _logprobs(
        self, gen: Generation, index: int, lps: Sequence[TokenLogprobsMsg]
    ) -> ChatLogprobs:
        return chat_logprobs(gen.tokenizer, lps)

    def first(self) -> BaseModel | None:
        # the role, once for each choice (as OpenAI streams them)
        choices = self.choices
        roles = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(len(choices.gens))
        ]
        return self._chunk_model(roles)

    def final(self) -> BaseModel:
        choices = self.choices
        out = []
        for index, gen in enumerate(choices.gens):
            out.append(self._final_choice(index, gen))
        return ChatCompletionResponse(
            id=choices.request_id, model=self.model_name, choices=out, usage=usage_of(choices)
        )

    def _final_choice(self, index: int, gen: Generation) -> ChatChoice:
        message = ChatMessageOut(content=gen.text)
        finish_reason = gen.finish_reason
        if gen.tools is not None:
            content, calls = gen.tools.parse(gen.text)
            if calls:
                message = ChatMessageOut(content=content, tool_calls=[c.openai() for c in calls])
                finish_reason = "tool_calls"
        want = gen.params.logprobs is not None
        logprobs = chat_logprobs(gen.tokenizer, gen.output_logprobs) if want else None
        return ChatChoice(
            index=index, message=message, finish_reason=finish_reason, logprobs=logprobs
        )


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    openapi_extra=json_body(CompletionRequest),
)
async def completions(request: Request) -> Response:
    return await serve_generation(request, "cmpl", prepare_completion, CompletionRenderer)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    openapi_extra=json_body(ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, "chatcmpl", prepare_chat, ChatRenderer)
