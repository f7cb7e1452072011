"""GGUF files (checkpoint/gguf_file.py, tokenizer/gguf_vocab.py): small files written with llama.cpp's own
``gguf`` writer from tiny random transformers models, q/k permuted as llama.cpp's converter does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from command_line import in_process

gguf = pytest.importorskip("gguf")

from conftest import hf_model, tiny_args  # noqa: E402
from mixtral_infer.checkpoint.loading import load_model, open_checkpoint  # noqa: E402
from mixtral_infer.errors import CheckpointError, ConfigError  # noqa: E402
from mixtral_infer.tokenizer import Tokenizer  # noqa: E402

SHIPPED_TOKENIZER = Path(__file__).parents[1] / "mixtral_infer" / "shipped" / "tiny-mixtral" / "tokenizer.model"
SENTENCES = ["Hello world", "  two  spaces and\ttabs\n", "Mixtral 8x7B: 46.7B parameters, 12.9B active.", "héllo ☃ 日本語"]
Q = gguf.GGMLQuantizationType


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """``permute`` of llama.cpp's convert_hf_to_gguf.py (LlamaModel), on a transformers q/k weight."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_tensors(hf, args, one_tensor_per_expert=False):
    """transformers' state dict under llama.cpp's names, as its converter writes them."""
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}  # fmt: skip
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        for theirs, ours in layer_names.items():
            if p + theirs + ".weight" in state:
                out[f"blk.{i}.{ours}.weight"] = state[p + theirs + ".weight"]
        out[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_q.weight"], args.n_heads)
        out[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_k.weight"], args.n_kv_heads)
        if args.moe is not None:
            experts = [k for k in state if k.startswith(p) and "experts" in k]
            if any(k.endswith("gate_up_proj") for k in experts):  # transformers 5: fused
                gate_up, hidden = state[p + "mlp.experts.gate_up_proj"], args.hidden_dim
                out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :hidden]
                out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, hidden:]
                out[f"blk.{i}.ffn_down_exps.weight"] = state[p + "mlp.experts.down_proj"]
                out[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "mlp.gate.weight"]
            else:
                e = range(args.moe.num_experts)
                for w, part in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
                    out[f"blk.{i}.{part}.weight"] = np.stack([state[f"{p}block_sparse_moe.experts.{j}.{w}.weight"] for j in e])
                out[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "block_sparse_moe.gate.weight"]
            if one_tensor_per_expert:  # llama.cpp's files of Mixtral converted before April 2024
                for part in ("ffn_gate", "ffn_up", "ffn_down"):
                    for j, expert in enumerate(out.pop(f"blk.{i}.{part}_exps.weight")):
                        out[f"blk.{i}.{part}.{j}.weight"] = expert
    return out


def write_gguf(path: Path, hf, args, kind=Q.F32, arch: str = "llama", one_tensor_per_expert=False, drop=(),
               tokenizer_model: str = "llama", skip_key: str = "") -> Path:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(SHIPPED_TOKENIZER))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(args.n_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    if skip_key != "norm_eps":
        writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_vocab_size(args.vocab_size)
    if args.moe is not None:
        writer.add_expert_count(args.moe.num_experts)
        writer.add_expert_used_count(args.moe.num_experts_per_tok)
    writer.add_tokenizer_model(tokenizer_model)
    n = sp.vocab_size()
    types = [2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 6 if sp.IsByte(i) else 1 for i in range(n)]
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    for name, value in gguf_tensors(hf, args, one_tensor_per_expert).items():
        if name in drop:
            continue
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 1 or kind == Q.F32:  # llama.cpp keeps norms in F32
            writer.add_tensor(name, value)
        elif kind == Q.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_args(moe: bool):
    return dataclasses.replace(tiny_args(moe=moe, sliding_window=None), vocab_size=2000, rope_theta=10000.0)


@pytest.fixture(scope="module", params=["mistral", "mixtral"])
def pair(request):
    args = gguf_args(request.param == "mixtral")
    return hf_model(args), args


TOKENS = torch.tensor([[1, 415, 1001, 33, 1999, 7, 250, 3]])


def hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(TOKENS).logits[0].float()


def our_logits(path: Path, **kwargs) -> torch.Tensor:
    model = load_model(path, device="cpu", dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model.forward(TOKENS[0], seqlens=[TOKENS.shape[1]]).float()


def rounded(hf, kind):
    """A copy of ``hf`` whose matrices went through ``kind``'s blocks (quantized, then dequantized by gguf):
    the model a ``kind`` file holds, to compare with in float tolerance."""
    import copy

    out = copy.deepcopy(hf)
    with torch.no_grad():
        for param in out.parameters():
            if param.dim() >= 2:
                data = param.detach().float().numpy()
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind).reshape(data.shape)))
    return out


