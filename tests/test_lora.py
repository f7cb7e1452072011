"""LoRA adapters merged while loading (checkpoint/lora.py): PEFT folders against transformers + peft's own
merge, mistral-inference's lora.safetensors against a merge by hand, and the one-line refusals."""

import json
import warnings

import pytest
import torch

from conftest import hf_model, random_model, tiny_args
from mixtral_infer.checkpoint import loading
from mixtral_infer.checkpoint.loading import internal_to_published, load_model, save_consolidated
from mixtral_infer.checkpoint.safetensors_writer import write_safetensors
from mixtral_infer.errors import CheckpointError, ConfigError

peft = pytest.importorskip("peft")

TOLERANCE = 1e-4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE = ["gate_proj", "up_proj", "down_proj"]


def logits(model, length: int = 12) -> torch.Tensor:
    ids = torch.randint(3, model.args.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids, [length]).float()


def hf_logits(hf, length: int = 12) -> torch.Tensor:
    ids = torch.randint(3, hf.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def peft_adapter(hf, folder, seed: int = 1, **config):
    """A random adapter made by peft (its B, zero as peft starts it, made random), saved; and the model
    with the adapter merged by peft."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(hf, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lm_head targeted: peft saves it whole too (save_embedding_layers)
        wrapped.save_pretrained(folder)
    return wrapped.merge_and_unload().eval()


@pytest.fixture
def dense_folders(tmp_path):
    hf = hf_model(tiny_args(moe=False), seed=1)
    hf.save_pretrained(tmp_path / "base")
    return tmp_path, hf


@pytest.mark.parametrize("extra", [{}, {"use_rslora": True, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 16}, "more": ["lm_head"]}],
                         ids=["plain", "rslora-patterns-lm-head"])  # fmt: skip
def test_a_peft_adapter_gives_peft_merged_logits(dense_folders, extra):
    tmp_path, hf = dense_folders
    base = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32))
    more = extra.pop("more", [])
    merged = peft_adapter(hf, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ATTENTION + DENSE + more, **extra)
    ours = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=tmp_path / "adapter"))
    assert (ours - hf_logits(merged)).abs().max().item() <= TOLERANCE
    assert (ours - base).abs().max().item() > 0.1  # the adapter changes the logits


def test_lora_scale_multiplies_the_adapters_own_scale(dense_folders):
    tmp_path, hf = dense_folders
    peft_adapter(hf, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ATTENTION)
    load = lambda folder, **kw: logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=folder, **kw))  # noqa: E731
    base = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32))
    assert torch.equal(load(tmp_path / "adapter", lora_scale=0.0), base)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["lora_alpha"] = 16  # twice the scale, as a config
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "adapter_config.json").write_text(json.dumps(config))
    (twice / "adapter_model.safetensors").write_bytes((tmp_path / "adapter" / "adapter_model.safetensors").read_bytes())
    assert (load(tmp_path / "adapter", lora_scale=2.0) - load(twice)).abs().max().item() <= TOLERANCE


def test_a_mixtral_adapter_on_attention_and_experts(tmp_path):
    """peft's adapter on the attention, plus the experts as transformers 4.x names them
    (block_sparse_moe.experts.N.w1/w2/w3, the hub's Mixtral adapters), merged by hand into
    transformers 5's fused experts for the reference."""
    from safetensors.torch import load_file, save_file

    args = tiny_args(moe=True)
    hf = hf_model(args, seed=2)
    hf.save_pretrained(tmp_path / "base")
    merged = peft_adapter(hf, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ATTENTION)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(5)
    d, i, scale = args.dim, args.hidden_dim, 8 / 4
    with torch.no_grad():
        for layer in range(args.n_layers):
            experts = merged.model.layers[layer].mlp.experts
            for j in (0, 3):
                for w, (out, inner) in (("w1", (i, d)), ("w2", (d, i)), ("w3", (i, d))):
                    a = torch.randn(4, inner, generator=generator) * 0.2
                    b = torch.randn(out, 4, generator=generator) * 0.2
                    prefix = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{j}.{w}"
                    tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
                    delta = scale * (b @ a)
                    if w == "w2":
                        experts.down_proj[j] += delta
                    else:
                        experts.gate_up_proj[j, slice(0, i) if w == "w1" else slice(i, 2 * i)] += delta
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["target_modules"] = ATTENTION + ["w1", "w2", "w3"]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    ours = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=tmp_path / "adapter"))
    assert (ours - hf_logits(merged)).abs().max().item() <= TOLERANCE


