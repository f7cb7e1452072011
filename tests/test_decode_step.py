"""The static decode step equals the eager decode loop: tokens, logprobs and the cache it leaves."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import re

import pytest
import torch
from conftest import WINDOW, generated_loops, random_model, tiny_args
from test_model import random_prompts
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

from mixtral_infer import GenerationError, generate
from mixtral_infer.steps import compiler, decode_step
from mixtral_infer.steps.decode_loop import compile_seconds, step_compiler
from mixtral_infer.steps.compiler import StepCompiler, slot_bucket
from mixtral_infer.steps.decode_step import decode_logits, make_decode_step, one_query_attention, slots_and_visibility
from mixtral_infer.kernels.moe import moe_one_token, one_by_one
from mixtral_infer.kernels.moe.every_expert import every_expert_batched
from mixtral_infer.kernels.moe.gathered import gathered_experts
from mixtral_infer.kernels.moe.one_by_one import every_expert_one_by_one, experts_one_by_one
from mixtral_infer.steps.mixed_step import mixed_logits, pack_chunk
from mixtral_infer.generation.generate import decode_mode
from mixtral_infer.sampling import Sampling
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.tuning import Tuning

LOGPROB_TOLERANCE = 1e-5
SAMPLINGS = {
    "greedy": dict(),
    "sampled": dict(temperature=0.9, seed=11),
    "top-k top-p": dict(temperature=1.2, top_k=10, top_p=0.8, seed=12),
}


@pytest.fixture(scope="module", params=["mistral", "mixtral"])
def model(request):
    return random_model(tiny_args(moe=request.param == "mixtral", max_batch_size=8), seed=21)


def assert_same(eager, static):
    (eager_tokens, eager_logprobs), (static_tokens, static_logprobs) = eager, static
    assert static_tokens == eager_tokens
    for got, expected in zip(static_logprobs, eager_logprobs):
        assert got == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


def eos_that_stops_some(model, prompts, max_tokens):
    """A token that one sequence emits midway, so sequences finish at different steps."""
    free, _ = generate(prompts, model, max_tokens=max_tokens, decode="eager")
    return free[0][len(free[0]) // 2]


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("lengths", [[5], [3 * WINDOW + 1, 4, 1], [7, 1, 12, 3, WINDOW, 2, 9, 30]], ids=["b1", "b3", "b8"])
def test_static_decode_equals_eager(model, lengths, sampling):
    """Ragged prompts, decoding 3x past the window, sequences stopping at their own EOS."""
    prompts = random_prompts(lengths, model.args.vocab_size, seed=len(lengths))
    max_tokens = 3 * WINDOW
    settings = dict(max_tokens=max_tokens, eos_id=eos_that_stops_some(model, prompts, max_tokens), **SAMPLINGS[sampling])
    eager = generate(prompts, model, decode="eager", **settings)
    static = generate(prompts, model, decode="static", **settings)
    assert_same(eager, static)
    lengths_generated = {len(tokens) for tokens in eager[0]}
    if len(lengths) > 1 and sampling == "greedy":
        assert len(lengths_generated) > 1, "the EOS should stop some sequences before others"


def test_static_decode_continues_a_conversation_like_eager(model):
    """Two turns in one cache: the same answers, and the caches hold the same keys."""
    prompts = random_prompts([2 * WINDOW, 3], model.args.vocab_size, seed=4)
    follow_ups = random_prompts([5, WINDOW + 2], model.args.vocab_size, seed=5)
    caches = {}
    results = {}
    for mode in ("eager", "static"):
        cache = model.make_cache(2)
        first = generate(prompts, model, max_tokens=WINDOW + 3, cache=cache, decode=mode, temperature=0.7, seed=3)
        second = generate(follow_ups, model, max_tokens=2 * WINDOW, cache=cache, decode=mode, temperature=0.7, seed=4)
        caches[mode], results[mode] = cache, (first, second)
    assert_same(results["eager"][0], results["static"][0])
    assert_same(results["eager"][1], results["static"][1])
    assert caches["static"].tokens_seen == caches["eager"].tokens_seen
    torch.testing.assert_close(caches["static"].cache_k, caches["eager"].cache_k, atol=1e-5, rtol=0)
    torch.testing.assert_close(caches["static"].cache_v, caches["eager"].cache_v, atol=1e-5, rtol=0)


def test_static_decode_without_a_window_equals_eager():
    model = random_model(tiny_args(sliding_window=None, max_batch_size=3), seed=22)
    prompts = random_prompts([13, 4, 1], model.args.vocab_size, seed=10)
    settings = dict(max_tokens=20, temperature=0.8, seed=5)
    assert_same(generate(prompts, model, decode="eager", **settings), generate(prompts, model, decode="static", **settings))


def compiled_case(moe: bool):
    """``(model, prompts, eos_id)`` of the fullgraph test: 3 ragged prompts, one of them longer than
    twice the window, and an EOS that stops some sequences. The guards test decodes the mixture too,
    so that on CPU it loads the step built here (kept on disk, ``cpu_aot_step.BuildCache``)."""
    model = random_model(tiny_args(moe=moe, max_batch_size=3), seed=23)
    prompts = random_prompts([2 * WINDOW + 1, 3, 6], model.args.vocab_size, seed=6)
    return model, prompts, eos_that_stops_some(model, prompts, 3 * WINDOW)


@pytest.mark.parametrize("moe, samplings", [(False, ["greedy"]), (True, ["top-k top-p"])], ids=["mistral", "mixtral"])
def test_the_step_compiles_with_fullgraph_and_equals_eager(moe, samplings):
    """torch.compile(fullgraph=True) fails on any graph break (.item(), .tolist(), boolean-mask
    indexing, a tensor built from a list); the compiled step then decodes as the eager loop does.
    The model's part of the step is the same whatever the sampling, and the sampling's whatever the
    model: one sampling a model (each step is a build, 15-25 s with a cold compile cache). The other
    pairs are built elsewhere: a dense model sampling top-k top-p in ``test_cpu_aot_step.py``, a
    mixture greedy in ``test_quant.py`` and the serving tests (tiny-mixtral, per-row samplings)."""
    model, prompts, eos_id = compiled_case(moe)
    messages = []
    step_compiler(model).announce = messages.append
    for name in samplings:
        settings = dict(max_tokens=3 * WINDOW, eos_id=eos_id, **SAMPLINGS[name])
        assert_same(generate(prompts, model, decode="eager", **settings), generate(prompts, model, decode="compiled", **settings))
    built = compile_seconds(model)  # a step built for each sampling: what tokens/s figures leave out
    settings = dict(max_tokens=4, eos_id=eos_id, **SAMPLINGS[samplings[-1]])
    again = generate(prompts, model, decode="compiled", **settings)  # the same shape again: built already
    assert_same(generate(prompts, model, decode="eager", **settings), again)
    compiling = [m for m in messages if m.startswith("compiling")]
    assert compiling == [f"compiling the decode step for batch 3, {WINDOW} cache slots (once per shape)..."] * len(
        samplings
    )
    announced = [float(re.match(r"compiled in ([\d.]+)s", m)[1]) for m in messages if m.startswith("compiled in")]
    assert compile_seconds(model) == built > 0 and built == pytest.approx(sum(announced), abs=0.11)


@pytest.mark.parametrize("change", ["a copy", "quantized"])
def test_a_model_whose_weights_changed_builds_its_steps_again(change, monkeypatch, capsys):
    """The compiled steps kept with a model hold its weights as they were when built: a deep copy
    given other weights (the GPU bench quantized a copy of its bfloat16 model and timed the
    original's step, at bfloat16's speed) or a model quantized in place builds its own, and says
    so. Steps run uncompiled here (the same step, without the compile's minutes; such a step reads
    the weights when called, so the copy is the case where the tokens part; the quantized model's
    shows in the announcement: a compiled one would be captured again)."""
    monkeypatch.setattr(compiler, "compiled", lambda step, device: step)
    monkeypatch.setattr(compiler, "built_ahead_of_time", lambda *args: None)
    model = random_model(tiny_args(moe=False, max_batch_size=3), seed=31)
    prompts = random_prompts([2 * WINDOW + 1, 3], model.args.vocab_size, seed=7)
    before = generate(prompts, model, max_tokens=WINDOW, decode="compiled")
    if change == "a copy":
        model = copy.deepcopy(model)
        torch.nn.init.normal_(model.layers["0"].feed_forward.w2.weight, std=0.5)
    else:
        quantize_model(model, "int4")
    capsys.readouterr()
    after = generate(prompts, model, max_tokens=WINDOW, decode="compiled")
    assert capsys.readouterr().err.count("compiling the decode step for batch 2") == 1
    assert_same(generate(prompts, model, max_tokens=WINDOW, decode="eager"), after)
    assert after[1] != before[1]  # the change shows in the logprobs: the check can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_one_query_attention_equals_sdpa(dtype):
    """What compiled CPU steps attend with, against PyTorch's kernel: 8 query heads over 2 key/value
    heads, rows that see their whole buffer, 5 slots and 1 slot; op by op and compiled."""
    g = torch.Generator().manual_seed(5)
    xq = torch.randn(3, 8, 16, generator=g).to(dtype)  # (B, H, Dh)
    keys, values = torch.randn(2, 3, 12, 2, 16, generator=g).to(dtype)  # (B, S, H_kv, Dh) each
    _, visible = slots_and_visibility(torch.tensor([20, 4, 0]), 12)  # (B, S)
    expected = torch.nn.functional.scaled_dot_product_attention(
        xq[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None], enable_gqa=True
    )[:, :, 0]
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bfloat16's rounding of the output
    torch.testing.assert_close(one_query_attention(xq, keys, values, visible), expected, **tolerance)
    compiled = torch.compile(one_query_attention, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(xq, keys, values, visible), expected, **tolerance)


def test_worked_example_of_slots_and_visibility():
    slots, visible = slots_and_visibility(torch.tensor([6, 1]), 4)
    assert slots.tolist() == [2, 1]
    assert visible.tolist() == [[True, True, True, True], [True, True, False, False]]


def test_a_finished_row_leaves_its_cache_and_position_alone():
    model = random_model(tiny_args(moe=False, max_batch_size=2), seed=24)
    cache = model.make_cache(2)
    cache.start_sequences(2)
    before_k, before_v = cache.cache_k.clone(), cache.cache_v.clone()
    settings = Sampling.uniform_settings(2, model.args.vocab_size, 0.0)
    step = make_decode_step(model, settings.greedy, settings.filtered, eos_id=None)
    with torch.no_grad():
        _, _, positions, alive, emitted = step(
            cache.cache_k, cache.cache_v, torch.tensor([5, 6]), torch.tensor([3, 9]), torch.tensor([True, False]),
            None, settings.temperature, settings.top_p, settings.top_k,
        )  # fmt: skip
    assert positions.tolist() == [4, 9]
    assert alive.tolist() == [True, False] and emitted[1].item() == -1
    assert not torch.equal(cache.cache_k[:, 0, 3], before_k[:, 0, 3])  # row 0 wrote slot 3
    torch.testing.assert_close(cache.cache_k[:, 1], before_k[:, 1], atol=0, rtol=0)  # row 1 wrote nothing
    torch.testing.assert_close(cache.cache_v[:, 1], before_v[:, 1], atol=0, rtol=0)


def test_decode_logits_with_grouped_experts_equals_the_one_token_moe():
    """``grouped_moe`` (the engine's per-step static step on CPU) changes how the experts run, not the result."""
    model = random_model(tiny_args(moe=True, max_batch_size=4), seed=26)
    cache = model.make_cache(4)
    cache.start_sequences(4)
    cache.cache_k.normal_()
    cache.cache_v.normal_()
    args = (torch.tensor([5, 6, 7, 8]), torch.tensor([3, 9, 0, 12]), torch.tensor([True, True, False, True]))
    with torch.no_grad():
        one_token = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *args)
        grouped = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *args, grouped_moe=True)
    torch.testing.assert_close(grouped, one_token, atol=1e-5, rtol=1e-5)


