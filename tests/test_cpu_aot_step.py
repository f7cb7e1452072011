"""The CPU decode step built by AOTInductor (steps/cpu_aot_step.py) = torch.compile's step, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch
from conftest import PACKS, WINDOW, random_model, tiny_args
from test_model import random_prompts

import mixtral_infer.steps.compiler as compiler
from mixtral_infer import Tokenizer, generate
from mixtral_infer.steps.cpu_aot_step import (
    CPU_INDUCTOR_OPTIONS,
    AotStep,
    BuildCache,
    build_key,
    builds_ahead_of_time,
    inductor_configs,
    step_signature,
)
from mixtral_infer.formats.packing import pack_model
from mixtral_infer.steps.decode_loop import step_compiler
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent
from mixtral_infer.steps.compiler import DECODE_LOGITS
from mixtral_infer.tuning import Tuning

SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)


def steps_built(model) -> list:
    return [type(step).__name__ for step in step_compiler(model).steps.values()]


def decode_both_ways(model, prompts, **settings):
    """(tokens, logprobs) from the AOTInductor step, then from torch.compile's, same settings; both
    of the same graph, every block written out (``Tuning.regions`` off for torch.compile's:
    export takes no regions, and the kernels of a region end at its block, so their sums may differ
    in the last bits)."""
    messages = []
    step_compiler(model).announce = messages.append
    step_compiler(model).tuning = Tuning(regions=False)
    ahead = generate(prompts, model, decode="compiled", **settings)
    assert steps_built(model) == ["AotStep"], messages
    step_compiler(model).tuning = Tuning(regions=False, ahead_of_time=False)
    step_compiler(model).steps.clear()
    compiled = generate(prompts, model, decode="compiled", **settings)
    assert len(steps_built(model)) == 1 and steps_built(model) != ["AotStep"]
    return ahead, compiled


@pytest.mark.parametrize(
    "moe, dtype, quantize",
    [(False, torch.bfloat16, "int8"), (True, torch.bfloat16, "int4")],
    ids=["mistral-int8", "mixtral-int4"],
)
def test_the_aot_step_decodes_as_torch_compile_does(moe, dtype, quantize):
    """Ragged prompts, sampling, decoding 3x past the window: the same tokens and the same
    log-probabilities to the last bit (the same kernels, called from C++). Plain weights: float32
    MoE in the serving engine's test below (bit for bit too), float32 dense in the replaced-weight
    test (against the static step); bfloat16 plain weights are the reductions int8's are, less the
    scales (two more builds each, a minute and a half of the suite with a cold compile cache)."""
    model = random_model(tiny_args(moe=moe, max_batch_size=3), seed=41).to(dtype)
    if quantize is not None:
        quantize_model(model, quantize)
    prompts = random_prompts([2 * WINDOW + 1, 3, 6], model.args.vocab_size, seed=9)
    ahead, compiled = decode_both_ways(model, prompts, max_tokens=3 * WINDOW, **SAMPLED)
    assert ahead == compiled


def test_a_replaced_weight_makes_a_new_build_and_an_edited_one_is_read_in_place():
    """The library reads the model's own tensors: an in-place edit shows in the next step without a
    build; a weight replaced by a new tensor is noticed (``current()``) and the step built anew."""
    model = random_model(tiny_args(moe=False, max_batch_size=1), seed=42)
    prompts = random_prompts([5], model.args.vocab_size, seed=10)
    compiler = step_compiler(model)
    compiler.announce = lambda message: None
    plain = generate(prompts, model, decode="compiled", max_tokens=6)
    (first,) = compiler.steps.values()
    assert isinstance(first, AotStep) and first.current()
    assert first.constants["model.output.weight"] is model.output.weight  # not a copy

    with torch.no_grad():
        model.output.weight.neg_()  # in place
    edited = generate(prompts, model, decode="compiled", max_tokens=6)
    assert list(compiler.steps.values()) == [first] and first.current()
    assert edited[0] != plain[0] and edited[0] == generate(prompts, model, decode="static", max_tokens=6)[0]

    model.output.weight = torch.nn.Parameter(-model.output.weight.detach())  # a new object: back to plain
    assert not first.current()
    again = generate(prompts, model, decode="compiled", max_tokens=6)
    (second,) = compiler.steps.values()
    assert second is not first and second.current()
    assert again == plain


@pytest.mark.parametrize(
    "weights, ahead", [("bfloat16", True), ("int8", True), ("int4", True), ("nf4-32", True), ("w8a8", False), ("packed", False)]
)
def test_which_steps_are_built_ahead_of_time(weights, ahead):
    """w8a8's kernels take packed matrices that AOTInductor would make constants of its own,
    oneDNN-packed weights are read by handle; their steps go to torch.compile directly."""
    model = random_model(tiny_args(moe=True), seed=43).to(PACKS if weights == "packed" else torch.bfloat16)
    if weights == "packed":
        pack_model(model, dtypes=(PACKS,))
    elif weights != "bfloat16":
        quantize_model(model, weights)
    assert builds_ahead_of_time(model) is ahead


@pytest.fixture
def build_cache(tmp_path, monkeypatch):
    """An empty folder of kept builds (``BuildCache``), this test's own."""
    monkeypatch.setattr(BuildCache, "root", classmethod(lambda cls: str(tmp_path)))
    return tmp_path


