// cpu_attention: built by pd.core.cpp.load_torch_ops from cpu_attention.py (see its docstring).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float to_float(uint16_t x) {  // bf16 -> fp32: the high half of the bits
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline float to_float(float x) { return x; }

// int8 KV (--kv-cache-dtype int8): each row of a head (one token's K or V of one KV head) is D
// int8 codes then its fp32 scale, kScaleBytes more bytes: the row's value d is code[d] * scale,
// one rounding, the same in every lane and every build.
static constexpr int64_t kScaleBytes = 4;
static inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// exp(x) for x <= 0 (a score minus the row's best), vectorizable: 2^n * 2^f with f in
// [-0.5, 0.5] and a degree-6 polynomial for 2^f (relative error < 2e-7); 0 below -87 and
// for -inf (a key that is not there). Every step is spelled out (fma, not a * b + c left to the
// compiler), so each value is the same on every x86 CPU.
static inline float exp_nonpositive(float x) {
  const bool tiny = !(x > -87.0f);
  const float t = (tiny ? -87.0f : x) * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, step for step the same arithmetic.
static inline __m512 exp16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  const __m512 t =
      _mm512_mul_ps(_mm512_mask_blend_ps(ok, _mm512_set1_ps(-87.0f), x),
                    _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(bits));
}
#endif

// e[l] = exp_nonpositive(x[l] - top) for l < n.
static inline void exp_row(float* x, int64_t n, float top) {
  int64_t l = 0;
#if defined(__AVX512F__)
  for (; l + 16 <= n; l += 16)
    _mm512_storeu_ps(x + l, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + l), _mm512_set1_ps(top))));
#endif
  for (; l < n; ++l) x[l] = exp_nonpositive(x[l] - top);
}

// Keys go through the scores in blocks of kLanes, one lane each; query rows of one request in
// tasks of up to kRows, sharing each block of keys.
static constexpr int64_t kLanes = 16;
static constexpr int64_t kRows = 16;

// Sums in a fixed order: kLanes lanes by index mod kLanes, then halves added pairwise. x holds
// n16 values (a multiple of kLanes). Zeros anywhere leave the sum as it is, so a row padded
// with masked keys sums to the very bits of the row without them.
static inline float lane_sum(const float* x, int64_t n16) {
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < n16; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += x[i + j];
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

// What every task reads: the caches and the heads' shape (R: a head's row in the caches, in
// elements: D, or D + kScaleBytes for int8 codes and their scale).
template <typename T>
struct Heads {
  const T* kc;
  const T* vc;
  int64_t KVH, S, G, D, R;
  float scale;
  float softcap;  // > 0: scores -> tanh(s / softcap) * softcap
  int64_t window;  // > 0: a row sees its last this many keys only
};

// A block of query rows that share their keys: rows [r0, r1), the keys slots[0, n_r) of each
// (n_r = lens[r - r0], non-decreasing), ``mask``: skip where 0 (may be null).
struct Block {
  int64_t r0, r1;
  const int64_t* slots;
  const uint8_t* mask;
  const int64_t* lens;
};

// Whether each of keys l0 .. l0 + kLanes - 1 is there (inside the rows' keys, not masked, its
// slot inside the pool), and the element offset of its row of KV head h.
template <typename T>
static inline void block_rows(const Heads<T>& a, const Block& b, int64_t h, int64_t l0,
                              int64_t n, int64_t* offsets, uint8_t* valid) {
  for (int64_t j = 0; j < kLanes; ++j) {
    const int64_t l = l0 + j;
    const int64_t slot = l < n ? b.slots[l] : -1;
    valid[j] = l < n && (b.mask == nullptr || b.mask[l]) && slot >= 0 && slot < a.S;
    offsets[j] = valid[j] ? (slot * a.KVH + h) * a.R : 0;
  }
}

#if defined(__AVX512F__)
// r[0 .. 16) (rows) -> columns, in place: r[d] lane j = old r[j] lane d.
static inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// 16 int8 codes times their row's scale
static inline __m512 load16(const int8_t* p, float scale) {
  const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  return _mm512_mul_ps(c, _mm512_set1_ps(scale));
}
#endif

// The int8 rows of a block's keys as fp32 columns, like load_keys: code times the row's scale.
static inline void load_keys(const Heads<int8_t>& a, const int64_t* offsets, const uint8_t* valid,
                             float* kt) {
  const int64_t D = a.D;
  float scales[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) scales[j] = valid[j] ? row_scale(a.kc + offsets[j], D) : 0;
  int64_t d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 16 <= D; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = valid[j] ? load16(a.kc + offsets[j] + d0, scales[j]) : _mm512_setzero_ps();
    transpose16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (d0 + d) * kLanes, r[d]);
  }
