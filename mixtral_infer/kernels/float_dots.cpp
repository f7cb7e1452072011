// float32 products of a few rows on x86 CPUs: y = x @ w.T for x (M, IN) with M up to 8 (decoding's
// rows, an expert's share of them) and a float32 weight w (OUT, IN), the weight read from memory once
// for all the rows, in sets of P rows shared among the threads (dots.h), each output a sum of 8-lane
// fused multiply-adds. kernels/native.py builds it with int_dots.cpp into one library;
// kernels/linear/plain.py calls it where Tuning.float_dots says (measured faster on the machine).
//
// Why: a library's general matrix product may multiply a few rows far under the speed of reading the
// weight (MKL's float32 path on some CPUs runs 2-8 rows at the speed of one row each), and decoding
// is reading weights. Here the work per weight read is M fused multiply-adds, so the product is bound
// by memory up to 8 rows (docs/performance.md, section 6).
//
// Registers: AVX2 has 16; a set keeps P x M accumulators, P weight vectors and one activation vector:
// 1 or 2 rows against 4 weight rows (at most 13), 3 or 4 rows against 2 (at most 11). 5 to 8 rows
// take the set twice, 4 rows then the rest: the second pass finds the set's weight rows in L1.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include "dots.h"

namespace {

using dots::AHEAD;
using dots::MAX_ROWS;

// Weight rows read at once for M (<= 4) activation rows.
template <int M> constexpr int places() { return M <= 2 ? 4 : 2; }

// Weight rows r..r+P-1 against the M (<= 4) activation rows of x: y[m, r + p].
template <int M, int P>
void float_rows(const float* x, const float* w, float* y, int64_t out, int64_t in, int64_t r, bool fetch) {
  __m256 acc[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    for (int p = 0; p < P; ++p) {
      const float* at = w + (r + p) * in + k;
      if (fetch && k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + AHEAD * P * in), _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(at);
      for (int m = 0; m < M; ++m) acc[p][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * in + k), acc[p][m]);
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int m = 0; m < M; ++m) {
      float sum = dots::sum8(acc[p][m]);
      for (int64_t j = k; j < in; ++j) sum += w[(r + p) * in + j] * x[m * in + j];  // IN not a multiple of 8
      y[m * out + r + p] = sum;
    }
  }
}

// The M (<= MAX_ROWS) rows of x against every weight row.
template <int M>
void every_weight_row(const float* x, const float* w, float* y, int64_t out, int64_t in) {
  constexpr int FIRST = M <= 4 ? M : 4, REST = M - FIRST;
  constexpr int P = places<FIRST>();
  dots::every_row<P>(out, [&](auto p, int64_t r) {
    constexpr int SET = decltype(p)::value;
    float_rows<FIRST, SET>(x, w, y, out, in, r, r + (AHEAD + 1) * SET <= out);
    if constexpr (REST > 0) float_rows<REST, SET>(x + FIRST * in, w, y + FIRST * out, out, in, r, false);
  });
}

at::Tensor float_dots(const at::Tensor& x_in, const at::Tensor& weight) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 x and weight expected, got ",
              x_in.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the weight must be a contiguous (OUT, IN) matrix");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in, "x must be (rows, ", in, "), got ", x_in.sizes());
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0);
  auto y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // More than MAX_ROWS rows go in passes of MAX_ROWS, each reading the weight again (the package sends
  // prompts to the library's product instead).
  dots::in_passes<MAX_ROWS>(rows, [&](int64_t m0, auto m) {
    every_weight_row<decltype(m)::value>(xp + m0 * in, w, yp + m0 * out, out, in);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixtral_infer_dots, m) {
  m.def("float_dots(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixtral_infer_dots, CPU, m) {
  m.impl("float_dots", float_dots);
}
