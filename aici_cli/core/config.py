"""The settings of a run, as frozen dataclasses: what the CLI builds from its options.

Torch-free, so `aici-batch --help` and the other light commands never load the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aici_cli.core.constraint import Constraint
from aici_cli.core.sampling import RUN_OPTIONS, Sampling


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 8
    fast_forward: bool = True
    step_stats: bool = False
    strict_json: bool = True
    initial_capacity: int = 256
    # Prompt-lookup draft length for greedy rows (see draft.py); below 2: no drafts.
    draft_tokens: int = 4
    # Reuse the keys a row holds for a new line whose prompt starts the same (rows.py).
    prefix_cache: bool = True
    # A 16-bit run's prompt tokens on the dense copies in one GEMM a pass, not in tiles of
    # one shape (models/quant/prompt_tokens.py): faster prefill where the copies pay (AMX),
    # a line's text then depending on the lines that share its passes.
    wide_prefill: bool = False
    # Lines read ahead of admission, to admit those whose prefix is cached first.
    lookahead: int = 64
    # Logprobs from the model's distribution ("raw", as OpenAI and vLLM) or from the one
    # the constraint leaves ("masked": renormalized over the allowed tokens).
    logprobs_mode: str = "raw"
    # Finish a constrained value (JSON schema, grammar, tool calls) before max_tokens cuts
    # it off, and when it loops (control/grammar/early_close.py). On by default: an
    # output that finishes on its own without looping is unchanged by either.
    close_at_limit: bool = True
    loop_guard: bool = True
    # The deterministic mode (engine/forward/deterministic.py), its passes batch-invariant:
    # a line's tokens do not depend on its batch, row, drafts or prefix-cache hits. Off by
    # default: it costs throughput.
    deterministic: bool = False
    # With `deterministic`: first check that this machine's kernels keep the promise
    # (engine/deterministic_check.py, cached per machine); the check's own engines do not.
    check_invariance: bool = True
    # Times a line generated with a relaxed schema (`--schema-fallback relax`) is generated
    # again, with another seed, when its output does not validate (engine/retry.py).
    schema_retries: int = 2
    # Sequences a line may run in all when its controller forks (engine/branches.py): its
    # samples and every fork's branches; a fork past it ends the line with bad_action.
    max_branches: int = 16
    # torch.compile the one-token decode step (engine/forward/compiled.py): "auto" (where its
    # package is built, else eager while a builder process makes it, decode_steps.py; never
    # with `deterministic`), "on", "off".
    # The CLI's default is "auto"; the library's "off" (tests and benches say so).
    compile: str = "off"


MIB = 1024 * 1024

# A line field -> the run option that sets its default, for messages that name the option
# (the up-front check of the defaults, jobs/defaults.py; a resume's mismatch, made_with.py).
FIELD_OPTIONS = {
    "json_schema": "--json-schema", "regex": "--regex", "choices": "--choices",
    "stop": "--stop", "max_tokens": "--max-tokens",
    **{option.name: option.flag for option in RUN_OPTIONS},
    "ignore_eos": "--ignore-eos", "n": "--n", "logprobs": "--logprobs", "score": "--score",
    "schema_fallback": "--schema-fallback", "grammar": "--grammar",
}


@dataclass(frozen=True)
class JobDefaults:
    """CLI-level defaults; a line's own fields override them.

    The `max_*` limits are not per-line settings: they bound what one hostile line can
    cost (memory, parser and schema-checker time, grammar compile time), and a line past
    one becomes an error result like any other bad line.
    """

    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)  # --temperature, --seed, ...
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    n: int = 1
    score: bool = False  # rank a line's choices by log-likelihood instead of generating
    logprobs: int | None = None  # top alternatives per token for every line; None: off
    ignore_eos: bool = False
    schema_fallback: str = "off"  # "relax": relax JSON schemas the grammar engine refuses
    # A line's size in UTF-8 bytes, without its line ending; checked before decoding.
    max_line_bytes: int = 8 * MIB
    # A line's `json_schema`, `regex` or `choices` as compact JSON: the grammar compiler's
    # time grows with it (about 10 s at 1 MiB), and real schemas stay far below.
    max_constraint_bytes: int = MIB
    # Nesting of arrays and objects, the line itself being level 1. Beyond about 125
    # levels llguidance refuses a schema and recursive checks come near Python's stack
    # limit, so deeper lines are refused here with a message that says so.
    max_depth: int = 100


@dataclass(frozen=True)
class RayOptions:
    """`--ray`: run the lines on Ray actors, one model and one engine each
    (aici_cli/run/distributed)."""

    address: str = "auto"  # "auto": RAY_ADDRESS, a running local cluster, or a new one
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0  # Ray's num_cpus, and the worker's torch threads
    # Lines per chunk handed to a worker (None: the batch size), and chunks each worker
    # may hold at once: together they bound the lines in flight (backpressure).
    chunk_lines: int | None = None
    chunks_in_flight: int = 4


@dataclass(frozen=True)
class ToolServer:
    """`--mcp NAME=TARGET`: an MCP server the run starts (a command line, spoken to over
    stdio) or connects to (an http:// or https:// URL, streamable HTTP)."""

    name: str
    target: str

    @property
    def url(self) -> bool:
        return self.target.startswith(("http://", "https://"))


@dataclass(frozen=True)
class ToolOptions:
    """The tools the host serves to a run's lines (aici_cli/run/tools): their servers,
    or a record of their answers to replay, the limits on each call, and those its
    controllers may call."""

    servers: tuple[ToolServer, ...] = ()
    # Rounds of calls a line may make before its next calls are handed back unrun.
    max_rounds: int = 8
    call_timeout_s: float = 30.0
    # A result longer than this (UTF-8 bytes) is the line's error: it would fill the
    # context, and a server that returns megabytes is misbehaving.
    result_bytes: int = 64 * 1024
    # Restarts of each crashed server this run (run/tools/restarts.py); past them its
    # calls fail at once.
    restarts: int = 16
    record: str | None = None  # every call and its answer, as JSON lines
    replay: str | None = None  # answer from such a file; no server runs
    # --allow-tool: the served tools the run's controllers may call (aici:tools).
    allowed: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.servers) or self.replay is not None


