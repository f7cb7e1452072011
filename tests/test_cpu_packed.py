"""Weights packed in oneDNN's layout (fast/cpu_packed.py) give oneDNN's product of the plain weight
(F.linear's, for bfloat16), bit for bit, on every path.

The weights are ``PACKS``: bfloat16 where this CPU's oneDNN packs it, else float32. A float32 model's
plain products go through MKL and the few-row kernels, not oneDNN, so there plain and packed models
agree to float32 rounding rather than bit for bit (``same_generation``)."""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import PACKS, random_model, tiny_args

from mixtral_infer import generate, load_model
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.fast.cpu_packed import _MATRICES, PackedParameter, onednn_linear, onednn_packs, pack, pack_side_by_side, side_by_side, side_by_side_groups
from mixtral_infer.formats.packing import is_packed, pack_model, packed_numel, unpack_model
from mixtral_infer.kernels.moe.one_by_one import every_expert_one_by_one, experts_one_by_one
from mixtral_infer.steps.decode_step import decode_logits
from mixtral_infer.kernels.linear import linear, linears
from mixtral_infer.serve.sizing import weight_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def same_generation(a, b):
    """Two ``generate`` results: the same tokens; log-probabilities equal (bfloat16: one oneDNN product
    either way) or within float32 rounding (float32: MKL's product against oneDNN's)."""
    assert a[0] == b[0]
    for got, expected in zip(a[1], b[1]):
        assert got == (expected if PACKS == torch.bfloat16 else pytest.approx(expected, abs=1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 33])
def test_equals_f_linear_bit_for_bit(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)  # (OUT, IN)
    if not onednn_packs(dtype):  # float16 without avx512_fp16 / avx_ne_convert: told, not a oneDNN traceback
        with pytest.raises(ValueError, match=f"oneDNN cannot pack {dtype} weights on this CPU"):
            pack(weight)
        return
    packed = pack(weight)
    for x in (torch.randn(rows, 64, generator=g).to(dtype), torch.randn(64, rows, generator=g).to(dtype).T):  # (M, IN), plain and transposed
        expected = onednn_linear(x, weight)  # oneDNN's product of the plain weight
        assert torch.equal(linear(x, packed), expected)
        if dtype != torch.float32:  # 16-bit F.linear is that product (float32's is MKL's)
            assert torch.equal(expected, F.linear(x, weight))
    assert torch.equal(packed.dense(), weight)


def test_stacked_experts_are_indexed_by_int_or_tensor():
    experts = torch.randn(4, 48, 32).to(PACKS)  # (E, OUT, IN)
    packed = pack(experts)
    x = torch.randn(2, 32).to(PACKS)
    for e in (0, 3, torch.tensor(2)):
        assert packed[e].shape == (48, 32)
        assert torch.equal(linear(x, packed[e]), onednn_linear(x, experts[int(e)]))
    assert torch.equal(packed.dense(), experts)
    with pytest.raises(ValueError, match="weight\\[e\\]"):
        linear(x, packed)


def test_side_by_side_worked_example():
    """``pack_side_by_side``'s docstring, scaled down by 16: wq (64, 64), wk and wv (16, 64) -> one
    (96, 64) matrix, rows [0, 64), [64, 80), [80, 96); ``linears`` multiplies it once, and each
    block alone, its dense weight and the state equal the plain weights bit for bit."""
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(out, 64, generator=g).to(PACKS) for out in (64, 16, 16)]
    blocks = pack_side_by_side(plain)
    assert [b.rows for b in blocks] == [(0, 64), (64, 80), (80, 96)] and len({b.handle for b in blocks}) == 1
    assert side_by_side(blocks).shape == (96, 64) and side_by_side(blocks).rows is None
    for rows in (1, 3, 33):
        x = torch.randn(rows, 64, generator=g).to(PACKS)
        expected = [onednn_linear(x, w) for w in plain]
        for got in (linears(x, *blocks), [linear(x, b) for b in blocks]):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(b.dense(), w) for b, w in zip(blocks, plain))
    # Not the whole matrix in order: each block is multiplied on its own
    assert side_by_side(blocks[::-1]) is None and side_by_side(blocks[:2]) is None and side_by_side([pack(plain[0])]) is None
    assert side_by_side(plain) is None


