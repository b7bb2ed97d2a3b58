"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pd.core.messages import TokenLogprobsMsg
from pd.engine.grammar import grammar_error
from pd.server.errors import APIError
from pd.server.generation import Generation, Step
from pd.server.logprobs import chat_logprobs, completion_logprobs
from pd.server.protocol import ChatCompletionRequest, CompletionRequest
from pd.server.responses import (
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
from pd.server.routes.common import json_body, parse_body, serve_generation
from pd.server.state import Prepared, ServerState
from pd.server.tools import Tools

router = APIRouter()


def usage_of(gen: Generation) -> Usage:
    return Usage.make(gen.num_prompt_tokens, len(gen.output_ids), gen.num_cached_tokens)


def prepare_completion(state: ServerState, body: bytes, api_key: str | None) -> Prepared:
    req: CompletionRequest = parse_body(CompletionRequest, body)
    req.check_supported()
    state.check_model(req.model)
    prompt = req.single_prompt
    if isinstance(prompt, str):
        prompt_ids = state.encode(prompt, "prompt")
    else:
        prompt_ids = state.prompt_ids(prompt, "prompt")
    max_tokens = state.max_tokens_for(len(prompt_ids), req.max_tokens, "prompt")
    params = state.sampling_params(req.sampling_kwargs(), max_tokens, req.logit_bias)
    namespace = state.namespace(api_key, req.cache_salt)
    return Prepared(prompt_ids, params, namespace, req.stream, req.include_usage)


def prepare_chat(state: ServerState, body: bytes, api_key: str | None) -> Prepared:
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    req.check_supported()
    state.check_model(req.model)
    tools = Tools.of(req.tools, req.tool_choice, req.parallel_tool_calls)
    if tools is not None and req.stream:
        raise APIError(
            "stream=true with tools is not supported yet (tool_choice=none is): ask without "
            "a stream",
            param="stream",
        )
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
    messages = [m.template_dict() for m in req.messages]
    prompt_ids = state.apply_chat_template(messages, req.tools if tools is not None else None)
    max_tokens = state.max_tokens_for(len(prompt_ids), req.requested_max_tokens, "messages")
    params = state.sampling_params(fields, max_tokens, req.logit_bias)
    namespace = state.namespace(api_key, req.cache_salt)
    return Prepared(prompt_ids, params, namespace, req.stream, req.include_usage, tools)


class _StreamRenderer:
    """Chunks and the usage chunk of an OpenAI stream; subclasses give the choice shape."""

    chunk_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def _choice(self, gen: Generation, text: str, finish_reason: str | None, logprobs: Any) -> Any:
        raise NotImplementedError

    def _logprobs(self, gen: Generation, lps: Sequence[TokenLogprobsMsg]) -> Any:
        raise NotImplementedError

    def chunk(self, gen: Generation, step: Step) -> BaseModel | None:
        """A step's chunk: its text, and its tokens' logprobs when asked for (a step whose
        tokens make no text yet still carries them)."""
        if not step.text and step.finish_reason is None and not step.logprobs:
            return None
        logprobs = self._logprobs(gen, step.logprobs) if gen.params.logprobs is not None else None
        choice = self._choice(gen, step.text, step.finish_reason, logprobs)
        return self.chunk_model(id=gen.request_id, model=self.model_name, choices=[choice])

    def usage(self, gen: Generation) -> BaseModel:
        return self.chunk_model(
            id=gen.request_id, model=self.model_name, choices=[], usage=usage_of(gen)
        )


class CompletionRenderer(_StreamRenderer):
    chunk_model = CompletionResponse

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self._text_offset = 0  # where the next chunk's tokens start (``text_offset``)

    def _choice(
        self,
        gen: Generation,
        text: str,
        finish_reason: str | None,
        logprobs: CompletionLogprobs | None,
    ) -> CompletionChoice:
        return CompletionChoice(text=text, finish_reason=finish_reason, logprobs=logprobs)

    def _logprobs(self, gen: Generation, lps: Sequence[TokenLogprobsMsg]) -> CompletionLogprobs:
        out = completion_logprobs(gen.tokenizer, lps, self._text_offset)
        self._text_offset += sum(len(t) for t in out.tokens)
        return out

    def first(self, gen: Generation) -> BaseModel | None:
        return None

    def final(self, gen: Generation) -> BaseModel:
        want = gen.params.logprobs is not None
        logprobs = self._logprobs(gen, gen.output_logprobs) if want else None
        choice = self._choice(gen, gen.text, gen.finish_reason, logprobs)
        return CompletionResponse(
            id=gen.request_id, model=self.model_name, choices=[choice], usage=usage_of(gen)
        )


class ChatRenderer(_StreamRenderer):
    chunk_model = ChatCompletionChunk

    def _choice(
        self, gen: Generation, text: str, finish_reason: str | None, logprobs: ChatLogprobs | None
    ) -> ChatChunkChoice:
        delta = DeltaMessage(content=text) if text or logprobs else DeltaMessage()
        return ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)

    def _logprobs(self, gen: Generation, lps: Sequence[TokenLogprobsMsg]) -> ChatLogprobs:
        return chat_logprobs(gen.tokenizer, lps)

    def first(self, gen: Generation) -> BaseModel | None:
        role = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=gen.request_id, model=self.model_name, choices=[role])

    def final(self, gen: Generation) -> BaseModel:
        message = ChatMessageOut(content=gen.text)
        finish_reason = gen.finish_reason
        if gen.tools is not None:
            content, calls = gen.tools.parse(gen.text)
            if calls:
                message = ChatMessageOut(content=content, tool_calls=[c.openai() for c in calls])
                finish_reason = "tool_calls"
        want = gen.params.logprobs is not None
        logprobs = chat_logprobs(gen.tokenizer, gen.output_logprobs) if want else None
        choice = ChatChoice(message=message, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletionResponse(
            id=gen.request_id, model=self.model_name, choices=[choice], usage=usage_of(gen)
        )


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    openapi_extra=json_body(CompletionRequest),
)
async def completions(request: Request) -> Response:
    render = CompletionRenderer(request.app.state.server.model_name)
    return await serve_generation(request, "cmpl", prepare_completion, render)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    openapi_extra=json_body(ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Response:
    render = ChatRenderer(request.app.state.server.model_name)
    return await serve_generation(request, "chatcmpl", prepare_chat, render)
