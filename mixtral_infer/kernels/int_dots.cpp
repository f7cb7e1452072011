// Integer dot products for int8 and int4 weights on x86 CPUs: the activations quantized to int8 per
// block of 32 inputs (as llama.cpp's Q8_0 products do), multiplied by the weights' stored bytes in
// integers, each block's 32-bit sum scaled once (int4 adds its nibbles' offset once a block as well,
// below). kernels/native.py builds this file with the
// machine's own compiler (-march=native), so the same source gives AVX512-VNNI or AVX-VNNI dot
// products where the CPU has them and AVX2's pairwise products elsewhere; kernels/linear/int_dots.py
// is the weight back-end that calls the two operators.
//
// int8: y[m, r] = s[r] * sum_b d[m, b] * sum_{k in b} q[m, k] * w[r, k]
//   x (M, IN), w (OUT, IN) int8, s (OUT,) one scale a row.
// int4: y[m, r] = sum_b d[m, b] * s[r, g(b)] * sum_{k in b} q[m, k] * (n[r, k] - 8)
//   n the nibbles as the package stores them (quant/weights.py): byte j of a row holds input 2j in its
//   low nibble and 2j + 1 in its high one, each the integer plus 8; s one scale a group of G inputs
//   (G a multiple of 32). Each row holds its scales inline (fast/int4_inline.py): chunks of 256 inputs,
//   a chunk the 256 / G scales of its groups (bfloat16 or float32) then its 128 bytes of nibbles, so a
//   row read is one stream of memory.
// q, d: each row of x quantized per block of 32: d = max|x| / 127, q = round(x * 127 / max|x|); a block
// of zeros, or one so small that 127 / max|x| overflows (max|x| below about 7e-37), has q = 0.
// int4 computes its sum as sum_b d s (sum_k q n - 8 sum_k q), the two terms rounded to float each: exact
// to float32's rounding of the terms, which may cancel (an all-zero weight row gives about 1e-4, not 0).
//
// No pair of int8 products saturates in AVX2's 16-bit sums: |q| <= 127, and the unsigned operand is
// |w| <= 128 or a nibble <= 15, so a pair is at most 2 * 128 * 127 = 32512 < 32767.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "dots.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per activation scale
constexpr int64_t CHUNK = 256;  // int4: inputs a chunk of a row (fast/int4_inline.py)
using dots::AHEAD;
using dots::MAX_ROWS;  // more rows go in panels (in_panels)
using dots::every_row;
using dots::in_passes;
using dots::panel_rows;
using dots::sum8;
// Prompt chunks' tiles (in_panels), activation rows by weight rows: int8 keeps 4 x 2 accumulators,
// int4 4 x 1 and as many block scales, in AVX2's 16 registers (docs/performance.md, section 6).
constexpr int INT8_TILE_M = 4, INT8_TILE_P = 2;
constexpr int INT4_TILE_M = 4, INT4_TILE_P = 1;

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

// Weight rows read at once for M activation rows: 16 vector registers hold P * M accumulators.
template <int M> constexpr int places() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

inline float max8(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

// 8 values from p as floats.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the high 16 bits of a float32
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  } else {
    alignas(32) float f[8];
    for (int k = 0; k < 8; ++k) f[k] = static_cast<float>(p[k]);
    return _mm256_load_ps(f);
  }
}

// One block of 32 values: q its integers, the return value its d.
template <typename T>
inline float quantize_block(const T* xb, int8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(xb + 8 * i);
    const __m256 a = _mm256_and_ps(v[i], magnitude);
    top = _mm256_max_ps(top, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ));  // NaN or inf
  }
  // A NaN or inf activation makes its block's scale NaN, so every product it enters is NaN, as the
  // weight-only product is (a bad model is caught downstream), and its integers 0, not undefined.
  if (_mm256_movemask_ps(bad) != 0) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float amax = max8(top);
  const float scale = 127.f / amax;  // inf for 0 and for tiny blocks: their integers 0, not -128
  const __m256 inverse = _mm256_set1_ps(scale <= std::numeric_limits<float>::max() ? scale : 0.f);
  __m256i n[4];  // rounded to the nearest, ties to even (as std::nearbyint)
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // packs work within 128-bit halves: bytes come out as 4-value groups 0 2 4 6 1 3 5 7, put back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return amax / 127.f;
}

// Each row of x (M, IN) as int8 q and float d per block (above), the rows shared among the threads.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in, int8_t* q, float* d) {
  const int64_t blocks = in / BLOCK;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b) d[m * blocks + b] = quantize_block(x + m * in + b * BLOCK, q + m * in + b * BLOCK);
  });
}

