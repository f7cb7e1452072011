"""The CUDA paths, on a GPU: logits against transformers, the compiled CUDA-graph step, quantized
kernels and the serving engine, each against the readable path on the same device.

Skipped without a GPU (CI has none); run on a lent H200 with ``pytest tests/test_cuda.py`` (nf4's
tests need bitsandbytes' CUDA library there, GemLite's its package: docs/testing.md says how to
carry them). The
CPU suite checks the same logic through each kernel's reference semantics (``test_varlen_attention``,
``test_quant``'s tinygemm layout); these check that the kernels themselves agree.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args
from test_decode_step import SAMPLINGS, assert_same, compiled_code, eos_that_stops_some
from test_model import TOLERANCE, cached_logits, hf_logits, random_prompts

from mixtral_infer.kernels.linear import int4, nf4 as nf4_linear
from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.steps.decode_loop import step_compiler
from mixtral_infer.steps.decode_step import decode_logits
from mixtral_infer.kernels.linear import linear
from mixtral_infer.kernels.linear import gemlite as gemlite_cuda
from mixtral_infer.quant import nf4
from mixtral_infer.kernels.linear import prepare_weight
from mixtral_infer.kernels.linear.reference import reference_linear
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter, QuantScheme, quantize
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA paths: no GPU here")
CUDA = torch.device("cuda")
NO_GEMLITE = "GemLite does not import here: install the cuda extra"
# bfloat16 logprobs against float32's: mean |difference| 0.010-0.030 and max 0.03-0.07 measured
# (CPU), max 0.26-0.58 (CUDA, Mixtral) where a router near tie sends a token to another expert.
# A wrong kernel or cache slot moves the mean by whole units.
MEAN_TOLERANCE, MAX_TOLERANCE = 0.08, 1.0


@pytest.fixture(scope="module")
def cuda_pair(model_pair):
    """(ours on CUDA in float32, transformers on CPU, args): the same weights."""
    ours, hf, args = model_pair
    return copy.deepcopy(ours).to(CUDA), hf, args


@pytest.mark.parametrize("chunk_size", [3, WINDOW, 13], ids=["chunk<W", "chunk=W", "chunk>W"])
def test_chunked_prefill_and_decoding_match_transformers_on_cuda(cuda_pair, chunk_size):
    ours, hf, args = cuda_pair
    lengths, prefixes = [4 * WINDOW + 5, 3 * WINDOW + 2, 7, 2 * WINDOW], [3 * WINDOW + 1, 11, 7, 1]
    sequences = random_prompts(lengths, args.vocab_size)
    for sequence, logits in zip(sequences, cached_logits(ours, sequences, prefixes, chunk_size)):
        assert logits.device.type == "cuda"
        assert (logits.cpu() - hf_logits(hf, sequence)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("chunk_size", [3, WINDOW, 13], ids=["chunk<W", "chunk=W", "chunk>W"])
def test_bfloat16_prefill_through_flash_attention_matches_float32(cuda_pair, chunk_size):
    """bfloat16 prompts take torch's ragged flash attention (``fast.varlen_attention``); its logits
    are float32's to bfloat16's precision, on every chunking of a ragged batch."""
    ours, _, args = cuda_pair
    half = copy.deepcopy(ours).to(torch.bfloat16)
    lengths, prefixes = [4 * WINDOW + 5, 3 * WINDOW + 2, 7], [3 * WINDOW + 1, 11, 7]
    sequences = random_prompts(lengths, args.vocab_size, seed=3)
    expected = cached_logits(ours, sequences, prefixes, chunk_size)
    for got, want in zip(cached_logits(half, sequences, prefixes, chunk_size), expected):
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 0.05 * scale


def forced_logprobs(model, prompts, generated):
    """The log-probability ``model`` gives each generated token, by one pass over prompt + tokens."""
    out = []
    for prompt, new in zip(prompts, generated):
        sequence = prompt + new
        with torch.no_grad():
            logprobs = model(torch.tensor(sequence), [len(sequence)]).float().log_softmax(-1)  # (T, V)
        out.append(logprobs[torch.arange(len(prompt) - 1, len(sequence) - 1), torch.tensor(new)].tolist())
    return out


def assert_scored_alike(got, expected):
    """Per-token logprobs ``got`` (bfloat16) as ``expected`` (float32): see ``MEAN_TOLERANCE``."""
    differences = [abs(x - y) for row_got, row_expected in zip(got, expected) for x, y in zip(row_got, row_expected)]
    assert sum(differences) / len(differences) <= MEAN_TOLERANCE and max(differences) <= MAX_TOLERANCE


@pytest.fixture(scope="module", params=["mistral", "mixtral"])
def cuda_model(request):
    return random_model(tiny_args(moe=request.param == "mixtral", max_batch_size=8), seed=21).to(CUDA)


@pytest.mark.parametrize("sampling", ["greedy", "top-k top-p"])
def test_the_cuda_graph_step_decodes_as_eager(cuda_model, sampling):
    """float32, ragged prompts, 3x past the window, rows stopping at their own EOS: the static
    step and the compiled one (a CUDA graph) give eager's tokens and logprobs."""
    prompts = random_prompts([3 * WINDOW + 1, 4, 1], cuda_model.args.vocab_size, seed=3)
    max_tokens = 3 * WINDOW
    eos_id = eos_that_stops_some(cuda_model, prompts, max_tokens)
    settings = dict(max_tokens=max_tokens, eos_id=eos_id, **SAMPLINGS[sampling])
    eager = generate(prompts, cuda_model, decode="eager", **settings)
    for mode in ("static", "compiled"):
        assert_same(eager, generate(prompts, cuda_model, decode=mode, **settings))


