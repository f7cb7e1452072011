"""This machine's ``Tuning``: the choices that depend on the machine, measured once and kept on disk.

Some fast paths are faster on one machine and slower on another, in a way nothing the CPU says about
itself (its flags, its vendor) tells: whether MKL's few-row float32 product uses every core, whether
oneDNN or MKL multiplies prompts faster, whether 16-bit prompts multiply faster in float32, in how
many places at once compiled code best reads a weight. Each
such choice (``CHOICES``) is timed once on the machine, the first time a model is loaded there, with
a line on stderr saying so, and kept in a JSON file (``cache_file``) under the machine's key
(``machine_key``: the CPU's model name, its usable cores, torch's version), so another machine, or
this one with another torch, measures anew. A choice the CPU's capabilities decide is not timed:
with one core there are no blocks per thread to share out; without oneDNN, MKL multiplies. The
choices that build the package's own kernels (``kernels.native``) are timed only where a model needs
them: ``FLOAT_DOTS`` where float32 weights are loaded on CPU, ``BFLOAT16_DOTS`` where plain bfloat16
ones are, ``INT_DOTS`` and ``INT_DOT_PROMPTS`` where int8 or int4 weights are.

Example cache file, one machine::

    {"AMD EPYC 9R14 | 2 cores | torch 2.13.0+cpu":
        {"onednn_float32": true, "upcast_bfloat16": false, "upcast_float16": true, "few_row_blocks": true}}

gives ``Tuning(onednn_float32=True, upcast=(torch.float16,), few_row_blocks=True)``, the
other fields their defaults.

``MIXTRAL_INFER_MEASURE=0`` measures nothing: ``Tuning()``'s safe defaults (the tests run so).
``MIXTRAL_INFER_TUNING_CACHE`` names the file (default ``$XDG_CACHE_HOME/mixtral_infer/tuning.json``,
``~/.cache/...`` without it). A ``Tuning`` passed in (``load_model(..., tuning=...)``) is taken as it
is: nothing is measured or read.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_float32 import best_seconds, onednn_is_faster
from mixtral_infer.fast.cpu_upcast import upcast_is_faster
from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear import few_row_blocks
from mixtral_infer.hardware import CpuInfo, cpu_info
from mixtral_infer.tuning import WIDE_DTYPES, Tuning

MEASURE_VARIABLE = "MIXTRAL_INFER_MEASURE"  # "0": measure nothing, the safe defaults
CACHE_VARIABLE = "MIXTRAL_INFER_TUNING_CACHE"  # the cache file, in place of the user's cache folder
BLOCKS_MARGIN = 1.2  # the bmm blocks only when at least this much faster than F.linear


@dataclass(frozen=True)
class Choice:
    """One choice measured on the machine: ``measure(known)`` times it (``known``: the choices
    measured before it), where ``capable(cpu)`` says the CPU can take it at all (False otherwise,
    without timing anything, and kept). ``ready()`` says whether it can be timed in this process:
    where not (the package's library cannot be built here for now: no compiler, ``MIXTRAL_INFER_NATIVE=0``),
    it is False here and not kept, so a process that can build it measures it."""

    name: str  # its key in the cache file
    measure: Callable[[Dict[str, bool]], bool]
    capable: Callable[[CpuInfo], bool] = lambda cpu: True
    ready: Callable[[], bool] = lambda: True


def few_row_blocks_are_faster() -> bool:
    """Whether one row times float32 weights too large for the cache runs at least ``BLOCKS_MARGIN``
    times faster as one ``bmm`` block per thread (``kernels.linear.few_row_blocks``) than by ``F.linear``:
    4 weights of about 4096 x 1024 in turn, best of 3."""
    threads = torch.get_num_threads()
    if threads < 2:
        return False
    out_features = -(-4096 // threads) * threads  # rows that split into one block per thread
    weights = [torch.ones(out_features, 1024) for _ in range(4)]
    x = torch.ones(1, 1024)

    def each(multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: [multiply(x, weight) for weight in weights]

    return best_seconds(each(F.linear)) >= BLOCKS_MARGIN * best_seconds(each(few_row_blocks))


FEW_STREAMS = 2  # Tuning.streams where reading a weight in fewer places is measured faster
STREAMS_MARGIN = 1.03  # fewer places only when at least this much faster (medians of 6 alternating rounds)


def few_streams_are_faster() -> bool:
    """Whether compiled few-row products read a weight faster in ``FEW_STREAMS`` places than in
    ``Tuning().streams`` (``fast.cpu_reductions.row_sums``): one bfloat16 row times two 64 MB
    weights in turn, each way compiled once (a few seconds), then alternated, medians of 6 rounds.
    Some machines keep more reads in flight per core than others; nothing the CPU says tells which."""
    from mixtral_infer.fast.cpu_reductions import rows_as_reductions

    weights = [torch.ones(8192, 4096, dtype=torch.bfloat16) for _ in range(2)]  # beyond any cache, in turn
    x = torch.ones(1, 4096, dtype=torch.bfloat16)
    seconds = {}
    for streams in (FEW_STREAMS, Tuning().streams):
        product = torch.compile(lambda x, w, s=streams: rows_as_reductions(x, w, streams=s), fullgraph=True, dynamic=False)
        product(x, weights[0])  # compiled here
        seconds[streams] = (product, [])
    for _ in range(6):
        for product, times in seconds.values():
            times.append(best_seconds(lambda: [product(x, weight) for weight in weights * 4], repeats=1))
    few, many = (sorted(times)[len(times) // 2] for _, times in seconds.values())
    return many >= STREAMS_MARGIN * few


INT_DOTS_MARGIN = 1.05  # the integer dot products only when at least this much faster (medians of 5 rounds)


def alternated_medians(ways: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, float]:
    """Each way's median seconds over ``rounds`` rounds, the ways taking turns within each round (a
    noisy machine slows them alike)."""
    times: Dict[str, list] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            times[name].append(best_seconds(way, repeats=1))
    return {name: sorted(samples)[len(samples) // 2] for name, samples in times.items()}


def int_dots_are_faster() -> bool:
    """Whether one bfloat16 row times int8 weights beyond any cache runs at least ``INT_DOTS_MARGIN``
    times faster through the integer dot products (``kernels.linear.int_dots``, built here first if
    it is not yet) than through PyTorch's int8 kernel: 4 weights of 4096 x 4096 in turn, alternated,
    medians of 5 rounds."""
    from mixtral_infer.kernels.linear.int_dots import available

    if not available():
        return False
    weights = [torch.ones(4096, 4096, dtype=torch.int8) for _ in range(4)]
    scales = torch.ones(4096, dtype=torch.bfloat16)
    x = torch.ones(1, 4096, dtype=torch.bfloat16)
    ways = {
        "kernel": lambda: [torch.ops.aten._weight_int8pack_mm(x, weight, scales) for weight in weights],
        "dots": lambda: [torch.ops.mixtral_infer_dots.int8_dots(x, weight, scales) for weight in weights],
    }
    medians = alternated_medians(ways, rounds=5)
    return medians["kernel"] >= INT_DOTS_MARGIN * medians["dots"]


def int_dot_prompts_are_faster(tuning: Tuning) -> bool:
    """Whether a prompt chunk (``DOTS_ROWS`` bfloat16 rows) times int8 weights multiplies at least as
    fast through the integer dot products as through int8's weight-only prompt path (dequantized,
    then the float product as ``tuning`` multiplies it): 2 weights of 4096 x 4096 in turn,
    alternated, medians of 3 rounds."""
    from mixtral_infer.kernels.linear.int8 import Int8Linear
    from mixtral_infer.kernels.linear.int_dots import DOTS_ROWS, available
    from mixtral_infer.quant.scheme import QuantScheme
    from mixtral_infer.quant.weights import quantize

    if not available():
        return False
    weights = [quantize(torch.ones(4096, 4096), QuantScheme("int8"), torch.bfloat16) for _ in range(2)]
    x = torch.ones(DOTS_ROWS, 4096, dtype=torch.bfloat16)
    ways = {
        "weight_only": lambda: [Int8Linear.product(x, weight, tuning) for weight in weights],
        "dots": lambda: [torch.ops.mixtral_infer_dots.int8_dots(x, weight.values, weight.scales) for weight in weights],
    }
    medians = alternated_medians(ways, rounds=3)
    return medians["weight_only"] >= medians["dots"]


FLOAT_DOTS_MARGIN = 1.1  # the package's float32 few-row product only when at least this much faster
FLOAT_DOTS_ROWS = (1, 2, 4, 8)  # decoding's rows, and an expert's share of them


def float_dots_are_faster(tuning: Tuning) -> bool:
    """Whether float32 products of a few rows run at least ``FLOAT_DOTS_MARGIN`` times faster through
    the package's kernel (``kernels/float_dots.cpp``, built here first if it is not yet) than as
    ``tuning`` multiplies them otherwise (``F.linear``, or ``few_row_blocks``): 1, 2, 4 and 8 rows
    times 4 weights of 4096 x 1024 in turn (64 MB, beyond the caches), alternated, medians of 3
    rounds, the rows' times summed."""
    return _few_rows_faster(tuning, "float_dots", torch.float32, 1024)


