"""Hugging Face folders of bitsandbytes' 4-bit NF4 weights (checkpoint/bnb_4bit.py): written here by
bitsandbytes' own quantize_4bit and read back as its own dequantize_4bit reads them; logits against
transformers holding those weights; the module docstring's worked example; what is refused."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from conftest import hf_model, ours_from_hf, tiny_args
from safetensors.torch import load_file, save_file

from mixtral_infer.kernels.linear import nf4 as nf4_linear
from mixtral_infer import load_model
from mixtral_infer.checkpoint import bnb_4bit
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.hf_format import (
    hf_config_from_args,
    hf_name_to_published,
    hf_rows_to_published,
    published_to_hf,
)
from mixtral_infer.checkpoint.loading import internal_to_published
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.model.parallel import Parallel
from mixtral_infer.quant.model import model_scheme
from mixtral_infer.quant.weights import QuantizedWeight

# A dependency; its import warns that the `kernels` package is missing (so nothing is fetched).
bnb_functional = pytest.importorskip("bitsandbytes.functional")

QUANTIZATION_CONFIG = {
    "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_skip_modules": ["lm_head"],
}  # fmt: skip


def quantized_by_bitsandbytes(name: str, tensor: torch.Tensor) -> bool:
    """What transformers hands to bitsandbytes: every nn.Linear (the router too) but the output matrix."""
    return tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name and name != "lm_head.weight"


def write_bnb_folder(folder, state, args, blocksize=64, nested=True):
    """Transformers-named float tensors ``state`` saved as transformers saves a model loaded with
    ``load_in_4bit``: each linear weight through bitsandbytes' ``quantize_4bit`` (from bfloat16, as
    the hub's checkpoints), the output matrix in bfloat16. Returns bitsandbytes' ``dequantize_4bit``
    of each quantized weight, by name."""
    folder.mkdir()
    tensors, dequantized = {}, {}
    for name, tensor in state.items():
        tensor = tensor.to(torch.bfloat16).contiguous()
        if not quantized_by_bitsandbytes(name, tensor):
            tensors[name] = tensor
            continue
        packed, quant_state = bnb_functional.quantize_4bit(
            tensor, blocksize=blocksize, quant_type="nf4", compress_statistics=nested
        )
        tensors[name] = packed
        tensors.update({f"{name}.{key}": value for key, value in quant_state.as_dict(packed=True).items()})
        dequantized[name] = bnb_functional.dequantize_4bit(packed, quant_state).float()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {**hf_config_from_args(args, torch.bfloat16), "quantization_config": QUANTIZATION_CONFIG}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def hub_state(moe: bool, seed: int):
    """A transformers model, and its weights in the layout of the hub's bitsandbytes checkpoints:
    a Mixtral's experts as per-expert linears (``block_sparse_moe.experts.{j}.w1``), which
    bitsandbytes quantizes (transformers 5 fuses them into 3-D parameters, which it would not)."""
    args = dataclasses.replace(tiny_args(moe=moe), hidden_dim=128)  # every width a multiple of the 64 of a block
    hf = hf_model(args, seed=seed)
    ours = ours_from_hf(hf, args)
    return hf, args, dict(published_to_hf(internal_to_published(ours.state_dict(), args), args))


def our_weight(model, published: str) -> torch.Tensor:
    """Our model's float32 weight under a published name (an expert: its part of the stacked weight)."""
    expert = re.match(r"^layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$", published)
    if expert:
        weight, index = getattr(model.layers[expert[1]].feed_forward, expert[3]), int(expert[2])
    else:
        weight, index = model.get_submodule(published[: -len(".weight")]).weight, None
    weight = weight.dequantize(torch.float32) if isinstance(weight, QuantizedWeight) else weight.detach().float()
    return weight if index is None else weight[index]


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "float-absmax"])
@pytest.mark.parametrize("blocksize", [32, 64])
@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_a_bitsandbytes_folder_reads_as_bitsandbytes_dequantizes_it(tmp_path, moe, blocksize, nested):
    """Each weight as bitsandbytes' own dequantize_4bit gives it, but for the scales' rounding to
    bfloat16 (2^-9 of a weight, relative) and bitsandbytes' rounding of its result to bfloat16:
    within 2^-7 relative; q and k rows permuted as float folders' are; the router and the output
    matrix as floats; the weights nf4 with bitsandbytes' block size as the group size."""
    _, args, state = hub_state(moe, seed=blocksize)
    dequantized = write_bnb_folder(tmp_path / "bnb", state, args, blocksize, nested)
    model = load_model(tmp_path / "bnb", dtype=torch.float32)
    assert model_scheme(model).label == f"nf4 (groups of {blocksize})"
    for name, expected in dequantized.items():
        published = hf_name_to_published(name)
        if published.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = args.n_heads if published.endswith("wq.weight") else args.n_kv_heads
            expected = hf_rows_to_published(expected, heads)
        got = our_weight(model, published)
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6, msg=name)
    assert model.output.weight.dtype == torch.float32  # stored in bfloat16, left unquantized


