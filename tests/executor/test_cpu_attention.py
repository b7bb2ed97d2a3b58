"""The CPU attention kernel (``pd.executor.cpu_attention``) against torch's math: head shapes in
bf16 and fp32, padded rows, a row without keys, a slot outside the pool, inside a compiled graph,
and behind the eager backend's decode rows; and its determinism: a row's bits are the same
padded or ragged, alone or in a batch, as a decode row or a prefill row, on any thread count,
built for AVX-512 or for AVX2."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pd.executor import cpu_attention
from pd.executor.attention import TorchAttentionBackend, _DecodeMeta, make_attention_backend
from pd.executor.config import EngineConfig

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
    ("num_kv_heads", "group", "head_dim"),
    [(3, 3, 64), (1, 8, 64), (2, 1, 128), (4, 5, 128), (2, 2, 48), (1, 12, 256)],
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
    with pytest.raises(ValueError, match=r"decode attention shapes: q \[2, 9, 64\], idx"):
        torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask[:, :4])
    with pytest.raises(
        ValueError,
        match="bf16 or fp32 alike, its KV in q.s dtype or int8, got q Float, keys BFloat16",
    ):
        torch.ops.pd.paged_decode_attention(q.float(), k_cache, v_cache, idx, mask)
    with pytest.raises(
        ValueError, match="runs on bf16 or fp32 alike, its KV in q.s dtype or int8, got q Half"
    ):
        torch.ops.pd.paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), idx, mask)
    with pytest.raises(ValueError, match=r"attention shapes: .* keys \[512, 0, 64\]"):
        no_heads = k_cache[:, :0]  # no KV head: refused, not divided by
        torch.ops.pd.paged_decode_attention(q, no_heads, no_heads, idx, mask)
    strided = k_cache.transpose(0, 1).contiguous().transpose(0, 1)  # the same shape
    with pytest.raises(ValueError, match="contiguous K/V caches"):
        torch.ops.pd.paged_decode_attention(q, strided, v_cache, idx, mask)


def test_shapes_and_dtypes_without_a_kernel_are_not_available():
    assert not cpu_attention.available(torch.float16, CPU, 9, 3, 64)
    assert cpu_attention.available(BF16, CPU, 9, 3, 96)  # any head dim ...
    assert cpu_attention.available(BF16, CPU, 27, 3, 64)  # ... and group
    assert not cpu_attention.available(BF16, CPU, 10, 3, 64)  # not a whole group
    assert not cpu_attention.available(BF16, torch.device("meta"), 9, 3, 64)


def _ragged(slots_per_req, extend_lens):
    """Ragged metadata of requests that extend by ``extend_lens`` tokens at the end of their
    ``slots_per_req``: (slots, starts, lens) of every row."""
    starts, lens, offset = [], [], 0
    for slots, n in zip(slots_per_req, extend_lens):
        starts += [offset] * n
        lens += range(len(slots) - n + 1, len(slots) + 1)
        offset += len(slots)
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return torch.cat(slots_per_req), as_long(starts), as_long(lens)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_a_row_has_the_same_bits_however_it_is_batched(dtype):
    """Prefill rows in one chunk, in chunks, in a batch with others, as decode rows one at a
    time (padded and ragged), on one thread and two: every row the same bits."""
    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, dim = 70, 9, 3, 64
    k_cache = torch.randn(300, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(300, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    slots = torch.randperm(300, generator=g)[:n]
    other = torch.randperm(300, generator=g)[:40]
    q_other = torch.randn(5, heads, dim, generator=g).to(dtype)

    def ragged(qs, slot_lists, extend_lens):
        return torch.ops.pd.paged_attention(qs, k_cache, v_cache, *_ragged(slot_lists, extend_lens))

    whole = ragged(q, [slots], [n])
    chunks = torch.cat(
        [ragged(q[i : i + 17], [slots[: i + 17]], [min(17, n - i)]) for i in range(0, n, 17)]
    )
    batched = ragged(torch.cat((q_other, q)), [other, slots], [5, n])[5:]
    decode_rows = torch.cat([ragged(q[i : i + 1], [slots[: i + 1]], [1]) for i in range(n)])
    idx = torch.stack([torch.cat((slots[: i + 1], slots.new_zeros(n - i - 1))) for i in range(n)])
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    padded = torch.ops.pd.paged_decode_attention(q, k_cache, v_cache, idx, mask)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ragged(q, [slots], [n])
    finally:
        torch.set_num_threads(before)
    for other_way in (chunks, batched, decode_rows, padded, one_thread):
        assert torch.equal(other_way, whole)
    torch.testing.assert_close(
        whole.float(),
        _reference(q, k_cache, v_cache, idx, mask),
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
    )


def test_ragged_rows_out_of_their_slots_are_refused_with_the_numbers():
    q, k_cache, v_cache, _, _ = _case(2, 3, 3, 64, 8)
    slots = torch.arange(10)
    with pytest.raises(ValueError, match=r"row 1 takes keys \[4, 12\) of 10"):
        torch.ops.pd.paged_attention(
            q, k_cache, v_cache, slots, torch.tensor([0, 4]), torch.tensor([3, 8])
        )
    with pytest.raises(IndexError, match="1 key slots outside the pool's 512"):
        torch.ops.pd.paged_attention(
            q, k_cache, v_cache, torch.tensor([0, 512]), torch.tensor([0, 0]), torch.tensor([1, 2])
        )


_OTHER_BUILD = """
import sys, torch
import pd.core.cpp as cpp
cpp.FLAGS = (*cpp.FLAGS, *sys.argv[2:])
from pd.executor import cpu_attention
assert cpu_attention.available(torch.float32, torch.device("cpu"), 9, 3, 64)
g = torch.Generator().manual_seed(0)
out = []
for dtype in (torch.float32, torch.bfloat16):
    for dim, heads, kv_heads in ((64, 9, 3), (48, 4, 2)):
        k = torch.randn(600, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(600, kv_heads, dim, generator=g).to(dtype)
        q = torch.randn(50, heads, dim, generator=g).to(dtype)
        slots = torch.randperm(600, generator=g)[:300]
        lens = torch.arange(251, 301)
        out.append(torch.ops.pd.paged_attention(q, k, v, slots, torch.zeros(50, dtype=torch.long), lens))
        # int8 KV: the quantizer's bytes, and attention over them
        k8, v8 = cpu_attention.quantize(k), cpu_attention.quantize(v)
        out += [k8, v8, torch.ops.pd.paged_attention(q, k8, v8, slots, torch.zeros(50, dtype=torch.long), lens)]
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
def test_an_avx2_build_gives_the_bits_of_this_machines_build(tmp_path):
    """Nodes on CPUs with and without AVX-512 compute the same attention (each of its steps is
    spelled out: no reduction left to the compiler's vector width), and quantize KV to int8 the
    same (bytes a node of either kind may send the other)."""
    import subprocess
    import sys

    flags = open("/proc/cpuinfo").read()
    if " avx512f " not in flags:
        pytest.skip("this CPU has no AVX-512: its build is the AVX2 one")
    outs = []
    for name, extra in (("native", []), ("avx2", ["-mno-avx512f"])):
        out = tmp_path / f"{name}.pt"
        subprocess.run(
            [sys.executable, "-c", _OTHER_BUILD, str(out), *extra], check=True, timeout=300
        )
        outs.append(torch.load(out))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


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
