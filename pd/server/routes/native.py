"""The native ``/generate`` (SGLang-like): token ids in and out, sampling params nested."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pd.server.checks import Prepared, RequestChecks
from pd.server.generation import Choices, Step
from pd.server.http.errors import APIError
from pd.server.openai.protocol import GenerateRequest
from pd.server.openai.responses import GenerateResponse
from pd.server.routes.common import json_body, parse_body, serve_generation

router = APIRouter()


def prepare_generate(checks: RequestChecks, body: bytes, api_key: str | None) -> Prepared:
    req: GenerateRequest = parse_body(GenerateRequest, body)
    req.check_supported()
    if (req.input_ids is None) == (req.text is None):
        raise APIError("give exactly one of input_ids and text", param="input_ids")
    if req.input_ids is not None:
        if not req.input_ids:
            raise APIError("input_ids must not be empty", param="input_ids")
        prompt_ids = checks.prompt_ids(req.input_ids, "input_ids")
    else:
        prompt_ids = checks.encode(req.text or "", "text")
    sp = req.sampling_params
    return checks.prepare(
        prompt_ids,
        sp.sampling_kwargs(),
        param="input_ids",
        max_tokens=sp.max_new_tokens,
        logit_bias=sp.logit_bias,
        priority=None,  # the API key's
        api_key=api_key,
        cache_salt=req.cache_salt,
        stream=req.stream,
    )


class GenerateRenderer:
    def __init__(self, model_name: str, choices: Choices) -> None:
        self.choices = choices

    def first(self) -> None:
        return None

    def chunk(self, index: int, step: Step) -> GenerateResponse:
        gen = self.choices.gens[index]  # /generate has one choice
        return GenerateResponse(
            id=gen.request_id,
            output_ids=step.token_ids,
            text=step.text,
            finish_reason=step.finish_reason,
            prompt_tokens=gen.num_prompt_tokens,
            completion_tokens=len(gen.output_ids),
            cached_tokens=gen.num_cached_tokens,
        )

    def usage(self) -> None:
        return None  # /generate's chunks carry their counts, every one

    def final(self) -> GenerateResponse:
        gen = self.choices.gens[0]
        return self.chunk(0, Step(gen.text, gen.output_ids, gen.finish_reason))


@router.post("/generate", response_model=GenerateResponse, openapi_extra=json_body(GenerateRequest))
async def generate(request: Request) -> Response:
    return await serve_generation(request, "gen", prepare_generate, GenerateRenderer)
