"""Model folders built to break the loader: bad index entries, wrong types in config.json, tensors that
do not fit the layout translation, odd .pth keys, absurd sizes. Each gets one error line naming the culprit."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer import CheckpointError, ConfigError, load_model
from mixtral_infer.checkpoint.hf_format import hf_config_from_args, hf_to_published, published_to_hf
from mixtral_infer.checkpoint.loading import internal_to_published, save_consolidated
from mixtral_infer.checkpoint.safetensors_reader import iter_tensors
from mixtral_infer.checkpoint.safetensors_writer import write_safetensors
from mixtral_infer.checkpoint.weight_shapes import published_shape


def load(folder):
    return load_model(folder, device="cpu", dtype=torch.float32)


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.fixture()
def hf_folder(tmp_path):
    """A Hugging Face folder (per-expert layout) split in two shards with an index."""
    args = tiny_args(moe=True)
    tensors = dict(published_to_hf(internal_to_published(random_model(args, seed=2).state_dict(), args), args))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    folder = tmp_path / "hf"
    folder.mkdir()
    for shard, members in shards.items():
        write_safetensors(folder / shard, [(n, tensors[n]) for n in members])
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_config_from_args(args, torch.float32)))
    return folder


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_hf_fixture_loads(hf_folder):
    assert load(hf_folder).args.moe.num_experts == 4


# ------------------------------------------------------------------ the index


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"])
def test_index_cannot_point_outside_the_folder(hf_folder, shard):
    outside = hf_folder.parent / "outside.safetensors"
    (hf_folder / "model-00001-of-00002.safetensors").rename(outside)
    index = hf_folder / "model.safetensors.index.json"
    weight_map = {n: (shard if s.startswith("model-00001") else s) for n, s in json.loads(index.read_text())["weight_map"].items()}
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="points outside the model folder") as error:
        load(hf_folder)
    assert repr(shard) in one_line(error)


@pytest.mark.parametrize("value, message", [(5, "5 must name a .safetensors file"), (None, "None must name"), ("w.bin", "'w.bin' must name")])
def test_index_entries_must_be_safetensors_file_names(hf_folder, value, message):
    index = hf_folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map["model.norm.weight"] = value
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=message):
        load(hf_folder)


def test_a_symlinked_shard_inside_the_folder_is_followed(hf_folder, tmp_path):
    """As in the hub's cache: the shard's name is in the folder, its bytes elsewhere."""
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    shard = hf_folder / "model-00002-of-00002.safetensors"
    shard.rename(blob)
    shard.symlink_to(os.path.relpath(blob, hf_folder))
    assert load(hf_folder).args.dim == 64


# ------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(architectures=5), ConfigError, "architectures=5 must be a list of names"),
        (dict(architectures=[5]), ConfigError, r"architectures=\[5\] must be a list of names"),
        (dict(num_attention_heads=0), ConfigError, "num_attention_heads=0 must be a positive integer"),
        (dict(num_attention_heads="4"), ConfigError, "num_attention_heads='4' must be an int"),
        (dict(hidden_size=64.0), ConfigError, "hidden_size=64.0 must be an int"),
        (dict(num_hidden_layers=True), ConfigError, "num_hidden_layers=True must be an int"),
        (dict(rope_parameters="x"), ConfigError, "rope_parameters='x' must be a dict"),
        (dict(rope_theta="big"), ConfigError, "rope_theta='big' must be a positive number"),
        (dict(rms_norm_eps=[1]), ConfigError, r"rms_norm_eps=\[1\] must be an int or float"),
        (dict(num_local_experts="4"), ConfigError, "num_local_experts='4' must be an int"),
        (dict(sliding_window="8"), ConfigError, "sliding_window='8' must be a positive integer or null"),
        (dict(num_hidden_layers=10**12), ConfigError, "n_layers=1000000000000 is more than 4096"),
        # torch's sizes past 2**63 were an OverflowError or a many-line TypeError
        (dict(intermediate_size=10**30), ConfigError, f"hidden_dim={10**30} is more than 2\\*\\*31 - 1"),
        (dict(num_local_experts=10**30), ConfigError, f"moe.num_experts={10**30} is more than 2\\*\\*31 - 1"),
        # computed otherwise by transformers, and silently ignored here
        (dict(rope_scaling={"type": "linear", "factor": 4.0}), ConfigError, "RoPE scaling rope_type='linear' is not computed"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ConfigError, "rope_type='yarn' is not computed here"),
        (dict(hidden_act="gelu"), ConfigError, "hidden_act='gelu': only silu"),
    ],
)
def test_wrong_types_in_config_json_name_the_field(hf_folder, changes, error, message):
    edit_json(hf_folder / "config.json", **changes)
    with pytest.raises(error, match=message) as raised:
        load(hf_folder)
    assert one_line(raised).startswith(str(hf_folder / "config.json"))


@pytest.mark.parametrize("architecture, theta", [("MistralForCausalLM", 10000.0), ("MixtralForCausalLM", 1e6)])
def test_a_config_without_rope_theta_takes_transformers_default_for_its_class(hf_folder, architecture, theta):
    """Without rope_theta (and without a window, for Mistral) transformers' class default is the
    value its model computes with; params.json's rule (by the window) gave the other one."""
    config = json.loads((hf_folder / "config.json").read_text())
    config.pop("rope_theta", None)
    config.get("rope_parameters", {}).pop("rope_theta", None)
    config.update(architectures=[architecture], model_type=architecture[:7].lower(), sliding_window=None)
    (hf_folder / "config.json").write_text(json.dumps(config))
    assert load(hf_folder).args.rope_theta == theta