BFLOAT16_DOTS_INPUTS = 2048  # 4 weights of 4096 x 2048 in bfloat16: 64 MB, as float_dots' in float32


def bfloat16_dots_are_faster(tuning: Tuning) -> bool:
    """Whether bfloat16 products of a few rows of plain weights run at least ``FLOAT_DOTS_MARGIN`` times
    faster through the package's kernel (``float_dots.cpp``'s ``bfloat16_dots``) than through
    ``F.linear``, measured as ``float_dots_are_faster`` (1, 2, 4 and 8 rows, 4 weights of 64 MB in all)."""
    return _few_rows_faster(tuning, "bfloat16_dots", torch.bfloat16, BFLOAT16_DOTS_INPUTS)


def _few_rows_faster(tuning: Tuning, field: str, dtype: torch.dtype, inputs: int) -> bool:
    """Whether ``PlainLinear`` with the choice ``field`` on is ``FLOAT_DOTS_MARGIN`` times faster than
    with it off, on ``FLOAT_DOTS_ROWS`` rows times 4 weights of 4096 x ``inputs`` in ``dtype``."""
    from mixtral_infer.kernels.linear.plain import PlainLinear

    if not native.loaded():
        return False
    weights = [torch.ones(4096, inputs, dtype=dtype) for _ in range(4)]
    rows = [torch.ones(m, inputs, dtype=dtype) for m in FLOAT_DOTS_ROWS]
    otherwise, kernel = replace(tuning, **{field: False}), replace(tuning, **{field: True})
    ways = {
        "otherwise": lambda: [PlainLinear.product(x, weight, otherwise) for x in rows for weight in weights],
        "kernel": lambda: [PlainLinear.product(x, weight, kernel) for x in rows for weight in weights],
    }
    medians = alternated_medians(ways, rounds=3)
    return medians["otherwise"] >= FLOAT_DOTS_MARGIN * medians["kernel"]


