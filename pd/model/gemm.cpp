// gemm: built by pd.core.cpp.load_torch_ops from gemm.py (see its docstring).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

// Output columns of one block of the packed weight: [blocks, K, kCols], a k's kCols weights
// side by side, so that each output column sits in one vector lane.
static constexpr int64_t kCols = 32;

// The weight formats: a weight element -> fp32, exactly (int8's per-column scale comes last).
enum class Format { kF32, kBF16, kF16, kI8 };

#if defined(__AVX512F__)
// 16 lanes; a block is 2 vectors; 6 rows of x at a time (12 accumulators).
static constexpr int kLanes = 16, kRows = 6;
using Vec = __m512;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vset1(float v) { return _mm512_set1_ps(v); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
static inline Vec vloadf(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
template <Format F>
static inline Vec vload(const void* p) {
  if constexpr (F == Format::kF32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (F == Format::kBF16) {  // bf16 -> fp32: the high half of the bits
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (F == Format::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 lanes; a block is 4 vectors; 3 rows of x at a time (12 accumulators).
static constexpr int kLanes = 8, kRows = 3;
using Vec = __m256;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vset1(float v) { return _mm256_set1_ps(v); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
static inline Vec vloadf(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
template <Format F>
static inline Vec vload(const void* p) {
  if constexpr (F == Format::kF32) {
    return _mm256_loadu_ps((const float*)p);
  } else if constexpr (F == Format::kBF16) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == Format::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
}
#else
// No vectors: one lane, the same fma a step (std::fma rounds once, as the vector fma does).
static constexpr int kLanes = 1, kRows = 1;
struct Vec {
  float v;
};
static inline Vec vzero() { return {0.0f}; }
static inline Vec vset1(float v) { return {v}; }
static inline Vec vfma(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
static inline Vec vmul(Vec a, Vec b) { return {a.v * b.v}; }
static inline Vec vloadf(const float* p) { return {*p}; }
static inline void vstore(float* p, Vec v) { *p = v.v; }
template <Format F>
static inline Vec vload(const void* p) {
  if constexpr (F == Format::kF32) {
    return {*(const float*)p};
  } else if constexpr (F == Format::kBF16) {
    uint32_t bits = uint32_t(*(const uint16_t*)p) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return {f};
  } else if constexpr (F == Format::kF16) {
    return {static_cast<float>(*(const c10::Half*)p)};
  } else {
    return {float(*(const int8_t*)p)};
  }
}
#endif

static constexpr int kVecs = kCols / kLanes;  // vectors a block

template <Format F>
static constexpr int64_t kBytes = F == Format::kF32 ? 4 : F == Format::kI8 ? 1 : 2;

// R rows of x (fp32, rows ldx apart) times one block of the weight ([K, kCols], elements of
// format F) -> y's columns n0 .. n0 + cols (rows ldy apart). Every output is one chain of
// fmas over k = 0, 1, .., K - 1 from 0, then (int8) times its column's scale: the same
// operations, in the same order, whatever R, the row's place among the rows, the threads, and
// the vector width.
template <Format F, int R>
static inline void block(const float* x, int64_t ldx, const uint8_t* w, int64_t K,
                         const float* scale, float* y, int64_t ldy, int64_t cols) {
  Vec acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = vzero();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t* wk = w + k * kCols * kBytes<F>;
    Vec wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = vload<F>(wk + v * kLanes * kBytes<F>);
    for (int r = 0; r < R; ++r) {
      const Vec xr = vset1(x[r * ldx + k]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = vfma(xr, wv[v], acc[r][v]);
    }
  }
  if constexpr (F == Format::kI8)
    for (int v = 0; v < kVecs; ++v) {
      const Vec s = vloadf(scale + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] = vmul(acc[r][v], s);
    }
  for (int r = 0; r < R; ++r) {
    if (cols == kCols) {
      for (int v = 0; v < kVecs; ++v) vstore(y + r * ldy + v * kLanes, acc[r][v]);
    } else {  // the last block of a weight whose N is no multiple of kCols
      float tmp[kCols];
      for (int v = 0; v < kVecs; ++v) vstore(tmp + v * kLanes, acc[r][v]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

// Rows of x per task: the tasks are (block of columns, run of rows) pairs, which threads share.
static constexpr int64_t kTaskRows = 8 * kRows;
// Below this many multiply-adds one thread runs the whole matmul: waking the team costs more.
static constexpr int64_t kParallelMinMacs = 1 << 16;

template <Format F>
static void gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                 const float* scale, float* y) {
  const int64_t blocks = (N + kCols - 1) / kCols, runs = (M + kTaskRows - 1) / kTaskRows;
  const int64_t block_bytes = K * kCols * kBytes<F>;
  auto task = [&](int64_t t) {
    const int64_t b = t % blocks, m0 = (t / blocks) * kTaskRows;
    const int64_t m1 = std::min(M, m0 + kTaskRows), n0 = b * kCols;
    const int64_t cols = std::min(kCols, N - n0);
    const uint8_t* wb = w + b * block_bytes;
    const float* sb = scale == nullptr ? nullptr : scale + n0;
    int64_t m = m0;
    for (; m + kRows <= m1; m += kRows)
      block<F, kRows>(x + m * K, K, wb, K, sb, y + m * N + n0, N, cols);
    switch (m1 - m) {  // the rows left: fewer accumulators, the same chain each
#define PD_REST(r) \
  case r:          \
    if constexpr (r < kRows) block<F, r>(x + m * K, K, wb, K, sb, y + m * N + n0, N, cols); \
    break;
      PD_REST(1)
      PD_REST(2)
      PD_REST(3)
      PD_REST(4)
      PD_REST(5)
#undef PD_REST
      default:
        break;
    }
  };
  const int64_t tasks = blocks * runs;
  const int64_t grain = M * N * K >= kParallelMinMacs ? 1 : tasks;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) task(t);
  });
}

static at::Tensor fixed_mm_cpu(const at::Tensor& x_in, const at::Tensor& weight,
                               const std::optional<at::Tensor>& scale, int64_t n) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "fixed matmul: x must be [rows, inputs], got ", x_in.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.size(2) == kCols && weight.is_contiguous(),
                    "fixed matmul: the weight must be a contiguous [blocks, K, ", kCols,
                    "], got ", weight.sizes());
  const int64_t k = weight.size(1), blocks = weight.size(0);
  TORCH_CHECK_VALUE(x_in.size(1) == k, "fixed matmul: x has ", x_in.size(1),
                    " inputs, the weight ", k);
  TORCH_CHECK_VALUE(n > (blocks - 1) * kCols && n <= blocks * kCols, "fixed matmul: ", n,
                    " outputs do not fit ", blocks, " blocks of ", kCols);
  const at::ScalarType st = weight.scalar_type();
  const bool int8 = st == at::kChar;
  TORCH_CHECK_VALUE(scale.has_value() == int8, "fixed matmul: int8 weights take a scale, ",
                    "others none");
  const float* scale_ptr = nullptr;
  if (int8) {
    TORCH_CHECK_VALUE(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                          scale->numel() == blocks * kCols,
                      "fixed matmul: the scale must be contiguous fp32 [", blocks * kCols,
                      "], got ", scale->scalar_type(), " ", scale->sizes());
    scale_ptr = scale->data_ptr<float>();
  }
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* wp = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t m = x.size(0);
  switch (st) {
    case at::kFloat:
      gemm<Format::kF32>(xp, m, k, wp, n, nullptr, yp);
      break;
    case at::kBFloat16:
      gemm<Format::kBF16>(xp, m, k, wp, n, nullptr, yp);
      break;
    case at::kHalf:
      gemm<Format::kF16>(xp, m, k, wp, n, nullptr, yp);
      break;
    case at::kChar:
      gemm<Format::kI8>(xp, m, k, wp, n, scale_ptr, yp);
      break;
    default:
      TORCH_CHECK_VALUE(false, "fixed matmul: weights in ", st,
                        " (float32, bfloat16, float16 or int8 only)");
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(pd, m) {
  m.def("fixed_mm(Tensor x, Tensor weight, Tensor? scale, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(pd, CPU, m) { m.impl("fixed_mm", &fixed_mm_cpu); }

// The vector width this build runs (1: the scalar path).
extern "C" int pd_gemm_lanes() { return kLanes; }
