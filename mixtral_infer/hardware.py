"""What this machine's CPU is and can do, read once from the operating system.

Three decisions depend on it, each measured where it is made:

* ``fast.linear``: whether few-row float32 matmuls are split into one block per thread
  (MKL's few-row path runs on one core on AMD CPUs and on every core on Intel ones);
* ``checkpoint.compute_dtype``: whether a bfloat16 or float16 checkpoint computes in its own
  dtype (the CPU has native arithmetic for it) or in float32;
* ``quant.int8_activations``: how many levels int8 activations get (8-bit dot products that
  cannot overflow, VNNI, or 7-bit ones).

Linux: ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``). macOS: ``sysctl``. Elsewhere the
CPU is treated as having no native 16-bit arithmetic and an unknown vendor.

Example, an x86 ``/proc/cpuinfo`` with ``vendor_id : GenuineIntel`` and ``flags : ... avx512f
avx512_bf16 ...`` gives ``CpuInfo(vendor="GenuineIntel", native={torch.bfloat16})``; an Arm one
with ``Features : ... fphp asimdhp ... bf16`` gives ``native={torch.bfloat16, torch.float16}``.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from dataclasses import dataclass, field
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
    vendor: str = ""  # "GenuineIntel", "AuthenticAMD", "" when unknown
    native: FrozenSet[torch.dtype] = field(default_factory=frozenset)  # 16-bit float types with native arithmetic
    int8_dot: bool = False  # x86 VNNI/AMX: u8 x s8 products summed in 32 bits


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
    return CpuInfo(vendor=fields.get("vendor_id", ""), native=native, int8_dot=bool(flags & set(X86_INT8_DOT)))


def _macos_cpu() -> CpuInfo:
    def sysctl(name: str) -> str:
        try:
            return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    native = frozenset(dtype for dtype, name in MACOS_NATIVE.items() if sysctl(name) == "1")
    return CpuInfo(vendor=sysctl("machdep.cpu.vendor"), native=native)


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    cpuinfo = Path("/proc/cpuinfo")
    try:
        if cpuinfo.is_file():
            return parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        return CpuInfo()
    if platform.system() == "Darwin":
        return _macos_cpu()
    return CpuInfo()
