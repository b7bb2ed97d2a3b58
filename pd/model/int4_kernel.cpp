// int4_kernel: built by pd.core.cpp.load_torch_ops from int4_kernel.py (see its docstring).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> fp32: the high half of the bits
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// One block of 8 output rows for MT rows of x from m0: see the module's docstring.
template <int MT>
static inline void block(const int16_t* xq, const float* dx, const float* xs, int64_t m0,
                         int64_t K, const uint8_t* qb, const uint16_t* sb, const uint16_t* zb,
                         int64_t n, int64_t N, float* y) {
  const int64_t G = K / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i sums[MT];
    for (int i = 0; i < MT; ++i) sums[i] = _mm256_setzero_si256();
    const uint8_t* q = qb + g * 128;
    for (int c = 0; c < 8; ++c) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(q + 16 * c));
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
      for (int i = 0; i < MT; ++i) {  // inputs 4c .. 4c + 3 of the group, as two int16 pairs
        const int32_t* pairs = (const int32_t*)(xq + (m0 + i) * K + g * 32 + 4 * c);
        const __m256i p0 = _mm256_madd_epi16(w0, _mm256_set1_epi32(pairs[0]));
        const __m256i p1 = _mm256_madd_epi16(w1, _mm256_set1_epi32(pairs[1]));
        sums[i] = _mm256_add_epi32(sums[i], _mm256_add_epi32(p0, p1));
      }
    }
    const __m256 s = bf16x8(sb + g * 8), z = bf16x8(zb + g * 8);
    for (int i = 0; i < MT; ++i) {
      const float d = dx[(m0 + i) * G + g], sum = xs[(m0 + i) * G + g];
      const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), _mm256_set1_ps(d),
                                       _mm256_set1_ps(-8.0f * sum));  // sum((q - 8) * x)
      acc[i] = _mm256_fmadd_ps(s, t, acc[i]);
      acc[i] = _mm256_fmadd_ps(z, _mm256_set1_ps(sum), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm256_storeu_ps(y + (m0 + i) * N + n, acc[i]);
}

static inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One group of 32 inputs to int16 (rounded to nearest, ties to even): xq ~ x / d with
// d = the largest magnitude / 32767; -> d, and the inputs' sum in *sum.
static inline float quantize_group(const float* x, int16_t* xq, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], top = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
    s = _mm256_add_ps(s, v[j]);
  }
  const float d = hmax(top) / 32767.0f;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  for (int j = 0; j < 4; j += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
    // packs works per 128-bit lane: put the four 64-bit quarters back in order
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256((__m256i*)(xq + 8 * j), ab);
  }
  *sum = hsum(s);
  return d;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
static inline __m512i both(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// The weights of blocks b and b + 1 (16 output rows, one a lane) widened to int16 for every
// group: w[(g * 16 + c) * 32 ..] holds input pair c of the group for the 16 rows, two int16 a
// row (what ``_mm512_dpwssd_epi32`` multiplies by one pair of x).
static inline void widen16(const uint8_t* q0, const uint8_t* q1, int64_t G, int16_t* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < 8; ++c) {
      const __m128i a = _mm_loadu_si128((const __m128i*)(q0 + g * 128 + 16 * c));
      const __m128i b = _mm_loadu_si128((const __m128i*)(q1 + g * 128 + 16 * c));
      __m512i* out = (__m512i*)(w + (g * 16 + 2 * c) * 32);
      _mm512_storeu_si512(out, both(_mm256_cvtepu8_epi16(_mm_and_si128(a, low)),
                                    _mm256_cvtepu8_epi16(_mm_and_si128(b, low))));
      _mm512_storeu_si512(out + 1,
                          both(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(a, 4), low)),
                               _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low))));
    }
}