def called_nodes(graph: torch.fx.GraphModule):
    """The op nodes a compiled step runs: its graph's, and each region's (``decode_step.in_regions``)
    at every call of it, in place of the call."""
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        operands = [*node.args, *node.kwargs.values()]
        regions = [
            getattr(graph, operand.target) for operand in operands
            if isinstance(operand, torch.fx.Node) and operand.op == "get_attr"
            and isinstance(getattr(graph, operand.target, None), torch.fx.GraphModule)
        ]  # fmt: skip
        if regions:
            for region in regions:
                yield from called_nodes(region)
        else:
            yield node


def called_ops(graph: torch.fx.GraphModule) -> collections.Counter:
    """``called_nodes``' ops, counted by name."""
    return collections.Counter(str(node.target) for node in called_nodes(graph))


def compiled_graph(step, cache, *args):
    """``step``'s graph as compiled code sees it (after functionalization, before inductor), given
    the cache's layers (``layer_keys``, ``layer_values``) and ``args``. Dynamo forgets what it
    compiled before: a step compiled for many models (one per test) would reach its recompile limit."""
    torch._dynamo.reset()
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep_graph), fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(cache.layer_keys, cache.layer_values, *args)
    (graph,) = graphs
    return graph


def compiled_code(step, *args) -> str:
    """The code inductor generates for ``step`` (compiled afresh) called on ``args``, and its result."""
    torch._dynamo.reset()
    with torch.inference_mode():
        result, codes = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), *args)
    return "\n".join(codes), result