def mistral_lora(tmp_path, args, scaling=None):
    """A Mistral folder and a mistral-inference lora.safetensors over it (published names), and the
    expected merged model, merged by hand."""
    model = random_model(args, seed=3)
    save_consolidated(model, tmp_path / "base")
    state = dict(internal_to_published(model.state_dict(), args))
    generator = torch.Generator().manual_seed(4)
    lora, folder = {}, tmp_path / "lora"
    folder.mkdir()
    names = ["layers.0.attention.wq.weight", "layers.1.attention.wk.weight", "layers.1.attention.wo.weight"]
    names += ["layers.0.feed_forward.experts.1.w2.weight"] if args.moe else ["layers.0.feed_forward.w2.weight"]
    expected = dict(state)
    for name in names:
        out, inner = state[name].shape
        a, b = torch.randn(4, inner, generator=generator) * 0.2, torch.randn(out, 4, generator=generator) * 0.2
        module = name.removesuffix(".weight")
        lora[f"{module}.lora_A.weight"], lora[f"{module}.lora_B.weight"] = a, b
        expected[name] = state[name] + (2.0 if scaling is None else scaling) * (b @ a)
    write_safetensors(folder / "lora.safetensors", lora.items())
    if scaling is not None:
        (folder / "params.json").write_text(json.dumps({"dim": args.dim, "lora": {"rank": 4, "scaling": scaling}}))
    reference = tmp_path / "expected"
    reference.mkdir()
    write_safetensors(reference / "consolidated.safetensors", expected.items())
    (reference / "params.json").write_text((tmp_path / "base" / "params.json").read_text())
    return folder, reference


@pytest.mark.parametrize("scaling", [None, 0.5], ids=["default-2.0", "params-json"])
def test_a_mistral_inference_lora_file_merges_as_load_lora(tmp_path, scaling):
    folder, reference = mistral_lora(tmp_path, tiny_args(moe=True), scaling)
    expected = logits(load_model(reference, device="cpu", dtype=torch.float32))
    for path in (folder, folder / "lora.safetensors"):
        ours = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=path))
        assert (ours - expected).abs().max().item() <= TOLERANCE


def test_merged_then_quantized(tmp_path):
    folder, reference = mistral_lora(tmp_path, tiny_args(moe=False))
    """The update is added to the float weight, which is then quantized: the logits are those of the
    merged float model quantized alike, not of the base quantized."""
    merged = logits(load_model(reference, device="cpu", dtype=torch.float32, quantize="int8"))
    base = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, quantize="int8"))
    ours = logits(load_model(tmp_path / "base", device="cpu", dtype=torch.float32, quantize="int8", lora=folder))
    assert (ours - merged).abs().max().item() <= 1e-3
    assert (base - merged).abs().max().item() > 0.1


def test_convert_writes_the_merged_model_in_either_layout(tmp_path):
    from mixtral_infer.checkpoint.convert import convert

    folder, reference = mistral_lora(tmp_path, tiny_args(moe=True))
    expected = logits(load_model(reference, device="cpu", dtype=torch.float32))
    for to in ("mistral", "hf"):
        out = convert(tmp_path / "base", tmp_path / f"merged-{to}", to=to, lora=folder)
        assert (logits(load_model(out, device="cpu", dtype=torch.float32)) - expected).abs().max().item() <= TOLERANCE


# ---------------------------------------------------------------- bad input, before any weight is read


@pytest.fixture
def no_weights_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the adapter was checked")

    monkeypatch.setattr(loading, "build_model", refuse)


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_adapters_are_one_line_errors_naming_file_and_tensor(dense_folders, no_weights_read):
    from safetensors.torch import load_file, save_file

    tmp_path, hf = dense_folders
    base = tmp_path / "base"
    load = lambda path, **kw: load_model(base, device="cpu", dtype=torch.float32, lora=path, **kw)  # noqa: E731

    other = tmp_path / "other"  # an adapter for a model of another width
    wide = tiny_args(moe=False)
    wide.dim = 96
    peft_adapter(hf_model(wide, seed=1), other, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: tensors .*layers.0.self_attn.q_proj.lora_A.weight .* "
                                              r"do not fit the model's layers.0.attention.wq.weight \(64, 64\): an adapter for another base"):  # fmt: skip
        load(other)

    adapter = tmp_path / "adapter"
    peft_adapter(hf, adapter, r=4, lora_alpha=8, target_modules=ATTENTION)
    edit_config(adapter, r=8)
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: tensor .*_proj.lora_A.weight has rank 4 .* says r=8"):
        load(adapter)
    edit_config(adapter, r=4, target_modules=["c_attn", "c_proj"])
    with pytest.raises(ConfigError, match=r"adapter_config.json: target_modules \['c_attn', 'c_proj'\] name no module of this model"):
        load(adapter)
    edit_config(adapter, target_modules=ATTENTION, use_dora=True)
    with pytest.raises(ConfigError, match="adapter_config.json: use_dora=True: DoRA's magnitude vectors are not read here"):
        load(adapter)
    edit_config(adapter, use_dora=False)

    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({**tensors, "base_model.model.model.layers.0.mlp.router.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.mlp.router.lora_B.weight": torch.zeros(64, 4)},
              adapter / "adapter_model.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: unexpected tensor .*layers.0.mlp.router.lora_A.weight"):
        load(adapter)
    save_file({**tensors, "base_model.model.model.layers.0.self_attn.q_proj.magnitude": torch.zeros(4)},
              adapter / "adapter_model.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match=r"unexpected tensor base_model.model.model.layers.0.self_attn.q_proj.magnitude"):
        load(adapter)

    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: file not found"):
        load(adapter)
    with pytest.raises(CheckpointError, match=r"nowhere: LoRA adapter not found"):
        load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"base: not a LoRA adapter"):
        load(base)
    with pytest.raises(ConfigError, match=r"lora_scale='x' must be a finite number"):
        load(adapter, lora_scale="x")


