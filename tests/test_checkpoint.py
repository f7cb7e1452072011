"""Model folders in both layouts load and give transformers' logits; conversion round-trips exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import hf_model, random_model, tiny_args

from mixtral_infer import Transformer, load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.hf_format import hf_config_from_args, published_to_hf
from mixtral_infer.checkpoint.loading import internal_to_published, save_consolidated
from mixtral_infer.checkpoint.safetensors_writer import write_safetensors

TOLERANCE = 1e-4


def max_difference(ours: Transformer, hf, length: int = 40) -> float:
    ids = torch.randint(3, ours.args.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(ids, [length]) - hf(ids[None]).logits[0]).abs().max().item()


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_sharded_hf_folder_saved_by_transformers_loads_and_matches(tmp_path, moe):
    hf = hf_model(tiny_args(moe=moe), seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert max_difference(ours, hf) <= TOLERANCE


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_a_folder_with_tied_word_embeddings_loads_as_transformers_reads_it(tmp_path, moe):
    """tie_word_embeddings: true and no lm_head.weight (transformers saves none): the output matrix is
    the embedding matrix, and the logits are transformers'."""
    import transformers

    from conftest import hf_config

    config, model_class = hf_config(tiny_args(moe=moe))
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    hf = model_class(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        assert "lm_head.weight" not in stored.keys()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert torch.equal(ours.output.weight, ours.tok_embeddings.weight)
    assert max_difference(ours, hf) <= TOLERANCE


def test_hf_folder_with_per_expert_layout_of_transformers_4(tmp_path):
    """The layout published on the hub: block_sparse_moe.experts.{j}.w1/w2/w3."""
    import transformers

    args = tiny_args(moe=True)
    model = random_model(args, seed=2)
    names = dict(published_to_hf(internal_to_published(model.state_dict(), args), args))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    write_safetensors(tmp_path / "model.safetensors", names.items(), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(args, torch.float32)))
    ours = load_model(tmp_path, device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_difference(ours, hf) <= TOLERANCE
    assert max_difference(ours, hf) == max_difference(model, hf)


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_convert_mistral_to_hf_and_back_is_byte_identical(tmp_path, moe):
    import transformers

    args = tiny_args(moe=moe)
    model = random_model(args, seed=3)
    save_consolidated(model, tmp_path / "mistral")
    convert(tmp_path / "mistral", tmp_path / "hf", to="hf")
    convert(tmp_path / "hf", tmp_path / "back", to="mistral")
    for name in ("consolidated.safetensors", "params.json"):
        assert (tmp_path / "mistral" / name).read_bytes() == (tmp_path / "back" / name).read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert max_difference(model, hf) <= TOLERANCE


def test_convert_to_bfloat16_and_load_in_any_dtype(tmp_path):
    args = tiny_args(moe=True)
    model = random_model(args, seed=4)
    save_consolidated(model, tmp_path / "mistral")
    convert(tmp_path / "mistral", tmp_path / "bf16", to="mistral", dtype=torch.bfloat16)
    loaded = load_model(tmp_path / "bf16", device="cpu", dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    state = loaded.state_dict()  # packed for oneDNN (fast/cpu_packed.py): the same names, in another order
    assert state.keys() == model.state_dict().keys()
    for name, expected in model.state_dict().items():
        assert torch.equal(expected.to(torch.bfloat16), state[name]), name
    upcast = load_model(tmp_path / "bf16", device="cpu", dtype=torch.float32)
    assert upcast.dtype == torch.float32


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    import mixtral_infer.checkpoint.convert as convert_module

    save_consolidated(random_model(tiny_args()), tmp_path / "mistral")

    def fail_midway(folder, tensors, max_shard_size, metadata=None, plan=None):
        next(iter(tensors))
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "write_hf_shards", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "mistral", tmp_path / "hf", to="hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mistral"]


PEAK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from mixtral_infer import load_model

    def rss_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    torch.ones(1) @ torch.ones(1)  # let torch allocate what it allocates once
    before = rss_kib("VmRSS")
    model = load_model(sys.argv[1], device="cpu", dtype=torch.float32)
    print((rss_kib("VmHWM") - before) * 1024)
    """
)


def test_loading_peak_memory_stays_near_one_copy(tmp_path):
    """Peak resident memory while loading, measured in a fresh process, stays below 1.5x the checkpoint."""
    from mixtral_infer import ModelArgs, MoeArgs

    args = ModelArgs(
        dim=512, n_layers=4, head_dim=64, hidden_dim=1024, n_heads=8, n_kv_heads=2, norm_eps=1e-5,
        vocab_size=16000, sliding_window=64, moe=MoeArgs(num_experts=4, num_experts_per_tok=2),
    )
    save_consolidated(Transformer(args), tmp_path)
    checkpoint_bytes = (tmp_path / "consolidated.safetensors").stat().st_size
    assert checkpoint_bytes > 100e6
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    peak = int(result.stdout.strip())
    assert peak < 1.5 * checkpoint_bytes, f"peak {peak / 1e6:.0f} MB for a {checkpoint_bytes / 1e6:.0f} MB checkpoint"


@pytest.mark.parametrize("weights", ["consolidated.safetensors", "consolidated.00.pth"])
def test_progress_counts_every_tensor_of_either_file_once(tmp_path, weights):
    """A .pth used to report (done, done) for each tensor: from tensor 50 on the bar printed a full line each."""
    args = tiny_args(moe=False)
    args.n_layers = 6  # 6 * 9 + 3 = 57 tensors: above the bar's threshold of 50
    folder = tmp_path / "model"
    save_consolidated(random_model(args), folder)
    if weights.endswith(".pth"):
        from mixtral_infer.checkpoint.safetensors_reader import iter_tensors

        torch.save(dict(iter_tensors(folder / "consolidated.safetensors")), folder / weights)
        (folder / "consolidated.safetensors").unlink()
    calls = []
    load_model(folder, device="cpu", progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 57) for i in range(1, 58)]


def test_hf_config_without_rms_norm_eps_gets_mistral_configs_default():
    import transformers

    from mixtral_infer.checkpoint.hf_format import args_from_hf_config

    config = hf_config_from_args(tiny_args(moe=False), torch.float32)
    del config["rms_norm_eps"]
    assert args_from_hf_config(config).norm_eps == transformers.MistralConfig().rms_norm_eps == 1e-6


@pytest.mark.parametrize("batch", [0, -1, "2", 1.5])
def test_max_batch_size_is_validated_with_the_args(tmp_path, batch):
    from mixtral_infer.errors import ConfigError

    save_consolidated(random_model(tiny_args(moe=False)), tmp_path / "model")
    with pytest.raises(ConfigError, match=rf"load_model: max_batch_size={batch!r} must be a positive integer"):
        load_model(tmp_path / "model", max_batch_size=batch, device="cpu")


def test_params_json_round_trip_leaves_out_max_batch_size(tmp_path):
    args = tiny_args(moe=True, max_batch_size=3)
    save_consolidated(random_model(args), tmp_path / "model")
    params = json.loads((tmp_path / "model" / "params.json").read_text())
    assert "max_batch_size" not in params
    assert params["moe"] == {"num_experts": 4, "num_experts_per_tok": 2}
    loaded = load_model(tmp_path / "model", max_batch_size=3, device="cpu").args
    assert loaded == args
