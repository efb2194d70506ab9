"""Dense copies of the int4 layers for prompt tokens (models/quant/dense_copies.py,
prompt_tokens.py): the copy is the kernel's own weights; whether it is made is decided once,
before the first prompt token, only where the trial finds it faster and it fits; from
then on a pass's prompt tokens run on it in tiles of one shape, every other token on the
int4 kernel, a prompt token's bits the same whatever shares its pass; the engine's outputs
stay within rounding of the int4 kernel's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.engine import Engine
from aici_cli.models.cache import packed_layers
from aici_cli.models.load import load_model
from aici_cli.models.quant import dense_copies, prompt_tokens
from aici_cli.models.quant.dense_copies import WideRows, dense_weight
from aici_cli.models.quant.quantize import GROUP, Int4Linear, quantize_int4


def _layer(n: int, k: int, seed: int = 0) -> Int4Linear:
    torch.manual_seed(seed)
    codes, d, m = quantize_int4(torch.randn(n, k))
    return Int4Linear(codes, d, m, None, torch.bfloat16)


def _kernel(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, GROUP,
                                                      layer.scale_zero)


@pytest.mark.parametrize("n,k", [(64, 64), (192, 576), (576, 1536)])
def test_the_dense_copy_is_the_kernels_own_weights(n: int, k: int) -> None:
    layer = _layer(n, k)
    dense = dense_weight(layer)
    assert dense.shape == (n, k) and dense.dtype == torch.bfloat16
    # Column j of the kernel's output for the unit vector e_i is weight[j, i].
    for i in (0, k // 3, k - 1):
        unit = torch.zeros(1, k, dtype=torch.bfloat16)
        unit[0, i] = 1
        assert torch.equal(_kernel(layer, unit)[0], dense[:, i])
    x = torch.randn(40, k, dtype=torch.bfloat16)
    ref, alt = _kernel(layer, x).float(), torch.nn.functional.linear(x, dense).float()
    assert (ref - alt).abs().max() <= 0.02 * ref.abs().max()  # rounding only


@given(st.integers(1, 100), st.integers(1, 8), st.sampled_from([64, 32]))
def test_unpacking_undoes_each_layout_exactly(pairs: int, groups: int, block: int) -> None:
    """Codes of any even row count (whole blocks and a rest) and K a multiple of 32 come
    back from each AVX layout's bytes as they went in, and from this machine's layout
    where it has an inverse."""
    n, k = 2 * pairs, GROUP * groups
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    assert torch.equal(packed_layers._unlanes(block)(packed_layers._lanes(block)(codes),
                                                      n, k), codes)
    unpacked = packed_layers.unpack_int4_cpu(packed_layers.pack_int4_cpu(codes), n, k)
    assert unpacked is None or torch.equal(unpacked, codes)


def test_the_unpacked_copy_is_taken_only_where_it_gives_the_kernels_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where unpacking gives no codes (a layout without an inverse) or the probe finds the
    widening rounds otherwise, the copy is the kernel's own widening; either way its bits."""
    layer = _layer(128, 64)
    made = dense_weight(layer)
    monkeypatch.setattr(packed_layers, "unpack_int4_cpu", lambda *_: None)
    assert torch.equal(dense_weight(layer), made)
    monkeypatch.undo()
    monkeypatch.setattr(dense_copies, "_unpacked_exact", lambda: False)
    monkeypatch.setattr(dense_copies, "_widened", lambda *_: pytest.fail("widened unpacked"))
    assert torch.equal(dense_weight(layer), made)


def test_the_choice_is_taken_once_before_the_first_prompt_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [_layer(128, 64, seed) for seed in range(3)]
    wide = WideRows(layers)
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)  # whatever this CPU measures
    for _ in range(10):
        wide.before_pass(0)  # passes of generated tokens only never decide
    assert wide.state == "undecided" and all(layer.dense is None for layer in layers)
    wide.before_pass(1)  # the first prompt token, however few
    assert wide.state == "dense" and f"at {prompt_tokens.TILE_ROWS} rows" in (wide.reason or "")
    assert all(layer.dense is not None for layer in layers)
    # Another engine over the same layers finds the copies made.
    assert WideRows(layers).state == "undecided"
    again = WideRows.for_model(torch.nn.Sequential(*layers))
    assert again is not None and again.dense


