"""fast.measured: this machine's Tuning, its choices measured once (with a line saying so) and kept on
disk by the CPU's model, cores and torch's version, never by its vendor; a Tuning passed in wins.
No test times anything: the measurements are stand-ins that say what they were asked."""

from __future__ import annotations

import json

import pytest
import torch

from mixtral_infer import load_model
from mixtral_infer.errors import ConfigError
from mixtral_infer.fast import cpu_float32
from mixtral_infer.formats import measured
from mixtral_infer.kernels import linear
from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.formats.measured import Choice, cache_file, machine_key, machine_tuning
from mixtral_infer.hardware import CpuInfo
from mixtral_infer.tuning import Tuning

XEON = CpuInfo(vendor="GenuineIntel", model="Some CPU", cores=2)
EPYC = CpuInfo(vendor="AuthenticAMD", model="Some CPU", cores=2)  # the same model name and cores


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring switched on (conftest switches it off), the cache in a folder of the test's own."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    monkeypatch.setenv(measured.CACHE_VARIABLE, str(tmp_path / "tuning.json"))
    return tmp_path / "tuning.json"


def stand_ins(results: dict, asked: list):
    """Choices named as the real ones whose measurements return ``results`` and note each call."""

    def measure(name):
        return lambda known: asked.append(name) or results[name]

    return [Choice(c.name, measure(c.name), c.capable) for c in measured.CHOICES]


ALL_FASTER = {
    "onednn_float32": True, "upcast_bfloat16": True, "upcast_float16": False, "few_row_blocks": True, "few_streams": True,
}


def test_the_choices_are_measured_once_then_read_from_the_cache(measuring):
    """The first call measures every choice, says so in one line naming the file, and writes it; the
    second reads it and says nothing. The tuning follows the measurements."""
    asked, lines = [], []
    choices = stand_ins(ALL_FASTER, asked)
    first = machine_tuning(cpu=XEON, choices=choices, announce=lines.append)
    assert asked == ["onednn_float32", "upcast_bfloat16", "upcast_float16", "few_row_blocks", "few_streams"]
    assert lines == [
        f"measuring onednn_float32, upcast_bfloat16, upcast_float16, few_row_blocks, few_streams once for this machine "
        f"(cached in {measuring})"
    ]
    assert (first.onednn_float32, first.upcast, first.few_row_blocks, first.streams) == (True, (torch.bfloat16,), True, 2)
    assert json.loads(measuring.read_text()) == {machine_key(XEON): ALL_FASTER}
    again = machine_tuning(cpu=XEON, choices=choices, announce=lines.append)
    assert again == first and len(asked) == 5 and len(lines) == 1


def test_the_vendor_decides_nothing(measuring):
    """Two CPUs of one model name and core count, one Intel's, one AMD's: one entry, one measurement,
    one tuning (the measured one, not a vendor's conclusion)."""
    asked = []
    choices = stand_ins({**ALL_FASTER, "few_row_blocks": False}, asked)
    xeon = machine_tuning(cpu=XEON, choices=choices, announce=lambda line: None)
    epyc = machine_tuning(cpu=EPYC, choices=choices, announce=pytest.fail)  # nothing measured: no line
    assert xeon == epyc and not epyc.few_row_blocks and len(asked) == 5
    assert machine_key(XEON) == machine_key(EPYC) == f"Some CPU | 2 cores | torch {torch.__version__}"


def test_a_machine_of_another_model_cores_or_torch_measures_anew(measuring, monkeypatch):
    asked = []
    choices = stand_ins(ALL_FASTER, asked)
    for cpu in (XEON, CpuInfo(model="Other CPU", cores=2), CpuInfo(model="Some CPU", cores=4)):
        machine_tuning(cpu=cpu, choices=choices, announce=lambda line: None)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    machine_tuning(cpu=XEON, choices=choices, announce=lambda line: None)
    assert len(asked) == 5 * 4 and len(json.loads(measuring.read_text())) == 4


def test_capabilities_decide_without_measuring(measuring, monkeypatch):
    """One core: no blocks per thread, without timing them; no oneDNN: MKL, likewise."""
    asked = []
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    tuning = machine_tuning(cpu=CpuInfo(model="Small CPU", cores=1), choices=stand_ins(ALL_FASTER, asked),
                            announce=lambda line: None)  # fmt: skip
    assert asked == ["upcast_bfloat16", "upcast_float16"]
    assert not tuning.few_row_blocks and not tuning.onednn_float32 and tuning.upcast == (torch.bfloat16,)


