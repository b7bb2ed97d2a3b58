"""The model (layer 2, above ``pd.core`` only): the decoder and the families it runs, loading
(HF dirs and GGUF), weight formats and tokenization."""

from __future__ import annotations

from pd.model.loader import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    load_config,
    load_weights,
    resolve_model,
)
from pd.model.tokenizer import encode_chat, encode_prompt, eos_token_ids, load_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelLoadError",
    "encode_chat",
    "encode_prompt",
    "eos_token_ids",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model",
]
