"""The constraint an OpenAI batch request asks for, as the fields of aici-batch's own line.

Three spellings lead to the same built-in controllers: OpenAI's `response_format`, vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) and
vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
A request asks for one constraint at most. The options that shape a JSON schema map onto
the line's `whitespace_pattern` and `json_permissive`; options that only permit what
aici-batch's outputs already satisfy, or pick vLLM's backend, are accepted and ignored.
The values themselves are checked with the line (`jobs.parse`), whose messages then name
the request's field (see `Request.fields`).
"""

from __future__ import annotations

import json
from typing import Any

from aici_cli.core.job import TranslateError
from aici_cli.core.json_text import json_type

# vLLM's top-level fields and `structured_outputs` keys that are a constraint, and the
# line field each becomes.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
           "guided_choice": "choices", "guided_grammar": "grammar"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choices",
               "grammar": "grammar"}
# `structured_outputs` keys besides those: options (read below) and `json_object`.
_STRUCTURED_OPTIONS = {"json_object", "whitespace_pattern", "disable_any_whitespace",
                       "disable_additional_properties", "disable_fallback"}

# The body fields read here, for the request reader's list of known fields.
BODY_FIELDS = ("response_format", "structured_outputs", *_GUIDED,
               "guided_whitespace_pattern", "guided_decoding_backend")


class BatchRequestError(TranslateError):
    """A request this format reader cannot run; the message names the offending field."""


def constraint_fields(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The line fields of the request's constraint and its JSON options, and for each of
    them the request field it came from; raises BatchRequestError."""
    options = _structured_outputs(body.get("structured_outputs"))
    asked = _constraints(body, options)
    if len(asked) > 1:
        names = " and ".join(source for source, _, _ in asked)
        raise BatchRequestError(f"a request takes one constraint, got {names}")
    line: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, field, value in asked:
        line[field] = _schema(value, source) if field == "json_schema" else value
        sources[field] = source
    on_json = "json_schema" in line
    whitespace = _whitespace(body, options, on_json)
    if whitespace is not None:
        source, line["whitespace_pattern"] = whitespace
        sources["whitespace_pattern"] = source
        if asked and not on_json:
            raise BatchRequestError(f"{source} applies to a JSON schema, not to {asked[0][0]}")
    closed = _flag(options, "disable_additional_properties")
    if closed and on_json:
        # false is vLLM's default, which only permits undeclared keys: outputs without
        # them satisfy it too, so only true changes anything.
        line["json_permissive"] = False
        sources["json_permissive"] = "body.structured_outputs.disable_additional_properties"
    _flag(options, "disable_fallback")  # vLLM's backend choice: checked, nothing to do here
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise BatchRequestError("body.guided_decoding_backend must be a string, got "
                           f"{json_type(backend)}")
    return line, sources


def _structured_outputs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BatchRequestError(
            f"body.structured_outputs must be an object, got {json_type(value)}")
    # A key set to null is unset (clients that write every key of vLLM's
    # StructuredOutputsParams send `"structural_tag": null`).
    given = {key for key, item in value.items() if item is not None}
    unknown = sorted(given - set(_STRUCTURED) - _STRUCTURED_OPTIONS)
    if unknown:
        raise BatchRequestError(
            f"unsupported body.structured_outputs field(s): {', '.join(unknown)}")
    return value


def _constraints(body: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(request field, line field, value) of every constraint the request gives."""
    asked: list[tuple[str, str, Any]] = []
    response = _response_format(body.get("response_format"))
    if response is not None:
        asked.append((response[0], "json_schema", response[1]))
    asked += [(f"body.{name}", field, body[name]) for name, field in _GUIDED.items()
              if body.get(name) is not None]
    asked += [(f"body.structured_outputs.{key}", field, options[key])
              for key, field in _STRUCTURED.items() if options.get(key) is not None]
    if _flag(options, "json_object"):
        asked.append(("body.structured_outputs.json_object", "json_schema", {"type": "object"}))
    return asked


def _response_format(fmt: Any) -> tuple[str, Any] | None:
    """(request field, JSON schema) of a `response_format`; None for plain text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BatchRequestError("body.response_format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "body.response_format", {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BatchRequestError("response_format json_schema needs json_schema.schema")
        schema = spec["schema"]
        if not isinstance(schema, (dict, bool)):
            raise BatchRequestError("response_format json_schema.schema must be a JSON object")
        return "body.response_format.json_schema.schema", schema
    raise BatchRequestError(f"response_format type {kind!r} is not supported "
                       "(use text, json_object or json_schema)")


def _schema(value: Any, source: str) -> Any:
    """vLLM takes a schema as an object or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise BatchRequestError(f"{source} is a string but not JSON text: {e}") from None


def _whitespace(body: dict[str, Any], options: dict[str, Any],
                on_json: bool) -> tuple[str, str] | None:
    """(request field, pattern) of the whitespace the request allows between JSON tokens;
    None for the compact default."""
    given = [(f"body.{where}", value) for where, value in (
        ("guided_whitespace_pattern", body.get("guided_whitespace_pattern")),
        ("structured_outputs.whitespace_pattern", options.get("whitespace_pattern")),
    ) if value is not None]
    for source, value in given:
        if not isinstance(value, str):
            raise BatchRequestError(f"{source} must be a string, got {json_type(value)}")
    # true means no whitespace at all; false (vLLM's default) only permits it, and the
    # compact default satisfies that. Neither means anything without a JSON schema.
    if _flag(options, "disable_any_whitespace") and on_json:
        given.append(("body.structured_outputs.disable_any_whitespace", ""))
    if len(given) > 1:
        raise BatchRequestError(f"{given[0][0]} and {given[1][0]} both set the whitespace; "
                           "give one")
    return given[0] if given else None


def _flag(options: dict[str, Any], key: str) -> bool:
    value = options.get(key)
    if value is not None and not isinstance(value, bool):
        raise BatchRequestError(f"body.structured_outputs.{key} must be true or false, got "
                           f"{json_type(value)}")
    return bool(value)
