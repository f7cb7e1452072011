"""The CPU decode step built ahead of time by AOTInductor: torch.compile's kernels, no Python per step.

A step compiled by ``torch.compile`` runs Python on every call: dynamo's frame hook and guards,
AOTAutograd's wrapper, and inductor's Python wrapper, which allocates the step's intermediate
buffers (hundreds of them) and checks its inputs' sizes before it calls the one C++ kernel the step
fuses into: on a small model, a good part of the step.

Here the same ``decode_one_token`` is exported (``torch.export``, non-strict: Python runs it once
on fake tensors with ``torch.compiler.is_compiling()`` true, so it takes the forms written for
compiled code) and AOTInductor builds it into a shared library whose wrapper is C++. The weights
are not copied into it: the runner is handed the model's own tensors (``user_managed``), so it reads
them where they are, and a weight edited in place is seen. A weight *replaced* (``quantize_model``,
``unpack_model``, assigning a new parameter) is not, and nothing guards against it as dynamo would:
``current()`` checks that every tensor the library reads is still the one at its place in the model,
and the step compiler builds the step anew when one is not.

Worked example: the library of an int8 model reads ``model.layers.0.attention.wq.weight.values``
(the integers) and ``model.layers.0.attention.wq.weight.scales``, and a float model's reads
``model.output.weight``. ``model.output.weight.neg_()`` changes what the next step reads, with no
build; ``model.output.weight = nn.Parameter(...)`` makes ``current()`` False, and the next
``generate`` builds the step again rather than read the old tensor (``tests/test_cpu_aot_step.py``).

AOTInductor may add constants of its own while it lowers the step: int4's product is lowered to
a call that takes the group size as a one-value tensor (``torch.tensor(32)``). They are not the
model's and, with the weights left out of the library, not in it either: the build records them
as inductor makes them (``_scalar_constants_recorded``) and hands them over with the weights.
Not every step can be handed its weights: for w8a8 weights AOTInductor makes constants of its own
from them (fbgemm's packed matrices), which are not the model's tensors, and weights in oneDNN's
layout (``pack_model``) are read by handle. Those steps stay on ``torch.compile``
(``builds_ahead_of_time``; a build that makes other constants of its own raises ``NotAheadOfTime``).

AOTInductor keeps nothing between builds (torch.compile's graph cache does not serve it), so each
build is kept on disk (``BuildCache``), where inductor keeps its own: under ``TORCHINDUCTOR_CACHE_DIR``
(default ``/tmp/torchinductor_<user>``), folder ``mixtral_infer_aot``. A build is found again by
its exported graph (every op, every value's shape, strides and dtype: the weights are read, not
built in), the torch and package versions and the CPU; so another run, or another model of the same
shapes, loads it in the time of the export instead of a build's. ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
switches it off, as inductor's.

An export takes seconds on a small model and more on a large one, so a build is also noted by the
step's *signature* (``step_signature``): a digest of what its graph is made from that is read off the
model without tracing it (the package's source, the versions, the CPU, the step's kind, options and
tuning, the arguments' layouts, every module's class and attributes and every tensor's layout). A
second start finds its build by that and hands it the model's tensors (``AotStep.kept``), checking
each is at its noted place with its noted layout; where none is noted, or one is not, the export
finds it by its graph as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from mixtral_infer._version import __version__
from mixtral_infer.formats.packing import is_packed
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.quant.model import model_scheme


def builds_ahead_of_time(model: Transformer) -> bool:
    """False for w8a8 weights, whose packed matrices AOTInductor would make constants of (module
    docstring), and for weights in oneDNN's layout (``cpu_packed``), which the step reads by a
    handle, an integer the library would keep after the weight is gone: their steps go to
    ``torch.compile`` (whose guards see a new handle) without a build tried first."""
    if is_packed(model):
        return False
    scheme = model_scheme(model)
    return scheme is None or scheme.activations is None


class NotAheadOfTime(Exception):
    """This step cannot be built by AOTInductor reading the model's own tensors."""


class _StepModule(torch.nn.Module):
    """``decode_one_token`` as a module holding the model, so that export names its tensors by
    their places in the model (``model.layers.0.attention.wq.weight``)."""

    def __init__(self, model: Transformer, decode_one_token: Callable[..., Tuple[torch.Tensor, ...]]):
        super().__init__()
        self.model = model
        self.decode_one_token = decode_one_token

    def forward(self, *args):
        return self.decode_one_token(*args)


