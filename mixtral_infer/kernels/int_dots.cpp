// Integer dot products for int8 and int4 weights on x86 CPUs: the activations quantized to int8 per
// block of 32 inputs (as llama.cpp's Q8_0 products do), multiplied by the weights' stored bytes in
// integers, each block's 32-bit sum scaled once. kernels/native.py builds this file with the
// machine's own compiler (-march=native), so the same source gives AVX512-VNNI or AVX-VNNI dot
// products where the CPU has them and AVX2's pairwise products elsewhere; kernels/linear/int_dots.py
// is the weight back-end that calls the two operators.
//
// int8: y[m, r] = s[r] * sum_b d[m, b] * sum_{k in b} q[m, k] * w[r, k]
//   x (M, IN), w (OUT, IN) int8, s (OUT,) one scale a row.
// int4: y[m, r] = sum_b d[m, b] * s[r, g(b)] * sum_{k in b} q[m, k] * (n[r, k] - 8)
//   n the nibbles as the package stores them (quant/weights.py): byte j of a row holds input 2j in its
//   low nibble and 2j + 1 in its high one, each the integer plus 8; s (OUT, IN/G) one scale a group
//   of G inputs (G a multiple of 32).
// q, d: each row of x quantized per block of 32: d = max|x| / 127, q = round(x * 127 / max|x|).
//
// No pair of int8 products saturates in AVX2's 16-bit sums: |q| <= 127, and the unsigned operand is
// |w| <= 128 or a nibble <= 15, so a pair is at most 2 * 128 * 127 = 32512 < 32767.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per activation scale
constexpr int64_t MAX_ROWS = 8;  // activation rows per pass over the weight
// Each pass over a set of P weight rows asks for the same bytes of the set AHEAD sets on (one cache line
// a time): a thread reads its rows set after set, and short rows read in step defeat the hardware's
// stream detection, so a decode product otherwise waits on memory (docs/performance.md, section 6).
constexpr int64_t AHEAD = 2;

// acc + in each 32-bit lane the sum of its 4 products u * s (u unsigned bytes, s signed).
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // 16 lanes, each the sum of 2 products
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// acc + in each 32-bit lane the sum of its 8 products u0 * s0 and u1 * s1, u0 and u1 nibbles (<= 15):
// AVX2 adds the pairs of both in 16 bits first (each pair at most 2 * 15 * 127 = 3810, so two 7620).
inline __m256i dot8_nibbles(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return dot4(dot4(acc, u0, s0), u1, s1);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Weight rows read at once for M activation rows: 16 vector registers hold P * M accumulators.
template <int M> constexpr int places() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// Each row of x (M, IN) as int8 q and float d per block (above).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in, int8_t* q, float* d) {
  const int64_t blocks = in / BLOCK;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* xb = x + m * in + b * BLOCK;
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const float v = static_cast<float>(xb[i]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      // A NaN or inf activation makes its block's scale NaN, so every product it enters is NaN, as the
      // weight-only product is (a bad model is caught downstream), and its integers 0, not undefined.
      const float inverse = finite && amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = 0; i < BLOCK; ++i)
        q[m * in + b * BLOCK + i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[i]) * inverse));
      d[m * blocks + b] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    }
  }
}

// Weight rows r..r+P-1 against the M activation rows.
template <int M, int P, typename S>
void int8_rows(const int8_t* q, const float* d, const int8_t* w, const S* s, float* y,
               int64_t out, int64_t in, int64_t r) {
  const int64_t blocks = in / BLOCK;
  __m256 acc[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int p = 0; p < P; ++p) {
      const int8_t* at = w + (r + p) * in + b * BLOCK;
      if (b % 2 == 0 && r + (AHEAD + 1) * P <= out) _mm_prefetch(reinterpret_cast<const char*>(at + AHEAD * P * in), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      const __m256i magnitude = _mm256_sign_epi8(wv, wv);  // |w|, unsigned
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * in + b * BLOCK));
        const __m256i dots = dot4(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(xv, wv));  // x * sign(w)
        acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_broadcast_ss(d + m * blocks + b), acc[p][m]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) y[m * out + r + p] = static_cast<float>(s[r + p]) * sum8(acc[p][m]);
}

// int4: the row's inputs split by parity per 64 (even: low nibbles, odd: high ones), and each
// 32-bit lane's start, -8 times the sum of its 8 inputs (which takes the nibbles' 8 out).
struct SplitRows {
  std::vector<int8_t> even, odd;  // (M, IN/2) each
  std::vector<int32_t> start;  // (M, IN/8)
};

SplitRows split_rows(const int8_t* q, int64_t rows, int64_t in) {
  SplitRows split{std::vector<int8_t>(rows * in / 2), std::vector<int8_t>(rows * in / 2), std::vector<int32_t>(rows * in / 8)};
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < in / 2; ++j) {
      split.even[m * in / 2 + j] = q[m * in + 2 * j];
      split.odd[m * in / 2 + j] = q[m * in + 2 * j + 1];
    }
    // Lane i of the 64 inputs from c: even inputs 8i..8i+6 and odd ones 8i+1..8i+7 (bytes 4i..4i+3).
    for (int64_t lane = 0; lane < in / 8; ++lane) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 8; ++k) sum += q[m * in + lane * 8 + k];
      split.start[m * in / 8 + lane] = -8 * sum;
    }
  }
  return split;
}

