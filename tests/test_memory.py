"""The heap kept for prompts' activations (mixtral_infer/memory.py), measured in a fresh process.

Each case runs in a subprocess: the setting is process-wide, and the worker running the other tests
has its own allocation history.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixtral_infer.memory import _LIBC

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, resource, threading, torch
from mixtral_infer import load_model
from mixtral_infer.memory import keep_freed_memory, release_freed_memory

def faults_of_four_steps():  # steps that make and free three 64 MB blocks each, after 8 uncounted ones
    def step():
        a = torch.ones(16 * 2**20)
        b = a * 2
        (a * b).sum()
    for _ in range(8):
        step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

before = faults_of_four_steps()
load_model("tiny-mistral", device="cpu")
after_load = faults_of_four_steps()  # load_model changes no process-wide setting
keep_freed_memory()  # what the command line and the server do
after = faults_of_four_steps()
in_thread = {}  # as the serving engine runs its steps
thread = threading.Thread(target=lambda: in_thread.update(faults=faults_of_four_steps()))
thread.start()
thread.join()
blocks = [torch.ones(16 * 2**20) for _ in range(4)]  # 256 MB at once, then freed
del blocks
kept_mb = resident_mb()
release_freed_memory()
measured = {"before": before, "after_load": after_load, "after": after, "in_thread": in_thread["faults"], "kept_mb": kept_mb}
print(json.dumps({**measured, "released_mb": resident_mb()}))
"""


@pytest.mark.skipif(_LIBC is None, reason="the heap settings are glibc's (Linux)")
def test_a_cpu_model_reuses_freed_blocks_and_release_hands_them_back():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    # glibc's default: every 64 MB block gets fresh pages, a fault per page touched (4 KB pages: 16,384
    # a block; where transparent huge pages are always on, 32)
    assert measured["before"] >= 4 * 3 * 32, measured
    # load_model alone leaves glibc's settings: the blocks still get fresh pages
    assert measured["after_load"] * 2 > measured["before"], measured
    # after keep_freed_memory: the freed blocks are reused, their pages already there (the heap may
    # still grow by a block now and then: 0 or one block's pages of the twelve)
    assert measured["after"] * 4 < measured["before"], measured
    assert measured["in_thread"] * 4 < measured["before"], measured  # a thread's own arena faults them all
    # the 256 MB freed stays resident until release_freed_memory hands it back
    assert measured["kept_mb"] - measured["released_mb"] > 200, measured


def test_load_model_leaves_the_heap_settings_alone(monkeypatch):
    """A library call changes no process-wide setting: only the command line and the server keep
    freed memory (``keep_freed_memory``); loading may still hand freed pages back (``malloc_trim``)."""
    import mixtral_infer.memory as memory
    from mixtral_infer import load_model

    class Libc:
        trimmed = 0

        def mallopt(self, *args):
            raise AssertionError(f"load_model called mallopt{args}")

        def malloc_trim(self, pad):
            Libc.trimmed += 1

    monkeypatch.setattr(memory, "_LIBC", Libc())
    load_model("tiny-mistral", device="cpu", quantize="int8")
    assert Libc.trimmed > 0  # the fake was the one in use