def kept_builds(folder) -> list:
    return [entry for entry in folder.iterdir() if entry.name != BuildCache.SIGNATURES]


def no_build(*args, **kwargs):
    raise AssertionError("built, where the kept build should have been loaded")


def test_kept_builds_are_found_by_signature_or_graph_with_inductor_s_constants_and_copies_of_weights_refused(monkeypatch, build_cache):
    """int4's product is lowered to a call taking the group size as a one-value tensor, a constant
    AOTInductor adds and does not keep: the build records it (the step then decodes as
    torch.compile's, test above), and keeps it with the build, so a step loaded from the cache has
    it too: another model of the same shapes finds the build by its signature, with no export, and
    reads its own weights; where the note of a signature names a tensor that is not as noted (a note
    written for other weights), the export finds the build by its graph and notes it again.
    w8a8's lowering adds fbgemm's packed matrices, copies of the weights: the build refuses them,
    keeps nothing, and the step goes to torch.compile."""
    prompts = random_prompts([4], 128, seed=12)
    build, export = torch._inductor.aoti_compile_and_package, torch.export.export
    exports = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or export(*a, **k))
    for seed, found_by in [(45, None), (46, "signature"), (46, "graph")]:  # a new model of those weights: its own compiler
        if found_by == "graph":
            (note,) = (build_cache / BuildCache.SIGNATURES).iterdir()
            entry = json.loads(note.read_text())
            name = next(iter(entry["constants"]))
            entry["constants"][name] = entry["constants"][name].replace("(", "(3, ", 1)  # another shape
            note.write_text(json.dumps(entry))
        model = random_model(tiny_args(moe=False, max_batch_size=1), seed=seed).to(torch.bfloat16)
        quantize_model(model, "int4")
        exports.clear()
        tokens, _ = generate(prompts, model, decode="compiled", max_tokens=3)
        (step,) = step_compiler(model).steps.values()
        assert isinstance(step, AotStep) and step.loaded is (found_by is not None) and step.current()
        assert exports == ([] if found_by == "signature" else [1])
        assert len(step.scalars) >= 2 * model.args.n_layers
        assert {int(value) for value in step.scalars.values()} == {32}  # int4's group size, one a product
        assert tokens == generate(prompts, model, decode="static", max_tokens=3)[0]  # its own weights read
        monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_build)
    assert json.loads(note.read_text()) != entry  # noted again as it is
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", build)
    assert len(kept_builds(build_cache)) == 1

    model = random_model(tiny_args(moe=False, max_batch_size=1), seed=45).to(torch.bfloat16)
    quantize_model(model, "w8a8")
    monkeypatch.setattr(compiler, "builds_ahead_of_time", lambda model: True)  # tried, not skipped
    messages = []
    step_compiler(model).announce = messages.append
    tokens, _ = generate(prompts, model, decode="compiled", max_tokens=3)
    assert any("(NotAheadOfTime: AOTInductor made" in message for message in messages), messages
    assert steps_built(model) != ["AotStep"]
    assert tokens == generate(prompts, model, decode="static", max_tokens=3)[0]
    assert len(kept_builds(build_cache)) == 1  # the refused build was not kept


