"""Chat message `content` as a list of parts, as the OpenAI SDK writes it.

`[{"type": "text", "text": "..."}, ...]` becomes one string, the texts joined with a
newline, as vLLM joins them for a text-only model; a part of any other type (an image,
audio, a file) is the line's error, naming the part and its type, since the models
here read text only. Runs before the line is checked against its schema, which then
sees plain strings.
"""

from __future__ import annotations

from typing import Any

from aici_cli.core.json_text import json_type


def join_text_parts(messages: Any) -> tuple[Any, str | None]:
    """`messages` with every list-of-parts `content` joined into a string, and the
    problem with the first part that cannot be joined (None: there is none). Anything
    else (not a list, a message that is not an object) comes back as it is, for the
    schema check to name."""
    if not isinstance(messages, list) or not any(
            isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
        return messages, None
    out: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        texts: list[str] = []
        for k, part in enumerate(content):
            where = f"messages[{i}].content[{k}]"
            if not isinstance(part, dict):
                return messages, (f"field '{where}' must be a content part object, got "
                                  f"{json_type(part)}")
            kind = part.get("type")
            if kind != "text":
                shown = f"'{kind}'" if isinstance(kind, str) else json_type(kind)
                return messages, (f"field '{where}' is a part of type {shown}: only text "
                                  "parts can run here (the model reads text)")
            text = part.get("text")
            if not isinstance(text, str):
                return messages, f"field '{where}.text' must be string, got {json_type(text)}"
            texts.append(text)
        out.append({**message, "content": "\n".join(texts)})
    return out, None