def native_ready() -> bool:
    """Whether the library may be built or loaded in this process: not under ``MIXTRAL_INFER_NATIVE=0``
    or without a compiler or ninja (nothing kept then). A build that fails is measured as not faster,
    and kept."""
    return native.unavailable_because() is None


def native_cpu(cpu: CpuInfo) -> bool:
    """Whether this machine can run the package's library at all: kept False where it never can
    (another architecture, no AVX2); where it cannot be built for now, ``native_ready`` says so."""
    return native.unsuited_because() is None


# Measured only where a model is loaded with float32 weights on CPU (the library is built then),
# after the few-row blocks it is weighed against.
FLOAT_DOTS = Choice(
    "float_dots", lambda known: float_dots_are_faster(with_choices(Tuning(), known)), native_cpu, ready=native_ready
)
# Measured only where a model is loaded with plain bfloat16 weights on CPU (the library is built then).
BFLOAT16_DOTS = Choice(
    "bfloat16_dots", lambda known: bfloat16_dots_are_faster(with_choices(Tuning(), known)), native_cpu, ready=native_ready
)
# Measured only where a model is loaded with int8 or int4 weights on CPU (the library is built then);
# the prompts' choice only where the dot products are chosen at all.
INT_DOTS = Choice("int_dots", lambda known: int_dots_are_faster(), native_cpu, ready=native_ready)
INT_DOT_PROMPTS = Choice(
    "int_dots_prompts",
    lambda known: known.get("int_dots", False) and int_dot_prompts_are_faster(with_choices(Tuning(), known)),
    native_cpu,
    ready=native_ready,
)

CHOICES: Sequence[Choice] = (
    Choice("onednn_float32", lambda known: onednn_is_faster(), lambda cpu: torch.backends.mkldnn.is_available()),
    Choice("upcast_bfloat16", lambda known: upcast_is_faster(torch.bfloat16, known.get("onednn_float32", False))),
    Choice("upcast_float16", lambda known: upcast_is_faster(torch.float16, known.get("onednn_float32", False))),
    Choice("few_row_blocks", lambda known: few_row_blocks_are_faster(), lambda cpu: cpu.cores >= 2),
    Choice("few_streams", lambda known: few_streams_are_faster(), lambda cpu: cpu.cores >= 2),
)


