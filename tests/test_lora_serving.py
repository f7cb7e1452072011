"""LoRA adapters kept apart and served at once (formats/adapters.py, serve --lora NAME=PATH): each row of a
batch reads its own adapter, and gets the tokens and log-probabilities the model with that adapter merged
gets alone; prefix reuse never hands one adapter's keys to another's request."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.checkpoint.lora import attach_served, parse_named_adapters
from mixtral_infer.checkpoint.safetensors_writer import write_safetensors
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.formats.adapters import lora_update, selected
from mixtral_infer.tuning import Tuning
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4
TEXTS = ["In the beginning God created the heaven and the earth.", "And it came to pass", "The quick brown fox jumps"]


def test_the_worked_example_both_ways():
    """formats/adapters.py's docstring: three tokens, none, adapter 1 and adapter 2; gathered (3 > 2
    adapters is the masked way's shape: both are forced by the number of adapters given)."""
    a = torch.tensor([[[0.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])  # (3, 1, 2): slot 0 zeros
    b = torch.tensor([[[0.0, 0.0]], [[0.0, 2.0]], [[1.0, 0.0]]])  # (3, 1, 2)
    x = torch.tensor([[3.0, 4.0]] * 3)
    ids = torch.tensor([0, 1, 2])
    expected = torch.tensor([[0.0, 0.0], [0.0, 6.0], [4.0, 0.0]])
    assert torch.equal(lora_update(x, ids, a, b), expected)  # 3 tokens > 2 adapters: every adapter, masked
    assert torch.equal(lora_update(x[1:], ids[1:], a, b), expected[1:])  # 2 tokens: gathered by token


@pytest.mark.parametrize("tokens", [3, 40])
def test_both_ways_equal_a_loop_over_tokens(tokens):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4, 16, generator=generator)
    b = torch.randn(6, 4, 24, generator=generator)
    a[0] = b[0] = 0
    x = torch.randn(tokens, 16, generator=generator)
    ids = torch.randint(0, 6, (tokens,), generator=generator)
    naive = torch.stack([x[t] @ a[ids[t]].T @ b[ids[t]] for t in range(tokens)])
    torch.testing.assert_close(lora_update(x, ids, a, b), naive, rtol=1e-5, atol=1e-5)


def write_adapter(folder, seed: int, rank: int, targets, scaling: float):
    """A mistral-inference lora.safetensors of random factors over ``targets`` of tiny-mistral's 4 layers."""
    args = load_model("tiny-mistral", dtype=torch.float32, device="cpu").args
    shapes = {"wq": (args.n_heads * args.head_dim, args.dim), "wk": (args.n_kv_heads * args.head_dim, args.dim),
              "wv": (args.n_kv_heads * args.head_dim, args.dim), "wo": (args.dim, args.n_heads * args.head_dim),
              "w1": (args.hidden_dim, args.dim), "w3": (args.hidden_dim, args.dim), "w2": (args.dim, args.hidden_dim)}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.n_layers):
        for target in targets:
            out, inner = shapes[target]
            module = f"layers.{layer}.{'attention' if target.startswith('w') and target[1] in 'qkvo' else 'feed_forward'}.{target}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, inner, generator=generator) * 0.12
            tensors[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.12
    folder.mkdir()
    write_safetensors(folder / "lora.safetensors", tensors.items())
    (folder / "params.json").write_text(json.dumps({"lora": {"rank": rank, "scaling": scaling}}))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [
        ("sql", write_adapter(root / "sql", 1, 4, ["wq", "wk", "wv", "wo"], 2.0)),
        ("chat", write_adapter(root / "chat", 2, 8, ["wq", "wv", "w1", "w2", "w3"], 1.0)),
        ("code", write_adapter(root / "code", 3, 2, ["wo", "w2"], 4.0)),
    ]


@pytest.fixture(scope="module")
def served(adapters):
    model = load_model("tiny-mistral", dtype=torch.float32, device="cpu")
    assert attach_served(model, adapters) == ["sql", "chat", "code"]
    merged = [load_model("tiny-mistral", dtype=torch.float32, device="cpu")]  # 0: the base model
    merged += [load_model("tiny-mistral", dtype=torch.float32, device="cpu", lora=path) for _, path in adapters]
    return model, merged, Tokenizer.from_folder("tiny-mistral")


def alone(model, tokenizer, prompt, max_tokens):
    tokens, logprobs = generate([prompt], model, max_tokens=max_tokens, eos_id=tokenizer.eos_id, prompt_logprobs=False)
    return tokens[0], logprobs[0]


def serve(engine, requests):
    events = {}
    for key, (prompt, settings) in enumerate(requests):
        engine.submit(prompt, settings, lambda event, key=key: events.setdefault(key, []).append(event))
    while engine.step():
        pass
    got = []
    for key in range(len(requests)):
        tokens = [e for e in events[key] if isinstance(e, TokenEvent)]
        got.append(([e.token for e in tokens], [e.logprob for e in tokens]))
    return got


@pytest.mark.parametrize("decode", ["eager", "static", "auto"])
def test_each_row_gets_its_adapter_merged_alone(served, decode):
    """Seven requests over four rows, adapters 0 to 3 mixed in each step, past the window (32): every
    request's tokens are those of its adapter merged and run alone, log-probabilities within 1e-4."""
    model, merged, tokenizer = served
    engine = Engine(model, tokenizer, 4, decode=decode, prefill_tokens=24)
    engine.warm_up()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    requests = [(prompts[i % 3], RequestSettings(max_tokens=40, logprobs=0, adapter=adapter))
                for i, adapter in enumerate([1, 0, 2, 3, 2, 1, 0])]  # fmt: skip
    got = serve(engine, requests)
    for (prompt, settings), (tokens, logprobs) in zip(requests, got):
        want_tokens, want_logprobs = alone(merged[settings.adapter], tokenizer, prompt, 40)
        assert tokens == want_tokens
        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs)) <= TOLERANCE
    assert len({tuple(tokens) for tokens, _ in got[:4]}) == 4  # the adapters do change the text


