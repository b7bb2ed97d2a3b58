"""A stream's text chunks, encoded once with a mark for the text, are the bytes their models
encode (``pd.server.routes.completions._StreamRenderer``), for any text; and the
detokenizer's decode of a few ids is the tokenizer's, taken from its Rust backend."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.server.detokenizer import backend_decoder
from pd.server.generation import Step
from pd.server.routes.completions import ChatRenderer, CompletionRenderer

TEXTS = [" hello", "", 'quote " back \\ slash /', "tab\t nl\n cr\r nul\x00 esc\x1b del\x7f",
         "Hello 世界 🎉 café", "\u2028\u2029", "\x00pd-text\x00"]  # fmt: skip


def _choices(n: int, **params: Any) -> Any:
    p = SimpleNamespace(logprobs=None, **params)
    gens = [SimpleNamespace(params=p, tools=None) for _ in range(n)]
    return SimpleNamespace(request_id="chatcmpl-1f\"x", gens=gens)


def _model_json(render: Any, index: int, text: str) -> str:
    choice = render._choice(index, text, None, None)
    return render.chunk_model(
        id=render.choices.request_id, model=render.model_name, created=render.created,
        choices=[choice],
    ).model_dump_json()  # fmt: skip


@pytest.mark.parametrize("renderer", [ChatRenderer, CompletionRenderer])
@pytest.mark.parametrize("model_name", ["SmolLM2", 'a "model" \\ 名 \x00pd-text\x00', "\x00pd-text\x00"])
def test_text_chunks_are_the_models_json(renderer: Any, model_name: str) -> None:
    render = renderer(model_name, _choices(3))
    for index in (0, 2):
        for text in TEXTS:
            chunk = render.chunk(index, Step(text, [1], None))
            if not text:
                assert chunk is None
                continue
            if model_name == "\x00pd-text\x00":  # the mark's encoding twice: the models
                assert not isinstance(chunk, str)
                chunk = chunk.model_dump_json()
            assert isinstance(chunk, str)
            assert chunk == _model_json(render, index, text)


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_text_chunk_is_the_models_json(text: str) -> None:
    for renderer in (ChatRenderer, CompletionRenderer):
        render = renderer("m", _choices(1))
        chunk = render.chunk(0, Step(text, [1], None))
        if text:
            assert chunk == _model_json(render, 0, text)


def test_finish_and_logprobs_chunks_are_models() -> None:
    render = ChatRenderer("m", _choices(1))
    assert not isinstance(render.chunk(0, Step("x", [1], "stop")), str)


def test_backend_decoder_is_the_tokenizers_decode(tokenizer: Any) -> None:
    decode = backend_decoder(tokenizer)
    assert decode == tokenizer._tokenizer.decode  # the stock fast tokenizer: its backend's
    vocab = len(tokenizer)
    for start in range(0, vocab, 997):
        ids = [(start + 31 * k) % vocab for k in range(6)] + [tokenizer.eos_token_id]
        for skip in (True, False):
            want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert decode(ids, skip) == want


def test_backend_decoder_keeps_a_tokenizers_own_decode(tokenizer: Any) -> None:
    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def decode(self, ids: Any, **kwargs: Any) -> str:
            return super().decode(ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    assert backend_decoder(shouting)(ids, True) == "HELLO THERE"