def test_compiled_steps_compile_one_region_for_every_block():
    """Compiled, each block is a call of one region (``decode_step.in_regions``): the generated code
    defines it once and calls it once a layer; its ops, in the graph once, run at every call. The
    logits are the step's op by op. (Without regions the code holds none: the case without them of
    ``test_compiled_steps_write_the_cache_in_place``.)"""
    model = random_model(dataclasses.replace(tiny_args(moe=True, max_batch_size=2), n_layers=3), seed=27)
    cache = model.make_cache(2)
    cache.start_sequences(2)
    inputs = (torch.tensor([5, 6]), torch.tensor([3, 9]), torch.tensor([True, True]))  # tokens, positions, alive
    step = functools.partial(decode_logits, model)
    graph = compiled_graph(step, cache, *inputs)
    assert called_ops(graph)["aten.index_put.default"] == 2 * 3  # a key and a value a layer
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
    code, logits = compiled_code(step, cache.layer_keys, cache.layer_values, *inputs)
    defined = set(re.findall(r"def (\w*subgraph_\d+)\(", code))
    calls = re.findall(r"= (\w*subgraph_\d+)\(", code)
    assert (len(defined), len(calls)) == (1, 3)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_step_whose_regions_fail_to_compile_has_its_blocks_written_out(monkeypatch):
    """Where regions cannot take the step (an older torch; here a region that fails when traced), the
    step compiles with every block written out, the terminal says so in a line, and it decodes as
    the eager loop does."""

    def failing_region(*args):
        raise RuntimeError("no regions here")

    monkeypatch.setattr(decode_step, "block_region", failing_region)
    model = random_model(tiny_args(moe=False, max_batch_size=2), seed=27)
    prompts = random_prompts([5, 3], model.args.vocab_size, seed=3)
    messages = []
    step_compiler(model).announce = messages.append
    step_compiler(model).tuning = Tuning(ahead_of_time=False)  # torch.compile's step, where regions apply
    torch._dynamo.reset()
    compiled, _ = generate(prompts, model, max_tokens=2 * WINDOW, decode="compiled", temperature=0)
    eager, _ = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager", temperature=0)
    assert compiled == eager
    assert [m for m in messages if "as a region failed" in m and m.endswith("writing blocks out")], messages


