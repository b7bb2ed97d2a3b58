"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pd.server.generation import Generation
from pd.server.protocol import ChatCompletionRequest, CompletionRequest
from pd.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from pd.server.routes.common import json_body, parse_body, serve_generation
from pd.server.state import Prepared, ServerState

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
    prompt_ids = state.apply_chat_template([m.template_dict() for m in req.messages])
    max_tokens = state.max_tokens_for(len(prompt_ids), req.requested_max_tokens, "messages")
    params = state.sampling_params(req.sampling_kwargs(), max_tokens, req.logit_bias)
    namespace = state.namespace(api_key, req.cache_salt)
    return Prepared(prompt_ids, params, namespace, req.stream, req.include_usage)


class _StreamRenderer:
    """Chunks and the usage chunk of an OpenAI stream; subclasses give the choice shape."""

    chunk_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def _choice(self, text: str, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def chunk(
        self, gen: Generation, text: str, ids: list[int], finish_reason: str | None
    ) -> BaseModel | None:
        if not text and finish_reason is None:
            return None
        choice = self._choice(text, finish_reason)
        return self.chunk_model(id=gen.request_id, model=self.model_name, choices=[choice])

    def usage(self, gen: Generation) -> BaseModel:
        return self.chunk_model(
            id=gen.request_id, model=self.model_name, choices=[], usage=usage_of(gen)
        )


class CompletionRenderer(_StreamRenderer):
    chunk_model = CompletionResponse

    def _choice(self, text: str, finish_reason: str | None) -> CompletionChoice:
        return CompletionChoice(text=text, finish_reason=finish_reason)

    def first(self, gen: Generation) -> BaseModel | None:
        return None

    def final(self, gen: Generation) -> BaseModel:
        choice = self._choice(gen.text, gen.finish_reason)
        return CompletionResponse(
            id=gen.request_id, model=self.model_name, choices=[choice], usage=usage_of(gen)
        )


class ChatRenderer(_StreamRenderer):
    chunk_model = ChatCompletionChunk

    def _choice(self, text: str, finish_reason: str | None) -> ChatChunkChoice:
        delta = DeltaMessage(content=text) if text else DeltaMessage()
        return ChatChunkChoice(delta=delta, finish_reason=finish_reason)

    def first(self, gen: Generation) -> BaseModel | None:
        role = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=gen.request_id, model=self.model_name, choices=[role])

    def final(self, gen: Generation) -> BaseModel:
        message = ChatMessageOut(content=gen.text)
        choice = ChatChoice(message=message, finish_reason=gen.finish_reason)
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
