"""The OpenAI batch format: requests mapped onto input lines, results onto output lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.formats.jobs import load_schema
from aici_cli.formats.openai_batch import (
    CHAT,
    COMPLETIONS,
    BatchRequestError,
    Request,
    looks_like_request,
    to_line,
    to_output,
)

SCHEMA = load_schema("openai-batch-output")


def request(url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "method": "POST", "url": url, "body": body}


def test_chat_request_maps_every_supported_field() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    line, req = to_line(request(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=20, temperature=0.5, top_p=0.9, seed=7, stop="END", n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    ))
    assert line == {"id": "r1", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                    "stop": ["END"], "n": 2, "json_schema": schema}
    assert (req.custom_id, req.url) == ("r1", CHAT)
    # Each line field remembers the request field it came from, for error messages.
    assert dict(req.fields) == {
        "messages": "body.messages", "max_tokens": "body.max_completion_tokens",
        "temperature": "body.temperature", "top_p": "body.top_p", "seed": "body.seed",
        "stop": "body.stop", "n": "body.n",
        "json_schema": "body.response_format.json_schema.schema"}


def test_completion_request_and_json_object() -> None:
    line, req = to_line(request(COMPLETIONS, prompt=["Once"], max_tokens=5,
                                response_format={"type": "json_object"}))
    assert line == {"id": "r1", "prompt": "Once", "max_tokens": 5,
                    "json_schema": {"type": "object"}}
    assert req.url == COMPLETIONS


@pytest.mark.parametrize(("req", "needle"), [
    (request(messages=[], functions=[{}], audio={}),
     "unsupported body field(s): audio, functions"),
    ({**request(messages=[]), "extra": 1}, "unsupported request field(s): extra"),
    ({**request(messages=[]), "url": "/v1/embeddings"}, "url '/v1/embeddings' is not supported"),
    ({**request(messages=[]), "method": "GET"}, "method must be POST"),
    ({**request(messages=[]), "custom_id": ""}, "custom_id must be a non-empty string"),
    (request(prompt="x"), "body.prompt belongs to /v1/completions"),
    (request(COMPLETIONS, prompt=["a", "b"]), "must be one string"),
    (request(messages=[], stream=True), "stream must be false"),
    (request(messages=[], stream=0), "stream must be false in a batch, got 0"),
    (request(messages=[], response_format={"type": "grammar"}), "type 'grammar' is not"),
    (request(messages=[], response_format={"type": "json_schema", "json_schema": {}}),
     "needs json_schema.schema"),
])
def test_unsupported_requests_name_the_field(req: dict[str, Any], needle: str) -> None:
    with pytest.raises(BatchRequestError, match=".*") as info:
        to_line(req)
    assert needle in str(info.value)


def test_detection() -> None:
    assert looks_like_request(request(messages=[]))
    assert not looks_like_request({"id": "x", "prompt": "p"})
    assert not looks_like_request([1])


RESULT = {"id": "r1", "index": 3, "text": '{"a": 1}', "finish_reason": "stop", "valid": True,
          "stats": {"prompt_tokens": 10, "cached_tokens": 6, "output_tokens": 4,
                    "forward_passes": 3}}


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_outputs_validate_against_the_documented_format(url: str) -> None:
    out = to_output(RESULT, Request("r1", url), "smollm2", created=1)
    jsonschema.validate(out, SCHEMA)
    body = out["response"]["body"]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 6}}
    choice = body["choices"][0]
    assert (choice["message"]["content"] if url == CHAT else choice["text"]) == '{"a": 1}'
    assert out["custom_id"] == "r1" and out["error"] is None
    assert out["aici"]["stats"]["forward_passes"] == 3 and out["aici"]["index"] == 3


def test_error_and_n_sample_outputs() -> None:
    err = {"id": "r2", "index": 4, "text": "", "finish_reason": "error",
           "error": {"type": "invalid_line", "message": "line 4: bad"}, "stats": {}}
    out = to_output(err, Request("r2", CHAT), "m")
    jsonschema.validate(out, SCHEMA)
    assert out["response"] is None and out["error"]["code"] == "invalid_line"

    two = {**RESULT, "n": 2, "choices": [
        {**RESULT, "index": 0, "finish_reason": "length"}, {**RESULT, "index": 1}]}
    out = to_output(two, Request("r1", CHAT), "m")
    jsonschema.validate(out, SCHEMA)
    choices = out["response"]["body"]["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "stop"]
    assert out["response"]["body"]["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------ through the CLI

def _write(path: Path, rows: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_openai_batch_file_runs_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rows: list[Any] = [
        {"custom_id": "chat-1", "method": "POST", "url": CHAT,
         "body": {"model": "any", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 5}},
        {"custom_id": "schema-1", "method": "POST", "url": CHAT,
         "body": {"model": "any", "messages": [{"role": "user", "content": "JSON please"}],
                  "max_completion_tokens": 40,
                  "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "s", "schema": schema}}}},
        {"custom_id": "text-1", "method": "POST", "url": COMPLETIONS,
         "body": {"model": "any", "prompt": "Once upon", "max_tokens": 4, "n": 3,
                  "temperature": 1.0, "seed": 3}},
        {"custom_id": "functions-1", "method": "POST", "url": CHAT,
         "body": {"model": "any", "messages": [], "functions": []}},
        "{not json",
    ]
    src, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    args = ["run", str(src), "-o", str(out), "--model", str(tiny_model_dir),
            "--dtype", "float32", "-q"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output  # two lines failed, the others ran
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(rows)
    for line in lines:
        jsonschema.validate(line, SCHEMA)
    by_id = {line["custom_id"]: line for line in lines}
    chat = by_id["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 5
    made = json.loads(by_id["schema-1"]["response"]["body"]["choices"][0]["message"]["content"])
    jsonschema.validate(made, schema)
    text = by_id["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and len(text["choices"]) == 3
    assert by_id["functions-1"]["response"] is None
    assert "unsupported body field(s): functions" in by_id["functions-1"]["error"]["message"]
    # The three samples share one prompt: one computes it, the others take its keys.
    samples = by_id["text-1"]["aici"]["choices"]
    assert sorted(c["stats"]["cached_tokens"] > 0 for c in samples) == [False, True, True]
    assert text["usage"]["prompt_tokens_details"]["cached_tokens"] == samples[0]["stats"][
        "cached_tokens"]
    [bad] = [line for line in lines if line["custom_id"] is None]
    assert bad["error"]["code"] == "invalid_json"

    # The output can be resumed like aici-batch's own: nothing is left to run.
    before = out.read_text()
    res = CliRunner().invoke(main, [*args, "--resume"])
    assert res.exit_code == 1 and out.read_text() == before
    # `report` reads the format back like its own result lines.
    res = CliRunner().invoke(main, ["report", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["lines"] == 5 and summary["errors"] == 2
    assert summary["schema_lines"] == 1


def test_logprobs_in_both_shapes(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows: list[Any] = [
        {"custom_id": "chat", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "text", "method": "POST", "url": COMPLETIONS,
         "body": {"prompt": "Once upon", "max_tokens": 4, "logprobs": 3}},
        {"custom_id": "plain", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}},
        {"custom_id": "bad", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}},
    ]
    src, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                    str(tiny_model_dir), "--dtype", "float32", "-q"])
    assert res.exit_code == 1, res.output
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    for line in lines.values():
        jsonschema.validate(line, SCHEMA)
    chat = lines["chat"]["response"]["body"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == lines["chat"]["aici"]["stats"]["output_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert "".join(bytes(c["bytes"]).decode("utf-8", "replace") for c in content) == (
        chat["message"]["content"])
    text = lines["text"]["response"]["body"]["choices"][0]
    lp = text["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert all(len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == text["text"]
    assert lines["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert "top_logprobs needs body.logprobs" in lines["bad"]["error"]["message"]


def test_null_fields_and_the_fields_vllm_ignores_are_accepted() -> None:
    """As the OpenAI SDK writes a request: every field it does not set may be null, and
    `user`, `metadata`, `store`, `service_tier`, `stream_options` and the like change
    nothing generated here."""
    messages = [{"role": "user", "content": "hi"}]
    line, _ = to_line(request(
        messages=messages, max_tokens=5, stream=False, stream_options=None, user="u-1",
        metadata={"job": "nightly"}, store=False, service_tier="auto",
        prompt_cache_key="k", safety_identifier="s", audio=None, functions=None,
        temperature=None, response_format=None, tools=None))
    assert line == {"id": "r1", "messages": messages, "max_tokens": 5}
    line, _ = to_line(request(COMPLETIONS, prompt="Once", stream_options={"include_usage": True},
                              top_logprobs=None, suffix=None))
    assert line == {"id": "r1", "prompt": "Once"}
    with pytest.raises(BatchRequestError, match=r"unsupported body field\(s\): audio$"):
        to_line(request(messages=messages, audio={"voice": "alloy"}))