// Blocks b and b + 1 (16 output rows) for MT rows of x from m0, with AVX-512 VNNI, from the
// widened weights ``w`` (``widen16``). The int32 sums are exact and the fp32 steps after them
// are ``block``'s, so each output has the bits the AVX2 path gives it.
template <int MT>
static inline void block16(const int16_t* xq, const float* dx, const float* xs, int64_t m0,
                           int64_t K, const int16_t* w, const uint16_t* s0, const uint16_t* s1,
                           const uint16_t* z0, const uint16_t* z1, int64_t n, int64_t N,
                           float* y) {
  const int64_t G = K / 32;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i* wg = (const __m512i*)(w + g * 16 * 32);
    // one chain a row, the rows' adds side by side (MT <= 4: named, so that each stays in
    // its register)
    const int32_t* p0 = (const int32_t*)(xq + m0 * K + g * 32);
    const int32_t* p1 = p0 + (MT > 1 ? K / 2 : 0);
    const int32_t* p2 = p0 + (MT > 2 ? K : 0);
    const int32_t* p3 = p0 + (MT > 3 ? 3 * K / 2 : 0);
    __m512i u0 = _mm512_setzero_si512(), u1 = u0, u2 = u0, u3 = u0;
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      const __m512i wc = _mm512_loadu_si512(wg + c);
      u0 = _mm512_dpwssd_epi32(u0, wc, _mm512_set1_epi32(p0[c]));
      if (MT > 1) u1 = _mm512_dpwssd_epi32(u1, wc, _mm512_set1_epi32(p1[c]));
      if (MT > 2) u2 = _mm512_dpwssd_epi32(u2, wc, _mm512_set1_epi32(p2[c]));
      if (MT > 3) u3 = _mm512_dpwssd_epi32(u3, wc, _mm512_set1_epi32(p3[c]));
    }
    const __m512i sums[4] = {u0, u1, u2, u3};
    const __m512 s = _mm512_insertf32x8(_mm512_castps256_ps512(bf16x8(s0 + g * 8)),
                                        bf16x8(s1 + g * 8), 1);
    const __m512 z = _mm512_insertf32x8(_mm512_castps256_ps512(bf16x8(z0 + g * 8)),
                                        bf16x8(z1 + g * 8), 1);
    for (int i = 0; i < MT; ++i) {
      const float d = dx[(m0 + i) * G + g], xsum = xs[(m0 + i) * G + g];
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_set1_ps(d),
                                       _mm512_set1_ps(-8.0f * xsum));  // sum((q - 8) * x)
      acc[i] = _mm512_fmadd_ps(s, t, acc[i]);
      acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + (m0 + i) * N + n, acc[i]);
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

// Whether this process may use AMX's tiles (Linux asks each process to request them).
static bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 and 5, 6 the int32 sums of x's high and low bytes ([16 rows, 16 columns]) of
// even and odd groups; 2, 3 those bytes for a group ([16 rows, 32 inputs]); 4 the group's
// weights in AMX's layout ([8 rows of 4 inputs, 16 columns]).
static void amx_configure() {
  TileConfig cfg;
  for (int t : {0, 1, 5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 32;
  cfg.rows[4] = 8, cfg.colsb[4] = 64;
  _tile_loadconfig(&cfg);
}

// The weights of blocks b and b + 1 (16 output rows) for every group in AMX's layout: row c of
// group g holds inputs 4c .. 4c + 3 of each output row side by side, as 0..15 (the packed
// chunk c holds exactly those: low nibbles inputs 4c, 4c + 1, high nibbles 4c + 2, 4c + 3).
static inline void amx_weights(const uint8_t* q0, const uint8_t* q1, int64_t G, uint8_t* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < 8; ++c) {
      uint8_t* out = w + (g * 8 + c) * 64;
      for (int half = 0; half < 2; ++half) {
        const __m128i b = _mm_loadu_si128((const __m128i*)((half ? q1 : q0) + g * 128 + 16 * c));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        _mm_storeu_si128((__m128i*)(out + 32 * half), _mm_unpacklo_epi16(lo, hi));
        _mm_storeu_si128((__m128i*)(out + 32 * half + 16), _mm_unpackhi_epi16(lo, hi));
      }
    }
}

// 16 rows of x from m0 (xhi, xlo: the high and low bytes of their int16 inputs, rows K apart;
// dx, xs by group, [G, Mp], padded with zeros past M) times blocks b and b + 1
// (``amx_weights``'s ``w``): the int32 sum of each group is 256 * sum(hi * q) + sum(lo * q) =
// sum(xq * q), exactly ``block16``'s, and the fp32 steps after it are ``block16``'s, in the
// same order of groups, so every output has the bits the AVX-512 and AVX2 paths give it.
//
// Even and odd groups take turns on two pairs of sum tiles (0, 1 and 5, 6) and of buffers:
// group g's tiles are zeroed, loaded, multiplied and stored while group g - 1's sums (stored a
// group before) are scaled, four rows at a time between the tile steps, so the vector units
// work while the tiles multiply. Macros, not functions: the tile intrinsics take their tile's
// number as a literal, and the accumulators must stay in registers (an array passed by pointer
// is spilled around every tile step).
#define PD_AMX_SCALE(R0, R1, HI, LO, GP)                                                     \
  _Pragma("GCC unroll 16") for (int i = R0; i < R1; ++i) {                                  \
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(HI[i]), 8),    \
                                         _mm512_load_si512(LO[i]));                         \
    const float d = dx[(GP) * Mp + m0 + i], xsum = xs[(GP) * Mp + m0 + i];                  \
    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d),            \
                                     _mm512_set1_ps(-8.0f * xsum)); /* sum((q - 8) * x) */  \
    acc[i] = _mm512_fmadd_ps(s, t, acc[i]);                                                 \
    acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum), acc[i]);                              \
  }
