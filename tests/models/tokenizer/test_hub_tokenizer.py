"""A fast tokenizer read without transformers (`models/tokenizer/fast_tokenizer.py`) answers as
transformers' own class does: the same ids for any text (special tokens inside it too),
the same text back, the same padded batches, and the same rendered chat for generated
conversations, tools and templates. Files that ask for more go to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_model import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE

from aici_cli.models.tokenizer.fast_tokenizer import HubTokenizer, read_hub_tokenizer

# Templates exercising what the sandbox provides: loop controls, namespaces, tojson's
# options, raise_exception, dict(), {% generation %}, and the default model's own.
FEATURES_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'boom' %}{{ raise_exception('no boom role') }}{% endif %}"
    "[{{ ns.n }}:{{ m['role'] }}]{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% if m['reasoning_content'] is defined %}<think>{{ m['reasoning_content'] }}</think>"
    "{% endif %}\n"
    "{% endfor %}"
    "{{ dict(a=1, b=tools) | tojson(indent=2, sort_keys=True) }}"
    "{{ messages | tojson(separators=[',', ':']) }}{{ eos_token }}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = [CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, FEATURES_TEMPLATE, SMOL_TEMPLATE]


def _pair(path: Path) -> tuple[HubTokenizer, Any]:
    from transformers import AutoTokenizer

    mine = read_hub_tokenizer(path)
    assert mine is not None
    theirs = AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True)
    for tok in (mine, theirs):
        if tok.pad_token is None:  # as load_model sets it
            tok.pad_token = tok.eos_token
    return mine, theirs


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir: Path) -> tuple[HubTokenizer, Any]:
    return _pair(tiny_model_dir)


def _texts(specials: list[str]) -> st.SearchStrategy[str]:
    """Unicode text with the tokenizer's special tokens spliced in here and there."""
    piece = st.one_of(st.text(max_size=12), st.sampled_from(specials),
                      st.sampled_from([" ", "\n", "  ", "\t", "é", "你好", "🙂", "'s", "{\""]))
    return st.lists(piece, max_size=8).map("".join)


def _check_text(mine: HubTokenizer, theirs: Any, text: str, special: bool) -> None:
    ids = mine(text, add_special_tokens=special)["input_ids"]
    assert ids == theirs(text, add_special_tokens=special)["input_ids"]
    assert mine.encode(text, add_special_tokens=special) == ids
    for skip in (False, True):
        assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data(), special=st.booleans())
def test_ids_and_text_match_transformers(tiny_pair: tuple[HubTokenizer, Any],
                                         data: st.DataObject, special: bool) -> None:
    mine, theirs = tiny_pair
    specials = [t for t in (mine.bos_token, mine.eos_token) if t]
    _check_text(mine, theirs, data.draw(_texts(specials)), special)


@SETTINGS
@given(texts=st.lists(st.text(max_size=20), min_size=1, max_size=4))
def test_padded_batches_match_transformers(tiny_pair: tuple[HubTokenizer, Any],
                                           texts: list[str]) -> None:
    mine, theirs = tiny_pair
    a = mine(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    b = theirs(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a["attention_mask"].tolist() == b["attention_mask"].tolist()
    one = mine(texts[0], return_tensors="pt")
    assert one.input_ids.tolist() == theirs(texts[0], return_tensors="pt").input_ids.tolist()


def test_special_tokens_and_ids_match_transformers(tiny_pair: tuple[HubTokenizer, Any]) -> None:
    mine, theirs = tiny_pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(mine, name) == getattr(theirs, name)
        assert getattr(mine, f"{name}_id") == getattr(theirs, f"{name}_id")
    assert mine.special_tokens_map == theirs.special_tokens_map
    assert len(mine) == len(theirs)
    tokens = theirs.convert_ids_to_tokens(list(range(len(theirs))))
    assert mine.convert_ids_to_tokens(list(range(len(mine)))) == tokens
    assert mine.convert_tokens_to_ids([*tokens[:50], "no-such-token"]) == \
        theirs.convert_tokens_to_ids([*tokens[:50], "no-such-token"])
    assert mine.decode(5) == theirs.decode(5)


_content = st.one_of(st.text(max_size=15), st.sampled_from(["", " x ", "<|user|>", "{}", "\n"]))
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
     "content": st.one_of(_content, st.none())},
    optional={"reasoning_content": _content, "name": st.one_of(st.text(max_size=5), st.none()),
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": st.text(max_size=6),
                   "arguments": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)})}),
                  max_size=2)})
_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.text(min_size=1, max_size=8), "description": st.text(max_size=20),
    "parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}})})})


def _render(tok: Any, template: str, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None, gen: bool) -> tuple[str, str]:
    """("ok", text) or ("error", its type): both sides must agree on either."""
    try:
        return "ok", str(tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=gen,
                                                 chat_template=template))
    except Exception as exc:  # noqa: BLE001 - the template's own failures are compared
        return "error", type(exc).__name__