def test_side_by_side_experts():
    """Stacked experts w1 and w3 (E, I, D), packed side by side: one product per expert, by int or
    tensor; two different experts are not one product."""
    g = torch.Generator().manual_seed(1)
    w1, w3 = torch.randn(2, 4, 48, 32, generator=g).to(PACKS)  # (E, I, D) each
    p1, p3 = pack_side_by_side([w1, w3])
    x = torch.randn(2, 32, generator=g).to(PACKS)
    for e in (0, 3, torch.tensor(2)):
        assert side_by_side([p1[e], p3[e]]) is not None
        gate, up = linears(x, p1[e], p3[e])
        assert torch.equal(gate, onednn_linear(x, w1[int(e)])) and torch.equal(up, onednn_linear(x, w3[int(e)]))
    assert side_by_side([p1[0], p3[1]]) is None
    assert torch.equal(p1.dense(), w1) and torch.equal(p3.dense(), w3)


@pytest.fixture(scope="module")
def models():
    """The same MoE model, plain and packed (``PACKS``)."""
    plain = random_model(tiny_args(moe=True)).to(PACKS)
    packed = pack_model(random_model(tiny_args(moe=True)).to(PACKS), dtypes=(PACKS,))
    return plain, packed


def test_pack_model_replaces_the_decoding_matrices_only(models):
    plain, packed = models
    assert isinstance(packed.layers["0"].attention.wq.weight, PackedParameter)
    assert isinstance(packed.layers["0"].feed_forward.w1, PackedParameter)
    assert isinstance(packed.output.weight, PackedParameter)
    for layer in packed.layers.values():  # wq wk wv in one matrix, w1 w3 too (dims 64, 2 x 16, 2 x 16)
        attention, moe = layer.attention, layer.feed_forward
        assert [w.weight.rows for w in (attention.wq, attention.wk, attention.wv)] == [(0, 64), (64, 96), (96, 128)]
        assert attention.wq.weight.handle == attention.wv.weight.handle != attention.wo.weight.handle
        assert (moe.w1.rows, moe.w3.rows, moe.w2.rows) == ((0, 96), (96, 192), None) and moe.w1.handle == moe.w3.handle
    kept = {name for name, _ in packed.named_parameters()}
    assert kept and all("norm" in name or "embeddings" in name or "gate" in name for name in kept)
    assert packed_numel(packed) + sum(p.numel() for p in packed.parameters()) == sum(p.numel() for p in plain.parameters())
    assert weight_bytes(packed) == weight_bytes(plain)


def test_state_dict_holds_the_plain_weights_under_their_names(models):
    plain, packed = models
    ours, theirs = packed.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


PROMPTS = [list(range(3, 40)), list(range(5, 12))]  # ragged, the longer one past the window


def test_logits_equal_on_prefill_chunks_and_eager_decoding(models):
    """Chunked prefill past the window then eager decoding: the same tokens and log-probabilities."""
    plain, packed = models
    same_generation(generate(PROMPTS, plain, max_tokens=12, chunk_size=5, decode="eager"), generate(PROMPTS, packed, max_tokens=12, chunk_size=5, decode="eager"))


def test_logits_equal_on_the_static_decode_step():
    """Dense model: the static step differs only in its matmuls. (With experts, plain weights take the
    stacked einsums and packed ones the per-expert loop, which add in another order: tested below.)"""
    plain = random_model(tiny_args(moe=False)).to(PACKS)
    packed = pack_model(random_model(tiny_args(moe=False)).to(PACKS), dtypes=(PACKS,))
    same_generation(generate(PROMPTS, plain, max_tokens=12, chunk_size=5, decode="static"), generate(PROMPTS, packed, max_tokens=12, chunk_size=5, decode="static"))


