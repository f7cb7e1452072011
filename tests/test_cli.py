"""The command line end to end, in a subprocess, on the model shipped with the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.cli.commands import DEFAULT_MODEL, DEMO_PROMPTS, SHIPPED_MODELS

REPO = Path(__file__).resolve().parents[1]


def run(*args, stdin=None):
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_shipped_models_are_complete():
    for name in ("tiny-mixtral", "tiny-mistral"):
        folder = SHIPPED_MODELS / name
        for file in ("params.json", "consolidated.safetensors", "tokenizer.model"):
            assert (folder / file).is_file(), folder / file
    mixtral = load_model(DEFAULT_MODEL, device="cpu")
    assert mixtral.args.moe is not None and mixtral.args.moe.num_experts_per_tok == 2
    assert mixtral.args.sliding_window is not None


@pytest.mark.parametrize("settings", [[], ["--temperature", "0"]], ids=["sampled", "greedy"])
def test_demo_prints_each_prompt_with_its_completion(settings):
    result = run("demo", "--max_tokens", "40", *settings)
    assert result.returncode == 0, result.stderr
    model = load_model(DEFAULT_MODEL, max_batch_size=3, device="cpu")
    tokenizer = Tokenizer(DEFAULT_MODEL / "tokenizer.model")
    sampling = dict(temperature=0.7, top_p=0.9, seed=0) if not settings else {}
    generated, _ = generate(
        [tokenizer.encode(p) for p in DEMO_PROMPTS], model, max_tokens=40, eos_id=tokenizer.eos_id, **sampling
    )
    for prompt, tokens in zip(DEMO_PROMPTS, generated):
        completion = tokenizer.decode(tokens)
        assert len(completion.split()) >= 5
        assert completion.strip() in result.stdout
        assert prompt in result.stdout
    # The demo's output runs past the window, so the cache has rotated.
    assert max(len(tokenizer.encode(p)) + len(t) for p, t in zip(DEMO_PROMPTS, generated)) > model.args.sliding_window


def test_interactive_streams_two_instruct_turns_then_ends_at_end_of_input():
    result = run("interactive", "--instruct", "--max_tokens", "12", "--temperature", "0", stdin="Who art thou?\nSay more.\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    answers = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(answers) == 2
    assert all(len(a.split()) >= 2 for a in answers)


def test_interactive_reset_and_quit():
    result = run("interactive", "--max_tokens", "5", "--temperature", "0", stdin="In the beginning\n/reset\n/quit\nnever read\n")
    assert result.returncode == 0, result.stderr
    assert "(new conversation)" in result.stderr
    assert result.stdout.count("> ") == 3  # three prompts shown; the line after /quit is never read


@pytest.mark.parametrize("option", ["--tensor_parallel", "--num_pipeline_ranks"])
def test_torchrun_with_two_processes_prints_the_same_completions(option):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    single = run("demo", "--max_tokens", "30")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), str(REPO / "main.py"), "demo", "--max_tokens", "30", option, "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == single.stdout  # only rank 0 prints


def test_parallel_options_without_torchrun_are_a_clear_error():
    result = run("demo", "--tensor_parallel", "2")
    assert result.returncode == 1
    assert "launch with torchrun --nproc-per-node 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_decode_static_prints_what_decode_eager_prints():
    """The fast decode step behind the command line: the same sampled text, demo and a conversation."""
    eager = run("demo", "--max_tokens", "40", "--decode", "eager")
    static = run("demo", "--max_tokens", "40", "--decode", "static")
    assert eager.returncode == 0 and static.returncode == 0, static.stderr
    assert static.stdout == eager.stdout
    turns = "Who art thou?\nSay more.\n"
    chat = [run("interactive", "--instruct", "--max_tokens", "40", "--seed", "1", "--decode", mode, stdin=turns) for mode in ("eager", "static")]
    assert chat[1].returncode == 0, chat[1].stderr
    assert chat[1].stdout == chat[0].stdout


def test_an_unknown_decode_mode_is_refused_before_loading():
    result = run("demo", "--decode", "fast")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --decode 'fast' is not one of auto, eager, static, compiled"