#endif
  for (int64_t j = 0; j < kLanes; ++j) {
    const int8_t* src = a.kc + offsets[j];
    for (int64_t d = d0; d < D; ++d)
      kt[d * kLanes + j] = valid[j] ? static_cast<float>(src[d]) * scales[j] : 0.0f;
  }
}

// The int8 rows of a block's values as fp32 rows, like load_values.
static inline void load_values(const Heads<int8_t>& a, const int64_t* offsets,
                               const uint8_t* valid, float* vt) {
  const int64_t D = a.D;
  for (int64_t j = 0; j < kLanes; ++j) {
    const int8_t* src = a.vc + offsets[j];
    float* vr = vt + j * D;
    if (!valid[j]) {
      std::fill(vr, vr + D, 0.0f);
      continue;
    }
    const float scale = row_scale(src, D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = static_cast<float>(src[d]) * scale;
  }
}

// The keys of one block as fp32 columns: kt[d * kLanes + j] = key j, dim d (0 for a key that is
// not there). With AVX-512, 16 dims of the 16 rows at a time, transposed in registers.
template <typename T>
static inline void load_keys(const Heads<T>& a, const int64_t* offsets, const uint8_t* valid,
                             float* kt) {
  const int64_t D = a.D;
  int64_t d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 16 <= D; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = valid[j] ? load16(a.kc + offsets[j] + d0) : _mm512_setzero_ps();
    transpose16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (d0 + d) * kLanes, r[d]);
  }
#endif
  for (int64_t j = 0; j < kLanes; ++j) {
    const T* src = a.kc + offsets[j];
    for (int64_t d = d0; d < D; ++d) kt[d * kLanes + j] = valid[j] ? to_float(src[d]) : 0.0f;
  }
}

// The values of one block as fp32 rows: vt[j * D + d] (0 for a key that is not there).
template <typename T>
static inline void load_values(const Heads<T>& a, const int64_t* offsets, const uint8_t* valid,
                               float* vt) {
  const int64_t D = a.D;
  for (int64_t j = 0; j < kLanes; ++j) {
    const T* src = a.vc + offsets[j];
    float* vr = vt + j * D;
    if (!valid[j]) {
      std::fill(vr, vr + D, 0.0f);
      continue;
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = to_float(src[d]);
  }
}

// The scores of query heads qs[0 .. m) (m <= 4, each of D) against one block of keys:
// s[i * kLanes + j] = fma(q[D-1], k_j[D-1], ... fma(q[0], k_j[0], 0)). Up to four chains side
// by side, so that the fma's latency overlaps.
static inline void block_scores(const float* const* qs, int64_t m, const float* kt, int64_t D,
                                float* s) {
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * kLanes);
    s0 = _mm512_fmadd_ps(_mm512_set1_ps(qs[0][d]), k, s0);
    if (m > 1) s1 = _mm512_fmadd_ps(_mm512_set1_ps(qs[1][d]), k, s1);
    if (m > 2) s2 = _mm512_fmadd_ps(_mm512_set1_ps(qs[2][d]), k, s2);
    if (m > 3) s3 = _mm512_fmadd_ps(_mm512_set1_ps(qs[3][d]), k, s3);
  }
  _mm512_storeu_ps(s, s0);
  if (m > 1) _mm512_storeu_ps(s + kLanes, s1);
  if (m > 2) _mm512_storeu_ps(s + 2 * kLanes, s2);
  if (m > 3) _mm512_storeu_ps(s + 3 * kLanes, s3);
#else
  for (int64_t i = 0; i < m; ++i) {
    float acc[kLanes] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float x = qs[i][d];
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = std::fma(x, kt[d * kLanes + j], acc[j]);
    }
    for (int64_t j = 0; j < kLanes; ++j) s[i * kLanes + j] = acc[j];
  }
#endif
}

