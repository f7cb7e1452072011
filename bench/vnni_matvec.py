"""What would integer dot products written by hand buy on CPU? A measurement for a decision.

    python bench/vnni_matvec.py [--shape 3584 1024] [--weights 96] [--rounds 7]

The quantization issue asks for kernels from the field; on CPU none of them multiplies int8 or
int4 weights faster than our int8 reductions (``fast/cpu_reductions.py``: each int8 weight
converted to float32, then a multiply-add), which is why int8 stays under llama.cpp's Q8_0 and
int4 under 1.3x our int8 (``bench/PERFORMANCE_LOG.md``). llama.cpp quantizes the activations to
8 bits and multiplies integers with VNNI (``vpdpbusd``: 64 byte products summed four by four in
one instruction). This script compiles such a matrix-vector product here (a few dozen lines of
C++, ``torch.utils.cpp_extension.load_inline``; not part of the package) and times it against
what the package runs, one bfloat16 row times ``--weights`` weights in turn (more than the caches
hold at the defaults), medians of ``--rounds``:

* ``int8 reductions``: ``rows_as_reductions`` compiled, int8 weights, one scale a row (ours);
* ``int4 kernel``: PyTorch's ``_weight_int4pack_mm_for_cpu``, groups of 32 (ours);
* ``int8 vnni``: the row quantized to int8 (``round(127 x / max|x|)``, as ``w8a8`` does), plus
  128 to make it unsigned; ``vpdpbusd`` against the int8 weight; ``- 128 * sum(w_row)`` (kept
  per row, 4 bytes) takes the 128 out; times the two scales. Summing the row as it is read (a
  second ``vpdpbusd``, against ones) instead made it slower: 25.5-26.0 GB/s against 29-30;
* ``int4 vnni``: the same row, signed, against int4 weights held as ``q + 8`` (0..15, unsigned),
  two a byte: byte ``j`` of each 64 inputs holds input ``j`` low and ``j + 32`` high, so a mask
  and a shift give the 64 in order. Each 32-bit lane of ``vpdpbusd`` sums 4 products, so a lane
  lies in one group of 32; it starts from ``-8 * sum`` of its 4 inputs (computed once per row),
  which takes the 8 out, then is converted and multiplied by its group's scale.

Every way's output is checked against the dequantized weight (and each vnni way against its own
integer arithmetic done by PyTorch). Prints one JSON line: ms a weight, GB/s of weight bytes
(integers, scales and the int8 row sums), billions of weights a second. Both vnni products are
operators (``torch.ops.vnni_bench``), the ones ``bench/vnni_decode.py`` calls from a model's step.
The vnni ways include quantizing the row (once per call, for all the weights; a model would once per
norm). Tried on the int8 product and dropped: software prefetch 2-4 KB ahead into L1 or L2
(27.0-28.1 GB/s against 29.2 without, 96 x 3584 x 1024), 16 places (28.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_reductions import ms_per_weight  # noqa: E402

from mixtral_infer.fast.cpu_reductions import rows_as_reductions  # noqa: E402
from mixtral_infer.quant import kernels  # noqa: E402
from mixtral_infer.quant.scheme import QuantScheme  # noqa: E402
from mixtral_infer.quant.weights import quantize  # noqa: E402

CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// Expert e of stacked weights (E, ...) where an expert index is given: views, read in place.
void pick_expert(const std::optional<torch::Tensor>& expert, std::initializer_list<torch::Tensor*> tensors) {
  if (!expert.has_value()) return;
  const int64_t e = expert->item<int64_t>();
  for (torch::Tensor* t : tensors) *t = t->select(0, e);
}

// Rows of the weight are read in P places at once, OUT / P rows apart (as cpu_reductions.row_sums),
// each against the M activation rows: P * M accumulators, fewer places as M grows (32 registers).
template <int M> constexpr int places() { return M == 1 ? 8 : M <= 2 ? 4 : M <= 4 ? 2 : 1; }

// y[m, r] = scale[m] * s[r] * sum_k xq[m, k] * w[r, k]: xq (M, IN) int8, scale (M,) float32, w (OUT, IN)
// int8, sums (OUT,) int32 (each row's sum), s (OUT,) bfloat16 -> y (M, OUT) float32. vpdpbusd takes
// unsigned bytes: xq ^ 0x80 is xq + 128, and - 128 * sums[r] takes the 128 out.
template <int M>
void int8_rows_m(const int8_t* x, const float* sx, const int8_t* W, const int32_t* sum, const at::BFloat16* rs,
                 float* Y, int64_t OUT, int64_t IN) {
  constexpr int P = places<M>();
  const int64_t step = OUT / P;
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  at::parallel_for(0, step, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      __m512i acc[P][M];
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < M; ++m) acc[p][m] = _mm512_setzero_si512();
      for (int64_t k = 0; k < IN; k += 64) {
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_xor_si512(_mm512_loadu_si512(x + m * IN + k), sign);  // + 128
        for (int p = 0; p < P; ++p) {
          const __m512i wv = _mm512_loadu_si512(W + (r + p * step) * IN + k);
          for (int m = 0; m < M; ++m) acc[p][m] = _mm512_dpbusd_epi32(acc[p][m], xv[m], wv);
        }
      }
      for (int p = 0; p < P; ++p) {
        const int64_t row = r + p * step;
        for (int m = 0; m < M; ++m)
          Y[m * OUT + row] = sx[m] * float(rs[row]) * float(_mm512_reduce_add_epi32(acc[p][m]) - 128 * sum[row]);
      }
    }
  });
}

// y[m, r] = scale[m] * sum_g scales[r, g] * sum_{k in g} q[r, k] * xq[m, k], groups of 32; w (OUT, IN/2)
// bytes as the docstring lays them out, scales (OUT, IN/32) bfloat16, start (M, IN/4) int32: -8 * the
// sums of 4 inputs of each row.
template <int M>
void int4_rows_m(const int8_t* x, const float* sx, const uint8_t* W, const uint16_t* S, const int32_t* C,
                 float* Y, int64_t OUT, int64_t IN) {
  constexpr int P = places<M>();
  const int64_t step = OUT / P, G = IN / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // lanes 0-7 take the first group's scale (the low 16 bits of two bfloat16), lanes 8-15 the second's
  const __m512i shifts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
  const __m512i high16 = _mm512_set1_epi32(0xFFFF0000);
  at::parallel_for(0, step, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      __m512 acc[P][M];
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < M; ++m) acc[p][m] = _mm512_setzero_ps();
      for (int64_t k = 0; k < IN; k += 64) {
        for (int p = 0; p < P; ++p) {
          const int64_t row = r + p * step;
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + row * (IN / 2) + k / 2));
          const __m256i lo = _mm256_and_si256(bytes, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
          const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          uint32_t two;
          std::memcpy(&two, S + row * G + k / 32, 4);
          const __m512i bits = _mm512_and_si512(_mm512_sllv_epi32(_mm512_set1_epi32(two), shifts), high16);
          const __m512 s = _mm512_castsi512_ps(bits);
          for (int m = 0; m < M; ++m) {
            const __m512i xv = _mm512_loadu_si512(x + m * IN + k);
            const __m512i cv = _mm512_loadu_si512(C + m * (IN / 4) + k / 4);
            const __m512i dots = _mm512_dpbusd_epi32(cv, q, xv);  // 16 lanes of 4 products each, minus 8 * sums
            acc[p][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), s, acc[p][m]);
          }
        }
      }
      for (int p = 0; p < P; ++p)
        for (int m = 0; m < M; ++m) Y[m * OUT + r + p * step] = sx[m] * _mm512_reduce_add_ps(acc[p][m]);
    }
  });
}

// The number of rows M (1-8) as a template argument. xq (IN,) is one row and gives y (OUT,).
template <typename Kernel>
torch::Tensor rows(const torch::Tensor& xq, int64_t OUT, int64_t IN, Kernel kernel) {
  const int64_t M = xq.dim() == 1 ? 1 : xq.size(0);
  TORCH_CHECK(IN % 64 == 0 && OUT % 8 == 0 && M >= 1 && M <= 8, "IN must be a multiple of 64, OUT of 8, rows 1-8");
  auto y = torch::empty(xq.dim() == 1 ? std::vector<int64_t>{OUT} : std::vector<int64_t>{M, OUT}, torch::kFloat32);
  switch (M) {
    case 1: kernel(std::integral_constant<int, 1>{}, y.data_ptr<float>()); break;
    case 2: kernel(std::integral_constant<int, 2>{}, y.data_ptr<float>()); break;
    case 3: kernel(std::integral_constant<int, 3>{}, y.data_ptr<float>()); break;
    case 4: kernel(std::integral_constant<int, 4>{}, y.data_ptr<float>()); break;
    case 5: kernel(std::integral_constant<int, 5>{}, y.data_ptr<float>()); break;
    case 6: kernel(std::integral_constant<int, 6>{}, y.data_ptr<float>()); break;
    case 7: kernel(std::integral_constant<int, 7>{}, y.data_ptr<float>()); break;
    default: kernel(std::integral_constant<int, 8>{}, y.data_ptr<float>());
  }
  return y;
}

// With expert: w (E, OUT, IN), sums and s (E, OUT), and expert e's are read.
torch::Tensor int8_rows(torch::Tensor xq, torch::Tensor scale, torch::Tensor w, torch::Tensor sums, torch::Tensor s,
                        const std::optional<torch::Tensor>& expert) {
  pick_expert(expert, {&w, &sums, &s});
  auto sx = scale.contiguous();
  return rows(xq, w.size(0), w.size(1), [&](auto m, float* y) {
    int8_rows_m<decltype(m)::value>(xq.data_ptr<int8_t>(), sx.data_ptr<float>(), w.data_ptr<int8_t>(),
                                    sums.data_ptr<int32_t>(), s.data_ptr<at::BFloat16>(), y, w.size(0), w.size(1));
  });
}

// With expert: w and scales stacked (E, ...), expert e's read.
torch::Tensor int4_rows(torch::Tensor xq, torch::Tensor scale, torch::Tensor w, torch::Tensor scales,
                        torch::Tensor start, const std::optional<torch::Tensor>& expert) {
  pick_expert(expert, {&w, &scales});
  auto sx = scale.contiguous();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  return rows(xq, w.size(0), 2 * w.size(1), [&](auto m, float* y) {
    int4_rows_m<decltype(m)::value>(xq.data_ptr<int8_t>(), sx.data_ptr<float>(), w.data_ptr<uint8_t>(), S,
                                    start.data_ptr<int32_t>(), y, w.size(0), 2 * w.size(1));
  });
}

// Operators, so that a compiled step calls them from C++ (no Python between): torch.ops.vnni_bench.*
TORCH_LIBRARY(vnni_bench, m) {
  m.def("int8_rows(Tensor xq, Tensor scale, Tensor w, Tensor sums, Tensor s, Tensor? expert=None) -> Tensor");
  m.def("int4_rows(Tensor xq, Tensor scale, Tensor w, Tensor scales, Tensor start, Tensor? expert=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(vnni_bench, CPU, m) {
  m.impl("int8_rows", int8_rows);
  m.impl("int4_rows", int4_rows);
}
"""


