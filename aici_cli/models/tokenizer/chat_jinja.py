"""Chat templates rendered as transformers renders them, without importing transformers.

A template is Jinja run in the sandbox transformers sets up for templates from the Hub
(`transformers.utils.chat_template_utils._compile_jinja_template`, 5.x): an immutable
sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson`
filter that keeps non-ASCII text and takes `indent`, `separators` and `sort_keys`, and
the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses
underscore names. `{% generation %}` blocks render their body (transformers tracks their
spans for assistant masks, which nothing here asks for).

The values a template sees are prepared as transformers prepares them: messages with
their None-valued keys dropped, a message's reasoning also under `reasoning_content` and
`thinking`, and everything rebuilt from plain JSON types.
`tests/models/tokenizer/test_hub_tokenizer.py` renders generated conversations both ways and
compares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning comes under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
            lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            "Chat templates cannot store underscore-prefixed attributes on a namespace, "
            f"but got {name!r}. Please rename the attribute.")


class _TemplateDict:
    """`dict(...)` in a template, without the class itself (no attribute escapes)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template `source`, compiled once per process (~ms for a typical template)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def render(source: str, messages: list[dict[str, Any]], tools: list[Any] | None,
           add_generation_prompt: bool, variables: Mapping[str, Any]) -> str:
    """`messages` rendered by the template `source`, with `tools` and `variables` (the
    tokenizer's special tokens, then any the caller adds) as the template's names."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. "
                         "Provide at least one message.")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        chat.append(_plain({k: v for k, v in message.items() if v is not None}))
    return compile_template(source).render(
        messages=_alias_reasoning(chat), tools=_plain(tools), documents=None,
        add_generation_prompt=add_generation_prompt, **_plain(dict(variables)))


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under `reasoning_content` and `thinking` too."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (what the sandbox may see); anything else
    becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
