"""The compiled CPU step as an AOTInductor package: built once per graph and machine,
ready in milliseconds after that.

`torch.compile` keeps its generated kernels in inductor's disk cache, but every run still
traces the 30-layer step with dynamo and loads what it made: ~5.5 s on a quiet 2-core
Xeon, ~9 s in a whole run. That is longer than a short run's whole decode, so the
compiled step never reached the runs that most need it. Here the same step
(`decode_layer.all_layers_step`) is exported once (`torch.export`) and compiled ahead of
time into a package (`torch._inductor.aoti_compile_and_package`), which a later run loads
through torch's C++ loader without importing inductor or tracing anything.

- **What a package holds**: the generated code only (~3 MB for the default model). Its
  weights are the model's own tensors, handed to it at load as user-managed constants
  (`package_constants_in_so=False`): nothing of the model is stored twice. The only
  constants the package needs besides them are the ones inductor makes while lowering
  (the int4 kernel's group size as a tensor); they are recorded at build time beside it.
- **What keys it** (`package_file`): everything the generated code depends on, and no
  weight value: each layer's tensor names, shapes and dtypes, its head counts and query
  scale, which layers slide (Gemma 3: they take the sliding tables), the
  row count B (the step's rows are static, as in the `torch.compile` graph), the source
  of the code it traces, torch's version and the machine's fingerprint (CPU model and
  instruction-set flags: a package built for AVX-512 must never run on an AVX2 CPU).
  Two models of one architecture and size share a package. The cache capacity and the
  cache's row count are dynamic dimensions: lines growing and batch sizes do not rebuild.
- **When it is built**: by a run with `--compile on` whose package is missing (~1–3 min
  on 2 cores, once), by `aici-batch prepare`, or by the builder process of a run at
  `--compile auto` (step_builds.py); checked against the eager step on the same inputs
  before it is published under its name; a package that disagrees is never published,
  and a `--compile on` run then compiles with `torch.compile` as before.
- **When it is used**: whenever it is ready, `--compile auto` included (compiled.py).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from aici_cli.core.cache_paths import cache_dir
from aici_cli.core.file_lock import exclusive_lock
from aici_cli.engine.forward import decode_layer
from aici_cli.engine.forward.decode_layer import (
    EAGER_ROUNDING,
    DecodeLayer,
    Tables,
    all_layers_step,
    slides,
)
from aici_cli.models.kernels import native_norm, rows_attention
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.kernels.probe import fingerprint

# 2: the step takes the sliding layers' tables (Gemma 3) after the caches.
PACKAGE_VERSION = 2
FOLDER = "compiled-steps"


class PackagedStep:
    """A loaded package: `all_layers_step` for B rows, over the model's own weights."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __call__(self, layers: list[DecodeLayer], h: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 pos: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                 sliding: Tables | None = None) -> torch.Tensor:
        """As `all_layers_step` (the layers are the package's constants already). The
        inputs in `_Step.forward`'s order, flattened: a model without sliding layers was
        exported with `sliding` None, which takes no input."""
        out = self._loader.run([h, cos, sin, pos, valid, mask, *keys, *values,
                                *(sliding or ())])
        return out[0]


class _Step(torch.nn.Module):
    """The exported module: its parameters' names are the package's constant names."""

    def __init__(self, layers: list[DecodeLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self._steps = layers  # the same modules, typed

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor],
                sliding: Tables | None = None) -> torch.Tensor:
        return all_layers_step(self._steps, h, cos, sin, keys, values, pos, valid, mask,
                               sliding)


def package_file(model: Any, rows: int, cache_rows: int) -> Path:
    """Where the package of `model`'s step at `rows` rows over a cache of `cache_rows`
    rows lives on this machine (computed from the model's own layers: no decode layer is
    built to ask). The cache's rows are a dynamic size from 2 up; export specializes a
    size of 1, so a one-row cache has packages of its own."""
    layers = model.model.layers
    attn = layers[0].self_attn
    # Every name, shared tensors included: stacking the layers for the step makes some
    # share one (an empty tensor), and the key must not change when it does.
    shapes = [[(name, list(t.shape), str(t.dtype)) for name, t in
               (*layer.named_parameters(remove_duplicate=False),
                *layer.named_buffers(remove_duplicate=False))] for layer in layers]
    # The operators' Python sides too: which calls a trace takes (rows_attention's dtypes)
    # is decided there.
    sources = [inspect.getsource(module) for module in
               (decode_layer, sys.modules[type(attn.q_proj).__module__],
                sys.modules[type(attn).__module__], rows_attention, native_norm)]
    config = model.config
    key = json.dumps({
        "version": PACKAGE_VERSION, "torch": torch.__version__, "rows": rows,
        "cache_rows": cache_rows if cache_rows < 2 else "2+",
        "machine": fingerprint("cpu"), "capability": cpu_features().capability,
        "layers": shapes, "types": [type(m).__name__ for m in layers[0].modules()],
        "config": [getattr(config, name, None) for name in (
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "rms_norm_eps", "attention_bias", "mlp_bias")],
        # The graph's constants beyond the shapes: the query scale (Gemma 3's is
        # query_pre_attn_scalar's) and which layers take the sliding tables.
        "scaling": float(attn.scaling), "sliding": [slides(layer) for layer in layers],
        "code": hashlib.sha256("".join(sources).encode()).hexdigest()}, sort_keys=True)
    return cache_dir() / FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"