def build() -> None:
    """Compile the extension once (``torch.utils.cpp_extension``'s cache) and load its operators,
    ``torch.ops.vnni_bench.int8_rows`` and ``int4_rows``. ``-fopenmp`` matters: without it
    ``at::parallel_for`` in the extension runs on one thread."""
    load_inline(
        "vnni_matvec", cpp_sources=CPP, is_python_module=False,
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
    )  # fmt: skip

    @torch.library.register_fake("vnni_bench::int8_rows")
    def _(xq, scale, values, sums, scales, expert=None):
        return values.new_empty((*xq.shape[:-1], values.shape[-2]), dtype=torch.float32)

    @torch.library.register_fake("vnni_bench::int4_rows")
    def _(xq, scale, values, scales, start, expert=None):
        return values.new_empty((*xq.shape[:-1], values.shape[-2]), dtype=torch.float32)


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (M, IN)`` -> int8 ``(M, IN)`` and float32 scales ``(M, 1)``: ``round(127 x / max|x|)``
    row by row, as ``w8a8`` quantizes its rows."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127  # (M, 1)
    return torch.round(x.float() / scale).to(torch.int8), scale


def int4_start(xq: torch.Tensor) -> torch.Tensor:
    """``-8 *`` the sums of 4 consecutive inputs of ``xq (..., IN)``, int32 ``(..., IN/4)``: where each
    lane of ``int4_rows`` starts, which takes the 8 of ``q + 8`` out."""
    return -8 * xq.unflatten(-1, (-1, 4)).sum(-1, dtype=torch.int32)