@pytest.mark.parametrize("kind, tolerance", [(Q.F32, 1e-4), (Q.F16, 2e-2), (Q.BF16, 1e-4), (Q.Q8_0, 1e-4), (Q.Q4_0, 1e-4), (Q.Q5_1, 1e-4)])
def test_logits_equal_the_source_model(tmp_path, pair, kind, tolerance, capsys):
    hf, args = pair
    path = write_gguf(tmp_path / "model.gguf", hf, args, kind)
    checkpoint = open_checkpoint(path)
    assert checkpoint.format == "gguf" and checkpoint.args.vocab_size == 2000
    assert (checkpoint.args.moe is None) == (args.moe is None) and checkpoint.args.sliding_window is None
    source = hf if kind in (Q.F32, Q.F16) else rounded(hf, kind)
    ours, theirs = our_logits(path), hf_logits(source)
    assert (ours - theirs).abs().max().item() < tolerance
    if kind not in (Q.F32, Q.F16, Q.BF16):
        assert f"dequantizing {kind.name} weights" in capsys.readouterr().err
    else:
        assert "dequantizing" not in capsys.readouterr().err
    if kind == Q.Q8_0:
        quantized = our_logits(path, quantize="int8")  # quantize-while-loading, on the dequantized weights
        assert (quantized - theirs).abs().max().item() < 0.5


def test_logits_equal_transformers_gguf_loader(tmp_path, pair):
    hf, args = pair
    if args.moe is not None:  # checked against the source model in test_logits_equal_the_source_model
        pytest.skip("transformers reads a 'llama' GGUF as LlamaForCausalLM, without Mixtral's experts")
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.F32)
    transformers = pytest.importorskip("transformers")
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, torch_dtype=torch.float32)
    except Exception as error:  # pragma: no cover - transformers' loader and these tiny configs
        pytest.skip(f"transformers cannot load this GGUF: {type(error).__name__}: {str(error)[:100]}")
    assert (our_logits(path) - hf_logits(loaded)).abs().max().item() < 1e-4


def test_tokenizer_round_trip(tmp_path, pair):
    hf, args = pair
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.F32)
    ours, shipped = Tokenizer.from_folder(path), Tokenizer(SHIPPED_TOKENIZER)
    assert ours.n_words == shipped.n_words and (ours.bos_id, ours.eos_id) == (shipped.bos_id, shipped.eos_id)
    for text in SENTENCES:
        ids = shipped.encode(text, bos=True)
        assert ours.encode(text, bos=True) == ids
        assert ours.decode(ids) == shipped.decode(ids)


def test_convert_writes_mistral_and_hf_folders(tmp_path, pair):
    from mixtral_infer.checkpoint.convert import convert

    hf, args = pair
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.F16)
    expected = our_logits(path)
    for target in ("mistral", "hf"):
        out = convert(path, tmp_path / target, to=target)
        assert (our_logits(out) - expected).abs().max().item() < 1e-5
        assert Tokenizer.from_folder(out).encode(SENTENCES[2]) == Tokenizer(SHIPPED_TOKENIZER).encode(SENTENCES[2])


def test_other_architecture_refused(tmp_path):
    args = gguf_args(False)
    path = write_gguf(tmp_path / "phi.gguf", hf_model(args), args, arch="phi3")
    with pytest.raises(CheckpointError, match=r"phi\.gguf: architecture 'phi3', only 'llama'"):
        open_checkpoint(path)


