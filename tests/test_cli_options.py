"""Every command-line option is checked before the model loads: one `error: ...` line, exit 1, no traceback.

Each case runs the command line's ``main`` in this process (``command_line.in_process``); what needs a
process of its own (torch not yet imported, the peak memory, the process id) runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from command_line import in_process

REPO = Path(__file__).resolve().parents[1]


run_cli = in_process  # main() here, as a subprocess would report it (tests/command_line.py)


def run_subprocess(*args):
    return subprocess.run([sys.executable, str(REPO / "main.py"), *map(str, args)], capture_output=True, text=True, timeout=300)


USAGE = ("unknown option", "unexpected argument", "is given twice", "is required")  # usage errors exit 2, as argparse's


def assert_one_line_error(result, message):
    assert result.returncode == (2 if any(usage in message for usage in USAGE) else 1), result.stderr
    assert "Traceback" not in result.stderr
    assert "loaded" not in result.stderr  # refused before the model was loaded
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--max-token", "5"], "demo: unknown option --max-token; did you mean --max-tokens? options: --model-path"),
        (["interactive", "--instrct"], "interactive: unknown option --instrct; did you mean --instruct?"),
        (["demo", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["demo", "--max-tokens", "abc"], "--max-tokens 'abc' must be an integer >= 0"),
        (["demo", "--seed", "abc"], "--seed 'abc' must be an integer in [0, 2**63)"),
        (["demo", "--seed", str(2**64 + 1)], f"--seed {2**64 + 1} must be an integer in [0, 2**63)"),
        (["demo", "--device", "meta"], "--device meta: a model runs on cpu, cuda or mps, not meta"),
        (["demo", "--device", "cpu:1"], "--device cpu:1: the CPU is one device, cpu"),  # the index was ignored
        # said before "launch with torchrun", which led to these errors only after the weights loaded
        (["demo", "--tensor-parallel", "2", "--num-pipeline-ranks", "2"], "use either --tensor-parallel or --num-pipeline-ranks, not both"),
        (["demo", "--tensor-parallel", "2", "--decode", "static"], "--decode static needs the whole model in one process"),
        (["demo", "--device", "mps"], "--device mps: MPS is not available on this machine" if not torch.backends.mps.is_available() else None),
        (["demo", "--tensor-parallel", "abc"], "--tensor-parallel 'abc' must be an integer >= 1"),
        (["convert", "a", "b", "c", "d", "e", "f", "g"], "convert: unexpected argument 'g'"),
        (["interactive", "tiny-mistral", "hello"], "interactive: unexpected argument 'hello' (a switch such as"),
        (["demo", "--max-tokens", "3", "--max-tokens=4"], "demo: --max-tokens is given twice; give it once"),  # fire took 4
        (["perplexity", "tiny-mistral"], "--text FILE is required: the file whose perplexity to measure"),
        (["perplexity", "tiny-mistral", "--text", "no-such.txt"], "--text no-such.txt: cannot read it (No such file"),
        (["perplexity", "--text", "README.md", "--context", "1"], "--context=1 must be an integer >= 2"),
        (["perplexity", "--text", "README.md", "--quantize", "int3"], "--quantize 'int3': expected one of"),
        (["serve", "--reuse-slack", "-1"], "--reuse-slack -1 must be an integer >= 0"),
        (["serve", "--tensor-parallel", "2"], "--tensor-parallel 2 --num-pipeline-ranks 1 needs 2 processes; this is 1: launch with torchrun"),
        (["serve", "--collective-timeout", "0"], "--collective-timeout 0 must be a number of seconds > 0"),
        (["serve", "--tensor-parallel", "2", "--decode", "compiled"], "--decode compiled needs the whole model in one process"),
        (["serve", "--tensor-parallel", "2", "--speculative-ngram"], "speculative decoding needs the whole model in one process"),
        (["serve", "--num-pipeline-ranks", "2", "--lora", "a=tests"], "--lora NAME=PATH (adapters kept apart) needs the whole model in one process"),
    ],
)
def test_bad_options_are_refused_before_loading(args, message):
    if message is None:
        pytest.skip("this machine has MPS")
    assert_one_line_error(run_cli(*args), message)


BEFORE_TORCH = """
import sys
from mixtral_infer.cli.commands import main
for args in ARGS:
    assert main(args) == 1