// The scales of the 8 blocks of inputs c0..c0+255 of one weight row (s[g(b)], g(b) = 32 b / G) as
// floats: one load where each block has its own scale in bfloat16 or float32 (G = 32), else each read.
template <typename S>
inline __m256 block_scales8(const S* row, int64_t c0, int64_t group) {
  if (group == BLOCK) {
    if constexpr (std::is_same_v<S, c10::BFloat16>) {  // bfloat16: the high 16 bits of a float32
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0 / BLOCK));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    } else if constexpr (std::is_same_v<S, float>) {
      return _mm256_loadu_ps(row + c0 / BLOCK);
    }
  }
  alignas(32) float f[8];
  for (int k = 0; k < 8; ++k) f[k] = static_cast<float>(row[(c0 + k * BLOCK) / group]);
  return _mm256_load_ps(f);
}

// 64 inputs from c of M activation rows against P weight rows: acc[p][m] + each block's integer sum
// times its scale, sd[p][m] (8 blocks' d * s from c0) permuted so that lanes 0-3 hold block `first`'s
// and lanes 4-7 the next one's.
template <int M, int P>
inline void int4_step(const SplitRows& x, const uint8_t* w, int64_t half, int64_t in, int64_t c, int64_t r, bool fetch,
                      const __m256 (&sd)[P][M], __m256i order, __m256 (&acc)[P][M]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < P; ++p) {
    const uint8_t* at = w + (r + p) * half + c / 2;
    if (fetch && c % 128 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + AHEAD * P * half), _MM_HINT_T0);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256i low = _mm256_and_si256(bytes, low4);  // inputs c + 2j
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);  // inputs c + 2j + 1
    for (int m = 0; m < M; ++m) {
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.even.data() + m * half + c / 2));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.odd.data() + m * half + c / 2));
      const __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.start.data() + m * (in / 8) + c / 8));
      const __m256i dots = dot8_nibbles(start, low, even, high, odd);  // lanes 0-3: block c/32, 4-7: the next
      acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_permutevar8x32_ps(sd[p][m], order), acc[p][m]);
    }
  }
}

template <int M, int P, typename S>
void int4_rows(const SplitRows& x, const float* d, const uint8_t* w, const S* s, float* y,
               int64_t out, int64_t in, int64_t group, int64_t r) {
  const int64_t blocks = in / BLOCK, groups = in / group, half = in / 2;
  __m256 acc[P][M], sd[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  // Lanes 0-3 from block 2j of the 8, lanes 4-7 from block 2j + 1, for the j-th 64 inputs of 256.
  const __m256i order[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  const bool fetch = r + (AHEAD + 1) * P <= out;
  int64_t c0 = 0;
  for (; c0 + 256 <= in; c0 += 256) {  // 8 blocks: their scales d * s made once, then 4 steps of 64
    for (int p = 0; p < P; ++p) {
      const __m256 sv = block_scales8(s + (r + p) * groups, c0, group);
      for (int m = 0; m < M; ++m) sd[p][m] = _mm256_mul_ps(sv, _mm256_loadu_ps(d + m * blocks + c0 / BLOCK));
    }
    for (int j = 0; j < 4; ++j) int4_step<M, P>(x, w, half, in, c0 + 64 * j, r, fetch, sd, order[j], acc);
  }
  for (int64_t c = c0; c < in; c += 64) {  // the last 64-192 inputs where IN is not a multiple of 256
    for (int p = 0; p < P; ++p) {
      const float s0 = static_cast<float>(s[(r + p) * groups + c / group]);
      const float s1 = static_cast<float>(s[(r + p) * groups + (c + BLOCK) / group]);
      for (int m = 0; m < M; ++m) {
        const float* db = d + m * blocks + c / BLOCK;
        sd[p][m] = _mm256_setr_ps(s0 * db[0], s1 * db[1], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
      }
    }
    int4_step<M, P>(x, w, half, in, c, r, fetch, sd, order[0], acc);
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) y[m * out + r + p] = sum8(acc[p][m]);
}

// Calls rows(P-as-a-constant, r) for every weight row r, P rows at a time (places<M>), then one at a
// time for the rest; the sets of rows shared among the threads.
template <int M, typename Rows>
void every_row(int64_t out, const Rows& rows) {
  constexpr int P = places<M>();
  const int64_t sets = out / P;
  at::parallel_for(0, sets, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rows(std::integral_constant<int, P>{}, i * P);
  });
  for (int64_t r = sets * P; r < out; ++r) rows(std::integral_constant<int, 1>{}, r);
}

// rows(m0, M-as-a-constant): the activation rows in passes of at most MAX_ROWS.
template <typename Pass>
void in_passes(int64_t rows, const Pass& pass) {
  for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) {
    switch (std::min(rows - m0, MAX_ROWS)) {
      case 1: pass(m0, std::integral_constant<int, 1>{}); break;
      case 2: pass(m0, std::integral_constant<int, 2>{}); break;
      case 3: pass(m0, std::integral_constant<int, 3>{}); break;
      case 4: pass(m0, std::integral_constant<int, 4>{}); break;
      case 5: pass(m0, std::integral_constant<int, 5>{}); break;
      case 6: pass(m0, std::integral_constant<int, 6>{}); break;
      case 7: pass(m0, std::integral_constant<int, 7>{}); break;
      default: pass(m0, std::integral_constant<int, 8>{});
    }
  }
}

// Expert e of stacked weights (E, ...) where an expert index is given: views, read in place.
void pick_expert(const std::optional<at::Tensor>& expert, at::Tensor& values, at::Tensor& scales) {
  if (!expert.has_value()) return;
  const int64_t e = expert->item<int64_t>();
  TORCH_CHECK(e >= 0 && e < values.size(0), "expert ", e, " of ", values.size(0));
  values = values.select(0, e);
  scales = scales.select(0, e);
}

// x (M, IN) float32, bfloat16 or float16 -> q (M, IN) int8 and d (M, IN/32) float32.
std::pair<at::Tensor, at::Tensor> quantized(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  auto q = at::empty({rows, in}, x.options().dtype(at::kChar));
  auto d = at::empty({rows, in / BLOCK}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), rows, in, q.data_ptr<int8_t>(), d.data_ptr<float>());
  });
  return {q, d};
}

