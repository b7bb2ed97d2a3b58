"""Tokenizer loading, prompt encoding and the chat template, from local files only."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pd.model.loader import ModelLoadError, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model: str | os.PathLike[str] | None) -> PreTrainedTokenizerBase:
    """The HF tokenizer of a model (anything ``resolve_model`` accepts); never downloads."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(model)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a raw prompt; special tokens (BOS) only where the tokenizer adds them
    by default, as HF ``tokenizer(text)`` and vLLM do."""
    return _as_id_list(tokenizer(text, add_special_tokens=True)["input_ids"])


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]) -> str:
    """The chat template applied to ``messages``, ending with the assistant's turn opener."""
    _require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str), type(text)
    return text


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` through the chat template, with the generation prompt (and
    ``tools``, OpenAI's tool definitions, for a template that shows them to the model)."""
    _require_chat_template(tokenizer)
    encoded = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=True,
        tokenize=True,
    )
    # transformers 5 returns a BatchEncoding here; 4.x returned the id list itself.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return _as_id_list(encoded)


def chat_template(
    tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]] | None = None
) -> str | None:
    """The source of the chat template ``encode_chat`` renders with (a tokenizer's named
    ``tool_use`` template where it has one and ``tools`` are given); None without one."""
    if not tokenizer.chat_template:
        return None
    return tokenizer.get_chat_template(None, list(tools) if tools else None)


def eos_token_ids(
    model: str | os.PathLike[str] | None, tokenizer: PreTrainedTokenizerBase | None = None
) -> tuple[int, ...]:
    """Every id that ends generation: generation_config.json's eos ids (falling back to
    config.json's), then the tokenizer's eos, without duplicates. Without ``tokenizer``, its
    eos id is read from the tokenizer's files (``tokenizer_eos_id``)."""
    model_dir = resolve_model(model)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read eos_token_id from {path}: {e}") from e
        if value is not None:
            ids.extend([value] if isinstance(value, int) else value)
            break
    eos = tokenizer_eos_id(model_dir) if tokenizer is None else tokenizer.eos_token_id
    if eos is not None:
        ids.append(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def tokenizer_eos_id(model: str | os.PathLike[str] | None) -> int | None:
    """``load_tokenizer(model).eos_token_id``, read in milliseconds where the files say it
    plainly: the ``eos_token`` of ``tokenizer_config.json``, looked up in ``tokenizer.json`` by
    the tokenizers library. A node generates token ids only, and transformers' import and
    ``AutoTokenizer`` were half its start (docs/bench/history.md, "Node start-up"). Where
    the files are otherwise (no ``tokenizer.json``, a ``special_tokens_map.json``, no eos token
    named, one not in the vocabulary), the tokenizer is loaded after all."""
    model_dir = resolve_model(model)
    config, vocab = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if (
        vocab.is_file()
        and config.is_file()
        and not (model_dir / "special_tokens_map.json").exists()
    ):
        try:
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, dict):  # an AddedToken, as some files write it
                eos = eos.get("content")
            if isinstance(eos, str):
                from tokenizers import Tokenizer

                token_id = Tokenizer.from_file(str(vocab)).token_to_id(eos)
                if token_id is not None:
                    return int(token_id)
        except Exception:  # noqa: BLE001 - whatever these files are, transformers decides
            pass
    return load_tokenizer(model_dir).eos_token_id


def _require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; send a raw prompt instead"
        )


def _as_id_list(ids: Iterable[Any]) -> list[int]:
    out = [int(i) for i in ids]
    assert all(i >= 0 for i in out), "negative token id"
    return out
