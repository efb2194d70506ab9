"""This machine's CPU as every kernel choice reads it: the one place that reads
`/proc/cpuinfo`, torch's ATen capability and torch's private CPU probes.

Every choice that depends on the CPU asks `cpu_features()`: the load dtype (`device.py`),
the project's own int kernels (`int_mm.py`), the kernel probe's key and modes
(`probe.py`, `checks/doctor.py`) and the compiled step's package key. One reading, cached
per process (ATen's capability is fixed at process start by `ATEN_CPU_CAPABILITY`), so a
new instruction set is one more flag here, not one more reader.

A lower instruction set can be forced (`AICI_BATCH_ISA`: `avx2`, `avx_vnni`,
`avx512_vnni`; `neon`, `neon_dot`): the flags above it are taken out of this reading, so
every choice (the dtype `auto` picks, the int kernels' variant, the probe's key) is the
one a CPU of that level makes. Below AVX-512 it also sets `ATEN_CPU_CAPABILITY=avx2` for
torch's own kernels where the environment does not set it already and torch has not yet
chosen (the CLI reads the CPU before any torch operation). So an AVX-512 machine runs, and
measures, what an AVX2 laptop or CI runner runs.

Cost: one read of `/proc/cpuinfo` (~1 ms) and, for `native_bf16`, torch's cpuinfo probes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from aici_cli.core.errors import UsageError

ISA_ENV = "AICI_BATCH_ISA"
X86 = ("x86_64", "amd64")
ARM = ("aarch64", "arm64")
# ATen's CPU capabilities on x86, weakest first (`ATEN_CPU_CAPABILITY`).
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


@dataclass(frozen=True)
class CpuFeatures:
    """What the kernels see of this CPU. `flags`: x86's `flags` or ARM's `Features` line
    of /proc/cpuinfo (empty where there is none); `capability`: the ATen capability
    torch's own kernels run at in this process (DEFAULT, AVX2, AVX512 on x86)."""

    system: str  # Linux, Darwin, ...
    forced: str | None  # the instruction set AICI_BATCH_ISA forces, or None
    machine: str  # x86_64, aarch64, ... (lower case)
    model: str  # the CPU's model name, "" where unknown
    flags: frozenset[str]
    capability: str

    @property
    def x86(self) -> bool:
        return self.machine in X86

    @property
    def arm(self) -> bool:
        return self.machine in ARM

    def missing(self, needs: tuple[str, ...]) -> list[str]:
        """The flags of `needs` this CPU lacks."""
        return [flag for flag in needs if flag not in self.flags]

    @property
    def fingerprint(self) -> str:
        """The machine as its kernels see it: OS, architecture, model name and a digest of
        the instruction-set flags (kernel verdicts and compiled packages are keyed by it)."""
        digest = hashlib.sha256(" ".join(sorted(self.flags)).encode()).hexdigest()[:12]
        model = f"{self.model} {digest}" if self.model or self.flags else \
            (platform.processor() or self.machine)
        return f"{self.system} {platform.machine()} {model}"

    @property
    def native_bf16(self) -> bool:
        """Whether this CPU executes bf16 matmuls natively (x86 AVX512-BF16/AMX, ARM BF16).

        Measured on a 2-core AMX Xeon (SmolLM2-135M): bf16 prefill ~4x and batch-8 decode
        ~1.6x faster than float32. Without native support bf16 is emulated and slower, and
        torch's capability says "AVX512" on such CPUs too, so torch's precise probes (which
        also ask the OS whether AMX state is enabled) come first.
        """
        if self.forced is not None:  # the flags say it: torch's probes read the real CPU
            return bool({"avx512_bf16", "amx_bf16"} & self.flags) if self.x86 \
                else "bf16" in self.flags
        if self.x86:
            import torch

            probes = [getattr(torch.cpu, name, None)
                      for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
            if all(callable(probe) for probe in probes):
                try:
                    return any(probe() for probe in probes)  # type: ignore[misc]
                except Exception:  # noqa: BLE001 - private API; the coarse check below
                    pass
            return "AMX" in self.capability.upper() or "AVX512" in self.capability.upper()
        return self.arm and self.system == "Linux" and "bf16" in self.flags

    def capabilities_up_to_chosen(self) -> list[str]:
        """The ATen capabilities this CPU runs, weakest first, up to the one torch chose
        (on x86; elsewhere only the chosen one)."""
        if not self.x86 or self.capability not in X86_CAPABILITIES:
            return [self.capability]
        return list(X86_CAPABILITIES[:X86_CAPABILITIES.index(self.capability) + 1])


# What forcing an instruction set takes out of the flags: everything above it.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int8")
_FORCED_AWAY: dict[str, tuple[str, ...]] = {
    "avx2": _ABOVE_AVX2,
    "avx_vnni": ("avx512", "amx"),
    "avx512_vnni": (),
    "neon": ("asimddp", "bf16", "i8mm", "sve", "sme"),
    "neon_dot": (),
}


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's reading of the CPU (read once), with a forced lower instruction set
    (`AICI_BATCH_ISA`) applied. Raises UsageError for a name it does not know."""
    model, flags = _cpuinfo()
    forced = os.environ.get(ISA_ENV, "").strip().lower() or None
    if forced is not None:
        if forced not in _FORCED_AWAY:
            raise UsageError(f"{ISA_ENV}={forced!r}: expected one of "
                             f"{', '.join(_FORCED_AWAY)}")
        flags = frozenset(f for f in flags if not f.startswith(_FORCED_AWAY[forced]))
        if forced in ("avx2", "avx_vnni"):
            os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    import torch

    return CpuFeatures(system=platform.system(), machine=platform.machine().lower(),
                       model=model, flags=flags, forced=forced,
                       capability=torch.backends.cpu.get_cpu_capability())


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (x86 `flags`, ARM `Features`)."""
    try:
        text = path.read_text()
    except OSError:
        return "", frozenset()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: all cores are alike here
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model name") or fields.get("CPU part", "")
    flags = fields.get("flags") or fields.get("Features", "")
    return model, frozenset(flags.split())
