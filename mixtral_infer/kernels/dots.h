// What the package's dot-product kernels share (int_dots.cpp, float_dots.cpp): how decoding's few
// activation rows pass over every weight row, spread over the threads, and the sum of a vector's lanes.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dots {

constexpr int64_t MAX_ROWS = 8;  // activation rows per pass over the weight
// Each pass over a set of P weight rows asks for the same bytes of the set AHEAD sets on (one cache line
// a time): a thread reads its rows set after set, and short rows read in step defeat the hardware's
// stream detection, so a decode product otherwise waits on memory (docs/performance.md, section 6).
constexpr int64_t AHEAD = 2;

inline float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Calls rows(P-as-a-constant, r) for every weight row r, P rows at a time, then one at a time for the
// rest; the sets of rows shared among the threads.
template <int P, typename Rows>
void every_row(int64_t out, const Rows& rows) {
  const int64_t sets = out / P;
  at::parallel_for(0, sets, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rows(std::integral_constant<int, P>{}, i * P);
  });
  for (int64_t r = sets * P; r < out; ++r) rows(std::integral_constant<int, 1>{}, r);
}

// pass(m0, M-as-a-constant): the activation rows in passes of at most MOST (<= 8) rows.
template <int MOST, typename Pass>
void in_passes(int64_t rows, const Pass& pass) {
  static_assert(MOST >= 1 && MOST <= 8);
  for (int64_t m0 = 0; m0 < rows; m0 += MOST) {
    const int64_t m = std::min<int64_t>(rows - m0, MOST);
    if (m == MOST) { pass(m0, std::integral_constant<int, MOST>{}); continue; }
    switch (m) {
      case 1: pass(m0, std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (MOST > 2) pass(m0, std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (MOST > 3) pass(m0, std::integral_constant<int, 3>{}); break;
      case 4: if constexpr (MOST > 4) pass(m0, std::integral_constant<int, 4>{}); break;
      case 5: if constexpr (MOST > 5) pass(m0, std::integral_constant<int, 5>{}); break;
      case 6: if constexpr (MOST > 6) pass(m0, std::integral_constant<int, 6>{}); break;
      default: if constexpr (MOST > 7) pass(m0, std::integral_constant<int, 7>{});
    }
  }
}

// The core's L2 cache in bytes, as the system reports it.
inline int64_t level2_bytes() {
  const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return reported > 0 ? reported : 256 * 1024;  // unreported: the smallest L2 of current x86 cores
}

// Weight rows a panel: at most half the core's L2 cache of rows of row_bytes (at least tp rows, where
// one row is wider than that), a multiple of tp, and small enough that each thread has at least 4.
// Example: a 4096-input int8 weight (4 KiB a row) on a core with 512 KiB of L2 has panels of 64 rows;
// 14336 inputs, of 18 (multiples of tp = 2).
inline int64_t panel_rows(int64_t out, int64_t row_bytes, int64_t tp) {
  static const int64_t cache = level2_bytes();
  const int64_t fits = cache / 2 / std::max<int64_t>(row_bytes, 1) / tp * tp;  // no inputs: any panel
  const int64_t shared = (out + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  return std::max<int64_t>(tp, std::min(fits, (shared + tp - 1) / tp * tp));
}

}  // namespace dots
