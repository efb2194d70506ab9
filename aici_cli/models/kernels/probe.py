"""The kernel probe: a mode's real kernels run once per machine in a child process, so
that a kernel that crashes, hangs or computes wrong is never used by a run.

A *mode* is what picks the kernels a run calls: the device, the dtype, the quantisation
and, on the CPU, the ATen capability its kernels were built for (`ATEN_CPU_CAPABILITY`).
Alignment was one cause of a dead kernel (`aligned`); the next torch, a GPU or a user's
model may bring another, and a native crash cannot be caught in-process. So the first time
a machine loads a model in a mode, a child process (`python -m
aici_cli.models.checks.probe_child`) builds that mode's layers with the model's real shapes
through the project's own constructors (their buffers first placed off a 64-byte boundary,
as a mapped file would hold them), and runs a prefill, one-token steps at 1, 3 and 8 rows
and the output projection, plus attention. A death by a signal, no answer within
`TIMEOUT_S`, or an output further than `TOLERANCE` from float32 over the same weights
marks the mode unusable on this machine.

The verdict is cached in `$AICI_BATCH_CACHE/kernel-probe/` under a key of everything it
depends on (this probe's version, torch's, the machine's fingerprint, the mode, the
shapes): later runs pay nothing. `choose_kernels` then walks from the requested mode
to the next one where a choice was `auto` (`candidates`), and refuses an explicit one
the probe rejected. `aici-batch doctor` shows every verdict.

Cost, first use of a mode: a child's start (torch's import, ~1.5 s) and its kernels
(~1-3 s for the default model); then 0. `AICI_BATCH_KERNEL_PROBE=off` skips it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models.kernels.cpu_features import cpu_features

PROBE_VERSION = 3  # 2: step times on one thread; 3: the int kernels at any dtype
TIMEOUT_S = 120.0  # a probe child that takes longer hangs (the default model's: ~3 s)
ENV = "AICI_BATCH_KERNEL_PROBE"  # "off": no probe (the test suite's in-process runs)
# Largest |y - reference| / max|reference| over a layer's outputs, by activation dtype,
# where the reference is float32 over the same (dequantised) weights and inputs: bf16 and
# fp16 round each output (2^-8, 2^-11) and accumulate in blocks; a wrong kernel is off by
# about 1.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}
# The int kernels round activations to 8 bits per group of 32 (~5e-3 of a layer's largest
# output against float32 over the same weights), whatever the activation dtype.
INT8_ACTIVATIONS_TOLERANCE = 3e-2
PREFILL_ROWS = 64
STEP_ROWS = (1, 3, 8)


@dataclass(frozen=True)
class KernelMode:
    """What picks a run's kernels. `capability`: ATen's CPU capability (DEFAULT, AVX2,
    AVX512), or the GPU's name."""

    device: str  # cpu, cuda
    dtype: str  # float32, bfloat16, float16
    quantize: str  # none, int8, int4
    capability: str

    @property
    def label(self) -> str:
        return f"{self.dtype}+{self.quantize}"