@dataclass(frozen=True)
class RunConfig:
    input: str  # path or "-"
    output: str = "-"  # path or "-"
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # Weight-only quantisation (models/quant/quantize.py): auto, none, int8, int4.
    quantize: str = "auto"
    # Who builds the model (models/load.py): auto (the families of
    # models/families/decoder_shape.py: models/families/llama.py), or
    # transformers. The logits are the same either way.
    model_impl: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    defaults: JobDefaults = field(default_factory=JobDefaults)
    stats_out: str | None = None
    quiet: bool = False
    controller: str | None = None  # path of a .wasm controller component
    controller_arg: str = ""  # its argument, for lines without their own `controller_arg`
    controller_call_ms: int = 50  # deadline per guest call
    resume: bool = False  # skip lines whose result is already in `output`, append the rest
    # With `resume`: keep results made with other options (`made_with`) instead of refusing.
    resume_mixed: bool = False
    input_format: str = "auto"  # "aici", "openai" (batch requests), or "auto": by the lines
    exit_zero_on_line_errors: bool = False  # exit 0 though some lines ended in an error
    ray: RayOptions | None = None  # None: run in this process
    plain_http: bool = False  # an oci:// controller's registry speaks HTTP, not HTTPS
    trace: str | None = None  # OTLP JSON spans of the run go here (aici_cli/run/tracing.py)
    threads: int | None = None  # torch's CPU threads; None: the CPUs this process may use
    # Where a local run's engine runs: "child", a process of its own that the run restarts
    # when it dies (backends/supervised.py), or "inline", this process (a traced run
    # always: its tracer attaches to the engine). Ray runs ignore it.
    engine_process: str = "child"
    ordered: bool = False  # results in input order (aici_cli/run/ordered.py)
    tools: ToolOptions = field(default_factory=ToolOptions)  # --mcp and its options
    progress_interval_s: float = 10.0  # off a terminal: a progress line this often; 0: none


# The options under which `--quantize auto` loads the weights unquantised: each asks for
# the model's own numbers (scores and logprobs that match transformers, float32 as the
# user wrote it, batch-invariant passes, which are established for the dense path only).
# `--dtype auto` choosing float32 on a CPU without bf16 is not among them: that run keeps
# the int kernels (`quant/quantize.py: resolve_mode`), and says so in `made_with`.
EXACT_OPTIONS = ("--dtype float32", "--score", "--logprobs", "--deterministic")


def exact_options(config: RunConfig) -> list[str]:
    """Which of `EXACT_OPTIONS` the run sets (in that order)."""
    chosen = {
        "--dtype float32": config.dtype == "float32",
        "--score": config.defaults.score,
        "--logprobs": config.defaults.logprobs is not None,
        "--deterministic": config.engine.deterministic,
    }
    return [flag for flag in EXACT_OPTIONS if chosen[flag]]


def load_quantize(config: RunConfig) -> str:
    """The `--quantize` the model loads with: `auto` is `none` where the run sets one of
    `EXACT_OPTIONS`; anything else as the option says."""
    if config.quantize == "auto" and exact_options(config):
        return "none"
    return config.quantize
