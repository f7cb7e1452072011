"""The command line end to end on the model shipped with the package: its ``main`` in this process
(``command_line.in_process``: what a command prints), and in a subprocess what is about a process
(torchrun, a terminal, Ctrl-C, what is imported)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from command_line import in_process

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.cli.commands import DEFAULT_MODEL, DEMO_PROMPTS, SHIPPED_MODELS
from mixtral_infer.generation.perplexity import perplexity

REPO = Path(__file__).resolve().parents[1]


run = in_process  # main() here, as a subprocess would report it (tests/command_line.py)


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
    result = run("demo", "--max-tokens", "40", *settings)
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
    result = run("interactive", "--instruct", "--max-tokens", "12", "--temperature", "0", stdin="Who art thou?\nSay more.\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    answers = result.stdout.splitlines()  # piped: no prompt characters, one answer per line
    assert len(answers) == 2
    assert all(len(a.split()) >= 2 for a in answers)


def test_interactive_reset_and_quit():
    """Lines of a Windows file (CRLF) are their text (the \\r was read as part of the prompt), and
    a command may follow spaces."""
    stdin = "In the beginning\r\n/reset\r\n  /quit\nnever read\n"
    result = run("interactive", "--max-tokens", "5", "--temperature", "0", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert "(new conversation)" in result.stderr
    assert "> " not in result.stdout
    assert result.stdout == greedy_continuation("In the beginning", 5)[0] + "\n"  # the line after /quit is never read


def greedy_continuation(prompt: str, max_tokens: int) -> tuple[str, int]:
    """What the shipped default model continues ``prompt`` with at temperature 0, and its token count."""
    model = load_model(DEFAULT_MODEL, device="cpu")
    tokenizer = Tokenizer(DEFAULT_MODEL / "tokenizer.model")
    generated, _ = generate([tokenizer.encode(prompt)], model, max_tokens=max_tokens, eos_id=tokenizer.eos_id)
    return tokenizer.decode_continuation(generated[0]), len(generated[0])


def test_interactive_piped_gives_the_answers_on_stdout_and_a_stats_line_each_on_stderr():
    expected, n_tokens = greedy_continuation("In the beginning", 6)
    result = run("interactive", "--max-tokens", "6", "--temperature", "0", stdin="In the beginning\nIn the beginning\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{expected}\n{expected}\n"
    stats = [line for line in result.stderr.splitlines() if "tokens/s" in line]
    assert len(stats) == 2
    for line in stats:
        assert re.fullmatch(rf"\[{n_tokens} tokens, [\d.]+ tokens/s, first token after [\d.]+ s; cut at --max-tokens 6\]", line), line


def test_an_answer_that_ends_at_eos_has_no_max_tokens_mark(monkeypatch, capsys, tokenizer_path):
    """The shipped models never end a text, so the model's EOS is played by the token it says third."""
    from conftest import random_model, tiny_args

    from mixtral_infer.cli import commands

    model = random_model(dataclasses.replace(tiny_args(), vocab_size=400), seed=3)
    tokenizer = Tokenizer(tokenizer_path)
    greedy, _ = generate([tokenizer.encode("a question")], model, max_tokens=8)
    stop = greedy[0].index(greedy[0][2])  # tokens said before the "EOS" first comes

    class EndsThere(Tokenizer):
        eos_id = greedy[0][2]

    lines = iter(["a question", "a question", None])
    monkeypatch.setattr(commands, "load", lambda *args: (model, EndsThere(tokenizer_path)))
    monkeypatch.setattr(commands, "read_line", lambda prompt: next(lines))
    commands.interactive(max_tokens=8, temperature=0)
    monkeypatch.setattr(commands, "load", lambda *args: (model, tokenizer))
    lines = iter(["a question", None])
    commands.interactive(max_tokens=8, temperature=0)
    stats = [line for line in capsys.readouterr().err.splitlines() if "tokens/s" in line]
    assert len(stats) == 3
    assert all(line.startswith(f"[{stop} tokens, ") and line.endswith(" s]") for line in stats[:2])
    assert stats[2].startswith("[8 tokens, ") and stats[2].endswith("; cut at --max-tokens 8]")


