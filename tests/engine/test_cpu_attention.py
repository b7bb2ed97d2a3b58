"""The CPU decode attention kernel (``pd.engine.cpu_attention``) against torch's math: every
head shape it takes in bf16 and fp32, padded rows, a row without keys, a slot outside the pool, inside a
compiled graph, and behind the eager backend's decode rows."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pd.engine import cpu_attention
from pd.engine.attention import TorchAttentionBackend, _DecodeMeta, make_attention_backend
from pd.engine.config import EngineConfig

CPU = torch.device("cpu")
BF16 = torch.bfloat16
FP32 = torch.float32
# how close each dtype's output is to fp32 math over the same inputs
TOLERANCE = {BF16: 2e-2, FP32: 1e-5}

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(BF16, CPU, 9, 3, 64), reason="no C++ compiler to build the kernel"
)


def _reference(q, k_cache, v_cache, idx, mask):
    """fp32 softmax attention of each row over its masked keys (zeros for a row without)."""
    b, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    keys = k_cache.float()[idx].repeat_interleave(group, dim=2)  # [B, L, H, D]
    values = v_cache.float()[idx].repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * head_dim**-0.5
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhl,blhd->bhd", probs, values)


def _case(batch, num_kv_heads, group, head_dim, length, num_slots=512, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    idx = torch.randint(0, num_slots, (batch, length), generator=g)
    lens = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lens[:, None]
    return q, k_cache, v_cache, idx, mask


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 64), (2, 1, 128), (4, 5, 128)]
)
@pytest.mark.parametrize("length", [1, 37, 700])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_the_kernel_matches_fp32_attention(num_kv_heads, group, head_dim, length, dtype):
    case = _case(5, num_kv_heads, group, head_dim, length, dtype=dtype)
    assert cpu_attention.available(dtype, CPU, num_kv_heads * group, num_kv_heads, head_dim)
    out = torch.ops.pd.paged_decode_attention(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _reference(*case), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_one_thread_and_many_give_the_same_result(dtype):
    # 4 x 3 x 900 key rows: above the threshold for threads
    case = _case(4, 3, 3, 64, 900, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many = torch.ops.pd.paged_decode_attention(*case)
        torch.set_num_threads(1)
        one = torch.ops.pd.paged_decode_attention(*case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_a_row_without_keys_gives_zeros_and_others_are_unharmed(dtype):
    q, k_cache, v_cache, idx, mask = _case(3, 3, 3, 64, 20, dtype=dtype)
    mask[1] = False
    out = torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), _reference(q, k_cache, v_cache, idx, mask), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_a_slot_outside_the_pool_raises_with_the_numbers(dtype):
    q, k_cache, v_cache, idx, mask = _case(2, 3, 3, 64, 8, num_slots=64, dtype=dtype)
    idx[1, 2], mask[1, :3] = 64, True
    with pytest.raises(IndexError, match="1 key slots outside the pool's 64"):
        torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask)
    mask[1, 2] = False  # a masked key is never read: no error
    torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask)


def test_shapes_and_dtypes_off_the_kernel_raise_with_the_numbers():
    q, k_cache, v_cache, idx, mask = _case(2, 3, 3, 64, 8)
    with pytest.raises(ValueError, match=r"decode attention shapes: q \[2, 9, 64\], keys"):
        torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask[:, :4])
    with pytest.raises(ValueError, match="runs on bf16 or fp32 alike, got q Float, keys BFloat16"):
        torch.ops.pd.paged_decode_attention(q.float(), k_cache, v_cache, idx, mask)
    with pytest.raises(ValueError, match="runs on bf16 or fp32 alike, got q Half"):
        torch.ops.pd.paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), idx, mask)
    with pytest.raises(ValueError, match=r"decode attention shapes: .* keys \[512, 0, 64\]"):
        no_heads = k_cache[:, :0]  # no KV head: refused, not divided by
        torch.ops.pd.paged_decode_attention(q, no_heads, no_heads, idx, mask)
    strided = k_cache.transpose(0, 1).contiguous().transpose(0, 1)  # the same shape
    with pytest.raises(ValueError, match="contiguous K/V caches"):
        torch.ops.pd.paged_decode_attention(q, strided, v_cache, idx, mask)


def test_shapes_and_dtypes_without_a_kernel_are_not_available():
    assert not cpu_attention.available(torch.float16, CPU, 9, 3, 64)
    assert not cpu_attention.available(BF16, CPU, 9, 3, 96)  # head dim
    assert not cpu_attention.available(BF16, CPU, 27, 3, 64)  # 9 query heads a KV head
    assert not cpu_attention.available(BF16, CPU, 10, 3, 64)  # not a whole group
    assert not cpu_attention.available(BF16, torch.device("meta"), 9, 3, 64)


@pytest.mark.slow
def test_the_op_inside_a_compiled_graph_matches_the_eager_call():
    case = _case(4, 3, 3, 64, 50)

    def step(q, k_cache, v_cache, idx, mask):
        return torch.ops.pd.paged_decode_attention(q * 2, k_cache, v_cache, idx, mask) + 1

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(*case), step(*case))


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_the_eager_backend_runs_decode_rows_on_the_kernel_like_sdpa(dtype):
    q, k_cache, v_cache, idx, mask = _case(4, 3, 3, 64, 30, seed=3, dtype=dtype)
    tol = TOLERANCE[dtype]

    class Pool:
        k, v = [k_cache], [v_cache]

    backend = TorchAttentionBackend()
    out = backend._decode(q, 0, Pool, _DecodeMeta(idx, mask))  # type: ignore[arg-type]
    assert backend._kernel is True
    keys = k_cache[idx].transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache[idx].transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(
        q[:, :, None].float(),
        keys.float(),
        values.float(),
        attn_mask=mask[:, None, None, :],
        enable_gqa=True,
    )[:, :, 0]
    torch.testing.assert_close(out.float(), sdpa, atol=tol, rtol=tol)
    full = backend._decode(q, 0, Pool, _DecodeMeta(idx, None))  # no padding: no mask
    torch.testing.assert_close(
        full.float(),
        _reference(q, k_cache, v_cache, idx, torch.ones_like(mask)),
        atol=tol,
        rtol=tol,
    )


def test_the_torch_backend_never_calls_the_kernel_and_unknown_backends_are_refused():
    q, k_cache, v_cache, idx, mask = _case(2, 3, 3, 64, 10)

    class Pool:
        k, v = [k_cache], [v_cache]

    backend = make_attention_backend("torch", CPU)
    backend._decode(q, 0, Pool, _DecodeMeta(idx, mask))  # type: ignore[attr-defined]
    assert backend._kernel is False  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="attention_backend must be auto or torch, got 'cpp'"):
        EngineConfig(attention_backend="cpp")


def test_without_a_compiler_the_kernel_is_unavailable_and_torch_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    # a fresh look for the library (the process has loaded it already)
    monkeypatch.setattr(
        cpu_attention, "_library", functools.cache(cpu_attention._library.__wrapped__)
    )
    assert not cpu_attention.available(BF16, CPU, 9, 3, 64)
    q, k_cache, v_cache, idx, mask = _case(2, 3, 3, 64, 10)

    class Pool:
        k, v = [k_cache], [v_cache]

    backend = TorchAttentionBackend()
    out = backend._decode(q, 0, Pool, _DecodeMeta(idx, mask))  # type: ignore[arg-type]
    assert backend._kernel is False
    torch.testing.assert_close(
        out.float(), _reference(q, k_cache, v_cache, idx, mask), atol=2e-2, rtol=2e-2
    )