// Weight rows r..r+P-1 against the M activation rows.
template <int M, int P, typename S>
void int8_rows(const int8_t* q, const float* d, const int8_t* w, const S* s, float* y,
               int64_t out, int64_t in, int64_t r, bool fetch) {
  const int64_t blocks = in / BLOCK;
  __m256 acc[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int p = 0; p < P; ++p) {
      const int8_t* at = w + (r + p) * in + b * BLOCK;
      if (fetch && b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + AHEAD * P * in), _MM_HINT_T0);
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
// block's offset, -8 times the sum of its 32 inputs: times the block's scale it takes the nibbles'
// 8 out, once for 8 blocks, where the integer sums are of the nibbles as they are.
struct SplitRows {
  std::vector<int8_t> even, odd;  // (M, IN/2) each
  std::vector<float> offsets;  // (M, IN/32)
};

// Rows m0.. of SplitRows (M rows, IN inputs).
struct SplitView {
  const int8_t* even;
  const int8_t* odd;
  const float* offsets;
};

SplitView view(const SplitRows& split, int64_t m0, int64_t in) {
  return {split.even.data() + m0 * in / 2, split.odd.data() + m0 * in / 2, split.offsets.data() + m0 * in / BLOCK};
}

SplitRows split_rows(const int8_t* q, int64_t rows, int64_t in) {
  SplitRows split{std::vector<int8_t>(rows * in / 2), std::vector<int8_t>(rows * in / 2), std::vector<float>(rows * in / BLOCK)};
  // Within each 128-bit half: its 8 even bytes, then its 8 odd ones.
  const __m256i parity = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t c = 0; c < in; c += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * in + c));
        const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, parity), 0xD8);  // evens | odds
        _mm_storeu_si128(reinterpret_cast<__m128i*>(split.even.data() + (m * in + c) / 2), _mm256_castsi256_si128(halves));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(split.odd.data() + (m * in + c) / 2), _mm256_extracti128_si256(halves, 1));
        // The block's sum: 8 sums of 4 bytes, then of the 8.
        const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(fours), _mm256_extracti128_si256(fours, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
        split.offsets[(m * in + c) / BLOCK] = -8.f * static_cast<float>(_mm_cvtsi128_si32(sum));
      }
    }
  });
  return split;
}

// int4 rows with their scales inline (fast/int4_inline.py): row r starts at w + r * row; its chunk of
// inputs c..c+255 (c a multiple of 256) `chunk` bytes later each, `head` bytes of scales of type S first.
template <typename S>
struct Int4Rows {
  const uint8_t* w;
  int64_t row, chunk, head, group;
};

// The scales of the 8 blocks of a chunk (s[g(b)], g(b) = 32 b / G, from its inline scales) as floats:
// one load where each block has its own scale (G = 32), else each read.
template <typename S>
inline __m256 block_scales8(const S* chunk, int64_t group) {
  if (group == BLOCK) return load8(chunk);
  alignas(32) float f[8];
  for (int k = 0; k < 8; ++k) f[k] = static_cast<float>(chunk[k * BLOCK / group]);
  return _mm256_load_ps(f);
}

// 64 inputs from c of M activation rows against P weight rows, `nibbles[p]` their bytes: acc[p][m] +
// each block's integer sum with the nibbles times its scale, sd[p][m] (8 blocks' d * s from c0) permuted
// by `order` so that lanes 0-3 hold block c / 32's and lanes 4-7 the next one's. `ahead`: the bytes
// from a row to the one the prefetch asks for, or 0.
template <int M, int P>
inline void int4_step(const SplitView& x, const uint8_t* const (&nibbles)[P], int64_t half, int64_t c, int64_t ahead,
                      const __m256 (&sd)[P][M], __m256i order, __m256 (&acc)[P][M]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < P; ++p) {
    if (ahead != 0 && c % 128 == 0) _mm_prefetch(reinterpret_cast<const char*>(nibbles[p] + ahead), _MM_HINT_T0);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles[p]));
    const __m256i low = _mm256_and_si256(bytes, low4);  // inputs c + 2j
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);  // inputs c + 2j + 1
    for (int m = 0; m < M; ++m) {
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.even + m * half + c / 2));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.odd + m * half + c / 2));
      const __m256i dots = dot8_nibbles(_mm256_setzero_si256(), low, even, high, odd);  // lanes 0-3: block c/32, 4-7: the next
      acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_permutevar8x32_ps(sd[p][m], order), acc[p][m]);
    }
  }
}