class Terminal:
    """The command line on a pseudo-terminal, as a user at a shell sees it (stdout and stderr mixed)."""

    def __init__(self, *args):
        import pty

        env = {**os.environ, "TERM": "xterm", "OMP_NUM_THREADS": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session of its own, the pty as its terminal
            # As a shell starts a foreground job: Ctrl-C interrupts. (A suite started in the
            # background by a non-interactive shell ignores SIGINT, and a child would inherit that.)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, str(REPO / "main.py"), *args], env)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        """Everything shown from the last call on, up to and including ``text``."""
        import select

        deadline = time.monotonic() + timeout
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"{text!r} never shown; the terminal shows {self.seen!r}")
            try:
                self.seen += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # the child has exited
                raise AssertionError(f"{text!r} never shown; the terminal shows {self.seen!r}") from None
        shown, self.seen = self.seen.split(text, 1)
        return shown + text

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def ctrl_c(self) -> None:
        # Python's readline loop sees a signal only when its select() is interrupted; one that
        # lands between the prompt being drawn and select() waits for the next key. A person
        # never presses that fast: wait as they would.
        time.sleep(0.5)
        self.type("\x03")

    def exit_code(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_interactive_on_a_terminal_prompts_edits_recalls_history_and_explains_ctrl_c():
    expected, _ = greedy_continuation("In the beginning", 6)
    terminal = Terminal("interactive", "--max-tokens", "6", "--temperature", "0")
    assert "type a prompt" in terminal.read_until("> ")
    terminal.type("In the begXX\x7f\x7finning\r")  # two backspaces: line editing
    first = terminal.read_until("> ")
    assert expected in first and "cut at --max-tokens 6" in first
    terminal.type("\x1b[A\r")  # up arrow: the last line again, from readline's history
    again = terminal.read_until("> ")
    assert "In the beginning" in again and expected in again
    terminal.ctrl_c()  # at the empty prompt
    assert "(Ctrl-C: press it again, type /quit or press Ctrl-D to leave)" in terminal.read_until("> ")
    terminal.type("/quit\r")
    assert terminal.exit_code() == 0


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_ctrl_c_twice_at_the_prompt_leaves():
    terminal = Terminal("interactive", "--max-tokens", "4")
    terminal.read_until("> ")
    terminal.ctrl_c()
    terminal.read_until("press it again")
    terminal.read_until("> ")
    terminal.ctrl_c()
    assert terminal.exit_code() == 0


def test_instruct_on_a_shipped_model_says_it_is_not_instruction_tuned():
    instruct = run("interactive", "tiny-mistral", "--instruct", stdin="")
    assert instruct.returncode == 0, instruct.stderr
    assert "note: tiny-mistral is not instruction-tuned" in instruct.stderr
    plain = run("interactive", "tiny-mistral", stdin="")
    assert "instruction-tuned" not in plain.stderr


def test_only_rank_0_says_an_answer_was_stopped(monkeypatch, capsys, tokenizer_path):
    """Ctrl-C reaches every torchrun process; ranks other than 0 print nothing."""
    from conftest import random_model, tiny_args

    from mixtral_infer.cli import commands
    from mixtral_infer.generation.chat import Conversation

    def interrupted(self, text, emit):
        raise KeyboardInterrupt

    model = random_model(dataclasses.replace(tiny_args(), vocab_size=400))
    monkeypatch.setattr(commands, "load", lambda *args: (model, Tokenizer(tokenizer_path)))
    monkeypatch.setattr(Conversation, "reply", interrupted)
    for main_process, expected in ((False, ""), (True, "[stopped by Ctrl-C]\n")):
        lines = iter(["a question", None])
        monkeypatch.setattr(commands, "is_main_process", lambda: main_process)
        monkeypatch.setattr(commands, "read_line", lambda prompt: next(lines))
        monkeypatch.setattr(commands, "_share_line", lambda line: next(lines) if not main_process else line)
        commands.interactive()
        out, err = capsys.readouterr()
        assert err.endswith(expected) and (out == "\n") == main_process


def test_demo_completes_each_prompt_given_in_order():
    prompts = ["Blessed are", "3", "你好 world"]  # "3" stays text; 你 and 好 have no pieces (bytes)
    args = [item for prompt in prompts for item in ("--prompt", prompt)]
    result = run("demo", *args, "--max-tokens", "10", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    model = load_model(DEFAULT_MODEL, max_batch_size=3, device="cpu")
    tokenizer = Tokenizer(DEFAULT_MODEL / "tokenizer.model")
    generated, _ = generate([tokenizer.encode(p) for p in prompts], model, max_tokens=10, eos_id=tokenizer.eos_id)
    blocks = [f"{p}{tokenizer.decode_continuation(g)}\n{'-' * 40}\n" for p, g in zip(prompts, generated)]
    assert result.stdout == "".join(blocks)
    one = run("demo", "-p", "Blessed are", "--max-tokens", "10", "--temperature", "0")
    assert one.stdout == blocks[0]


def test_perplexity_prints_what_the_api_measures(tmp_path):
    text = "In the beginning God created the heaven and the earth. And the earth was without form, and void."
    (tmp_path / "text.txt").write_text(text * 3, encoding="utf-8")
    result = run("perplexity", "tiny-mistral", "--text", tmp_path / "text.txt", "--context", "16", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    model = load_model("tiny-mistral", max_batch_size=4, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder("tiny-mistral")
    ids = tokenizer.encode(text * 3, bos=False)
    expected = perplexity(model, ids, tokenizer.bos_id, context=16)
    assert len(ids) == 83 and expected.segments == 6  # 15 tokens a segment after its BOS
    assert 1 < expected.perplexity < 100  # Bible text, which it was trained on
    assert result.stdout == f"perplexity {expected.perplexity:.4f} over 83 tokens (6 segments of up to 16 tokens)\n"
    assert "scored in" in result.stderr


def run_counting_heavy_imports(*args):
    """The command line in a subprocess that says on stderr which heavy modules were imported by the end."""
    code = (
        "import atexit, runpy, sys\n"
        f"sys.argv = ['main.py', *{list(args)!r}]\n"
        "heavy = ('torch', 'xformers', 'sentencepiece', 'safetensors', 'fire')\n"
        "atexit.register(lambda: sys.stderr.write('imported: %s\\n' % sorted(m for m in heavy if m in sys.modules)))\n"
        f"runpy.run_path({str(REPO / 'main.py')!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["interactive", "-h"], ["convert", "--help"], []])
def test_help_imports_no_torch(args):
    """--help took 5.5-6 s when importing xformers pulled in torch._dynamo; now it imports no model code."""
    result = run_counting_heavy_imports(*args)
    assert result.returncode == 0, result.stderr
    heavy = result.stderr.strip().splitlines()[-1]
    assert heavy in ("imported: []", "imported: ['fire']"), heavy
    assert result.stdout.strip()  # on stdout, so `| less` shows it


def test_help_documents_every_option_with_its_default_and_choices():
    from mixtral_infer.cli.commands import COMMANDS
    from mixtral_infer.generation.generate import DECODE_MODES

    top = run("--help")
    for command in COMMANDS:
        assert f"  {command} " in top.stdout
    assert "MODEL_PATH: a model folder" in top.stdout and "tiny-mistral, tiny-mixtral" in top.stdout
    for command, function in COMMANDS.items():
        text = run(command, "--help").stdout
        assert "Optional[Optional" not in text and "'Optional" not in text and "Optional[]" not in text
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is inspect.Parameter.empty:  # SRC, DST: listed as positional arguments
                block = re.split(r"\n {0,4}(?=\S)", text.split(f"\n    {name.upper()}\n", 1)[1])[0]
            else:
                block = text.split(f"--{name.replace('_', '-')}=", 1)[1].split("\n    -", 1)[0]  # this option's lines
                assert f"Default: {parameter.default!r}" in block, block
            description = block.strip().splitlines()[-1].strip()
            assert not description.startswith(("Type:", "Default:")) and len(description) > 20, block
    demo_help = run("demo", "--help").stdout
    decode = demo_help.split("--decode=", 1)[1]
    assert all(mode in decode for mode in DECODE_MODES)
    assert all(name in demo_help.split("--dtype=", 1)[1] for name in ("float32", "bfloat16", "float16"))
    assert "shipped model's name" in demo_help.split("--model-path=", 1)[1]
    assert "not" in run("interactive", "--help").stdout.split("--instruct", 1)[1].split("--max-tokens")[0]


@pytest.mark.parametrize("option", ["--tensor-parallel", "--num-pipeline-ranks"])
def test_torchrun_with_two_processes_prints_the_same_completions(option):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # float32: bfloat16 (the shipped models' own dtype) rounds differently once the matmuls are cut
    single = run("demo", "--max-tokens", "30", "--dtype", "float32")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), str(REPO / "main.py"), "demo", "--max-tokens", "30", option, "2", "--dtype", "float32",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == single.stdout  # only rank 0 prints


def test_perplexity_of_a_pipe_under_torchrun_is_one_process_s():
    """Rank 0 reads /dev/stdin and shares the text: every rank read its own part of the pipe, and the
    ranks' collectives of different sizes aborted (or one rank said the text was empty)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = " ".join(["In the beginning God created the heaven and the earth."] * 30)
    single = subprocess.run([sys.executable, str(REPO / "main.py"), "perplexity", "--text", "/dev/stdin", "--dtype", "float32"],
                            input=text, capture_output=True, text=True, timeout=300)  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), str(REPO / "main.py"), "perplexity", "--text", "/dev/stdin", "--tensor-parallel", "2",
        "--dtype", "float32",
    ]  # fmt: skip
    result = subprocess.run(command, input=text, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0 and single.returncode == 0, result.stderr
    assert result.stdout == single.stdout and result.stdout.startswith("perplexity ")


def test_parallel_options_without_torchrun_are_a_clear_error():
    result = run("demo", "--tensor-parallel", "2")
    assert result.returncode == 1
    assert "launch with torchrun --nproc-per-node 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_decode_static_prints_what_decode_eager_prints():
    """The fast decode step behind the command line: the same sampled text, demo and a conversation
    (in float32: in the shipped models' bfloat16 the two paths round differently)."""
    eager = run("demo", "--max-tokens", "16", "--decode", "eager", "--dtype", "float32")
    static = run("demo", "--max-tokens", "16", "--decode", "static", "--dtype", "float32")
    assert eager.returncode == 0 and static.returncode == 0, static.stderr
    assert static.stdout == eager.stdout
    turns = "Who art thou?\nSay more.\n"
    chat = [run("interactive", "--instruct", "--max-tokens", "40", "--seed", "1", "--decode", mode, "--dtype", "float32", stdin=turns)
            for mode in ("eager", "static")]
    assert chat[1].returncode == 0, chat[1].stderr
    assert chat[1].stdout == chat[0].stdout


def test_an_unknown_decode_mode_is_refused_before_loading():
    result = run("demo", "--decode", "fast")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --decode 'fast' is not one of auto, eager, static, compiled"


@pytest.mark.parametrize("decode", ["auto", "eager", "compiled"])
def test_decode_compiled_loads_bfloat16_weights_plain_long_rows_in_blocks(decode, monkeypatch):
    """Compiled CPU decoding reads plain bfloat16 weights faster than oneDNN's layout (model.linear),
    long rows in column blocks (here rows of more than 32: the shipped model's are short); the eager
    loop reads the packed ones faster: the command line loads what its --decode reads."""
    from mixtral_infer.cli import commands
    from mixtral_infer.fast import cpu_column_blocks
    from mixtral_infer.fast.cpu_packed import onednn_packs
    from mixtral_infer.formats import packing
    from mixtral_infer.formats.packing import is_packed

    monkeypatch.setattr(cpu_column_blocks, "MAX_BLOCK", 32)
    model, _ = commands.load(None, 1, "cpu", "bfloat16", max_tokens=8, decode=decode)
    assert is_packed(model) == (decode != "compiled" and onednn_packs(torch.bfloat16))  # packed where this CPU can
    assert (packing.blocked_numel(model) > 0) == (decode == "compiled")


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8, 1.5, 3.0])
def test_ctrl_c_at_any_moment_of_start_up_prints_no_traceback(delay):
    """SIGINT while Python starts, while torch is imported, while the model loads, while it generates:
    a blank line and exit 130 (or the interpreter's own end before it runs any code), never a traceback."""
    # As a terminal starts it: SIGINT handled by default (a suite run in the background by a
    # non-interactive shell ignores SIGINT, and the child would inherit that and never see the signal).
    process = subprocess.Popen([sys.executable, "main.py", "demo", "tiny-mixtral", "--max-tokens", "2000"], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    if stderr.startswith("Fatal Python error: init_import_site"):
        return  # the interpreter's own end while its site module runs, before any code of ours (a slow first start)
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert process.returncode in (130, -signal.SIGINT), (process.returncode, stderr)


def test_ctrl_c_while_triton_imports_is_held_until_the_import_returns(tmp_path):
    """torch._dynamo imports triton lazily, after torch (xformers' import asks for it); a Ctrl-C in
    its import ran through triton's C++ and ended the process with "terminate called". The command
    line's finder holds it for triton as for torch: the import finishes, then KeyboardInterrupt. A
    stand-in triton signals itself mid-import (the real one is slow to import only sometimes)."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\n"
        f"open({str(tmp_path / 'finished')!r}, 'w').close()\n")
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(REPO)!r})\n"
              "from mixtral_infer.cli.commands import DeferCtrlCWhileTorchImports\n"
              "sys.meta_path.insert(0, DeferCtrlCWhileTorchImports())\n"
              "try:\n    import triton\nexcept KeyboardInterrupt:\n"
              "    print('held')\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert result.stdout.strip() == "held" and (tmp_path / "finished").exists(), (result.stdout, result.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["dmeo"], "error: unknown command 'dmeo': did you mean demo? (commands: demo, interactive,"),
        (["demo", "tiny-mixtrl"], "error: tiny-mixtrl: model folder not found: did you mean tiny-mixtral?"),
        (["demo", "In the beginning"], 'model folder not found (to give a prompt, write --prompt "In the beginning")'),
    ],
)
def test_mistakes_get_a_did_you_mean_before_anything_loads(args, message):
    result = run(*args)
    assert result.returncode != 0 and message in result.stderr and result.stderr.count("\n") == 1


def test_h_is_help_everywhere_and_host_has_no_short_form():
    result = run("serve", "-h", "0.0.0.0")
    assert result.returncode == 0 and "--host=HOST" in result.stdout and "-h, --host" not in result.stdout


def test_demo_reads_prompts_from_a_file_or_stdin_and_prints_json(tmp_path):
    """--prompt-file (one prompt a line, - for stdin) after any --prompt; --json: one object a completion."""
    import json

    (tmp_path / "prompts.txt").write_text("In the beginning\n\nBlessed are\n")
    args = ["demo", "--max-tokens", "5", "--temperature", "0", "--dtype", "float32", "--json"]
    from_file = run(*args, "--prompt", "And God said", "--prompt-file", tmp_path / "prompts.txt")
    records = [json.loads(line) for line in from_file.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["And God said", "In the beginning", "Blessed are"]
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    for record in records:
        tokens = generate([tokenizer.encode(record["prompt"])], model, max_tokens=5, eos_id=tokenizer.eos_id)[0][0]
        assert record["text"] == tokenizer.decode_continuation(tokens) and record["tokens"] == len(tokens)
        assert record["finish_reason"] == ("length" if len(tokens) == 5 else "stop") and record["seconds"] > 0
    piped = run(*args, "--prompt-file", "-", stdin="In the beginning\n")
    assert [json.loads(line) for line in piped.stdout.splitlines()] == [{**records[1], "seconds": json.loads(piped.stdout)["seconds"],
                                                                          "tokens_per_second": json.loads(piped.stdout)["tokens_per_second"]}]  # fmt: skip
    missing = run("demo", "--prompt-file", tmp_path / "nope.txt")
    assert missing.returncode == 1 and "--prompt-file" in missing.stderr and "cannot read it" in missing.stderr


def test_convert_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch, capsys):
    """tiny-mixtral has 59 tensors: on a terminal, convert draws the bar loading draws."""
    from mixtral_infer.cli import commands

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    commands.convert("tiny-mixtral", str(tmp_path / "hf"), to="hf")
    err = capsys.readouterr().err
    assert "\rconverting [" in err and re.search(r"converting \[#{30}\] (\d+)/\1\n", err), err[-300:]
