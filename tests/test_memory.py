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
from mixtral_infer.memory import release_freed_memory

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
after = faults_of_four_steps()
in_thread = {}  # as the serving engine runs its steps
thread = threading.Thread(target=lambda: in_thread.update(faults=faults_of_four_steps()))
thread.start()
thread.join()
blocks = [torch.ones(16 * 2**20) for _ in range(4)]  # 256 MB at once, then freed
del blocks
kept_mb = resident_mb()
release_freed_memory()
measured = {"before": before, "after": after, "in_thread": in_thread["faults"], "kept_mb": kept_mb}
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
    # after load_model: the freed blocks are reused, their pages already there (the heap may still
    # grow by a block now and then: measured 0 or one block's pages of the twelve)
    assert measured["after"] * 4 < measured["before"], measured
    assert measured["in_thread"] * 4 < measured["before"], measured  # a thread's own arena faults them all
    # the 256 MB freed stays resident until release_freed_memory hands it back
    assert measured["kept_mb"] - measured["released_mb"] > 200, measured