def test_a_choice_added_later_is_measured_alone(measuring):
    asked = []
    choices = stand_ins(ALL_FASTER, asked)
    machine_tuning(cpu=XEON, choices=choices[:2], announce=lambda line: None)
    lines = []
    machine_tuning(cpu=XEON, choices=choices, announce=lines.append)
    assert asked == ["onednn_float32", "upcast_bfloat16", "upcast_float16", "few_row_blocks", "few_streams"]
    assert lines[0].startswith("measuring upcast_float16, few_row_blocks, few_streams once")


def test_a_damaged_cache_is_measured_again_and_an_unwritable_one_said(measuring, tmp_path):
    asked, lines = [], []
    measuring.write_text("{not json")
    machine_tuning(cpu=XEON, choices=stand_ins(ALL_FASTER, asked), announce=lines.append)
    assert len(asked) == 5 and machine_key(XEON) in json.loads(measuring.read_text())
    blocked = tmp_path / "a file" / "tuning.json"  # its folder is a file: nothing can be written there
    (tmp_path / "a file").write_text("")
    tuning = machine_tuning(cpu=XEON, path=blocked, choices=stand_ins(ALL_FASTER, asked), announce=lines.append)
    assert tuning.onednn_float32 and len(asked) == 10
    assert lines[-1].startswith(f"could not keep the measurements in {blocked}")


def test_nothing_is_measured_for_the_reference_or_when_switched_off(measuring, monkeypatch):
    choices = stand_ins(ALL_FASTER, [])
    assert machine_tuning(False, cpu=XEON, choices=choices, announce=pytest.fail) == Tuning(fast=False)
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "0")
    assert machine_tuning(cpu=XEON, choices=choices, announce=pytest.fail) == Tuning()
    assert not measuring.exists()


def test_the_cache_file_s_place(monkeypatch, tmp_path):
    monkeypatch.setenv(measured.CACHE_VARIABLE, str(tmp_path / "here.json"))
    assert cache_file() == tmp_path / "here.json"
    monkeypatch.delenv(measured.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cache_file() == tmp_path / "cache" / "mixtral_infer" / "tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_file() == tmp_path / "home" / ".cache" / "mixtral_infer" / "tuning.json"


def test_load_model_takes_the_machine_s_tuning_unless_given_one(measuring, monkeypatch, model_folder):
    """load_model measures once (the stand-ins: nothing is timed), a second load reads the cache, and a
    Tuning passed in is taken as it is: nothing measured, nothing read."""
    asked = []
    monkeypatch.setattr(measured, "CHOICES", stand_ins(ALL_FASTER, asked))
    first = load_model(model_folder)
    assert tuning_of(first).onednn_float32 and tuning_of(first).few_row_blocks and len(asked) == 5
    assert tuning_of(load_model(model_folder)) == tuning_of(first) and len(asked) == 5
    measuring.unlink()
    given = Tuning(streams=2, expert_streams=1)
    model = load_model(model_folder, tuning=given)
    assert tuning_of(model) is given and len(asked) == 5 and not measuring.exists()
    assert {module.tuning for module in model.modules() if "tuning" in module.__dict__} == {given}
    with pytest.raises(ConfigError, match="disagree"):
        load_model(model_folder, fast=False, tuning=given)


def test_the_few_row_blocks_measurement_asks_for_a_clear_margin(monkeypatch):
    """The bmm blocks only when at least BLOCKS_MARGIN faster than F.linear (times given, not taken),
    and never on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for library, blocks, expected in ((1.0, 0.5, True), (1.0, 0.9, False), (0.5, 1.0, False)):
            times = iter([library, blocks])
            monkeypatch.setattr(measured, "best_seconds", lambda fn: next(times))
            assert measured.few_row_blocks_are_faster() is expected
        torch.set_num_threads(1)
        assert measured.few_row_blocks_are_faster() is False
    finally:
        torch.set_num_threads(threads)


def test_the_measured_paths_compute_what_the_reference_does():
    """What is measured changes the speed, not the numbers: the bmm blocks and oneDNN give F.linear's
    products (to float32's rounding)."""
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(64, 32, generator=g), torch.randn(300, 32, generator=g)
    want = torch.nn.functional.linear(x, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # two blocks
        torch.testing.assert_close(linear.few_row_blocks(x[:3], weight), want[:3], atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(cpu_float32.float32_linear(x, weight, onednn=True), want, atol=1e-5, rtol=1e-5)
