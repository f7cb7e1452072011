"""The command line's front doors (issue 72, item 10): blank lines in ``interactive``, a ``--text`` that
is not UTF-8, exit code 2 for a command line that is not one. In-process: each check runs before
anything loads, or on a model loaded once."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import Tokenizer, load_model
from mixtral_infer.cli import commands
from mixtral_infer.cli.commands import DEFAULT_MODEL, main, read_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_interactive_skips_blank_and_whitespace_only_lines(monkeypatch, capsys):
    """As a shell does: "", "   " and "\\t" are no prompts (each was sent to the model, which answered)."""
    from mixtral_infer.generation.chat import Conversation

    model, tokenizer = load_model(DEFAULT_MODEL, device="cpu", dtype=torch.float32), Tokenizer.from_folder(DEFAULT_MODEL)
    lines = iter(["", "In the beginning", "   ", "\t", "Blessed are", " ", None])
    prompts = []
    reply = Conversation.reply
    monkeypatch.setattr(commands, "load", lambda *args: (model, tokenizer))
    monkeypatch.setattr(commands, "read_line", lambda prompt: next(lines))
    monkeypatch.setattr(Conversation, "reply", lambda self, line, **kwargs: prompts.append(line) or reply(self, line, **kwargs))
    commands.interactive(max_tokens=3, temperature=0)
    assert prompts == ["In the beginning", "Blessed are"]
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and sum("tokens/s" in line for line in err.splitlines()) == 2


def test_perplexity_refuses_a_text_that_is_not_utf8(tmp_path, capsys):
    """Its help says UTF-8; a Latin-1 file was read with U+FFFD for its bytes, silently. One line names
    the first byte that is not UTF-8 and its offset, before the model loads."""
    latin1 = tmp_path / "psalm.txt"
    latin1.write_bytes("The LORD is my shepherd; caf".encode() + b"\xe9 au lait\n")
    assert main(["perplexity", "--text", str(latin1)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --text {latin1}: not UTF-8 (byte 0xe9 at offset 28); convert it to UTF-8 first (iconv -t utf-8)\n"
    utf8 = tmp_path / "utf8.txt"
    utf8.write_text("café 日本語\n", encoding="utf-8")
    assert read_text(str(utf8)) == "café 日本語\n"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["dmeo"], 2, "unknown command 'dmeo'"),
        (["demo", "--max-token", "5"], 2, "demo: unknown option --max-token; did you mean --max-tokens?"),
        (["models", "extra"], 2, "models: unexpected argument 'extra' (takes none)"),
        (["demo", "--seed", "1", "--seed=2"], 2, "demo: --seed is given twice"),
        (["demo", "--prompt"], 2, "demo: --prompt needs a value (--prompt VALUE)"),  # fire passed True
        (["demo", "--max-tokens", "--seed", "1"], 2, "demo: --max-tokens needs a value"),
        (["perplexity"], 2, "--text FILE is required"),
        (["demo", "--json=3"], 2, "--json takes no value (got 3)"),
        (["demo", "--top-p", "1.5"], 1, "--top-p 1.5 must be in (0, 1]"),  # a value out of range: 1, as before
        (["perplexity", "--text", "no-such.txt"], 1, "--text no-such.txt: cannot read it"),
    ],
)
def test_a_command_line_that_is_not_one_exits_2(args, code, message, capsys):
    """Usage errors exit 2 everywhere, as argparse's and the shells' do (an unknown command did, an
    unknown option exited 1); errors about a value, a file or a model stay 1."""
    assert main(args) == code
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