def test_the_cuda_step_compiles_each_block_once(cuda_model):
    """On the GPU's torch too, each block of the compiled step is one region (``decode_step.
    in_regions``): the generated code defines it once and calls it once a layer, with eager's logits,
    and ``generate`` compiles it so (no line saying it fell back to blocks written out)."""
    model = cuda_model
    cache = model.make_cache(2)
    cache.start_sequences(2)
    # tokens, positions, alive
    inputs = tuple(torch.tensor(values, device=CUDA) for values in ([5, 6], [3, 9], [True, True]))
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
    code, logits = compiled_code(functools.partial(decode_logits, model), cache.layer_keys, cache.layer_values, *inputs)
    defined, called = re.findall(r"def (\w*subgraph_\d+)\(", code), re.findall(r"= (\w*subgraph_\d+)\(", code)
    assert len(set(defined)) == 1 and len(called) == model.args.n_layers, (defined, called, code[:3000])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    messages = []
    step_compiler(model).announce = messages.append
    generate(random_prompts([4, 2], model.args.vocab_size, seed=5), model, max_tokens=4, decode="compiled")
    assert not [m for m in messages if "as a region failed" in m], messages


def test_bfloat16_decoding_on_cuda_scores_its_tokens_as_float32_does(cuda_model):
    """bfloat16 on every path (eager, static, compiled) against the float32 model: the logprob each
    path gives its greedy tokens is what a float32 pass over the same sequence gives, to bfloat16's
    precision (random bfloat16 models part ways on near ties, so tokens are not compared)."""
    half = copy.deepcopy(cuda_model).to(torch.bfloat16)
    prompts = random_prompts([3 * WINDOW + 1, 4, 1], cuda_model.args.vocab_size, seed=3)
    for mode in ("eager", "static", "compiled"):
        generated, logprobs = generate(prompts, half, max_tokens=3 * WINDOW, decode=mode, prompt_logprobs=False)
        assert [len(g) for g in generated] == [3 * WINDOW] * 3
        assert_scored_alike(logprobs, forced_logprobs(cuda_model, prompts, generated))


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_cuda_nf4_kernel_equals_the_dequantize_reference(rows, group):
    """bitsandbytes' CUDA kernel on its format (``with_cuda_nf4_layout``; the CPU suite reads that
    format back with bitsandbytes' CPU reader) equals dequantize-then-matmul in float32 up to
    bfloat16 rounding, each expert of stacked weights; 8 rows on take the reference."""
    assert nf4.cuda_kernel() is not None, "bitsandbytes' CUDA library for this torch's CUDA did not load"
    g = torch.Generator().manual_seed(rows)
    weight = quantize(torch.randn(2, 256, 512, generator=g).to(CUDA), QuantScheme("nf4", group), torch.bfloat16)
    reference = weight.dequantize()  # (2, 256, 512) float32
    prepare_weight(weight)
    assert nf4_linear.nf4_layout(weight) == "cuda" and weight.values is None
    x = torch.randn(rows, 512, generator=g).to(CUDA, torch.bfloat16)
    for expert in range(2):
        got = linear(x, weight[expert]).float()
        expected = x.float() @ reference[expert].T
        assert (got - expected).abs().max() <= 2**-7 * expected.abs().max()
    many = torch.randn(nf4_linear.CUDA_NF4_KERNEL_ROWS, 512, generator=g).to(CUDA, torch.bfloat16)
    assert torch.equal(linear(many, weight[0]), reference_linear(many, weight[0]))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-128"])
@pytest.mark.parametrize("rows", [1, 2, 5, 63])
def test_gemlites_products_equal_the_dequantize_reference(scheme, rows):
    """GemLite's kernels (``quant/gemlite_cuda.py``; the CPU suite checks the format handed to
    them) on Mistral 7B's shapes (those its H100 tuning holds at one row, so the configurations
    decoding uses, without minutes of autotuning): float32 dequantize-then-matmul up to bfloat16
    rounding; from ``ROWS`` rows on, the path before GemLite. A failure says which product and
    how far off (the H200 run of 2026-11-28 lost its messages to a timeout)."""
    assert gemlite_cuda.library() is not None, NO_GEMLITE
    g = torch.Generator(device=CUDA).manual_seed(rows)
    for out_features, in_features in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
        weight = quantize(torch.randn(out_features, in_features, generator=g, device=CUDA), QuantScheme.parse(scheme),
                          torch.bfloat16)  # fmt: skip
        reference = weight.dequantize()
        prepare_weight(weight)
        assert weight.gemlite is not None
        for x in (torch.randn(rows, in_features, generator=g, device=CUDA), torch.randn(gemlite_cuda.ROWS, in_features,
                  generator=g, device=CUDA)):  # fmt: skip
            x = x.to(torch.bfloat16)
            got, expected = linear(x, weight).float(), x.float() @ reference.T
            off = ((got - expected).abs().max() / expected.abs().max()).item()
            assert off <= 2**-7, f"{len(x)} rows x {out_features}x{in_features}: max error {off:.2e} of the max output"


