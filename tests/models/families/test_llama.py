"""The project's own Llama model (models/families/llama.py) against transformers' LlamaForCausalLM:
the same logits bit for bit, in plain passes and in the engine's packed passes, for any
Llama-shaped config; the run that loads one imports none of transformers' model code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aici_cli.core.config import EngineConfig
from aici_cli.core.job import Job
from aici_cli.core.sampling import Sampling
from aici_cli.engine.engine import Engine
from aici_cli.models import LoadedModel, load_model
from aici_cli.models.families.llama import LlamaCausalLM, unsupported


@pytest.fixture(scope="module")
def hf_lm(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32",
                      implementation="transformers")


def test_tiny_model_loads_as_own_model(lm: LoadedModel, hf_lm: LoadedModel) -> None:
    assert isinstance(lm.model, LlamaCausalLM)
    assert type(hf_lm.model).__name__ == "LlamaForCausalLM"
    assert lm.eos_token_ids == hf_lm.eos_token_ids
    assert lm.vocab_size == hf_lm.vocab_size
    own = lm.model.state_dict()
    theirs = hf_lm.model.state_dict()
    assert own.keys() == theirs.keys()
    assert all(torch.equal(own[k], theirs[k]) for k in own)


FIXTURES = [HealthCheck.function_scoped_fixture]  # module-scoped models, read only


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURES)
@given(tokens=st.lists(st.integers(0, 669), min_size=1, max_size=40),
       batch=st.integers(1, 3))
def test_plain_pass_logits_equal_transformers(lm: LoadedModel, hf_lm: LoadedModel,
                                              tokens: list[int], batch: int) -> None:
    ids = torch.tensor([tokens] * batch)
    with torch.inference_mode():
        mine = lm.model(input_ids=ids).logits
        theirs = hf_lm.model(input_ids=ids).logits
    assert torch.equal(mine, theirs)


def _job(index: int, prompt: str, **kw: Any) -> Job:
    fields: dict[str, Any] = dict(index=index, id=str(index), prompt=prompt, messages=None,
                                  max_tokens=10, sampling=Sampling(seed=index))
    return Job(**(fields | kw))


def _engine_run(lm: LoadedModel, jobs: list[Job], **config: Any) -> dict[int, Any]:
    results: list[dict[str, Any]] = []
    Engine(lm, EngineConfig(**config)).run(jobs, results.append)
    return {r["index"]: (r["text"], [e["logprob"] for e in r["logprobs"]]) for r in results}


@pytest.mark.heavy
@settings(max_examples=6, deadline=None, suppress_health_check=FIXTURES)
@given(prompts=st.lists(st.text("abc xyz{}\":,0123", min_size=1, max_size=30),
                        min_size=1, max_size=5),
       batch=st.integers(1, 4), drafts=st.sampled_from([0, 3]))
def test_engine_passes_equal_transformers(lm: LoadedModel, hf_lm: LoadedModel,
                                          prompts: list[str], batch: int, drafts: int) -> None:
    """Packed passes of every kind (prompts, single tokens, drafts, shared prefixes)
    through the engine's cache and attention: the same tokens and logprobs exactly."""
    jobs = [_job(i, p, logprobs=2) for i, p in enumerate(prompts, 1)]
    config = dict(batch_size=batch, draft_tokens=drafts)
    assert _engine_run(lm, jobs, **config) == _engine_run(hf_lm, jobs, **config)


@st.composite
def llama_configs(draw: st.DrawFn) -> dict[str, Any]:
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16]))
    return dict(
        vocab_size=draw(st.integers(32, 96)), hidden_size=heads * draw(st.sampled_from([8, 16])),
        num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=draw(st.sampled_from([24, 64])),
        attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])), max_position_embeddings=256,
    )


