"""The architectures users bring, against transformers itself: a tiny random-weight model of
each (tests/support/arch_models.py: Llama, Mistral, Qwen 2, Qwen 3, Gemma 2, Gemma 3, Phi-3,
OLMo 2), saved as a Hugging Face directory, run in float32 and compared with the same
directory loaded by transformers with eager attention (its reference implementation):

- next-token logits of the engine's packed passes (prompts, then ragged chunks past the
  sliding window) within `LOGITS_TOL`;
- `aici-batch run`: greedy text for 32 tokens equal to transformers' greedy decoding
  (one whole forward per token), each token's log-probability and the `score`
  log-likelihoods within `SCORE_TOL` of a direct computation, and a JSON-schema line
  whose output validates;
- the same run on the model written as a GGUF (tests/support/arch_gguf.py: F16 and Q8_0,
  every architecture transformers reads from a GGUF, so not OLMo 2) and converted as any
  GGUF is, against transformers on what the conversion must hold.

And the loader's part: what transformers computes instead of reading (buffers, tied
weights) is not a missing tensor on either load path, a truly missing weight is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from arch_gguf import GGUF_ARCH, QUANTS, stored_weights, write_arch_gguf
from arch_models import BUILDERS, build_arch_model
from click.testing import CliRunner
from tokenizers import Tokenizer

from aici_cli.cli.main import main
from aici_cli.core.errors import ModelError

# Measured: at most ~1e-5 apart (fp32 sums in another order: packed rows, per-row SDPA
# against transformers' eager matmuls), on logits of magnitude ~5.
LOGITS_TOL = 1e-4
SCORE_TOL = 1e-4
GREEDY_TOKENS = 32

def _archs() -> list[str]:
    return list(BUILDERS)


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """Every architecture's tiny model, built once for the session (~1 s in all)."""
    root = tmp_path_factory.mktemp("architectures")
    return {arch: build_arch_model(arch, tiny_model_dir, root / arch) for arch in BUILDERS}


_references: dict[Path, Any] = {}


def reference(model_dir: Path) -> Any:
    """transformers' own model of `model_dir`: float32, eager attention (its reference
    implementation, soft-capping included), loaded once per session."""
    if model_dir not in _references:
        from transformers import AutoModelForCausalLM

        _references[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return _references[model_dir]


def encode(model_dir: Path, text: str) -> list[int]:
    """The prompt's ids as the tokenizer file gives them (it adds no special tokens)."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.mark.heavy
@pytest.mark.parametrize("arch", _archs())
def test_next_token_logits_match_transformers(arch: str, arch_dirs: dict[str, Path]) -> None:
    from aici_cli.engine.forward.attention import install
    from aici_cli.engine.forward.cache import RowCache
    from aici_cli.engine.forward.inputs import AttentionLayout, build_inputs, forward
    from aici_cli.models import load_model

    model_dir = arch_dirs[arch]
    lm = load_model(str(model_dir), device="cpu", dtype="float32")
    ref = reference(model_dir)
    install(lm.model)
    layout = AttentionLayout.for_config(lm.model.config)
    cache = RowCache(lm.model.config.num_hidden_layers, 2, 128)
    prompts = [encode(model_dir, "The quick brown fox jumps over"), encode(model_dir, "{")]
    seqs, lengths, chunks = [list(p) for p in prompts], [0, 0], prompts
    chunk = encode(model_dir, ' "a": 1')
    worst = 0.0
    # Row 0 takes one token a step, row 1 a chunk of several: both pass the window (12).
    for _ in range(6):
        inputs = build_inputs(0, lengths, chunks, layout, torch.device("cpu"))
        with torch.inference_mode():
            logits = forward(lm.model, cache, inputs)
            for r in range(2):
                want = ref(input_ids=torch.tensor([seqs[r]])).logits[0, -1]
                worst = max(worst, float((logits[r] - want).abs().max()))
        lengths = [n + len(c) for n, c in zip(lengths, chunks)]
        chunks = [[int(logits[0].argmax())], chunk]
        for r in range(2):
            seqs[r] += chunks[r]
    assert max(len(s) for s in seqs) > 12
    assert worst < LOGITS_TOL, f"{arch}: logits {worst:.2e} from transformers'"


PROMPT = "Alice and Bob"
SCORE_PROMPT = "The quick brown fox jumps over the lazy"
SCORE_CHOICES = [" dog", " fox", " model", "gy brown"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "id": {"type": "integer"}},
          "required": ["name", "id"], "additionalProperties": False}


def run_lines(model_dir: Path, lines: list[dict[str, Any]], tmp_path: Path) -> list[Any]:
    """`aici-batch run` on `lines` with the model at `model_dir`, in float32 and
    unquantised (the exact path: `auto` would run a Q8_0 GGUF on the int kernels where
    this CPU has them); the results in input order."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q", "--model",
                                    str(model_dir), "--dtype", "float32", "--quantize", "none",
                                    "--device", "cpu"])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception  # the engine's own error, as raised
    assert res.exit_code == 0, res.output
    results = [json.loads(x) for x in out.read_text().splitlines()]
    return sorted(results, key=lambda r: r["index"])