@pytest.mark.parametrize(
    "scheme, gemlite", [("int8", False), ("int4", False), ("nf4-32", False), ("int8", True), ("int4", True)]
)
@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_quantized_cuda_decoding_scores_its_tokens_as_its_dequantized_model(moe, scheme, gemlite, monkeypatch):
    """bfloat16 activations through the CUDA kernels (int4: tinygemm; int8: the dequantizing
    product; nf4: bitsandbytes'; with ``gemlite``, int8 and int4 dense weights through GemLite),
    eager and compiled, batch 1 (the MoE gathers 2 experts) and 3 (every expert runs): the logprobs
    of their tokens are a float32 model's holding the dequantized weights."""
    if gemlite:
        assert gemlite_cuda.library() is not None, NO_GEMLITE
    else:
        monkeypatch.setattr(gemlite_cuda, "library", lambda: None)
    float_model = random_model(tiny_args(moe=moe), seed=5).to(CUDA)
    quantized = quantize_model(copy.deepcopy(float_model).to(torch.bfloat16), scheme)
    if gemlite:
        assert quantized.layers["0"].attention.wq.weight.gemlite is not None
    elif scheme == "int4":
        assert int4.int4_layout(quantized.layers["0"].attention.wq.weight) == "cuda"
    if scheme.startswith("nf4"):
        assert nf4_linear.nf4_layout(quantized.layers["0"].attention.wq.weight) == "cuda"
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantizedParameter):
                float_model.get_parameter(name).copy_(module.dequantize())
    for lengths in ([5], [2 * WINDOW + 1, 3, 6]):
        prompts = random_prompts(lengths, 128, seed=len(lengths))
        for mode in ("eager", "compiled"):
            generated, logprobs = generate(
                prompts, quantized, max_tokens=2 * WINDOW, decode=mode, prompt_logprobs=False
            )
            assert_scored_alike(logprobs, forced_logprobs(float_model, prompts, generated))


def test_a_bitsandbytes_folder_decodes_on_cuda_as_its_float32_model_on_cpu(tmp_path):
    """A Hugging Face folder of bitsandbytes' 4-bit weights (tests/test_bnb_4bit.py's, written by
    bitsandbytes' quantize_4bit) loaded onto the GPU: its weights in bitsandbytes' CUDA format, and
    its decoded tokens, eager and compiled, scored as the same folder's float32 model on the CPU."""
    from test_bnb_4bit import hub_state, write_bnb_folder

    _, args, state = hub_state(True, seed=6)
    write_bnb_folder(tmp_path / "bnb", state, args, blocksize=64)
    model = load_model(tmp_path / "bnb", device=CUDA, max_batch_size=3)
    assert nf4_linear.nf4_layout(model.layers["0"].attention.wq.weight) == "cuda"
    reference = load_model(tmp_path / "bnb", dtype=torch.float32, max_batch_size=3).to(CUDA)
    prompts = random_prompts([5, 2 * WINDOW + 1, 3], args.vocab_size, seed=6)
    for mode in ("eager", "compiled"):
        generated, logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode=mode, prompt_logprobs=False)
        assert_scored_alike(logprobs, forced_logprobs(reference, prompts, generated))


def test_the_engine_on_cuda_gives_what_generate_gives():
    """Continuous batching with compiled prompt steps (CUDA's default): every request's greedy
    tokens are what generate() gives it alone, on the GPU."""
    model = load_model("tiny-mixtral", dtype=torch.float32, device=CUDA, max_batch_size=1)
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    engine = Engine(model, tokenizer, rows=4, prefill_tokens=64)
    assert engine.mode == "compiled" and engine.compile_prompts
    texts = ["In the beginning", "And it came to pass", "Blessed are", "Jesus wept.", "The LORD is my shepherd"]
    prompts = [tokenizer.encode(t) for t in texts]
    events = {}
    for i, prompt in enumerate(prompts):
        settings = RequestSettings(max_tokens=6 + i, temperature=0)
        engine.submit(prompt, settings, lambda event, i=i: events.setdefault(i, []).append(event))
    while engine.step():
        pass
    for i, prompt in enumerate(prompts):
        alone, _ = generate([prompt], model, max_tokens=6 + i, eos_id=tokenizer.eos_id, decode="eager")
        assert [e.token for e in events[i] if isinstance(e, TokenEvent)] == alone[0]