// For each of up to four heads i < m: acc_i[d] = fma(p_i[j], vt[j * D + d], acc_i[d]) over the
// keys j < nk_i in order (``use[j]``: skip where 0); one value row load for all four.
static inline void block_values(float* const* accs, const float* const* ps, const int64_t* nks,
                                int64_t m, const uint8_t* use, const float* vt, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  // every p is 0 past its row's keys and every value row 0 where there is no key: adding
  // fma(0, 0, a) = a leaves the sums as skipping does, so no test in the loop
  for (; d + 16 <= D; d += 16) {
    __m512 a0 = _mm512_loadu_ps(accs[0] + d), a1 = a0, a2 = a0, a3 = a0;
    if (m > 1) a1 = _mm512_loadu_ps(accs[1] + d);
    if (m > 2) a2 = _mm512_loadu_ps(accs[2] + d);
    if (m > 3) a3 = _mm512_loadu_ps(accs[3] + d);
    for (int64_t j = 0; j < kLanes; ++j) {
      const __m512 v = _mm512_loadu_ps(vt + j * D + d);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(ps[0][j]), v, a0);
      if (m > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(ps[1][j]), v, a1);
      if (m > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(ps[2][j]), v, a2);
      if (m > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(ps[3][j]), v, a3);
    }
    _mm512_storeu_ps(accs[0] + d, a0);
    if (m > 1) _mm512_storeu_ps(accs[1] + d, a1);
    if (m > 2) _mm512_storeu_ps(accs[2] + d, a2);
    if (m > 3) _mm512_storeu_ps(accs[3] + d, a3);
  }
#endif
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < nks[i]; ++j) {
      if (!use[j]) continue;
      const float w = ps[i][j];
      const float* v = vt + j * D;
      float* acc = accs[i];
#pragma omp simd
      for (int64_t e = d; e < D; ++e) acc[e] = std::fma(w, v[e], acc[e]);
    }
}

