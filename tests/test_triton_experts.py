"""The chosen experts' Triton kernels (``fast.triton_experts``), run on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest where there is no GPU): equal to the readable path (each
expert's weight dequantized, then multiplied), in fixed shapes that compile whole, and in the decode
steps, which give the eager loop's tokens with them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model, tiny_args

from mixtral_infer import generate
from mixtral_infer.fast import triton_experts as te
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.quant.scheme import QuantScheme
from mixtral_infer.quant.weights import quantize
from mixtral_infer.kernels.moe import moe_one_token, triton_kind
from mixtral_infer.tuning import Tuning

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not te.runs_kernels(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                       reason="Triton is not installed (pip install -e .[test] installs it)"),  # fmt: skip
]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, D, I = 4, 64, 96  # experts, model width, hidden width


def test_docstring_example_of_the_blocks():
    sorted_ids, block_experts = te.blocks_by_expert(torch.tensor([2, 0, 2, 3]), 4, 2)
    assert sorted_ids.tolist() == [1, 4, 0, 2, 3, 4, 4, 4]
    assert block_experts.tolist() == [0, 2, 3, -1]


@pytest.mark.parametrize("seed", range(6))
def test_blocks_hold_each_assignment_once_and_one_expert_each(seed):
    g = torch.Generator().manual_seed(seed)
    n_experts, block_m = [(8, 16), (4, 2), (8, 3), (16, 4), (3, 8), (8, 1)][seed]
    experts = torch.randint(0, n_experts, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
    sorted_ids, block_experts = te.blocks_by_expert(experts, n_experts, block_m)
    total = experts.numel()
    assert sorted_ids.numel() == te.padded_length(total, n_experts, block_m) == block_experts.numel() * block_m
    ids = sorted_ids.tolist()
    assert sorted(i for i in ids if i != total) == list(range(total))  # each assignment once
    for b, e in enumerate(block_experts.tolist()):
        block = [i for i in ids[b * block_m : (b + 1) * block_m] if i != total]
        if e < 0:
            assert not block
        else:
            assert block and all(int(experts[i]) == e for i in block)
    used = [e for e in block_experts.tolist() if e >= 0]
    assert used == sorted(used) and set(used) == set(experts.tolist())  # blocks in expert order, each chosen expert's


def weights_of(kind: int, seed: int = 0):
    """Stacked w1, w3 ``(E, I, D)`` and w2 ``(E, D, I)`` of ``kind`` with their scales, as the kernels take them."""
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(E, I, D, generator=g) * 0.15, torch.randn(E, I, D, generator=g) * 0.15, torch.randn(E, D, I, generator=g) * 0.15]
    if kind == te.PLAIN:
        return [(w.to(torch.bfloat16).to(DEVICE), None) for w in dense]
    scheme = QuantScheme("int8") if kind == te.INT8 else QuantScheme("int4", group_size=32)
    held = [quantize(w, scheme, torch.bfloat16) for w in dense]
    return [(q.values.to(DEVICE), q.scales.to(DEVICE)) for q in held]


def routed(batch: int, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(100 + batch + seed)
    x = torch.randn(batch, D, generator=g).to(torch.bfloat16).to(DEVICE)
    top, experts = torch.topk(torch.randn(batch, E, generator=g), k)
    return x, experts.to(DEVICE), torch.softmax(top, -1).to(torch.bfloat16).to(DEVICE)


def readable_mixture(x, experts, mix, parts, kind):
    """Each token, each chosen expert dequantized (``te.dequantized``) and multiplied in float32, mixed."""
    (w1, s1), (w3, s3), (w2, s2) = parts
    rows = []
    for t in range(x.shape[0]):
        row = x[t].float()
        total = torch.zeros(D, device=x.device)
        for e, m in zip(experts[t].tolist(), mix[t].float()):
            a, b, c = (te.dequantized(w[e], None if s is None else s[e], kind, torch.bfloat16).float() for w, s in parts)
            total += m * (c @ (F.silu(a @ row) * (b @ row)))
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("kind", [te.PLAIN, te.INT8, te.INT4])
@pytest.mark.parametrize("batch", [1, 3, 4, 9])  # 2, 6 assignments of 4 experts: one product each; 8, 18: blocks
def test_the_kernels_equal_each_expert_dequantized(kind, batch):
    parts = weights_of(kind, seed=batch)
    x, experts, mix = routed(batch)
    with torch.no_grad():
        flat = experts.reshape(-1)
        hidden = te.chosen_swiglu(x, flat, *parts[0], *parts[1], kind)
        assert torch.allclose(hidden.float(), te.reference_swiglu(x, flat, *parts[0], *parts[1], kind).float(), atol=2e-2, rtol=1e-2)
        down = te.chosen_down(hidden, flat, *parts[2], mix.reshape(-1), kind)
        readable_down = te.reference_down(hidden, flat, *parts[2], mix.reshape(-1), kind)
        # the readable path rounds each dequantized weight to bfloat16; the kernels scale the float32 sums
        assert (down - readable_down).abs().max() <= 5e-3 * readable_down.abs().max()
        got = te.mixture(x, experts, mix, *parts[0], *parts[1], *parts[2], kind).float()
    expected = readable_mixture(x, experts, mix, parts, kind)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 0.02 * scale  # the hidden rows rounded to bfloat16 once


@pytest.mark.parametrize("kind", [te.PLAIN, te.INT8, te.INT4])
def test_split_inputs_add_up_to_the_whole_product(kind):
    """``w2``'s long inputs split in 3 parts (split-K, added atomically) give the unsplit product."""
    (_, _), (_, _), (w2, s2) = weights_of(kind, seed=3)
    g = torch.Generator().manual_seed(3)
    k_in = 2 * te.ROWS_BLOCK_K + 64  # 3 parts: 128, 128 and 64 inputs
    w2 = torch.cat([w2] * (k_in // I + 1), dim=-1)[..., : k_in // (2 if kind == te.INT4 else 1)].contiguous()
    if s2 is not None and kind == te.INT4:
        s2 = torch.cat([s2] * (k_in // I + 1), dim=-1)[..., : k_in // 32].contiguous()
    h = torch.randn(2, k_in, generator=g).to(torch.bfloat16).to(DEVICE)
    experts, mix = torch.tensor([3, 1], device=DEVICE), torch.tensor([0.25, 0.75], dtype=torch.bfloat16, device=DEVICE)
    expected = te.reference_down(h, experts, w2, s2, mix, kind)
    for parts in (1, 3):
        out = torch.zeros(2, D, device=DEVICE)
        te._launch(h, experts, w2, s2, None, None, mix, out, kind, False, 1, parts=parts)
        assert (out - expected).abs().max() <= 5e-3 * expected.abs().max(), parts


@pytest.mark.parametrize("kind", [te.PLAIN, te.INT8, te.INT4])
@pytest.mark.parametrize("batch", [1, 9])  # the matrix-vector kernel, the blocks
def test_every_configuration_a_gpu_may_choose_gives_the_same_products(kind, batch):
    """On a GPU ``triton.autotune`` keeps the fastest of each kernel's configurations per shape: each
    one, run here with its block sizes, gives the readable path's products."""
    (w1, s1), (w3, s3), (w2, s2) = weights_of(kind, seed=5)
    x, experts, mix = routed(batch, seed=5)
    flat = experts.reshape(-1)
    expected_hidden = te.reference_swiglu(x, flat, w1, s1, w3, s3, kind).float()
    configs = te.ROWS_CONFIGS if batch == 1 else te.BLOCKS_CONFIGS
    for config in configs:
        hidden = torch.empty(flat.numel(), I, dtype=x.dtype, device=DEVICE)
        te._launch(x, flat, w1, s1, w3, s3, None, hidden, kind, True, 2, config=config)
        assert torch.allclose(hidden.float(), expected_hidden, atol=2e-2, rtol=1e-2), config
        down = torch.zeros(flat.numel(), D, device=DEVICE)
        te._launch(hidden, flat, w2, s2, None, None, mix.reshape(-1), down, kind, False, 1, parts=2, config=config)
        readable = te.reference_down(hidden, flat, w2, s2, mix.reshape(-1), kind)
        assert (down - readable).abs().max() <= 5e-3 * readable.abs().max(), config


@pytest.mark.parametrize("group", [64, 256])
@pytest.mark.parametrize("batch", [1, 9])
def test_int4_groups_longer_and_shorter_than_a_block_of_inputs(group, batch):
    """A block of inputs that holds whole groups (their scales loaded once each, repeated over the
    group) and one that lies within a group (one scale an output): every configuration, both kernels."""
    g = torch.Generator().manual_seed(group + batch)
    wide = 256  # D = I = 256: groups of 256 are longer than the 128-input blocks, those of 64 shorter
    scheme = QuantScheme("int4", group_size=group)
    held = [quantize(torch.randn(E, wide, wide, generator=g) * 0.1, scheme, torch.bfloat16) for _ in range(3)]
    (w1, s1), (w3, s3), (w2, s2) = [(q.values.to(DEVICE), q.scales.to(DEVICE)) for q in held]
    x = torch.randn(batch, wide, generator=g).to(torch.bfloat16).to(DEVICE)
    flat = torch.randint(0, E, (2 * batch,), generator=g).to(DEVICE)
    mix = torch.rand(2 * batch, generator=g).to(torch.bfloat16).to(DEVICE)
    expected_hidden = te.reference_swiglu(x, flat, w1, s1, w3, s3, te.INT4).float()
    for config in te.ROWS_CONFIGS if batch == 1 else te.BLOCKS_CONFIGS:
        hidden = torch.empty(flat.numel(), wide, dtype=x.dtype, device=DEVICE)
        te._launch(x, flat, w1, s1, w3, s3, None, hidden, te.INT4, True, 2, config=config)
        assert torch.allclose(hidden.float(), expected_hidden, atol=2e-2, rtol=1e-2), config
        down = torch.zeros(flat.numel(), wide, device=DEVICE)
        te._launch(hidden, flat, w2, s2, None, None, mix, down, te.INT4, False, 1, parts=2, config=config)
        readable = te.reference_down(hidden, flat, w2, s2, mix, te.INT4)
        assert (down - readable).abs().max() <= 5e-3 * readable.abs().max(), config


def bfloat16_moe(scheme=None, seed: int = 4) -> MoeLayer:
    from mixtral_infer.formats.quantizing import quantize_model

    model = random_model(tiny_args(moe=True), seed=seed).to(torch.bfloat16).to(DEVICE)
    if scheme is not None:
        quantize_model(model, scheme)
    return model.layers["0"].feed_forward


@pytest.mark.parametrize("scheme", [None, "int8"])
@pytest.mark.parametrize("batch", [1, 4])
def test_moe_one_token_takes_the_kernels_and_equals_the_reference_layer(scheme, batch):
    """With ``Tuning.triton_experts`` the decode step's mixture is the kernels', and equals the reference
    layer's (``MoeLayer.forward``: the reference modules, quantized experts dequantized); compiled whole."""
    moe = bfloat16_moe(scheme)
    assert triton_kind(moe, torch.zeros(1, D, dtype=torch.bfloat16)) == (te.PLAIN if scheme is None else te.INT8)
    x = torch.randn(batch, D, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        got = moe_one_token(moe, x, Tuning(triton_experts=True))
        expected = te.mixture(x, *moe.route(x), *_parts(moe, scheme), te.PLAIN if scheme is None else te.INT8)
        assert torch.equal(got, expected)
        use_formats(moe, Tuning(fast=False))
        reference = moe(x).float()
        step = torch.compile(lambda x: moe_one_token(moe, x, Tuning(triton_experts=True)), fullgraph=True, dynamic=False)
        compiled = step(x)
    assert (got.float() - reference).abs().max() <= 0.02 * reference.abs().max()
    assert (compiled.float() - got.float()).abs().max() <= 1e-2 * got.float().abs().max()  # the routing compiled


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_prompts_take_the_kernels_too(scheme, monkeypatch):
    """A prompt chunk of 21 tokens (42 assignments: the blocks kernel) through ``FastMoeLayer`` with the
    option: one SwiGLU and one down launch, equal to the reference layer."""
    moe = bfloat16_moe(scheme, seed=9)
    use_formats(moe, Tuning(triton_experts=True))
    x = torch.randn(21, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    launches = []
    launch = te._launch
    monkeypatch.setattr(te, "_launch", lambda *args, **kwargs: launches.append(args[9]) or launch(*args, **kwargs))
    with torch.no_grad():
        got = moe(x).float()
        use_formats(moe, Tuning(fast=False))
        reference = moe(x).float()
    assert launches == [True, False]
    assert (got - reference).abs().max() <= 0.02 * reference.abs().max()


def _parts(moe, scheme):
    if scheme is None:
        return moe.w1, None, moe.w3, None, moe.w2, None
    return moe.w1.values, moe.w1.scales, moe.w3.values, moe.w3.scales, moe.w2.values, moe.w2.scales


def test_experts_the_kernels_do_not_take_keep_their_path():
    """Weights in another dtype than the activations, nf4 experts, a rank's share of the experts: no
    kind, the other paths."""
    moe = bfloat16_moe()
    assert triton_kind(moe, torch.zeros(1, D)) is None  # float32 activations, bfloat16 weights
    assert triton_kind(bfloat16_moe(QuantScheme("nf4", group_size=32)), torch.zeros(1, D, dtype=torch.bfloat16)) is None
    moe.local_experts = range(2)
    assert triton_kind(moe, torch.zeros(1, D, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("scheme", [None, "int8"])
@pytest.mark.parametrize("decode", ["eager", "static", "compiled"])
def test_the_decode_steps_with_the_kernels_give_the_eager_tokens(scheme, decode, monkeypatch):
    """Batch 4, top-2 of 4, float32 (the kernels multiply in float32; the eager loop dequantizes the
    int8 experts and multiplies with F.linear): the eager loop, the static and the compiled step with
    the kernels (prompts through them too) give the readable eager loop's tokens and log-probabilities. Compiled on CPU by AOTInductor, whose library calls
    the kernels' ops back (on CUDA by torch.compile)."""
    from mixtral_infer.formats.quantizing import quantize_model

    model = random_model(dataclasses.replace(tiny_args(moe=True), max_batch_size=4), seed=6).to(DEVICE)
    if scheme is not None:
        quantize_model(model, scheme)
    assert triton_kind(model.layers["0"].feed_forward, torch.zeros(1, D)) == (te.PLAIN if scheme is None else te.INT8)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 8], [1, 20, 21]]
    eager, eager_lp = generate(prompts, model, max_tokens=8, decode="eager", prompt_logprobs=False)
    use_formats(model, Tuning(triton_experts=True))
    launches = []
    launch = te._launch
    monkeypatch.setattr(te, "_launch", lambda *args, **kwargs: launches.append(args[9]) or launch(*args, **kwargs))
    with_kernels, kernels_lp = generate(prompts, model, max_tokens=8, decode=decode, prompt_logprobs=False)
    assert launches.count(True) == launches.count(False) >= 2 * 7  # a SwiGLU and a down pass a layer a step
    assert with_kernels == eager
    for got, expected in zip(kernels_lp, eager_lp):
        assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("scheme", [QuantScheme("int8"), QuantScheme("int4", group_size=32)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # a matrix-vector product per row below 4 rows, blocks from 4
def test_a_dense_quantized_weight_read_as_one_expert_equals_its_dequantized_product(scheme, rows):
    from mixtral_infer.kernels.linear import reference_linear
    from mixtral_infer.kernels.linear.triton import triton_dense_kind

    g = torch.Generator().manual_seed(rows)
    weight = quantize((torch.randn(80, 2 * te.ROWS_BLOCK_K + 64, generator=g) * 0.1).to(DEVICE), scheme, torch.bfloat16)
    x = torch.randn(rows, weight.in_features, generator=g).to(torch.bfloat16).to(DEVICE)
    kind = triton_dense_kind(x, weight)
    assert kind == (te.INT8 if scheme.name == "int8" else te.INT4)
    with torch.no_grad():
        got = te.dense_rows(x, weight.values, weight.scales, kind).float()
        expected = reference_linear(x.float(), weight)  # float32 products of the dequantized weight
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()  # the output rounded to bfloat16


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("decode", ["eager", "static", "compiled"])
def test_a_quantized_mistral_decodes_the_readable_tokens_through_the_dense_kernel(scheme, decode, monkeypatch):
    """A dense float32 model, int8 and int4: with ``Tuning.triton_dense`` every quantized product of a
    few rows goes through ``dense_rows``; tokens and log-probabilities are the readable path's."""
    from mixtral_infer.formats.quantizing import quantize_model

    model = random_model(dataclasses.replace(tiny_args(moe=False), max_batch_size=2), seed=8).to(DEVICE)
    quantize_model(model, QuantScheme("int8") if scheme == "int8" else QuantScheme("int4", group_size=32))
    prompts = [[1, 5, 9, 13, 2], [1, 7, 7]]
    expected, expected_lp = generate(prompts, model, max_tokens=8, decode="eager", prompt_logprobs=False)
    use_formats(model, Tuning(triton_dense=True))
    launches = []
    launch = te._launch
    monkeypatch.setattr(te, "_launch", lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs))
    got, got_lp = generate(prompts, model, max_tokens=8, decode=decode, prompt_logprobs=False)
    assert len(launches) >= 7 * 2 * 7  # 7 quantized matrices a layer, 2 layers, 7 steps at least
    assert got == expected
    for a, b in zip(got_lp, expected_lp):
        assert a == pytest.approx(b, abs=1e-4)


HOPPER = ("cuda", 90, 32)  # the H100 / H200: compute capability 9.0, warps of 32


def compiled_for_hopper() -> int:
    """Each kernel built by Triton's compiler for ``HOPPER`` down to its cubin, with every configuration
    for int4 (the largest code) and the first for plain and int8 weights, float32 tiles (``WIDEN``)
    and one quantized weight (``DENSE``) too: the count built. Runs where Triton's interpreter is off (``TRITON_INTERPRET=0``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert isinstance(te._expert_rows, triton.runtime.jit.JITFunction), "the interpreter is on"
    weight_types = {te.PLAIN: "*bf16", te.INT8: "*i8", te.INT4: "*u8"}
    built = 0

    def build(kernel, types: dict, constants: dict, config: dict) -> None:
        nonlocal built
        names = kernel.arg_names
        constants = {**constants, "BLOCK_N": config["BLOCK_N"], "BLOCK_K": config["BLOCK_K"]}
        signature = {name: "constexpr" if name in constants else types[name] for name in names}
        # as Triton's launcher specializes them: pointers and sizes that are multiples of 16
        aligned = [name for name in names if name not in constants and (types[name].startswith("*") or name in ("N", "K"))]
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                           attrs=attrs)  # fmt: skip
        options = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")}
        assert "cubin" in triton.compile(source, target=GPUTarget(*HOPPER), options=options).asm
        built += 1

    for kind, weights in weight_types.items():
        group = 128 if kind == te.INT4 else 1  # int4: the blocks of 64 inputs lie within a group, those of 128+ hold whole ones
        for swiglu in (True, False):
            out = "*bf16" if swiglu else "*fp32"
            common = dict(w_ptr=weights, s_ptr="*bf16", v_ptr=weights, t_ptr="*bf16", mix_ptr="*bf16", out_ptr=out,
                          N="i32", K="i32", PER_ROW="i32")  # fmt: skip
            rows = dict(common, x_ptr="*bf16", experts_ptr="*i64")
            blocks = dict(common, x_ptr="*bf16", sorted_ids_ptr="*i32", block_experts_ptr="*i32", ASSIGNMENTS="i32")
            for config in te.ROWS_CONFIGS if kind == te.INT4 else te.ROWS_CONFIGS[:1]:
                build(te._expert_rows, rows, dict(KIND=kind, GROUP=group, SWIGLU=swiglu, DENSE=False, SPLIT_K=1 if swiglu else 4), config)
            for config in te.BLOCKS_CONFIGS if kind == te.INT4 else te.BLOCKS_CONFIGS[:1]:
                build(te._expert_blocks, blocks, dict(KIND=kind, GROUP=group, SWIGLU=swiglu, DENSE=False, WIDEN=False, BLOCK_M=16), config)
            widened = dict(blocks, x_ptr="*fp32", **({"w_ptr": "*fp32", "v_ptr": "*fp32"} if kind == te.PLAIN else {}))
            build(te._expert_blocks, widened, dict(KIND=kind, GROUP=group, SWIGLU=swiglu, DENSE=False, WIDEN=True, BLOCK_M=16),
                  te.BLOCKS_CONFIGS[0])  # fmt: skip
            if kind != te.PLAIN and not swiglu:  # dense_rows: one quantized weight, nothing sorted or mixed
                build(te._expert_rows, rows, dict(KIND=kind, GROUP=group, SWIGLU=False, DENSE=True, SPLIT_K=4), te.ROWS_CONFIGS[0])
                build(te._expert_blocks, dict(blocks, out_ptr="*bf16"), dict(KIND=kind, GROUP=group, SWIGLU=False, DENSE=True,
                      WIDEN=False, BLOCK_M=16), te.BLOCKS_CONFIGS[0])  # fmt: skip
    return built


def test_every_kernel_compiles_for_an_h200():
    """Triton's own compiler, not its interpreter, builds each kernel for compute capability 9.0 down to
    the cubin (Triton ships its ptxas): what the GPU's compiler would refuse is found without a GPU."""
    code = "import test_triton_experts as t; print(t.compiled_for_hopper())"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == str(2 * (4 + 4 + 1) + 2 * 2 * (1 + 1 + 1) + 2 * 2)  # int4's 18, 12 others, 4 dense