#define PD_AMX_GROUP(A, B, HI, LO, PHI, PLO)                                                 \
  _tile_zero(A);                                                                            \
  _tile_zero(B);                                                                            \
  _tile_loadd(2, xhi + m0 * K + g * 32, K);                                                 \
  if (g > 0) { PD_AMX_SCALE(0, 4, PHI, PLO, g - 1) }                                        \
  _tile_loadd(3, xlo + m0 * K + g * 32, K);                                                 \
  _tile_loadd(4, w + g * 512, 64);                                                          \
  if (g > 0) { PD_AMX_SCALE(4, 8, PHI, PLO, g - 1) }                                        \
  _tile_dpbsud(A, 2, 4);                                                                    \
  _tile_dpbuud(B, 3, 4);                                                                    \
  if (g > 0) { PD_AMX_SCALE(8, 12, PHI, PLO, g - 1) }                                       \
  _tile_stored(A, HI, 64);                                                                  \
  _tile_stored(B, LO, 64);                                                                  \
  if (g > 0) { PD_AMX_SCALE(12, 16, PHI, PLO, g - 1) }

static inline void amx_block(const int8_t* xhi, const uint8_t* xlo, const float* dx,
                             const float* xs, int64_t m0, int64_t M, int64_t Mp, int64_t K,
                             const uint8_t* w,
                             const uint16_t* s0, const uint16_t* s1, const uint16_t* z0,
                             const uint16_t* z1, int64_t n, int64_t N, float* y) {
  const int64_t G = K / 32;
  alignas(64) int32_t hi0[16][16], lo0[16][16], hi1[16][16], lo1[16][16];
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  __m512 s = _mm512_setzero_ps(), z = s;
  auto scales = [&](int64_t g) {  // group g's scales and zeros, of the 16 output rows
    s = _mm512_insertf32x8(_mm512_castps256_ps512(bf16x8(s0 + g * 8)), bf16x8(s1 + g * 8), 1);
    z = _mm512_insertf32x8(_mm512_castps256_ps512(bf16x8(z0 + g * 8)), bf16x8(z1 + g * 8), 1);
  };
  for (int64_t g = 0; g < G; ++g) {
    if (g > 0) scales(g - 1);
    if (g % 2 == 0) {
      PD_AMX_GROUP(0, 1, hi0, lo0, hi1, lo1)
    } else {
      PD_AMX_GROUP(5, 6, hi1, lo1, hi0, lo0)
    }
  }
  scales(G - 1);
  if ((G - 1) % 2 == 0) {
    PD_AMX_SCALE(0, 16, hi0, lo0, G - 1)
  } else {
    PD_AMX_SCALE(0, 16, hi1, lo1, G - 1)
  }
  for (int i = 0; i < 16 && m0 + i < M; ++i) _mm512_storeu_ps(y + (m0 + i) * N + n, acc[i]);
}
#undef PD_AMX_GROUP
#undef PD_AMX_SCALE
#endif