def machine_tuning(
    fast: Optional[bool] = None,
    cpu: Optional[CpuInfo] = None,
    path: Optional[Path] = None,
    choices: Optional[Sequence[Choice]] = None,
    announce: Optional[Callable[[str], None]] = None,
    integers: bool = False,
    floats: bool = False,
    bfloat16: bool = False,
) -> Tuning:
    """The tuning for this machine (``cpu``, default this one's): ``Tuning.default(fast)`` with the
    measured ``choices`` (default ``CHOICES``) kept in ``path`` (default ``cache_file()``), measuring
    those not kept yet and saying so to ``announce`` (default stderr); ``integers`` (int8 or int4
    weights on CPU) adds ``INT_DOTS`` and ``INT_DOT_PROMPTS``, ``floats`` (float32 weights on CPU)
    ``FLOAT_DOTS``, ``bfloat16`` (plain bfloat16 weights on CPU) ``BFLOAT16_DOTS``. The reference (``fast`` False) and ``MIXTRAL_INFER_MEASURE=0`` measure nothing."""
    tuning = Tuning.default(fast)
    if not tuning.fast or os.environ.get(MEASURE_VARIABLE, "1") == "0":
        return tuning
    if choices is None:
        choices = (*CHOICES, *((FLOAT_DOTS,) if floats else ()), *((BFLOAT16_DOTS,) if bfloat16 else ()),
                   *((INT_DOTS, INT_DOT_PROMPTS) if integers else ()))  # fmt: skip
    known = measured_choices(cpu or cpu_info(), path or cache_file(), choices, announce)
    return with_choices(tuning, known)


def with_choices(tuning: Tuning, known: Dict[str, bool]) -> Tuning:
    """``tuning`` with the fields the measured choices ``known`` decide (the cache file's names)."""
    upcast = tuple(dtype for dtype in WIDE_DTYPES if known.get(f"upcast_{dtype_name(dtype)}"))
    return replace(
        tuning,
        few_row_blocks=known.get("few_row_blocks", tuning.few_row_blocks),
        float_dots=known.get("float_dots", tuning.float_dots),
        bfloat16_dots=known.get("bfloat16_dots", tuning.bfloat16_dots),
        onednn_float32=known.get("onednn_float32", tuning.onednn_float32),
        upcast=upcast,
        streams=FEW_STREAMS if known.get("few_streams") else tuning.streams,
        int_dots=known.get("int_dots", tuning.int_dots),
        int_dots_prompts=known.get("int_dots_prompts", tuning.int_dots_prompts),
    )


def measured_choices(
    cpu: CpuInfo, path: Path, choices: Sequence[Choice], announce: Optional[Callable[[str], None]] = None
) -> Dict[str, bool]:
    """The ``choices`` for machine ``cpu``: those kept in ``path``, the others measured now (one line
    to ``announce`` first) and kept there beside them."""
    say = announce if announce is not None else lambda line: print(line, file=sys.stderr, flush=True)
    key = machine_key(cpu)
    kept = read_cache(path)
    known = {name: value for name, value in kept.get(key, {}).items() if isinstance(value, bool)}
    missing = [choice for choice in choices if choice.name not in known]
    unready = {choice.name for choice in missing if choice.capable(cpu) and not choice.ready()}
    known.update(dict.fromkeys(unready, False))  # False in this process, measured by a later one
    missing = [choice for choice in missing if choice.name not in unready]
    if not missing:
        return known
    say(f"measuring {', '.join(c.name for c in missing)} once for this machine (cached in {path})")
    for choice in missing:
        known[choice.name] = bool(choice.capable(cpu) and choice.measure(dict(known)))
    kept = read_cache(path)  # another process may have kept its own since
    kept[key] = {**kept.get(key, {}), **{name: value for name, value in known.items() if name not in unready}}
    try:
        write_cache(path, kept)
    except OSError as error:
        say(f"could not keep the measurements in {path} ({error.strerror or error}): measuring again next time")
    return known


def machine_key(cpu: CpuInfo) -> str:
    """What a measurement is kept under: the CPU's model name, its usable cores and torch's version
    (``"AMD EPYC 9R14 | 2 cores | torch 2.13.0+cpu"``)."""
    return f"{cpu.model or 'unknown CPU'} | {cpu.cores} cores | torch {torch.__version__}"


def cache_file() -> Path:
    """``$MIXTRAL_INFER_TUNING_CACHE``, else ``tuning.json`` in ``mixtral_infer`` under the user's
    cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    named = os.environ.get(CACHE_VARIABLE)
    if named:
        return Path(named)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mixtral_infer" / "tuning.json"


def read_cache(path: Path) -> Dict[str, Dict[str, bool]]:
    """The cache file's machines, or none where it is missing or unreadable (measured again)."""
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {key: value for key, value in kept.items() if isinstance(value, dict)} if isinstance(kept, dict) else {}


def write_cache(path: Path, kept: Dict[str, Dict[str, bool]]) -> None:
    """Write ``kept`` to ``path`` whole: beside it, then renamed into place (a reader finds the old
    file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tuning-", suffix=".json", delete=False) as file:
        json.dump(kept, file, indent=1, sort_keys=True)
    try:
        os.replace(file.name, path)
    except OSError:
        os.unlink(file.name)
        raise


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