def test_truncated_file_refused(tmp_path):
    args = gguf_args(False)
    path = write_gguf(tmp_path / "model.gguf", hf_model(args), args)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.gguf: truncated: tensor blk\.1\.ffn_down\.weight ends at byte \d+, the file has") as error:
        load_model(path, device="cpu")
    assert "\n" not in str(error.value)
    path.write_bytes(data[:1000])  # in the metadata
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a readable GGUF file, or truncated"):
        load_model(path, device="cpu")


def test_unknown_type_refused(tmp_path):
    args = gguf_args(False)
    path = write_gguf(tmp_path / "model.gguf", hf_model(args), args, Q.F16)
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    type_offset = tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:-2])  # the type, then the offset
    data = bytearray(path.read_bytes())
    data[type_offset:type_offset + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.gguf: tensor blk\.0\.attn_k\.weight has unknown type 99 \(not a GGML type"):
        open_checkpoint(path)


def test_missing_tensor_and_shape_refused(tmp_path):
    args = gguf_args(False)
    hf = hf_model(args)
    path = write_gguf(tmp_path / "model.gguf", hf, dataclasses.replace(args, hidden_dim=128), Q.F32)
    with pytest.raises(CheckpointError, match=r"model\.gguf: tensor blk\.0\.ffn_gate\.weight has shape \(96, 64\)"):
        open_checkpoint(path)


def test_llm_and_command_line_take_a_gguf_file(tmp_path, pair):
    from mixtral_infer.llm import LLM

    hf, args = pair
    if args.moe is not None:
        pytest.skip("one model is enough for the front doors")
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.Q8_0)
    llm = LLM(str(path), dtype=torch.float32, device="cpu")
    out = llm.generate("Hello world", max_tokens=4, temperature=0)[0]
    assert len(out.token_ids) == 4
    result = in_process("demo", path, "--prompt", "Hello world", "--max-tokens", "4", "--quantize", "int8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dequantizing Q8_0 weights" in result.stderr


def test_one_tensor_per_expert(tmp_path):
    """Mixtral files converted before llama.cpp stacked the experts: blk.N.ffn_gate.J.weight, ..."""
    args = gguf_args(True)
    hf = hf_model(args)
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.F16, one_tensor_per_expert=True)
    assert "blk.0.ffn_gate.3.weight" in [t.name for t in gguf.GGUFReader(path).tensors]
    assert (our_logits(path) - hf_logits(hf)).abs().max().item() < 2e-2
    write_gguf(tmp_path / "missing.gguf", hf, args, Q.F16, one_tensor_per_expert=True, drop=("blk.1.ffn_up.2.weight",))
    with pytest.raises(CheckpointError, match=r"missing\.gguf: missing tensor\(s\) \['blk\.1\.ffn_up\.2\.weight'\]"):
        open_checkpoint(tmp_path / "missing.gguf")


def test_other_hostile_files(tmp_path):
    args = gguf_args(False)
    hf = hf_model(args)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf: not a readable GGUF file"):
        load_model(junk, device="cpu")
    path = write_gguf(tmp_path / "noeps.gguf", hf, args, skip_key="norm_eps")
    with pytest.raises(ConfigError, match=r"noeps\.gguf: metadata llama\.attention\.layer_norm_rms_epsilon missing"):
        load_model(path, device="cpu")
    path = write_gguf(tmp_path / "bpe.gguf", hf, args, tokenizer_model="gpt2")
    with pytest.raises(CheckpointError, match=r"bpe\.gguf: tokenizer\.ggml\.model='gpt2'; only sentencepiece"):
        load_model(path, device="cpu")


# ---------------------------------------------------------------- Q4_0 blocks kept as int4


def int4_weights(model):
    """{module name: QuantizedParameter} of a loaded model."""
    from mixtral_infer.quant.weights import QuantizedParameter

    return {name: module for name, module in model.named_modules() if isinstance(module, QuantizedParameter)}


def test_q4_0_blocks_are_int4_bit_for_bit():
    """The docstring's block, then random blocks (negative scales among them, as llama.cpp writes them):
    the int4 weight dequantizes to gguf's own dequantization, bit for bit in float32."""
    from mixtral_infer.checkpoint.gguf_file import Q4_0_SCHEME, q4_0_as_int4
    from mixtral_infer.quant.weights import QuantizedWeight

    block = np.zeros((1, 1, 18), dtype=np.uint8)
    block[0, 0, :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    block[0, 0, 2:] = 0x88  # every weight n = 8: zero
    block[0, 0, 2], block[0, 0, 3] = 0x9F, 0x08
    values, scales = q4_0_as_int4(block)
    assert block[0, 0, :2].tolist() == [0x00, 0x38] and values[0, 0].item() == 0x8F and values[0, 8].item() & 15 == 9
    weight = QuantizedWeight(Q4_0_SCHEME, values, scales, 32).dequantize()
    assert weight[0, :3].tolist() == [3.5, 0.0, 0.0] and weight[0, 16].item() == 0.5

    rng = np.random.default_rng(0)
    for shape in ((3, 64), (5, 96), (2, 4, 160)):  # a stacked (E, OUT, IN) too
        data = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0], size=shape[:-1] + (1,))).astype(np.float32)
        data[..., 0, :32] = 0.0  # an all-zero block: d = 0
        raw = gguf.quants.quantize(data, Q.Q4_0)  # (..., OUT, IN/32 * 18)
        blocks = raw.reshape(*raw.shape[:-1], -1, 18)
        values, scales = q4_0_as_int4(blocks)
        assert values.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 32)
        assert bool((scales < 0).any())
        theirs = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0).astype(np.float32))
        ours = QuantizedWeight(Q4_0_SCHEME, values, scales, shape[-1]).dequantize(torch.float32)
        assert torch.equal(ours, theirs)


