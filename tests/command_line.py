"""The command line run in the test's own process, reported as a subprocess would report it.

``python main.py ARGS`` in a subprocess spends 3-5 s of CPU importing torch, xformers and the package
before it reads its first option; ``in_process(*ARGS)`` calls the same ``main`` here, with stdin, stdout
and stderr swapped for memory, and gives back what ``subprocess.run(..., capture_output=True,
text=True)`` would: the exit code, stdout and stderr. For the tests of what a command prints and
refuses. A test of how a process starts, ends or is signalled (Ctrl-C, SIGTERM, torchrun, a pipe
that closes, what is imported) runs a real one.

    >>> result = in_process("demo", "--max-tokens", "abc")
    >>> result.returncode, result.stderr
    (1, "error: --max-tokens 'abc' must be an integer >= 0\\n")
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys


def in_process(*args, stdin: str | bytes = "") -> subprocess.CompletedProcess:
    """``main.py ARGS`` in this process; ``stdin`` the bytes or text piped in (bytes are decoded as
    a pipe's are, so undecodable input reaches the command as it would from a shell)."""
    from mixtral_infer.cli.commands import main

    argv = [str(arg) for arg in args]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    piped = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline="\n")  # as sys.stdin: reconfigure(), \r kept
    out, err = io.StringIO(), io.StringIO()
    saved_stdin = sys.stdin
    sys.stdin = piped
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:  # fire's own exits (FireExit), as the process would end
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    finally:
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(["main.py", *argv], code, out.getvalue(), err.getvalue())
