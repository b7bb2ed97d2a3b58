"""Prefill and extend rows attending in another dtype than the model's (long chunks of int4 and
int8 weights in an fp32 model attend in bf16 on a CPU with oneDNN's bf16 path, in fp32 on an
AVX2-only one): the output stays in the model's dtype
and near its own attention, cached prefixes included; shorter chunks attend as before; the
quantized runner picks bf16 from ``DEQUANT_MIN_TOKENS`` on, others none; all of it only where
the runner is not deterministic (``--no-deterministic``)."""

from __future__ import annotations

import pytest
import torch

from pd.core.batch import ForwardBatch, SeqInput
from pd.core.kv_pool import KVPool
from pd.executor.attention import KernelAttentionBackend, TorchAttentionBackend
from pd.executor.config import EngineConfig
from pd.executor.runner import ModelRunner
from pd.model import quant
from pd.model.quant import DEQUANT_MIN_TOKENS

HEADS, KV_HEADS, DIM = 6, 2, 32
# long quantized chunks attend in bf16 where oneDNN has its bf16 path (not on an AVX2-only cpu)
QUANTIZED_LONG_CHUNKS = torch.bfloat16 if quant.onednn_has_bf16() else None


def _attend(backend: TorchAttentionBackend, pool: KVPool, seqs: list[SeqInput], seed: int):
    batch = ForwardBatch.build(seqs)
    rows = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch, pool)


def test_bf16_extend_rows_stay_fp32_and_near_fp32_attention_with_and_without_a_prefix():
    pools = [KVPool(1, 256, KV_HEADS, DIM) for _ in range(2)]
    backends = [TorchAttentionBackend(), TorchAttentionBackend(extend_dtype=torch.bfloat16)]
    short = TorchAttentionBackend(extend_dtype=torch.bfloat16, extend_min_tokens=41)
    cold = [SeqInput(list(range(40)), list(range(40)), 0), SeqInput([5] * 9, range(40, 49), 0)]
    # then extends over what the first step cached: a short prefix (padded causal) and a long
    # one (an explicit mask)
    warm = [SeqInput([7] * 30, list(range(3)) + list(range(60, 90)), 3),
            SeqInput([8] * 6, list(range(40)) + list(range(100, 106)), 40)]  # fmt: skip
    for step, seqs in enumerate((cold, warm)):
        ref, out = (_attend(b, p, seqs, seed=step) for b, p in zip(backends, pools))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        assert not torch.equal(out, ref)  # it did attend in bf16
        if step == 0:  # 40 and 9 new tokens, under 41: both attend in fp32
            assert torch.equal(_attend(short, pools[1], seqs, seed=step), ref)
    torch.testing.assert_close(pools[1].k[0], pools[0].k[0], atol=0, rtol=0)  # fp32 KV kept


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"quantization": "int4"}, QUANTIZED_LONG_CHUNKS),
        ({"quantization": "int8"}, QUANTIZED_LONG_CHUNKS),
        ({}, None),
        ({"quantization": "fp16"}, None),
        ({"dtype": "bfloat16"}, None),
        ({"quantization": "int4", "deterministic": True}, None),
    ],
)
def test_quantized_fp32_runners_prefill_in_bf16(tiny_llama_dir, kw, expected):
    kw = {"deterministic": False, **kw}
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=256, **kw))
    assert runner.extend_attention_dtype == expected
    if kw["deterministic"]:  # the C++ kernel attends every row in fp32, in a fixed order
        assert isinstance(runner.attn, KernelAttentionBackend)
        return
    assert runner.attn.extend_dtype == expected  # type: ignore[attr-defined]
    assert runner.attn.extend_min_tokens == DEQUANT_MIN_TOKENS  # type: ignore[attr-defined]


@pytest.mark.parametrize("has_bf16", [True, False])
def test_without_onednns_bf16_path_int4_prefills_in_fp32(tiny_llama_dir, monkeypatch, has_bf16):
    # an AVX2-only cpu: bf16 GEMMs and SDPA are slower than fp32's there, so int4's dense copy
    # holds the kernel's weights in fp32 and long chunks attend in fp32
    monkeypatch.setattr(quant, "onednn_has_bf16", lambda: has_bf16)
    cfg = EngineConfig(
        model=str(tiny_llama_dir), max_total_tokens=256, quantization="int4", deterministic=False
    )
    runner = ModelRunner(cfg)
    want = torch.bfloat16 if has_bf16 else torch.float32
    layer = runner.model.model.layers[0].mlp.down_proj
    assert layer.dense.dtype == want  # type: ignore[union-attr]
    assert runner.extend_attention_dtype == (torch.bfloat16 if has_bf16 else None)
    x = torch.randn(DEQUANT_MIN_TOKENS, layer.in_features)
    assert layer(x).dtype == torch.float32
    # the same weights either way: bf16-rounded values of the kernel's dequantization
    assert torch.equal(layer.dense.float(), layer.dense.bfloat16().float())  # type: ignore