def test_large_tensors_convert_in_pieces_side_by_side_as_in_one(monkeypatch):
    """Tensors of several 1 MB pieces, converted two pieces at a time (gguf_file.by_row_pieces): Q4_0
    blocks give gguf's own dequantization bit for bit, and other types dequantize as gguf does in one call."""
    from types import SimpleNamespace

    from mixtral_infer.checkpoint.gguf_file import Q4_0_SCHEME, _to_torch, by_row_pieces, q4_0_as_int4
    from mixtral_infer.quant.weights import QuantizedWeight

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    pieces = by_row_pieces(lambda start, stop: stop - start, 2500, 1000)  # 1048 rows a piece, in order
    assert list(pieces) == [(0, 1048, 1048), (1048, 2096, 1048), (2096, 2500, 404)]
    with pytest.raises(ZeroDivisionError):  # a piece's error reaches the caller
        list(by_row_pieces(lambda start, stop: 1 // start, 2500, 1000))

    rng = np.random.default_rng(1)
    data = rng.standard_normal((2, 1100, 1024)).astype(np.float32)  # (E, OUT, IN): 2200 rows of 576 bytes, 2 MB
    raw = gguf.quants.quantize(data, Q.Q4_0)
    values, scales = q4_0_as_int4(raw.reshape(*raw.shape[:-1], -1, 18))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0).astype(np.float32))
    assert torch.equal(QuantizedWeight(Q4_0_SCHEME, values, scales, 1024).dequantize(torch.float32), theirs)

    raw = gguf.quants.quantize(data[1], Q.Q5_1)  # (OUT, IN/32 * 24): a type gguf writes and dequantizes
    tensor = SimpleNamespace(data=raw, tensor_type=Q.Q5_1, shape=[1024, 1100], name="w")  # ggml's order: IN first
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q5_1))
    assert torch.equal(_to_torch(tensor, "file.gguf"), expected)
    assert torch.equal(_to_torch(tensor, "file.gguf", torch.bfloat16), expected.bfloat16())  # rounded a piece at a time


def float_model_of(path: Path, dtype=torch.float32):
    """The model of a GGUF file with every weight dequantized by gguf (the path of the other types), for
    comparison with the one that keeps the Q4_0 blocks."""
    from mixtral_infer.checkpoint.loading import build_model
    from mixtral_infer.formats.modules import use_formats
    from mixtral_infer.tuning import Tuning

    checkpoint = open_checkpoint(path)
    model = build_model(checkpoint.args, checkpoint.gguf.published_tensors(), path.parent, "cpu", dtype)
    return use_formats(model, Tuning(fast=False))