template <int M, int P, typename S>
void int4_rows(const SplitView& x, const float* d, const Int4Rows<S>& w, float* y, int64_t out, int64_t in, int64_t r, bool fetch) {
  const int64_t blocks = in / BLOCK, half = in / 2, group = w.group, ahead = fetch ? AHEAD * P * w.row : 0;
  __m256 acc[P][M], sd[P][M];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  // Lanes 0-3 from block 2j of the 8, lanes 4-7 from block 2j + 1, for the j-th 64 inputs of 256.
  const __m256i order[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  const uint8_t* chunk[P];  // each weight row's chunk of the inputs c0..c0+255
  for (int p = 0; p < P; ++p) chunk[p] = w.w + (r + p) * w.row;
  int64_t c0 = 0;
  for (; c0 + CHUNK <= in; c0 += CHUNK) {  // a chunk: its 8 blocks' scales d * s and offsets once, then 4 steps of 64
    const uint8_t* nibbles[P];
    for (int p = 0; p < P; ++p) {
      const __m256 sv = block_scales8(reinterpret_cast<const S*>(chunk[p]), group);
      nibbles[p] = chunk[p] + w.head;
      chunk[p] += w.chunk;
      for (int m = 0; m < M; ++m) {
        sd[p][m] = _mm256_mul_ps(sv, _mm256_loadu_ps(d + m * blocks + c0 / BLOCK));
        acc[p][m] = _mm256_fmadd_ps(sd[p][m], _mm256_loadu_ps(x.offsets + m * blocks + c0 / BLOCK), acc[p][m]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      int4_step<M, P>(x, nibbles, half, c0 + 64 * j, ahead, sd, order[j], acc);
      for (int p = 0; p < P; ++p) nibbles[p] += 32;
    }
  }
  for (int64_t c = c0; c < in; c += 64) {  // the last chunk's 64-192 inputs where IN is not a multiple of 256
    const uint8_t* nibbles[P];
    for (int p = 0; p < P; ++p) {
      const S* scales = reinterpret_cast<const S*>(chunk[p]);
      const float s0 = static_cast<float>(scales[c % CHUNK / group]);
      const float s1 = static_cast<float>(scales[(c % CHUNK + BLOCK) / group]);
      nibbles[p] = chunk[p] + w.head + c % CHUNK / 2;
      for (int m = 0; m < M; ++m) {
        const float* db = d + m * blocks + c / BLOCK;
        const float* ob = x.offsets + m * blocks + c / BLOCK;
        sd[p][m] = _mm256_setr_ps(s0 * db[0], s1 * db[1], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
        acc[p][m] = _mm256_fmadd_ps(sd[p][m], _mm256_setr_ps(ob[0], ob[1], 0.f, 0.f, 0.f, 0.f, 0.f, 0.f), acc[p][m]);
      }
    }
    int4_step<M, P>(x, nibbles, half, c, ahead, sd, order[0], acc);
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) y[m * out + r + p] = sum8(acc[p][m]);
}

// Prompt chunks (more than MAX_ROWS rows) in panels: the weight rows cut into panels of at most half
// the core's L2 cache (at least TP rows, where one row is wider than that), and each panel met by
// every activation row, TM rows at a time against TP weight rows at a time, while it stays in that
// cache (dots::panel_rows). The weight is read from memory once for all the rows, where decoding's
// passes read it once each MAX_ROWS rows. A thread takes whole panels.
// tile(m0, M-as-a-constant, r, P-as-a-constant, fetch) over every activation row and weight row.
template <int TM, int TP, typename Tile>
void in_panels(int64_t rows, int64_t out, int64_t row_bytes, const Tile& tile) {
  const int64_t panel = panel_rows(out, row_bytes, TP), panels = (out + panel - 1) / panel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i * panel, r1 = std::min(out, r0 + panel);
      in_passes<TM>(rows, [&](int64_t m0, auto m) {
        int64_t r = r0;
        for (; r + TP <= r1; r += TP) tile(m0, m, r, std::integral_constant<int, TP>{}, false);
        for (; r < r1; ++r) tile(m0, m, r, std::integral_constant<int, 1>{}, false);
      });
    }
  });
}

// tile(m0, M-as-a-constant, r, P-as-a-constant, fetch) over every activation row and weight row:
// decoding's passes (every weight row for up to MAX_ROWS rows, prefetching), prompt chunks' panels beyond.
template <int TM, int TP, typename Tile>
void every_tile(int64_t rows, int64_t out, int64_t row_bytes, const Tile& tile) {
  if (rows > MAX_ROWS) return in_panels<TM, TP>(rows, out, row_bytes, tile);
  in_passes<MAX_ROWS>(rows, [&](int64_t m0, auto m) {
    every_row<places<decltype(m)::value>()>(out, [&](auto p, int64_t r) { tile(m0, m, r, p, r + (AHEAD + 1) * decltype(p)::value <= out); });
  });
}

// Expert e of a stacked tensor (E, ...) where an expert index is given (a view, read in place), else the tensor.
at::Tensor picked(const std::optional<at::Tensor>& expert, const at::Tensor& stacked) {
  if (!expert.has_value()) return stacked;
  const int64_t e = expert->item<int64_t>();
  TORCH_CHECK(e >= 0 && e < stacked.size(0), "expert ", e, " of ", stacked.size(0));
  return stacked.select(0, e);
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
  values = picked(expert, values);
  scales = picked(expert, scales);
  const int64_t out = values.size(0), in = values.size(1), rows = x_in.size(0), blocks = in / BLOCK;
  const auto x = x_in.contiguous();
  check(x, values, in, BLOCK);
  TORCH_CHECK(values.scalar_type() == at::kChar, "int8 values expected");
  scales = scales.contiguous();
  auto [q, d] = quantized(x);
  auto y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  const int8_t* w = values.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "int8_dots", [&] {
    const scalar_t* s = scales.data_ptr<scalar_t>();
    // Rows m0.. against weight rows r..r+P-1.
    const auto tile = [&](int64_t m0, auto m, int64_t r, auto p, bool fetch) {
      int8_rows<decltype(m)::value, decltype(p)::value>(q.data_ptr<int8_t>() + m0 * in, d.data_ptr<float>() + m0 * blocks,
                                                        w, s, y.data_ptr<float>() + m0 * out, out, in, r, fetch);
    };
    every_tile<INT8_TILE_M, INT8_TILE_P>(rows, out, in, tile);
  });
  return y.to(x.scalar_type());
}

