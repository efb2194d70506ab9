"""A Hugging Face fast tokenizer read without transformers.

Importing transformers costs ~0.45 s and ~25 MB of a run's start (its package scans its
model folders on import), about half of what a run spends besides torch. A fast
tokenizer is a `tokenizers` file plus a few settings, so where its files ask for nothing
that only transformers' tokenizer classes do, it is read here: `tokenizer.json` through
the `tokenizers` library, the special tokens from `tokenizer_config.json`, and the chat
template rendered as transformers renders it (`chat_jinja`).

`read_hub_tokenizer` says None for anything else, and the caller loads transformers'
class as before: another tokenizer class or remote code, a setting that changes encoding
in transformers' code (a BOS/EOS flag, truncation or padding in the file, a special
token missing from the vocabulary, extra special tokens, a vocabulary over 100k, where
transformers patches a pre-tokenizer regex, WordPiece-era spacing clean-up), or
templates in more than one place.

`HubTokenizer` answers the part of transformers' tokenizer interface the tool uses:
`__call__`/`encode` (one text or a list, left padding, `return_tensors="pt"`), `decode`,
token/id conversions, the special tokens and their ids, `len`, `backend_tokenizer`,
`chat_template`, `get_chat_template` and `apply_chat_template` (rendering only).
`tests/models/tokenizer/test_hub_tokenizer.py` checks each against transformers' class on
generated inputs, for the test model's tokenizer and the default model's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# tokenizer_config.json's classes that are a tokenizer.json and settings, nothing more.
_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")
# tokenizer_config.json keys read here, or without effect on encoding and rendering.
_KNOWN_KEYS = frozenset({
    *_SPECIAL, "tokenizer_class", "backend", "is_local", "local_files_only",
    "model_max_length", "clean_up_tokenization_spaces", "added_tokens_decoder",
    "chat_template", "padding_side", "truncation_side", "model_input_names", "name_or_path",
})
_MAX_PLAIN_VOCAB = 100_000  # above it transformers may patch the pre-tokenizer (Mistral)


class Encoded(dict[str, Any]):
    """transformers' BatchEncoding as far as used: keys and the same names as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HubTokenizer:
    """A fast tokenizer from its files (see the module docstring); `padding_side` left."""

    is_fast = True

    def __init__(self, backend: Any, config: Mapping[str, Any], template: Any,
                 name_or_path: str) -> None:
        self.backend_tokenizer = backend  # tokenizers.Tokenizer
        self.name_or_path = name_or_path
        self.chat_template = template  # str, {name: str} or None
        self.padding_side = "left"
        self.model_max_length = int(config.get("model_max_length", 10**30))
        self._special: dict[str, str | None] = {
            key: _token_text(config.get(key)) for key in _SPECIAL}

    # -- special tokens --

    def __getattr__(self, name: str) -> Any:
        special = self.__dict__.get("_special", {})
        if name in special:
            return special[name]
        if name.endswith("_id") and name[:-3] in special:
            token = special[name[:-3]]
            return None if token is None else self.backend_tokenizer.token_to_id(token)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SPECIAL:
            self._special[name] = _token_text(value)
        else:
            object.__setattr__(self, name, value)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: v for k, v in self._special.items() if v is not None}

    # -- encoding --

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True,
                 padding: bool = False, return_tensors: str | None = None) -> Encoded:
        """transformers' call: one text's ids, or a list's (left-padded with `padding`);
        with return_tensors="pt", [rows, length] tensors."""
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, add_special_tokens) for t in texts]
        masks = [[1] * len(row) for row in ids]
        if padding or return_tensors:
            width = max((len(row) for row in ids), default=0)
            if padding:
                pad = self.pad_token_id
                if pad is None:
                    raise ValueError("the tokenizer has no pad token to pad with")
                ids = [[pad] * (width - len(row)) + row for row in ids]
                masks = [[0] * (width - len(m)) + m for m in masks]
            elif any(len(row) != width for row in ids):
                raise ValueError("texts of different lengths need padding=True for tensors")
        if return_tensors == "pt":
            import torch

            return Encoded(input_ids=torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(masks, dtype=torch.long))
        if return_tensors is not None:
            raise ValueError(f"unsupported return_tensors {return_tensors!r}")
        if isinstance(text, str):
            return Encoded(input_ids=ids[0], attention_mask=masks[0])
        return Encoded(input_ids=ids, attention_mask=masks)

    def decode(self, ids: int | Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return str(self.backend_tokenizer.decode(list(ids),
                                                 skip_special_tokens=skip_special_tokens))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def _token_id(self, token: str) -> int | None:
        found = self.backend_tokenizer.token_to_id(token)
        return found if found is not None else self.unk_token_id

    # -- chat templates --

    def get_chat_template(self, chat_template: str | None = None,
                          tools: list[Any] | None = None) -> str:
        """The template to render with, chosen as transformers chooses: a name picks one
        of several, else "tool_use" with tools where there is one, else "default"."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return str(templates[chat_template])
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in templates:
                return str(templates["tool_use"])
            if "default" in templates:
                return str(templates["default"])
            raise ValueError("This model has multiple chat templates with no default "
                             f"specified! Please pass a template name; available: "
                             f"{sorted(templates)}.")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("Cannot use chat template functions because "
                             "tokenizer.chat_template is not set.")
        return str(templates)

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            tools: list[Any] | None = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> Any:
        """The conversation rendered (tokenize=False) or its ids, as transformers does
        for one conversation; `kwargs` reach the template beside the special tokens."""
        from aici_cli.models.tokenizer import chat_jinja  # jinja2: ~0.1 s, for runs with messages

        source = self.get_chat_template(chat_template, tools)
        text = chat_jinja.render(source, conversation, tools, add_generation_prompt,
                                 {**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def read_hub_tokenizer(path: Path) -> HubTokenizer | None:
    """The tokenizer at `path` read without transformers, or None where its files ask
    for more (see the module docstring). Raises where a file is unreadable."""
    config = _json(path / "tokenizer_config.json")
    file = path / "tokenizer.json"
    if not isinstance(config, dict) or not file.is_file():
        return None
    if config.get("tokenizer_class") not in _CLASSES or set(config) - _KNOWN_KEYS:
        return None
    template = _template(path, config)
    if template is False:
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(file))  # ~0.1 s for a 49k vocabulary
    if backend.truncation or backend.padding or backend.post_processor is None \
            or backend.get_vocab_size(with_added_tokens=False) > _MAX_PLAIN_VOCAB:
        return None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers rewrites decoded spacing (it leaves BPE text alone)
    added = {t.content: (i, t.special) for i, t in backend.get_added_tokens_decoder().items()}
    for key in _SPECIAL:  # transformers adds a special token it does not find
        token = _token_text(config.get(key))
        if token is not None and (token not in added or not added[token][1]):
            return None
    for index, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or content not in added \
                or added[content][0] != int(index):
            return None
    return HubTokenizer(backend, config, template, str(path))


def _template(path: Path, config: Mapping[str, Any]) -> Any:
    """The chat template (a string, {name: string} or None); False where transformers
    would merge templates from several places."""
    in_config = config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    others = (path / "chat_template.json").exists() or (
        path / "additional_chat_templates").exists()
    if others or (in_config is not None and jinja_file.is_file()):
        return False
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    if isinstance(in_config, list):
        return {t["name"]: t["template"] for t in in_config}
    return in_config


def _json(file: Path) -> Any:
    if not file.is_file():
        return None
    return json.loads(file.read_text(encoding="utf-8"))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken
    record ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
