// fixed_ops: built by pd.core.cpp.load_torch_ops from fixed_ops.py (see its docstring).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

static inline float to_float(float x) { return x; }
static inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// Each row of x [rows, D] over the last dim: y = (x * r) * weight, r = 1 / sqrt(mean(x^2) +
// eps), the squares summed in 16 lanes by index mod 16 and the lanes added pairwise (a fixed
// order, whatever the CPU's vector width), in fp32.
template <typename T>
static void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      float lanes[16] = {};
      int64_t d = 0;
      for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = to_float(xr[d + j]);
          lanes[j] = std::fma(v, v, lanes[j]);
        }
      for (; d < D; ++d) {
        const float v = to_float(xr[d]);
        lanes[d % 16] = std::fma(v, v, lanes[d % 16]);
      }
      for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; ++j) lanes[j] += lanes[j + h];
      const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(D) + eps);
      T* yr = y + r * D;
      for (d = 0; d < D; ++d) yr[d] = static_cast<T>((to_float(xr[d]) * inv) * to_float(w[d]));
    }
  });
}

static at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = weight_in.to(x.scalar_type()).contiguous();
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  TORCH_CHECK_VALUE(w.numel() == D, "rms_norm: weight of ", w.numel(), " for rows of ", D);
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, D,
                  static_cast<float>(eps));
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "rms_norm runs on fp32 or bf16, got ",
                      x.scalar_type());
    rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                  y.data_ptr<at::BFloat16>(), rows, D, static_cast<float>(eps));
  }
  return y;
}

// x: [T, H, D]; cos, sin: [T, 1, D] (sin signed as Rotary's: -sin for the first half): y[d] =
// fma(x[d], cos[d], x[(d + D/2) % D] * sin[d]), in fp32.
template <typename T>
static void rotary_rows(const T* x, const T* c, const T* s, T* y, int64_t Tn, int64_t H,
                        int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, Tn, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + (t * H + h) * D;
        T* yr = y + (t * H + h) * D;
        const T *ct = c + t * D, *st = s + t * D;
        for (int64_t d = 0; d < half; ++d) {  // the two halves: no modulo, so it vectorizes
          const float rolled = to_float(xr[d + half]) * to_float(st[d]);
          yr[d] = static_cast<T>(std::fma(to_float(xr[d]), to_float(ct[d]), rolled));
        }
        for (int64_t d = half; d < D; ++d) {
          const float rolled = to_float(xr[d - half]) * to_float(st[d]);
          yr[d] = static_cast<T>(std::fma(to_float(xr[d]), to_float(ct[d]), rolled));
        }
      }
  });
}

static at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos_in,
                         const at::Tensor& sin_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 3 && cos_in.dim() == 3 && cos_in.size(0) == x_in.size(0) &&
                        cos_in.size(2) == x_in.size(2) && sin_in.sizes() == cos_in.sizes() &&
                        x_in.size(2) % 2 == 0,
                    "rotary shapes: x ", x_in.sizes(), ", cos ", cos_in.sizes(), ", sin ",
                    sin_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor c = cos_in.to(x.scalar_type()).contiguous();
  const at::Tensor s = sin_in.to(x.scalar_type()).contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t Tn = x.size(0), H = x.size(1), D = x.size(2);
  if (x.scalar_type() == at::kFloat) {
    rotary_rows(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(),
                y.data_ptr<float>(), Tn, H, D);
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "rotary runs on fp32 or bf16, got ",
                      x.scalar_type());
    rotary_rows(x.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(),
                s.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), Tn, H, D);
  }
  return y;
}

// gate_up: [rows, 2I] -> silu(gate) * up: torch's own silu (vectorized), then the product.
static at::Tensor silu_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  at::Tensor y = at::silu(halves[0]);
  y.mul_(halves[1]);
  return y;
}

// gate_up: [rows, 2I] -> gelu_tanh(gate) * up (Gemma's GeGLU): torch's own tanh-GELU.
static at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  at::Tensor y = at::gelu(halves[0], "tanh");
  y.mul_(halves[1]);
  return y;
}

TORCH_LIBRARY_FRAGMENT(pd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(pd, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
}

extern "C" int pd_fixed_ops_loaded() { return 1; }
