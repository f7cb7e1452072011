"""Where a compiled CPU decode step's time goes apart from its generated C++ kernels.

    python bench/step_overhead.py FOLDER [--dtype bfloat16] [--quantize int8] [--rounds 7] [--aoti]
    python bench/step_overhead.py --tiny mistral-bench            # weights almost free

Times ``generate(..., decode="compiled")`` at batch 1 (127 steps after a 64-token prompt), and
inside it the compiled graph's call (``CompiledFxGraph.__call__``: inductor's Python wrapper,
which allocates the step's intermediate buffers and checks its inputs' sizes, then calls the
kernels) and the generated C++ kernels themselves. So a step splits into

* ``kernels_ms``: the C++ loops (the weight products, attention, norms, sampling);
* ``wrapper_ms``: graph call minus kernels (about 200 buffer allocations and 80 size checks a step
  at mistral-bench's 8 layers);
* ``outside_ms``: step minus graph call (dynamo's frame hook and guards, AOTAutograd's wrapper, the
  decode loop's own Python).

The split is of torch.compile's step. ``--aoti`` then times whole decode loops with the step the
package builds on CPU, by AOTInductor (``steps/cpu_aot_step.py``: the same kernels, a C++ wrapper,
no dynamo), against torch.compile's, alternating in one process (``aoti_step_ms``,
``compile_step_ms``).
``--tiny SHAPE`` runs a copy of a bench shape with dim 64 (same layers, heads, window), whose
step is almost only that fixed cost.

Prints one JSON line of medians (ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_transformers as b  # noqa: E402
from bench_decode_modes import decode_seconds  # noqa: E402
from profile_decode import tiny_copy  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.formats.modules import tuning_of  # noqa: E402
from mixtral_infer.steps.decode_loop import step_compiler  # noqa: E402

NEW_TOKENS = 128


class Clock:
    """Seconds spent in the compiled graph's call and in its generated kernels."""

    def __init__(self):
        self.graph = 0.0
        self.kernels = 0.0
        self.kernels_found = 0

    def time_graph_calls(self) -> None:
        from torch._inductor import output_code

        call = output_code.CompiledFxGraph.__call__

        def timed(graph, inputs):
            start = time.perf_counter()
            result = call(graph, inputs)
            self.graph += time.perf_counter() - start
            return result

        output_code.CompiledFxGraph.__call__ = timed

    def time_kernels(self) -> None:
        """Wrap the ``cpp_fused_*`` functions of every loaded inductor module (after compiling)."""
        for module in list(sys.modules.values()):
            if "torchinductor" not in str(getattr(module, "__file__", "")) or not hasattr(module, "Runner"):
                continue
            for name, kernel in list(vars(module).items()):
                if name.startswith("cpp_fused") and callable(kernel):
                    setattr(module, name, self._timed(kernel))
                    self.kernels_found += 1

    def _timed(self, kernel):
        def timed(*args):
            start = time.perf_counter()
            result = kernel(*args)
            self.kernels += time.perf_counter() - start
            return result

        return timed


def split_step(model, rounds: int) -> Dict[str, float]:
    """The step as torch.compile builds it (on CPU the package builds it with AOTInductor, whose
    wrapper is C++: nothing of it to time from Python)."""
    step_compiler(model).tuning = dataclasses.replace(tuning_of(model), ahead_of_time=False)
    clock = Clock()
    clock.time_graph_calls()
    prompts = b.random_prompts(1, 64, model.args.vocab_size, seed=1)
    decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # compiles
    clock.time_kernels()
    steps, graph, kernels = [], [], []
    for _ in range(rounds):
        clock.graph = clock.kernels = 0.0
        steps.append(decode_seconds(model, prompts, "compiled", NEW_TOKENS) / (NEW_TOKENS - 1) * 1e3)
        graph.append(clock.graph / (NEW_TOKENS - 1) * 1e3)
        kernels.append(clock.kernels / (NEW_TOKENS - 1) * 1e3)
    step, graph_ms, kernels_ms = (statistics.median(v) for v in (steps, graph, kernels))
    out = {"step_ms": step, "outside_ms": step - graph_ms}
    out.update(wrapper_ms=graph_ms - kernels_ms, kernels_ms=kernels_ms)
    if clock.kernels_found == 0:  # another torch's inductor: only the step and the graph call are known
        out.update(wrapper_ms=None, kernels_ms=None, graph_ms=graph_ms)
    return out


def aot_against_compile(model, rounds: int) -> Dict[str, float]:
    """Whole decode loops (``generate``), the step built by AOTInductor against torch.compile's,
    alternating in one process."""
    prompts = b.random_prompts(1, 64, model.args.vocab_size, seed=1)
    compiler = step_compiler(model)
    ways = {"aoti": True, "compile": False}
    steps: Dict[str, Dict] = {}
    for name, ahead in ways.items():  # build both (the split above built torch.compile's already)
        compiler.tuning = dataclasses.replace(tuning_of(model), ahead_of_time=ahead)
        compiler.steps.clear()
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)
        steps[name] = {"steps": dict(compiler.steps), "build_s": time.perf_counter() - start}
    times: Dict[str, List[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, ahead in ways.items():
            compiler.tuning = dataclasses.replace(tuning_of(model), ahead_of_time=ahead)
            compiler.steps = dict(steps[name]["steps"])
            times[name].append(decode_seconds(model, prompts, "compiled", NEW_TOKENS) / (NEW_TOKENS - 1) * 1e3)
    compiler.tuning = None
    kinds = [type(step).__name__ for step in steps["aoti"]["steps"].values()]
    medians = {f"{name}_step_ms": statistics.median(ms) for name, ms in times.items()}
    return {"aoti_built": kinds == ["AotStep"], "aoti_build_s": steps["aoti"]["build_s"], **medians}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", default=None)
    parser.add_argument("--tiny", default=None, choices=list(b.MODELS), help="a dim-64 copy of this bench shape")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantize", default=None, help="int8, int4 or w8a8 (a model folder only)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--aoti", action="store_true")
    options = parser.parse_args(argv)
    if (options.folder is None) == (options.tiny is None):
        parser.error("give a model folder or --tiny SHAPE")
    if options.tiny is not None and options.quantize is not None:
        parser.error("--quantize needs a model folder")
    dtype = getattr(torch, options.dtype)
    if options.tiny is not None:
        torch.manual_seed(0)
        model = b.ours_alone(tiny_copy(b.bench_args(options.tiny, max_batch_size=1))).to(dtype)
    else:
        model = load_model(
            options.folder, max_batch_size=1, device="cpu", dtype=dtype, quantize=options.quantize, pack="columns"
        )
    result = {"model": options.tiny or options.folder, "dtype": options.dtype, "quantize": options.quantize}
    result.update(torch=torch.__version__, threads=torch.get_num_threads(), **split_step(model, options.rounds))
    if options.aoti:
        result.update(aot_against_compile(model, options.rounds))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