def load(path: Path, layers: list[DecodeLayer]) -> PackagedStep | None:
    """The package at `path` over `layers`' weights, or None when there is none (~10 ms:
    torch's C++ loader, no inductor import)."""
    made = path.with_suffix(".constants.pt")
    if not path.is_file() or not made.is_file():
        return None
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    own = dict(_Step(layers).state_dict(keep_vars=True))
    constants = {name: t.detach() for name, t in own.items()}
    constants.update(torch.load(made, weights_only=True))
    wanted = loader.get_constant_fqns()
    missing = [name for name in wanted if name not in constants]
    if missing:
        raise RuntimeError(f"compiled step package {path.name} wants constants the model "
                           f"lacks: {', '.join(missing[:3])}")
    # user_managed: the package reads the model's tensors in place (no copy).
    loader.load_constants({name: constants[name] for name in wanted}, False, True, True)
    return PackagedStep(loader)


def build(path: Path, layers: list[DecodeLayer], example: tuple[Any, ...]) -> PackagedStep:
    """Export and compile the step for `example`'s rows (the arguments of
    `all_layers_step` but the layers, `sliding` included) into `path`, check it against
    the eager step on `example`, and return it loaded. Raises where any of that fails;
    nothing is stored then. `example`'s tensors are not changed."""
    with exclusive_lock(path.parent, path.stem):
        done = load(path, layers)
        if done is not None:  # another process built it meanwhile
            return done
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=".building-", suffix=".pt2")
        os.close(fd)
        tmp = Path(name)
        try:
            _export_and_compile(layers, example, tmp)
            step = load(tmp, layers)
            assert step is not None
            problem = _disagrees(step, layers, example)
            if problem:
                raise RuntimeError(f"the packaged step disagrees with the eager one: {problem}")
            # Published once checked, the package last (`load` wants both): a run that
            # looks for it meanwhile (step_builds.py) never finds one unchecked.
            os.replace(tmp.with_suffix(".constants.pt"), path.with_suffix(".constants.pt"))
            os.replace(tmp, path)
        finally:
            for p in (tmp, tmp.with_suffix(".constants.pt")):
                p.unlink(missing_ok=True)
    return step


def _export_and_compile(layers: list[DecodeLayer], example: tuple[Any, ...],
                        path: Path) -> None:
    """Write the package to `path` and its lowering constants beside it."""
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.graph import GraphLowering

    h, cos, sin, keys, values, pos, valid, mask, sliding = example
    if mask.shape[3] == keys[0].shape[2] > 2:
        # Sizes equal in the example would be traced as one: the span one slot short
        # (export reads its shape, not its values).
        mask = mask[..., :-1].contiguous()  # as step_tables makes it
        if sliding is not None:
            sliding = (*sliding[:2], sliding[2][..., :-1].contiguous())
    capacity = torch.export.Dim("capacity", min=2, max=1 << 20)
    span = torch.export.Dim("span", min=2, max=1 << 20)  # the slots attended, <= capacity
    kv: dict[int, Any] = {2: capacity}
    if keys[0].shape[0] >= 2:  # a one-row cache stays static (package_file)
        kv[0] = torch.export.Dim("cache_rows", min=max(2, h.shape[0]), max=1 << 16)
    shapes = {"h": None, "cos": None, "sin": None, "pos": None, "valid": None,
              "mask": {3: span}, "keys": [kv] * len(keys), "values": [kv] * len(values),
              "sliding": None if sliding is None else (None, None, {3: span})}
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own pickling of the program's tree specs, not ours to act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        program = torch.export.export(_Step(layers), (h, cos, sin, pos, valid, mask, keys,
                                                      values, sliding),
                                      dynamic_shapes=shapes, strict=False)
    made: dict[str, torch.Tensor] = {}
    original = GraphLowering.add_tensor_constant

    def recorded(self: Any, data: torch.Tensor, name: str | None = None) -> Any:
        before = set(self.constants)
        out = original(self, data, name)
        if name is None:  # made by a lowering (the weights come named)
            for new in set(self.constants) - before:
                made[new] = data.detach().clone()
        return out

    GraphLowering.add_tensor_constant = recorded  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
            aoti_compile_and_package(program, package_path=str(path), inductor_configs={
                "aot_inductor.package_constants_in_so": False, **EAGER_ROUNDING})
    finally:
        GraphLowering.add_tensor_constant = original  # type: ignore[method-assign]
    torch.save(made, path.with_suffix(".constants.pt"))


def _disagrees(step: PackagedStep, layers: list[DecodeLayer],
               example: tuple[Any, ...]) -> str | None:
    """Why the package's output and cache writes are not the eager step's on `example`
    (None: they agree within the dtype's rounding over the layers)."""
    h, cos, sin, keys, values, pos, valid, mask, sliding = example
    ours = ([k.clone() for k in keys], [v.clone() for v in values])
    theirs = ([k.clone() for k in keys], [v.clone() for v in values])
    with torch.no_grad():
        want = all_layers_step(layers, h, cos, sin, *theirs, pos, valid, mask,
                               sliding).float()
        got = step(layers, h, cos, sin, *ours, pos, valid, mask, sliding).float()
    # On the int kernels the activations are rounded to 8 bits: where the graph's float32
    # input and the eager one differ in their last bit, a value can round to the next
    # code, and that step grows over the layers (1.6% of the output's scale seen on the
    # default model forced to AVX2): bf16's tolerance then, as the rounding is as coarse.
    int_kernels = any(getattr(m, "vnni", False) for layer in layers for m in layer.modules())
    tolerance = 1e-3 if h.dtype == torch.float32 and not int_kernels else 6e-2
    scale = want.abs().max().clamp(min=1.0)
    if not torch.isfinite(got).all() or (got - want).abs().max() > tolerance * scale:
        return f"output off by {float((got - want).abs().max()):.3g} (scale {float(scale):.3g})"
    for mine, eager in zip([*ours[0], *ours[1]], [*theirs[0], *theirs[1]]):
        if (mine.float() - eager.float()).abs().max() > tolerance * scale:
            return "the cache writes differ"
    return None
