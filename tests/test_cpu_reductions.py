"""fast.cpu_reductions: compiled few-row products as multiply-and-sum loops, their routing from
linear(), and the norm before them computed once (apart from test_linear.py, whose fixture runs every
test under both of linear()'s few-row paths: these do not depend on it)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import generated_loops

from mixtral_infer.fast import cpu_reductions
from mixtral_infer.kernels.linear import linear
from mixtral_infer.tuning import Tuning


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_compiled_products_of_few_rows_are_reductions(dtype, rows):
    """Compiled code multiplies a plain weight by at most REDUCTION_ROWS[dtype] rows of it as float32
    multiply-and-sums (no library matmul or bmm blocks in the graph), and equals the float32 product
    rounded once; more rows keep the library's product (float32: the bmm blocks where they are on)."""
    torch._dynamo.reset()
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 40, generator=g).to(dtype), torch.randn(96, 40, generator=g).to(dtype)
    got = torch.compile(lambda x, w: linear(x, w), backend=keep_graph, fullgraph=True)(x, weight)
    want = F.linear(x.float(), weight.float()).to(dtype)  # exact products, float32 sums, one rounding
    rounding = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]  # relative
    torch.testing.assert_close(got, want, atol=1e-3, rtol=rounding)
    called = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    reduced = rows <= cpu_reductions.REDUCTION_ROWS[dtype]  # 16-bit 4, float32 8
    assert (torch._C._nn.linear in called or F.linear in called or torch.bmm in called) != reduced
    assert (torch.stack in called) == reduced


def test_rows_as_reductions_worked_example():
    """fast.cpu_reductions' example, and a second row: [[1, 2], [3, 4]] @ W.T, one multiply-and-sum per row;
    int8 integers with one scale per output row (OUT) scale the sums."""
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.bfloat16)  # (OUT=3, IN=2)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)  # (M=2, IN=2)
    got = cpu_reductions.rows_as_reductions(x, weight)
    assert got.dtype == torch.bfloat16
    assert got.tolist() == [[1.0, 2.0, 3.0], [3.0, 4.0, 7.0]]
    scaled = cpu_reductions.rows_as_reductions(x, weight.to(torch.int8), torch.tensor([0.5, 2.0, 1.0]))
    assert scaled.tolist() == [[0.5, 4.0, 3.0], [1.5, 8.0, 7.0]]


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_compiled_reductions_read_their_rows_from_memory(weight_dtype):
    """fast.cpu_reductions: the RMSNorm before a product runs once, into a buffer; inductor would
    otherwise recompute it inside the loop over the weight's rows (one square root per row here).
    The result equals the product op by op within bfloat16's rounding of the norm's output."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(96, 64, generator=g) * 40).to(weight_dtype)  # (OUT, IN)
    scales = torch.rand(96, generator=g) / 40 if weight_dtype == torch.int8 else None
    dtype = torch.float32 if weight_dtype == torch.float32 else torch.bfloat16  # the activations'
    norm_weight = torch.rand(64, generator=g).to(dtype)
    h = torch.randn(1, 64, generator=g).to(dtype)

    def normed_product(h):
        wide = h.float()
        x = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * norm_weight  # (1, IN)
        return cpu_reductions.rows_as_reductions(x, weight, scales, streams=8)  # (1, OUT): 96 rows in 2 places

    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(normed_product, fullgraph=True), h)
    loops = generated_loops([code])
    over_rows = "static_cast<int64_t>(0L); x0<static_cast<int64_t>(48L)"  # 96 rows read in 2 places
    (weight_loop,) = [loop for loop in loops if loop.startswith(over_rows) and "x1<static_cast<int64_t>(64L)" in loop]
    assert "sqrt" in code and "sqrt" not in weight_loop
    want = normed_product(h)  # op by op: the norm's output rounded to bfloat16, which compiled code skips
    torch.testing.assert_close(got, want, atol=0.01 * want.abs().max().item(), rtol=2**-7)


def test_places_worked_example():
    """fast.cpu_reductions.places' examples: the largest power of two up to the streams (8 here)
    dividing OUT into groups of at least MIN_GROUP_ROWS rows."""
    assert cpu_reductions.MIN_GROUP_ROWS == 32
    outs = (256, 32000, 128, 96, 48, 7, 1024, 8, 64, 3584)
    assert [cpu_reductions.places(out, 8) for out in outs] == [8, 8, 4, 2, 1, 1, 8, 1, 2, 8]
    assert [cpu_reductions.places(32000, streams) for streams in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 2, 4, 4, 8, 16]


def test_the_tuning_says_the_places_the_chosen_experts_theirs():
    """Tuning.streams for every product (8 unless told), Tuning.expert_streams for the chosen
    experts' (Tuning.for_experts; None: as the others)."""
    assert Tuning().streams == cpu_reductions.STREAMS == 8 and Tuning().expert_streams is None
    for tuning, outside, inside in [(Tuning(), 8, 8), (Tuning(streams=2, expert_streams=1), 2, 1),
                                    (Tuning(streams=4), 4, 4), (Tuning(streams=4, expert_streams=2), 4, 2)]:
        assert (tuning.streams, tuning.for_experts().streams) == (outside, inside)
        assert cpu_reductions.places(3584, tuning.for_experts().streams) == inside
        assert tuning.for_experts().for_experts() == tuning.for_experts()
    with pytest.raises(ValueError, match="at least 1 place"):
        Tuning(streams=0)


