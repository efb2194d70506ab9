"""The OpenAI batch file format (the one `vllm run-batch` reads and writes).

Input lines are requests `{custom_id, method, url, body}` for `/v1/chat/completions` or
`/v1/completions`; `to_line` maps each onto aici-batch's own input line, so the rest of
the pipeline (validation, constraints, engine) is shared, and remembers which request
field each line field came from, so that an error names the field the user wrote. The
constraint fields (`response_format`, vLLM's structured outputs) are
`request_constraints`; chat's tool fields are the line's own (`jobs/tools.py`). Output
lines are
`{id, custom_id, response: {status_code, request_id, body}, error}` with the body of a
chat completion or a text completion; aici-batch's own per-line figures ride along under
`aici`, a field a consumer of the format ignores.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from aici_cli.core.job import TranslateError
from aici_cli.core.json_text import show
from aici_cli.core.sampling import OPTIONS
from aici_cli.core.suggest import did_you_mean
from aici_cli.formats.jobs.parse import Translate
from aici_cli.formats.request_constraints import BODY_FIELDS, BatchRequestError, constraint_fields
from aici_cli.formats.schemas import load_schema

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Request body fields -> the line fields they become: the sampling options (each by its
# request name, core/sampling.py), and those of the same name and meaning besides.
_SAME = {**{option.request: option.name for option in OPTIONS.values()},
         **{key: key for key in ("n", "stop_token_ids", "ignore_eos")}}
# The same, for chat requests only.
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
# Accepted and ignored whatever their value, as vLLM ignores them: they do not change
# what is generated here (`stream_options` only shapes a stream, and a batch has none).
IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options",
           "prompt_cache_key", "safety_identifier")
_KNOWN = {"messages", "prompt", "max_tokens", "max_completion_tokens", "stop",
          "stream", "logprobs", "top_logprobs", *BODY_FIELDS, *_SAME, *_TOOLS, *IGNORED}
# The keys of a request line; any one of them makes a line a request.
_REQUEST_KEYS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class Request:
    """What the output line needs from its request: its id (None when it has none), its
    url, and for each field of the line it became, the request field it came from."""

    custom_id: str | None
    url: str
    fields: tuple[tuple[str, str], ...] = ()


def looks_like_request(obj: Any) -> bool:
    """True for a parsed line shaped like a batch request: it has any of `custom_id`,
    `method`, `url`, `body` (none of which aici-batch's own lines have)."""
    return isinstance(obj, dict) and any(key in obj for key in _REQUEST_KEYS)


def line_format(obj: Any) -> str | None:
    """"openai" for a line shaped like a batch request, "aici" for one with a field of
    aici-batch's own lines, None for anything else (not an object, or neither)."""
    if looks_like_request(obj):
        return "openai"
    own = load_schema("input-line")["properties"]
    if isinstance(obj, dict) and any(key in own for key in obj):
        return "aici"
    return None


def _shown_keys(obj: dict[str, Any], keys: Collection[str]) -> str:
    return ", ".join(repr(k) for k in obj if k in keys)


def refuse_requests(why: str) -> Translate:
    """The check of a file read in aici-batch's own format (a `jobs.Translate`): a line
    shaped like a batch request is that line's error, saying why the file is read so."""

    def check(obj: dict[str, Any], index: int) -> dict[str, Any]:
        if looks_like_request(obj):
            raise TranslateError(
                f"an OpenAI batch request (it has {_shown_keys(obj, _REQUEST_KEYS)}) in a "
                f"file read in aici-batch's own format ({why})", "format_mismatch")
        return obj

    return check


def to_line(obj: Any) -> tuple[dict[str, Any], Request]:
    """Map one request onto an aici-batch input line; raises BatchRequestError."""
    custom_id, url, body = _envelope(obj)
    line: dict[str, Any] = {"id": custom_id, **_prompt(body, url)}
    sources: dict[str, str] = {}
    for key, name in [*_SAME.items(), *zip(_TOOLS, _TOOLS)]:
        if key in body and body[key] is not None:
            line[name] = body[key]
            sources[name] = f"body.{key}"
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        line["max_tokens"] = limit
    stop = body.get("stop")
    if stop is not None:
        line["stop"] = [stop] if isinstance(stop, str) else stop
    line.update(_logprobs(body, url == CHAT))
    constraint, constraint_sources = constraint_fields(body)
    line.update(constraint)
    sources.update({key: f"body.{key}" for key in line if key != "id" and key not in sources})
    if "max_completion_tokens" in body:
        sources["max_tokens"] = "body.max_completion_tokens"
    sources.update(constraint_sources)
    return line, Request(custom_id, url, tuple(sources.items()))


def _envelope(obj: Any) -> tuple[str, str, dict[str, Any]]:
    """A request's custom_id, url and body (its null fields left out), each checked;
    raises BatchRequestError."""
    if not isinstance(obj, dict):
        raise BatchRequestError("a batch request must be a JSON object")
    extra = sorted(set(obj) - set(_REQUEST_KEYS))
    if "custom_id" not in obj:
        also = f" (and request field(s) {', '.join(extra)} are not supported)" if extra else ""
        raise BatchRequestError(f"custom_id is required{also}")
    if extra:
        raise BatchRequestError(f"unsupported request field(s): {', '.join(extra)}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchRequestError("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise BatchRequestError(f"method must be POST, not {obj.get('method')!r}")
    url = obj.get("url")
    if url not in (CHAT, COMPLETIONS):
        raise BatchRequestError(f"url {url!r} is not supported; use {CHAT} or {COMPLETIONS}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchRequestError("body must be a JSON object")
    # A field set to null is unset, whatever it is (the SDK writes some as null), as vLLM
    # reads a request.
    body = {key: value for key, value in body.items() if value is not None}
    unsupported = sorted(set(body) - _KNOWN)
    if unsupported:
        hint = did_you_mean(unsupported, _KNOWN)
        raise BatchRequestError(f"unsupported body field(s): {', '.join(unsupported)}"
                                + (f" ({hint})" if hint else ""))
    if body.get("stream") is not None and body["stream"] is not False:
        raise BatchRequestError(f"body.stream must be false in a batch, got {show(body['stream'])}")
    return custom_id, url, body


def _prompt(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The line's `messages` (chat) or `prompt` (completions); raises BatchRequestError for
    the other endpoint's fields."""
    if url == CHAT:
        if "prompt" in body:
            raise BatchRequestError(f"body.prompt belongs to {COMPLETIONS}; {CHAT} takes messages")
        return {"messages": body.get("messages")}
    if "messages" in body:
        raise BatchRequestError(f"body.messages belongs to {CHAT}; {COMPLETIONS} takes prompt")
    tools = [key for key in _TOOLS if body.get(key) is not None]
    if tools:
        raise BatchRequestError(f"body.{tools[0]} belongs to {CHAT}, not to {COMPLETIONS}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise BatchRequestError("body.prompt must be one string (one request per line)")
    return {"prompt": prompt}


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The line's logprob fields: chat takes `logprobs: true` and `top_logprobs: k`;
    completions take `logprobs: k` (the alternatives per token)."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if top is not None and not value:
            raise BatchRequestError("body.top_logprobs needs body.logprobs: true")
        if not value:
            return {}
        return {"logprobs": True, **({"top_logprobs": top} if top is not None else {})}
    if "top_logprobs" in body:
        raise BatchRequestError(f"body.top_logprobs belongs to {CHAT}; {COMPLETIONS} takes "
                           "logprobs: <int>")
    if value is None or value is False:
        return {}
    if isinstance(value, bool) or not isinstance(value, int):
        raise BatchRequestError(f"body.logprobs of {COMPLETIONS} is the number of alternatives "
                           "per token (0-20)")
    return {"logprobs": True, "top_logprobs": value}


def _finish(reason: str) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


def _choice(result: dict[str, Any], index: int, chat: bool) -> dict[str, Any]:
    text = result.get("text", "")
    choice: dict[str, Any] = {"index": index}
    calls = result.get("tool_calls")
    if chat and calls is not None:
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    entries = result.get("logprobs")
    if entries is None:
        choice["logprobs"] = None
    elif chat:
        choice["logprobs"] = {"content": [_chat_logprob(e) for e in entries]}
    else:
        choice["logprobs"] = _completion_logprobs(entries)
    choice["finish_reason"] = _finish(result.get("finish_reason", "stop"))
    return choice


def _chat_logprob(e: dict[str, Any] | None) -> dict[str, Any]:
    """A chat `logprobs.content` item (null logprob where none could be read)."""
    if e is None:
        return {"token": "", "logprob": None, "bytes": [], "top_logprobs": []}
    return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                              "bytes": t["bytes"]} for t in e["top_logprobs"]]}


def _completion_logprobs(entries: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The completions format: parallel lists, alternatives as {token: logprob}."""
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for e in entries:
        token = e["token"] if e is not None else ""
        tokens.append(token)
        values.append(e["logprob"] if e is not None else None)
        tops.append({t["token"]: t["logprob"] for t in e["top_logprobs"]}
                    if e is not None else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def _aici(result: dict[str, Any]) -> dict[str, Any]:
    """aici-batch's own figures for the line (input line number, stats, validity, the
    transcript of its tool rounds)."""
    keep = ("index", "input_sha256", "made_with", "valid", "relaxed", "attempts", "warnings",
            "stats", "outputs", "logs", "branches", "transcript")
    out = {k: result[k] for k in keep if k in result}
    if "branches" in result and "n" in result:
        out["n"] = result["n"]
    if "choices" in result:  # a forked line's: which branch, and its own outputs
        out["choices"] = [
            {k: c[k] for k in ("index", "sample", "branch", "valid", "outputs", "stats")
             if k in c}
            for c in result["choices"]]
    return out


def to_output(result: dict[str, Any], request: Request | None, model: str,
              created: int | None = None) -> dict[str, Any]:
    """The output line for one result; `request` is None when the line never parsed as a
    request with a custom_id (its custom_id is then null)."""
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    custom_id = request.custom_id if request is not None else None
    line: dict[str, Any] = {"id": f"batch_{request_id}", "custom_id": custom_id}
    if result.get("finish_reason") == "error":
        err = result.get("error", {})
        message = str(err.get("message", ""))
        if request is not None:
            # A message may name a tool field the request lacks ("needs 'tools'").
            tools = tuple((key, f"body.{key}") for key in _TOOLS) if request.url == CHAT else ()
            message = _request_names(message, (*tools, *request.fields))
        line["response"] = None
        line["error"] = {"code": err.get("type", "error"), "message": message}
        line["aici"] = _aici(result)
        return line
    chat = request is None or request.url == CHAT
    samples = result.get("choices") or [result]
    prompt_tokens = int(samples[0].get("stats", {}).get("prompt_tokens", 0))
    cached = int(samples[0].get("stats", {}).get("cached_tokens", 0))
    completion = sum(int(s.get("stats", {}).get("output_tokens", 0)) for s in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [_choice(s, i, chat) for i, s in enumerate(samples)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                  "total_tokens": prompt_tokens + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    line["error"] = None
    line["aici"] = _aici(result)
    return line


def _request_names(message: str, fields: tuple[tuple[str, str], ...]) -> str:
    """`message` with each line field it quotes ('json_schema', 'choices[0]') named as
    the request field it came from ('body.guided_json', 'body.guided_choice[0]')."""
    if not fields:
        return message
    names = dict(fields)
    pattern = "|".join(re.escape(name) for name in names)
    return re.sub(rf"'({pattern})((?:[.\[][^']*)?)'",
                  lambda m: f"'{names[m.group(1)]}{m.group(2)}'", message)


class BatchFormat:
    """The OpenAI batch format for one run: requests in (`translate`, for `read_jobs`),
    output lines out (`output`), matched by input line number."""

    def __init__(self, model: str, why: str = "--format openai") -> None:
        self.model = model
        self.why = why  # why the file is read in this format, for a line that is not
        self.created = int(time.time())
        self.requests: dict[int, Request] = {}

    def translate(self, obj: dict[str, Any], index: int) -> dict[str, Any]:
        custom_id = obj.get("custom_id")
        if isinstance(custom_id, str) and custom_id:  # known even if the request is refused
            url = obj.get("url")
            self.requests[index] = Request(custom_id, url if url == COMPLETIONS else CHAT)
        if line_format(obj) == "aici":
            own = load_schema("input-line")["properties"]
            raise TranslateError(
                f"a line of aici-batch's own format (it has {_shown_keys(obj, own)}) in a "
                f"file read as OpenAI batch requests ({self.why})", "format_mismatch")
        line, self.requests[index] = to_line(obj)
        return line

    def output(self, result: dict[str, Any]) -> dict[str, Any]:
        request = self.requests.pop(int(result.get("index", 0)), None)
        return to_output(result, request, self.model, self.created)


def is_output_line(obj: Any) -> bool:
    """True for an output line of this format written by aici-batch (it has `aici`)."""
    return isinstance(obj, dict) and "custom_id" in obj and isinstance(obj.get("aici"), dict)


def as_result(line: dict[str, Any]) -> dict[str, Any]:
    """An output line of this format read back as aici-batch's own result line (for
    `--resume` and `report`); other lines are returned unchanged."""
    if not is_output_line(line):
        return line
    own = line["aici"]
    body = (line.get("response") or {}).get("body") or {}
    samples = body.get("choices") or [{}]
    figures = own.get("choices") or [own]

    def text_of(choice: dict[str, Any]) -> str:
        message = choice.get("message") or {}
        return str(message.get("content") or choice.get("text") or "")

    def calls_of(choice: dict[str, Any]) -> dict[str, Any]:
        calls = (choice.get("message") or {}).get("tool_calls")
        return {"tool_calls": calls} if calls else {}

    result: dict[str, Any] = {"id": line.get("custom_id") or str(own.get("index")),
                              "index": own.get("index")}
    for key in ("input_sha256", "made_with"):
        if key in own:
            result[key] = own[key]
    error = line.get("error")
    result["text"] = text_of(samples[0])
    result["finish_reason"] = "error" if error else samples[0].get("finish_reason", "stop")
    if error:
        result["error"] = {"type": str(error.get("code")), "message": str(error.get("message"))}
    for key in ("valid", "relaxed", "attempts", "warnings", "outputs", "logs"):
        if key in own:
            result[key] = own[key]
    result["stats"] = own.get("stats", {})
    forked = "branches" in own
    if len(samples) > 1 or forked:
        if forked:
            result["branches"] = own["branches"]
            if "n" in own:
                result["n"] = own["n"]
        else:
            result["n"] = len(samples)
        result["choices"] = [
            {"index": i, "text": text_of(c), "finish_reason": c.get("finish_reason", "stop"),
             **{k: f[k] for k in ("sample", "branch", "valid", "outputs", "stats") if k in f},
             **calls_of(c)}
            for i, (c, f) in enumerate(zip(samples, figures))
        ]
    result.update(calls_of(samples[0]))
    return result
