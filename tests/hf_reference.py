"""HF transformers greedy decoding: the correctness reference for the whole project.

pd's greedy output must equal ``hf_greedy`` token for token on the same checkpoint.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str) -> PreTrainedModel:
    """The fp32 HF model of a checkpoint dir, loaded once per dir per process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def hf_greedy(
    model_dir: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
) -> list[int]:
    """The new tokens of HF ``generate(do_sample=False)`` in fp32.

    Generation stops after an EOS token (which is included), unless ``ignore_eos``. Only
    the checkpoint's eos ids are taken from its generation config, never sampling knobs
    such as repetition_penalty, so this is plain argmax decoding.
    """
    assert len(prompt_ids) > 0 and max_new_tokens >= 1, (len(prompt_ids), max_new_tokens)
    key = (str(Path(model_dir).resolve()), tuple(prompt_ids), max_new_tokens, ignore_eos)
    return list(_hf_greedy(*key))


@functools.lru_cache(maxsize=1024)
def _hf_greedy(
    model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool
) -> tuple[int, ...]:
    """``hf_greedy`` computed once per question per process (the reference never changes,
    and the cluster tests ask the same ones in each topology)."""
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    # None would fall back to the model's eos; an empty list really disables stopping.
    eos = [] if ignore_eos else model.generation_config.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=model.generation_config.pad_token_id,
    )
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
        )
    return tuple(out[0, input_ids.shape[1] :].tolist())
