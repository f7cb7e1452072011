"""fast.cpu_column_blocks: long rows stored in blocks of columns give the plain weight's products."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import generated_loops, random_model, tiny_args

from mixtral_infer.kernels.linear import int8
from mixtral_infer import load_model
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.errors import ConfigError
from mixtral_infer.fast import cpu_column_blocks, cpu_reductions
from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks, ColumnBlocksParameter, block_width, int8_blocks, to_blocks
from mixtral_infer.formats.packing import block_long_rows, blocked_numel, unblock_long_rows
from mixtral_infer.steps.decode_step import decode_logits
from mixtral_infer.kernels.linear import linear
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter
from mixtral_infer.tuning import Tuning


def test_the_docstring_example():
    """Two blocks of two columns: the block sums [3, 11] + [7, 15] are weight @ x = [10, 26]."""
    weight = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    blocks = to_blocks(weight, 2)
    assert blocks.blocks.tolist() == [[[1, 2], [5, 6]], [[3, 4], [7, 8]]]
    assert blocks.shape == (2, 4)
    assert torch.equal(blocks.dense(), weight)
    x = torch.ones(1, 4)
    assert cpu_reductions.rows_as_reductions(x, blocks.blocks).tolist() == [[10, 26]]
    assert linear(x, blocks).tolist() == [[10, 26]]  # not compiling: the plain weight's product


def test_block_widths():
    """The fewest equal blocks of at most MAX_BLOCK (2048) columns: Mistral 7B's w2 (14336) in 7 of
    2048, its other matrices (rows of 4096) in 2; the bench shapes' w2 (3584) in 2 of 1792."""
    assert cpu_column_blocks.MAX_BLOCK == 2048
    assert block_width(14336) == 2048
    assert block_width(4096) == 2048
    assert block_width(3584) == 1792
    assert block_width(2048) is None and block_width(1024) is None  # short rows stay as they are
    assert block_width(2049) == 683  # 3 blocks: the fewest that divide it
    assert block_width(2053) is None  # a prime: no blocks of at least 32 columns


def test_stacked_experts_index_to_their_own_blocks():
    weight = torch.randn(3, 5, 12)  # (E, OUT, IN)
    blocks = to_blocks(weight, 4)
    assert blocks.blocks.shape == (3, 3, 5, 4) and blocks.shape == (3, 5, 12)
    for e in range(3):
        assert torch.equal(blocks[e].blocks, to_blocks(weight[e], 4).blocks)
        assert torch.equal(blocks[torch.tensor(e)].dense(), weight[e])
    with pytest.raises(IndexError, match="only stacked experts"):
        blocks[0][0]


@pytest.fixture
def short_blocks(monkeypatch):
    """Blocks of at most 64 columns: the tiny models' w2 (rows of 96) splits into 2 of 48."""
    monkeypatch.setattr(cpu_column_blocks, "MAX_BLOCK", 64)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_blocked_model_keeps_its_weights_and_products(moe, short_blocks):
    """Only w2 (rows of 96 > 64) is blocked; state_dict() still gives the plain weights, the eager
    forward is the plain model's bit for bit, and unblock_long_rows gives the plain parameters back."""
    plain = random_model(tiny_args(moe=moe), seed=3).to(torch.bfloat16)
    blocked = block_long_rows(random_model(tiny_args(moe=moe), seed=3).to(torch.bfloat16))
    holders = {name: m for name, m in blocked.named_modules() if isinstance(m, ColumnBlocksParameter)}
    assert sorted(holders) == [f"layers.{i}.feed_forward.w2{'' if moe else '.weight'}" for i in range(2)]
    assert all(m.blocks.shape[-3:] == (2, 64, 48) for m in holders.values())
    assert blocked_numel(blocked) == sum(m.numel() for m in holders.values()) > 0
    expected = plain.state_dict()
    got = blocked.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    tokens = torch.tensor([5, 9, 1, 7, 3])
    assert torch.equal(blocked(tokens, [3, 2]), plain(tokens, [3, 2]))
    unblock_long_rows(blocked)
    assert blocked_numel(blocked) == 0
    assert {n: p.shape for n, p in blocked.named_parameters()} == {n: p.shape for n, p in plain.named_parameters()}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_float32_blocks_multiply_block_by_block_op_by_op_too(moe, short_blocks, monkeypatch):
    """float32 long rows are blocked as well; op by op their products are the blocks' float32 sums
    added up (nothing is rounded between blocks, and putting 235 MB of Mistral 7B's w2 back together
    for every product cost more than the product), equal to the plain model within float32's rounding."""
    plain = random_model(tiny_args(moe=moe), seed=3)
    blocked = block_long_rows(random_model(tiny_args(moe=moe), seed=3))
    assert blocked_numel(blocked) == 2 * (4 if moe else 1) * 64 * 96  # both layers' w2, every expert
    monkeypatch.setattr(ColumnBlocks, "dense", lambda self: pytest.fail("the plain weight was put back together"))
    tokens = torch.tensor([5, 9, 1, 7, 3])
    for seqlens in ([3, 2], [1] * 5):  # a prompt's rows, and one row a sequence as the eager loop decodes
        torch.testing.assert_close(blocked(tokens, seqlens), plain(tokens, seqlens), atol=1e-5, rtol=1e-5)