@settings(max_examples=10, deadline=None)
@given(fields=llama_configs(), tokens=st.lists(st.integers(0, 31), min_size=1, max_size=20),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_any_llama_config_matches_transformers(tmp_path_factory: pytest.TempPathFactory,
                                               fields: dict[str, Any], tokens: list[int],
                                               dtype: str) -> None:
    """Config fields the default model does not exercise (biases, untied heads, a head
    size of its own, other RoPE bases): read as transformers reads them."""
    from tiny_model import build_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = build_tiny_model(tmp_path_factory.mktemp("shape"))  # for its tokenizer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(len(tokens))
        model = LlamaForCausalLM(LlamaConfig(**fields))
        for p in model.parameters():  # biases and norms away from their 0/1 init
            p.data.normal_(0, 0.5)
    model.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    assert unsupported(raw) is None
    mine = load_model(str(directory), device="cpu", dtype=dtype)
    theirs = load_model(str(directory), device="cpu", dtype=dtype,
                        implementation="transformers")
    assert isinstance(mine.model, LlamaCausalLM)
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        assert torch.equal(mine.model(input_ids=ids).logits, theirs.model(input_ids=ids).logits)


@pytest.mark.parametrize("change", [
    {"architectures": ["MistralForCausalLM"]},  # not what model_type "llama" says
    {"hidden_act": "gelu"},
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
])
def test_other_models_load_through_transformers(tiny_model_dir: Path, tmp_path: Path,
                                                change: dict[str, Any]) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    raw = json.loads((copy / "config.json").read_text()) | change
    (copy / "config.json").write_text(json.dumps(raw))
    assert unsupported(raw) is not None
    loaded = load_model(str(copy), device="cpu", dtype="float32")
    assert not isinstance(loaded.model, LlamaCausalLM)


def _cli_run(model_dir: Path, tmp_path: Path,
             impl: str) -> tuple[list[str], list[dict[str, Any]]]:
    """A run in a fresh process of a prompt, and of messages under a JSON schema (the chat
    template and llguidance's token table): the heavy modules it imported, its results."""
    prompts, out = tmp_path / "in.jsonl", tmp_path / f"out-{impl}.jsonl"
    chat = {"messages": [{"role": "user", "content": "A name?"}], "logprobs": True,
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}},
                            "required": ["name"]}}
    prompts.write_text('{"prompt": "hello", "logprobs": true}\n' + json.dumps(chat) + "\n")
    script = (
        "import sys\n"
        "from aici_cli.cli.main import main\n"
        f"try: main(['run', {str(prompts)!r}, '--model', {str(model_dir)!r},"
        f" '--max-tokens', '5', '-o', {str(out)!r}, '--quiet', '--model-impl', {impl!r}])\n"
        "except SystemExit as e: assert e.code in (0, None), e.code\n"
        "heavy = ['transformers', 'transformers.modeling_utils', 'transformers.masking_utils',"
        " 'torch._dynamo', 'torch.distributed.tensor', 'scipy', 'sympy']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr
    results = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["index"])
    return json.loads(ran.stdout.strip().splitlines()[-1].replace("'", '"')), results


@pytest.mark.subprocess
def test_a_run_imports_no_model_code_of_transformers(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """What a run on a Llama model with a plain fast tokenizer imports: nothing of
    transformers (its own import is ~0.45 s; its model classes, masking utilities,
    torch.distributed and torch._dynamo a second or so more); with `--model-impl
    transformers` it runs through them, to the same tokens."""
    heavy, own = _cli_run(tiny_model_dir, tmp_path, "auto")
    assert heavy == []
    heavy, theirs = _cli_run(tiny_model_dir, tmp_path, "transformers")
    assert "transformers.modeling_utils" in heavy
    assert own[0]["finish_reason"] == "length"
    assert "error" not in own[1], own[1]
    for mine, other in zip(own, theirs, strict=True):
        assert (mine["text"], mine["logprobs"]) == (other["text"], other["logprobs"])
        assert mine["stats"]["prompt_tokens"] == other["stats"]["prompt_tokens"]


@pytest.mark.real_model
def test_default_model_logits_equal_transformers() -> None:
    ids = torch.tensor([[1, 504, 3458, 282, 253, 1345, 30, 2, 44, 45, 46, 9087]])
    for quantize in ("none", "int4"):
        mine = load_model(None, device="cpu", quantize=quantize)
        theirs = load_model(None, device="cpu", quantize=quantize,
                            implementation="transformers")
        assert isinstance(mine.model, LlamaCausalLM)
        with torch.inference_mode():
            assert torch.equal(mine.model(input_ids=ids).logits,
                               theirs.model(input_ids=ids).logits)
