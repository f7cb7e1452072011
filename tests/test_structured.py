"""Structured output: the grammar's bitmask (llguidance) on our tokenizers, the logits changes
(bitmask, penalties, bias) against plain references and transformers."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from mixtral_infer import Tokenizer
from mixtral_infer.errors import GenerationError
from mixtral_infer.structured.grammar import Constraint, RowGrammar, check_constraint, fill_bitmask, ll_tokenizer
from mixtral_infer.structured.logits import RowPenalties, apply_bitmask, apply_penalties, dense_penalties

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["psalm", "proverb", "song"]},
        "verses": {"type": "integer", "minimum": 1, "maximum": 176},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "source": {"type": "object", "properties": {"book": {"type": "string", "maxLength": 12}}, "required": ["book"],
                   "additionalProperties": False},  # fmt: skip
    },
    "required": ["name", "kind", "verses", "tags", "source"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder("tiny-mixtral")


def random_walk(grammar: RowGrammar, tokenizer: Tokenizer, rng: random.Random, limit: int = 400) -> str:
    """Sample uniformly among the allowed tokens until the grammar is done or allows EOS and draws it;
    a token that closes something (a quote, a bracket, EOS) is drawn a third of the time when allowed,
    so that free text and open objects end."""
    closing = {tokenizer.eos_id} | {i for i in range(tokenizer.n_words) if tokenizer.byte_value(i) in (0x22, 0x7D, 0x5D)}
    tokens = []
    for _ in range(limit):
        bits = fill_bitmask([grammar], tokenizer.n_words)
        logits = apply_bitmask(torch.zeros(1, tokenizer.n_words), bits)[0]
        allowed = torch.nonzero(torch.isfinite(logits))[:, 0].tolist()
        assert allowed, "the grammar left no token"
        ends = [t for t in allowed if t in closing]
        token = rng.choice(ends if ends and rng.random() < 1 / 3 else allowed)
        if token == tokenizer.eos_id:
            break
        grammar.accept(token)
        tokens.append(token)
        if grammar.done:
            break
    return tokenizer.decode(tokens)


def test_pieces_become_the_bytes_they_write(tokenizer):
    ll = ll_tokenizer(tokenizer)
    the = tokenizer.encode("the", bos=False)
    assert ll.decode_bytes(the) == b" the"  # sentencepiece's ▁ is a space
    newline = [i for i in range(tokenizer.n_words) if tokenizer.byte_value(i) == 0x0A]
    assert ll.decode_bytes(newline) == b"\n"
    assert ll.is_special_token(tokenizer.eos_id) and not ll.is_special_token(the[0])


@pytest.mark.parametrize("kind, value", [("json_schema", SCHEMA), ("json_object", None)])
def test_fifty_random_walks_through_a_json_grammar_parse_and_validate(tokenizer, kind, value):
    """Any token the mask allows keeps the text valid: 50 uniform random walks all end in JSON that
    parses (and validates against the schema)."""
    grammar = check_constraint(Constraint(kind, value), tokenizer)
    rng = random.Random(0)
    for _ in range(50):
        text = random_walk(RowGrammar(grammar, tokenizer), tokenizer, rng)
        parsed = json.loads(text)
        if value is not None:
            jsonschema.validate(parsed, value)
        else:
            assert isinstance(parsed, dict)


def test_regex_and_choices(tokenizer):
    rng = random.Random(1)
    regex = check_constraint(Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), tokenizer)
    choice = check_constraint(Constraint("choice", ["yes", "no", "not sure"]), tokenizer)
    for _ in range(20):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", random_walk(RowGrammar(regex, tokenizer), tokenizer, rng))
        assert random_walk(RowGrammar(choice, tokenizer), tokenizer, rng) in ("yes", "no", "not sure")


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint("regex", "[a-z]+("), "the regex cannot be compiled: "),
        (Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "nonsense"}}}), "the json schema cannot be compiled"),
        (Constraint("json_schema", "{not json"), "the json schema cannot be compiled"),
        (Constraint("json_schema", [1]), "the JSON schema must be an object"),
        (Constraint("choice", []), "the choices must be a non-empty list"),
    ],
)
def test_a_constraint_that_cannot_compile_is_one_line(tokenizer, constraint, message):
    with pytest.raises(GenerationError) as error:
        check_constraint(constraint, tokenizer)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bitmask_against_a_loop():
    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    logits = torch.randn(3, 100)
    masked = apply_bitmask(logits, bits)
    for row in range(3):
        for token in range(100):
            allowed = (int(bits[row, token // 32]) >> (token % 32)) & 1
            assert masked[row, token] == (logits[row, token] if allowed else float("-inf"))


def test_penalties_docstring_example():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    counts = torch.tensor([[2.0, 0.0, 0.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_penalties(logits, counts, seen, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    assert out.tolist() == [[0.0, -2.0, 0.5]]


def test_presence_and_frequency_follow_openai_s_formula_and_bias_adds():
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence, per row, then the bias."""
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    rows = [RowPenalties.of(0.7, 0.3, 1.0, {4: 5.0, 9: -100.0}, prompt=[]), RowPenalties.of(0.0, 1.5, 1.0, None, prompt=[])]
    for token in (3, 3, 7, 9):
        rows[0].add(token)
    rows[1].add(11)
    out = apply_penalties(logits, *dense_penalties(rows, 50, torch.device("cpu")))
    expected = logits.clone()
    for row, penalties in enumerate(rows):
        for token, count in penalties.counts.items():
            expected[row, token] -= count * penalties.frequency + penalties.presence
        for token, bias in (penalties.bias or {}).items():
            expected[row, token] += bias
    assert torch.allclose(out, expected)