@dataclass(frozen=True)
class Shapes:
    """The model's shapes the probe computes with (its config.json)."""

    hidden: int = 576
    intermediate: int = 1536
    vocab: int = 49152
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30

    @classmethod
    def of(cls, path: Path) -> Shapes:
        """The shapes of the model at `path`; the default model's where its config.json
        does not say (the probe still runs every kernel of the mode)."""
        try:
            raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
            raw = raw.get("text_config", raw) if isinstance(raw, dict) else {}
        except (OSError, ValueError):
            raw = {}
        return cls.of_fields(raw)

    @classmethod
    def of_config(cls, config: Any) -> Shapes:
        """The shapes of a loaded model's config (its attributes, as config.json's keys)."""
        names = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                 "num_key_value_heads", "head_dim", "num_hidden_layers")
        return cls.of_fields({name: getattr(config, name, None) for name in names})

    @classmethod
    def of_fields(cls, raw: dict[str, Any]) -> Shapes:
        """The shapes config.json's fields give; the default model's where one is missing."""
        base = cls()

        def field(key: str, default: int) -> int:
            value = raw.get(key)
            return value if isinstance(value, int) and value > 0 else default

        hidden = field("hidden_size", base.hidden)
        heads = field("num_attention_heads", base.heads)
        return cls(hidden, field("intermediate_size", base.intermediate),
                   field("vocab_size", base.vocab), heads,
                   field("num_key_value_heads", heads),
                   field("head_dim", hidden // heads if hidden % heads == 0 else 64),
                   field("num_hidden_layers", base.layers))


@dataclass(frozen=True)
class Verdict:
    """A mode's verdict on this machine: usable or why not, with its linear layers' time
    for one decode step at 1 row (`step_ms`, the whole model's), when measured."""

    ok: bool
    reason: str | None = None
    step_ms: float | None = None
    max_error: float | None = None
    probe_s: float | None = None  # the child's wall time, when it ran (not cached)


@dataclass(frozen=True)
class KernelChoice:
    """The mode a load runs in, and the modes the probe turned down on the way."""

    dtype: str
    quantize: str
    rejected: tuple[tuple[str, str], ...] = ()  # (mode label, why)

    @property
    def note(self) -> str | None:
        """One line for the user when the run is not in the mode `auto` chose first."""
        if not self.rejected:
            return None
        why = "; ".join(f"{label}: {reason}" for label, reason in self.rejected)
        return (f"kernel probe: running {self.dtype}+{self.quantize} instead ({why}; "
                "`aici-batch doctor` shows every mode)")


def choose_kernels(path: Path, device: str, dtype_spec: str, quantize_spec: str,
                   dtype: str, quantize: str,
                   auto_quantize: Callable[[str], str]) -> KernelChoice:
    """The first mode the probe passes, from (`dtype`, `quantize`), what `auto` chose or
    the user named, on to the next where a choice was `auto` (`candidates`). Raises
    ModelError when none passes (an explicit mode the probe rejected among them)."""
    if not enabled():
        return KernelChoice(dtype, quantize)
    shapes = Shapes.of(path)
    rejected: list[tuple[str, str]] = []
    for dt, q in candidates(dtype_spec, quantize_spec, dtype, quantize, auto_quantize):
        mode = current_mode(device, dt, q)
        found = verdict(mode, shapes)
        if found.ok:
            return KernelChoice(dt, q, tuple(rejected))
        rejected.append((mode.label, found.reason or "rejected"))
    from aici_cli.core.errors import ModelError

    label, reason = rejected[0]
    others = "".join(f"; then {lb}: {r}" for lb, r in rejected[1:])
    raise ModelError(f"cannot run {label} on this machine ({fingerprint(device)}): the kernel "
                     f"probe found that {reason}{others}. Choose another mode (--dtype "
                     "float32, --quantize none), or let --dtype/--quantize auto pick one; "
                     "`aici-batch doctor` shows what runs here")


def candidates(dtype_spec: str, quantize_spec: str, dtype: str, quantize: str,
               auto_quantize: Callable[[str], str]) -> list[tuple[str, str]]:
    """The modes to try in order: the chosen one, then, where the quantisation was
    `auto`, int8 and unquantised; where the dtype was `auto`, the same in float32.
    `auto_quantize(dtype)` is what `--quantize auto` means at that dtype."""
    dtypes = [dtype] if dtype_spec != "auto" else list(dict.fromkeys([dtype, "float32"]))
    found: list[tuple[str, str]] = []
    for dt in dtypes:
        first = quantize if dt == dtype else (
            quantize if quantize_spec != "auto" else auto_quantize(dt))
        modes = [first] if quantize_spec != "auto" else [first, "int8", "none"]
        if first == "none" and quantize_spec == "auto":
            modes = ["none"]
        found += [(dt, q) for q in dict.fromkeys(modes) if (dt, q) not in found]
    return found


def enabled() -> bool:
    return os.environ.get(ENV, "").lower() not in ("off", "0", "false", "no")


def current_mode(device: str, dtype: str, quantize: str) -> KernelMode:
    """The mode this process would run in (its capability as torch chose it)."""
    import torch

    if device == "cuda":
        capability = torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        capability = cpu_features().capability
    return KernelMode(device, dtype, quantize, capability)


def verdict(mode: KernelMode, shapes: Shapes, code: str = "") -> Verdict:
    """The cached verdict of `mode` for `shapes` on this machine, else the probe's (run
    in a child now, and cached). `code`: a digest of kernels the project builds itself
    (`int_mm`), so that other code is probed again."""
    key = json.dumps({"probe": PROBE_VERSION, "torch": _torch_version(),
                      "machine": fingerprint(mode.device), "mode": asdict(mode),
                      "shapes": asdict(shapes), **({"code": code} if code else {})},
                     sort_keys=True)
    path = cache_dir() / "kernel-probe" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return Verdict(**{k: cached.get(k) for k in ("ok", "reason", "step_ms",
                                                          "max_error")})
    except (OSError, ValueError, TypeError):
        pass
    found = run_probe(mode, shapes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **asdict(found)}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache: probed again next time
    return found


def run_probe(mode: KernelMode, shapes: Shapes, timeout_s: float = TIMEOUT_S) -> Verdict:
    """Run `mode`'s kernels in a child process and judge them (never cached)."""
    env = dict(os.environ)
    if mode.device == "cpu":
        env["ATEN_CPU_CAPABILITY"] = mode.capability.lower()
    spec = json.dumps({"mode": asdict(mode), "shapes": asdict(shapes)})
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "aici_cli.models.checks.probe_child", spec],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"its kernels did not finish within {timeout_s:.0f} s (a hang)",
                       probe_s=time.perf_counter() - started)
    took = time.perf_counter() - started
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return Verdict(False, f"its kernels crashed the process ({name})", probe_s=took)
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return Verdict(False, f"its probe failed (exit {done.returncode}: {tail})",
                       probe_s=took)
    return Verdict(bool(answer["ok"]), answer.get("reason"), answer.get("step_ms"),
                   answer.get("max_error"), probe_s=took)


def fingerprint(device: str = "cpu") -> str:
    """The machine as its kernels see it: the GPU's name, or the CPU's fingerprint
    (`cpu_features.CpuFeatures.fingerprint`)."""
    if device == "cuda":
        import torch

        return f"cuda:{torch.cuda.get_device_name(torch.cuda.current_device())}"
    return cpu_features().fingerprint


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")