def test_adapters_differ_and_none_is_the_base(served):
    model, merged, _ = served
    ids = torch.arange(3, 30)
    with torch.no_grad():
        base = model(ids, [len(ids)])  # nothing selected: the base model
        torch.testing.assert_close(base, merged[0](ids, [len(ids)]), rtol=0, atol=TOLERANCE)
        for i in (1, 2, 3):
            assert (merged[i](ids, [len(ids)]) - base).abs().max() > 0.1


def test_prefix_reuse_never_crosses_adapters(served):
    """The same prompt after a request of another adapter is read whole; after one of its own, reused."""
    model, merged, tokenizer = served
    engine = Engine(model, tokenizer, 2, decode="eager")
    prompt = tokenizer.encode(TEXTS[0] + " " + TEXTS[2])
    first = serve(engine, [(prompt, RequestSettings(max_tokens=5, adapter=1))])[0][0]
    other = serve(engine, [(prompt, RequestSettings(max_tokens=5, adapter=2))])[0][0]
    assert engine.prefix_hits == 0
    assert other == alone(merged[2], tokenizer, prompt, 5)[0] and first == alone(merged[1], tokenizer, prompt, 5)[0]
    again = serve(engine, [(prompt, RequestSettings(max_tokens=5, adapter=1))])[0][0]
    assert engine.prefix_hits == 1 and again == first


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_speculation_with_adapters(served, decode):
    """Prompt lookup checked by each row's own adapter (Transformer.forward, or the fixed-shape verify
    step): the tokens of its adapter alone."""
    model, merged, tokenizer = served
    engine = Engine(model, tokenizer, 3, decode=decode, draft="ngram")
    engine.policy.wanted = lambda rows: True
    prompt = tokenizer.encode(TEXTS[0] * 3)
    requests = [(prompt, RequestSettings(max_tokens=20, adapter=a)) for a in (0, 1, 2)]
    got = serve(engine, requests)
    for (p, settings), (tokens, _) in zip(requests, got):
        assert tokens == alone(merged[settings.adapter], tokenizer, p, 20)[0]
    assert engine.stats()["guesses"] > 0