def test_compiled_cpu_steps_attend_without_the_sdpa_kernel():
    """PyTorch's CPU attention kernel is slow for one query (``one_query_attention``): the compiled
    decode step on CPU attends with products and sums that inductor fuses."""
    model = random_model(tiny_args(moe=False, max_batch_size=2), seed=27)
    cache = model.make_cache(2)
    cache.start_sequences(2)
    graph = compiled_graph(functools.partial(decode_logits, model), cache, torch.tensor([5, 6]), torch.tensor([3, 9]),
                           torch.tensor([True, True]))  # fmt: skip
    ops = set(called_ops(graph))
    assert not [op for op in ops if "scaled_dot_product" in op]
    assert "aten.softmax.default" in ops or "aten._softmax.default" in ops


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_cpu_steps_multiply_plain_bfloat16_weights_as_reductions(batch):
    """A bfloat16 model with plain weights (``load_model(..., pack=False)``): the compiled step's
    products are multiply-and-sums that inductor fuses (``fast.cpu_reductions``), not
    the library's matmul, and its logits equal the step op by op within bfloat16's rounding."""
    model = random_model(tiny_args(moe=False, max_batch_size=2), seed=29).to(torch.bfloat16)
    cache = model.make_cache(batch)
    cache.start_sequences(batch)
    inputs = (torch.tensor([5, 6][:batch]), torch.tensor([3, 9][:batch]), torch.ones(batch, dtype=torch.bool))
    graph = compiled_graph(functools.partial(decode_logits, model), cache, *inputs)
    ops = set(called_ops(graph))
    assert not ops & {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
        compiled = torch.compile(functools.partial(decode_logits, model), fullgraph=True, dynamic=False)
        logits = compiled(cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)  # bfloat16: fused ops round less often


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_cpu_steps_route_experts_with_a_reduction(batch):
    """The router's product goes through ``linear()`` like every other: compiled on CPU it is a
    multiply-and-sum fused with the norm before it, not a library ``mm`` between two kernels
    (mixtral-bench w8a8 compiled decode, alternating: 98.0 -> 103.4 tokens/s). Its logits equal
    the step op by op within bfloat16's rounding (batch 1 gathers experts, batch 2 runs them all)."""
    model = random_model(tiny_args(moe=True, max_batch_size=2), seed=29).to(torch.bfloat16)
    cache = model.make_cache(batch)
    cache.start_sequences(batch)
    inputs = (torch.tensor([5, 6][:batch]), torch.tensor([3, 9][:batch]), torch.ones(batch, dtype=torch.bool))
    graph = compiled_graph(functools.partial(decode_logits, model), cache, *inputs)
    ops = called_ops(graph)
    assert ops["aten.mm.default"] == ops["aten.addmm.default"] == 0
    assert ops["aten.topk.default"] == model.args.n_layers  # one routing per layer
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)  # (B, V)
        compiled = torch.compile(functools.partial(decode_logits, model), fullgraph=True, dynamic=False)
        logits = compiled(cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_compiled_cpu_steps_normalize_once_per_product(moe):
    """Each RMSNorm's output is computed once, into a buffer the products read (``fast.cpu_reductions
    .materialized``): no loop of the generated code both sums (a product over a weight's rows) and
    takes a square root (the norm, recomputed per row). Without it, 4 (dense) and 7 (MoE) did:
    wq, wk and wv, the experts, the output matrix."""
    model = random_model(tiny_args(moe=moe, max_batch_size=1), seed=29).to(torch.bfloat16)
    cache = model.make_cache(1)
    cache.start_sequences(1)
    inputs = (torch.tensor([5]), torch.tensor([3]), torch.ones(1, dtype=torch.bool))
    torch._dynamo.reset()
    step = torch.compile(functools.partial(decode_logits, model), fullgraph=True, dynamic=False)
    with torch.inference_mode():
        _, codes = run_and_get_code(step, cache.cache_k, cache.cache_v, *inputs)
    loops = generated_loops(codes)
    assert len(loops) > 20 and sum("tmp_acc" in loop for loop in loops) > 10  # the products are in there
    norms = [loop for loop in loops if "sqrt" in loop]
    assert norms and not [loop for loop in norms if "tmp_acc" in loop]


def copies_back(code: str) -> bool:
    """Whether generated code copies a buffer back into an input (a kernel with ``copy_`` in its name,
    other than ``_to_copy``, a cast, or a ``.copy_(`` call): what a write through a view becomes."""
    return bool(re.search(r"(?<!_to)_copy_\w*\(|\.copy_\(", code))


@pytest.mark.parametrize("step, buffers, regions", [("decode", "layers", True), ("mixed", "layers", True),
                                                    ("decode", "whole", False)])
def test_compiled_steps_write_the_cache_in_place(step, buffers, regions):
    """Each layer's buffers are inputs of the step (``RotatingBufferCache.layer_keys``), and each
    layer's keys and values go into them by ``index_put``, which inductor does in place: the code
    copies nothing back (the mixed step: its chunk written before the decoding rows,
    ``decode_step.block``). Given the whole ``(L, B, S, H_kv, Dh)`` buffer, a block without
    regions writes through a view of it, and the code copies the whole cache back (``decode_step.layer_buffers``)."""
    tuning = Tuning(regions=regions)
    model = random_model(tiny_args(moe=False, max_batch_size=4), seed=27)
    cache = model.make_cache(4)
    cache.start_sequences(4)
    layers = (cache.layer_keys, cache.layer_values) if buffers == "layers" else (cache.cache_k, cache.cache_v)
    if step == "decode":
        code, _ = compiled_code(functools.partial(decode_logits, model, tuning=tuning), *layers, torch.tensor([5, 6]),
                                torch.tensor([3, 9]), torch.tensor([True, True]))  # fmt: skip
    else:
        chunk = pack_chunk([(3, 0, [1, 2, 3])], size=4, segments=1)
        alive = torch.tensor([True, True, False, False])
        code, _ = compiled_code(functools.partial(mixed_logits, model, tuning=tuning), *layers,
                                torch.tensor([5, 6, 0, 0]), torch.tensor([3, 9, 0, 0]), alive, chunk)  # fmt: skip
    assert "index_put" in code
    assert copies_back(code) == (buffers == "whole")
    if step == "decode":  # written out without regions (the mixed step's region, inductor inlines)
        assert bool(re.search(r"def \w*subgraph_\d+\(", code)) == regions


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
def test_moe_one_token_equals_the_grouped_layer(batch):
    """4 experts, top-2: batch 1 reads its 2 chosen experts (2 < 4); from batch 2 every expert runs.
    Each of the four forms ``moe_one_token`` picks from (by device and weight) equals the layer too,
    whatever the batch: the CUDA ones are checked here by their arithmetic."""
    model = random_model(tiny_args(moe=True), seed=25)
    layer = model.layers["0"].feed_forward
    x = torch.randn(batch, model.args.dim, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        expected = layer(x)
        torch.testing.assert_close(moe_one_token(layer, x), expected, atol=1e-5, rtol=1e-5)
        experts, weights = layer.route(x)
        one_by_one_forms = (functools.partial(experts_one_by_one, tuning=layer.tuning),
                            functools.partial(every_expert_one_by_one, tuning=layer.tuning))  # fmt: skip
        for form in (gathered_experts, every_expert_batched, *one_by_one_forms):
            torch.testing.assert_close(form(layer, x, experts, weights), expected, atol=1e-5, rtol=1e-5)


def test_the_chosen_experts_take_the_tuning_for_experts(monkeypatch):
    """``experts_one_by_one`` runs each chosen expert with the tuning for the experts
    (``Tuning.for_experts``: compiled, their products read in ``expert_streams`` places), and the
    tuning it was given is left as it was."""
    model = random_model(tiny_args(moe=True), seed=25)
    layer = model.layers["0"].feed_forward
    x = torch.randn(2, model.args.dim, generator=torch.Generator().manual_seed(2))  # (B, D)
    tuning = Tuning(streams=2, expert_streams=1)
    seen, expert = [], one_by_one.expert

    def noting_expert(moe, e, rows, tuning):
        seen.append(tuning)
        return expert(moe, e, rows, tuning)

    with torch.no_grad():
        expected = layer(x)
        experts, weights = layer.route(x)
        monkeypatch.setattr(one_by_one, "expert", noting_expert)
        out = experts_one_by_one(layer, x, experts, weights, tuning)
    assert [t.streams for t in seen] == [1] * 4 and tuning.streams == 2  # B * A = 4 chosen experts
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", [gathered_experts, every_expert_batched], ids=["gathered", "every-expert"])
def test_batched_expert_products_give_each_expert_its_own_rows(form):
    """The batched forms multiply each expert by its own copy of the rows: one bmm a matrix (then one
    that mixes the experts' outputs), a batch entry per expert, ``(E, B, I)`` for every expert on B
    rows, ``(B * A, 1, I)`` for each row's A chosen ones. Shared rows left to einsum's broadcast
    made one product of all the experts' rows side by side, ``(1, B, E * I)``, which ran 46x slower
    in bfloat16 on CPU (``expert_products``)."""
    model = random_model(tiny_args(moe=True), seed=25).to(torch.bfloat16)
    layer = model.layers["0"].feed_forward
    x = torch.randn(3, model.args.dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # (B, D)
    experts, weights = layer.route(x)  # (B, A)
    products = []

    class Products(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                products.append(tuple(out.shape))
            return out

    with torch.no_grad(), Products():
        out = form(layer, x, experts, weights)
    E, I, D = layer.w1.shape[0], model.args.hidden_dim, model.args.dim  # noqa: N806
    batches = {every_expert_batched: (E, 3), gathered_experts: (3 * 2, 1)}[form]
    assert products[:3] == [(*batches, I), (*batches, I), (*batches, D)]  # w1, w3, w2; then the mixing
    with torch.no_grad():
        torch.testing.assert_close(out, layer(x), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("one_by_one", [True, False], ids=["large-experts", "small-experts"])
def test_compiled_cpu_steps_read_the_chosen_experts_in_place(one_by_one):
    """Compiled on CPU, batch 1 multiplies its 2 chosen experts one by one where they are large
    (``moe_one_token``; here the threshold is lowered to the tiny model's experts): each of their 3
    matrices is selected by ``index_select`` at the routed index, which inductor loads through
    inside the product's loop. Small experts stay one gathered, batched product (no such selects).
    Either way no buffer in the generated code is as large as one expert's matrix (a copied expert
    would be), and the logits equal the step op by op within bfloat16's rounding."""
    tuning = Tuning(one_by_one_min_weights=0) if one_by_one else Tuning()
    model = random_model(tiny_args(moe=True, max_batch_size=1), seed=31).to(torch.bfloat16)
    cache = model.make_cache(1)
    cache.start_sequences(1)
    inputs = (torch.tensor([5]), torch.tensor([3]), torch.ones(1, dtype=torch.bool))
    step = functools.partial(decode_logits, model, tuning=tuning)
    graph = compiled_graph(step, cache, *inputs)
    expert_shapes = {(model.args.hidden_dim, model.args.dim), (model.args.dim, model.args.hidden_dim)}
    selected = [
        node for node in called_nodes(graph)
        if str(node.target) == "aten.index_select.default" and tuple(node.meta["val"].shape[1:]) in expert_shapes
    ]  # fmt: skip
    assert len(selected) == (2 * 3 * model.args.n_layers if one_by_one else 0)
    ops = set(called_ops(graph))
    assert "aten.mm.default" not in ops and ("aten.bmm.default" in ops) != one_by_one  # gathered: one batched product
    torch._dynamo.reset()
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs, tuning=tuning)  # (1, V)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        logits, codes = run_and_get_code(compiled, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
    buffers = [re.findall(r"\d+", shape) for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", "\n".join(codes))]
    assert buffers and max(math.prod(map(int, shape)) for shape in buffers) < model.args.hidden_dim * model.args.dim
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.02)


def test_slot_bucket_worked_example():
    assert slot_bucket(300, 4096) == 512
    assert slot_bucket(5000, 4096) == 4096
    assert slot_bucket(1, None) == 128
    assert slot_bucket(129, None) == 256


def test_compiled_decode_reuses_its_cache_for_the_same_shape():
    model = random_model(tiny_args(moe=False, sliding_window=None, max_batch_size=2), seed=26)
    compiler = StepCompiler(model, announce=lambda message: None)
    first = compiler.cache_for(2, 100)
    assert first.cache_size == 128 and compiler.cache_for(2, 120) is first
    assert compiler.cache_for(2, 200).cache_size == 256


def test_a_model_cast_after_decoding_gets_a_cache_of_its_new_dtype():
    """The kept cache is made anew when the model's dtype (or device) changed since: reused, a
    float32 buffer received bfloat16 keys (a traceback seen on CUDA, ``model.to(torch.bfloat16)``)."""
    model = random_model(tiny_args(moe=False, sliding_window=None, max_batch_size=2), seed=26)
    compiler = StepCompiler(model, announce=lambda message: None)
    assert compiler.cache_for(2, 100).cache_k.dtype == torch.float32
    model.to(torch.bfloat16)
    cache = compiler.cache_for(2, 100)
    assert cache.cache_k.dtype == cache.cache_v.dtype == torch.bfloat16 and compiler.cache_for(2, 120) is cache


def test_decode_mode_choices():
    model = random_model(tiny_args(moe=False), seed=27)
    assert decode_mode("auto", model) == "eager"  # CPU: the eager loop measures faster
    assert decode_mode("static", model) == "static"
    with pytest.raises(GenerationError, match="decode='fast' must be one of auto, eager, static, compiled"):
        decode_mode("fast", model)


def test_guards_are_skipped_only_within_one_loop_after_two_checked_steps(monkeypatch):
    """From the third compiled step of a loop on, dynamo runs only the guards that tell its graphs
    apart (``GUARDED_STEPS``); the caller's on_token keeps every guard, and a model edited
    between two calls is seen by the next call's checked steps. The fullgraph test's mixture, with
    its sampling (``compiled_case``): the same step, loaded where that test built it."""
    from mixtral_infer.steps import decode_loop

    model, prompts, eos_id = compiled_case(moe=True)
    settings = dict(max_tokens=6, eos_id=eos_id, **{**SAMPLINGS["top-k top-p"], "seed": 13})  # a seed that meets no EOS
    schedule, in_callback = [], []
    checked = decode_loop.guards_checked
    monkeypatch.setattr(decode_loop, "guards_checked", lambda ok: schedule.append(ok) or checked(ok))

    def on_token(index, token):
        in_callback.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)

    before = generate(prompts, model, decode="compiled", on_token=on_token, **settings)
    assert [len(tokens) for tokens in before[0]] == [6, 6, 6]  # none met the EOS this early
    assert schedule == [True, True, False, False, False]  # steps 2..6: the first token comes from the prompt's pass
    assert len(in_callback) == 18 and not any(in_callback)
    assert_same(generate(prompts, model, decode="eager", **settings), before)

    model.output.weight = torch.nn.Parameter(-model.output.weight.detach())  # a new object, not an in-place edit
    after = generate(prompts, model, decode="compiled", **settings)
    assert after[0] != before[0]
    assert_same(generate(prompts, model, decode="eager", **settings), after)