@SETTINGS
@given(template=st.sampled_from(TEMPLATES), gen=st.booleans(),
       messages=st.lists(_message, min_size=1, max_size=4),
       tools=st.one_of(st.none(), st.lists(_tool, min_size=1, max_size=2)))
def test_rendered_chats_match_transformers(tiny_pair: tuple[HubTokenizer, Any], template: str,
                                           gen: bool, messages: list[dict[str, Any]],
                                           tools: list[dict[str, Any]] | None) -> None:
    mine, theirs = tiny_pair
    got = _render(mine, template, messages, tools, gen)
    assert got == _render(theirs, template, messages, tools, gen)
    if got[0] == "ok" and template is FEATURES_TEMPLATE:
        assert mine.apply_chat_template(messages, tools=tools, chat_template=template,
                                        add_generation_prompt=gen) == \
            mine.encode(got[1], add_special_tokens=False)


def test_named_templates_are_chosen_as_transformers_chooses(tiny_pair: tuple[HubTokenizer, Any],
                                                            ) -> None:
    mine, theirs = tiny_pair
    named = {"default": CHAT_TEMPLATE, "tool_use": TOOLS_CHAT_TEMPLATE}
    original = mine.chat_template
    try:
        mine.chat_template = named
        for tools in (None, [{"type": "function", "function": {"name": "f"}}]):
            want = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
            assert mine.get_chat_template(None, tools) == want
        assert mine.get_chat_template("tool_use") == TOOLS_CHAT_TEMPLATE
    finally:
        mine.chat_template = original
    assert mine.get_chat_template() == theirs.get_chat_template()


@pytest.mark.real_model
@settings(max_examples=40, deadline=None)
@given(data=st.data(), special=st.booleans())
def test_the_default_models_tokenizer_matches_transformers(data: st.DataObject,
                                                           special: bool) -> None:
    mine, theirs = _default_pair()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    _check_text(mine, theirs, data.draw(_texts(specials)), special)
    messages = data.draw(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": _content}),
        min_size=1, max_size=3))
    assert _render(mine, mine.get_chat_template(), messages, None, True) == \
        _render(theirs, theirs.get_chat_template(), messages, None, True)


_DEFAULT: list[tuple[HubTokenizer, Any]] = []


def _default_pair() -> tuple[HubTokenizer, Any]:
    if not _DEFAULT:
        from aici_cli.models.sources.resolve import resolve_with_name

        _DEFAULT.append(_pair(resolve_with_name(None)[0]))
    return _DEFAULT[0]


def _edited(source: Path, dest: Path, config: dict[str, Any] | None = None,
            tokenizer: dict[str, Any] | None = None) -> Path:
    shutil.copytree(source, dest)
    for name, changes in (("tokenizer_config.json", config), ("tokenizer.json", tokenizer)):
        if changes:
            raw = json.loads((dest / name).read_text())
            raw.update(changes)
            (dest / name).write_text(json.dumps(raw))
    return dest


@pytest.mark.parametrize(("config", "tokenizer"), [
    ({"tokenizer_class": "LlamaTokenizer"}, None),
    ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, None),
    ({"add_bos_token": True}, None),
    ({"bos_token": "<not-in-the-vocabulary>"}, None),
    ({"extra_special_tokens": ["<x>"]}, None),
    (None, {"truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                           "direction": "Right"}}),
    (None, {"post_processor": None}),
])
def test_files_that_ask_for_more_go_to_transformers(tiny_model_dir: Path, tmp_path: Path,
                                                    config: dict[str, Any] | None,
                                                    tokenizer: dict[str, Any] | None) -> None:
    assert read_hub_tokenizer(tiny_model_dir) is not None
    assert read_hub_tokenizer(_edited(tiny_model_dir, tmp_path / "m", config, tokenizer)) is None


def test_llguidances_token_table_is_the_one_its_transformers_wrapper_builds(
        tiny_pair: tuple[HubTokenizer, Any]) -> None:
    import llguidance.hf

    from aici_cli.control.grammar.compiler import ll_tokenizer

    mine, theirs = tiny_pair
    vocab = len(theirs) + 30  # logits wider than the vocabulary, as models have
    eos = [theirs.eos_token_id]
    want = llguidance.hf.from_tokenizer(theirs, n_vocab=vocab, eos_token=eos)
    for tok in (mine, theirs):
        got = ll_tokenizer(tok, vocab, eos)
        assert (got.vocab_size, got.eos_token) == (want.vocab_size, want.eos_token)
        for i in range(vocab):
            assert got.decode_bytes([i]) == want.decode_bytes([i])
            assert got.is_special_token(i) == want.is_special_token(i)
        for text in ("hello world", "<s> x </s>", "é 🙂"):
            assert got.tokenize_str(text) == want.tokenize_str(text)