# Inductor's options for every step compiled on CPU (by AOTInductor here, by torch.compile where it
# cannot). A multiply and the add after it are one fused multiply-add (gcc's ``-ffp-contract=fast``;
# inductor's default, ``off``, keeps them two instructions, each rounded): fewer instructions a
# weight in the decode loops' multiply-and-sums, which widen each 16-bit or int8 weight before they
# multiply, and one rounding where there were two.
CPU_INDUCTOR_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}


def inductor_configs() -> Dict[str, object]:
    """AOTInductor's options for a build: ``CPU_INDUCTOR_OPTIONS`` as they are now, and the weights
    handed over at load, not built into the library."""
    return {**CPU_INDUCTOR_OPTIONS, "aot_inductor.package_constants_in_so": False}


class AotStep:
    """A decode step of ``model`` (``decode_step.make_decode_step``'s, or ``decode_logits`` bound to it:
    ``compiler.StepKind``) built by AOTInductor for the shapes of ``args``, its first call's
    arguments, or loaded from the build cache (``loaded``: whether it was; ``kept_only``: only that).

    Called as the step is, e.g. ``step(cache_k, cache_v, tokens, positions, alive, uniform,
    temperature, top_p, top_k)``, the cache as its layers' buffers (``RotatingBufferCache.layer_keys``);
    writes the cache in place, returns fresh output tensors."""

    def __init__(self, model: Transformer, decode_one_token: Callable[..., Tuple[torch.Tensor, ...]], args: Sequence,
                 kept_only: bool = False, known_as: Optional[tuple] = None):  # fmt: skip
        """``known_as``: what the caller knows makes ``decode_one_token`` what it is (the step's kind,
        options and tuning), so that the build is found again by its signature (``step_signature``),
        without an export, by ``AotStep.kept``; None: found by its exported graph only."""
        self.module = _StepModule(model, decode_one_token)
        # Export traces on fake tensors: plain tensors of the arguments' shapes (the caller's may be
        # inference tensors, which export may not write); empty_strided touches no memory.
        with torch.inference_mode(False), torch.no_grad():
            examples = tuple(_plain_like(arg) for arg in args)
            exported = torch.export.export(self.module, examples, strict=False)
            tensors = {**exported.state_dict, **exported.constants}
            cache = BuildCache.for_graph(exported)
            kept = cache.load() if cache is not None else None
            self.loaded = kept is not None
            if kept is None and kept_only:  # a background build that should be on disk is not
                raise NotAheadOfTime("no build of this step is kept on disk")
            runner, scalars = kept if kept is not None else _build(exported, tensors, cache)
        self._ready(runner, scalars, tensors)
        if cache is not None and known_as is not None and self.current():  # each read at its place in the model
            cache.remember(step_signature(self.module, args, known_as), self.constants)

    @classmethod
    def kept(cls, model: Transformer, decode_one_token: Callable[..., Tuple[torch.Tensor, ...]], args: Sequence,
             known_as: tuple) -> Optional["AotStep"]:  # fmt: skip
        """The step an earlier run built and kept (``BuildCache``) for this model, ``known_as`` and
        ``args``' layouts, found by its signature (``step_signature``) and loaded without an export:
        a second start decodes compiled from its first token. None where none is kept, caches are
        switched off, or a tensor the build reads is not at its place in the model with its layout."""
        if torch._inductor.config.force_disable_caches:
            return None
        step = cls.__new__(cls)
        step.module = _StepModule(model, decode_one_token)
        found = BuildCache.by_signature(step_signature(step.module, args, known_as))
        if found is None:
            return None
        cache, layouts = found
        tensors = {name: _at(step.module, name) for name in layouts}
        if any(_layout(tensors[name]) != layout for name, layout in layouts.items()):
            return None  # not this model's weights after all: export and find the build by its graph
        kept = cache.load()
        if kept is None:
            return None
        runner, scalars = kept
        if any(name not in tensors and name not in scalars for name in runner.get_constant_fqns()):
            return None
        step._ready(runner, scalars, tensors)
        step.loaded = True
        return step

    def _ready(self, runner, scalars: Dict[str, torch.Tensor], tensors: Dict[str, torch.Tensor]) -> None:
        """Hand the library the model's tensors it reads (by place) and inductor's scalars."""
        self.runner = runner
        self.scalars = _handed_over(runner, tensors, scalars)  # inductor's (module docstring)
        self.constants: Dict[str, torch.Tensor] = {
            name: tensors[name] for name in runner.get_constant_fqns() if name in tensors
        }
        self.runner.load_constants({**self.constants, **self.scalars}, check_full_update=True, user_managed=True)

    def current(self) -> bool:
        """Whether every tensor the library reads is still the model's tensor at its place."""
        return all(_at(self.module, name) is tensor for name, tensor in self.constants.items())

    def __call__(self, *args):
        return self.runner(*args)  # what decode_one_token returns: a tuple of tensors, or one