def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(2)
    logits = torch.randn(1, 40)
    prompt_and_generated = [3, 5, 5, 17, 39]
    row = RowPenalties.of(0.0, 0.0, 1.3, None, prompt=prompt_and_generated[:3])
    for token in prompt_and_generated[3:]:
        row.add(token)
    counts, seen, presence, frequency, repetition, bias = dense_penalties([row], 40, torch.device("cpu"))
    ours = apply_penalties(logits, torch.zeros_like(counts), seen, presence, frequency, repetition)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt_and_generated]), logits.clone())
    assert torch.allclose(ours, theirs)


def test_neutral_settings_make_no_row_penalties():
    assert RowPenalties.of(0.0, 0.0, 1.0, None, prompt=[1, 2]) is None
    assert RowPenalties.of(0.0, 0.0, 1.0, {}, prompt=[1, 2]) is None


# ---- the serving engine: constrained rows beside free ones ------------------------------------


@pytest.fixture(scope="module")
def tiny_engine_model():
    from mixtral_infer import load_model

    return load_model("tiny-mixtral", dtype=torch.float32, device="cpu")


def engine_answers(model, tokenizer, requests, rows=8, decode="eager"):
    """Every (prompt, settings) through one engine; each request's generated tokens and its end."""
    from mixtral_infer.serve.engine import Engine, Finished, TokenEvent

    engine = Engine(model, tokenizer, rows=rows, decode=decode)
    events = [[] for _ in requests]
    for (prompt, settings), sink in zip(requests, events):
        engine.submit(prompt, settings, sink.append)
    while engine.step():
        pass
    out = []
    for ev in events:
        assert isinstance(ev[-1], Finished)
        out.append(([e.token for e in ev if isinstance(e, TokenEvent)], ev[-1].reason, "".join(e.text for e in ev)))
    return out


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_thirty_schema_requests_beside_free_ones_in_one_engine(tiny_engine_model, tokenizer, decode):
    """The shipped model knows no JSON: 30 sampled requests with a JSON schema all return text that
    parses and validates; the unconstrained requests among them get exactly their tokens alone."""
    from mixtral_infer.serve.engine import RequestSettings

    rng = random.Random(5)
    prompts = [tokenizer.encode(f"Psalm {i}: the LORD is") for i in range(36)]
    constrained = RequestSettings(max_tokens=300, temperature=0.9, constraint=Constraint("json_schema", SCHEMA))
    requests = []
    for i, prompt in enumerate(prompts):
        free = i % 6 == 5
        settings = RequestSettings(max_tokens=8) if free else RequestSettings(**{**constrained.__dict__, "seed": rng.randrange(10**6)})
        requests.append((prompt, settings))
    answers = engine_answers(tiny_engine_model, tokenizer, requests, decode=decode)
    parsed = 0
    for (prompt, settings), (tokens, reason, text) in zip(requests, answers):
        if settings.constraint is None:
            alone = engine_answers(tiny_engine_model, tokenizer, [(prompt, settings)], rows=1, decode=decode)[0]
            assert tokens == alone[0]
            continue
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        parsed += 1
    assert parsed == 30