def test_a_mistral_lora_of_another_rank_than_params_says(tmp_path, no_weights_read):
    folder, _ = mistral_lora(tmp_path, tiny_args(moe=False), scaling=1.0)
    (folder / "params.json").write_text(json.dumps({"lora": {"rank": 16, "scaling": 1.0}}))
    with pytest.raises(CheckpointError, match=r"lora.safetensors: tensor layers.0.attention.wq.lora_A.weight has rank 4 .* r=16"):
        load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=folder)


# ---------------------------------------------------------------- the front doors: command line, LLM


def shipped_lora(tmp_path, name: str = "tiny-mistral"):
    """A mistral-inference lora.safetensors over a shipped model (its attention and feed-forward)."""
    from mixtral_infer.checkpoint.loading import open_checkpoint

    args = open_checkpoint(name).args
    generator = torch.Generator().manual_seed(6)
    q, kv, d = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim
    lora = {}
    for layer in range(args.n_layers):
        for module, (out, inner) in (("attention.wq", (q, d)), ("attention.wv", (kv, d)), ("attention.wo", (d, q))):
            prefix = f"layers.{layer}.{module}"
            lora[f"{prefix}.lora_A.weight"] = torch.randn(4, inner, generator=generator) * 0.3
            lora[f"{prefix}.lora_B.weight"] = torch.randn(out, 4, generator=generator) * 0.3
    write_safetensors(tmp_path / "lora.safetensors", lora.items())
    return tmp_path / "lora.safetensors"


def test_perplexity_demo_and_convert_take_lora(tmp_path, capsys):
    from mixtral_infer.cli import commands
    from mixtral_infer.llm import LLM

    adapter = shipped_lora(tmp_path)
    text = "In the beginning God created the heaven and the earth. And the earth was without form, and void."
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    scores = {}
    for scale in (None, 1.0, 0.0):
        extra = {} if scale is None else {"lora": str(adapter), "lora_scale": scale}
        commands.perplexity("tiny-mistral", text=str(tmp_path / "text.txt"), dtype="float32", **extra)
        scores[scale] = capsys.readouterr().out
    assert scores[0.0] == scores[None] != scores[1.0]
    llm = LLM("tiny-mistral", dtype=torch.float32, lora=str(adapter))
    assert f"perplexity {llm.score(text).perplexity:.4f}" in scores[1.0]

    commands.demo("tiny-mistral", prompt=["In the beginning"], max_tokens=4, dtype="float32", lora=str(adapter))
    assert f"with LoRA {adapter} merged" in capsys.readouterr().err
    commands.convert("tiny-mistral", str(tmp_path / "merged"), to="mistral", dtype="float32", lora=str(adapter))
    commands.perplexity(str(tmp_path / "merged"), text=str(tmp_path / "text.txt"), dtype="float32")
    assert capsys.readouterr().out == scores[1.0]