def test_a_passs_prompt_tokens_run_on_the_copy_and_the_rest_on_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    layer = _layer(128, 64)
    WideRows([layer]).before_pass(1)
    assert layer.dense is not None
    x = torch.randn(30, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), _kernel(layer, x))  # outside a pass: the kernel
    runs = [(2, 5), (10, 1), (20, 10)]
    with prompt_tokens.feeding(runs, 30, x.device):
        y = layer(x)
        assert torch.equal(layer(x[:29]), _kernel(layer, x[:29]))  # not the pass's rows
    prompt = [p for start, n in runs for p in range(start, start + n)]
    others = [p for p in range(30) if p not in prompt]
    assert torch.equal(y[prompt], prompt_tokens.tiled_linear(x[prompt], layer.dense))
    assert torch.equal(y[others], _kernel(layer, x[others]))


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 300), at=st.integers(0, 299), seed=st.integers(0, 2**16))
def test_a_prompt_tokens_bits_do_not_depend_on_the_tokens_beside_it(
        count: int, at: int, seed: int) -> None:
    """A prompt token's row through the tiles, alone and among `count` other prompt
    tokens at any place: the same bits (a dense GEMM of the pass's width would round it
    by that width)."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(192, 576, generator=generator) * 0.05).to(torch.bfloat16)
    x = torch.randn(count, 576, generator=generator).to(torch.bfloat16)
    token = torch.randn(1, 576, generator=generator).to(torch.bfloat16)
    at = at % (count + 1)
    beside = torch.cat([x[:at], token, x[at:]])
    assert torch.equal(prompt_tokens.tiled_linear(beside, weight)[at],
                       prompt_tokens.tiled_linear(token, weight)[0])


def test_no_copy_where_the_trial_finds_no_gain_or_it_does_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow = WideRows([_layer(128, 64)])
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 1e9)
    slow.before_pass(64)
    assert slow.state == "int4" and slow.layers[0].dense is None
    assert "against the int4 kernel" in (slow.reason or "")
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    slow.before_pass(10_000)  # decided: never tried again
    assert slow.layers[0].dense is None

    big = WideRows([_layer(128, 64)])
    monkeypatch.setattr(dense_copies, "budget_bytes", lambda: 1000)
    big.before_pass(64)
    assert big.state == "int4" and "does not fit" in (big.reason or "")
    assert big.layers[0].dense is None


def test_a_run_with_wide_passes_keeps_the_int4_runs_tokens_within_rounding(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model at int4 (bf16), a long prompt then greedy decode: the first
    next-token logits of a run whose passes run dense against one whose passes do not."""
    prompt = " ".join(f"word{i}" for i in range(60))
    job = Job(index=1, id="1", prompt=prompt, messages=None, max_tokens=4,
              ignore_eos=True, logprobs=5)

    def run(dense: bool) -> tuple[list[dict[str, object]], str]:
        lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16",
                        quantize="int4")
        monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0 if dense else 1e9)
        engine = Engine(lm, EngineConfig(batch_size=2, draft_tokens=0, compile="off"))
        results: list[dict[str, object]] = []
        engine.run([job], results.append)
        wide = engine.runner.model_pass.wide
        assert wide is not None
        return results[0]["logprobs"], wide.state  # type: ignore[return-value]

    plain, state = run(dense=False)
    assert state == "int4"
    dense, state = run(dense=True)
    assert state == "dense"
    first_plain, first_dense = plain[0], dense[0]
    assert abs(first_plain["logprob"] - first_dense["logprob"]) < 0.05  # type: ignore[operator]
    assert first_plain["id"] == first_dense["id"]


