"""bench/gpu_table.py: the GPU rows against issue 66's targets, from bench_gpu.py's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_table import table  # noqa: E402


def test_the_h200_rows_against_their_targets():
    text = table([REPO / "bench/results_gpu_h200_mixtral_int8.json", REPO / "bench/results_gpu_h200_mistral_quant.json"])
    assert "| mixtral-8x7b | int8 | 1 | 99.9 | - | - | 230 tok/s | no | 259 s (over 60) |" in text
    assert "| mistral-7b | int4 | 1 | 261.9 | - | - | 500 tok/s | no | 169 s (over 60) |" in text


def test_batches_of_8_and_more_are_held_to_80_percent_of_their_floor(tmp_path):
    results = {"models": {"mixtral-8x7b": {"decode": [
        {"batch": 1, "ours_fast": 150.0, "floor": 160.0, "ours_fast_compile_s": 50.0},
        {"batch": 8, "ours_fast": 700.0, "floor": 1000.0},
        {"batch": 32, "ours_fast": 2500.0, "floor": 3000.0},
    ]}}}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    lines = table([path]).splitlines()
    assert lines[2] == "| mixtral-8x7b | bfloat16 | 1 | 150.0 | 160.0 | 94% | 140 tok/s | yes | 50 s |"
    assert lines[3] == "| mixtral-8x7b | bfloat16 | 8 | 700.0 | 1000.0 | 70% | 800 80% of the floor | no | - |"
    assert lines[4] == "| mixtral-8x7b | bfloat16 | 32 | 2500.0 | 3000.0 | 83% | 2400 80% of the floor | yes | - |"


def test_the_lease_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(REPO / "bench/gpu_lease.sh")]).returncode == 0


def test_variants_are_named_and_held_to_their_scheme_s_target(tmp_path):
    results = {"grouped_experts": True, "models": {"mixtral-8x7b": {
        "decode": [{"batch": 8, "ours_fast": 900.0, "floor": 1000.0}],
        "quantized": [{"scheme": "int8", "batch": 1, "ours_fast": 240.0, "gathered_int8_experts": True}],
    }}}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    lines = table([path]).splitlines()
    assert lines[2] == "| mixtral-8x7b | bfloat16 grouped | 8 | 900.0 | 1000.0 | 90% | 800 80% of the floor | yes | - |"
    assert lines[3] == "| mixtral-8x7b | int8 gathered | 1 | 240.0 | - | - | 230 tok/s | yes | - |"


def test_rows_of_the_triton_experts_are_named_so(tmp_path):
    results = {"triton_experts": True, "models": {"mixtral-8x7b": {
        "decode": [{"batch": 1, "ours_fast": 150.0, "floor": 160.0}],
        "quantized": [{"scheme": "int4", "batch": 1, "ours_fast": 310.0}],
    }}}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    lines = table([path]).splitlines()
    assert lines[2] == "| mixtral-8x7b | bfloat16 triton | 1 | 150.0 | 160.0 | 94% | 140 tok/s | yes | - |"
    assert lines[3] == "| mixtral-8x7b | int4 triton | 1 | 310.0 | - | - | 300 tok/s | yes | - |"