def direct_logprob(model: Any, prompt: list[int], whole: list[int]) -> float:
    """The sum of the log-softmax of `whole`'s tokens after `prompt`, one forward."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(prompt), len(whole)))


def greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` (one whole forward per token, no
    cache), and each picked token's log-probability."""
    seq, picks, logprobs = list(prompt), [], []
    with torch.inference_mode():
        for _ in range(n):
            row = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(),
                                    dim=-1)
            token = int(row.argmax())
            picks.append(token)
            logprobs.append(float(row[token]))
            seq.append(token)
    return picks, logprobs


def check_run(model: Path, ref: Any, tokenizer_file: Path, tmp_path: Path) -> None:
    """One `aici-batch run --model MODEL` of a greedy line, a scored line and a JSON-schema
    line, against transformers' model `ref`: the same 32 tokens, each with its
    log-probability (the run's logits, through the engine) and each choice's score
    within `SCORE_TOL`; the schema line's output validates."""
    plain, scored, constrained = run_lines(model, [
        {"prompt": PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0,
         "ignore_eos": True, "logprobs": True},
        {"prompt": SCORE_PROMPT, "choices": SCORE_CHOICES, "score": True},
        {"prompt": "A JSON object:", "json_schema": SCHEMA, "max_tokens": 48,
         "temperature": 0},
    ], tmp_path)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    prompt = tokenizer.encode(PROMPT).ids
    assert plain["stats"]["prompt_tokens"] == len(prompt)
    want, logprobs = greedy(ref, prompt, GREEDY_TOKENS)
    assert [e["id"] for e in plain["logprobs"]] == want
    assert [e["logprob"] for e in plain["logprobs"]] == pytest.approx(logprobs, abs=SCORE_TOL)
    assert plain["text"] == tokenizer.decode(want, skip_special_tokens=False)

    context = tokenizer.encode(SCORE_PROMPT).ids
    assert len(scored["scores"]) == len(SCORE_CHOICES)
    for s in scored["scores"]:
        whole = tokenizer.encode(SCORE_PROMPT + s["choice"]).ids
        assert whole[: len(context)] == context  # no merge across the boundary
        assert s["logprob"] == pytest.approx(direct_logprob(ref, context, whole), abs=SCORE_TOL)

    assert constrained["valid"] is True
    jsonschema.validate(json.loads(constrained["text"]), SCHEMA)


@pytest.mark.heavy
@pytest.mark.parametrize("arch", _archs())
def test_a_run_matches_transformers(arch: str, arch_dirs: dict[str, Path],
                                    tmp_path: Path) -> None:
    model_dir = arch_dirs[arch]
    check_run(model_dir, reference(model_dir), model_dir / "tokenizer.json", tmp_path)


def gguf_reference(gguf: Path, model_dir: Path, quant: str) -> Any:
    """transformers' model of what a conversion of `gguf` must hold: the config
    transformers reads from the file, the directory's weights through the file's type and
    the conversion's bfloat16 (`arch_gguf.stored_weights`), in float32, eager."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager")
    model.load_state_dict(stored_weights(reference(model_dir), quant))
    return model.eval()


def _gguf_archs() -> list[str]:
    return list(GGUF_ARCH)


@pytest.mark.heavy
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", _gguf_archs())
def test_a_gguf_run_matches_transformers(arch: str, quant: str, arch_dirs: dict[str, Path],
                                         tmp_path_factory: pytest.TempPathFactory,
                                         monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    """The same model as a GGUF (matrices in F16 or Q8_0), converted as any GGUF is: the
    run's tokens, log-probabilities and scores are transformers' on the converted
    weights."""
    from aici_cli.models import resolve_model

    monkeypatch.setenv("AICI_BATCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    gguf = write_arch_gguf(arch_dirs[arch], tmp_path / f"{arch}-{quant}.gguf", quant)
    converted = resolve_model(str(gguf))
    check_run(gguf, gguf_reference(gguf, arch_dirs[arch], quant),
              converted / "tokenizer.json", tmp_path)


@pytest.mark.parametrize("arch", ["mistral"])
def test_a_window_without_layer_types_masks_every_layer(arch: str,
                                                        arch_dirs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """Mistral v0.1's window (every layer, no `layer_types`), set to 12: greedy text past
    it must still be transformers'."""
    from transformers import AutoConfig

    model_dir = tmp_path / "mistral-window"
    shutil.copytree(arch_dirs[arch], model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.sliding_window = 12
    config.save_pretrained(model_dir)
    (result,) = run_lines(model_dir, [{"prompt": PROMPT, "max_tokens": GREEDY_TOKENS,
                                        "temperature": 0, "ignore_eos": True,
                                        "logprobs": True}], tmp_path)
    want, _ = greedy(reference(model_dir), encode(model_dir, PROMPT), GREEDY_TOKENS)
    assert [e["id"] for e in result["logprobs"]] == want


def test_gemma2_caps_change_its_logits(arch_dirs: dict[str, Path]) -> None:
    """The tiny Gemma 2 reaches its caps: without them transformers' logits differ, so the
    comparisons above would catch a cap left out."""
    from transformers import AutoModelForCausalLM

    model_dir = arch_dirs["gemma2"]
    ids = torch.tensor([encode(model_dir, SCORE_PROMPT)])
    capped = reference(model_dir)
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager",
            **{field: None}).eval()
        with torch.inference_mode():
            gap = (capped(input_ids=ids).logits - uncapped(input_ids=ids).logits).abs().max()
        assert gap > 0.1, field