def test_q4_0_file_keeps_its_blocks(tmp_path, pair, capsys):
    from mixtral_infer.quant.weights import QuantizedWeight

    hf, args = pair
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.Q4_0)
    model = load_model(path, device="cpu", dtype=torch.float32, fast=False)
    err = capsys.readouterr().err
    assert f"{path}: keeping Q4_0 matrices in their blocks as int4 (groups of 32); dequantizing Q4_0 weights to float32" in err
    weights = int4_weights(model)
    matrices = 7 * args.n_layers + 1  # wq wk wv wo w1 w2 w3 per layer, the output
    assert len(weights) == matrices and all((w.scheme.name, w.scheme.group_size) == ("int4", 32) for w in weights.values())
    reader = gguf.GGUFReader(path)  # each weight equals gguf's dequantization of the file's tensor, bit for bit
    stored = {t.name: t for t in reader.tensors}
    pairs = {"layers.0.attention.wq.weight": "blk.0.attn_q.weight", "output.weight": "output.weight"}
    pairs["layers.1.feed_forward.w2" + ("" if args.moe else ".weight")] = "blk.1.ffn_down" + ("_exps" if args.moe else "") + ".weight"
    for ours, theirs in pairs.items():
        tensor = stored[theirs]
        expected = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert torch.equal(QuantizedWeight.dequantize(weights[ours]), torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))
    with torch.no_grad():
        kept = model.forward(TOKENS[0], seqlens=[TOKENS.shape[1]])
        dequantized = float_model_of(path).forward(TOKENS[0], seqlens=[TOKENS.shape[1]])
    assert (kept - dequantized).abs().max().item() < 1e-5

    # bfloat16: the int4 kernels against the reference on the same weights (scales rounded to bfloat16)
    fast, reference = (load_model(path, device="cpu", dtype=torch.bfloat16, fast=fast) for fast in (True, False))
    with torch.no_grad():
        logits, expected = (m.forward(TOKENS[0], seqlens=[TOKENS.shape[1]]).float() for m in (fast, reference))
    # logits near 2 in bfloat16 differ by a few steps of 1/64 between any two orders of summing
    assert (logits - expected).abs().max().item() < 0.1 and (logits - dequantized).abs().max().item() < 0.2
    assert len(int4_weights(fast)) == matrices


def test_q4_0_file_with_quantize(tmp_path, capsys):
    """int4 (groups of 32) keeps the blocks, the same weights; another scheme quantizes the dequantized weights."""
    args = gguf_args(False)
    path = write_gguf(tmp_path / "model.gguf", hf_model(args), args, Q.Q4_0)
    plain = load_model(path, device="cpu", fast=False)
    assert plain.tok_embeddings.weight.dtype == torch.bfloat16  # a file of int4 weights computes as quantized ones do
    capsys.readouterr()
    asked = load_model(path, device="cpu", fast=False, quantize="int4")
    assert "keeping Q4_0 matrices in their blocks" in capsys.readouterr().err
    for name, weight in int4_weights(asked).items():
        assert torch.equal(weight.values, int4_weights(plain)[name].values) and torch.equal(weight.scales, int4_weights(plain)[name].scales)
    int8 = load_model(path, device="cpu", dtype=torch.float32, fast=False, quantize="int8")
    assert f"{path}: dequantizing Q4_0 weights to float32, then quantizing the matrices to int8\n" in capsys.readouterr().err
    assert {w.scheme.name for w in int4_weights(int8).values()} == {"int8"}
    with torch.no_grad():
        logits = int8.forward(TOKENS[0], seqlens=[TOKENS.shape[1]])
        expected = float_model_of(path).forward(TOKENS[0], seqlens=[TOKENS.shape[1]])
    assert (logits - expected).abs().max().item() < 0.5


