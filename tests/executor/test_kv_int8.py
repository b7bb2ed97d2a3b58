"""int8 KV (``--kv-cache-dtype int8``): the quantizer's bytes against a torch reference and
independent of the batch; pd's attention kernel over int8 rows against fp32 math over their
dequantized values, a row's bits the same however it is batched; the pool's layout and bytes; the
flag's refusals and the pool's default size in bytes."""

from __future__ import annotations

import pytest
import torch

from pd.core.kv_pool import KV_SCALE_BYTES, KVPool
from pd.executor import cpu_attention
from pd.executor.config import DEFAULT_KV_TOKENS, EngineConfig
from pd.executor.host_pool import HostKVPool

CPU = torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(FP32, CPU, 9, 3, 64), reason="no C++ compiler to build the kernel"
)


def _reference_quantize(x: torch.Tensor) -> torch.Tensor:
    """The quantizer's contract in torch: per row, scale = absmax / 127, code =
    round-half-even(x * (127 / absmax)), then the scale's 4 bytes."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    # a tensor over a tensor: torch's ``127.0 / t`` multiplies by a reciprocal (two roundings)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
    codes = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    scale = (absmax / 127.0).view(torch.int8)  # [..., 4] bytes
    return torch.cat((codes, scale), dim=-1)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_the_quantizer_gives_the_references_bytes_row_by_row(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3, 64, generator=g) * torch.rand(37, 3, 1, generator=g) * 9).to(dtype)
    x[5, 1] = 0  # a row of zeros: codes and scale 0
    x[6, 0, 7] = float(x[6, 0].abs().max()) * -1.5  # the absmax is negative: code -127
    rows = cpu_attention.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (37, 3, 64 + KV_SCALE_BYTES)
    assert torch.equal(rows, _reference_quantize(x))
    assert not rows[5, 1].any() and int(rows[6, 0, 7]) == -127
    # each token alone, or in another batch: the same bytes (a row depends on itself alone)
    alone = torch.cat([cpu_attention.quantize(x[i : i + 1]) for i in range(37)])
    assert torch.equal(alone, rows)
    back = cpu_attention.dequantize(rows)
    err = (back - x.float()).abs().amax(-1)
    assert torch.all(err <= x.float().abs().amax(-1) / 254 * 1.0001)  # half a step


def _int8_case(num_slots: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, kv_heads, dim, generator=g)
    v = torch.randn(num_slots, kv_heads, dim, generator=g)
    return cpu_attention.quantize(k), cpu_attention.quantize(v)


def _reference(q, k_rows, v_rows, slots, lens):
    """fp32 softmax attention of row t over the dequantized keys slots[:lens[t]]."""
    keys, values = cpu_attention.dequantize(k_rows), cpu_attention.dequantize(v_rows)
    group = q.shape[1] // keys.shape[1]
    out = []
    for t in range(q.shape[0]):
        idx = slots[: lens[t]]
        kk = keys[idx].repeat_interleave(group, 1)  # [L, H, D]
        vv = values[idx].repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[t].float(), kk) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv))
    return torch.stack(out)


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (2, 2, 48), (1, 4, 128)])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_the_kernel_reads_int8_rows_like_fp32_math_over_their_values(kv_heads, group, dim, dtype):
    k_rows, v_rows = _int8_case(300, kv_heads, dim, seed=1)
    g = torch.Generator().manual_seed(2)
    n = 70
    q = torch.randn(n, kv_heads * group, dim, generator=g).to(dtype)
    slots = torch.randperm(300, generator=g)[:n]
    lens = torch.arange(1, n + 1)
    out = torch.ops.pd.paged_attention(
        q, k_rows, v_rows, slots, torch.zeros(n, dtype=torch.long), lens
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = 2e-2 if dtype == BF16 else 1e-5
    torch.testing.assert_close(
        out.float(), _reference(q, k_rows, v_rows, slots, lens), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_an_int8_row_has_the_same_bits_however_it_is_batched(dtype):
    """One chunk, chunks of 17, beside another request, decode rows one at a time, padded
    decode rows, one thread: every row the same bits over the same int8 pool."""
    k_rows, v_rows = _int8_case(300, 3, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    n = 70
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    slots = torch.randperm(300, generator=g)[:n]
    other = torch.randperm(300, generator=g)[:40]
    q_other = torch.randn(5, 9, 64, generator=g).to(dtype)

    def ragged(qs, slot_lists, extend_lens):
        flat, starts, lens, off = [], [], [], 0
        for s, e in zip(slot_lists, extend_lens):
            flat.append(s)
            starts += [off] * e
            lens += range(len(s) - e + 1, len(s) + 1)
            off += len(s)
        meta = (torch.cat(flat), torch.tensor(starts), torch.tensor(lens))
        return torch.ops.pd.paged_attention(qs, k_rows, v_rows, *meta)

    whole = ragged(q, [slots], [n])
    chunks = torch.cat(
        [ragged(q[i : i + 17], [slots[: i + 17]], [min(17, n - i)]) for i in range(0, n, 17)]
    )
    batched = ragged(torch.cat((q_other, q)), [other, slots], [5, n])[5:]
    decode_rows = torch.cat([ragged(q[i : i + 1], [slots[: i + 1]], [1]) for i in range(n)])
    idx = torch.stack([torch.cat((slots[: i + 1], slots.new_zeros(n - i - 1))) for i in range(n)])
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    padded = torch.ops.pd.paged_decode_attention(q, k_rows, v_rows, idx, mask)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ragged(q, [slots], [n])
    finally:
        torch.set_num_threads(before)
    for other_way in (chunks, batched, decode_rows, padded, one_thread):
        assert torch.equal(other_way, whole)


def test_int8_rows_of_the_wrong_width_are_refused_with_the_numbers():
    k_rows, v_rows = _int8_case(16, 3, 64, seed=5)
    q = torch.randn(2, 9, 64)
    slots, starts, lens = torch.arange(4), torch.zeros(2, dtype=torch.long), torch.tensor([3, 4])
    with pytest.raises(ValueError, match=r"keys \[16, 3, 64\].*int8 rows: head dim \+ 4"):
        torch.ops.pd.paged_attention(q, k_rows[..., :64], v_rows[..., :64], slots, starts, lens)
    with pytest.raises(
        ValueError, match="its KV in q's dtype or int8, got q Float, keys Char, values Float"
    ):
        torch.ops.pd.paged_attention(q, k_rows, v_rows.float(), slots, starts, lens)
    with pytest.raises(ValueError, match=r"kv_quantize takes .* fp32 or bf16, got \[2, 64\]"):
        cpu_attention.quantize(torch.randn(2, 64))


def test_an_int8_pool_holds_codes_and_scales_and_its_tier_carries_their_bytes():
    pool = KVPool(2, 16, 3, 64, FP32, quantize=cpu_attention.quantize)
    assert pool.is_quantized and pool.dtype == torch.int8 and pool.compute_dtype == FP32
    assert pool.k[0].shape == (16, 3, 68) and pool.kv_format == "int8/float32"
    assert pool.num_bytes_per_token == 2 * 2 * 3 * 68  # vs 2 * 2 * 3 * 64 * 4 in fp32
    assert KVPool(2, 16, 3, 64, FP32).num_bytes_per_token == 2 * 2 * 3 * 256
    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    slots = torch.tensor([3, 9, 1, 0, 15])
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], _reference_quantize(k))
    assert torch.equal(pool.v[1][slots], _reference_quantize(v))
    host = HostKVPool(pool, 8)
    host.save([3, 9, 1], [0, 1, 2])
    payload = host.host_bytes([0, 1, 2])
    assert len(payload) == 3 * pool.num_bytes_per_token
    pool.k[1].zero_()
    pool.v[1].zero_()
    host.load_bytes(memoryview(payload), 0, [4, 5, 6])  # e.g. a disk chunk's bytes
    assert torch.equal(pool.k[1][[4, 5, 6]], _reference_quantize(k[:3]))
    assert torch.equal(pool.v[1][[4, 5, 6]], _reference_quantize(v[:3]))


def test_the_flag_refuses_what_cannot_hold_or_read_int8_kv_and_sizes_pools_in_bytes():
    for fp8 in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype {fp8} is reserved for a CUDA"):
            EngineConfig(kv_cache_dtype=fp8)
    with pytest.raises(ValueError, match="runs on a cpu; device is cuda"):
        EngineConfig(kv_cache_dtype="int8", device="cuda")
    with pytest.raises(ValueError, match="attention backend auto\\), not by 'torch'"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="torch")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    # the default pool: DEFAULT_KV_TOKENS tokens' bytes of the model's dtype
    assert EngineConfig().pool_slots(64) == DEFAULT_KV_TOKENS
    fp32 = EngineConfig(kv_cache_dtype="int8").pool_slots(64)
    bf16 = EngineConfig(kv_cache_dtype="int8", dtype="bfloat16").pool_slots(64)
    assert fp32 == DEFAULT_KV_TOKENS * 256 // 68 and bf16 == DEFAULT_KV_TOKENS * 128 // 68
    assert EngineConfig(kv_cache_dtype="int8", max_total_tokens=100).pool_slots(64) == 100
