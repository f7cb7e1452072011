// float32 products of a few rows on x86 CPUs: y = x @ w.T for x (M, IN) with M up to 8 (decoding's
// rows, an expert's share of them) and a float32 weight w (OUT, IN), the weight read from memory once
// for all the rows, in sets of P rows shared among the threads (dots.h), each output a sum of 8-lane
// fused multiply-adds. kernels/native.py builds it with int_dots.cpp into one library;
// kernels/linear/plain.py calls it where Tuning.float_dots says (measured faster on the machine).
// float_experts, below, runs Mixtral's float32 experts on rows of one token each through the same
// product (kernels/moe/float_experts.py). bfloat16_dots is the same product of a bfloat16 weight: each
// weight widened to float32 in registers (its 16 bits moved up, exact), the rows widened once, the
// sums float32, each output rounded to bfloat16 once; half the bytes read of a float32 weight, where a
// CPU without bfloat16 arithmetic otherwise multiplies bfloat16 far under the speed of reading it.
//
// Why: a library's general matrix product may multiply a few rows far under the speed of reading the
// weight (MKL's float32 path on some CPUs runs 2-8 rows at the speed of one row each), and decoding
// is reading weights. Here the work per weight read is M fused multiply-adds, so the product is bound
// by memory up to 8 rows (docs/performance.md, section 6).
//
// Registers: AVX2 has 16; a set keeps P x M accumulators, P weight vectors and one activation vector:
// 1 or 2 rows against 4 weight rows (at most 13), 3 or 4 rows against 2 (at most 11). 5 to 8 rows
// take the weight twice, 4 rows then the rest, in panels that the second pass finds in L2.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include "dots.h"

#include <cmath>
#include <utility>
#include <vector>

namespace {

using dots::AHEAD;
using dots::MAX_ROWS;

// Weight rows read at once for M (<= 4) activation rows.
template <int M> constexpr int places() { return M <= 2 ? 4 : 2; }

// 8 weights from memory as float32 lanes: float32 as they are; bfloat16 widened (its bits are a
// float32's upper half, so the widening is exact).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Weight rows r..r+P-1 against the M (<= 4) activation rows of x: y[m, r + p]. Where `ahead` is not 0,
// each weight cache line read asks for the one `ahead` weights on.
template <int M, int P, typename W>
void float_rows(const float* x, const W* w, float* y, int64_t out, int64_t in, int64_t r, int64_t ahead) {
  constexpr int64_t LINE = 64 / sizeof(W);  // weights a cache line
  __m256 acc[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    for (int p = 0; p < P; ++p) {
      const W* at = w + (r + p) * in + k;
      if (ahead != 0 && k % LINE == 0) _mm_prefetch(reinterpret_cast<const char*>(at + ahead), _MM_HINT_T0);
      const __m256 wv = load8(at);
      for (int m = 0; m < M; ++m) acc[p][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * in + k), acc[p][m]);
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int m = 0; m < M; ++m) {
      float sum = dots::sum8(acc[p][m]);
      for (int64_t j = k; j < in; ++j) sum += static_cast<float>(w[(r + p) * in + j]) * x[m * in + j];  // IN not a multiple of 8
      y[m * out + r + p] = sum;
    }
  }
}

// The M (<= MAX_ROWS) rows of x against every weight row. Up to 4 rows, the sets of weight rows are
// shared among the threads and each set meets the rows once. 5 to 8 rows meet the weight in panels
// (dots::panel_rows: a few sets that fit in half the core's L2), a thread taking whole panels: the
// first 4 rows pass over a panel's sets as it comes from memory, then the rest over the same sets from
// L2. Each pass holds its rows of x in L1 where they fit (4 rows of 1024 inputs: 16 KiB), where
// alternating 4 and 4 rows set by set cycled all 8 rows through L1 and read them from L2 for every set.
// The loops' order changes no sum: a row's output is the same bits in any batch.
template <int M, typename W>
void every_weight_row(const float* x, const W* w, float* y, int64_t out, int64_t in) {
  constexpr int FIRST = M <= 4 ? M : 4, REST = M - FIRST;
  constexpr int P = places<FIRST>();
  if constexpr (REST == 0) {
    dots::every_row<P>(out, [&](auto p, int64_t r) {
      constexpr int SET = decltype(p)::value;
      float_rows<M, SET>(x, w, y, out, in, r, r + (AHEAD + 1) * SET <= out ? AHEAD * SET * in : 0);
    });
  } else {
    constexpr int P2 = places<REST>();  // the second pass's sets: 4 weight rows for 1 or 2 rows
    const int64_t panel = dots::panel_rows(out, in * static_cast<int64_t>(sizeof(W)), std::max(P, P2));
    const int64_t panels = (out + panel - 1) / panel;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r0 = i * panel, r1 = std::min(out, r0 + panel);
        int64_t r = r0;
        for (; r + P <= r1; r += P) float_rows<FIRST, P>(x, w, y, out, in, r, r + (AHEAD + 1) * P <= out ? AHEAD * P * in : 0);
        for (; r < r1; ++r) float_rows<FIRST, 1>(x, w, y, out, in, r, 0);
        for (r = r0; r + P2 <= r1; r += P2) float_rows<REST, P2>(x + FIRST * in, w, y + FIRST * out, out, in, r, 0);
        for (; r < r1; ++r) float_rows<REST, 1>(x + FIRST * in, w, y + FIRST * out, out, in, r, 0);
      }
    });
  }
}