// From this many rows of x on, AMX's tiles multiply (where the CPU has them): fewer rows would
// leave most of a tile's 16 empty.
static constexpr int64_t kAmxMinRows = 16;
// From this many rows of x on, the threads share their quantization.
static constexpr int64_t kQuantizeTeamRows = 16;

// x: [M, K] fp32; qw: [N / 8, K / 32, 128] bytes; scale, zero: [N / 8, K / 32, 8] bf16;
// y: [M, N] fp32.
static void int4_mm(const float* x, int64_t M, int64_t K, const uint8_t* qw,
                    const uint16_t* scale, const uint16_t* zero, int64_t N, float* y,
                    int threads) {
  const int64_t G = K / 32;
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  const bool amx = M >= kAmxMinRows && amx_ready();
#else
  const bool amx = false;
#endif
  const int64_t Mp = amx ? (M + 15) / 16 * 16 : M;  // AMX takes rows 16 at a time
  static thread_local std::vector<int16_t> xq;
  static thread_local std::vector<float> dx, xs;
  xq.resize(M * K);
  dx.assign(Mp * G, 0.0f);
  xs.assign(Mp * G, 0.0f);
  // the thread-locals of this thread, by pointer: each OpenMP thread has its own
  int16_t* q = xq.data();
  float *d = dx.data(), *sums = xs.data();
  const int64_t NB = N / 8;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  const int64_t NB2 = NB / 2 * 2;  // blocks taken two at a time; an odd last one below
#else
  const int64_t NB2 = 0;
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  // AMX multiplies bytes: each int16 input as its high (signed) and low (unsigned) byte (the
  // rows past M zero)
  static thread_local std::vector<int8_t> xhi;
  static thread_local std::vector<uint8_t> xlo;
  static thread_local std::vector<float> dxt, xst;  // dx and xs by group: [G, Mp]
  if (amx) {
    dxt.assign(G * Mp, 0.0f);
    xst.assign(G * Mp, 0.0f);
    xhi.resize(Mp * K);
    xlo.resize(Mp * K);
    std::fill(xhi.begin() + M * K, xhi.end(), 0);
    std::fill(xlo.begin() + M * K, xlo.end(), 0);
  }
  int8_t* xh = xhi.data();
  uint8_t* xl = xlo.data();
  float *dt = dxt.data(), *st = xst.data();
#endif
  // each row of x alone (its inputs do not depend on the other rows or the threads): on the
  // team from kQuantizeTeamRows rows on, before it below (a decode step's rows are not worth a
  // barrier)
  auto quantize_row = [&](int64_t m) {
    for (int64_t g = 0; g < G; ++g)
      d[m * G + g] = quantize_group(x + m * K + g * 32, q + m * K + g * 32, sums + m * G + g);
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx) {
      for (int64_t i = m * K; i < (m + 1) * K; ++i) {
        xh[i] = static_cast<int8_t>(q[i] >> 8);
        xl[i] = static_cast<uint8_t>(q[i] & 0xFF);
      }
      for (int64_t g = 0; g < G; ++g) {
        dt[g * Mp + m] = d[m * G + g];
        st[g * Mp + m] = sums[m * G + g];
      }
    }
#endif
  };
  const bool team_quantizes = M >= kQuantizeTeamRows && threads > 1;
  if (!team_quantizes)
    for (int64_t m = 0; m < M; ++m) quantize_row(m);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    if (team_quantizes) {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) quantize_row(m);
    }
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx) {
      amx_configure();
      std::vector<uint8_t> wa(G * 512);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < NB2; b += 2) {
        const uint8_t* q0 = qw + b * G * 128;
        const uint16_t *s0 = scale + b * G * 8, *s1 = s0 + G * 8;
        const uint16_t *z0 = zero + b * G * 8, *z1 = z0 + G * 8;
        amx_weights(q0, q0 + G * 128, G, wa.data());
        for (int64_t m = 0; m < M; m += 16)
          amx_block(xh, xl, dt, st, m, M, Mp, K, wa.data(), s0, s1, z0, z1, 8 * b, N, y);
      }
      _tile_release();
    } else