void check(const at::Tensor& x, const at::Tensor& values, int64_t in, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "x must be (rows, ", in, "), got ", x.sizes());
  TORCH_CHECK(in % multiple == 0, "inputs must be a multiple of ", multiple, ", got ", in);
  TORCH_CHECK(values.is_contiguous(), "the weight's bytes must be contiguous");
}

at::Tensor int8_dots(const at::Tensor& x_in, at::Tensor values, at::Tensor scales, const std::optional<at::Tensor>& expert) {
  pick_expert(expert, values, scales);
  const int64_t out = values.size(0), in = values.size(1);
  const auto x = x_in.contiguous();
  check(x, values, in, BLOCK);
  TORCH_CHECK(values.scalar_type() == at::kChar, "int8 values expected");
  scales = scales.contiguous();
  auto [q, d] = quantized(x);
  auto y = at::empty({x.size(0), out}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "int8_dots", [&] {
    const scalar_t* s = scales.data_ptr<scalar_t>();
    in_passes(x.size(0), [&](int64_t m0, auto rows) {
      const int8_t* qm = q.data_ptr<int8_t>() + m0 * in;
      const float* dm = d.data_ptr<float>() + m0 * (in / BLOCK);
      float* ym = y.data_ptr<float>() + m0 * out;
      constexpr int M = decltype(rows)::value;
      every_row<M>(out, [&](auto p, int64_t r) {
        int8_rows<M, decltype(p)::value>(qm, dm, values.data_ptr<int8_t>(), s, ym, out, in, r);
      });
    });
  });
  return y.to(x.scalar_type());
}

at::Tensor int4_dots(const at::Tensor& x_in, at::Tensor values, at::Tensor scales, int64_t group,
                     const std::optional<at::Tensor>& expert) {
  pick_expert(expert, values, scales);
  const int64_t out = values.size(0), in = 2 * values.size(1);
  const auto x = x_in.contiguous();
  check(x, values, in, 64);
  TORCH_CHECK(values.scalar_type() == at::kByte, "int4 values expected as bytes (uint8)");
  TORCH_CHECK(group % BLOCK == 0 && in % group == 0, "groups of a multiple of 32 inputs expected, got ", group);
  scales = scales.contiguous();
  auto [q, d] = quantized(x);
  auto y = at::empty({x.size(0), out}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "int4_dots", [&] {
    const scalar_t* s = scales.data_ptr<scalar_t>();
    in_passes(x.size(0), [&](int64_t m0, auto rows) {
      constexpr int M = decltype(rows)::value;
      const SplitRows split = split_rows(q.data_ptr<int8_t>() + m0 * in, M, in);
      const float* dm = d.data_ptr<float>() + m0 * (in / BLOCK);
      float* ym = y.data_ptr<float>() + m0 * out;
      every_row<M>(out, [&](auto p, int64_t r) {
        int4_rows<M, decltype(p)::value>(split, dm, values.data_ptr<uint8_t>(), s, ym, out, in, group, r);
      });
    });
  });
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(mixtral_infer_dots, m) {
  m.def("int8_dots(Tensor x, Tensor values, Tensor scales, Tensor? expert=None) -> Tensor");
  m.def("int4_dots(Tensor x, Tensor values, Tensor scales, int group_size, Tensor? expert=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixtral_infer_dots, CPU, m) {
  m.impl("int8_dots", int8_dots);
  m.impl("int4_dots", int4_dots);
}
