"""The lm-evaluation-harness backend: real `lm_eval` on the local tasks of tests/data/lm_eval
(no hub), every per-request answer against lm-eval's own `hf` backend on the same model in
fp32 (loglikelihoods to 1e-4, `is_greedy`, accuracy), generation under a constraint, and
`aici-batch lm-eval` end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import DATA

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from aici_cli.evals.harness import harness_argv  # noqa: E402
from aici_cli.evals.lm_eval_backend import AiciBatchLM  # noqa: E402
from aici_cli.evals.requests import EvalRequestError  # noqa: E402

TASKS = DATA / "lm_eval"
TOL = 1e-4
# Short windows, so that a passage spans several (lm-eval's disjoint rolling windows).
MAX_LENGTH = 24


@pytest.fixture(scope="module")
def tasks() -> TaskManager:
    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def ours(tiny_model_dir: Path) -> AiciBatchLM:
    return AiciBatchLM.create_from_arg_string(
        f"model={tiny_model_dir},dtype=float32,device=cpu,batch_size=4,max_length={MAX_LENGTH}")


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_model_dir), dtype="float32", device="cpu", batch_size=4,
                max_length=MAX_LENGTH)


def evaluate(lm: Any, tasks: TaskManager, names: list[str]) -> dict[str, Any]:
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks,
                                   log_samples=True, bootstrap_iters=0)


def responses(out: dict[str, Any], task: str) -> list[Any]:
    """Each request's raw answer, in document then request order."""
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [resp[0] for s in samples for resp in s["resps"]]


@pytest.mark.subprocess
def test_scores_equal_the_hf_backends(ours: AiciBatchLM, hf: Any, tasks: TaskManager) -> None:
    """Multiple choice (3-shot) and perplexity (several windows per passage): every
    request's loglikelihood to 1e-4 and its is_greedy, and so every metric."""
    names = ["aici_capitals", "aici_passages"]
    mine, theirs = evaluate(ours, tasks, names), evaluate(hf, tasks, names)
    mc_mine, mc_theirs = responses(mine, "aici_capitals"), responses(theirs, "aici_capitals")
    assert len(mc_mine) == len(mc_theirs) == 15 * 4
    for (lp, greedy), (lp_hf, greedy_hf) in zip(mc_mine, mc_theirs):
        assert lp == pytest.approx(lp_hf, abs=TOL)
        assert greedy == greedy_hf
    rolled, rolled_hf = responses(mine, "aici_passages"), responses(theirs, "aici_passages")
    assert len(rolled) == 5
    assert rolled == pytest.approx(rolled_hf, abs=TOL)
    for task, metrics in (("aici_capitals", ["acc,none", "acc_norm,none"]),
                          ("aici_passages", ["word_perplexity,none", "bits_per_byte,none"])):
        for metric in metrics:
            assert mine["results"][task][metric] == pytest.approx(
                theirs["results"][task][metric], rel=1e-4), (task, metric)


def test_is_greedy_when_the_continuation_is_the_models_pick(ours: AiciBatchLM, hf: Any) -> None:
    """A continuation made of the model's own greedy tokens is greedy for both backends;
    one other token in it is not."""
    contexts = ["The quick brown fox", "Alice and Bob", "json schema value"]
    gen = [Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 3}), 0)
           for c in contexts]
    picks = hf.generate_until(gen)
    assert picks == ours.generate_until(gen)  # greedy generation agrees too
    requests = [Instance("loglikelihood", {}, (c, p), i)
                for i, (c, p) in enumerate(zip(contexts, picks)) if p]
    requests += [Instance("loglikelihood", {}, (c, p + " the"), 9)
                 for c, p in zip(contexts, picks) if p]
    mine, theirs = ours.loglikelihood(requests), hf.loglikelihood(requests)
    assert [g for _, g in mine] == [g for _, g in theirs]
    n = len(requests) // 2
    assert n >= 2 and all(g for _, g in mine[:n])
    assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], abs=TOL)


@pytest.mark.subprocess
def test_generation_under_a_regex_constraint(ours: AiciBatchLM, tasks: TaskManager) -> None:
    """The task's gen_kwargs carry `regex`: every answer matches it, and exact_match is
    the share of answers equal to the target."""
    out = evaluate(ours, tasks, ["aici_yes_no_regex"])
    samples = out["samples"]["aici_yes_no_regex"]
    answers = [s["resps"][0][0] for s in samples]
    assert len(answers) == 10
    assert all(re.fullmatch(r" (yes|no)", a) for a in answers), answers
    expected = sum(a == s["target"] for a, s in zip(answers, samples)) / len(samples)
    assert out["results"]["aici_yes_no_regex"]["exact_match,none"] == pytest.approx(expected)