def test_q4_0_tied_output_and_shares(tmp_path):
    """A file without output.weight: the output is the Q4_0 embeddings, kept as int4 (the embeddings
    themselves dequantized). A rank's share keeps whole blocks; one that cuts a block is refused."""
    from mixtral_infer.checkpoint.gguf_file import GgufLoading, Q4_0_SCHEME
    from mixtral_infer.checkpoint.shares import Selection
    from mixtral_infer.tuning import Tuning

    args = gguf_args(False)
    path = write_gguf(tmp_path / "tied.gguf", hf_model(args), args, Q.Q4_0, drop=("output.weight",))
    model = load_model(path, device="cpu", dtype=torch.float32, fast=False)
    output = int4_weights(model)["output.weight"]
    assert torch.equal(output.dequantize(), model.tok_embeddings.weight)
    file = open_checkpoint(path).gguf
    loading = GgufLoading(torch.float32, torch.device("cpu"), Tuning(fast=False))
    whole = dict(file.published_tensors(loading=loading))["layers.0.feed_forward.w2.weight"]  # (64, 96)
    w2_share = lambda name: Selection(slice(16, 48), slice(32, 96)) if name.endswith("w2.weight") else Selection()  # noqa: E731
    share = dict(file.published_tensors(select=w2_share, loading=loading))
    part = share["layers.0.feed_forward.w2.weight"]
    assert part.scheme == Q4_0_SCHEME and torch.equal(part.dequantize(), whole.dequantize()[16:48, 32:96])
    with pytest.raises(ConfigError, match=r"tied\.gguf: layers\.0\.attention\.wq\.weight: this rank's inputs 16:64 cut Q4_0's blocks of 32"):
        cut = lambda name: Selection(None, slice(16, 64)) if name.endswith("wq.weight") else Selection()  # noqa: E731
        dict(file.published_tensors(select=cut, loading=loading))


def test_a_file_is_parsed_once_while_held_over_plain_slices_and_again_once_written_again(tmp_path, pair, monkeypatch):
    """As the command line does: the checkpoint opened, then the tokenizer and the model read, parse the
    file once (gguf_reader); its arrays are plain ndarrays over the mapped file; once nobody holds the
    reader, its mapping goes. The same path written again with other weights is parsed again."""
    import gc

    from mixtral_infer import gguf_reader

    hf, args = pair
    parses = []
    original = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **k: (parses.append(a[0]), original(self, *a, **k))[1])
    path = write_gguf(tmp_path / "model.gguf", hf, args, Q.F32)
    checkpoint = open_checkpoint(path)
    Tokenizer.from_folder(path)
    model = load_model(path, device="cpu", dtype=torch.float32)
    assert len(parses) == 1
    reader = gguf_reader.open_reader(path)
    assert len(parses) == 1 and type(reader.data) is np.ndarray and type(reader.tensors[0].data) is np.ndarray
    assert np.shares_memory(reader.data, reader.tensors[0].data)  # a view of the file, not a copy
    assert reader.get_field("tokenizer.ggml.tokens").contents()[:3] == ["<unk>", "<s>", "</s>"]
    del checkpoint, reader
    gc.collect()
    assert len(gguf_reader._OPEN) == 0  # nothing holds the file mapped

    path.unlink()  # a new file at the same path (a new inode, another size)
    write_gguf(path, hf, args, Q.F16)
    again = load_model(path, device="cpu", dtype=torch.float32)
    assert len(parses) == 2
    assert not torch.equal(again.output.weight, model.output.weight)  # float16's weights, read from the new file
    torch.testing.assert_close(again.output.weight, model.output.weight, atol=1e-3, rtol=0)


def test_a_weight_past_float16_s_range_is_named_so_and_not_a_damaged_file(tmp_path, pair):
    """A Q8_0 weight of 1e5 loaded in float16: the range error of check_finite (dequantized tensors stay
    float32 until the model rounds them), not "the checkpoint is damaged"."""
    import copy

    hf, args = pair
    big = copy.deepcopy(hf)
    with torch.no_grad():
        next(p for n, p in big.named_parameters() if "down_proj" in n or "w2" in n).view(-1)[0] = 1e5
    path = write_gguf(tmp_path / "big.gguf", big, args, Q.Q8_0)
    with pytest.raises(CheckpointError, match=r"beyond torch\.float16's range"):
        load_model(path, device="cpu", dtype=torch.float16)
