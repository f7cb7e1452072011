"""hardware.cpu_info reads the CPU's vendor, model name, cores, native 16-bit float arithmetic and
8-bit dot products (the module docstring's examples)."""

from __future__ import annotations

import torch

from mixtral_infer.hardware import CpuInfo, cpu_info, parse_cpuinfo, usable_cores

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni avx512_fp16
"""
AMD_NO_16_BIT = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 fma
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid bf16
CPU implementer\t: 0x41
"""


def test_intel_with_avx512_bf16():
    expected = CpuInfo(vendor="GenuineIntel", native=frozenset({torch.bfloat16}), int8_dot=True,  # avx512_vnni
                       model="Intel(R) Xeon(R) Processor", cores=2)  # fmt: skip
    assert parse_cpuinfo(INTEL) == expected  # the first processor's entries; both processors counted


def test_amd_without_16_bit_arithmetic():
    assert parse_cpuinfo(AMD_NO_16_BIT) == CpuInfo(vendor="AuthenticAMD", native=frozenset(), cores=1)


def test_arm_features():
    expected = CpuInfo(vendor="", native=frozenset({torch.bfloat16, torch.float16}), model="CPU implementer 0x41",
                       cores=1)  # fmt: skip
    assert parse_cpuinfo(ARM) == expected


def test_nothing_readable_means_no_native_arithmetic():
    assert parse_cpuinfo("") == CpuInfo()


def test_this_machine_is_read_once():
    assert cpu_info() is cpu_info()
    assert cpu_info().native <= {torch.bfloat16, torch.float16}
    assert cpu_info().cores == usable_cores() >= 1  # the cores this process may run on