#endif
    {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
      std::vector<int16_t> wide(G * 16 * 32);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < NB2; b += 2) {
        const uint8_t* q0 = qw + b * G * 128;
        const uint16_t *s0 = scale + b * G * 8, *s1 = s0 + G * 8;
        const uint16_t *z0 = zero + b * G * 8, *z1 = z0 + G * 8;
        const int16_t* w = wide.data();
        widen16(q0, q0 + G * 128, G, wide.data());
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) block16<4>(q, d, sums, m, K, w, s0, s1, z0, z1, 8 * b, N, y);
        for (; m + 2 <= M; m += 2) block16<2>(q, d, sums, m, K, w, s0, s1, z0, z1, 8 * b, N, y);
        for (; m < M; ++m) block16<1>(q, d, sums, m, K, w, s0, s1, z0, z1, 8 * b, N, y);
      }
#endif
    }
#pragma omp for schedule(static)
    for (int64_t b = NB2; b < NB; ++b) {
      const uint8_t* qb = qw + b * G * 128;
      const uint16_t* sb = scale + b * G * 8;
      const uint16_t* zb = zero + b * G * 8;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) block<4>(q, d, sums, m, K, qb, sb, zb, 8 * b, N, y);
      for (; m + 2 <= M; m += 2) block<2>(q, d, sums, m, K, qb, sb, zb, 8 * b, N, y);
      for (; m < M; ++m) block<1>(q, d, sums, m, K, qb, sb, zb, 8 * b, N, y);
    }
  }
}
#endif

// Below this many weights one thread runs the whole matmul: waking the OpenMP team costs more.
static constexpr int64_t kParallelMinWeights = 1 << 16;

static at::Tensor int4_mm_cpu(const at::Tensor& x_in, const at::Tensor& weight,
                              const at::Tensor& scale, const at::Tensor& zero) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK_VALUE(x_in.dim() == 2, "int4 matmul: x must be [rows, inputs], got ", x_in.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.size(2) == 128 &&
                        weight.scalar_type() == at::kByte && weight.is_contiguous(),
                    "int4 matmul: the weight must be a contiguous uint8 [N / 8, K / 32, 128], got ",
                    weight.scalar_type(), " ", weight.sizes());
  const int64_t nb = weight.size(0), g = weight.size(1), n = nb * 8, k = x_in.size(1);
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kBFloat16 && t->is_contiguous() &&
                          t->dim() == 3 && t->size(0) == nb && t->size(1) == g && t->size(2) == 8,
                      "int4 matmul: scales and zeros must be contiguous bf16 [", nb, ", ", g,
                      ", 8], got ", t->scalar_type(), " ", t->sizes());
  TORCH_CHECK_VALUE(k == g * 32, "int4 matmul: x has ", k, " inputs, the weight ", g * 32);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const int threads = n * k >= kParallelMinWeights ? at::get_num_threads() : 1;
  int4_mm(x.data_ptr<float>(), x.size(0), k, weight.data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(scale.data_ptr()),
          reinterpret_cast<const uint16_t*>(zero.data_ptr()), n, y.data_ptr<float>(), threads);
  return y;
#else
  TORCH_CHECK(false, "int4 matmul: this build has no AVX2 with FMA");
#endif
}

TORCH_LIBRARY_FRAGMENT(pd, m) {
  m.def("int4_mm(Tensor x, Tensor weight, Tensor scale, Tensor zero) -> Tensor");
}
TORCH_LIBRARY_IMPL(pd, CPU, m) { m.impl("int4_mm", &int4_mm_cpu); }

extern "C" int pd_int4_available() {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}
