"""Rendering `messages` with the model's chat template."""

from __future__ import annotations

from typing import Any

from aici_cli.core.errors import ModelError, NoChatTemplateError, one_line
from aici_cli.models.tokenizer.tool_prompt import (
    plain_messages,
    template_messages,
    template_takes_tools,
    template_tools,
    uses_tools,
)

# The tokenizer attribute `load_model` records the model's name in, for `render_prompt`.
MODEL_NAME_ATTR = "aici_model_name"


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The chat-template rendering of `messages`, ending with the assistant turn's opening.

    `tools`, and tool calls and results in `messages`, go through the template's own tool
    support where it reads `tools`, else into plain messages (`tool_prompt.py`).

    The result already contains any BOS the template emits, so encode it without adding
    special tokens again. Both failures (no template: NoChatTemplateError; a template that
    rejects the messages, e.g. an unsupported role: ModelError) are reported by the engine
    as that input line's error rather than aborting the run. There is no fallback format
    for a model without a template: a guessed one would silently prompt the model in a
    format it was never trained on.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, MODEL_NAME_ATTR, None) or tokenizer.name_or_path
        raise NoChatTemplateError(
            f"model {name!r} has no chat template, so 'messages' cannot be rendered; "
            "give this line a 'prompt' (raw text) instead"
        )
    extra: dict[str, Any] = {}
    try:
        if uses_tools(messages, tools):
            if template_takes_tools(tokenizer.get_chat_template(None, tools)):
                messages = template_messages(messages)
                extra["tools"] = template_tools(tools) if tools is not None else None
            else:
                messages = plain_messages(messages, tools)
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as exc:  # jinja errors, raise_exception() inside templates
        raise ModelError(f"chat template failed: {one_line(exc)}") from exc
    return str(rendered)