def test_json_schema_and_choice_in_gen_kwargs(ours: AiciBatchLM) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    requests = [
        Instance("generate_until", {}, ("Give n: ", {"until": ["\n\n"], "max_gen_toks": 12,
                                                     "json_schema": schema}), 0),
        Instance("generate_until", {}, ("Give n: ", {"max_gen_toks": 12,
                                                     "json_schema": json.dumps(schema)}), 1),
        Instance("generate_until", {}, ("Pick: ", {"choice": ["red", "green", "blue"]}), 2),
    ]
    first, second, third = ours.generate_until(requests)
    assert isinstance(json.loads(first)["ok"], bool) and json.loads(first) == json.loads(second)
    assert third in ("red", "green", "blue")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"regex": "(unclosed"}, "task t, document 3: "),
    ({"num_beams": 4}, "gen_kwargs ['num_beams'] have no meaning for the aici-batch backend"),
    ({"regex": "a", "choice": ["a"]}, "gen_kwargs give regex and choice: at most one"),
])
def test_a_request_it_cannot_run_names_its_task(ours: AiciBatchLM, kwargs: dict[str, Any],
                                                message: str) -> None:
    req = Instance("generate_until", {}, ("Q: ", kwargs), 0, metadata=("t", 3, 1))
    with pytest.raises(EvalRequestError, match=re.escape(message)):
        ours.generate_until([req])


def test_model_args_win_over_lm_evals_own_defaults(tiny_model_dir: Path) -> None:
    """lm-eval's CLI always passes batch_size (1 unless given) and device (cuda:0 unless
    given): --model_args of the same name are what the user asked for."""
    lm = AiciBatchLM.create_from_arg_string(
        f"model={tiny_model_dir},batch_size=3,device=cpu,deterministic=true",
        {"batch_size": 1, "device": "cuda:0", "max_batch_size": None})
    assert lm.engine.config.batch_size == 3 and lm.engine.config.deterministic
    assert str(lm.lm.device) == "cpu"
    with pytest.raises(ValueError, match=r"model_args \['temperature'\] are unknown"):
        AiciBatchLM(model=str(tiny_model_dir), device="cpu", temperature=0.5)


@pytest.mark.parametrize(("args", "argv"), [
    (["--tasks", "x"], ["run", "--model", "aici-batch", "--device", "auto",
                        "--batch_size", "8", "--tasks", "x"]),
    # lm-eval prints its own --batch_size: it is given the size the engine runs at.
    (["--model_args", "model=m", "batch_size=4", "--tasks", "x"],
     ["run", "--model", "aici-batch", "--device", "auto", "--batch_size", "4",
      "--model_args", "model=m", "batch_size=4", "--tasks", "x"]),
    (["--model_args=batch_size=2,dtype=float32", "-a", '{"batch_size": 3}'],
     ["run", "--model", "aici-batch", "--device", "auto", "--batch_size", "3",
      "--model_args=batch_size=2,dtype=float32", "-a", '{"batch_size": 3}']),
    (["--model_args", "batch_size=auto"], ["run", "--model", "aici-batch", "--device", "auto",
                                           "--batch_size", "8", "--model_args", "batch_size=auto"]),
    (["run", "--tasks", "x", "-b", "4", "--device=cpu"],
     ["run", "--model", "aici-batch", "--tasks", "x", "-b", "4", "--device=cpu"]),
    (["--model", "hf", "--tasks", "x"], ["run", "--model", "hf", "--tasks", "x"]),
    (["ls", "tasks"], ["ls", "tasks"]),
    (["--help"], ["run", "--help"]),
])
def test_harness_argv(args: list[str], argv: list[str]) -> None:
    assert harness_argv(args) == argv


@pytest.mark.subprocess
def test_the_lm_eval_command_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`aici-batch lm-eval` with lm-eval's own options, as a user types them."""
    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "aici-batch"), "lm-eval", "--tasks",
           "aici_capitals,aici_yes_no_regex", "--include_path", str(TASKS), "--model_args",
           f"model={tiny_model_dir},dtype=float32,batch_size=4", "--limit", "4",
           "--output_path", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**_env(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["config"]["model"] == "aici-batch"
    assert set(results["results"]) == {"aici_capitals", "aici_yes_no_regex"}
    assert "acc,none" in results["results"]["aici_capitals"]
    assert "|aici_capitals" in done.stdout  # lm-eval's own table
    # The table's header names the batch size the engine ran at (lm-eval's default is 1).
    assert re.search(r"num_fewshot: \w+, batch_size: 4\b", done.stdout), done.stdout[-2000:]
    assert results["config"]["batch_size"] == "4"


@pytest.mark.subprocess
def test_the_lm_eval_command_without_lm_eval_installed() -> None:
    code = ("import sys\nsys.modules['lm_eval'] = None  # as if not installed\n"
            "from aici_cli.cli.main import main\nmain(['lm-eval', '--tasks', 'x'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("Error: lm-eval is not installed: "
                                   "pip install 'aici-batch[lm-eval]'")


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.mark.real_model
def test_default_model_scores_equal_the_hf_backends(tasks: TaskManager) -> None:
    """The default model (SmolLM2, its own tokenizer's spacing and merges) in fp32."""
    from lm_eval.models.huggingface import HFLM

    from aici_cli.models.load import load_model

    path = load_model(None, "cpu", "float32").model.name_or_path
    mine = evaluate(AiciBatchLM(dtype="float32", device="cpu", batch_size=8), tasks,
                    ["aici_capitals"])
    theirs = evaluate(HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=8),
                      tasks, ["aici_capitals"])
    for (lp, greedy), (lp_hf, greedy_hf) in zip(responses(mine, "aici_capitals"),
                                                responses(theirs, "aici_capitals")):
        assert lp == pytest.approx(lp_hf, abs=TOL)
        assert greedy == greedy_hf
    assert mine["results"]["aici_capitals"]["acc,none"] == (
        theirs["results"]["aici_capitals"]["acc,none"])
