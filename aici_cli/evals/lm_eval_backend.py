"""`AiciBatchLM`: lm-evaluation-harness's `LM` on this engine, registered as "aici-batch".

    lm_eval --model aici-batch --model_args model=smollm2-135m-instruct,batch_size=8 ...
    (or `aici-batch lm-eval ...`, which registers it first: lm-eval 0.4.13 reads no plugin
    entry points)

Every request runs on one `Engine` (continuous batching, the prefix cache), with the token
ids lm-eval's `hf` backend would feed (`tok_encode`, `_encode_pair`, its truncation), so
the two backends score the same tokens:
- `loglikelihood`: requests grouped by context into scored lines (one row per
  continuation, the shared context's keys from the prefix cache); each answer is the
  continuation's summed logprob and whether greedy decoding would write it (`is_greedy`).
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows, each a scored line.
- `generate_until`: one line per request through the normal generation path; `gen_kwargs`
  may carry a constraint (`json_schema`, `regex`, `choice`, `grammar`), see `requests.py`.

A request that fails (a constraint the engine refuses, a prompt too long) raises
`EvalRequestError` naming its task and document: an eval with a silently missing answer
would report a wrong score.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix, resolve_max_length
from tqdm import tqdm

from aici_cli.core.config import EngineConfig, JobDefaults
from aici_cli.core.job import BadLine, Job
from aici_cli.engine import Engine
from aici_cli.evals.requests import (
    PROMPT_IDS,
    SEQUENCES,
    EvalRequestError,
    ScoreGroup,
    cut_at_stops,
    generation_line,
    group_by_context,
    score_line,
)
from aici_cli.evals.token_intake import TokenIntake
from aici_cli.formats.jobs import read_jobs
from aici_cli.models.load import load_model

# A (context, continuation) request as TemplateLM hands it over: its strings (None for a
# rolling window) and their token ids.
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]

DEFAULT_BATCH_SIZE = EngineConfig().batch_size
DEFAULT_MAX_LENGTH = 2048  # lm-eval's `hf` default where neither config nor tokenizer says


def batch_size_arg(value: int | str | None) -> int:
    """lm-eval's batch size: an integer, or "auto"/"auto:N" (this engine refills rows
    continuously, so it has nothing to tune: the default)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, got {size}")
    return size