print("torch imported" if "torch" in sys.modules else "torch not imported")
"""


def test_option_errors_answer_before_torch_is_imported():
    """Checking an option costs no import of torch (1.5-3.5 s on 2 cores), only of the checks."""
    cases = [
        ["demo", "--max-tokens", "-3"],
        ["demo", "--quantize", "int3"],
        ["demo", "--decode", "fast"],
        ["demo", "--dtype", "float64"],
        ["demo", "--top-k", "0"],
        ["interactive", "--seed", "abc"],
        ["serve", "--port", "abc"],
        ["serve", "--max-rows", "0"],
        ["perplexity", "--text", "README.md", "--context", "0"],
        ["perplexity", "--text", "no-such.txt"],
        ["perplexity", "--text", "/dev/null"],  # empty: said after the model had loaded
        ["demo", "--temperature", "inf"],  # text, not a number: was "must be >= 0"
        ["convert", "a", "b", "--quantize", "int4-48"],
    ]
    code = f"ARGS = {cases!r}" + BEFORE_TORCH
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch not imported"
    errors = result.stderr.strip().splitlines()
    assert len(errors) == len(cases) and all(line.startswith("error: ") for line in errors), result.stderr
    assert "int4 group_size=48" in errors[-1]
    assert errors[-3:-1] == ["error: no tokens to score: /dev/null is empty",
                             "error: --temperature 'inf' must be a number >= 0 (0 means greedy)"]  # fmt: skip


def test_a_stray_world_size_is_one_line(monkeypatch):
    """WORLD_SIZE left in the environment without torchrun's other variables: torch's rendezvous
    error was a traceback."""
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run_cli("demo", "--tensor-parallel", "2")
    assert_one_line_error(result, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not: launch with torchrun")


def test_interactive_with_a_bad_setting_and_empty_input_fails():
    assert_one_line_error(run_cli("interactive", "--temperature", "-1", stdin=""), "--temperature -1 must be >= 0")


PEAK = (
    "import resource, sys; from mixtral_infer.cli.commands import main; code = main(sys.argv[1:]); "
    "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr); sys.exit(code)"
)


def test_max_tokens_too_large_for_a_model_without_a_window_is_refused_before_loading(model_folder):
    params = json.loads((model_folder / "params.json").read_text())
    del params["sliding_window"]
    (model_folder / "params.json").write_text(json.dumps(params))
    result = subprocess.run(
        [sys.executable, "-c", PEAK, "demo", str(model_folder), "--max-tokens", str(10**12)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error, peak = result.stderr.strip().splitlines()
    # 2 x 2 layers x 3 prompts x (10**12 + 1) slots x 2 KV heads x 16 x 4 bytes
    assert error.startswith(
        "error: --max-tokens 1000000000000: the KV cache for 3 sequence(s) of up to 1000000000001 tokens "
        "(no sliding window) needs 1536000.0 GB, more than the "
    ), error
    assert int(peak.split()[1]) < 1000  # MB, the interpreter and torch included: nothing of the cache was allocated


# ------------------------------------------------------------------ convert


def test_convert_refuses_a_dangling_symlink(tmp_path):
    (tmp_path / "dst").symlink_to(tmp_path / "nowhere")
    assert_one_line_error(
        run_cli("convert", REPO / "mixtral_infer/shipped/tiny-mistral", tmp_path / "dst"),
        f"{tmp_path / 'dst'}: already exists (a symlink); choose a new destination folder",
    )


@pytest.mark.parametrize("length", [300, 245])
def test_convert_refuses_a_destination_name_too_long_for_its_partial_folder(tmp_path, length):
    """The files are written into ``.DST.partial-PID`` first: 300 characters were a traceback
    (File name too long), 245 a "cannot write here" that did not say why."""
    from mixtral_infer.checkpoint.convert import convert
    from mixtral_infer.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^a{37}\.\.\.: name too long \(the partial folder .NAME.partial-PID "
                                              r"written first needs \d+ fewer bytes\); choose a shorter destination$"):  # fmt: skip
        convert(REPO / "mixtral_infer/shipped/tiny-mistral", tmp_path / ("a" * length), quantize="int8")
    assert list(tmp_path.iterdir()) == []


def test_convert_on_a_full_disk_names_the_destination(tmp_path, monkeypatch):
    """safetensors' own error for a full disk was a traceback (``--to hf``), and a tokenizer that
    could not be copied was reported as the source file that could not be written."""
    import shutil

    from safetensors import SafetensorError

    import mixtral_infer.checkpoint.convert as convert_module
    from mixtral_infer.errors import CheckpointError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert_module, "write_hf_shards", full)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"^{dst}: cannot write \(No space left on device \(os error 28\)\); nothing was written"):
        convert_module.convert("tiny-mistral", dst, to="hf")

    def no_room(src, copy_to, **kwargs):
        raise OSError(28, "No space left on device", str(src))

    monkeypatch.setattr(shutil, "copyfile", no_room)
    with pytest.raises(CheckpointError, match=rf"^{dst}: cannot write \(No space left on device\); nothing was written"):
        convert_module.convert("tiny-mistral", dst, to="mistral")
    assert list(tmp_path.iterdir()) == []


def test_convert_into_a_folder_it_cannot_write(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere; /proc refuses everyone
        parent, message = Path("/proc"), "/proc: cannot write here"
    else:
        parent, message = tmp_path / "read-only", f"{tmp_path / 'read-only'}: cannot write here (permission denied)"
        parent.mkdir(mode=0o555)
    result = run_cli("convert", REPO / "mixtral_infer/shipped/tiny-mistral", parent / "dst")
    assert_one_line_error(result, message)


def test_convert_removes_the_partial_folder_of_a_killed_run_and_says_so(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".dst.partial-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "consolidated.safetensors").write_bytes(b"half")
    result = run_cli("convert", REPO / "mixtral_infer/shipped/tiny-mistral", tmp_path / "dst")
    assert result.returncode == 0, result.stderr
    assert f"removed {stale}, left by an interrupted conversion (process {int(dead.stdout)} is gone)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    assert (tmp_path / "dst" / "config.json").is_file()


def test_convert_refuses_while_another_conversion_is_writing(tmp_path):
    live = tmp_path / f".dst.partial-{os.getpid()}"  # this test's process is alive
    live.mkdir()
    assert_one_line_error(
        run_subprocess("convert", REPO / "mixtral_infer/shipped/tiny-mistral", tmp_path / "dst"),
        f"another conversion to {tmp_path / 'dst'} (process {os.getpid()}) is running",
    )
    assert live.is_dir()