def test_bad_lora_options_are_said_before_loading(tmp_path):
    from mixtral_infer.cli import commands
    from mixtral_infer.cli.commands import UsageError

    with pytest.raises(CheckpointError, match=r"nowhere: LoRA adapter not found"):
        commands.demo("tiny-mistral", lora=str(tmp_path / "nowhere"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"notes.txt: not a LoRA adapter"):
        commands.convert("tiny-mistral", str(tmp_path / "out"), lora=str(tmp_path / "notes.txt"))
    with pytest.raises(ConfigError, match=r"^--lora-scale 'big' must be a finite number"):
        commands.perplexity("tiny-mistral", text=str(tmp_path / "notes.txt"), lora=str(shipped_lora(tmp_path)), lora_scale="big")
    with pytest.raises(UsageError, match=r"--lora-scale 2.0 scales an adapter: give it with --lora PATH"):
        commands.interactive("tiny-mistral", lora_scale=2.0)
    dense = tmp_path / "dense" / "lora.safetensors"  # the dense model's feed-forward: tiny-mixtral has experts there
    dense.parent.mkdir()
    write_safetensors(dense, [("layers.0.feed_forward.w2.lora_A.weight", torch.zeros(4, 384)),
                              ("layers.0.feed_forward.w2.lora_B.weight", torch.zeros(128, 4))])  # fmt: skip
    with pytest.raises(CheckpointError, match=r"lora.safetensors: unexpected tensor layers.0.feed_forward.w2.lora_A.weight"):
        commands.serve("tiny-mixtral", lora=str(dense))  # before the engine starts
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, message", [
    ({"r": "4"}, r"adapter_config.json: r='4' must be a positive number"),
    ({"lora_alpha": -1}, r"adapter_config.json: lora_alpha=-1 must be a positive number"),
    ({"rank_pattern": ["q_proj"]}, r"adapter_config.json: rank_pattern=\['q_proj'\] must be an object"),
    ({"alpha_pattern": {"q_proj": "big"}}, r"adapter_config.json: alpha_pattern\['q_proj'\]='big' must be a positive number"),
    ({"rank_pattern": {"q_proj(": 4}}, r"adapter_config.json: rank_pattern\['q_proj\('\]: 'q_proj\(' is not a regular expression"),
    ({"target_modules": "model.*proj["}, r"adapter_config.json: target_modules: .* is not a regular expression"),
    ({"target_modules": 3}, r"adapter_config.json: target_modules=3 must be a list"),
    ({"peft_type": "IA3"}, r"adapter_config.json: peft_type='IA3': only LoRA adapters are read"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, r"target_parameters=.* are not read here"),
], ids=lambda value: str(value)[:30])  # fmt: skip
def test_hostile_adapter_configs_are_one_line(dense_folders, no_weights_read, changes, message):
    tmp_path, hf = dense_folders
    peft_adapter(hf, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ATTENTION)
    edit_config(tmp_path / "adapter", **changes)
    with pytest.raises((ConfigError, CheckpointError), match=message) as error:
        load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=tmp_path / "adapter")
    assert "\n" not in str(error.value)


def test_hostile_adapter_files_are_one_line(dense_folders):
    tmp_path, hf = dense_folders
    adapter = tmp_path / "adapter"
    peft_adapter(hf, adapter, r=4, lora_alpha=8, target_modules=ATTENTION)
    load = lambda: load_model(tmp_path / "base", device="cpu", dtype=torch.float32, lora=adapter)  # noqa: E731
    (adapter / "adapter_config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match=r"adapter_config.json") as error:
        load()
    assert "\n" not in str(error.value)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, adapter / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=rf"adapter_model.safetensors: tensor {name} holds torch.float32 values that are not finite"):
        load()
    (adapter / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1")
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors") as error:
        load()
    assert "\n" not in str(error.value)


def test_a_ranks_share_gets_the_same_share_of_the_update(tmp_path):
    """With parallelism the loader keeps part of a weight (``select``); the update is cut alike."""
    from mixtral_infer.checkpoint.loading import open_checkpoint
    from mixtral_infer.checkpoint.lora import merged, open_adapter
    from mixtral_infer.checkpoint.safetensors_reader import iter_tensors
    from mixtral_infer.checkpoint.shares import Selection

    folder, reference = mistral_lora(tmp_path, tiny_args(moe=False))
    checkpoint = open_checkpoint(tmp_path / "base")
    cuts = {"layers.0.attention.wq.weight": Selection(rows=slice(16, 48)), "layers.1.attention.wo.weight": Selection(columns=slice(0, 32))}
    select = lambda name: cuts.get(name, Selection())  # noqa: E731
    adapter = open_adapter(folder, checkpoint.args)
    ours = dict(merged(checkpoint.published_tensors(None, select), adapter, torch.float32, select))
    expected = dict(iter_tensors(reference / "consolidated.safetensors"))
    torch.testing.assert_close(ours["layers.0.attention.wq.weight"], expected["layers.0.attention.wq.weight"][16:48])
    torch.testing.assert_close(ours["layers.1.attention.wo.weight"], expected["layers.1.attention.wo.weight"][:, :32])
    torch.testing.assert_close(ours["layers.1.attention.wk.weight"], expected["layers.1.attention.wk.weight"])