class Product(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T


def key_of(weight: torch.Tensor, x: torch.Tensor) -> str:
    return build_key(torch.export.export(Product(weight), (x,), strict=False))


def test_a_build_is_found_again_by_its_graph_and_layouts_not_by_its_weights_values():
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g)
    key = key_of(weight, x)
    assert key_of(torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g)) == key  # other values: the same build
    others = [
        key_of(torch.randn(5, 3), x),  # another shape of weight
        key_of(weight.to(torch.bfloat16), x.to(torch.bfloat16)),  # another dtype
        key_of(torch.randn(3, 4).T, x),  # the same shape, transposed in memory: the library indexes it otherwise
        key_of(weight, torch.randn(1, 3)),  # another batch
    ]
    assert len({key, *others}) == 5
    # AOTInductor writes the device it built for into its options at a process's first build (as
    # here): the key stays, or a build kept by one process's first step is not found by a later one.
    device = {"AOTI_DEVICE_KEY": "cpu", "AOTI_CPU_ISA": "AVX512"}
    with torch._inductor.config.patch({"aot_inductor.metadata": device}):
        assert key_of(weight, x) == key


def test_a_kept_build_that_does_not_load_is_removed_and_caches_can_be_switched_off(tmp_path, monkeypatch):
    entry = BuildCache(str(tmp_path / "entry"))
    assert entry.load() is None  # nothing kept
    entry.save(str(tmp_path / "missing.pt2"), {})  # nothing to keep: skipped, nothing half-written
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / BuildCache.PACKAGE).write_bytes(b"cut short")
    assert entry.load() is None and not (tmp_path / "entry").exists()

    exported = torch.export.export(Product(torch.ones(2, 2)), (torch.ones(1, 2),), strict=False)
    monkeypatch.setattr(BuildCache, "root", classmethod(lambda cls: str(tmp_path)))
    assert BuildCache.for_graph(exported).folder == str(tmp_path / build_key(exported))
    with torch._inductor.config.patch(force_disable_caches=True):  # TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
        assert BuildCache.for_graph(exported) is None


def test_cpu_steps_fuse_each_multiply_and_add():
    """``CPU_INDUCTOR_OPTIONS`` (every CPU step's, the AOTInductor builds' too): ``a * b + c`` is one
    fused multiply-add, rounded once. Worked example: ``a = b = 1 + 2**-13`` gives ``a * b = 1 +
    2**-12 + 2**-26``, which float32 rounds to ``1 + 2**-12`` (its steps there are 2**-23); with
    ``c = -(1 + 2**-12)`` the sum is 0 when the product is rounded first, ``2**-26`` when fused.
    (The AOTInductor step equals torch.compile's bit for bit, above: both are built so.)"""
    assert inductor_configs().items() >= CPU_INDUCTOR_OPTIONS.items()
    a = torch.full((64,), 1 + 2**-13)
    c = torch.full((64,), -(1 + 2**-12))

    def multiply_add(a, b, c):
        return a * b + c

    assert torch.equal(multiply_add(a, a, c), torch.zeros(64))  # op by op: rounded twice
    torch._dynamo.reset()
    fused = torch.compile(multiply_add, dynamic=False, options=CPU_INDUCTOR_OPTIONS)(a, a, c)
    assert torch.equal(fused, torch.full((64,), 2.0**-26))


def test_a_step_aot_cannot_build_falls_back_to_torch_compile_and_says_why(monkeypatch, build_cache):
    model = random_model(tiny_args(moe=False, max_batch_size=1), seed=44)
    prompts = random_prompts([4], model.args.vocab_size, seed=11)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("an op with no C shim\nsecond line")

    monkeypatch.setattr(AotStep, "__init__", refuse)
    messages = []
    step_compiler(model).announce = messages.append
    tokens, _ = generate(prompts, model, decode="compiled", max_tokens=5)
    assert "AOTInductor cannot build this step (RuntimeError: an op with no C shim); using torch.compile" in messages
    assert steps_built(model) != ["AotStep"]
    assert tokens == generate(prompts, model, decode="static", max_tokens=5)[0]


def served(engine, prompts):
    """Each prompt's (token, log-probability) pairs, every prompt submitted at once to ``engine``."""
    events = {}
    for i, prompt in enumerate(prompts):
        sink = lambda event, i=i: events.setdefault(i, []).append(event)  # noqa: E731
        engine.submit(prompt, RequestSettings(max_tokens=2 * WINDOW, logprobs=0), sink)
    while engine.step():
        pass
    return [[(e.token, e.logprob) for e in events[i] if isinstance(e, TokenEvent)] for i in range(len(prompts))]


WRITTEN_OUT = Tuning(regions=False)  # the AOT step's graph, as in decode_both_ways


