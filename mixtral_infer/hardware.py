"""What this machine's CPU is and can do, read once from the operating system.

Decisions that depend on it:

* ``formats.measured``: which machine the choices measured there are kept for (the CPU's model
  name and usable cores, with torch's version);
* ``checkpoint.compute_dtype``: whether a bfloat16 or float16 checkpoint computes in its own
  dtype (the CPU has native arithmetic for it) or in float32;
* ``kernels.linear.w8a8``: how many levels int8 activations get (8-bit dot products that
  cannot overflow, VNNI, or 7-bit ones).

Linux: ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``). macOS: ``sysctl``. Elsewhere the
CPU is treated as having no native 16-bit arithmetic and an unknown vendor.

What a CPU is called (its vendor, its model name) decides nothing here: two CPUs of one vendor
differ, and a choice that depends on the machine is measured on it (``formats.measured``).

Example, an x86 ``/proc/cpuinfo`` with one processor entry, ``vendor_id : GenuineIntel``,
``model name : Intel(R) Xeon(R) Processor`` and ``flags : ... avx512f avx512_bf16 ...`` gives
``CpuInfo(vendor="GenuineIntel", model="Intel(R) Xeon(R) Processor", native={torch.bfloat16},
cores=1)``; an Arm one with ``Features : ... fphp asimdhp ... bf16`` gives
``native={torch.bfloat16, torch.float16}``.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import FrozenSet

import torch

# Instruction-set flags that give native arithmetic in a 16-bit float type.
X86_NATIVE = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
X86_INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")  # 8-bit dot products summed into 32 bits (no 16-bit saturation)
ARM_NATIVE = {torch.bfloat16: ("bf16",), torch.float16: ("fphp", "asimdhp")}
MACOS_NATIVE = {torch.bfloat16: "hw.optional.arm.FEAT_BF16", torch.float16: "hw.optional.arm.FEAT_FP16"}


@dataclass(frozen=True)
class CpuInfo:
    vendor: str = ""  # "GenuineIntel", "AuthenticAMD", "" when unknown: for the record, decides nothing
    native: FrozenSet[torch.dtype] = field(default_factory=frozenset)  # 16-bit float types with native arithmetic
    int8_dot: bool = False  # x86 VNNI/AMX: u8 x s8 products summed in 32 bits
    model: str = ""  # the model name ("AMD EPYC 9R14"), "" when unknown
    cores: int = 0  # the cores this process may run on (0: unknown)


def parse_cpuinfo(text: str) -> CpuInfo:
    """The CPU described by the text of a Linux ``/proc/cpuinfo`` (first processor's entries)."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if "flags" in fields:
        flags, table = set(fields["flags"].split()), X86_NATIVE
    else:
        flags, table = set(fields.get("Features", "").split()), ARM_NATIVE
    native = frozenset(dtype for dtype, names in table.items() if flags & set(names))
    arm_model = " ".join(f"{key} {fields[key]}" for key in ("CPU implementer", "CPU part") if key in fields)
    return CpuInfo(
        vendor=fields.get("vendor_id", ""),
        native=native,
        int8_dot=bool(flags & set(X86_INT8_DOT)),
        model=fields.get("model name") or fields.get("Hardware") or arm_model,
        cores=sum(1 for line in text.splitlines() if line.partition(":")[0].strip() == "processor"),
    )


def _macos_cpu() -> CpuInfo:
    def sysctl(name: str) -> str:
        try:
            return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    native = frozenset(dtype for dtype, name in MACOS_NATIVE.items() if sysctl(name) == "1")
    return CpuInfo(vendor=sysctl("machdep.cpu.vendor"), native=native, model=sysctl("machdep.cpu.brand_string"))


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process), its cores those this process may run on."""
    return replace(_described_cpu(), cores=usable_cores())


def _described_cpu() -> CpuInfo:
    cpuinfo = Path("/proc/cpuinfo")
    try:
        if cpuinfo.is_file():
            return parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        return CpuInfo()
    if platform.system() == "Darwin":
        return _macos_cpu()
    return CpuInfo(model=platform.processor())


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system says, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
