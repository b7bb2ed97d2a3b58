"""Model loading: GGUF conversion, HF dirs, weights, tokenizer and the HF reference."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pd.model import convert
from pd.model.loader import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    default_gguf_path,
    load_config,
    load_weights,
    resolve_model,
)
from pd.model.tokenizer import (
    encode_chat,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
    render_chat,
    tokenizer_eos_id,
)
from tests.hf_reference import hf_greedy, load_hf_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _copy_model_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expected_llama_shapes(config: dict, tied: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


# ---- the default model -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_conversion_matches_gguf_loaded_model(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    source = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    converted = load_hf_model(str(smollm2_dir)).state_dict()
    assert sorted(converted) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(converted[name], tensor), name

    weights = load_weights(smollm2_dir)
    assert set(weights) == set(source) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, source[name]), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_default_model_resolves_fast_from_cache(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == DEFAULT_MODEL_NAME
    start = time.perf_counter()
    for alias in (None, "default", DEFAULT_MODEL_NAME, str(default_gguf_path())):
        assert resolve_model(alias) == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert not list(smollm2_dir.parent.glob(f".tmp-{DEFAULT_MODEL_NAME}-*"))

    config = load_config(smollm2_dir)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (3, True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_smollm2_chat_template_and_hf_reference_answer(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    text = render_chat(tokenizer, FRANCE)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = encode_chat(tokenizer, FRANCE)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = eos_token_ids(smollm2_dir, tokenizer)
    assert eos == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    out = hf_greedy(smollm2_dir, ids, max_new_tokens=24)
    answer = tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[-1] in eos and len(out) < 24  # stopped on EOS, which is included


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_encode_prompt_adds_bos_only_if_tokenizer_does(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    ids = encode_prompt(tokenizer, "The capital of France is")
    assert ids == tokenizer.encode("The capital of France is")
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS to raw prompts
    assert tokenizer.decode(ids) == "The capital of France is"


# ---- tiny HF checkpoints -----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "llama3"])
def test_load_weights_names_shapes_and_values(tiny_model_factory, kind: str) -> None:
    model_dir = tiny_model_factory(kind)
    config = load_config(model_dir)
    expected = _expected_llama_shapes(config, tied=config["tie_word_embeddings"])
    if kind == "qwen2":
        head_dim = config["head_dim"]
        for i in range(config["num_hidden_layers"]):
            expected[f"model.layers.{i}.self_attn.q_proj.bias"] = (4 * head_dim,)
            expected[f"model.layers.{i}.self_attn.k_proj.bias"] = (2 * head_dim,)
            expected[f"model.layers.{i}.self_attn.v_proj.bias"] = (2 * head_dim,)

    weights = load_weights(model_dir)
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    reference = load_hf_model(str(model_dir)).state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name

    half = load_weights(model_dir, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


@pytest.mark.timeout(120)
def test_tiny_checkpoints_are_complete_and_decode_varied_tokens(tiny_model_factory) -> None:
    for kind in ("llama", "llama_tied", "qwen2", "llama3"):
        model_dir = tiny_model_factory(kind)
        tokenizer = load_tokenizer(model_dir)
        assert len(tokenizer) == load_config(model_dir)["vocab_size"]
        prompt = encode_chat(tokenizer, FRANCE)
        out = hf_greedy(model_dir, prompt, max_new_tokens=16, ignore_eos=True)
        assert len(out) == 16
        assert len(set(out)) >= 8, (kind, out)  # random weights must not loop on one token


@pytest.mark.timeout(120)
def test_tiny_llama3_rope_scaling_changes_logits(tiny_llama_dir: Path, tiny_llama3_dir: Path):
    # Same seed and dims: identical weights, so only the rope scaling differs.
    plain, scaled = load_weights(tiny_llama_dir), load_weights(tiny_llama3_dir)
    assert all(torch.equal(plain[name], scaled[name]) for name in plain)
    assert load_config(tiny_llama3_dir)["rope_parameters"]["rope_type"] == "llama3"

    ids = torch.arange(100, 164).unsqueeze(0)
    with torch.inference_mode():
        a = load_hf_model(str(tiny_llama_dir))(ids).logits[0]
        b = load_hf_model(str(tiny_llama3_dir))(ids).logits[0]
    assert torch.allclose(a[0], b[0], atol=1e-5)  # position 0: rotation by angle 0 either way
    assert (a[-1] - b[-1]).abs().max() > 0.1


@pytest.mark.timeout(60)
def test_sharded_checkpoint_loads_and_missing_shard_is_reported(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    weights = load_weights(tiny_llama_dir)
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", sharded)
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(sharded / file))
        weight_map |= dict.fromkeys(shard_names, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    loaded = load_weights(sharded)
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[n], weights[n]) for n in names)

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing.*model-00002-of-00002"):
        load_weights(sharded)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncate_half", "truncate_to_4_bytes", "garble_header"])
def test_corrupt_weights_raise_model_load_error(
    tiny_llama_dir: Path, tmp_path: Path, damage: str
) -> None:
    model_dir = _copy_model_dir(tiny_llama_dir, tmp_path / "model")
    weight_file = model_dir / "model.safetensors"
    size = weight_file.stat().st_size
    if damage == "truncate_half":
        os.truncate(weight_file, size // 2)
    elif damage == "truncate_to_4_bytes":
        os.truncate(weight_file, 4)
    else:
        with open(weight_file, "r+b") as f:
            f.seek(16)
            f.write(b"\xff\xfe not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_weights(model_dir)


def test_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(str(missing))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_weights(missing)


def test_bad_model_dirs_raise_clear_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(empty))

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        resolve_model(str(no_weights))

    bad_config = _copy_model_dir(tiny_llama_dir, tmp_path / "bad_config")
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_config(bad_config)

    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(not_gguf))


def test_eos_ids_merge_generation_config_and_tokenizer(tiny_llama_dir: Path, tmp_path: Path):
    model_dir = _copy_model_dir(tiny_llama_dir, tmp_path / "model")
    tokenizer = load_tokenizer(model_dir)
    assert eos_token_ids(model_dir, tokenizer) == (2,)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert eos_token_ids(model_dir, tokenizer) == (7, 2, 9)
    (model_dir / "generation_config.json").unlink()
    assert eos_token_ids(model_dir, tokenizer) == (2,)  # config.json's, then the tokenizer's


def test_eos_id_read_from_the_files_is_the_loaded_tokenizers(
    tiny_llama_dir: Path, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pd.model import tokenizer as tokenizer_module

    loads: list[Path] = []
    real_load = tokenizer_module.load_tokenizer
    monkeypatch.setattr(
        tokenizer_module, "load_tokenizer", lambda m: loads.append(Path(m)) or real_load(m)
    )
    for model_dir in (tiny_llama_dir, smollm2_dir):  # read from the files, no tokenizer loaded
        assert tokenizer_eos_id(model_dir) == real_load(model_dir).eos_token_id == 2
        assert eos_token_ids(model_dir) == eos_token_ids(model_dir, real_load(model_dir))
    assert loads == []

    # otherwise the tokenizer decides, loaded
    odd = _copy_model_dir(tiny_llama_dir, tmp_path / "odd")
    config_path = odd / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    config_path.write_text(json.dumps(config))
    assert tokenizer_eos_id(odd) == real_load(odd).eos_token_id == 0 and loads == []
    (odd / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    assert tokenizer_eos_id(odd) == real_load(odd).eos_token_id and loads == [odd]
    (odd / "special_tokens_map.json").unlink()
    config["eos_token"] = "not-a-token-of-this-vocabulary"
    config_path.write_text(json.dumps(config))
    assert tokenizer_eos_id(odd) == real_load(odd).eos_token_id and loads == [odd, odd]


def test_encode_chat_without_template_is_refused(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(tokenizer, FRANCE)


# ---- GGUF conversion mechanics (the transformers step replaced by a small writer) ----------


def _fake_writer(calls: list[Path], fail: bool = False):
    def write(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("simulated crash mid-conversion")
        save_file({"model.norm.weight": torch.ones(4)}, str(out_dir / "model.safetensors"))

    return write


def test_gguf_path_is_converted_once_into_hashed_cache_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny-Model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)))
    calls: list[Path] = []
    monkeypatch.setattr(convert, "_write_converted", _fake_writer(calls))

    model_dir = resolve_model(str(gguf))
    assert model_dir.parent == tmp_path / "cache" / "models"
    assert model_dir.name.startswith("Tiny-Model.Q8_0-") and len(model_dir.name) == 16 + 12
    assert load_weights(gguf)["model.norm.weight"].shape == (4,)  # a .gguf path loads too
    assert resolve_model(str(gguf)) == model_dir
    assert calls == [gguf]  # converted once

    gguf.write_bytes(b"GGUF" + bytes(range(255)))  # new content, new cache dir
    assert resolve_model(str(gguf)) != model_dir
    assert len(calls) == 2


def test_crashed_conversion_leaves_no_cache_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []
    monkeypatch.setattr(convert, "_write_converted", _fake_writer(calls, fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(str(gguf))
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(convert, "_write_converted", _fake_writer(calls))
    assert (resolve_model(str(gguf)) / "model.safetensors").is_file()
    assert len(calls) == 2