def test_compiled_chosen_experts_read_in_their_own_places():
    """Compiled, one graph, Tuning(streams=2, expert_streams=1): the expert's product reads its 256-row
    weight in one loop over all 256 rows with one sum, the other in a loop over 128 rows with 2; both
    are the product's bits (the places change the loops, not the sums)."""
    from torch._inductor.utils import run_and_get_code

    tuning = Tuning(streams=2, expert_streams=1)
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(2, 256, 64, generator=g).to(torch.bfloat16)  # (2, OUT, IN): an expert, a plain weight
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)

    def products(x, tuning=tuning):
        expert = cpu_reductions.rows_as_reductions(x, weights[0], streams=tuning.for_experts().streams)
        return expert, cpu_reductions.rows_as_reductions(x, weights[1], streams=tuning.streams)

    torch._dynamo.reset()
    (expert, plain), (code,) = run_and_get_code(torch.compile(products, fullgraph=True), x)
    sums = {}
    for loop in generated_loops([code]):
        rows = re.match(r"static_cast<int64_t>\(0L\); x0<static_cast<int64_t>\((\d+)L\)", loop)
        if rows and "x1<static_cast<int64_t>(64L)" in loop:
            sums[int(rows.group(1))] = len(set(re.findall(r"tmp_acc\d+_vec ", loop)))
    assert sums == {256: 1, 128: 2}
    for got, weight in [(expert, weights[0]), (plain, weights[1])]:
        want = F.linear(x.float(), weight.float()).to(x.dtype)
        torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=2**-7)
    torch._dynamo.reset()
    one_place = torch.compile(lambda x: products(x, Tuning(streams=1)), fullgraph=True)(x)
    assert torch.equal(expert, one_place[0]) and torch.equal(plain, one_place[1])


@pytest.mark.parametrize("places", [8, 2])
def test_compiled_code_reads_the_weight_in_the_tuning_s_places(places):
    """Compiled, a 256-row weight is read in 8 places with Tuning(streams=8) (a loop over 32 rows with
    8 sums), in 2 with streams=2 (a loop over 128 rows with 2 sums); the product is the weight's."""
    from torch._inductor.utils import run_and_get_code

    tuning = Tuning(streams=places)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(256, 64, generator=g).to(torch.bfloat16)  # (OUT, IN)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    product = torch.compile(lambda x: linear(x, weight, tuning))
    got, (code,) = run_and_get_code(product, x)
    over_rows = f"static_cast<int64_t>(0L); x0<static_cast<int64_t>({256 // places}L)"
    (loop,) = [loop for loop in generated_loops([code]) if loop.startswith(over_rows) and "x1<" in loop]
    assert len(set(re.findall(r"tmp_acc\d+_vec ", loop))) == places
    want = F.linear(x.float(), weight.float()).to(x.dtype)
    torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=2**-7)


@pytest.mark.parametrize(
    "weight_dtype, out, places, rows",
    [(torch.int8, 256, 8, 1), (torch.int8, 256, 8, 3), (torch.bfloat16, 128, 4, 1), (torch.float32, 96, 2, 2),
     (torch.bfloat16, 7, 1, 1)],
)
def test_compiled_reductions_read_the_weight_in_several_places(weight_dtype, out, places, rows):
    """row_sums: a weight of OUT rows is read in places(OUT, 8) places by loops over OUT / places
    rows, each place with its own sum for each row of x (one loop for one row; inductor shares more
    sums out over several loops), and the products are the
    same bits as one reduction over all the weight's rows (streams = 1), also for column blocks."""
    from torch._inductor.utils import run_and_get_code

    streams = 8
    g = torch.Generator().manual_seed(out + rows)
    weight = (torch.randn(out, 64, generator=g) * 40).to(weight_dtype)  # (OUT, IN)
    scales = torch.rand(out, generator=g) / 40 if weight_dtype == torch.int8 else None
    x = torch.randn(rows, 64, generator=g).to(torch.float32 if weight_dtype == torch.float32 else torch.bfloat16)
    blocks = weight.view(out, 2, 32).transpose(0, 1).contiguous()  # (2, OUT, 32): column blocks

    def products(x):
        plain = cpu_reductions.rows_as_reductions(x, weight, scales, streams)
        return plain, cpu_reductions.rows_as_reductions(x, blocks, scales, streams)

    torch._dynamo.reset()
    (got, got_blocks), (code,) = run_and_get_code(torch.compile(products, fullgraph=True), x)
    over_rows = f"static_cast<int64_t>(0L); x0<static_cast<int64_t>({out // places}L)"
    weight_loops = [loop for loop in generated_loops([code]) if loop.startswith(over_rows) and "x1<" in loop]
    sums = sum(len(set(re.findall(r"tmp_acc\d+_vec ", loop))) for loop in weight_loops)
    if places > 1:  # (7 rows: one place, loops as inductor makes them)
        assert sums == places * rows * 3  # the plain weight's and each of the 2 blocks'
    if places > 1 and rows == 1:  # one loop reads the whole weight (each block) in all its places at once
        assert len(weight_loops) == 3
    streams = 1
    torch._dynamo.reset()
    one_place, one_place_blocks = torch.compile(products, fullgraph=True)(x)
    assert torch.equal(got, one_place) and torch.equal(got_blocks, one_place_blocks)
    want = F.linear(x.float(), weight.float() * (scales[:, None] if scales is not None else 1)).to(x.dtype)
    torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=2**-7)
    torch.testing.assert_close(got_blocks, want, atol=1e-3 * want.abs().max().item(), rtol=2**-7)
