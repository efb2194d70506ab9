"""The compiled one-token decode step (`--compile`), gpt-fast's recipe on the row cache.

A step where every row feeds one sampled token is most of a run's passes, and in eager
PyTorch it pays a dispatch per op: ~15 ops per layer, 30 layers. Here that step runs
`torch.compile`d (decode_layer.py: on CPU one graph for all layers, on CUDA one per layer
replayed as CUDA graphs; q/k/v and gate/up stacked into one matrix each), called with
static shapes:

- rows: on CUDA the cache rows 0..B-1 for the smallest bucket B in `BUCKETS` (or the batch
  size) that holds the step's span; on CPU one graph for the run, of every row of the
  cache, or, where the run's first compiled step knows no line can come any more (a
  one-line input, the last lines of a small file), of the smallest bucket that holds the
  rows still busy: a single stream computes one row, not the batch size's (at batch size
  8, 78 against 29 ms a step, int4, 2 AVX2 cores). Rows sitting the step out ride along
  as idle rows;
- keys: each row attends with a mask by position (slot s is visible to a row at position
  p iff s <= p), so its length does not change a shape. Over the whole cache capacity
  (CUDA graphs replay one shape; torch.compile's graph on CPU); a packaged step
  (packaged_step.py, what CPU runs take) over the step's span of slots, the
  highest position fed plus one rounded up to SPAN_QUANTUM (`span_slots`), a dynamic
  dimension of its own like the capacity (which doubles as lines grow): no recompile
  either way. Reading the whole capacity cost the default model's 8-row step 16.5,
  19.6, 25.3 and 38.0 ms at a capacity of 256, 512, 1,024 and 2,048 slots, rows under
  150 positions each (int4, 2 cores forced to AVX2): the keys' read grows with it; over
  the span, 13.9-14.2 ms at 1,024 and 2,048.

An idle row's query is at position 0 and it writes back the key its slot 0 already holds,
so it changes nothing; its logits are dropped. Each row writes only its own row, so no
two writes meet. The embedding (Gemma's scale included), the rotary tables, the masks,
the final norm and the output projection (over the span's rows only) stay eager: a few
ops each.

The families compiled:

- Llama-shaped decoder layers (Llama, Mistral, Qwen 2 and Qwen 3: norm, attention with
  RoPE, Qwen 3's q/k norms, norm, MLP, both residuals), as the project's own module or
  transformers' classes, with one sliding window for every layer at most (Mistral
  v0.1's: the mask by position also hides the slots before it; Qwen's window on some
  layers only is not);
- Gemma 3 (text), only as the project's own module builds it (models/families/llama.py;
  transformers' Gemma 3 classes, and the configs that module refuses, stay eager): its
  four norms a layer, q/k norms, query scale and GELU are the layer's (decode_layer.py),
  its embedding scale the eager embedding's, and its two layer kinds each take a RoPE
  table and a mask of their own, made here per step (`step_tables`): the full layers
  the global base and the plain mask, the sliding layers the local base and a mask that
  also hides the slots before the window (slot s is visible to a row at position p iff
  p - window < s <= p, as the eager passes' sliding mask).

Other models, and the ragged prefill and fast-forward passes, run eagerly as before
(passes.py). Compiled kernels are cached on disk by inductor (`TORCHINDUCTOR_CACHE_DIR`,
by default under the system temp directory), so a second run pays tracing, not code
generation. On CUDA the same functions run in `reduce-overhead` mode (CUDA graphs).

`--deterministic` never uses this path: its passes are batch-invariant by construction
(engine/forward/deterministic.py), which compiled kernels are not shown to be.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from aici_cli.core.errors import one_line
from aici_cli.engine.forward import packaged_step
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.decode_layer import LayerGraphs, Tables, layer_graphs
from aici_cli.models.families.llama import LlamaCausalLM

# Row-count buckets of the compiled step: each is compiled once, on first use.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Model types whose decoder layer is the Llama layer (with or without projection biases).
_LLAMA_SHAPED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Model types compiled only as the project's own module builds them (Gemma 3 text: its
# layer kinds, RoPE tables and norms are read as models/families/llama.py names them).
_OWN_MODULE_ONLY = frozenset({"gemma3_text"})


def unsupported(model: Any) -> str | None:
    """Why the compiled step cannot run `model` (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind in _OWN_MODULE_ONLY:
        if not isinstance(model, LlamaCausalLM):
            return f"model type {kind!r} through transformers' classes"
        # The own module builds neither (decoder_shape.py): a guard, not a path.
        if getattr(config, "attn_logit_softcapping", None) \
                or getattr(config, "final_logit_softcapping", None):
            return "soft-capped logits"
    elif kind not in _LLAMA_SHAPED:
        return f"model type {kind!r} is not Llama-shaped"
    elif _window(config) is None and getattr(config, "sliding_window", None) \
            and getattr(config, "use_sliding_window", True):
        return "sliding-window attention on some layers"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not hasattr(model.model, "rotary_emb"):
        return "no decoder layers where a Llama model has them"
    return None


def _window(config: Any) -> int | None:
    """The sliding window every layer has (Mistral v0.1: `sliding_window`, no
    `layer_types`), or None (no window, or not on every layer)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "layer_types", None) \
            or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


# The CPU step's span of slots is rounded up to a multiple of this: a step reads at most
# this many slots a row more than its highest position needs.
SPAN_QUANTUM = 16


def span_slots(positions: list[int], capacity: int) -> int:
    """The slots a CPU step attends over: the highest of `positions` (the rows' fed
    positions) plus one, rounded up to SPAN_QUANTUM, at least 2 (the package's dynamic
    size starts there), at most `capacity`."""
    need = max(positions, default=0) + 1
    return min(capacity, max(2, -(-need // SPAN_QUANTUM) * SPAN_QUANTUM))


def step_tables(model: Any, h: torch.Tensor, pos: torch.Tensor,
                capacity: int) -> tuple[Tables, Tables | None]:
    """The RoPE tables and mask of a step whose rows are at positions `pos` [B] (h: the
    embedded tokens [B, hidden], for the tables' dtype and device) over the first
    `capacity` slots of the cache (all of them, or the step's span): those of every layer
    (Gemma 3: of its full layers), and those of its sliding layers where some layers
    slide and others need not (Gemma 3's `layer_types`; None: no such layers). cos/sin
    [B, 1, D]; masks [B, 1, 1, C] bool: slot s is visible to a row at position p iff
    s <= p, and under a window w also s > p - w. The graph attends over as many slots as
    the mask has."""
    inner, config = model.model, model.config
    # The own module keeps a RoPE table per layer kind where their bases differ.
    per_kind = bool(getattr(config, "rope_thetas", None))

    def rope(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        named = (kind,) if per_kind else ()
        return inner.rotary_emb(h[:, None], pos[:, None], *named)

    slots = torch.arange(capacity, device=h.device)[None, :]
    visible = slots <= pos[:, None]
    window = _window(config)
    if window is not None:  # as the packed passes' sliding mask: the last `window` slots
        visible &= slots > pos[:, None] - window
    plain = (*rope("full_attention"), visible[:, None, None])
    if "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return plain, None
    sliding = visible & (slots > pos[:, None] - int(config.sliding_window))
    return plain, (*rope("sliding_attention"), sliding[:, None, None])


def compiler_problem(device: torch.device) -> str | None:
    """Why inductor cannot build kernels here (None: it can): CPU code needs a C++
    compiler; CUDA code needs Triton."""
    if device.type == "cpu":
        return None if shutil.which("g++") or shutil.which("c++") else "no C++ compiler"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    return f"device {device.type!r}"


class NoPackage(RuntimeError):
    """A step `auto` chose for its packaged step found none it could load: the run goes
    on eagerly (passes.py), not through seconds of torch.compile."""


class CompiledDecode:
    """The compiled one-token step over a model and its row cache."""

    def __init__(self, model: Any, cache: RowCache, rows: int, device: torch.device,
                 build_packages: bool = False) -> None:
        """`build_packages`: on CPU, a bucket without a packaged step builds one
        (packaged_step.py; `--compile on` and `auto`); else it compiles with
        `torch.compile`."""
        self.model = model
        self.cache = cache
        self.rows = rows
        self.device = device
        self.build_packages = build_packages
        self.package_problem: str | None = None  # why a package was not built or loaded
        # Whether a bucket without a package may compile with torch.compile (seconds of
        # tracing): False for `auto` when it chose this step for a ready package alone.
        self.may_trace = True
        self._package_ready: dict[int, bool] = {}
        # While a builder makes packages (step_builds.py), a bucket found without one is
        # looked for again, at most every `recheck_s` seconds (0: never again).
        self.recheck_s = 0.0
        self._checked_at: dict[int, float] = {}
        self._paths: dict[int, Path] = {}
        self._graphs: LayerGraphs | None = None
        self.compile_s: dict[int, float] = {}  # bucket -> seconds its first call took
        self.steps = 0
        self._marked_capacity = 0
        self._cpu_rows: int | None = None  # the CPU graph's rows, fixed at its first call

    @property
    def graphs(self) -> LayerGraphs:
        """The model's decode layers and graphs, made at the first compiled step: a run
        that stays eager never stacks the layers' projections (~0.1 s at start-up)."""
        if self._graphs is None:
            self._graphs = layer_graphs(self.model, self.device)
        return self._graphs

    def bucket(self, span_end: int, rows_bound: int = 0) -> int:
        """The rows 0..B-1 a step whose span ends at row `span_end` (exclusive) runs on;
        `rows_bound`: the rows the run can still occupy (0: unknown).

        On CUDA the smallest bucket that holds the span. On CPU one graph of all layers
        recompiles in seconds (~10 s warm on a Xeon, ~25 s on an AVX2 EPYC), so a run
        keeps the graph of its first compiled step: of every row, or of the smallest
        bucket that holds `rows_bound` where that is known. A run's tail of fewer rows
        rides along in it, unless a smaller bucket that holds it has a packaged step
        ready: that loads in ~10 ms, and the tail's steps cost its rows' (one row of the
        default model, int4, on the AMX Xeon: 7 ms a step against 22 ms for 8 rows). A
        span past it (a fork's branch) takes the graph of every row from then on."""
        if self.device.type == "cuda":
            return smallest_bucket(span_end, self.rows)
        rows = self._cpu_rows
        if rows is None:
            rows = smallest_bucket(max(span_end, rows_bound), self.rows) if rows_bound \
                else self.rows
        elif rows_bound:
            tail = smallest_bucket(max(span_end, rows_bound), self.rows)
            if tail < rows and self._has_package(tail):
                rows = tail
        return rows if span_end <= rows else self.rows

    def run(self, first_row: int, lengths: list[int], tokens: list[int | None],
            rows_bound: int = 0, project: bool = True) -> torch.Tensor:
        """Rows `first_row + i` feed `tokens[i]` (None: sits out) at position `lengths[i]`.
        The cache must already hold a capacity past every fed position. Returns the
        next-token logits [len(tokens), V] (a sitting-out row's are to be ignored), or with
        `project` False the final hidden states [len(tokens), hidden] (for the masked
        projection)."""
        b = len(tokens)
        rows = self.bucket(first_row + b, rows_bound)
        if self.device.type != "cuda":
            self._cpu_rows = rows
        ids = [0] * rows
        pos = [0] * rows
        valid = [False] * rows
        for i, (length, tok) in enumerate(zip(lengths, tokens)):
            if tok is not None:
                ids[first_row + i], pos[first_row + i] = tok, length
                valid[first_row + i] = True
        dev = self.device
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        valid_t = torch.tensor(valid, dtype=torch.bool, device=dev)
        started = time.perf_counter() if rows not in self.compile_s else None
        inner = self.model.model
        # [B, hidden]; Gemma's embedding scale is its embedding module's, as in the eager pass.
        h = inner.embed_tokens(ids_t)
        capacity = self.cache.capacity
        # A packaged step attends over the step's span; torch.compile's graph over the
        # whole capacity (its dynamic mask size would take the capacity's symbol where
        # the two sizes first meet equal, and recompile when they part).
        packaged = dev.type != "cuda" and (started is not None
                                           or self._key(rows) in self.graphs.packaged)
        slots = span_slots(pos, capacity) if packaged else capacity
        (cos, sin, mask), sliding = step_tables(self.model, h, pos_t, slots)
        if dev.type == "cuda":
            self._static_cache_addresses()
        elif started is not None:
            self._packaged(rows, (h, cos, sin, self.cache.keys, self.cache.values, pos_t,
                                  valid_t, mask, sliding))
            if self._key(rows) not in self.graphs.packaged:
                if not self.may_trace:
                    raise NoPackage(f"the packaged step for {rows} rows did not load "
                                    f"({self.package_problem or 'none built'}), and too "
                                    "little work is ahead to trace one")
                (cos, sin, mask), sliding = step_tables(self.model, h, pos_t, capacity)
        h = self.graphs.forward(h, cos, sin, self.cache.keys, self.cache.values, pos_t,
                                valid_t, mask, sliding)
        span = h[first_row : first_row + b]
        final = inner.norm(span)  # the projection runs eagerly, outside the graphs
        logits = self.model.lm_head(final) if project else final
        if started is not None:
            self.compile_s[rows] = time.perf_counter() - started
        self.steps += 1
        return logits

    def package_ready(self, span_end: int, rows_bound: int = 0) -> bool:
        """Whether the bucket a step of this span would run on has a packaged step on
        this machine (CPU; a file check, once per bucket)."""
        if self.device.type == "cuda":
            return False
        return self._has_package(self.bucket(span_end, rows_bound))

    def _has_package(self, rows: int) -> bool:
        """Whether `rows` rows have a packaged step: loaded, or on disk (a file check,
        once per bucket, or again every `recheck_s` while it is missing)."""
        if self._graphs is not None and self._key(rows) in self._graphs.packaged:
            return True
        now = time.perf_counter()
        if rows not in self._package_ready or not self._package_ready[rows] and \
                self.recheck_s and now - self._checked_at[rows] >= self.recheck_s:
            self._package_ready[rows] = self.package_path(rows).is_file()
            self._checked_at[rows] = now
        return self._package_ready[rows]

    def _packaged(self, rows: int, example: tuple[Any, ...]) -> None:
        """Give the graphs the packaged step for `rows` rows: loaded where one was built,
        else built now if this step builds packages. Where neither works, the bucket
        compiles with `torch.compile` (`package_problem` says why)."""
        graphs = self.graphs
        if self._key(rows) in graphs.packaged:
            return
        path = self.package_path(rows)
        try:
            step = packaged_step.load(path, graphs.layers)
            if step is None and self.build_packages:
                step = packaged_step.build(path, graphs.layers, example)
        except Exception as e:  # a toolchain or export problem: torch.compile instead
            self.package_problem = one_line(e, 300)
            return
        if step is not None:
            graphs.packaged[self._key(rows)] = step

    def package_path(self, rows: int) -> Path:
        """Where this cache's packaged step at `rows` rows lives (computed once)."""
        if rows not in self._paths:
            self._paths[rows] = packaged_step.package_file(self.model, rows, self.cache.rows)
        return self._paths[rows]

    def _key(self, rows: int) -> tuple[int, bool]:
        """The graphs' key of this cache's packaged step at `rows` rows (the graphs are
        the model's, shared by engines of other cache sizes)."""
        return rows, self.cache.rows == 1

    def _static_cache_addresses(self) -> None:
        """CUDA graphs replay fixed addresses: the cache buffers, written in place, are
        marked static (again after a capacity growth replaced them)."""
        if self._marked_capacity == self.cache.capacity:
            return
        for buf in (*self.cache.keys, *self.cache.values):
            torch._dynamo.mark_static_address(buf)
        self._marked_capacity = self.cache.capacity


def step_row_counts(batch_size: int) -> tuple[int, ...]:
    """The row counts a CPU run's compiled steps take at `batch_size` (`bucket`): every
    row, and each smaller bucket its tail may move down to."""
    return (*(b for b in BUCKETS if b < batch_size), batch_size)


def smallest_bucket(rows: int, cap: int) -> int:
    """The graph rows that hold `rows` rows: the smallest of `BUCKETS` up to `cap`, else
    `cap` (the cache's rows)."""
    return next((b for b in BUCKETS if rows <= b <= cap), cap)
