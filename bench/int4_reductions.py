"""Can code that inductor writes multiply int4 weights faster than PyTorch's int4 CPU kernel?

    python bench/int4_reductions.py [--shape 3584 1024] [--group 32] [--weights 96] [--rounds 7]

int8 weights decode faster as multiply-and-sum reductions that inductor writes
(``fast/cpu_reductions.py``) than through PyTorch's int8 kernel. This tries the same for int4:
one bfloat16 row times ``--weights`` int4 weights (more than the caches hold), each way one call
over all of them (compiled ways one graph, with ``dynamic=False``: a compiled call per weight would
add its call's cost to each 0.1-0.2 ms product), alternating, medians of ``--rounds``:

* ``kernel``: ``_weight_int4pack_mm_for_cpu`` on its own layout (what ``quant/kernels.py`` calls);
* ``rows``: a reduction over each row of the weight, vectorised along the row. The bytes of group
  g hold its inputs ``j`` (low nibble) and ``j + G/2`` (high nibble), so each half meets a
  contiguous piece of the row; the high nibble is read without a shift (none for bytes in the
  vector units): ``byte = low + 16 * high``, so ``low * a + byte * b`` with ``b = x_high / 16`` and
  ``a = x_low - b`` is ``low * x_low + high * x_high``; the ``- 8`` of every value comes out as
  ``8 * scale * sum(x)`` per group; the rows cut into ``streams(OUT)`` groups, read in as many
  places at once, as ``cpu_reductions.row_sums`` does;
* ``columns``: the same sums vectorised across 16 rows of the weight (stored transposed), each
  group's sums scaled once;
* ``template``: the kernel's call compiled with ``max_autotune`` and ``freezing``, where inductor
  writes it as its own int4 GEMM template (``CppWoqInt4GemmTemplate``: the weights must be
  constants of the graph, hence frozen; the CPP backend only, so the template is what runs);
* ``int8``: ``rows_as_reductions`` on int8 weights of the same shape, for scale.

Prints one JSON line: ms a weight, GB/s of weight bytes read (integers and scales), and billions
of weights a second. Every way's product is first checked against the dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mixtral_infer.fast.cpu_reductions import materialized, rows_as_reductions, streams  # noqa: E402
from mixtral_infer.quant import kernels  # noqa: E402
from mixtral_infer.quant.scheme import QuantScheme  # noqa: E402
from mixtral_infer.quant.weights import quantize  # noqa: E402


def halves(integers: torch.Tensor, group: int) -> torch.Tensor:
    """Signed int4 integers ``(OUT, IN)`` as bytes ``(OUT, IN/G, G/2)``: byte j of group g holds
    input ``gG + j`` in its low nibble and ``gG + G/2 + j`` in its high one (both plus 8)."""
    n = (integers + 8).to(torch.uint8).view(integers.shape[0], -1, 2, group // 2)  # (OUT, IN/G, 2, G/2)
    return (n[:, :, 0] | (n[:, :, 1] << 4)).contiguous()


def row_inputs(x: torch.Tensor, group: int):
    """``a``, ``b`` (IN/G, G/2) and the groups' sums ``(IN/G,)`` of one row ``x (1, IN)`` (docstring)."""
    xf = x.float().view(-1, 2, group // 2)  # (IN/G, 2, G/2): each group's low and high halves
    b = xf[:, 1] * 0.0625
    a = materialized((xf[:, 0] - b).contiguous())
    return a, materialized(b.contiguous()), xf.sum((1, 2))


def rows_way(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x (1, IN)`` times bytes ``(OUT, IN/G, G/2)`` with ``scales (OUT, IN/G, 1)`` -> ``(1, OUT)``."""
    a, b, sums = row_inputs(x, 2 * values.shape[-1])
    k = streams(values.shape[0])
    parts = []
    for part, part_scales in zip(values.chunk(k), scales.chunk(k)):  # k x (OUT/k, IN/G, G/2): k places at once
        s = part_scales.float()
        products = (((part & 15).float() * a + part.float() * b) * s).sum((-1, -2))  # (OUT/k,)
        parts.append(products - 8 * (s[..., 0] * sums).sum(-1))
    return torch.cat(parts).to(x.dtype)[None]


def columns_way(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x (1, IN)`` times bytes ``(IN/G, G/2, OUT)`` with ``scales (IN/G, OUT)`` -> ``(1, OUT)``."""
    a, b, sums = row_inputs(x, 2 * values.shape[1])
    s = scales.float()
    groups = ((values & 15).float() * a[..., None] + values.float() * b[..., None]).sum(1)  # (IN/G, OUT)
    return ((groups * s).sum(0) - 8 * (s * sums[:, None]).sum(0)).to(x.dtype)[None]


def ms_per_weight(ways: dict, x: torch.Tensor, rounds: int) -> dict:
    """``ways``: name -> ``(way, weights)``, ``way(x, weights)`` multiplying ``x`` by each weight.
    Returns name -> ``rounds`` times in ms a weight, the ways alternating, each warmed first."""
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, (way, args) in ways.items():
            way(x, args)  # warm: the loop, not the weights (they are more than the caches)
            start = time.perf_counter()
            for _ in range(5):
                way(x, args)
            times[name].append((time.perf_counter() - start) / (5 * len(args)) * 1e3)
    return times


@torch.no_grad()  # as decoding runs, and the frozen way's compile is for no_grad only
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[3584, 1024], metavar=("OUT", "IN"))
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    (out_features, in_features), group = options.shape, options.group
    torch.manual_seed(0)
    x = torch.randn(1, in_features, dtype=torch.bfloat16)

    def random_weights(scheme: QuantScheme):
        return [
            quantize(torch.randn(out_features, in_features), scheme, torch.bfloat16) for _ in range(options.weights)
        ]

    int4 = random_weights(QuantScheme("int4", group))
    expected = x.float() @ int4[0].dequantize().T  # (1, OUT)
    rows = [(halves(w.integers(), group), w.scales[..., None]) for w in int4]
    columns = [(v.permute(1, 2, 0).contiguous(), s[..., 0].T.contiguous()) for v, s in rows]
    for w in int4:
        kernels.prepare(w)  # the kernel's layout, in place of the plain one
    packed = [w.packed for w in int4]
    int8 = random_weights(QuantScheme("int8"))
    int8_args = [(w.values, w.scales) for w in int8]

    def kernel(x, values, scales_and_zeros):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, values, group, scales_and_zeros)

    def over_all(way, compiled=True):
        def all_weights(x, weights):
            return [way(x, *weight) for weight in weights]

        return torch.compile(all_weights, dynamic=False) if compiled else all_weights

    class Frozen(torch.nn.Module):  # the weights as buffers: what freezing makes constants of
        def __init__(self):
            super().__init__()
            for i, w in enumerate(int4):
                self.register_buffer(f"values{i}", w.packed[0])
                self.register_buffer(f"pairs{i}", w.packed[1])

        def forward(self, x, _):
            return [kernel(x, getattr(self, f"values{i}"), getattr(self, f"pairs{i}")) for i in range(len(int4))]

    template = torch.compile(Frozen().eval(), dynamic=False)
    with torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP"):
        template(x, packed)  # compiled here, under these settings

    ways = {
        "kernel": (over_all(kernel, compiled=False), packed),
        "template": (template, packed),
        "rows": (over_all(rows_way), rows),
        "columns": (over_all(columns_way), columns),
        "int8": (over_all(rows_as_reductions), int8_args),
    }
    for name, (way, args) in ways.items():
        if name != "int8":  # int8's weights are others
            got = way(x, args)[0].float()
            torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max().item(), rtol=0)

    times = ms_per_weight(ways, x, options.rounds)

    count = out_features * in_features
    int4_bytes = count / 2 + count / group * 2  # integers and bfloat16 scales
    int8_bytes = count + out_features * 2
    result = {"shape": options.shape, "group": group, "weights": options.weights, "torch": torch.__version__,
              "threads": torch.get_num_threads()}  # fmt: skip
    for name, samples in times.items():
        ms = statistics.median(samples)
        read = int8_bytes if name == "int8" else int4_bytes
        result[name] = {"ms": round(ms, 4), "GB/s": round(read / ms / 1e6, 1), "Gweights/s": round(count / ms / 1e6, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