// y (rows, OUT) = x (rows, IN) @ w (OUT, IN).T, every pointer to contiguous memory, x and y float32, w
// float32 or bfloat16. More than MAX_ROWS rows go in passes of MAX_ROWS, each reading the weight again
// (the package sends prompts to the library's product instead).
template <typename W>
void rows_product(const float* x, int64_t rows, const W* w, int64_t out, int64_t in, float* y) {
  dots::in_passes<MAX_ROWS>(rows, [&](int64_t m0, auto m) {
    every_weight_row<decltype(m)::value>(x + m0 * in, w, y + m0 * out, out, in);
  });
}

void check_float32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

at::Tensor float_dots(const at::Tensor& x_in, const at::Tensor& weight) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 x and weight expected, got ",
              x_in.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the weight must be a contiguous (OUT, IN) matrix");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in, "x must be (rows, ", in, "), got ", x_in.sizes());
  const auto x = x_in.contiguous();
  auto y = at::empty({x.size(0), out}, x.options());
  rows_product(x.data_ptr<float>(), x.size(0), weight.data_ptr<float>(), out, in, y.data_ptr<float>());
  return y;
}

// y (rows, OUT) = x (rows, IN) @ weight (OUT, IN).T in bfloat16: float32 sums of the widened numbers,
// rounded once (file comment).
at::Tensor bfloat16_dots(const at::Tensor& x_in, const at::Tensor& weight) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bfloat16 x and weight expected, got ", x_in.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the weight must be a contiguous (OUT, IN) matrix");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in, "x must be (rows, ", in, "), got ", x_in.sizes());
  const auto x = x_in.to(at::kFloat).contiguous();
  auto y = at::empty({x.size(0), out}, x.options());
  rows_product(x.data_ptr<float>(), x.size(0), weight.data_ptr<at::BFloat16>(), out, in, y.data_ptr<float>());
  return y.to(at::kBFloat16);
}

// Mixtral's feed-forward on rows of one token each: out[b] = sum_j mix[b, j] * expert_{e[b, j]}(x[b]),
// expert_e(v) = w2[e] @ (silu(w1[e] @ v) * (w3[e] @ v)). The rows are grouped by expert here, so each
// chosen expert is read once, for the rows that chose it, where the stacked weights lie: fixed shapes
// for compiled steps, and no gathered copy of any weight.
// x (B, D); w1, w3 (E, I, D); w2 (E, D, I); experts (B, k) integers; mix (B, k).
at::Tensor float_experts(const at::Tensor& x_in, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2,
                         const at::Tensor& experts_in, const at::Tensor& mix_in) {
  for (const auto& [t, name] : {std::pair{x_in, "x"}, {w1, "w1"}, {w3, "w3"}, {w2, "w2"}}) check_float32(t, name);
  TORCH_CHECK(w1.dim() == 3 && w1.is_contiguous() && w3.sizes() == w1.sizes() && w3.is_contiguous(),
              "w1 and w3 must be contiguous (E, I, D) stacks of one shape");
  const int64_t n_experts = w1.size(0), hidden = w1.size(1), dim = w1.size(2);
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.size(0) == n_experts && w2.size(1) == dim && w2.size(2) == hidden,
              "w2 must be a contiguous (E, D, I) stack matching w1");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == dim, "x must be (rows, ", dim, "), got ", x_in.sizes());
  const int64_t batch = x_in.size(0);
  TORCH_CHECK(experts_in.dim() == 2 && experts_in.size(0) == batch && mix_in.sizes() == experts_in.sizes(),
              "experts and mixing weights must both be (rows, k)");
  const auto x = x_in.contiguous();
  const auto experts = experts_in.to(at::kLong).contiguous();
  const auto mix = mix_in.to(at::kFloat).contiguous();
  const int64_t k = experts.size(1);
  const int64_t* chosen = experts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> assigned(n_experts);  // expert e's assignments b * k + j
  for (int64_t a = 0; a < batch * k; ++a) {
    TORCH_CHECK(chosen[a] >= 0 && chosen[a] < n_experts, "experts must be in [0, ", n_experts, "), got ", chosen[a]);
    assigned[chosen[a]].push_back(a);
  }
  auto out = at::zeros({batch, dim}, x.options());
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* m = mix.data_ptr<float>();
  std::vector<float> rows, gate, up, down;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t n = static_cast<int64_t>(assigned[e].size());
    if (n == 0) continue;
    rows.resize(n * dim);
    gate.resize(n * hidden);
    up.resize(n * hidden);
    down.resize(n * dim);
    for (int64_t i = 0; i < n; ++i) std::copy_n(xp + assigned[e][i] / k * dim, dim, rows.data() + i * dim);
    rows_product(rows.data(), n, w1.data_ptr<float>() + e * hidden * dim, hidden, dim, gate.data());
    rows_product(rows.data(), n, w3.data_ptr<float>() + e * hidden * dim, hidden, dim, up.data());
    for (int64_t i = 0; i < n * hidden; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];  // silu(gate) * up
    rows_product(gate.data(), n, w2.data_ptr<float>() + e * dim * hidden, dim, hidden, down.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = assigned[e][i];
      float* row = o + a / k * dim;
      for (int64_t c = 0; c < dim; ++c) row[c] += m[a] * down[i * dim + c];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixtral_infer_dots, m) {
  m.def("float_dots(Tensor x, Tensor weight) -> Tensor");
  m.def("bfloat16_dots(Tensor x, Tensor weight) -> Tensor");
  m.def("float_experts(Tensor x, Tensor w1, Tensor w3, Tensor w2, Tensor experts, Tensor mix) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixtral_infer_dots, CPU, m) {
  m.impl("float_dots", float_dots);
  m.impl("bfloat16_dots", bfloat16_dots);
  m.impl("float_experts", float_experts);
}