// One block's G query heads of KV head h. The arithmetic of one query row depends on its
// query and its keys alone, in their order: each score a chain of fma over the head dim, the
// best score, exp, lane_sum, then the values weighted in key order by fma. So a row gives the
// same bits alone or in any batch or block, padded or not, as a decode row or a prefill row, on
// any thread and any x86 CPU. Returns the number of slots outside [0, S) that a row should have
// read.
template <typename T, typename KV>
static int64_t attend(const Heads<KV>& a, const T* q, const Block& b, int64_t h, float* out,
                      std::vector<float>& buf) {
  const int64_t D = a.D, G = a.G, KVH = a.KVH, H = KVH * G, R = b.r1 - b.r0, RG = R * G;
  const int64_t n_max = b.lens[R - 1];
  const int64_t n16 = (n_max + kLanes - 1) / kLanes * kLanes;
  const float lowest = -std::numeric_limits<float>::infinity();
  buf.resize(RG * (n16 + 2 * D + 2) + 2 * D * kLanes + n16 + 4 * kLanes);
  int64_t offsets[kLanes];
  float* scores = buf.data();  // [RG, n16]
  float* qf = scores + RG * n16;  // [RG, D]
  float* acc = qf + RG * D;  // [RG, D]
  float* sums = acc + RG * D;  // [RG]: the softmax's denominators
  float* tops = sums + RG;  // [RG]: the best scores
  float* kt = tops + RG;  // [D, kLanes]
  float* vt = kt + D * kLanes;  // [kLanes, D]
  float* s4 = vt + D * kLanes;  // [4, kLanes]
  auto* valid = reinterpret_cast<uint8_t*>(s4 + 4 * kLanes);  // [n16]
  for (int64_t i = 0; i < RG; ++i) {
    const T* qr = q + ((b.r0 + i / G) * H + h * G + i % G) * D;
    for (int64_t d = 0; d < D; ++d) {
      qf[i * D + d] = to_float(qr[d]) * a.scale;
      acc[i * D + d] = 0.0f;
    }
    tops[i] = lowest;
  }
  // a row sees keys [lo, n): lo > 0 in a sliding window; the block's first row has the
  // smallest n, so the smallest lo; the passes start at its block of keys
  auto lo_of = [&](int64_t n) { return a.window > 0 && n > a.window ? n - a.window : 0; };
  const int64_t start = lo_of(b.lens[0]) / kLanes * kLanes;
  // pass 1: the scores, kLanes keys at a time
  for (int64_t l0 = start; l0 < n_max; l0 += kLanes) {
    block_rows(a, b, h, l0, n_max, offsets, valid + l0);
    if (l0 + kLanes < n_max)  // the next block's first rows
      for (int64_t j = 0; j < 4 && l0 + kLanes + j < n_max; ++j) {
        const int64_t slot = b.slots[l0 + kLanes + j];
        if (slot >= 0 && slot < a.S) __builtin_prefetch(a.kc + (slot * KVH + h) * a.R);
      }
    load_keys(a, offsets, valid + l0, kt);
#if defined(__AVX512F__)
    __mmask16 mask = 0;  // the keys that are there
    for (int64_t j = 0; j < kLanes; ++j) mask |= valid[l0 + j] ? 1u << j : 0u;
#endif
    for (int64_t i0 = 0; i0 < RG; i0 += 4) {
      const float* qs[4];
      int64_t m = 0;
      for (int64_t i = i0; i < RG && i < i0 + 4; ++i)
        if (l0 < b.lens[i / G]) qs[m++] = qf + i * D;
      if (m == 0) continue;
      block_scores(qs, m, kt, D, s4);
      if (a.softcap > 0.0f)
        for (int64_t j = 0; j < m * kLanes; ++j) s4[j] = std::tanh(s4[j] / a.softcap) * a.softcap;
      int64_t k = 0;
      for (int64_t i = i0; i < RG && i < i0 + 4; ++i) {
        const int64_t n = b.lens[i / G], lo = lo_of(n);
        if (l0 >= n) continue;
        const float* s = s4 + (k++) * kLanes;
        float* si = scores + i * n16 + l0;
#if defined(__AVX512F__)
        __mmask16 there = n - l0 >= kLanes ? mask : mask & ((1u << (n - l0)) - 1u);
        if (lo > l0) there &= lo - l0 >= kLanes ? 0u : 0xFFFFu << (lo - l0);
        const __m512 x = _mm512_mask_blend_ps(there, _mm512_set1_ps(lowest), _mm512_loadu_ps(s));
        _mm512_storeu_ps(si, x);
        tops[i] = std::max(tops[i], _mm512_reduce_max_ps(x));
#else
        float top = tops[i];
        for (int64_t j = 0; j < kLanes; ++j) {
          const bool there = l0 + j >= lo && l0 + j < n && valid[l0 + j];
          si[j] = there ? s[j] : lowest;
          top = std::max(top, si[j]);
        }
        tops[i] = top;
#endif
      }
    }
  }
  // pass 2: softmax numerators, in place (0 past the row's keys), and their sums (from the
  // first block read: the keys before it would add zeros, and start keeps the lanes)
  for (int64_t i = 0; i < RG; ++i) {
    const int64_t n = b.lens[i / G];
    const int64_t n16_row = (n + kLanes - 1) / kLanes * kLanes;
    float* si = scores + i * n16;
    exp_row(si + start, n - start, tops[i] == lowest ? 0.0f : tops[i]);
    std::fill(si + n, si + n16, 0.0f);  // past the row's keys (lane_sum and the values' pass)
    sums[i] = lane_sum(si + start, n16_row - start);
  }
  // pass 3: the values, in key order (the blocks' keys read again, now as rows)
  for (int64_t l0 = start; l0 < n_max; l0 += kLanes) {
    block_rows(a, b, h, l0, n_max, offsets, valid + l0);
    load_values(a, offsets, valid + l0, vt);
    for (int64_t i0 = 0; i0 < RG; i0 += 4) {
      float* accs[4];
      const float* ps[4];
      int64_t nks[4], m = 0;
      for (int64_t i = i0; i < RG && i < i0 + 4; ++i) {
        const int64_t n = b.lens[i / G];
        if (l0 >= n) continue;
        accs[m] = acc + i * D;
        ps[m] = scores + i * n16 + l0;
        nks[m++] = std::min(kLanes, n - l0);
      }
      if (m > 0) block_values(accs, ps, nks, m, valid + l0, vt, D);
    }
  }
  int64_t bad = 0;
  if (h == 0)  // counted once, not per KV head
    for (int64_t l = 0; l < n_max; ++l) {
      const int64_t slot = b.slots[l];
      bad += (b.mask == nullptr || b.mask[l]) && (slot < 0 || slot >= a.S);
    }
  for (int64_t i = 0; i < RG; ++i) {
    float* o = out + ((b.r0 + i / G) * H + h * G + i % G) * D;
    const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;  // no key: zeros
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
  }
  return bad;
}

// Below this many key rows (query rows x KV heads x keys) one thread runs the whole batch:
// waking the OpenMP team costs more than it saves.
static constexpr int64_t kParallelMinRows = 1024;