# (moe, dtype, batch): each path of a blocked product once (a compile each, the suite's slow part):
# dense reductions, MoE reductions of two gathered experts and of all four, more rows than the
# reductions take (block by block, dense and MoE), float32 reductions (MoE: blocks per expert).
STEPS = [
    (False, torch.bfloat16, 1), (True, torch.bfloat16, 1), (True, torch.bfloat16, 2),
    (False, torch.bfloat16, 4), (True, torch.bfloat16, 4), (True, torch.float32, 1),
]


STEP_IDS = [f"{str(dtype)[6:]}-{batch}-{'moe' if moe else 'dense'}" for moe, dtype, batch in STEPS]


@pytest.mark.parametrize("moe, dtype, batch", STEPS, ids=STEP_IDS)
def test_compiled_steps_read_the_blocks_and_equal_the_plain_step(moe, dtype, batch, short_blocks):
    """Compiled on CPU, a blocked model's decode step gives the plain model's logits op by op
    within the dtype's rounding (MoE: batch 1 gathers two experts, batches 2 and 4 run all four;
    batch 4: more rows than the reductions take, block by block)."""
    assert_compiled_step_equals_plain(moe, dtype, batch)


@pytest.mark.parametrize("moe, batch", [(False, 1), (True, 1), (True, 2)], ids=["dense", "moe-gathered", "moe-all"])
def test_compiled_steps_with_every_matrix_in_blocks(moe, batch, monkeypatch):
    """Blocks of at most 32 columns: every matrix decoding reads is blocked (rows of 64 in 2 blocks,
    w2's 96 in 3), as Mistral 7B's all are (rows of 4096 and 14336 in blocks of 2048); experts' w1
    and w3 as well as w2. The compiled step equals the plain model's op by op."""
    monkeypatch.setattr(cpu_column_blocks, "MAX_BLOCK", 32)
    blocked = assert_compiled_step_equals_plain(moe, torch.bfloat16, batch)
    attention, ff = blocked.layers["1"].attention, blocked.layers["1"].feed_forward
    weights = [attention.wq.weight, attention.wo.weight] + ([ff.w1, ff.w2] if moe else [ff.w1.weight, ff.w2.weight])
    assert all(isinstance(w, ColumnBlocks) for w in weights)
    assert weights[-1].blocks.shape[-3:] == (3, 64, 32)