def test_refusals(served, adapters, tmp_path):
    model, _, tokenizer = served
    engine = Engine(model, tokenizer, 1, decode="eager")
    with pytest.raises(Exception, match="adapter=4: this engine's model has 3 adapters"):
        engine.submit([1, 2], RequestSettings(max_tokens=2, adapter=4), lambda event: None)
    with pytest.raises(ConfigError, match="give NAME=PATH"):
        parse_named_adapters("sql")
    with pytest.raises(ConfigError, match="given twice"):
        parse_named_adapters("a=/x,a=/y")
    assert parse_named_adapters("sql=/a, chat=/b") == [("sql", "/a"), ("chat", "/b")]
    mixtral = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    args = mixtral.args
    expert = tmp_path / "expert"
    expert.mkdir()
    write_safetensors(expert / "lora.safetensors", {"layers.0.feed_forward.experts.0.w1.lora_A.weight": torch.zeros(2, args.dim),
                      "layers.0.feed_forward.experts.0.w1.lora_B.weight": torch.zeros(args.hidden_dim, 2)}.items())  # fmt: skip
    with pytest.raises(CheckpointError, match="adapters served apart update attention's and a dense feed-forward's"):
        attach_served(mixtral, [("expert", expert)])
    with pytest.raises(ValueError, match="already has adapters"):
        attach_served(model, adapters[:1])


def test_serve_lora_name_path_end_to_end(served, adapters):
    """``main.py serve --lora sql=PATH,chat=PATH``: /v1/models lists both beside the model; a request
    naming one gets its adapter's text, one naming another model a 404 that lists the served names."""
    model, merged, tokenizer = served
    spec = ",".join(f"{name}={path}" for name, path in adapters[:2])
    command = [sys.executable, "main.py", "serve", "tiny-mistral", "--port", "0", "--max-rows", "2", "--decode", "static", "--lora", spec]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.startswith("serving "):
                break
        log = "".join(lines)
        found = re.search(r"http://127\.0\.0\.1:(\d+)", log)
        assert found and "kept apart: LoRA adapters sql, chat" in log, log

        def call(method, path, body=None):
            connection = http.client.HTTPConnection("127.0.0.1", int(found.group(1)), timeout=60)
            connection.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, listed = call("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == ["tiny-mistral", "sql", "chat"]
        assert listed["data"][1]["parent"] == "tiny-mistral"
        prompt = tokenizer.encode(TEXTS[1])
        for index, name in ((0, "tiny-mistral"), (1, "sql"), (2, "chat")):
            status, body = call("POST", "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert status == 200 and body["model"] == name
            assert body["choices"][0]["text"].lstrip() == tokenizer.decode(alone(merged[index], tokenizer, prompt, 8)[0])  # a completion keeps its first space
        status, body = call("POST", "/v1/completions", {"model": "code", "prompt": prompt, "max_tokens": 2})
        assert status == 404 and "tiny-mistral, sql, chat" in body["error"]["message"]
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("upcast", [(), (torch.bfloat16,)])
def test_factors_widened_where_the_cpu_multiplies_float32_faster(adapters, upcast):
    """A bfloat16 model keeps its adapters' factors in bfloat16, or in float32 where its tuning says this
    CPU multiplies bfloat16 more slowly (Tuning.upcast); either way a projection's output is the
    float32 product of the same numbers, rounded to bfloat16."""
    model = load_model("tiny-mistral", dtype=torch.bfloat16, device="cpu", tuning=Tuning(upcast=upcast))
    attach_served(model, adapters)
    module = model.get_submodule("layers.0.attention.wq")
    assert module.a.dtype == module.b.dtype == (torch.float32 if upcast else torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, module.a.shape[-1], generator=generator).to(torch.bfloat16)
    ids = torch.tensor([0, 1, 2, 3, 1, 0])
    with torch.no_grad(), selected(model, ids):
        got = module(x).float()
    base = x.float() @ module.weight.float().T
    a, b = module.a.float(), module.b.float()
    want = base + torch.stack([x[t].float() @ a[ids[t]].T @ b[ids[t]] for t in range(6)])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, base.bfloat16().float())  # adapters 1 and 3 do change wq's output