// Tasks are (block, KV head) pairs, handed out in small chunks so that a causal prefill's long
// rows and short rows spread over the threads.
template <typename T, typename KV>
static int64_t attention(const Heads<KV>& a, const T* q, float* out,
                         const std::vector<Block>& blocks, int64_t total_keys) {
  const int threads = total_keys * a.KVH >= kParallelMinRows ? at::get_num_threads() : 1;
  const int64_t num_tasks = static_cast<int64_t>(blocks.size()) * a.KVH;
  int64_t bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(+ : bad)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task)
      bad += attend(a, q, blocks[task / a.KVH], task % a.KVH, out, buf);
  }
  return bad;
}

static void check_common(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache) {
  const bool codes = k_cache.scalar_type() == at::kChar;  // int8 codes and their scales
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.size(2) == q.size(2) + (codes ? kScaleBytes : 0) &&
                        k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0 && q.size(2) > 0,
                    "attention shapes: q ", q.sizes(), ", keys ", k_cache.sizes(), ", values ",
                    v_cache.sizes(), codes ? " (int8 rows: head dim + 4 scale bytes)" : "");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kBFloat16 || dtype == at::kFloat) &&
                        (k_cache.scalar_type() == dtype || codes) &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "attention runs on bf16 or fp32 alike, its KV in q's dtype or int8, got q ",
                    dtype, ", keys ", k_cache.scalar_type(), ", values ", v_cache.scalar_type());
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "attention needs contiguous K/V caches");
}

// ``attention`` with q as T, the caches as KV (q's dtype, or int8 codes and scales).
template <typename T, typename KV>
static int64_t run_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         at::Tensor& out, const std::vector<Block>& blocks, int64_t total_keys,
                         float scale, float softcap, int64_t window) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  Heads<KV> a{reinterpret_cast<const KV*>(k_cache.data_ptr()),
              reinterpret_cast<const KV*>(v_cache.data_ptr()),
              KVH, k_cache.size(0), H / KVH, D, k_cache.size(2), scale, softcap, window};
  return attention(a, reinterpret_cast<const T*>(q.data_ptr()), out.data_ptr<float>(), blocks,
                   total_keys);
}

// Runs ``attention`` over ``blocks`` in q's dtype -> [T, H, D] in q's dtype.
static at::Tensor run(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::vector<Block>& blocks, int64_t total_keys, double scale_in,
                      double softcap_in, int64_t window) {
  const at::Tensor q = q_in.contiguous();
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor out = at::empty({T_, H, D}, q.options().dtype(at::kFloat));
  TORCH_CHECK_VALUE(scale_in >= 0 && softcap_in >= 0 && window >= 0, "attention: scale ",
                    scale_in, ", softcap ", softcap_in, " and window ", window,
                    " must be >= 0 (0: the default, none, none)");
  const float scale = scale_in > 0 ? static_cast<float>(scale_in)
                                   : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float softcap = static_cast<float>(softcap_in);
  const bool fp32 = q.scalar_type() == at::kFloat, codes = k_cache.scalar_type() == at::kChar;
  const auto go = [&](auto q_tag, auto kv_tag) {
    using T = decltype(q_tag);
    using KV = decltype(kv_tag);
    return run_typed<T, KV>(q, k_cache, v_cache, out, blocks, total_keys, scale, softcap, window);
  };
  int64_t bad;
  if (codes)
    bad = fp32 ? go(float{}, int8_t{}) : go(uint16_t{}, int8_t{});
  else
    bad = fp32 ? go(float{}, float{}) : go(uint16_t{}, uint16_t{});
  TORCH_CHECK_INDEX(bad == 0, bad, " key slots outside the pool's ", k_cache.size(0));
  return out.to(q.scalar_type());  // fp32: the same tensor
}

// x: [N, KVH, D] fp32 or bf16 (new tokens' K or V) -> [N, KVH, D + kScaleBytes] int8: each
// row's codes, then its scale as fp32 bytes. A row depends on its own values alone, in a fixed
// order: absmax = the largest |x|, scale = absmax / 127, code = round-to-even(x * (127 /
// absmax)) (0 where absmax is 0), so a token's KV has the same bytes however it was batched or
// chunked and on whichever node computed it.
static at::Tensor kv_quantize_cpu(const at::Tensor& x_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 3 && x_in.size(2) > 0 &&
                        (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                    "kv_quantize takes [tokens, heads, head dim] in fp32 or bf16, got ",
                    x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0) * x.size(1), D = x.size(2);
  at::Tensor out = at::empty({x.size(0), x.size(1), D + kScaleBytes}, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  auto* op = reinterpret_cast<int8_t*>(out.data_ptr());
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = xp + r * D;
      int8_t* dst = op + r * (D + kScaleBytes);
      float absmax = 0.0f;
      for (int64_t d = 0; d < D; ++d) absmax = std::max(absmax, std::fabs(src[d]));
      const float scale = absmax / 127.0f;
      const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float c = std::nearbyint(src[d] * inv);
        dst[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
      }
      std::memcpy(dst + D, &scale, sizeof scale);
    }
  });
  return out;
}

