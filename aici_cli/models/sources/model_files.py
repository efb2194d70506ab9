"""Telling which file of a model is damaged, in one line a user can act on.

Called after transformers failed to load a model or tokenizer, whose own errors rarely
name the file: each check reads only what it needs (config.json, the JSON headers of
safetensors files, tokenizer files) and says what is wrong, or None when the files look
sound and the failure lies elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aici_cli.core.errors import one_line

# Weight files transformers looks for in a model directory, in its order of preference.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

# Tokenizer files that are JSON, checked when a tokenizer fails to load.
_TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# The safetensors format caps its JSON header at 100 MB; a larger length prefix means the
# file is not safetensors at all (random bytes, another format).
_MAX_SAFETENSORS_HEADER = 100_000_000


def missing_tensors_problem(names: list[str]) -> str:
    """What a load says of a checkpoint that lacks the model's tensors `names`."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"the weights lack {len(names)} of the model's tensors ({shown}); the files are "
            "incomplete or belong to another model")


def model_files_problem(model_dir: Path) -> str | None:
    """What is wrong with the config or weight files of `model_dir`, or None if they look
    sound (the failure then lies elsewhere). Reads only config.json and weight headers."""
    return _config_problem(model_dir / "config.json") or _weights_problem(model_dir)


def _config_problem(config: Path) -> str | None:
    from transformers import CONFIG_MAPPING

    value, problem = read_json(config)
    if problem is not None:
        return problem
    if not isinstance(value, dict):
        return f"{config.name} is not a JSON object"
    model_type = value.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return f"{config.name} has no model_type"
    if model_type not in CONFIG_MAPPING:
        import transformers

        return (
            f"{config.name} names model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not support"
        )
    return None


def _weights_problem(model_dir: Path) -> str | None:
    present = [name for name in _WEIGHT_FILES if (model_dir / name).is_file()]
    if not present:
        return f"no weights file (expected {', '.join(_WEIGHT_FILES[:-1])} or {_WEIGHT_FILES[-1]})"
    first = model_dir / present[0]
    if first.name == "model.safetensors":
        return _safetensors_problem(first)
    if first.name == "model.safetensors.index.json":
        return _sharded_problem(first)
    return None  # pickled torch weights: nothing cheap and safe to check


def _sharded_problem(index: Path) -> str | None:
    """Problems of a sharded checkpoint: its index, then each shard it names."""
    value, problem = read_json(index)
    if problem is not None:
        return problem
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict):
        return f"{index.name} has no weight_map"
    for shard_name in sorted({str(v) for v in weight_map.values()}):
        shard = index.parent / shard_name
        if not shard.is_file():
            return f"{shard_name}, named in {index.name}, is missing"
        problem = _safetensors_problem(shard)
        if problem is not None:
            return problem
    return None


def _safetensors_problem(file: Path) -> str | None:
    """Check a safetensors file's framing: an 8-byte header length, a JSON header, and
    tensor data as long as the header says. Reads the header only."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if header_len < 0 or header_len > min(size - 8, _MAX_SAFETENSORS_HEADER):
                return (
                    f"{file.name} is not a safetensors file, or is truncated ({size:,} bytes; "
                    "its header length is invalid)"
                )
            header = json.loads(f.read(header_len))
    except OSError as exc:
        return f"cannot read {file.name}: {exc.strerror or exc}"
    except ValueError:  # UnicodeDecodeError is a ValueError too
        return f"{file.name} is corrupt: its header is not valid JSON"
    if not isinstance(header, dict):
        return f"{file.name} is corrupt: its header is not a JSON object"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict)
        and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
        and isinstance(entry["data_offsets"][1], int)
    ]
    needed, held = max(ends, default=0), size - 8 - header_len
    if needed > held:
        return (
            f"{file.name} is truncated: its tensors need {needed:,} bytes of data, "
            f"the file holds {held:,}"
        )
    return None


def tokenizer_files_problem(model_dir: Path) -> str | None:
    for name in _TOKENIZER_JSON_FILES:
        file = model_dir / name
        if file.is_file():
            _, problem = read_json(file)
            if problem is not None:
                return problem
    vocabularies = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((model_dir / name).is_file() for name in vocabularies):
        return f"no tokenizer files (expected {', '.join(vocabularies[:-1])} or vocab.txt)"
    fast = model_dir / "tokenizer.json"
    if fast.is_file():
        # Valid JSON is not yet a tokenizer: ask the library that reads it.
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(fast))
        except Exception as exc:  # tokenizers raises a bare Exception for bad content
            return f"{fast.name} is not a valid tokenizer ({one_line(exc)})"
    return None


def read_json(file: Path) -> tuple[Any, str | None]:
    """(value, None), or (None, a one-line problem naming the file)."""
    try:
        text = file.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None, f"{file.name} is missing"
    except OSError as exc:
        return None, f"cannot read {file.name}: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        return None, f"{file.name} is not UTF-8 text (invalid byte at offset {exc.start:,})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        return None, f"{file.name} is not valid JSON ({exc.msg.removesuffix(' at')} at {where})"
    except RecursionError:
        return None, f"{file.name} is not usable JSON (nested too deeply)"