def test_gemma2_loads_with_eager_attention(arch_dirs: dict[str, Path]) -> None:
    """transformers refuses SDPA for Gemma 2: the loader asks for eager attention there
    (and SDPA elsewhere), on both load paths, and the load gives transformers' logits."""
    from aici_cli.models import load_model

    model_dir = arch_dirs["gemma2"]
    ids = torch.tensor([encode(model_dir, SCORE_PROMPT)])
    with torch.inference_mode():
        want = reference(model_dir)(input_ids=ids).logits
    for quantize in ("none", "int8"):
        lm = load_model(str(model_dir), device="cpu", dtype="float32", quantize=quantize)
        assert lm.model.config._attn_implementation == "eager"
        with torch.inference_mode():
            got = lm.model(input_ids=ids).logits
        assert (got - want).abs().max() < (LOGITS_TOL if quantize == "none" else 0.5)
    llama = load_model(str(arch_dirs["qwen3"]), device="cpu", dtype="float32")
    assert llama.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "qwen3"])
def test_computed_buffers_are_not_missing_on_the_mapped_path(
        arch: str, arch_dirs: dict[str, Path]) -> None:
    """A model built on meta and mapped from its file (`--quantize`) computes the buffers
    its file lacks as transformers does: Gemma's embedding scale, every RoPE table."""
    from aici_cli.models import load_model

    model_dir = arch_dirs[arch]
    lm = load_model(str(model_dir), device="cpu", dtype="float32", quantize="int8")
    ref_buffers = dict(reference(model_dir).named_buffers())
    buffers = dict(lm.model.named_buffers())
    assert ref_buffers.keys() <= buffers.keys()
    for name, want in ref_buffers.items():
        assert torch.equal(buffers[name].to(want.dtype), want), name
    if arch != "qwen3":
        assert float(buffers["model.embed_tokens.embed_scale"]) == 8.0  # sqrt(hidden 64)


def _drop_tensor(model_dir: Path, target: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, target)
    tensors = load_file(target / "model.safetensors")
    del tensors[name]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_missing_weight_is_still_an_error(quantize: str, arch_dirs: dict[str, Path],
                                            tmp_path: Path) -> None:
    from aici_cli.models import load_model

    name = "model.layers.1.mlp.down_proj.weight"
    model_dir = _drop_tensor(arch_dirs["gemma3"], tmp_path / "gemma3", name)
    with pytest.raises(ModelError, match=rf"lack 1 of the model's tensors \({name}\)"):
        load_model(str(model_dir), device="cpu", dtype="float32", quantize=quantize)


def test_a_buffer_init_leaves_unfilled_is_reported(arch_dirs: dict[str, Path]) -> None:
    """A buffer the model's own init does not compute stays NaN, and is named."""
    from aici_cli.models.families.transformers_build import fill_buffers

    model = reference(arch_dirs["gemma3"])
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    clone.model.norm.register_buffer("unknown", torch.ones(3), persistent=False)
    names = ["model.embed_tokens.embed_scale", "model.norm.unknown"]
    assert fill_buffers(clone, names, torch.device("cpu")) == ["model.norm.unknown"]
    assert float(clone.model.embed_tokens.embed_scale) == 8.0
    assert torch.equal(clone.lm_head.weight, model.lm_head.weight)  # nothing else redone