// q: [B, H, D]; k_cache, v_cache: [S, KVH, D]; idx: [B, L] slots; mask: [B, L] bool, True
// where the key is the row's (a prefix of the row) -> [B, H, D] in q's dtype. Each row is a
// block of its own, its keys up to its last one in the mask.
static at::Tensor paged_decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache, const at::Tensor& idx_in,
                                             const at::Tensor& mask_in, double scale,
                                             double softcap, int64_t window) {
  check_common(q_in, k_cache, v_cache);
  TORCH_CHECK_VALUE(idx_in.dim() == 2 && idx_in.sizes() == mask_in.sizes() &&
                        idx_in.size(0) == q_in.size(0),
                    "decode attention shapes: q ", q_in.sizes(), ", idx ", idx_in.sizes(),
                    ", mask ", mask_in.sizes());
  const at::Tensor idx = idx_in.to(at::kLong).contiguous();
  const at::Tensor mask = mask_in.to(at::kBool).contiguous();
  const int64_t B = idx.size(0);
  const int64_t L = idx.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const auto* mp = reinterpret_cast<const uint8_t*>(mask.data_ptr());
  std::vector<int64_t> lens(B);  // each row's keys: up to its last one in the mask
  std::vector<Block> blocks;
  blocks.reserve(B);
  for (int64_t t = 0; t < B; ++t) {
    int64_t n = L;
    while (n > 0 && !mp[t * L + n - 1]) --n;
    lens[t] = n;
    blocks.push_back(Block{t, t + 1, ip + t * L, mp + t * L, &lens[t]});
  }
  return run(q_in, k_cache, v_cache, blocks, B * L, scale, softcap, window);
}

// q: [T, H, D]; k_cache, v_cache: [S, KVH, D]; slots: [N] int64; starts, lens: [T] int64:
// query row t attends to the keys slots[starts[t] : starts[t] + lens[t]] -> [T, H, D]. Rows
// in a run with the same start and growing lens (one request's prefill rows) share blocks.
static at::Tensor paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& slots_in,
                                      const at::Tensor& starts_in, const at::Tensor& lens_in,
                                      double scale, double softcap, int64_t window) {
  check_common(q_in, k_cache, v_cache);
  TORCH_CHECK_VALUE(slots_in.dim() == 1 && starts_in.dim() == 1 &&
                        starts_in.sizes() == lens_in.sizes() && starts_in.size(0) == q_in.size(0),
                    "attention shapes: q ", q_in.sizes(), ", slots ", slots_in.sizes(),
                    ", starts ", starts_in.sizes(), ", lens ", lens_in.sizes());
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor starts = starts_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const int64_t N = slots.size(0), T_ = starts.size(0);
  const int64_t *sp = slots.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>(),
                *ln = lens.data_ptr<int64_t>();
  int64_t total = 0;
  std::vector<Block> blocks;
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK_VALUE(st[t] >= 0 && ln[t] >= 1 && st[t] + ln[t] <= N, "row ", t, " takes keys [",
                      st[t], ", ", st[t] + ln[t], ") of ", N);
    total += ln[t];
    Block* last = blocks.empty() ? nullptr : &blocks.back();
    if (last != nullptr && last->r1 == t && last->r1 - last->r0 < kRows &&
        st[last->r0] == st[t] && ln[t - 1] <= ln[t]) {
      last->r1 = t + 1;
    } else {
      blocks.push_back(Block{t, t + 1, sp + st[t], nullptr, ln + t});
    }
  }
  return run(q_in, k_cache, v_cache, blocks, total, scale, softcap, window);
}

TORCH_LIBRARY_FRAGMENT(pd, m) {
  // scale 0: 1 / sqrt(head dim); softcap 0: none; window 0: every key (AttentionSpec)
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor idx, "
        "Tensor mask, float scale=0., float softcap=0., int window=0) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor starts, Tensor lens, float scale=0., float softcap=0., int window=0) -> Tensor");
  m.def("kv_quantize(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(pd, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("kv_quantize", &kv_quantize_cpu);
}

extern "C" int pd_attention_loaded() { return 1; }