def test_penalties_bias_and_min_tokens_in_the_engine(tiny_engine_model, tokenizer):
    """A bias of -100 keeps a token out; min_tokens keeps EOS out; the repetition penalty gives the
    tokens of a plain loop over the model's logits with transformers' processor."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from mixtral_infer.serve.engine import RequestSettings

    model = tiny_engine_model
    prompt = tokenizer.encode("And God said, Let there be light")
    plain = engine_answers(model, tokenizer, [(prompt, RequestSettings(max_tokens=12, ignore_eos=True))])[0][0]
    banned = plain[0]
    biased = engine_answers(model, tokenizer, [(prompt, RequestSettings(max_tokens=12, logit_bias={banned: -100.0}))])[0][0]
    assert banned not in biased
    eos_first = [(prompt, RequestSettings(max_tokens=5, logit_bias={tokenizer.eos_id: 100.0}, min_tokens=3))]
    tokens, reason, _ = engine_answers(model, tokenizer, eos_first)[0]
    assert len(tokens) == 3 and reason == "stop"  # EOS as soon as it may come
    got = engine_answers(model, tokenizer, [(prompt, RequestSettings(max_tokens=12, repetition_penalty=1.5, ignore_eos=True))])[0][0]
    ids, expected = list(prompt), []
    processor = RepetitionPenaltyLogitsProcessor(1.5)
    with torch.inference_mode():
        for _ in range(12):  # the whole sequence read again at every step: no cache, no engine
            logits = model(torch.tensor(ids), [len(ids)])[-1:]  # (1, V)
            token = int(processor(torch.tensor([ids]), logits.clone()).argmax())
            ids.append(token)
            expected.append(token)
    assert got == expected and got != plain


# ---- generate(): every decoding path ---------------------------------------------------------


@pytest.mark.parametrize("decode", ["eager", "static", "compiled"])
def test_generate_with_a_json_schema_on_every_path(tokenizer, decode):
    """A batch of 4 sampled rows with a schema: every answer parses and validates; the static and
    compiled steps take the mask as a fixed-shape tensor and give the eager loop's tokens."""
    from mixtral_infer import generate, load_model

    model = load_model("tiny-mixtral", max_batch_size=4, dtype=torch.float32, device="cpu")
    prompts = [tokenizer.encode(f"Psalm {i}") for i in range(4)]
    kwargs = dict(max_tokens=300, temperature=0.9, seed=3, eos_id=tokenizer.eos_id, json_schema=SCHEMA, tokenizer=tokenizer)
    generated, _ = generate(prompts, model, decode=decode, **kwargs)
    for tokens in generated:
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    if decode != "eager":
        assert generated == generate(prompts, model, decode="eager", **kwargs)[0]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_generate_s_repetition_penalty_equals_transformers_generate(model_pair, decode):
    ours, hf, args = model_pair
    prompt = [1, 17, 17, 40, 9, 17, 3]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    generated, _ = generate_ours([prompt], ours, max_tokens=12, repetition_penalty=1.3, decode=decode)
    assert generated[0] == expected


def generate_ours(*args, **kwargs):
    from mixtral_infer import generate

    return generate(*args, **kwargs)


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_generate_s_penalties_bias_and_min_tokens_equal_the_eager_loop(tokenizer, decode):
    """The fixed-shape step counts the generated tokens on the device as the eager loop counts them."""
    from mixtral_infer import load_model

    model = load_model("tiny-mixtral", max_batch_size=3, dtype=torch.float32, device="cpu")
    prompts = [tokenizer.encode(text) for text in ("In the beginning", "And the LORD said", "Blessed are")]
    kwargs = dict(max_tokens=20, temperature=0.8, seed=1, eos_id=tokenizer.eos_id, presence_penalty=0.8,
                  frequency_penalty=0.6, logit_bias={5: 3.0, tokenizer.eos_id: 2.0}, min_tokens=6)  # fmt: skip
    eager, eager_lp = generate_ours(prompts, model, decode="eager", **kwargs)
    static, static_lp = generate_ours(prompts, model, decode=decode, **kwargs)
    assert static == eager and all(len(t) >= 6 for t in eager)
    assert [lp for row in static_lp for lp in row] == pytest.approx([lp for row in eager_lp for lp in row], abs=1e-4)


