"""The package's own C++ kernels, compiled on this machine the first time they are asked for.

One library of dot products (``SOURCES``): ``int_dots.cpp``, integer dot products for int8 and int4
weights (``kernels.linear.int_dots``), and ``float_dots.cpp``, float32 products of a few rows
(``kernels.linear.plain``), with what they share in ``dots.h``. It is built by
``torch.utils.cpp_extension`` with the machine's own compiler and ``-march=native``, so one source
gives the instructions this CPU has (AVX512-VNNI, AVX-VNNI, or AVX2's pairwise products). The library
is kept on disk under a key of the sources, the CPU's flags and torch's version (``library_key``): the
next process loads it at once, another CPU or torch builds anew. One line on stderr says when it
builds (about a minute on 2 cores) and, once, why it cannot where it cannot: no compiler or no
``ninja``, a CPU without AVX2, another architecture. Nothing is built on import: ``loaded()`` builds
or loads on its first call.

``MIXTRAL_INFER_NATIVE=0`` builds nothing (the package keeps the kernels of torch and the field).
``MIXTRAL_INFER_NATIVE_CACHE`` names the folder (default ``$XDG_CACHE_HOME/mixtral_infer/native``).

Example: on an x86 CPU with ``avx2`` and ``avx512_vnni`` in its flags, torch 2.13.0, the library is
``<cache>/mixtral_infer_dots_<16 hex digits>/mixtral_infer_dots_<same>.so``, and
``torch.ops.mixtral_infer_dots.int8_dots`` is its int8 product, ``float_dots`` its float32 one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Optional

import torch

NATIVE_VARIABLE = "MIXTRAL_INFER_NATIVE"  # "0": build nothing
CACHE_VARIABLE = "MIXTRAL_INFER_NATIVE_CACHE"
HERE = Path(__file__).parent
SOURCES = (HERE / "int_dots.cpp", HERE / "float_dots.cpp")  # compiled into one library
HEADERS = (HERE / "dots.h",)  # what they include
FLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for in the library uses torch's threads

_LOCK = threading.Lock()
_STATE: dict = {}  # "ok": bool, "why": the reason it is not available


def cpu_flags() -> str:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them (first processor), or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return " ".join(sorted(value.split()))
    except OSError:
        pass
    return ""


def unsuited_because() -> Optional[str]:
    """Why this machine can never run the native kernels (its architecture, its CPU), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return f"the native kernels are written for x86 Linux, this is {platform.machine()} {sys.platform}"
    if "avx2" not in cpu_flags().split():
        return "this CPU has no AVX2"
    return None


def unavailable_because() -> Optional[str]:
    """Why the native kernels cannot be built here, checked without building; None if they can be tried.
    Beside ``unsuited_because``, what may change on the same machine: the variable, a compiler, ninja."""
    if os.environ.get(NATIVE_VARIABLE, "") in ("0", "false", "no"):
        return f"{NATIVE_VARIABLE}=0"
    unsuited = unsuited_because()
    if unsuited is not None:
        return unsuited
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    if ninja_folder() is None:
        return "no ninja (apt install ninja-build, or pip install ninja)"
    return None


def ninja_folder() -> Optional[str]:
    """The folder of the ``ninja`` that builds the library: on PATH, or beside this Python's scripts
    (``pip install ninja`` in a virtual environment that is not activated); None where there is none."""
    for folder in (*os.environ.get("PATH", "").split(os.pathsep), sysconfig.get_path("scripts")):
        if folder and shutil.which("ninja", path=folder):
            return folder
    return None


def library_key() -> str:
    """16 hex digits of the sources and headers, the compiler flags, the CPU's flags and torch's version."""
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    text = "\n".join([*texts, " ".join(FLAGS), cpu_flags(), torch.__version__, sys.version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_folder() -> Path:
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mixtral_infer" / "native"


def loaded() -> bool:
    """Whether ``torch.ops.mixtral_infer_dots`` is loaded: built or loaded from the cache on the first
    call (module docstring), the answer kept for the process."""
    with _LOCK:
        if "ok" not in _STATE:
            _STATE["ok"], _STATE["why"] = _load()
            if not _STATE["ok"]:
                print(f"mixtral_infer: native kernels not used: {_STATE['why']}", file=sys.stderr)
        return _STATE["ok"]


def _load() -> tuple[bool, Optional[str]]:
    why = unavailable_because()
    if why is not None:
        return False, why
    name = f"mixtral_infer_dots_{library_key()}"
    folder = cache_folder() / name
    built = folder / f"{name}.so"
    if built.is_file():
        try:
            torch.ops.load_library(str(built))
            return True, None
        except OSError:  # another process is still writing it: build (torch's build waits for that one's lock)
            pass
    try:
        from torch.utils.cpp_extension import load

        print(f"mixtral_infer: building the native kernels for this CPU in {folder} (once)", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PATH", "")
        if ninja_folder() not in path.split(os.pathsep):  # torch's build calls "ninja" from PATH
            os.environ["PATH"] = os.pathsep.join([ninja_folder(), path])
        try:
            load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                 build_directory=str(folder), is_python_module=False, verbose=False)  # fmt: skip
        finally:
            os.environ["PATH"] = path
        return True, None
    except Exception as error:  # a compiler error, a library that does not load: today's kernels
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return False, f"building {', '.join(path.name for path in SOURCES)} failed ({first[:200]})"