def _build(exported: torch.export.ExportedProgram, tensors: Dict[str, torch.Tensor], cache: Optional["BuildCache"]):
    """``(runner, scalars)``: AOTInductor's library of ``exported`` and inductor's one-value constants
    it reads beside the model's ``tensors``; kept in ``cache`` (unless None) once known good."""
    recorded: Dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as folder, _scalar_constants_recorded(recorded):
        package = torch._inductor.aoti_compile_and_package(
            exported, package_path=os.path.join(folder, BuildCache.PACKAGE), inductor_configs=inductor_configs()
        )
        runner = torch._inductor.aoti_load_package(package)
        scalars = _handed_over(runner, tensors, recorded)  # NotAheadOfTime before anything is kept
        if cache is not None:
            cache.save(package, scalars)
    return runner, scalars


def _handed_over(runner, tensors: Dict[str, torch.Tensor], scalars: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The one-value constants of inductor's (of ``scalars``) that the library reads beside the model's
    ``tensors``; ``NotAheadOfTime`` if it reads a constant that is neither (a copy of a weight)."""
    names = runner.get_constant_fqns()
    own = [name for name in names if name not in tensors and name not in scalars]
    if own:
        raise NotAheadOfTime(f"AOTInductor made {len(own)} constants of its own ({own[0]}, ...)")
    return {name: scalars[name] for name in names if name not in tensors}


class BuildCache:
    """Where a step's build is kept between runs (module docstring): a folder named by the step's key,
    holding the package and inductor's one-value constants, written whole or not at all."""

    FOLDER = "mixtral_infer_aot"
    PACKAGE = "decode_step.pt2"
    SCALARS = "scalars.pt"
    SIGNATURES = "signatures"  # a build by a step's signature (``remember``)

    def __init__(self, folder: str):
        self.folder = folder

    @classmethod
    def for_graph(cls, exported: torch.export.ExportedProgram) -> Optional["BuildCache"]:
        """The cache entry of this exported step, or None where caches are switched off."""
        if torch._inductor.config.force_disable_caches:
            return None
        return cls(os.path.join(cls.root(), build_key(exported)))

    @classmethod
    def root(cls) -> str:
        """The folder of every kept build: beside inductor's own cache."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return os.path.join(cache_dir(), cls.FOLDER)

    def load(self) -> Optional[Tuple[object, Dict[str, torch.Tensor]]]:
        """``(runner, scalars)`` of the kept build, or None (none kept; one that does not load is removed)."""
        package = os.path.join(self.folder, self.PACKAGE)
        if not os.path.isfile(package):
            return None
        try:
            scalars = torch.load(os.path.join(self.folder, self.SCALARS), weights_only=True)
            return torch._inductor.aoti_load_package(package), scalars
        except Exception:  # cut short, or written by something else: built again
            shutil.rmtree(self.folder, ignore_errors=True)
            return None

    def remember(self, signature: str, constants: Dict[str, torch.Tensor]) -> None:
        """Note that the step of ``signature`` (``step_signature``) is this build, reading ``constants``
        (the model's tensors, by place) with their layouts now: a file in ``SIGNATURES``, written whole
        (renamed into place). Best effort, as ``save``."""
        entry = {"build": os.path.basename(self.folder), "constants": {name: _layout(t) for name, t in constants.items()}}
        folder = os.path.join(self.root(), self.SIGNATURES)
        writing = None
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".writing", delete=False) as out:
                writing = out.name
                json.dump(entry, out)
            os.replace(writing, os.path.join(folder, signature + ".json"))
        except OSError:
            if writing is not None:
                with contextlib.suppress(OSError):
                    os.unlink(writing)  # nothing half-written stays

    @classmethod
    def by_signature(cls, signature: str) -> Optional[Tuple["BuildCache", Dict[str, str]]]:
        """The kept build ``remember`` noted for ``signature`` and the layouts of the tensors it reads,
        or None (none noted, or not readable)."""
        try:
            with open(os.path.join(cls.root(), cls.SIGNATURES, signature + ".json"), encoding="utf-8") as noted:
                entry = json.load(noted)
            return cls(os.path.join(cls.root(), os.path.basename(entry["build"]))), dict(entry["constants"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, package: str, scalars: Dict[str, torch.Tensor]) -> None:
        """Keep ``package`` and ``scalars``: written beside the entry, then renamed into place, so a
        reader finds all of it or nothing. Best effort: a cache that cannot be written is skipped."""
        parent = os.path.dirname(self.folder)
        try:
            os.makedirs(parent, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=parent) as writing:
                staged = os.path.join(writing, "entry")
                os.mkdir(staged)
                shutil.copyfile(package, os.path.join(staged, self.PACKAGE))
                torch.save(scalars, os.path.join(staged, self.SCALARS))
                os.rename(staged, self.folder)
        except OSError:  # unwritable, or another process kept the same build first
            pass


def build_key(exported: torch.export.ExportedProgram) -> str:
    """A digest of everything the library is built from: each node of the exported graph with the
    shape, strides and dtype of its value (inputs and weights included: the library assumes their
    layout), which inputs it writes, the values of the tensors inductor may build in (constants and
    weights of at most ``SMALL_TENSOR`` numbers), inductor's options, the torch and package versions, the CPU (``-march=native``) and the
    threads torch runs on (inductor writes serial loops for one)."""
    digest = hashlib.sha256()
    add = functools.partial(_add, digest)
    add(torch.__version__, __version__, _inductor_options(), _cpu_description(), exported.graph_signature)
    add(f"threads {torch.get_num_threads()}")
    for node in exported.graph.nodes:
        add(node.format_node(), _layout(node.meta.get("val")))
    for name, value in sorted({**exported.state_dict, **exported.constants}.items()):
        small = isinstance(value, torch.Tensor) and value.numel() <= SMALL_TENSOR  # built in by value
        add(name, _layout(value), value.tolist() if small else "")
    return digest.hexdigest()[:32]


def step_signature(module: torch.nn.Module, args: Sequence, known_as: tuple) -> str:
    """A digest of what a step's exported graph is made from, read without exporting it: the torch
    and package versions and the package's source (``_source_digest``), inductor's options, the CPU
    and threads (as ``build_key``), ``known_as`` (the step's kind, options and tuning), the layouts of
    ``args``, and every module of ``module``: its place, its class, its attributes (a layer's window,
    a norm's eps, a LoRA scale, a format's group size) and the layout and class of each tensor it holds
    (and the values of one of at most ``SMALL_TENSOR`` numbers, which inductor builds in), the tensors
    held at two places (tied weights), and the variables read while tracing that choose ops
    (``TRACED_VARIABLES``).

    Worked example: two float32 models of one shape and config (different weights) have one signature,
    so the second loads the first's build and hands it its own tensors; the same model with its
    norms' ``eps`` changed, or its ``wq`` quantized, has another (``tests/test_cpu_aot_step.py``).
    Attributes whose names start with ``_`` are torch's bookkeeping (hooks excepted: their functions
    are named) or a cache of steps built, not what the step computes."""
    digest = hashlib.sha256()
    add = functools.partial(_add, digest)
    add(torch.__version__, __version__, SOURCE_DIGEST, _inductor_options(), _cpu_description())
    add(*(f"{name}={os.environ.get(name)}" for name in TRACED_VARIABLES))
    add(f"threads {torch.get_num_threads()}", _described(known_as), _described(tuple(args), small_values=False))
    # A tensor at two places (tied weights) is one constant of the build, read at its first name.
    first: Dict[int, str] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if first.setdefault(id(tensor), name) != name:
            add(f"{name} is {first[id(tensor)]}")
    for name, sub in module.named_modules(remove_duplicate=False):
        add(name, type(sub).__module__, type(sub).__qualname__)
        for key, value in sorted(vars(sub).items()):
            if key.endswith("_hooks"):  # by their functions: their keys count every hook of the process
                add(key, _described(list(value.values())))
            elif not key.startswith("_") or key in ("_parameters", "_buffers"):
                add(key, _described(value))
    return digest.hexdigest()[:32]


def _described(value, small_values: bool = True) -> str:
    """``value`` as text that is the same in every process: a tensor's class and layout, a module's
    or function's name, a plain value's repr, containers item by item; other objects by their class.
    ``small_values``: a tensor of at most ``SMALL_TENSOR`` numbers with its values (a weight inductor
    builds in); False for a step's arguments, whose values are the call's (the tokens fed)."""
    if isinstance(value, torch.Tensor):
        small = small_values and value.numel() <= SMALL_TENSOR and value.device.type == "cpu" and not value.is_meta
        # Inductor writes a tensor of a few numbers into the code by value (a norm of 8 channels).
        return f"{type(value).__qualname__}:{_layout(value)}" + (f"={value.tolist()}" if small else "")
    if isinstance(value, torch.nn.Module):
        return f"module {type(value).__qualname__}"
    if isinstance(value, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(_described(v, small_values) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_described(k, small_values)}:{_described(v, small_values)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={_described(getattr(value, f.name), small_values)}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, enum.Enum):
        return repr(value)
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return type(value).__qualname__


def _source_digest() -> str:
    """A digest of the package's source files (Python and C++), read when this module is imported (the
    code that runs): a step's graph is what its code says, and a checkout's code changes with no change
    of version. A file that cannot be read (an editor's lock link) counts by its name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, folders, files in sorted(os.walk(root)):
        folders.sort()
        for name in sorted(files):
            if name.endswith((".py", ".cpp", ".h")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                try:
                    if os.path.isfile(path):
                        with open(path, "rb") as source:
                            digest.update(source.read())
                except OSError:
                    pass
    return digest.hexdigest()


SOURCE_DIGEST = _source_digest()
SMALL_TENSOR = 8  # inductor builds in a tensor of at most this many numbers (graph.py's can_inline_constant)
# Variables read while a step is traced that choose its ops: the Triton interpreter (experts on CPU), the package's library.
TRACED_VARIABLES = ("TRITON_INTERPRET", "MIXTRAL_INFER_NATIVE")


def _add(digest, *parts) -> None:
    """``parts`` into ``digest``, each as its text ended by a NUL (build_key's and step_signature's)."""
    for part in parts:
        digest.update(str(part).encode())
        digest.update(b"\0")


def _inductor_options() -> list:
    """Inductor's options as a step is built with them, sorted. AOTInductor writes the device it
    builds for into ``aot_inductor.metadata``, in place, at a process's first build: left in, a key
    would change after that build, so the first step built in one process and a later one in another
    would never find each other's build (the CPU is keyed apart)."""
    options = {**torch._inductor.config.save_config_portable(), **inductor_configs()}
    options.pop("aot_inductor.metadata", None)
    return sorted(options.items(), key=str)


def _layout(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}{tuple(value.stride())}{value.device.type}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_layout(v) for v in value) + ")"
    return repr(value)


@functools.cache
def _cpu_description() -> str:
    """The CPU's model and instruction sets: a library built for one may not run on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            lines = [line for line in info.read().splitlines() if line.startswith(("model name", "flags"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


@contextlib.contextmanager
def _scalar_constants_recorded(into: Dict[str, torch.Tensor]):
    """Within the block, every one-value constant inductor adds to a graph it lowers is recorded in
    ``into`` by its name there (module docstring). Larger ones are not: they would be copies of
    weights, which the build then refuses (``NotAheadOfTime``)."""
    from torch._inductor.graph import GraphLowering

    add_tensor_constant = GraphLowering.add_tensor_constant

    def recording(graph, data, name=None):
        box = add_tensor_constant(graph, data, name)
        if data.numel() == 1:
            into[box.get_name()] = graph.constants[box.get_name()]
        return box

    GraphLowering.add_tensor_constant = recording
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = add_tensor_constant


def _plain_like(arg):
    """``arg`` with each tensor in it (the cache's layers are a tuple of them) a plain one of its
    shape, strides, dtype and device."""

    def plain(value):
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)

    return torch.utils._pytree.tree_map(plain, arg)


def _at(module: torch.nn.Module, name: str):
    """The object at a dotted place (``model.layers.0.attention.wq.weight``), None if there is none."""
    try:
        return functools.reduce(getattr, name.split("."), module)
    except AttributeError:
        return None
