"""The step compiler: where every fixed-shape step is built, kept and falls back, for ``generate``
(``steps.decode_loop``) and for the serving engine (``serve.engine``).

A step is a pass of the model whose inputs have fixed shapes, of one of a few kinds (``StepKind``),
each made from the model, a ``Tuning`` and the facts fixed when it is built (its ``options``):

* ``DECODE``: one token a row, sampled on the device (``decode_step.make_decode_step``): ``generate``'s;
* ``DECODE_LOGITS``: one token a row, its logits (``decode_step.decode_logits``): the engine's
  decode-only steps, which sample on the host;
* ``MIXED``: a prompt chunk a row beside the decoding rows, their logits (``mixed_step.mixed_logits``);
* ``VERIFY``: k + 1 tokens a row, the logits after each (``mixed_step.verify_logits``): speculative
  decoding's check of a proposer's guesses (``generation.speculative``), the mixed step's pass.

How a step is built: on CPU, the kinds that can be are built by AOTInductor (``cpu_aot_step``: the
kernels torch.compile makes, called from C++ without dynamo's Python), where the tuning asks for it
and the weights allow it (``builds_ahead_of_time``); every other step goes through
``torch.compile(fullgraph=True, dynamic=False)`` (``compiled``): one graph per shape, no guard on data,
on CUDA replayed as a CUDA graph. A CUDA graph writes the cache at the addresses it was captured
with, so the cache's buffers are marked static: a cache at other addresses is captured anew, not
compiled anew.

One fall-back path, taken on a step's first call, which builds it (a step that fails to build has
written nothing):

1. AOTInductor cannot build the step: a line says why, and torch.compile builds it;
2. torch.compile fails with each block as a region (``decode_step.in_regions``; a torch whose regions
   cannot take the step): a line says so, and this compiler writes every block out from then on,
   this step first (a step AOTInductor was tried for goes on to 3: export writes blocks out anyway);
3. the step still fails: the error is raised, and the caller runs the uncompiled step where it may
   (the engine's ``decode="auto"``), or stops.

Built steps are kept by their kind, the shape of their inputs (``shape`` and the cache's buffers),
their options, the tuning and the objects holding the weights (``weights_key``): a step reads the
weights it was built with, so one whose weights were replaced (``quantize_model``, ``unpack_model``)
is built again, and a step built by AOTInductor is checked too (``AotStep.current``: it reads tensors
by place, where dynamo would guard). Steps built by AOTInductor are kept with the model as well
(``built_steps``), so that every compiler on a model (``generate``'s, each engine's) shares them:
a build an earlier run kept on disk (``cpu_aot_step.BuildCache``) is found by the step's signature
without an export (``AotStep.kept``), or else by its exported graph.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import nn

from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.model.cache import RotatingBufferCache, layer_cache_sizes
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.steps.cpu_aot_step import CPU_INDUCTOR_OPTIONS, AotStep, builds_ahead_of_time
from mixtral_infer.steps.decode_step import decode_logits, make_decode_step
from mixtral_infer.steps.mixed_step import chunk_rows, mixed_logits, verify_logits
from mixtral_infer.tuning import Tuning


@dataclass(frozen=True)
class StepKind:
    """A kind of step: ``make(model, tuning, *options)`` gives the step as a plain function, which
    the compiler builds; ``ahead_of_time``: built by AOTInductor on CPU where it can be (its inputs
    are tensors and sequences of them)."""

    name: str
    make: Callable[..., Callable[..., object]]
    ahead_of_time: bool


def _decode(model: Transformer, tuning: Tuning, greedy: bool, filtered: bool, eos_id: Optional[int], shaped: bool):
    return make_decode_step(model, greedy, filtered, eos_id, tuning, shaped)


def _decode_logits(model: Transformer, tuning: Tuning, grouped_moe: bool):
    def decode_step(cache_k, cache_v, tokens, positions, alive):  # logits (R, V)
        return decode_logits(model, cache_k, cache_v, tokens, positions, alive, grouped_moe, tuning)

    return decode_step


def _mixed(model: Transformer, tuning: Tuning, grouped_moe: bool):
    def mixed_step(cache_k, cache_v, tokens, positions, alive, chunk):  # logits (R + K, V)
        return mixed_logits(model, cache_k, cache_v, tokens, positions, alive, chunk, grouped_moe, tuning)

    return mixed_step


def _verify(model: Transformer, tuning: Tuning, grouped_moe: bool):
    def verify_step(cache_k, cache_v, positions, chunk):  # logits (C, V)
        return verify_logits(model, cache_k, cache_v, positions, chunk, grouped_moe, tuning)

    return verify_step


DECODE = StepKind("decode", _decode, ahead_of_time=True)  # options: greedy, filtered, eos_id, shaped
DECODE_LOGITS = StepKind("decode logits", _decode_logits, ahead_of_time=True)  # options: grouped_moe
MIXED = StepKind("mixed", _mixed, ahead_of_time=False)  # options: grouped_moe; the chunk is a dataclass
VERIFY = StepKind("verify", _verify, ahead_of_time=False)  # options: grouped_moe; k + 1 tokens a row, every one's logits


def _with_adapters(kind: StepKind, token_adapters: Callable[..., torch.Tensor]) -> StepKind:
    """``kind``'s step with one input more, last: each cache row's adapter ``(R,)`` long (0: none), for a
    model whose adapters are kept apart (``formats.adapters``). ``token_adapters(row_adapters, *inputs)``
    gives each token of the pass its row's, in the order the step lays its tokens out. Built by
    torch.compile (AOTInductor would keep the selection a constant)."""

    def make(model: Transformer, tuning: Tuning, *options):
        step = kind.make(model, tuning, *options)

        def adapted_step(*inputs):
            *inputs, row_adapters = inputs
            model.adapters.ids = token_adapters(row_adapters, *inputs)  # (N,): what every AdaptedLinear reads
            out = step(*inputs)
            model.adapters.ids = None
            return out

        return adapted_step

    return StepKind(kind.name + ", adapters", make, ahead_of_time=False)


# The tokens of each step, in its order: the rows' (R, in the verify step none alive); then the chunk's
# (C), each its segment's row.
ADAPTED = {
    DECODE_LOGITS: _with_adapters(DECODE_LOGITS, lambda rows, k, v, tokens, positions, alive: rows),
    MIXED: _with_adapters(MIXED, lambda rows, k, v, tokens, positions, alive, chunk: torch.cat([rows, rows[chunk_rows(chunk)]])),
    VERIFY: _with_adapters(VERIFY, lambda rows, k, v, positions, chunk: torch.cat([rows, rows[chunk_rows(chunk)]])),
}


class StepCompiler:
    """The compiled steps of one model (module docstring), and the cache ``generate``'s decode into.

    ``announce``: where the compiler says it builds a step and how long that took (None: stderr);
    ``warn``: where it says why it fell back (None: ``announce``). ``tuning``: how the steps are
    built (None: the model's when a step is built, ``formats.modules.tuning_of``); a step is kept per
    tuning too. ``written_out``: a step failed to compile with regions, so this compiler builds every
    block written out.
    """

    def __init__(
        self,
        model: Transformer,
        announce: Optional[Callable[[str], None]] = None,
        tuning: Optional[Tuning] = None,
        warn: Optional[Callable[[str], None]] = None,
    ):
        self.model = model
        self.announce = announce if announce is not None else lambda message: print(message, file=sys.stderr)
        self.warn = warn
        self.tuning = tuning
        self.steps: Dict[tuple, Callable] = {}
        self.building: Dict[tuple, "BackgroundBuild"] = {}  # steps built in child processes now (build_in_background)
        self.cache: Optional[RotatingBufferCache] = None
        self.compile_seconds = 0.0  # spent building steps so far: what a tokens/s figure should leave out
        self.written_out = False

    def __deepcopy__(self, memo) -> "StepCompiler":
        """A copy builds its own steps: these read the weights of the model they were built for
        (a deep copy of a model that keeps its compiler, ``decode_loop.step_compiler``, gets an empty one)."""
        return StepCompiler(copy.deepcopy(self.model, memo), self.announce, self.tuning, self.warn)

    def __reduce__(self):
        return (type(None), ())  # pickled with a model (torch.save), it comes back as None: no steps

    def cache_for(self, batch: int, max_seqlen: int) -> RotatingBufferCache:
        """A cache of ``batch`` rows for sequences of up to ``max_seqlen`` tokens, reused when it fits.

        The number of slots is rounded up to a power of two (at least 128, at most the window),
        so a few shapes cover every call: each shape is one compilation, and decoding over a
        buffer at most twice the sequence reads at most twice the keys it needs. Reused, its
        buffers stay where a CUDA graph captured them, as a static cache does in transformers.
        """
        slots = slot_bucket(max_seqlen, None)  # each windowed layer's buffer is capped at its window
        cache = self.cache
        sizes = tuple(layer_cache_sizes(self.model.layer_windows, slots))
        wanted = (batch, sizes, self.model.dtype, self.model.device)  # a model cast or moved since: a new one
        if cache is None or buffer_shape(cache) != wanted:
            self.cache = cache = None  # free the old buffers before making the new ones
            cache = self.model.make_cache(batch, max_seqlen=slots)
            self.cache = cache
        cache.start_sequences(batch)
        return cache

    def tuning_now(self) -> Tuning:
        """The tuning steps are built with now: ``tuning`` (or the model's), blocks written out once
        regions failed."""
        tuning = self.tuning if self.tuning is not None else tuning_of(self.model)
        return replace(tuning, regions=False) if self.written_out and tuning.regions else tuning

    def step(self, kind: StepKind, cache: RotatingBufferCache, options: tuple = (), shape: tuple = ()) -> Callable:
        """The step of ``kind`` with ``options`` over ``cache`` (its layers' buffers are the step's first
        two inputs), the rest of its inputs' shapes fixed by ``shape`` (its first item: the rows fed):
        the one built before, or one that builds itself on its first call."""
        if cache.device.type == "cuda":
            # The graph writes the cache in place at the addresses it was captured with.
            for buffer in (*cache.layer_keys, *cache.layer_values):
                torch._dynamo.mark_static_address(buffer)
        tuning = self.tuning_now()
        key = self._key(kind, cache, options, shape, tuning)
        stores = [self.steps] + ([built_steps(self.model)] if kind.ahead_of_time else [])
        for store in stores:
            for stale in [k for k in store if k[:-1] == key[:-1] and k[-1] != key[-1]]:
                del store[stale]  # built for weights since replaced (quantized, unpacked): it would read them
        built = next((store[key] for store in stores if key in store), None)
        if isinstance(built, AotStep) and not built.current():  # a weight was replaced since: it would read the old one
            for store in stores:
                store.pop(key, None)
            built = None
        if built is not None:
            self.steps[key] = built
            return built
        return self._built_on_first_call(kind, cache, options, shape, tuning)

    def build_in_background(
        self, kind: StepKind, cache: RotatingBufferCache, options: tuple, shape: tuple, args: Sequence
    ) -> Optional["BackgroundBuild"]:
        """Build the step of ``kind`` for ``args``' shapes (``step``'s arguments) by AOTInductor in a
        child process, without calling it; or None where it is built already or cannot be built so
        (not on CPU or not on Linux, ``Tuning.ahead_of_time`` off, weights AOTInductor cannot be handed,
        the build cache switched off), or while another build runs.

        The child is a fork of this process: it reads the model's weights where they are (copied on
        write; nothing writes them), exports and builds the step on this process's threads, and keeps
        the build on disk (``cpu_aot_step.BuildCache``), while this process decodes. A thread could not:
        export and AOTInductor's lowering set torch's is-compiling flag and wrap every module call for
        the whole process while they trace, which an eager pass on another thread runs into. The child
        runs in a process group of its own (Ctrl-C at the terminal is the parent's) at the lowest
        priority (``lowest_priority``: it takes the cores the eager loop leaves idle, which on a machine
        whose every core the loop uses may be none until this process ends),
        writes its output to a log file (``BackgroundBuild.log``), and is reaped by a thread of this
        process; one that outlives this process finishes its build for the next run. Once it is done,
        ``BackgroundBuild.step()`` loads the build here. A build an earlier run kept for this step
        (found by its signature, ``AotStep.kept``) is loaded here instead, before the first token:
        then no child, and None."""
        tuning = self.tuning_now()
        key = self._key(kind, cache, options, shape, tuning)
        if key in self.building:  # an earlier call's build, still under way
            return self.building[key]
        built = self.step(kind, cache, options, shape)
        if not hasattr(built, "__wrapped_first_call__"):
            return None  # built already
        ahead = cache.device.type == "cpu" and kind.ahead_of_time and tuning.ahead_of_time and builds_ahead_of_time(self.model)
        if not ahead or not hasattr(os, "fork") or torch._inductor.config.force_disable_caches:
            return None
        rows = f"batch {shape[0]}, " if shape else ""
        loading = time.perf_counter()
        try:
            kept = AotStep.kept(self.model, kind.make(self.model, tuning, *options), args, known_as(kind, options, tuning))
        except Exception:  # a kept build that does not load here: built again in the child
            kept = None
        if kept is not None:  # an earlier run's build: decode with it from the first token
            self.steps[key] = built_steps(self.model)[key] = kept
            seconds = time.perf_counter() - loading
            self.compile_seconds += seconds
            self.announce(f"the {kind.name} step for {rows}{slots_text(cache)} cache slots was compiled by an earlier run "
                          f"(loaded in {seconds:.1f}s)")  # fmt: skip
            return None
        if any(not b.done() for b in self.building.values()):
            return None
        log = os.path.join(tempfile.gettempdir(), f"mixtral_infer_build_{os.getpid()}_{len(self.building)}.log")
        self.announce(f"compiling the {kind.name} step for {rows}{slots_text(cache)} cache slots in the background "
                      "(once per shape); decoding eagerly meanwhile")  # fmt: skip
        sys.stdout.flush(), sys.stderr.flush()  # the child writes none of what is buffered
        pid = os.fork()
        if pid == 0:  # the child: build, keep on disk, exit without running the parent's exit handlers
            code = 1
            try:
                os.setpgid(0, 0)
                lowest_priority()  # the eager loop's cores stay its own
                output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(output, 1), os.dup2(output, 2)  # and a pipe the parent writes to is not held open
                # Python's streams too: a notebook's are sockets served by threads a fork does not copy.
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                AotStep(self.model, kind.make(self.model, tuning, *options), args, known_as=known_as(kind, options, tuning))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        build = BackgroundBuild(self, kind, options, shape, tuning, args, key, pid, log)
        self.building[key] = build
        return build

    def _key(self, kind: StepKind, cache: RotatingBufferCache, options: tuple, shape: tuple, tuning: Tuning) -> tuple:
        return (kind.name, *shape, *buffer_shape(cache), *options, tuning, weights_key(self.model))

    def _built_on_first_call(self, kind: StepKind, cache: RotatingBufferCache, options: tuple, shape: tuple, tuning: Tuning):
        built: Optional[Callable] = None

        def first_call(*args):
            """Build the step for these arguments' shapes, saying so, then call it."""
            nonlocal built
            if built is not None:
                return built(*args)
            rows = f"batch {shape[0]}, " if shape else ""
            self.announce(f"compiling the {kind.name} step for {rows}{slots_text(cache)} cache slots (once per shape)...")
            start = time.perf_counter()
            outputs, built = self._build_and_call(kind, cache, options, shape, tuning, args)
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            kept = isinstance(built, AotStep) and built.loaded  # built by an earlier run (cpu_aot_step.BuildCache)
            self.announce(f"compiled in {seconds:.1f}s" + (" (kept from an earlier build)" if kept else ""))
            return outputs

        first_call.__wrapped_first_call__ = True  # not built yet (build_in_background asks)
        return first_call

    def _build_and_call(self, kind: StepKind, cache: RotatingBufferCache, options: tuple, shape: tuple, tuning: Tuning, args):
        """``(outputs, built)``: the step built (module docstring, the fall-back path), called on ``args``
        and kept once it ran."""
        device = cache.device
        step = kind.make(self.model, tuning, *options)
        ahead = device.type == "cpu" and kind.ahead_of_time and tuning.ahead_of_time and builds_ahead_of_time(self.model)
        named = known_as(kind, options, tuning)
        built = built_ahead_of_time(self.model, step, args, self._warn, named) if ahead else None
        if built is None:
            built = compiled(step, device)
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
            try:
                outputs = built(*args)  # torch.compile's step compiles here
            except Exception as reason:  # before the step ran: nothing written
                if ahead or not tuning.regions:
                    raise
                self._warn(regions_failed(reason))
                self.written_out = True
                tuning = self.tuning_now()
                built = compiled(kind.make(self.model, tuning, *options), device)
                outputs = built(*args)
        key = self._key(kind, cache, options, shape, tuning)
        self.steps[key] = built
        if isinstance(built, AotStep):
            built_steps(self.model)[key] = built
        return outputs, built

    def _warn(self, message: str) -> None:
        (self.warn if self.warn is not None else self.announce)(message)


class BackgroundBuild:
    """A step being built in a child process (``StepCompiler.build_in_background``). It keeps the
    shapes of the step's arguments, not the tensors (a cache replaced since is freed)."""

    def __init__(self, compiler: "StepCompiler", kind: StepKind, options: tuple, shape: tuple, tuning: Tuning,
                 args: Sequence, key: tuple, pid: int, log: str):  # fmt: skip
        self.compiler, self.kind, self.options, self.shape, self.tuning = compiler, kind, options, shape, tuning
        self.layouts = _layouts(args)
        self.key, self.pid, self.log = key, pid, log
        self.start = time.perf_counter()
        self.exit_code: Optional[int] = None
        self.built: Optional[AotStep] = None
        self.failed = False
        self.ended = threading.Event()
        threading.Thread(target=self._reap, name="mixtral_infer build waiter", daemon=True).start()

    def _reap(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        self.exit_code = os.waitstatus_to_exitcode(status)
        self.ended.set()

    def done(self) -> bool:
        """Whether the child has ended."""
        return self.ended.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the child; whether it has ended."""
        return self.ended.wait(timeout)

    def step(self) -> Optional[AotStep]:
        """The built step, loaded here from the child's build once the child is done (kept with the
        compiler and the model as ``step`` keeps steps); None while it runs, or where it failed (one
        line says so and where the child's output is)."""
        if self.built is not None or self.failed or not self.done():
            return self.built
        self.compiler.building.pop(self.key, None)
        loading = time.perf_counter()
        try:
            if self.exit_code != 0:
                raise RuntimeError(f"the child ended with exit code {self.exit_code}")
            make = self.kind.make(self.compiler.model, self.tuning, *self.options)
            examples, named = _examples(self.layouts), known_as(self.kind, self.options, self.tuning)
            step = AotStep.kept(self.compiler.model, make, examples, named)
            if step is None:  # not found by its signature (a tensor not where it was noted): by an export
                step = AotStep(self.compiler.model, make, examples, kept_only=True)
        except Exception as reason:  # its build failed, was cut short (a signal), or is not on disk
            self.failed = True
            self.compiler._warn(f"the background build of the {self.kind.name} step did not finish ({one_line(reason)}; "
                                f"its output: {self.log}); decoding on without it")  # fmt: skip
            return None
        os.unlink(self.log) if os.path.exists(self.log) else None
        self.compiler.steps[self.key] = step
        built_steps(self.compiler.model)[self.key] = step
        now = time.perf_counter()
        self.compiler.compile_seconds += now - loading  # decoding waited for this part only
        self.compiler.announce(f"compiled in the background in {now - self.start:.1f}s (loaded here in "
                               f"{now - loading:.1f}s); decoding with it now")  # fmt: skip
        self.built = step
        return step


def _layouts(args):
    """The shapes, strides, dtypes and devices of a step's arguments (tensors, sequences of them, None)."""
    if isinstance(args, torch.Tensor):
        return ("tensor", tuple(args.shape), args.stride(), args.dtype, args.device)
    if isinstance(args, (list, tuple)):
        return ("sequence", type(args), [_layouts(arg) for arg in args])
    return ("value", args)


def _examples(layouts):
    """Arguments of those layouts (``_layouts``), their memory untouched: what a build is found by."""
    if layouts[0] == "sequence":
        return layouts[1](_examples(layout) for layout in layouts[2])
    if layouts[0] == "tensor":
        _, shape, stride, dtype, device = layouts
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return layouts[1]


class BuiltSteps(dict):
    """Steps by their keys, kept with a model; a copy of the model starts with none (they read the
    weights of the model they were built for), and so does a model saved and loaded again."""

    def __deepcopy__(self, memo) -> "BuiltSteps":
        return BuiltSteps()

    def __reduce__(self):
        return (BuiltSteps, ())


def built_steps(model: Transformer) -> Dict[tuple, Callable]:
    """The steps AOTInductor has built for ``model``, kept with it for every compiler on it."""
    return model.__dict__.setdefault("_built_steps", BuiltSteps())


def weights_key(model: nn.Module) -> tuple:
    """What a built step assumes of ``model``'s weights: the objects that hold them. Replacing a
    weight (``quantize_model``, ``unpack_model``, a new ``nn.Parameter``) changes it; editing one in
    place (which a step reads at once) does not."""
    return tuple(id(module) for module in model.modules()) + tuple(id(param) for param in model.parameters())


def compiled(step: Callable, device: torch.device) -> Callable:
    """``step`` through ``torch.compile`` for ``device``: on CUDA replayed as a CUDA graph, its
    products tuned by coordinate descent (what reads the weights at the bandwidth, as in gpt-fast);
    on CPU with the package's inductor options."""
    cuda = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    options = cuda if device.type == "cuda" else CPU_INDUCTOR_OPTIONS
    return torch.compile(step, fullgraph=True, dynamic=False, options=options)


def lowest_priority() -> None:
    """Run this process on the cores nothing else wants now (Linux's ``SCHED_IDLE``: any other task
    that wakes takes the core at once), or where that policy is missing at the lowest niceness."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def known_as(kind: StepKind, options: tuple, tuning: Tuning) -> tuple:
    """What makes a step of ``kind`` what it is beside the model and its arguments: what its build is
    found again by, without an export (``AotStep.kept``)."""
    return (kind.name, *options, tuning)


def built_ahead_of_time(model: Transformer, step: Callable, args: Sequence, warn: Callable[[str], None],
                        named: Optional[tuple] = None) -> Optional[AotStep]:  # fmt: skip
    """``step`` (a fixed-shape step of ``model`` on CPU) built by AOTInductor for the shapes of
    ``args`` (``cpu_aot_step``), or None where the build failed, which ``warn`` is told in a line.
    ``named``: the step's ``known_as``, by which an earlier run's build is found without an export."""
    try:
        kept = AotStep.kept(model, step, args, named) if named is not None else None
        return kept if kept is not None else AotStep(model, step, args, known_as=named)
    except Exception as reason:  # NotAheadOfTime, or an op export or AOTInductor cannot take
        warn(f"AOTInductor cannot build this step ({one_line(reason)}); using torch.compile")
        return None


def regions_failed(reason: Exception) -> str:
    """The line said when a step with each block as a region fails to compile, before it is compiled
    with every block written out."""
    return f"compiling each block as a region failed ({one_line(reason)}); writing blocks out"


def one_line(reason: Exception) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first_line = (str(reason).strip().splitlines() or [""])[0][:200]
    return f"{type(reason).__name__}: {first_line}"


def buffer_shape(cache: RotatingBufferCache) -> tuple:
    """``(rows, each layer's slots, dtype, device)`` of a cache's buffers: what a step compiled for it assumes."""
    return cache.max_batch_size, tuple(cache.layer_sizes), cache.dtype, cache.device


def slots_text(cache: RotatingBufferCache) -> str:
    """A cache's slots per sequence, each kind's: ``"128"``, or ``"512/128"`` (full-attention and windowed layers)."""
    return "/".join(str(kind.size) for kind in cache.kinds)


def slot_bucket(max_seqlen: int, window: Optional[int]) -> int:
    """Cache slots for sequences of up to ``max_seqlen`` tokens: the next power of two (at least
    128), capped at the sliding window. ``slot_bucket(300, 4096) == 512``, ``slot_bucket(5000, 4096) == 4096``."""
    slots = 128
    while slots < max_seqlen:
        slots *= 2
    return min(slots, window) if window is not None else slots
