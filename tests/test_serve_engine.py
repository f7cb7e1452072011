"""The continuous-batching engine, stepped by hand: tokens equal generate(), rows reused and freed."""

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.errors import GenerationError
from mixtral_infer.steps import decode_step, mixed_step
from mixtral_infer.steps.cpu_aot_step import BuildCache
from mixtral_infer.steps.decode_loop import GUARDED_STEPS
from mixtral_infer.sampling import Sampling, draw_uniform, sample
from mixtral_infer.generation.settings import kv_cache_bytes
from mixtral_infer.serve import sizing
from mixtral_infer.serve.prefix_reuse import Placement
from mixtral_infer.serve.engine import (
    ADMIT_EVERY_COMPILED,
    MIXED_MOE_TOKENS,
    NOT_FINITE,
    Engine,
    Finished,
    QueueFull,
    RequestSettings,
    TokenEvent,
    finite_rows,
    mixed_chunk_sizes,
    sample_rows,
)

PROMPTS = [
    "In the beginning",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them",
    "Blessed are",
    "And it came to pass",
    "Jesus wept.",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster, far faster on a busy machine


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    return model, Tokenizer.from_folder("tiny-mixtral")


class Recorder:
    """Collects each request's events, as the HTTP layer would."""

    def __init__(self):
        self.events = {}

    def sink(self, key):
        return lambda event: self.events.setdefault(key, []).append(event)

    def tokens(self, key):
        return [e.token for e in self.events[key] if isinstance(e, TokenEvent)]

    def text(self, key):
        return "".join(e.text for e in self.events[key])

    def finished(self, key):
        assert isinstance(self.events[key][-1], Finished)
        return self.events[key][-1]


def run(engine):
    while engine.step():
        pass


def solo(model, tokenizer, prompt, settings):
    generated, logprobs = generate(
        [prompt], model, max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, seed=settings.seed, eos_id=tokenizer.eos_id, prompt_logprobs=False,
    )  # fmt: skip
    return generated[0], logprobs[0]


def test_docstring_example_schedule(tiny):
    """R = 2, prefill budget 4, prompts of 3 and 6 tokens: seqlens [3, 1], [1, 4], [1, 1], [1, 1]."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=2, prefill_tokens=4, decode="eager")
    planned = []
    plan = engine._plan

    def recording_plan():
        result = plan()
        planned.append(result[0])
        return result

    engine._plan = recording_plan
    recorder = Recorder()
    a, b = [5, 6, 7], [8, 9, 10, 11, 12, 13]
    engine.submit(a, RequestSettings(max_tokens=5, temperature=0), recorder.sink("a"))
    engine.submit(b, RequestSettings(max_tokens=5, temperature=0), recorder.sink("b"))
    for _ in range(4):
        engine.step()
    assert planned == [[3, 1], [1, 4], [1, 1], [1, 1]]
    assert len(recorder.tokens("a")) == 4 and len(recorder.tokens("b")) == 2


def mixed_requests(tokenizer):
    requests = []
    for i in range(8):
        temperature, top_k = [(0.0, None), (0.9, 20), (0.3, None)][i % 3]
        settings = RequestSettings(max_tokens=4 + i % 4, temperature=temperature, top_k=top_k, seed=100 + i, logprobs=0)
        requests.append((tokenizer.encode(PROMPTS[i % len(PROMPTS)]), settings))
    return requests


@pytest.fixture(scope="module")
def mixed_solo(tiny):
    """What generate() gives each of ``mixed_requests`` alone."""
    model, tokenizer = tiny
    return [solo(model, tokenizer, prompt, settings) for prompt, settings in mixed_requests(tokenizer)]


NO_COMPILER = "CppCompileError: C++ compile error\nCommand: g++ ... (no such file)"


def no_cpp_compiler(monkeypatch):
    """``torch.compile`` and AOTInductor as they behave on a machine without a C++ compiler: the
    compiled function fails on its first call, before it runs anything, and a build fails."""

    def compile(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError(NO_COMPILER)

        return compiled

    def build(*args, **kwargs):
        raise RuntimeError(NO_COMPILER)

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", build)
    monkeypatch.setattr(BuildCache, "load", lambda self: None)  # nor any build kept from a machine that had one


@pytest.mark.parametrize("decode", ["eager", "static", "compiled", "compiled-prompts", "auto", "auto-uncompiled"])
def test_each_request_gets_its_solo_tokens(tiny, mixed_solo, decode, monkeypatch, capsys):
    """8 requests on 3 rows, a small prefill budget (prompts read over several steps: decoding
    rows and prompt chunks share forward passes), greedy,
    seeded top-k and seeded plain-temperature sampling in one batch: each gets exactly what
    generate() gives its prompt alone, with the same log-probabilities.

    Batched and solo logits differ by float noise (~1e-5 here), so a sampled token matches
    only where its uniform number is not within that noise of a boundary of the cumulative
    probabilities; a low temperature (or top-k) keeps the near-zero tail, where neighbouring
    boundaries are that close, out of reach of the draws.

    ``compiled-prompts``: the steps that read prompts compile too (``compile_prompts``, CUDA's default).
    ``auto``: on CPU each step picks the static step, compiled, or the eager pass. ``auto-uncompiled``:
    the same where compiling fails (no C++ compiler): the steps run uncompiled, after a warning.
    """
    model, tokenizer = tiny
    compile_prompts = decode == "compiled-prompts"
    uncompiled = decode == "auto-uncompiled"
    if uncompiled:
        no_cpp_compiler(monkeypatch)
        monkeypatch.delitem(model.__dict__, "_built_steps", raising=False)  # the steps built above
    decode = "compiled" if compile_prompts else "auto" if uncompiled else decode
    engine = Engine(model, tokenizer, rows=3, prefill_tokens=7, decode=decode, compile_prompts=compile_prompts)
    choices = []
    if decode == "auto":  # on CPU each step picks the static step or the eager pass
        assert engine.mode == "compiled" and engine.choose_per_step and engine.admit_every == ADMIT_EVERY_COMPILED
        engine.warm_up()  # as the server does before it serves: compiles, or falls back
        assert engine.mode == ("eager" if uncompiled else "compiled") and engine.choose_per_step
        assert engine.admit_every == (1 if uncompiled else ADMIT_EVERY_COMPILED)
        warning = capsys.readouterr().err
        assert warning == (
            "warning: AOTInductor cannot build this step (RuntimeError: CppCompileError: C++ compile error); "
            "using torch.compile\n"
            "warning: could not compile the decode step (RuntimeError: CppCompileError: C++ compile error); "
            "serving with the uncompiled steps\n" if uncompiled else ""
        )
        assert engine._step_calls == {"decode": 1}  # warm_up's call, with every row sitting out
        cheaper = engine._static_step_is_cheaper
        engine._static_step_is_cheaper = lambda seqlens: choices.append(cheaper(seqlens)) or choices[-1]
    recorder = Recorder()
    for i, (prompt, settings) in enumerate(mixed_requests(tokenizer)):
        engine.submit(prompt, settings, recorder.sink(i))
        if i % 3 == 2:
            engine.step()  # staggered arrivals: later requests join a running batch
    run(engine)
    for i, (tokens, logprobs) in enumerate(mixed_solo):
        assert recorder.tokens(i) == tokens, i
        got = [e.logprob for e in recorder.events[i] if isinstance(e, TokenEvent)]
        assert got == pytest.approx(logprobs, abs=1e-4)
        assert recorder.finished(i).reason == "length"
        assert recorder.text(i) == " " * tokenizer.id_to_piece(tokens[0]).startswith("\u2581") + tokenizer.decode(tokens)
    stats = engine.stats()
    assert {k: stats[k] for k in ("rows", "rows_free", "running", "queued", "admitted", "steps")} == {
        "rows": 3, "rows_free": 3, "running": 0, "queued": 0, "admitted": 8, "steps": engine.steps
    }  # fmt: skip
    if decode == "compiled":  # later steps ran with dynamo's guards skipped (decode_loop.GUARDED_STEPS)
        assert engine._step_calls["decode"] > GUARDED_STEPS
    if compile_prompts:  # the prompts were read in chunks padded to 7 tokens
        assert set(engine._step_calls) == {"decode", ("mixed", 7)} and engine._step_calls["mixed", 7] > GUARDED_STEPS
    elif decode != "eager":  # every step that read a prompt (auto: some) ran the mixed step, unpadded
        assert engine._step_calls["mixed", None] > (3 if decode != "auto" else 0)
    if decode == "auto":  # both kinds of step ran
        assert True in choices and False in choices
        assert engine._step_calls["decode"] - 1 + engine._step_calls["mixed", None] == choices.count(True)


def test_auto_picks_the_static_step_when_it_reads_less():
    """``Engine._static_step_is_cheaper``'s example: R = 4 rows of S = 8 slots, 3 rows running."""
    model = random_model(tiny_args(sliding_window=8))
    engine = Engine(model, Tokenizer.from_folder("tiny-mixtral"), rows=4, decode="auto")
    assert engine.mode == "compiled" and engine.choose_per_step and engine.cache.cache_size == 8
    engine.running = [type("Request", (), {"row": row, "next_token": 1})() for row in range(3)]  # rows 0-2 decode
    engine.cache.tokens_seen[:] = [2, 3, 4, 0]
    assert not engine._static_step_is_cheaper([1, 1, 1, 0])  # L = 5: 4 * 8 = 32 > 2 * 3 * 5
    engine.cache.tokens_seen[:] = [2, 3, 8, 0]
    assert engine._static_step_is_cheaper([1, 1, 1, 0])  # L = 8 (a full row): 32 <= 48
    engine.running.append(type("Request", (), {"row": 3, "next_token": None})())  # row 3 reads a fresh prompt
    assert engine._static_step_is_cheaper([1, 1, 1, 4])  # 32 + 4 * (8 + 4) = 80 <= 2 * (24 + 4 * 4)
    engine.cache.tokens_seen[:] = [2, 3, 4, 0]
    assert not engine._static_step_is_cheaper([1, 1, 1, 4])  # 80 > 2 * (3 * 5 + 16) = 62

    assert not Engine(model, Tokenizer.from_folder("tiny-mixtral"), rows=4, decode="eager").choose_per_step


def test_seeded_request_does_not_depend_on_its_batch_mates(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode(PROMPTS[0])
    settings = RequestSettings(max_tokens=12, temperature=1.0, top_k=10, seed=7)
    alone, crowded = Recorder(), Recorder()
    engine = Engine(model, tokenizer, rows=4, decode="eager")
    engine.submit(prompt, settings, alone.sink(0))
    run(engine)
    for i in range(3):  # mates that sample with top-p / top-k, and draw from generators of their own
        mate = RequestSettings(max_tokens=20, temperature=0.8, top_p=0.9, top_k=5 + i)
        engine.submit(tokenizer.encode(PROMPTS[i + 1]), mate, crowded.sink(f"mate{i}"))
    engine.step()
    engine.submit(prompt, settings, crowded.sink(0))
    run(engine)
    assert crowded.tokens(0) == alone.tokens(0)


def test_sample_rows_draws_each_row_from_its_own_generator():
    """Mixed greedy / plain / top-k / top-p rows in one call: each row's token is what sampling
    that row alone, with its own seeded generator, gives (generate()'s batch of one)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    settings = [
        RequestSettings(max_tokens=1, temperature=0.0),
        RequestSettings(max_tokens=1, temperature=1.0, seed=1),
        RequestSettings(max_tokens=1, temperature=0.7, top_k=5, seed=2),
        RequestSettings(max_tokens=1, temperature=1.2, top_p=0.8, seed=3),
        RequestSettings(max_tokens=1, temperature=2.0, seed=4),
    ]
    for _ in range(20):
        generators = [None] + [torch.Generator().manual_seed(s.seed) for s in settings[1:]]
        batched = sample_rows(logits, settings, generators).tolist()
        for row, s in enumerate(settings):
            alone = Sampling.uniform_settings(1, 50, s.temperature, s.top_p, s.top_k)
            uniform = draw_uniform(1, alone, torch.Generator().manual_seed(s.seed) if s.seed else None, "cpu")
            assert batched[row] == sample(logits[row : row + 1], alone, uniform).item()
        logits = logits.roll(1, dims=1)


def test_cancel_frees_the_row_at_the_next_step(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=2, decode="eager")
    recorder = Recorder()
    request = engine.submit(tokenizer.encode(PROMPTS[1]), RequestSettings(max_tokens=50, temperature=0), recorder.sink(0))
    waiting = engine.submit(tokenizer.encode(PROMPTS[2]), RequestSettings(max_tokens=50, temperature=0), recorder.sink(1))
    for _ in range(3):
        engine.step()
    engine.cancel(request)
    engine.cancel(waiting)
    assert engine.stats()["rows_free"] == 0
    engine.step()
    assert engine.stats()["rows_free"] == 2 and engine.stats()["running"] == 0
    assert recorder.finished(0).reason == "cancelled" and len(recorder.tokens(0)) == 3
    assert not engine.step()  # nothing left to run


def test_prompts_join_in_groups_with_admit_every(tiny):
    """admit_every=3, 2 rows: a request that arrives while the other row runs waits until 3
    steps have passed since the last admission (an idle engine admits at once)."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=2, decode="eager", admit_every=3)
    settings = RequestSettings(max_tokens=20, temperature=0)
    engine.submit([1, 5, 6], settings, lambda event: None)
    engine.step()  # step 0: idle, admitted at once
    engine.submit([1, 7], settings, lambda event: None)
    running = []
    for _ in range(3):
        engine.step()
        running.append(engine.stats()["running"])
    assert running == [1, 1, 2]  # steps 1 and 2 decode alone; step 3 admits the waiting prompt


def served_alone(engine, prompt, settings) -> list:
    """The tokens ``engine`` gives ``prompt``, submitted alone and run to the end."""
    recorder = Recorder()
    engine.submit(prompt, settings, recorder.sink(0))
    run(engine)
    return recorder.tokens(0)


def test_warm_up_compiles_the_decode_step_and_leaves_the_cache(tiny):
    """A compiled engine compiles before its first request; the cache is as it was, and requests then
    get their solo tokens. (The engine of ``test_each_request_gets_its_solo_tokens[compiled-prompts]``:
    its steps' builds are kept, from there or here.)"""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=3, prefill_tokens=7, decode="compiled", compile_prompts=True)
    engine.cache.cache_k.normal_()  # anything: warm-up must not write it
    before = engine.cache.cache_k.clone(), engine.cache.cache_v.clone()
    engine.warm_up()
    assert engine._step_calls == {"decode": 1, ("mixed", 7): 1}
    assert torch.equal(engine.cache.cache_k, before[0]) and torch.equal(engine.cache.cache_v, before[1])
    settings = RequestSettings(max_tokens=6, temperature=0)
    prompt = tokenizer.encode(PROMPTS[0])
    assert served_alone(engine, prompt, settings) == solo(model, tokenizer, prompt, settings)[0]
    Engine(model, tokenizer, rows=2, decode="eager").warm_up()  # nothing to compile: a no-op


def test_admit_every_defaults_to_groups_where_decode_steps_are_compiled(tiny):
    """A compiled decode step is much cheaper than a pass that reads a prompt: prompts join in groups."""
    model, tokenizer = tiny
    assert Engine(model, tokenizer, rows=2, decode="compiled").admit_every == ADMIT_EVERY_COMPILED > 1
    assert Engine(model, tokenizer, rows=2, decode="auto").admit_every == ADMIT_EVERY_COMPILED  # compiled on CPU too
    assert Engine(model, tokenizer, rows=2, decode="static").admit_every == 1
    assert Engine(model, tokenizer, rows=2, decode="compiled", admit_every=1).admit_every == 1
    assert Engine(model, tokenizer, rows=2, decode="compiled", compile_prompts=True).admit_every == 1


@pytest.mark.parametrize("decode", ["eager", "static", "auto"])
def test_nan_logits_fail_their_request_alone_and_its_row_is_cleared(tiny, decode):
    """At the 4th step one request's pass goes wrong (NaN in its logits and in its cache row): it
    ends with an error after 3 tokens, its batch mates get all their solo tokens, and the request
    that reuses its row too (the static step reads a row's unwritten slots under a mask, where a
    NaN left behind would spoil every sum). 3 rows, as the test above: ``auto`` reuses the decode
    step built there (a build is 30 s of the suite)."""
    model, tokenizer = tiny
    settings = RequestSettings(max_tokens=8, temperature=0)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = [solo(model, tokenizer, prompt, settings)[0] for prompt in prompts]
    engine = Engine(model, tokenizer, rows=3, decode=decode)
    recorder = Recorder()
    broken = engine.submit(prompts[0], settings, recorder.sink(0))
    engine.submit(prompts[1], settings, recorder.sink(1))
    engine.submit(prompts[2], settings, recorder.sink(2))  # every row taken: the next request gets the broken one's
    forward = engine._forward

    def breaking_forward(seqlens, chunks, sampled, *rest):
        logits = forward(seqlens, chunks, sampled, *rest)
        if engine.steps == 3:
            engine.cache.cache_k[:, broken.row] = float("nan")
            engine.cache.cache_v[:, broken.row] = float("nan")
            logits[sampled.index(broken)] = float("nan")
        return logits

    engine._forward = breaking_forward
    for _ in range(4):
        engine.step()
    assert recorder.finished(0).reason == "error" and recorder.finished(0).error == NOT_FINITE
    assert recorder.tokens(0) == expected[0][:3] and engine.stats()["rows_free"] == 1
    reuser = engine.submit(prompts[3], settings, recorder.sink(3))  # takes the broken request's row
    run(engine)
    assert reuser.row == broken.row
    assert [recorder.tokens(i) for i in (1, 2, 3)] == expected[1:]
    assert recorder.finished(3).reason == "length"


def test_queue_bound(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=1, max_queue=1, decode="eager")
    sink = Recorder().sink(0)
    settings = RequestSettings(max_tokens=4, temperature=0)
    engine.submit([1, 5], settings, sink)  # takes the row at the next step
    engine.step()
    engine.submit([1, 6], settings, sink)  # waits
    with pytest.raises(QueueFull, match="all 1 rows are busy and 1 requests are waiting"):
        engine.submit([1, 7], settings, sink)
    run(engine)
    engine.submit([1, 7], settings, sink)  # room again


def test_stop_string_and_eos_end_a_request_and_free_its_row(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode(PROMPTS[0])
    tokens, _ = solo(model, tokenizer, prompt, RequestSettings(max_tokens=12))
    full = " " + tokenizer.decode(tokens)
    stop = full[10:14]

    class EosAtFifthToken:  # the model never ends a verse with EOS in 12 tokens: make its 5th token the EOS
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        eos_id = tokens[4]

    engine = Engine(model, EosAtFifthToken(), rows=1, decode="eager")
    recorder = Recorder()
    engine.submit(prompt, RequestSettings(max_tokens=12, stop=[stop]), recorder.sink("stop"))
    engine.submit(prompt, RequestSettings(max_tokens=12, stop=["\n\n"]), recorder.sink("eos"))
    engine.submit(prompt, RequestSettings(max_tokens=12, ignore_eos=True), recorder.sink("ignore"))
    run(engine)
    assert recorder.text("stop") == full[:10] and recorder.finished("stop").reason == "stop"
    assert recorder.tokens("eos") == tokens[:4] and recorder.finished("eos").reason == "stop"
    assert recorder.tokens("ignore") == tokens and recorder.finished("ignore").reason == "length"
    assert engine.stats()["rows_free"] == 1 and engine.stats()["admitted"] == 3


@pytest.mark.parametrize("window", [None, WINDOW], ids=["no-window", "window"])
def test_prompt_too_long_for_max_model_len(window):
    """Without a window, max_model_len is what a row holds; with one, a bound the server was given
    on each request (it was dropped: a max_tokens of 10**30 ran until the client left)."""
    model = random_model(tiny_args(sliding_window=window))
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    engine = Engine(model, tokenizer, rows=2, max_model_len=16, decode="eager")
    with pytest.raises(GenerationError, match="exceeds this model's limit of 16 tokens per sequence"):
        engine.submit(list(range(1, 12)), RequestSettings(max_tokens=6), lambda event: None)
    recorder = Recorder()
    engine.submit(list(range(1, 11)), RequestSettings(max_tokens=6, temperature=0), recorder.sink(0))
    run(engine)
    expected, _ = generate([list(range(1, 11))], model, max_tokens=6)
    assert recorder.tokens(0) == expected[0]


def test_sizing_from_a_budget(tiny, monkeypatch):
    model, _ = tiny
    row = kv_cache_bytes(model.args, 1, model.args.sliding_window, model.dtype, model.parallel)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(sizing, "total_memory", lambda device: 2 * (weights + 1000 + 10 * row))
    monkeypatch.setattr(sizing, "measure_step_peak", lambda model, n, slots: 1000)
    monkeypatch.setattr(sizing, "free_memory", lambda device: None)
    plan = sizing.plan_rows(model, prefill_tokens=64, memory_fraction=0.5)
    assert (plan.rows, plan.row_bytes, plan.step_peak_bytes) == (10, row, 1000)
    assert sizing.plan_rows(model, prefill_tokens=64, memory_fraction=0.5, max_rows=3).rows == 3
    with pytest.raises(GenerationError, match="leaves no room for one row"):
        sizing.plan_rows(model, prefill_tokens=64, memory_fraction=0.2)


def test_sizing_docstring_example():
    from mixtral_infer import ModelArgs

    args = ModelArgs(dim=4096, n_layers=32, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, norm_eps=1e-5,
                     vocab_size=32000, sliding_window=4096)  # fmt: skip
    from mixtral_infer.model.parallel import Parallel

    row = kv_cache_bytes(args, 1, 4096, torch.bfloat16, Parallel())
    assert row == 512 * 2**20
    assert int((72e9 - 14.5e9 - 1e9) // row) == 105


def test_a_step_that_breaks_off_mid_prompt_fails_its_requests_and_the_next_ones_run(tiny):
    """A prompt chunk cut short between layers marks the cache damaged (``RotatingBufferCache.damaged``);
    the engine fails what it held, as for any broken step, and its next requests start afresh (the
    mark would otherwise refuse every later step)."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=2, decode="eager")
    prompt = list(range(3, 3 + 40))
    recorder = Recorder()
    engine.submit(prompt, RequestSettings(max_tokens=4, temperature=0), recorder.sink("broken"))
    hook = model.layers["1"].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    hook.remove()
    assert engine.cache.damaged
    engine._fail_all("RuntimeError: out of memory")  # as the engine's thread does
    assert recorder.finished("broken").reason == "error"
    engine.submit(prompt, RequestSettings(max_tokens=4, temperature=0), recorder.sink("next"))
    run(engine)
    assert recorder.tokens("next") == generate([prompt], model, max_tokens=4)[0][0]


def test_finite_rows_finds_nan_and_inf_anywhere():
    logits = torch.randn(5, 7)
    logits[1, 3], logits[2, 0], logits[3, 6] = float("nan"), float("inf"), -float("inf")
    assert finite_rows(logits).tolist() == [True, False, False, False, True]
    assert finite_rows(logits).tolist() == torch.isfinite(logits).all(dim=-1).tolist()


def test_mixed_chunk_sizes_docstring_example():
    assert mixed_chunk_sizes(512) == [16, 64, 256, 512]
    assert mixed_chunk_sizes(7) == [7]
    assert mixed_chunk_sizes(64) == [16, 64]
    assert mixed_chunk_sizes(512, cap=64) == [16, 64]


def test_a_compiled_mixture_of_experts_reads_at_most_moe_tokens_a_step(tiny):
    """Every expert on every token: the compiled mixed step of an MoE reads small chunks."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=4, prefill_tokens=512, decode="compiled", compile_prompts=True)
    assert engine.chunk_sizes == [16, MIXED_MOE_TOKENS] and engine.step_budget == MIXED_MOE_TOKENS
    engine.submit(list(range(1, 150)), RequestSettings(max_tokens=1), Recorder().sink(0))
    engine._admit(engine.queue.popleft(), Placement(0, 0))
    seqlens, _, sampled = engine._plan()  # the first step's plan: 64 of the prompt's 149 tokens
    assert seqlens == [MIXED_MOE_TOKENS, 0, 0, 0] and not sampled


def test_compile_prompts_needs_a_compiled_decode_step(tiny):
    model, tokenizer = tiny
    with pytest.raises(GenerationError, match="compile_prompts needs decode='compiled'"):
        Engine(model, tokenizer, rows=2, decode="static", compile_prompts=True)
    assert not Engine(model, tokenizer, rows=2, decode="compiled").compile_prompts  # on CPU, by default


def test_an_engine_whose_regions_fail_to_compile_writes_blocks_out(tiny, monkeypatch, capsys):
    """Where regions cannot take a step (an older torch; here the mixed step's region fails when
    traced), the engine says so in one line and compiles its steps with every block written out:
    a request still gets its solo tokens."""
    model, tokenizer = tiny

    def failing_region(*args):
        raise RuntimeError("no regions here")

    monkeypatch.setattr(decode_step, "block_region", failing_region)  # the pass the mixed step shares
    # the warm-up test's rows and chunk: its decode step's build is kept with the model (compiler.built_steps)
    engine = Engine(model, tokenizer, rows=3, prefill_tokens=7, decode="compiled", compile_prompts=True)
    settings = RequestSettings(max_tokens=6, temperature=0)
    prompt = tokenizer.encode(PROMPTS[1])
    assert served_alone(engine, prompt, settings) == solo(model, tokenizer, prompt, settings)[0]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "as a region failed" in line]
    assert len(warnings) == 1 and warnings[0].endswith("writing blocks out") and engine.compiler.written_out