// x (M, IN) against int4 rows (OUT, row bytes) of IN inputs with their scales inline
// (fast/int4_inline.py), the scales bfloat16 or float32 as the rows' width says.
at::Tensor int4_dots(const at::Tensor& x_in, at::Tensor rows, int64_t in_features, int64_t group, const std::optional<at::Tensor>& expert) {
  rows = picked(expert, rows);
  TORCH_CHECK(in_features % 64 == 0, "int4 rows of a multiple of 64 inputs expected, got ", in_features);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "x must be (rows, ", in_features, "), got ", x_in.sizes());
  const auto x = x_in.contiguous();
  const int64_t out = rows.size(0), in = x.size(1), count = x.size(0), blocks = in / BLOCK;
  TORCH_CHECK(group % BLOCK == 0 && group <= CHUNK && in % group == 0, "groups of a multiple of 32 inputs expected, got ", group);
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(), "int4 rows expected as contiguous bytes (uint8)");
  const int64_t chunks = (in + CHUNK - 1) / CHUNK, chunk = rows.size(1) / chunks, head = chunk - CHUNK / 2;
  const bool wide = head == CHUNK / group * 4;  // float32 scales, else bfloat16
  TORCH_CHECK(chunk * chunks == rows.size(1) && (wide || head == CHUNK / group * 2),
              "rows of ", rows.size(1), " bytes are not the inline layout of ", in, " inputs in groups of ", group);
  auto [q, d] = quantized(x);
  const SplitRows split = split_rows(q.data_ptr<int8_t>(), count, in);
  auto y = at::empty({count, out}, x.options().dtype(at::kFloat));
  const auto run = [&](auto scale) {
    using S = decltype(scale);
    const Int4Rows<S> w{rows.data_ptr<uint8_t>(), rows.size(1), chunk, head, group};
    const auto tile = [&](int64_t m0, auto m, int64_t r, auto p, bool fetch) {
      int4_rows<decltype(m)::value, decltype(p)::value>(view(split, m0, in), d.data_ptr<float>() + m0 * blocks, w,
                                                        y.data_ptr<float>() + m0 * out, out, in, r, fetch);
    };
    every_tile<INT4_TILE_M, INT4_TILE_P>(count, out, rows.size(1), tile);
  };
  if (wide) run(float{});
  else run(c10::BFloat16{});
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(mixtral_infer_dots, m) {
  m.def("int8_dots(Tensor x, Tensor values, Tensor scales, Tensor? expert=None) -> Tensor");
  m.def("int4_dots(Tensor x, Tensor rows, int in_features, int group_size, Tensor? expert=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mixtral_infer_dots, CPU, m) {
  m.impl("int8_dots", int8_dots);
  m.impl("int4_dots", int4_dots);
}