def engine_for(model, decode="compiled", tuning=WRITTEN_OUT):
    return Engine(model, Tokenizer.from_folder("tiny-mixtral"), rows=2, prefill_tokens=8, decode=decode, tuning=tuning)


def decode_step_of(engine):
    """The decode step ``engine``'s compiler has built (one: a step built for weights since replaced is dropped)."""
    (step,) = [step for key, step in engine.compiler.steps.items() if key[0] == DECODE_LOGITS.name]
    return step


def test_the_serving_engine_s_cpu_decode_step_is_built_ahead_of_time():
    """The engine's compiled decode step on CPU (``steps.compiler``) is the AOT step: 3 requests on
    2 rows, decoding 2x past the window, get the tokens and log-probabilities torch.compile's step
    gives, bit for bit; a second engine reuses the build; a weight replaced between requests makes
    it build again (it would read the old one), and the requests then get what the static step
    gives them on the new weights."""
    model = random_model(tiny_args(moe=True, max_batch_size=2), seed=46)
    prompts = random_prompts([5, 11, 3], model.args.vocab_size, seed=13)
    engine = engine_for(model)
    ahead = served(engine, prompts)
    first = decode_step_of(engine)
    assert isinstance(first, AotStep)
    second = engine_for(model)  # a new engine on the same model and rows: the step is kept with the model
    assert served(second, prompts) == ahead and decode_step_of(second) is first

    other = engine_for(model, tuning=Tuning(regions=False, ahead_of_time=False))
    assert served(other, prompts) == ahead
    assert not isinstance(decode_step_of(other), AotStep)

    model.output.weight = torch.nn.Parameter(-model.output.weight.detach())
    again = served(engine, prompts)
    step = decode_step_of(engine)
    assert step is not first and isinstance(step, AotStep) and step.current()
    tokens = [[token for token, _ in pairs] for pairs in again]
    assert tokens == [[token for token, _ in pairs] for pairs in served(engine_for(model, "static"), prompts)]
    assert tokens != [[token for token, _ in pairs] for pairs in ahead]


def test_auto_decodes_eagerly_while_the_step_is_built_then_hands_over(monkeypatch, build_cache):
    """``decode="auto"`` on CPU: the eager loop decodes while AOTInductor builds the step on its own
    thread (the third token's callback waits for the build here, so the hand-over falls mid-way),
    then the static loop takes the rows still decoding on through the built step: the eager loop's
    tokens and log-probabilities, the row that ended early (EOS) staying ended. The next call has the
    step at once. float32: the compiled step's products are the eager ones to the last bits."""
    import mixtral_infer.generation.generate as generation

    settings = SAMPLED
    monkeypatch.setenv(generation.BACKGROUND_VARIABLE, "1")
    model = random_model(tiny_args(moe=False, max_batch_size=2), seed=43)
    prompts = random_prompts([7, 4], model.args.vocab_size, seed=11)
    eager = generate(prompts, model, decode="eager", max_tokens=12, **settings)
    eos_id = eager[0][1][2]  # row 1's third token ends it
    eager = generate(prompts, model, decode="eager", max_tokens=12, eos_id=eos_id, **settings)
    assert len(eager[0][1]) == 2 and len(eager[0][0]) == 12

    messages, builds, handed_over, policies = [], [], [], []
    compiler = step_compiler(model)
    compiler.announce = messages.append
    build = compiler.build_in_background
    monkeypatch.setattr(compiler, "build_in_background", lambda *a: builds.append(build(*a)) or builds[-1])
    static = generation.decode_static
    monkeypatch.setattr(generation, "decode_static", lambda *a, **k: handed_over.append(k.get("alive")) or static(*a, **k))
    seen = []

    def on_token(row, token):
        seen.append(row)
        if len(seen) == 5:  # two tokens of each row, then row 0's third (row 1's is EOS): wait for the build
            policies.append(scheduling_policy(builds[0].pid))
            assert builds[0].wait(timeout=600)

    auto = generate(prompts, model, decode="auto", max_tokens=12, eos_id=eos_id, on_token=on_token, **settings)
    assert auto[0] == eager[0]
    torch.testing.assert_close(auto[1], eager[1], rtol=1e-5, atol=1e-5)
    assert steps_built(model) == ["AotStep"] and handed_over[0].tolist() == [True, False], messages
    assert any("in the background" in message for message in messages)
    assert policies == [os.SCHED_IDLE]  # the child takes only the cores nothing else wants
    builds.clear()
    assert generate(prompts, model, decode="auto", max_tokens=12, eos_id=eos_id, **settings)[0] == eager[0]
    assert builds == [None]  # built already: the static loop from the first token

    # The next start: another model of these shapes (another process's, as a second run of a command
    # line) finds the build the child kept by its signature, no export, and decodes with it from its
    # first token, reading its own weights.
    other = random_model(tiny_args(moe=False, max_batch_size=2), seed=44)
    own = generate(prompts, other, decode="eager", max_tokens=12, eos_id=eos_id, **settings)
    messages.clear(), builds.clear()
    step_compiler(other).announce = messages.append
    monkeypatch.setattr(torch.export, "export", no_build)
    build = step_compiler(other).build_in_background
    monkeypatch.setattr(step_compiler(other), "build_in_background", lambda *a: builds.append(build(*a)) or builds[-1])
    kept = generate(prompts, other, decode="auto", max_tokens=12, eos_id=eos_id, **settings)
    assert kept[0] == own[0] and builds == [None] and steps_built(other) == ["AotStep"]
    torch.testing.assert_close(kept[1], own[1], rtol=1e-5, atol=1e-5)
    assert any("compiled by an earlier run" in message for message in messages), messages