def test_the_static_moe_step_equals_its_plain_loop(models):
    plain, packed = models
    x = torch.randn(3, plain.args.dim).to(PACKS)  # (B, D)
    moe_plain, moe_packed = plain.layers["1"].feed_forward, packed.layers["1"].feed_forward
    experts, weights = moe_plain.route(x)
    for form in (experts_one_by_one, every_expert_one_by_one):  # the chosen experts, or every expert
        got, expected = form(moe_packed, x, experts, weights, moe_packed.tuning), form(moe_plain, x, experts, weights, moe_plain.tuning)
        torch.testing.assert_close(got, expected, atol=0 if PACKS == torch.bfloat16 else 1e-5, rtol=0 if PACKS == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("batch", [1, 2], ids=["gathered-experts", "every-expert"])
def test_the_compiled_step_reads_packed_weights_through_the_op(models, batch):
    """torch.compile(fullgraph=True) cannot trace oneDNN's opaque tensors: compiled code multiplies
    through ``mixtral_infer::packed_linear`` instead, by handle, with the expert as a tensor (batch 1,
    2 of 4 experts gathered) or an int (batch 2, every expert). One step's logits equal the step op by
    op; weights packed side by side take one call."""
    _, packed = models
    cache = packed.make_cache(batch)
    cache.start_sequences(batch)
    generate([list(range(3, 3 + 9 + b)) for b in range(batch)], packed, max_tokens=1, cache=cache)
    inputs = (cache.cache_k.clone(), cache.cache_v.clone(), torch.tensor([5, 9][:batch]),
              torch.tensor(cache.tokens_seen), torch.ones(batch, dtype=torch.bool))  # fmt: skip
    compiled = torch.compile(functools.partial(decode_logits, packed), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        expected = decode_logits(packed, *[t.clone() for t in inputs])  # (B, V)
        compiled(*[t.clone() for t in inputs])  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            logits = compiled(*[t.clone() for t in inputs])  # clones made alike: no recompilation
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)  # bfloat16: fused ops round less often
    per_layer = 2 + 2 * (2 if batch == 1 else 4)  # wq+wk+wv, wo, then w1+w3, w2 of 2 gathered (or all 4) experts
    op = "mixtral_infer::packed_linear"
    calls = [e for e in profile.events() if e.name == op and (e.cpu_parent is None or e.cpu_parent.name != op)]
    assert len(calls) == packed.args.n_layers * per_layer + 1  # + the output matrix


def test_a_packed_weight_leaves_the_table_with_its_last_holder():
    weight = pack(torch.randn(4, 8, 8).to(PACKS))
    expert, handle = weight[1], weight.handle
    del weight
    gc.collect()
    assert torch.equal(expert.dense(), expert.matrices[0].to_dense())  # a view keeps the matrices
    del expert
    gc.collect()
    assert handle not in _MATRICES


def test_a_copied_packed_model_shares_the_matrices_and_outlives_the_original():
    model = pack_model(random_model(tiny_args(moe=True)).to(PACKS), dtypes=(PACKS,))
    expected = generate(PROMPTS, model, max_tokens=4)
    copied = copy.deepcopy(model)
    del model
    gc.collect()
    assert generate(PROMPTS, copied, max_tokens=4) == expected


def test_unpack_model_gives_parameters_back():
    model = pack_model(random_model(tiny_args(moe=False)).to(PACKS), dtypes=(PACKS,))
    assert is_packed(model)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    unpack_model(model)
    assert not is_packed(model)
    assert all(torch.equal(p, expected[name]) for name, p in model.named_parameters())
    assert isinstance(model.layers["0"].attention.wq.weight, torch.nn.Parameter)


def test_load_model_packs_bfloat16_models_on_cpu(tmp_path):
    save_consolidated(random_model(tiny_args(moe=True)).to(torch.bfloat16), tmp_path / "bf16")
    assert is_packed(load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16)) is onednn_packs(torch.bfloat16)
    assert not is_packed(load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16, pack=False))
    assert not is_packed(load_model(tmp_path / "bf16", device="cpu", dtype=torch.float32))
    assert not is_packed(load_model(tmp_path / "bf16", device="cpu", dtype=torch.float16))  # slower packed for one row
    assert not is_packed(load_model(tmp_path / "bf16", device="cpu", quantize="int8"))  # quantized matrices are not floats


def test_a_cpu_whose_onednn_cannot_pack_keeps_plain_weights(tmp_path, monkeypatch):
    """An x86 CPU without AVX-512 (or a PyTorch without oneDNN): load_model gives a plain model that
    still decodes, not oneDNN's "bf16 path needs the cpu support" error."""
    from mixtral_infer.fast import cpu_packed

    save_consolidated(random_model(tiny_args(moe=True)).to(torch.bfloat16), tmp_path / "bf16")
    monkeypatch.setattr(cpu_packed, "onednn_packs", lambda dtype: False)
    model = load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16)
    assert not is_packed(model)
    assert len(generate([[1, 2, 3]], model, max_tokens=3)[0][0]) == 3
    with pytest.raises(ValueError, match="oneDNN cannot pack torch.bfloat16 weights on this CPU"):
        pack(torch.randn(8, 8).bfloat16())


def test_side_by_side_groups_worked_example():
    """The docstring's: layer 0's wq wk wv and wo -> [[wq, wk, wv], [wo]]; members whose inputs differ go alone."""
    names = [f"layers.0.attention.{w}.weight" for w in ("wo", "wv", "wq", "wk")]
    shapes = {name: torch.Size((256 if "wk" in name or "wv" in name else 1024, 1024)) for name in names}
    assert side_by_side_groups(names, shapes.__getitem__) == [
        [f"layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv")],
        ["layers.0.attention.wo.weight"],
    ]
    shapes["layers.0.attention.wv.weight"] = torch.Size((256, 512))
    assert side_by_side_groups(names, shapes.__getitem__) == [
        ["layers.0.attention.wk.weight"], ["layers.0.attention.wo.weight"],
        ["layers.0.attention.wq.weight"], ["layers.0.attention.wv.weight"],
    ]  # fmt: skip