def assert_compiled_step_equals_plain(moe: bool, dtype: torch.dtype, batch: int):
    """The blocked model's compiled decode_logits against the plain model's op by op; returns the blocked model."""
    plain = random_model(tiny_args(moe=moe, max_batch_size=4), seed=29).to(dtype)
    blocked = block_long_rows(random_model(tiny_args(moe=moe, max_batch_size=4), seed=29).to(dtype))
    assert blocked_numel(blocked) > 0
    cache = plain.make_cache(batch)
    cache.start_sequences(batch)
    tokens = torch.tensor([5, 6, 1, 7, 2, 8, 4, 3, 9][:batch])
    positions = torch.tensor([3, 9, 0, 12, 1, 5, 2, 7, 4][:batch])
    inputs = (tokens, positions, torch.ones(batch, dtype=torch.bool))
    torch._dynamo.reset()  # this file compiles decode_logits for many models: past dynamo's recompile limit
    with torch.inference_mode():
        expected = decode_logits(plain, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
        compiled = torch.compile(functools.partial(decode_logits, blocked), fullgraph=True, dynamic=False)
        logits = compiled(cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
    tolerance = dict(atol=0.1, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected, **tolerance)
    return blocked


def compiled_block_product(rows: int, seed: int, tuning: Tuning = Tuning()):
    """A random (OUT=128, IN=96) bfloat16 weight in 2 blocks of 48 times ``rows`` random rows, compiled
    as ``tuning`` says: ``(weight, x, product, generated code)``."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(128, 96, generator=g).to(torch.bfloat16)  # (OUT, IN)
    blocks = to_blocks(weight, 48)  # (2, 128, 48)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(lambda x: linear(x, blocks, tuning), fullgraph=True), x)
    return weight, x, got, code


def test_compiled_products_walk_the_blocks_one_after_the_other():
    """One loop per block, each over the 128 rows of its contiguous (OUT, B) matrix as a plain
    weight's is (so both threads share every block), in 4 places (``cpu_reductions.row_sums``): 32
    steps, block 0 read at weight index ``x1 + 48*x0`` (row x0, column x1) and 3 more places 1536
    apart, block 1 from ``6144 + x1 + 48*x0``; the plain weight's loop would step 96 columns a row.
    The result is the plain product's."""
    weight, x, got, code = compiled_block_product(rows=1, seed=7, tuning=Tuning(streams=8))
    row_by_row = "static_cast<int64_t>(0L); x0<static_cast<int64_t>(32L); x0+=static_cast<int64_t>(1L))"
    over_rows = [loop for loop in generated_loops([code]) if loop.startswith(row_by_row)]
    assert len(over_rows) == 2
    assert "(x1 + 48L*x0)" in over_rows[0] and "6144L" not in over_rows[0]
    assert "(4608L + x1 + 48L*x0)" in over_rows[0]  # the 4th place of block 0
    assert "(6144L + x1 + 48L*x0)" in over_rows[1]
    assert "96L*x" not in code
    torch.testing.assert_close(got, (x.float() @ weight.float().T).to(torch.bfloat16), atol=0.07, rtol=0.01)


def int8_model(moe: bool, blocked: bool, seed: int):
    model = quantize_model(random_model(tiny_args(moe=moe, max_batch_size=9), seed=seed).to(torch.bfloat16), "int8")
    return block_long_rows(model) if blocked else model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_int8_integers_in_blocks_give_the_same_products(moe, short_blocks):
    """int8 weight-only w2 keeps its integers as column blocks only (``packed``, ``values`` dropped):
    ``integers()`` puts them back together, the eager forward (the int8 kernel on those integers)
    is the plain model's bit for bit, and unblock_long_rows gives the plain integers back."""
    plain, blocked = int8_model(moe, False, seed=4), int8_model(moe, True, seed=4)

    def w2(model, layer):
        feed_forward = model.layers[str(layer)].feed_forward
        return feed_forward.w2 if moe else feed_forward.w2.weight

    w2s = [(w2(plain, layer), w2(blocked, layer)) for layer in range(2)]
    for p, b in w2s:
        assert isinstance(b, QuantizedParameter) and b.values is None
        assert torch.equal(int8_blocks(b), to_blocks(p.values, 48).blocks)
        assert torch.equal(b.integers(), p.values)
    assert int8_blocks(blocked.layers["0"].attention.wq.weight) is None  # rows of 64: plain
    tokens = torch.tensor([5, 9, 1, 7, 3])
    assert torch.equal(blocked(tokens, [3, 2]), plain(tokens, [3, 2]))
    unblock_long_rows(blocked)
    assert all(torch.equal(b.values, p.values) and int8_blocks(b) is None for p, b in w2s)


INT8_STEPS = [(False, 1), (True, 2), (False, 9), (True, 9)]
INT8_STEP_IDS = [f"{batch}-{'moe' if moe else 'dense'}" for moe, batch in INT8_STEPS]


@pytest.mark.parametrize("moe, batch", INT8_STEPS, ids=INT8_STEP_IDS)
def test_compiled_int8_steps_read_the_blocks_and_equal_the_plain_step(moe, batch, short_blocks):
    """The compiled step never puts w2's integers back together (a copy every step): batches 1-2
    multiply its blocks as reductions, no int8 kernel (MoE batch 2: its 4 chosen experts one by one,
    each read in place through the routing's index); batch 9 (more rows than int8's reductions take)
    runs the kernel on each of its 2 blocks, where the plain model runs it once. Its logits equal
    the plain model's op by op within bfloat16's rounding. (Every expert on few rows: the float32
    and bfloat16 tests'; the same reductions with more rows: ``test_quant.py``'s.) The blocks are
    written out (``Tuning.regions`` off), so that the code holds every layer's calls."""
    from torch._inductor.utils import run_and_get_code

    plain, blocked = int8_model(moe, False, seed=31), int8_model(moe, True, seed=31)
    cache = plain.make_cache(batch)
    cache.start_sequences(batch)
    tokens = torch.tensor([5, 6, 1, 7, 2, 8, 4, 3, 9][:batch])
    positions = torch.tensor([3, 9, 0, 12, 1, 5, 2, 7, 4][:batch])
    inputs = (tokens, positions, torch.ones(batch, dtype=torch.bool))
    torch._dynamo.reset()
    with torch.inference_mode():
        expected = decode_logits(plain, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
        step = functools.partial(decode_logits, blocked, tuning=Tuning(regions=False))
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        logits, codes = run_and_get_code(compiled, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)

    calls = ("= extern_kernels._weight_int8pack_mm(", "int8_expert_mm.default(")
    kernel_calls = sum(code.count(call) for code in codes for call in calls)
    plain_calls = 0 if batch <= 2 else 15 if not moe else 33  # what the plain model's compiled step makes
    w2_products = 0 if batch <= 2 else 2 * (4 if moe else 1)  # 2 layers (x 4 experts), each now 2 blocks
    assert kernel_calls == plain_calls + w2_products
    buffers = [line for code in codes for line in code.splitlines() if "= empty_strided_cpu((" in line]
    assert not [line for line in buffers if "64, 96)" in line]  # no (.., OUT, IN) copy of w2's integers
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)


def test_compiled_products_of_more_rows_multiply_block_by_block():
    """Five rows, more than bfloat16's reductions take: one batched product over the blocks, summed, and no
    copy of the plain weight (no (OUT, IN) buffer) in the generated code; equal to the plain product
    within the rounding of each block's product to bfloat16."""
    weight, x, got, code = compiled_block_product(rows=5, seed=8)
    assert "extern_kernels.bmm" in code and "(128, 96)" not in code
    assert torch.equal(cpu_column_blocks.block_products(x, to_blocks(weight, 48)), got)
    torch.testing.assert_close(got, (x.float() @ weight.float().T).to(torch.bfloat16), atol=0.15, rtol=0.02)


def test_compiled_int8_products_of_many_rows_multiply_block_by_block():
    """More rows than the reductions take: the int8 kernel on each block, no (OUT, IN) copy of the
    integers; equal to the plain product within bfloat16's rounding."""
    from torch._inductor.utils import run_and_get_code

    from mixtral_infer.fast.cpu_reductions import REDUCTION_ROWS
    from mixtral_infer.kernels.linear import linear
    from mixtral_infer.quant.weights import QuantScheme, quantize

    g = torch.Generator().manual_seed(9)
    plain = quantize(torch.randn(40, 96, generator=g).to(torch.bfloat16), QuantScheme.parse("int8"), torch.bfloat16)
    blocked = quantize(plain.dequantize(torch.bfloat16), QuantScheme.parse("int8"), torch.bfloat16)
    blocked.packed, blocked.values = (to_blocks(blocked.values, 48).blocks, blocked.scales), None
    x = torch.randn(REDUCTION_ROWS[torch.int8] + 4, 96, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(lambda x: linear(x, blocked), fullgraph=True), x)
    assert code.count("_weight_int8pack_mm") >= 2 and "(40, 96)" not in code
    torch.testing.assert_close(got, linear(x, plain), atol=0.15, rtol=0.02)


def test_load_model_stores_long_rows_in_blocks(tmp_path, short_blocks):
    """``pack="columns"``: plain parameters but for the long rows; anything else than True, False
    or "columns" is a one-line error before any weight is read."""
    save_consolidated(random_model(tiny_args(moe=True)).to(torch.bfloat16), tmp_path / "bf16")
    model = load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16, pack="columns")
    assert isinstance(model.layers["0"].feed_forward.w2, ColumnBlocks)
    assert isinstance(model.layers["0"].feed_forward.w1, torch.nn.Parameter)
    int8 = load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16, quantize="int8", pack="columns")
    assert int8_blocks(int8.layers["0"].feed_forward.w2).shape == (4, 2, 64, 48)  # (E, n, OUT, B)
    with pytest.raises(ConfigError, match="pack='column'"):
        load_model(tmp_path / "missing", pack="column")
