"""Without dtype=, a model computes in its checkpoint's dtype where the device can (checkpoint/compute_dtype.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer import load_model
from mixtral_infer.checkpoint import compute_dtype as compute_module
from mixtral_infer.checkpoint.compute_dtype import compute_dtype, say_once, stored_dtype
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.loading import open_checkpoint, save_consolidated
from mixtral_infer.hardware import CpuInfo

BF16_CPU = CpuInfo(vendor="GenuineIntel", native=frozenset({torch.bfloat16}))
PLAIN_CPU = CpuInfo(vendor="AuthenticAMD", native=frozenset())
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture()
def cpu(monkeypatch):
    """Pretend to be a CPU with or without native bfloat16; the message may be said again."""
    say_once.cache_clear()

    def pretend(info: CpuInfo) -> None:
        monkeypatch.setattr(compute_module, "cpu_info", lambda: info)

    yield pretend
    say_once.cache_clear()


def test_the_stored_dtype_holds_the_most_numbers():
    # a bfloat16 model whose norms were kept in float32, plus integer step counters
    pairs = [(torch.bfloat16, 4096 * 4096), (torch.float32, 4096), (torch.int64, 10**9), (torch.bfloat16, 32000 * 4096)]
    assert stored_dtype(pairs) == torch.bfloat16
    assert stored_dtype([(torch.int8, 10)]) is None


@pytest.mark.parametrize(
    "stored, device, info, expected",
    [
        (torch.bfloat16, CPU, BF16_CPU, torch.bfloat16),
        (torch.bfloat16, CPU, PLAIN_CPU, torch.float32),
        (torch.float16, CPU, BF16_CPU, torch.float32),  # native bfloat16 says nothing of float16
        (torch.bfloat16, CUDA, PLAIN_CPU, torch.bfloat16),
        (torch.float16, CUDA, PLAIN_CPU, torch.float16),
        (torch.float32, CUDA, BF16_CPU, torch.float32),
        (torch.float64, CPU, BF16_CPU, torch.float32),
        (None, CPU, BF16_CPU, torch.float32),
    ],
)
def test_the_worked_examples(cpu, stored, device, info, expected):
    cpu(info)
    assert compute_dtype(stored, device) == expected


def test_float32_instead_is_said_once(cpu, capsys):
    cpu(PLAIN_CPU)
    for _ in range(3):
        assert compute_dtype(torch.bfloat16, CPU) == torch.float32
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no native bfloat16 arithmetic" in err and "--dtype bfloat16" in err


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory):
    """A bfloat16 model as a Mistral folder and as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("bf16")
    save_consolidated(random_model(tiny_args(moe=True)).to(torch.bfloat16), root / "mistral")
    convert(root / "mistral", root / "hf", to="hf")
    return root


@pytest.mark.parametrize("layout", ["mistral", "hf"])
def test_load_model_takes_the_checkpoints_dtype_where_the_cpu_has_it(cpu, bf16_folders, layout):
    assert open_checkpoint(bf16_folders / layout).stored_dtype() == torch.bfloat16
    cpu(BF16_CPU)
    assert load_model(bf16_folders / layout, device="cpu").dtype == torch.bfloat16
    cpu(PLAIN_CPU)
    assert load_model(bf16_folders / layout, device="cpu").dtype == torch.float32


def test_dtype_given_wins(cpu, bf16_folders):
    cpu(BF16_CPU)
    assert load_model(bf16_folders / "mistral", device="cpu", dtype=torch.float32).dtype == torch.float32


def test_a_float32_checkpoint_stays_float32(cpu, tmp_path):
    cpu(BF16_CPU)
    save_consolidated(random_model(tiny_args(moe=False)), tmp_path / "f32")
    assert load_model(tmp_path / "f32", device="cpu").dtype == torch.float32


def test_quantized_models_compute_in_bfloat16(cpu, bf16_folders):
    cpu(PLAIN_CPU)
    assert load_model(bf16_folders / "mistral", device="cpu", quantize="int8").dtype == torch.bfloat16


def test_the_command_line_sizes_the_cache_in_the_same_dtype(cpu, monkeypatch, tmp_path):
    """The CLI checks the cache's memory in the dtype the model will have: the shipped models are bfloat16."""
    from mixtral_infer.cli import commands
    from mixtral_infer.generation import settings

    seen = []
    check = settings.check_new_cache
    monkeypatch.setattr(settings, "check_new_cache", lambda *a: seen.append(a[4]) or check(*a))
    cpu(BF16_CPU)
    model, _ = commands.load("tiny-mistral", 1, "cpu", None, max_tokens=4)
    assert model.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    cpu(PLAIN_CPU)
    model, _ = commands.load("tiny-mistral", 1, "cpu", None, max_tokens=4)
    assert model.dtype == torch.float32 and seen[-1] == torch.float32