@register_model("aici-batch")
class AiciBatchLM(TemplateLM):
    backend = "causal"

    def __init__(self, model: str | None = None, pretrained: str | None = None,
                 batch_size: int | str | None = None, dtype: str = "auto",
                 device: str | None = None, deterministic: bool = False,
                 prefix_cache: bool = True, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, max_batch_size: int | None = None,
                 **unknown: Any) -> None:
        """`model` (or `pretrained`, as the `hf` backend names it): what `aici-batch run
        --model` takes (default: the default model). The rest as for the `hf` backend,
        plus `deterministic` (batch-invariant passes) and `prefix_cache`."""
        super().__init__()
        if unknown:
            raise ValueError(f"model_args {sorted(unknown)} are unknown to the aici-batch "
                             "backend (it takes model, batch_size, dtype, device, "
                             "deterministic, prefix_cache, max_length, max_gen_toks, "
                             "add_bos_token, prefix_token_id)")
        # transformers' tokenizer class: lm-eval calls more of its interface
        # (continue_final_message, model_max_length) than the tool's own reader serves.
        self.lm = load_model(model or pretrained, device or "auto", dtype,
                             tokenizer="transformers")
        self.tokenizer = self.lm.tokenizer
        self.engine = Engine(self.lm, EngineConfig(batch_size=batch_size_arg(batch_size),
                                                   deterministic=bool(deterministic),
                                                   prefix_cache=bool(prefix_cache)),
                             intake=TokenIntake)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_length = max_length
        self._max_gen_toks = int(max_gen_toks)
        self.defaults = JobDefaults()

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> AiciBatchLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string),
                                       additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> AiciBatchLM:
        """`--model_args` win over lm-eval's own options of the same name: its CLI always
        passes `batch_size` (1 unless given), which would otherwise clash with
        `--model_args batch_size=8`."""
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ------------------------------------------------------------------ tokens, as `hf`

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context or a rolling window's first token."""
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return int(self.tokenizer.bos_token_id)
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        return int(resolve_max_length(self.lm.model.config, self.tokenizer,
                                      default=DEFAULT_MAX_LENGTH))

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.lm.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """As the `hf` backend encodes: the tokenizer's special tokens unless told
        (`add_bos_token`), none when the text already starts with the prefix token."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return str(self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt))

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": self.lm.name, "model_dtype": str(self.lm.dtype),
                "model_device": str(self.lm.device), "backend": "aici-batch"}

    # ------------------------------------------------------------------------ requests

    def _loglikelihood_tokens(self, requests: Sequence[TokenRequest],
                              disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        groups = group_by_context([(ctx, cont) for _, ctx, cont in requests], self.max_length)
        jobs = [self._score_job(group, i) for i, group in enumerate(groups, start=1)]
        results = self._run(jobs, "loglikelihood", disable_tqdm)
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for i, group in enumerate(groups, start=1):
            result = self._succeeded(results[i], requests[group.members[0]][0])
            scores = {s["choice"]: s for s in result["scores"]}
            for k, member in enumerate(group.members):
                score = scores.get(str(k))  # none for an empty continuation: nothing to score
                answer = (score["logprob"], score["greedy"]) if score else (0.0, True)
                answers[member] = answer
                strings = requests[member][0]
                if strings is not None:
                    self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any],
                              disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's disjoint rolling windows (the
        `hf` backend's), all windows of all documents in one run."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                    lm_utils.make_disjoint_window,
                    lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                windows.append((None, list(context), list(continuation)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows,
                                                                          disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        jobs: list[Job] = []
        for i, req in enumerate(requests, start=1):
            context, gen_kwargs = req.args
            try:
                line = generation_line(i, gen_kwargs or {}, self.max_gen_toks, eos_text)
            except EvalRequestError as e:
                raise EvalRequestError(f"{_where(req)}: {e}") from None
            ids = self.tok_encode(context,
                                  left_truncate_len=self.max_length - line["max_tokens"])
            jobs.append(self._job(line, i, {PROMPT_IDS: ids}, req))
        results = self._run(jobs, "generate_until", disable_tqdm)
        texts = []
        for i, (req, job) in enumerate(zip(requests, jobs), start=1):
            text = cut_at_stops(self._succeeded(results[i], req)["text"], job.stop)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    # ------------------------------------------------------------------------- engine

    def _score_job(self, group: ScoreGroup, index: int) -> Job:
        return self._job(score_line(group, index), index,
                         {PROMPT_IDS: list(group.context), SEQUENCES: group.sequences}, None)

    def _job(self, line: dict[str, Any], index: int, extra: dict[str, Any],
             req: Any) -> Job:
        """The line through the input checks (a constraint is checked as a line's is),
        numbered `index`, with its token ids."""
        item = next(read_jobs([json.dumps(line)], self.defaults))
        if isinstance(item, BadLine):
            raise EvalRequestError(f"{_where(req)}: {item.message.removeprefix('line 1: ')}")
        return dataclasses.replace(item, index=index, extra={**item.extra, **extra})

    def _run(self, jobs: list[Job], what: str, disable_tqdm: bool) -> dict[int, dict[str, Any]]:
        """Every job's result by its index, the jobs run together on the engine."""
        results: dict[int, dict[str, Any]] = {}
        with tqdm(total=len(jobs), desc=f"aici-batch {what}", disable=disable_tqdm) as bar:
            def emit(result: dict[str, Any]) -> None:
                results[result["index"]] = result
                bar.update(1)

            self.engine.run(jobs, emit)
        return results

    @staticmethod
    def _succeeded(result: dict[str, Any], req: Any) -> dict[str, Any]:
        if result["finish_reason"] == "error":
            message = result["error"]["message"].split(": ", 1)[-1]
            raise EvalRequestError(f"{_where(req)}: {result['error']['type']}: {message}")
        return result


def _where(req: Any) -> str:
    """A request's task and document, for an error message."""
    task = getattr(req, "task_name", None)
    doc = getattr(req, "doc_id", None)
    if task is None:
        return "a request" if not isinstance(req, tuple) else f"request {req!r:.80}"
    return f"task {task}, document {doc}"