def test_logits_are_transformers_on_the_weights_bitsandbytes_reads(tmp_path):
    """Our float32 logits of a bitsandbytes Mistral folder against transformers' float32 model holding
    bitsandbytes' dequantized weights: apart by the scales' rounding only, a small fraction of what
    quantizing moved them."""
    hf, args, state = hub_state(False, seed=3)
    original = {name: tensor.to(torch.bfloat16).float() for name, tensor in hf.state_dict().items()}
    dequantized = write_bnb_folder(tmp_path / "bnb", state, args)
    ours = load_model(tmp_path / "bnb", dtype=torch.float32)
    ids = torch.randint(3, args.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf.load_state_dict(original)
        before = hf(ids[None]).logits[0]
        hf.load_state_dict({**original, **dequantized})
        theirs = hf(ids[None]).logits[0]
        ours_logits = ours(ids, [24])
    moved = (theirs - before).abs().max().item()
    assert moved > 0.05  # quantizing changed the logits this much
    assert (ours_logits - theirs).abs().max().item() <= 0.05 * moved


def test_the_module_docstring_worked_example():
    """OUT = 1, IN = 32, blocksize 32: bytes [242, 151, 119, ...], absmax [0.5] -> codes [15, 2, 9, 7,
    7, ...] (plain bytes [47, 121, 119, ...]) -> [0.5, -0.2625, 0.0805, 0.0, 0.0, ...]."""
    state = json.dumps({"quant_type": "nf4", "blocksize": 32, "dtype": "bfloat16", "shape": [1, 32]})
    codes = torch.tensor([242, 151] + [119] * 14, dtype=torch.uint8).view(16, 1)
    parts = {
        "": codes, "absmax": torch.tensor([0.5]), "quant_map": torch.tensor(bnb_4bit.nf4.NF4),
        bnb_4bit.STATE: torch.tensor(list(state.encode()), dtype=torch.uint8),
    }  # fmt: skip
    weight = bnb_4bit.decoded("w", parts, "example")
    assert weight.integers()[0, :5].tolist() == [15, 2, 9, 7, 7] and weight.values[0, :3].tolist() == [47, 121, 119]
    expected = torch.tensor([0.5, 0.5 * -0.5250730514526367, 0.5 * 0.16093020141124725] + [0.0] * 29)
    torch.testing.assert_close(weight.dequantize()[0], expected)


def test_a_bitsandbytes_folder_decodes_in_bfloat16_through_the_nf4_kernels(tmp_path):
    """Without a dtype the folder loads in bfloat16 (bitsandbytes' compute dtype here), its weights in
    the CPU kernel's layout where the kernel loads, and decoding eager and compiled agree."""
    from mixtral_infer import generate
    from test_model import random_prompts

    _, args, state = hub_state(True, seed=4)
    write_bnb_folder(tmp_path / "bnb", state, args, blocksize=32)
    model = load_model(tmp_path / "bnb", max_batch_size=2)
    assert model.dtype == torch.bfloat16
    wq = model.layers["0"].attention.wq.weight
    assert nf4_linear.nf4_layout(wq) == ("cpu" if bnb_4bit.nf4.kernel() is not None else None)
    prompts = random_prompts([5, 9], args.vocab_size, seed=1)
    eager = generate(prompts, model, max_tokens=6, decode="eager")[0]
    assert generate(prompts, model, max_tokens=6, decode="static")[0] == eager


def test_what_a_bitsandbytes_folder_cannot_be(tmp_path):
    _, args, state = hub_state(False, seed=5)
    write_bnb_folder(tmp_path / "bnb", state, args, blocksize=32)
    folder = tmp_path / "bnb"
    with pytest.raises(ConfigError, match="stored quantized by bitsandbytes .nf4. already; load without quantize="):
        load_model(folder, quantize="int8")
    with pytest.raises(ConfigError, match="loads in one process only"):
        load_model(folder, parallel=Parallel(tensor_parallel=2, rank=0))
    with pytest.raises(CheckpointError, match="bitsandbytes' 4-bit nf4, which load as they are; convert the float"):
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    config = json.loads((folder / "config.json").read_text())
    for change, message in [
        ({"bnb_4bit_quant_type": "fp4"}, "bitsandbytes 4-bit 'fp4' weights: only nf4 is read"),
        ({"load_in_4bit": False, "load_in_8bit": True}, "8-bit .LLM.int8. weights are not read"),
        ({"quant_method": "gptq"}, "weights quantized by 'gptq'"),
        ({"quant_method": None}, "quantization_config has no quant_method: say which"),  # was "quantized by None"
    ]:
        quantization = {**QUANTIZATION_CONFIG, **change}
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        with pytest.raises(ConfigError, match=message):
            load_model(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    broken = {key: value for key, value in tensors.items() if key != f"{name}.absmax"}
    save_file(broken, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name}: bitsandbytes' 4-bit weight is incomplete: {name}.absmax"):
        load_model(folder)
    state = json.loads(bytes(tensors[f"{name}.{bnb_4bit.STATE}"].tolist()))
    changes = [({"blocksize": 256}, "blocks of 256 values over 128 inputs"), ({"quant_type": "fp4"}, "only nf4")]
    for change, message in changes:
        bad = torch.tensor(list(json.dumps({**state, **change}).encode()), dtype=torch.uint8)
        save_file({**tensors, f"{name}.{bnb_4bit.STATE}": bad}, folder / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            load_model(folder)
