"""Hugging Face shards as transformers writes them: size limit, index, one shard in memory, nothing half-written."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from conftest import random_model, tiny_args
from test_checkpoint import TOLERANCE, max_difference

from mixtral_infer import load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.checkpoint.safetensors_writer import parse_size, write_hf_shards
from mixtral_infer.errors import ConfigError


def test_parse_size_docstring_example():
    assert (parse_size("5GB"), parse_size("100KB"), parse_size("2MiB"), parse_size(1234)) == (5 * 10**9, 10**5, 2 * 2**20, 1234)
    for bad in ("0", "-5GB", "five", ""):
        with pytest.raises(ConfigError, match="max_shard_size"):
            parse_size(bad)


def tensors_of(sizes):
    """Float32 tensors named t0, t1, ... of the given byte sizes."""
    return [(f"t{i}", torch.full((size // 4,), float(i))) for i, size in enumerate(sizes)]


def test_shards_close_before_the_limit_and_the_index_lists_every_tensor(tmp_path):
    # limit 1000 bytes: [400, 400] | [600] | [1200, alone: larger than the limit] | [100]
    files = write_hf_shards(tmp_path, tensors_of([400, 400, 600, 1200, 100]), max_shard_size=1000)
    assert [f.name for f in files] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 2700}
    assert index["weight_map"] == {
        "t0": files[0].name, "t1": files[0].name, "t2": files[1].name, "t3": files[2].name, "t4": files[3].name,
    }
    from safetensors.torch import load_file

    for i, (name, tensor) in enumerate(tensors_of([400, 400, 600, 1200, 100])):
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], tensor)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f.name for f in files] + ["model.safetensors.index.json"])


def test_a_model_that_fits_one_shard_is_model_safetensors(tmp_path):
    files = write_hf_shards(tmp_path, tensors_of([400, 400]), max_shard_size="5GB")
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_only_one_shard_is_held_in_memory(tmp_path):
    """When the writer asks for a tensor of shard 3, no tensor of shard 1 is alive any more."""
    alive = []
    held = []  # per request: how many earlier tensors are still alive

    def stream():
        for i in range(10):
            name, tensor = f"t{i}", torch.full((100,), float(i))  # made here, so only the writer holds it
            gc.collect()
            held.append(sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    write_hf_shards(tmp_path, stream(), max_shard_size=800)  # 2 tensors per shard
    assert max(held) <= 2, held  # the shard being filled (and the one just closed, until it is released)
    assert len(list(tmp_path.glob("model-*-of-00005.safetensors"))) == 5


def test_a_failing_shard_leaves_no_partial_files(tmp_path, monkeypatch):
    import safetensors.torch

    calls = []
    real_save = safetensors.torch.save_file

    def fail_on_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            open(path, "wb").write(b"half")  # a shard interrupted while being written
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        write_hf_shards(tmp_path, tensors_of([400] * 4), max_shard_size=800)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_converted_shards_load_in_transformers_and_here(tmp_path, moe):
    import transformers

    args = tiny_args(moe=moe)
    model = random_model(args, seed=11)
    save_consolidated(model, tmp_path / "mistral")
    convert(tmp_path / "mistral", tmp_path / "hf", to="hf", max_shard_size="40KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 3
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    for shard in shards:  # a shard over the limit holds a single tensor
        from safetensors import safe_open

        with safe_open(shard, "pt") as opened:
            assert shard.stat().st_size <= 40_000 + 1000 or len(opened.keys()) == 1
    assert not list((tmp_path / "hf").glob(".*"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert max_difference(model, hf) <= TOLERANCE
    ours = load_model(tmp_path / "hf", device="cpu", dtype=torch.float32)
    for (name, expected), got in zip(model.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(expected, got), name


def test_command_line_refuses_a_bad_shard_size_before_writing(tmp_path, model_folder, capsys):
    from mixtral_infer.cli.commands import main

    assert main(["convert", str(model_folder), str(tmp_path / "hf"), "--to", "hf", "--max_shard_size", "five"]) == 1
    assert capsys.readouterr().err.strip() == "error: max_shard_size='five': expected a positive size such as 5GB, 500MB or a number of bytes"
    assert not (tmp_path / "hf").exists()
    assert main(["convert", str(model_folder), str(tmp_path / "hf"), "--to", "hf", "--max_shard_size", "100KB"]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 3