@pytest.mark.parametrize("text, message", [("[" * 100000 + "]" * 100000, "nested too deeply"),
                                           ('{"a": ' + "9" * 5000 + "}", "Exceeds the limit")])  # fmt: skip
def test_json_nested_too_deeply_or_with_a_huge_number_is_one_line(hf_folder, text, message):
    (hf_folder / "config.json").write_text(text)  # were a RecursionError and a ValueError traceback
    with pytest.raises(ConfigError, match=f"config.json: not valid JSON \\(.*{message}"):
        load(hf_folder)


def test_huge_n_layers_in_params_json_fails_fast(tmp_path):
    args = tiny_args(moe=False)
    save_consolidated(random_model(args), tmp_path)
    edit_json(tmp_path / "params.json", n_layers=10**12)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"params.json: n_layers=1000000000000 is more than 4096"):
        load(tmp_path)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("field, value", [("norm_eps", float("inf")), ("rope_theta", float("nan"))])
def test_non_finite_numbers_in_params_json(tmp_path, field, value):
    save_consolidated(random_model(tiny_args(moe=False)), tmp_path)
    edit_json(tmp_path / "params.json", **{field: value})
    with pytest.raises(ConfigError, match=f"{field}=(inf|nan) must be a positive number"):
        load(tmp_path)


# ------------------------------------------------------------------ layout translation


def rewrite_hf(folder, transform):
    for shard in sorted(folder.glob("model-*.safetensors")):
        tensors = dict(iter_tensors(shard))
        write_safetensors(shard, transform(tensors).items())


def test_older_transformers_rotary_buffers_are_skipped_and_checked(hf_folder):
    """Checkpoints saved by older transformers hold each layer's ``rotary_emb.inv_freq`` (head_dim/2
    values), which transformers ignores on load; they were refused as unexpected tensors."""
    ids = torch.tensor([1, 5, 9, 3])
    expected = load(hf_folder)(ids, seqlens=[4])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)  # head_dim 16
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq for i in range(2)}
    rewrite_hf(hf_folder, lambda tensors: {**tensors, **buffers} if "model.norm.weight" in tensors else tensors)
    index = hf_folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shard = weight_map["model.norm.weight"]
    index.write_text(json.dumps({"weight_map": {**weight_map, **dict.fromkeys(buffers, shard)}}))
    assert torch.equal(load(hf_folder)(ids, seqlens=[4]), expected)
    rewrite_hf(hf_folder, lambda tensors: {**tensors, **dict.fromkeys(buffers, torch.ones(5))} if "model.norm.weight" in tensors else tensors)
    with pytest.raises(CheckpointError, match=r"rotary_emb.inv_freq has shape \(5,\), the model config implies \(8,\)"):
        load(hf_folder)