def int4_bytes(integers: torch.Tensor) -> torch.Tensor:
    """Signed int4 ``(OUT, IN)`` as bytes ``(OUT, IN/2)``: byte j of each 64 inputs holds input j
    (plus 8) in its low nibble and input j + 32 (plus 8) in its high one."""
    n = (integers + 8).to(torch.uint8).view(integers.shape[0], -1, 2, 32)  # (OUT, IN/64, 2, 32)
    return (n[:, :, 0] | (n[:, :, 1] << 4)).reshape(integers.shape[0], -1).contiguous()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[3584, 1024], metavar=("OUT", "IN"))
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    (out_features, in_features), group = options.shape, 32
    build()
    torch.manual_seed(0)
    x = torch.randn(1, in_features, dtype=torch.bfloat16)

    def random_weights(scheme: QuantScheme):
        shape = (out_features, in_features)
        return [quantize(torch.randn(shape), scheme, torch.bfloat16) for _ in range(options.weights)]

    int8 = random_weights(QuantScheme("int8"))
    int4 = random_weights(QuantScheme("int4", group))
    int8_expected = x.float() @ int8[0].dequantize().T  # (1, OUT)
    int4_expected = x.float() @ int4[0].dequantize().T
    int4_vnni = [(int4_bytes(w.integers()), w.scales.contiguous()) for w in int4]
    first4 = int4[0].integers()  # (OUT, IN): the kernel's layout replaces them below
    for w in int4:
        kernels.prepare(w)  # the kernel's layout, in place of the plain one
    int4_packed = [w.packed for w in int4]
    int8_rows, int4_rows = torch.ops.vnni_bench.int8_rows, torch.ops.vnni_bench.int4_rows

    def int8_vnni_way(x, weights):
        xq, sx = quantized_rows(x)
        return [int8_rows(xq[0], sx, v, sums, s) for v, sums, s in weights]  # float32 (OUT,) each

    def int4_vnni_way(x, weights):
        xq, sx = quantized_rows(x)
        start = int4_start(xq[0])
        return [int4_rows(xq[0], sx, v, s, start) for v, s in weights]

    def int4_kernel_way(x, weights):
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(x, v, group, sz) for v, sz in weights]

    reductions = torch.compile(lambda x, ws: [rows_as_reductions(x, v, s) for v, s in ws], dynamic=False)
    int8_vnni = [(w.values, w.values.sum(-1, dtype=torch.int32), w.scales) for w in int8]
    ways = {
        "int8 reductions": (reductions, [(w.values, w.scales) for w in int8], int8_expected),
        "int8 vnni": (int8_vnni_way, int8_vnni, int8_expected),
        "int4 kernel": (int4_kernel_way, int4_packed, int4_expected),
        "int4 vnni": (int4_vnni_way, int4_vnni, int4_expected),
    }
    xq, sx = quantized_rows(x)  # the vnni ways' integers: their sums exact, then scaled
    v, sums, s = int8_vnni[0]
    exact8 = (xq.int() @ v.int().T)[0].float() * sx[0] * s.float()
    torch.testing.assert_close(int8_rows(xq[0], sx, v, sums, s), exact8, rtol=1e-6, atol=0)
    exact4 = ((xq.float() * first4.float()).view(out_features, -1, group).sum(-1) * int4[0].scales.float())
    got4 = int4_rows(xq[0], sx, *int4_vnni[0], int4_start(xq[0]))
    torch.testing.assert_close(got4, exact4.sum(-1) * sx[0], rtol=1e-5, atol=1e-3)
    one = torch.tensor(1)  # expert 1 of stacked weights: the 2-D product of that weight
    stacked8 = [torch.stack(t) for t in zip(*int8_vnni[:2])]
    assert torch.equal(int8_rows(xq[0], sx, *stacked8, one), int8_rows(xq[0], sx, *int8_vnni[1]))
    stacked4 = [torch.stack(t) for t in zip(*int4_vnni[:2])]
    start = int4_start(xq[0])
    assert torch.equal(int4_rows(xq[0], sx, *stacked4, start, one), int4_rows(xq[0], sx, *int4_vnni[1], start))
    xq3, sx3 = quantized_rows(torch.randn(3, in_features, dtype=torch.bfloat16))  # 3 rows at once = each alone
    start3 = int4_start(xq3)
    for m in range(3):
        assert torch.equal(int8_rows(xq3, sx3, *int8_vnni[0])[m], int8_rows(xq3[m], sx3[m], *int8_vnni[0]))
        alone = int4_rows(xq3[m], sx3[m], *int4_vnni[0], start3[m])
        assert torch.equal(int4_rows(xq3, sx3, *int4_vnni[0], start3)[m], alone)
    for name, (way, args, expected) in ways.items():
        got = way(x, args)[0].float().view(1, -1)
        torch.testing.assert_close(got, expected, atol=3e-2 * expected.abs().max().item(), rtol=0, msg=name)

    times = ms_per_weight({name: (way, args) for name, (way, args, _) in ways.items()}, x, options.rounds)

    count = out_features * in_features
    read = {"int8": count + out_features * 2, "int4": count / 2 + count / group * 2}  # integers and bf16 scales
    result = {"shape": options.shape, "weights": options.weights, "torch": torch.__version__,
              "threads": torch.get_num_threads()}  # fmt: skip
    for name, samples in times.items():
        ms = statistics.median(samples)
        bytes_read = read[name.split()[0]] + (4 * out_features if name == "int8 vnni" else 0)  # the row sums
        rates = {"GB/s": round(bytes_read / ms / 1e6, 1), "Gweights/s": round(count / ms / 1e6, 1)}
        result[name] = {"ms": round(ms, 4), **rates}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