@pytest.mark.parametrize("files,room", [
    ({"memory.max": "1000000\n", "memory.current": "250000\n"}, 750000),
    ({"memory.max": "max\n", "memory.current": "250000\n"}, None),
    ({"memory/memory.limit_in_bytes": "2000\n", "memory/memory.usage_in_bytes": "500\n"}, 1500),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n",
      "memory/memory.usage_in_bytes": "5\n"}, None),
    ({}, None),
])
def test_a_containers_memory_limit_bounds_the_copy(tmp_path: Path, files: dict[str, str],
                                                   room: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert dense_copies.cgroup_room(str(tmp_path)) == room
    monkeypatch.setattr(dense_copies, "cgroup_room", lambda: 4000)
    assert dense_copies.budget_bytes() == 1000  # a quarter of the cgroup's room


def test_a_copy_that_cannot_be_made_leaves_the_int4_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [_layer(128, 64, seed) for seed in range(3)]
    made: list[Int4Linear] = []

    def fails_on_the_third(layer: Int4Linear) -> torch.Tensor:
        made.append(layer)
        if len(made) == 3:  # the trial's (its layer's copy too), another, then out of memory
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return torch.zeros(layer.out_features, layer.in_features, dtype=torch.bfloat16)

    monkeypatch.setattr(dense_copies, "dense_weight", fails_on_the_third)
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    wide = WideRows(layers)
    wide.before_pass(64)
    assert wide.state == "int4" and "not enough memory" in (wide.reason or "")
    assert all(layer.dense is None for layer in layers)  # no half-made copy is used
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    assert torch.equal(layers[0](x), _kernel(layers[0], x))


@pytest.mark.parametrize("ok", [True, False])
def test_the_dense_kernels_run_only_where_the_kernel_probe_passes_them(
        ok: bool, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aici_cli.models.kernels import probe as kernel_probe

    asked: list[tuple[kernel_probe.KernelMode, kernel_probe.Shapes]] = []

    def verdict(mode: kernel_probe.KernelMode,
                shapes: kernel_probe.Shapes) -> kernel_probe.Verdict:
        asked.append((mode, shapes))
        return kernel_probe.Verdict(ok, None if ok else "its kernels crashed the process "
                                                        "(SIGSEGV)")

    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", quantize="int4")
    monkeypatch.setenv(kernel_probe.ENV, "on")  # after the load: its own probe is not asked
    monkeypatch.setattr(kernel_probe, "verdict", verdict)
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    wide = WideRows.for_model(lm.model)
    assert wide is not None
    wide.before_pass(64)
    [(mode, shapes)] = asked  # the unquantised mode at the run's dtype, the model's shapes
    assert (mode.device, mode.dtype, mode.quantize) == ("cpu", "bfloat16", "none")
    assert shapes == kernel_probe.Shapes.of(tiny_model_dir)
    assert wide.state == ("dense" if ok else "int4")
    assert all((layer.dense is not None) is ok for layer in wide.layers)
    if not ok:
        assert "SIGSEGV" in (wide.reason or "")


def test_layers_with_dense_copies_still_stack_for_the_compiled_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt may make the copies before the first compiled step stacks q/k/v: the
    stack's probe compares the kernels the stack runs, so it still stacks (a package
    built with stacked layers needs them)."""
    from aici_cli.models.quant import fused_linear

    monkeypatch.setattr(fused_linear, "_VERDICTS", {})
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    parts = [_layer(n, 64, seed) for seed, n in enumerate((128, 64, 64))]
    # Copies that differ from the kernel's weights: a probe that reached them would fail.
    WideRows(parts).before_pass(64)
    for part in parts:
        assert part.dense is not None
        part.dense = part.dense + 1
    stacked = fused_linear.stack_linears(parts)
    assert isinstance(stacked, Int4Linear)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(stacked(x), torch.cat([_kernel(p, x) for p in parts], dim=-1))


def test_wide_prefill_runs_a_passs_prompt_tokens_in_one_gemm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--wide-prefill`: the prompt tokens in one GEMM of their count, as the CLI sets it,
    and the result names the path (made_with.batch_variant)."""
    import click

    from aici_cli.cli.main import main
    from aici_cli.cli.run_config import run_config
    from aici_cli.run.made_with import batch_variant_paths

    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    layer = _layer(128, 64)
    WideRows([layer]).before_pass(1)
    assert layer.dense is not None
    x = torch.randn(300, 64, dtype=torch.bfloat16)
    with prompt_tokens.feeding([(0, 290)], 300, x.device, tiled=False):
        y = layer(x)
    assert torch.equal(y[:290], torch.nn.functional.linear(x[:290], layer.dense))
    assert torch.equal(y[290:], _kernel(layer, x[290:]))

    command = main.get_command(click.Context(main), "run")
    assert isinstance(command, click.Command)
    for args, wide in (([], False), (["--wide-prefill"], True)):
        engine = run_config(**command.make_context("run", ["in.jsonl", *args]).params).engine
        assert engine.wide_prefill is wide
        assert ("wide-prefill" in batch_variant_paths(engine, "int4", "bfloat16")) is wide
        assert "wide-prefill" not in batch_variant_paths(engine, "int4", "float32")


def test_the_trials_measurement_is_taken_once_a_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one machine choose alike: the first run's measured speed-up is cached
    for the layer's shape and dtype, so a second run (under another load) reads it instead
    of timing again; another shape is measured."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    timed: list[int] = []

    def trial(layer: Int4Linear, dense: torch.Tensor, rows: int) -> float:
        timed.append(layer.out_features)
        return 1.75 if len(timed) == 1 else 0.5  # a later timing would say otherwise

    monkeypatch.setattr(dense_copies, "_trial", trial)
    first = dense_copies.measured_trial(_layer(128, 64))
    assert (first.speedup, first.moved, timed) == (1.75, None, [128])
    assert first.made is not None
    again = dense_copies.measured_trial(_layer(128, 64, seed=1))
    assert (again.speedup, again.moved, again.made, timed) == (1.75, None, None, [128])
    layers = [_layer(128, 64, seed) for seed in range(2)]
    wide = WideRows(layers)
    wide.before_pass(1)
    assert wide.dense and "1.8x" in (wide.reason or "")  # read, not timed: dense
    assert all(layer.dense is not None for layer in layers)
    assert dense_copies.measured_trial(_layer(64, 64)).speedup == 0.5
    assert timed == [128, 64]


def test_no_copy_where_a_tile_rounds_a_row_by_its_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose GEMM gives a tile's last rows other bits (a BLAS micro-kernel of 6
    rows, say) would make prompt tokens depend on their neighbours: the check finds the
    row and the run keeps every token on the int kernels."""
    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(dense_copies, "MIN_SPEEDUP", 0.0)
    linear = torch.nn.functional.linear

    def edge_rounds_otherwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = linear(x, weight)
        rest = x.shape[0] % 6
        if rest:  # the rows after the last whole block of 6, as an edge kernel would
            out[-rest:] = out[-rest:] * (1 + 2 ** -7)
        return out

    monkeypatch.setattr(prompt_tokens.F, "linear", edge_rounds_otherwise)
    assert prompt_tokens.moved_row(torch.randn(32, 64, dtype=torch.bfloat16)) is not None
    layers = [_layer(128, 64, seed) for seed in range(2)]
    wide = WideRows(layers)
    wide.before_pass(1)
    assert wide.state == "int4" and "rounds a row" in (wide.reason or "")
    assert all(layer.dense is None for layer in layers)
    monkeypatch.setattr(prompt_tokens.F, "linear", linear)
    assert prompt_tokens.moved_row(torch.randn(32, 64, dtype=torch.bfloat16)) is None
