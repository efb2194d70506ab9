"""The one reading of the CPU (`models/kernels/cpu_features.py`): /proc/cpuinfo as x86 and
ARM machines write it, the flags every kernel choice asks for, and the fingerprint that
keys kernel verdicts and compiled packages."""

from __future__ import annotations

from pathlib import Path

import torch

from aici_cli.models.kernels import cpu_features as features
from aici_cli.models.kernels.cpu_features import CpuFeatures, cpu_features

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma f16c

processor\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma f16c
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp bf16
CPU part\t: 0xd4f
"""


def _read(tmp_path: Path, text: str) -> tuple[str, frozenset[str]]:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return features._cpuinfo(path)


def test_x86_and_arm_cpuinfo_read_as_model_and_flags(tmp_path: Path) -> None:
    assert _read(tmp_path, X86) == ("AMD EPYC 7763 64-Core Processor",
                                    frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"}))
    model, flags = _read(tmp_path, ARM)
    assert model == "0xd4f" and {"asimddp", "bf16"} <= flags
    assert features._cpuinfo(tmp_path / "absent") == ("", frozenset())


def test_missing_flags_and_arm_bf16(tmp_path: Path) -> None:
    model, flags = _read(tmp_path, X86)
    avx2 = CpuFeatures("Linux", None, "x86_64", model, flags, "AVX2")
    assert avx2.x86 and not avx2.arm
    assert avx2.missing(("avx2", "fma", "avx512f", "avx512_vnni")) == ["avx512f", "avx512_vnni"]
    assert avx2.capabilities_up_to_chosen() == ["DEFAULT", "AVX2"]
    model, flags = _read(tmp_path, ARM)
    arm = CpuFeatures("Linux", None, "aarch64", model, flags, "DEFAULT")
    assert arm.arm and arm.native_bf16
    assert not CpuFeatures("Linux", None, "aarch64", model, flags - {"bf16"}, "DEFAULT").native_bf16
    assert arm.capabilities_up_to_chosen() == ["DEFAULT"]


def test_the_fingerprint_changes_with_the_flags_only(tmp_path: Path) -> None:
    model, flags = _read(tmp_path, X86)
    one = CpuFeatures("Linux", None, "x86_64", model, flags, "AVX2")
    same = CpuFeatures("Linux", None, "x86_64", model, flags, "AVX512")
    assert one.fingerprint == same.fingerprint
    assert one.fingerprint != CpuFeatures("Linux", None, "x86_64", model, flags | {"avx512f"},
                                          "AVX2").fingerprint
    assert model in one.fingerprint


def test_this_process_reads_once_and_agrees_with_torch() -> None:
    assert cpu_features() is cpu_features()
    assert cpu_features().capability == torch.backends.cpu.get_cpu_capability()
