"""Hugging Face shards as transformers writes them: size limit, index, one shard in memory, nothing half-written."""

from __future__ import annotations

import gc
import json
import os
import weakref

import pytest
import torch
from conftest import random_model, tiny_args
from test_checkpoint import TOLERANCE, max_difference

from mixtral_infer import load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.checkpoint.safetensors_reader import iter_tensors
from mixtral_infer.checkpoint.safetensors_writer import parse_size, plan_shards, write_hf_shards, write_safetensors
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

    write_hf_shards(tmp_path, stream(), max_shard_size=800, plan=tensors_of([400] * 10))  # 2 tensors per shard
    assert max(held) <= 1, held  # the shard being filled: a complete one is written before the next tensor is asked for
    assert len(list(tmp_path.glob("model-*-of-00005.safetensors"))) == 5


def test_each_shard_has_its_final_name_as_soon_as_it_is_written(tmp_path):
    """With the sizes known up front, shard 1 is written and in place before the first tensor of shard 2 is asked for."""
    present = []

    def stream():
        for i in range(6):
            present.append(sorted(p.name for p in tmp_path.iterdir()))
            yield f"t{i}", torch.full((100,), float(i))

    write_hf_shards(tmp_path, stream(), max_shard_size=800, plan=tensors_of([400] * 6))
    shard = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert present == [[], [], shard[:1], shard[:1], shard[:2], shard[:2]]  # (t0 t1 | t2 t3 | t4 t5)


def test_plan_shards_docstring_example():
    assert plan_shards([400, 400, 600, 1200, 100], limit=1000) == [1, 1, 2, 3, 4]
    assert plan_shards([0, 1000, 1], limit=1000) == [1, 1, 2]  # an empty tensor fills nothing
    assert plan_shards([], limit=1000) == []


@pytest.mark.parametrize(
    "plan, message",
    [
        (tensors_of([400, 400, 100]), r"tensor t2 torch.float32 \(100,\) differs from the plan: t2 torch.float32 \(25,\)"),
        ([("t0", torch.ones(100)), ("x", torch.ones(100)), ("t2", torch.ones(100))], "tensor t1 .* differs from the plan: x"),
        (tensors_of([400, 400]), "tensor t2 comes after the 2 planned"),
        (tensors_of([400] * 4), "3 tensors written, 4 planned"),
    ],
    ids=["shape", "name", "more", "fewer"],
)
@pytest.mark.parametrize("writer", ["hf", "mistral"])
def test_a_stream_that_differs_from_its_plan_is_refused_and_leaves_nothing(tmp_path, plan, message, writer):
    tensors = iter(tensors_of([400] * 3))
    with pytest.raises(ValueError, match=message):
        if writer == "hf":
            write_hf_shards(tmp_path, tensors, max_shard_size=400, plan=plan)
        else:
            write_safetensors(tmp_path / "consolidated.safetensors", tensors, plan=plan)
    assert list(tmp_path.iterdir()) == []


def test_one_file_is_written_in_one_pass_from_its_plan(tmp_path):
    """The header comes from the plan, so tensors go straight behind it: no side file, nothing copied afterwards."""
    path = tmp_path / "consolidated.safetensors"
    seen = []

    def stream():
        for name, tensor in tensors_of([400, 800, 4]):
            seen.append(sorted(p.name for p in tmp_path.iterdir()))
            yield name, tensor

    write_safetensors(path, stream(), plan=[(n, t.to("meta")) for n, t in tensors_of([400, 800, 4])])
    assert seen == [["consolidated.safetensors.partial"]] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["consolidated.safetensors"]
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert path.stat().st_size == header_end + 1204
    assert [(n, t.tolist()) for n, t in iter_tensors(path)] == [(n, t.tolist()) for n, t in tensors_of([400, 800, 4])]


@pytest.mark.parametrize("target", ["hf", "mistral"])
def test_convert_plans_from_the_headers_what_it_writes(tmp_path, target):
    """planned_tensors reads no tensor and gives the names, dtypes and shapes convert writes, in order."""
    from mixtral_infer.checkpoint.convert import planned_tensors
    from mixtral_infer.checkpoint.hf_format import published_to_hf
    from mixtral_infer.checkpoint.loading import open_checkpoint

    model = random_model(tiny_args(moe=True), seed=3)
    save_consolidated(model, tmp_path / "mistral")
    convert(tmp_path / "mistral", tmp_path / "hf", to="hf", max_shard_size="40KB")
    for source in ("mistral", "hf"):
        checkpoint = open_checkpoint(tmp_path / source)
        written = list(checkpoint.published_tensors())
        if target == "hf":
            written = list(published_to_hf(written, checkpoint.args))
        for dtype in (None, torch.bfloat16):
            plan = planned_tensors(checkpoint, target, dtype)
            assert all(like.is_meta for _, like in plan)
            assert [(n, like.dtype, like.shape) for n, like in plan] == [(n, dtype or t.dtype, t.shape) for n, t in written]


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


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_shards_are_written_with_the_permissions_of_the_other_files(tmp_path, umask):
    """safetensors' writer makes its files 0600; a converted folder's shards follow the umask as
    config.json does, so other users of a shared machine can read the weights where the umask allows."""
    model = random_model(tiny_args(moe=False), seed=3)
    save_consolidated(model, tmp_path / "mistral")
    previous = os.umask(umask)
    try:
        convert(tmp_path / "mistral", tmp_path / "hf", to="hf", max_shard_size="40KB")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert set(modes.values()) == {0o666 & ~umask}, modes