def scheduling_policy(pid: int, wait_s: float = 10.0) -> int:
    """The scheduling policy of process ``pid`` once the child has set its own (forked, it starts with
    its parent's)."""
    deadline = time.monotonic() + wait_s
    while os.sched_getscheduler(pid) == os.SCHED_OTHER and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.sched_getscheduler(pid)


def signature_of(model, known_as=("decode", True), batch: int = 1) -> str:
    args = (torch.zeros(batch, dtype=torch.long), 0.7)
    return step_signature(model, args, known_as)


def test_a_step_s_signature_is_its_model_s_shapes_and_settings_not_its_weights_values(monkeypatch):
    """The worked example of ``step_signature``: what a kept build is found by without an export."""
    args = tiny_args(moe=False, max_batch_size=1)
    signature = signature_of(random_model(args, seed=1))
    assert signature_of(random_model(args, seed=2)) == signature  # other weights: the same build
    fed = step_signature(random_model(args, seed=1), (torch.ones(1, dtype=torch.long), 0.7), ("decode", True))
    assert fed == signature  # other tokens fed (the arguments' values): the same build
    quantized = random_model(args, seed=1)
    quantize_model(quantized, "int8")
    transposed = random_model(args, seed=1)
    with torch.no_grad():
        transposed.output.weight = torch.nn.Parameter(transposed.output.weight.T.contiguous().T)
    others = [
        signature_of(random_model(dataclasses.replace(args, norm_eps=1e-6), seed=1)),  # a norm's eps
        signature_of(quantized),  # a format: other tensors, other modules
        signature_of(transposed),  # a weight laid out otherwise in memory
        signature_of(random_model(args, seed=1), known_as=("decode", False)),  # the step's options
        signature_of(random_model(args, seed=1), batch=2),  # its arguments' shapes
        signature_of(random_model(dataclasses.replace(args, sliding_window=16), seed=1)),  # a window
    ]
    tied = random_model(args, seed=1)
    tied.output.weight = tied.tok_embeddings.weight  # (128, 64) both: export reads one of them
    others.append(signature_of(tied))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the suite's conftest sets it where Triton is
    monkeypatch.setenv("TRITON_INTERPRET", "0" if interpreted else "1")  # read while tracing: the experts' ops on CPU
    others.append(signature_of(random_model(args, seed=1)))
    assert len({signature, *others}) == 1 + len(others)
    monkeypatch.undo()

    # Inductor writes a weight of at most 8 numbers into the code by value: its values are in the signature.
    small, wide = torch.nn.LayerNorm(8), torch.nn.LayerNorm(64)
    before = signature_of(small), signature_of(wide)
    with torch.no_grad():
        small.weight.mul_(2), wide.weight.mul_(2)
    assert signature_of(small) != before[0] and signature_of(wide) == before[1]


def test_a_kept_build_is_keyed_by_the_threads_it_was_built_for():
    """Inductor writes serial loops for one thread: a build made on one thread (a background build's
    child once was) is not found by a process on two."""
    exported = torch.export.export(torch.nn.Linear(4, 4), (torch.ones(1, 4),))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = build_key(exported)
        torch.set_num_threads(2)
        two = build_key(exported)
    finally:
        torch.set_num_threads(threads)
    assert one != two