def test_generate_s_stop_strings_end_a_row_at_the_token_that_completes_one(tokenizer):
    from mixtral_infer import load_model

    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    prompt = tokenizer.encode("And God said")
    plain, _ = generate_ours([prompt], model, max_tokens=30, eos_id=None)
    text = tokenizer.decode(plain[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # some text the answer holds
    stopped, _ = generate_ours([prompt], model, max_tokens=30, stop=[stop], tokenizer=tokenizer)
    assert stop in tokenizer.decode(stopped[0]) and stop not in tokenizer.decode(stopped[0][:-1])
    assert stopped[0] == plain[0][: len(stopped[0])]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json_schema={"type": "object"}), "json_schema is about text: pass tokenizer= as well"),
        (dict(regex="a", choices=["a"], tokenizer="given"), "give one of regex, choices"),
        (dict(presence_penalty=3), "presence_penalty=3 must be a number in [-2, 2]"),
        (dict(min_tokens=50), "min_tokens=50 must be an integer in [0, max_tokens=5]"),
        (dict(logit_bias={99999: 1.0}), "logit_bias {99999: 1.0}: keys must be token ids"),
        (dict(regex="(", tokenizer="given"), "the regex cannot be compiled"),
    ],
)
def test_generate_s_bad_settings_are_one_line_before_any_work(tokenizer, kwargs, message):
    from mixtral_infer import load_model

    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    if kwargs.get("tokenizer") == "given":
        kwargs["tokenizer"] = tokenizer
    with pytest.raises(GenerationError) as error:
        generate_ours([[1, 5]], model, max_tokens=5, **kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_generate_takes_a_penalty_per_prompt(tokenizer, decode):
    """presence, frequency and repetition penalties as lists, one per prompt: each row as if alone."""
    from mixtral_infer import load_model

    model = load_model("tiny-mixtral", max_batch_size=2, dtype=torch.float32, device="cpu")
    prompts = [tokenizer.encode("In the beginning"), tokenizer.encode("And the LORD said")]
    settings = [dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0),
                dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.4)]  # fmt: skip
    together, _ = generate_ours(prompts, model, max_tokens=16, decode=decode, eos_id=None,
                                **{k: [s[k] for s in settings] for k in settings[0]})  # fmt: skip
    for prompt, setting, tokens in zip(prompts, settings, together):
        alone, _ = generate_ours([prompt], model, max_tokens=16, decode=decode, eos_id=None, **setting)
        assert tokens == alone[0]
    with pytest.raises(GenerationError, match=r"a list of one per prompt \(2\)"):
        generate_ours(prompts, model, max_tokens=4, presence_penalty=[0.5])


def test_penalised_rows_report_the_model_s_logprobs(tiny_engine_model, tokenizer):
    """float32 logits: the penalties change a copy; each token's logprob is the model's (as without them)."""
    from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent

    prompt = tokenizer.encode("And God said, Let there be light")
    engine = Engine(tiny_engine_model, tokenizer, rows=1, decode="eager")
    events = []
    engine.submit(prompt, RequestSettings(max_tokens=6, logprobs=0, repetition_penalty=1.5, ignore_eos=True), events.append)
    while engine.step():
        pass
    tokens = [e.token for e in events if isinstance(e, TokenEvent)]
    got = [e.logprob for e in events if isinstance(e, TokenEvent)]
    with torch.inference_mode():
        logits = tiny_engine_model(torch.tensor(prompt + tokens), [len(prompt) + len(tokens)])  # (T, V)
    scores = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert got == pytest.approx(scores.tolist(), abs=1e-4)