@pytest.mark.parametrize(
    "name, tensor, message",
    [
        # Right byte count, wrong shape: (64, 64) would be (32, 128).
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 128),
         r"tensor model.layers.0.self_attn.q_proj.weight has shape \(32, 128\), the model config implies \(64, 64\)"),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(32 * 64),
         r"k_proj.weight has shape \(2048,\), the model config implies \(32, 64\)"),
        # Named like a module, not a tensor.
        ("model.layers.0.self_attn", torch.zeros(3), r"unexpected tensor model.layers.0.self_attn$"),
        ("model.layers.0.block_sparse_moe.experts.0", torch.zeros(3), r"unexpected tensor model.layers.0.block_sparse_moe.experts.0$"),
        ("model.layers.9.input_layernorm.weight", torch.zeros(64), "unexpected tensor model.layers.9.input_layernorm.weight"),
        ("model.layers.0.block_sparse_moe.experts.7.w1.weight", torch.zeros(96, 64), "unexpected tensor model.layers.0.block_sparse_moe.experts.7"),
    ],
)
def test_hf_tensors_that_do_not_fit_the_layout_are_refused_from_the_header(hf_folder, name, tensor, message):
    rewrite_hf(hf_folder, lambda t: {**t, name: tensor} if name in t else t)
    first = next(hf_folder.glob("model-00001*"))
    if name not in dict(iter_tensors(first)) and name not in dict(iter_tensors(next(hf_folder.glob("model-00002*")))):
        write_safetensors(first, [*iter_tensors(first), (name, tensor)])
    with pytest.raises(CheckpointError, match=message) as error:
        load(hf_folder)
    assert one_line(error).startswith(str(hf_folder))


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("model.layers.0.mlp.experts.gate_up_proj", (4 * 192 * 64,), r"gate_up_proj has shape \(49152,\), the model config implies \(4, 192, 64\)"),
        ("model.layers.0.mlp.experts.down_proj", (4, 96, 64), r"down_proj has shape \(4, 96, 64\), the model config implies \(4, 64, 96\)"),
        ("model.layers.0.self_attn.q_proj.weight", (32, 128), r"q_proj.weight has shape \(32, 128\)"),
        ("model.layers.0.self_attn", (3,), "unexpected tensor model.layers.0.self_attn"),
    ],
)
def test_hf_to_published_checks_shapes_before_translating(name, shape, message):
    """The translation itself (also used on in-memory state dicts) refuses what it cannot translate."""
    with pytest.raises(CheckpointError, match=message):
        list(hf_to_published([(name, torch.zeros(shape))], tiny_args(moe=True)))


def test_fused_expert_layout_of_the_right_shape_translates():
    args = tiny_args(moe=True)
    gate_up = torch.arange(4 * 192 * 64, dtype=torch.float32).reshape(4, 192, 64)
    out = dict(hf_to_published([("model.layers.1.mlp.experts.gate_up_proj", gate_up)], args))
    assert torch.equal(out["layers.1.feed_forward.experts.3.w3.weight"], gate_up[3, 96:])
    assert published_shape("layers.1.feed_forward.experts.3.w3.weight", args) == (96, 64)


def test_pth_with_non_string_keys(tmp_path):
    args = tiny_args(moe=False)
    save_consolidated(random_model(args), tmp_path)
    tensors = dict(iter_tensors(tmp_path / "consolidated.safetensors"))
    (tmp_path / "consolidated.safetensors").unlink()
    torch.save({**tensors, 7: torch.zeros(2)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="tensor name 7 is a int, expected a string"):
        load(tmp_path)


def test_pth_tensor_of_wrong_shape_is_refused_before_the_model_gets_it(tmp_path):
    args = tiny_args(moe=False)
    save_consolidated(random_model(args), tmp_path)
    tensors = dict(iter_tensors(tmp_path / "consolidated.safetensors"))
    (tmp_path / "consolidated.safetensors").unlink()
    torch.save({**tensors, "layers.1.attention.wq.weight": torch.zeros(32, 128)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth: tensor layers.1.attention.wq.weight has shape \(32, 128\)"):
        load(tmp_path)


@pytest.mark.parametrize(
    "device, message",
    [
        ("meta", r"device='meta': a model runs on cpu, cuda or mps, not meta \(it holds no data\)"),
        ("tpu9", "device='tpu9' is not a torch device"),
        (5.5, "device=5.5 is not a torch device"),
        ("cuda:99", r"device='cuda:99': (CUDA is not available on this machine|this machine has \d+ CUDA device\(s\))"),
        (99, r"device=99: (an index names a CUDA or MPS device, and none is available|this machine has \d+ CUDA device)"),
    ],
)
def test_a_device_that_cannot_hold_weights_is_named_not_blamed_on_the_checkpoint(hf_folder, device, message):
    with pytest.raises(ConfigError, match=message):
        load_model(hf_folder, device=device)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, "fp16", 16])
def test_a_dtype_a_model_cannot_compute_in_is_refused(hf_folder, dtype):
    """torch.int8 loaded: every weight rounded to an integer; a name reached torch's Tensor.to."""
    message = f"dtype={dtype!r} is not a floating dtype a model computes in: use one of float32"
    with pytest.raises(ConfigError, match=message):
        load_model(hf_folder, dtype=dtype)


def test_a_model_folder_must_be_a_path_or_a_name():
    with pytest.raises(CheckpointError, match="folder=None: give a model folder's path or a shipped model's name"):
        load_model(None)


def test_a_dtype_may_be_named(hf_folder):
    assert load_model(hf_folder, dtype="bfloat16").dtype == torch.bfloat16
