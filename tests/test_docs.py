"""The documentation's examples run as written, and print what the pages say they print.

Every ```python block of README.md and docs/*.md (not ```python no-run) runs, a page's blocks in
order in one process, from an empty folder. A block states what it prints as comments: a comment
after ``print(...)`` on its line, or comment lines right after the print lines. Each stated line
must be one of the lines the page printed. Figures a command prints are checked where a page
quotes them: the shipped models' perplexity on the held-out verses.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
from command_line import in_process

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


def runnable_blocks(text: str) -> List[str]:
    """The ```python blocks of a page, without those marked ```python no-run."""
    return FENCE.findall(text)


def stated_output(block: str) -> List[str]:
    """The lines a block says it prints.

    >>> stated_output('print(1)  # 1\\nx = 2\\nprint(x)\\nprint(3)\\n# 2\\n# 3\\n')
    ['1', '2', '3']
    """
    stated, after_print = [], False
    for line in block.splitlines():
        code, _, comment = line.partition("  # ")
        if line.startswith("# ") and after_print:
            stated.append(line[2:].strip())
        elif line.startswith("print(") and comment:
            stated.append(comment.strip())
            after_print = True
        else:
            after_print = line.startswith(("print(", "    print("))
    return stated


def test_stated_output_reads_the_convention():
    import doctest

    assert doctest.run_docstring_examples(stated_output, {"stated_output": stated_output}) is None
    assert stated_output("print(1)  # 1\n# 2\n") == ["1", "2"]
    assert stated_output("x = 1  # a remark, not output\n# nor this\n") == []


def pages_with_blocks() -> List[Tuple[str, List[str]]]:
    found = [(page.relative_to(REPO).as_posix(), runnable_blocks(page.read_text())) for page in PAGES]
    return [(name, blocks) for name, blocks in found if blocks]


@pytest.mark.parametrize("name, blocks", pages_with_blocks(), ids=[name for name, _ in pages_with_blocks()])
def test_a_pages_python_runs_and_prints_what_it_says(name, blocks, tmp_path):
    script = "\n\n".join(blocks)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
    printed = {line.strip() for line in result.stdout.splitlines()}
    missing = [line for block in blocks for line in stated_output(block) if line not in printed]
    assert not missing, f"{name} says these are printed, but they are not: {missing}\nprinted:\n{result.stdout}"


def test_there_are_runnable_examples():
    """The README and the architecture page show the API in blocks the test above runs."""
    names = [name for name, _ in pages_with_blocks()]
    assert "README.md" in names and "docs/architecture.md" in names


PERPLEXITY_ROW = re.compile(r"^\| (tiny-mixtral|tiny-mistral) \| ([\d.]+) \|", re.M)


def test_the_quoted_perplexity_is_what_the_command_prints(tmp_path, monkeypatch):
    """docs/quantization.md's table quotes each shipped model's perplexity on the held-out verses,
    as ``python main.py perplexity MODEL --text heldout.txt`` prints it."""
    quoted = dict(PERPLEXITY_ROW.findall((REPO / "docs" / "quantization.md").read_text()))
    assert set(quoted) == {"tiny-mixtral", "tiny-mistral"}
    text = tmp_path / "heldout.txt"
    text.write_text((REPO / "tests" / "data" / "kjv_heldout.txt").read_text().replace("\n", " "))
    monkeypatch.chdir(tmp_path)  # the shipped models by name from anywhere
    for model, figure in quoted.items():
        result = in_process("perplexity", model, "--text", text)
        assert result.returncode == 0, result.stderr
        printed = float(re.search(r"perplexity ([\d.]+) over", result.stdout + result.stderr)[1])
        assert f"{printed:.2f}" == figure, (model, printed, figure)
