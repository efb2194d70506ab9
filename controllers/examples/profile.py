"""A multi-step program: fixed text, a JSON object by schema, then a free-text field.

Arg (JSON, optional): {"max_bio_tokens": 40}.
Outputs: "profile" (the object), "name" (from it), "bio" (one line of free text).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, fixed, gen, gen_json, set_output

PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@controller
def profile(ctx: Context) -> Generator[Any, Any, None]:
    max_bio = int(ctx.arg_json().get("max_bio_tokens", 40))
    yield fixed("\nProfile (JSON): ")
    person = yield from gen_json(PROFILE_SCHEMA, max_tokens=120)
    set_output("profile", person)
    set_output("name", person["name"])
    yield fixed("\nBio: ")
    bio = yield gen(stop="\n", max_tokens=max_bio)
    set_output("bio", bio.strip())
