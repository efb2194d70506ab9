"""A tiny random-weight Llama model plus tokenizer, built in code for fast offline tests.

The weights are random (seeded), so generations are gibberish but deterministic for a
given torch build; tests should rely on mechanics (shapes, constraints, stop handling),
never on content. The tokenizer is byte-level BPE, so every string is encodable, and it
mirrors the default SmolLM2 tokenizer in adding no special tokens on encode: the chat
template writes `<s>` itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<s>"
EOS = "</s>"

# Renders e.g. "<s><|user|>\nhi</s>\n<|assistant|>\n"; role markers are ordinary text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A template that reads `tools`, as Hermes's and Qwen's do: the tools in a system turn, an
# assistant's calls as <tool_call> blocks (the form aici-batch's tool-call grammar writes),
# a tool's result as a <|tool|> turn.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>\n{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an model token batch prompt answer json schema regex value key name id "
    "quick brown fox jumps over lazy dog Alice Bob Paris London True False null yes no "
    "Hello World Error Result Output Input Number String Object Array Item List"
)
_WORDS = _WORD_TEXT.split()


def _corpus(rng: random.Random) -> list[str]:
    """A few KB of English-like and JSON-like lines with digits, quotes, braces, both cases."""
    lines: list[str] = []
    for _ in range(60):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ","]))
    for i in range(60):
        key, other = rng.choice(_WORDS), rng.choice(_WORDS)
        value = rng.choice(
            [str(rng.randint(-1000, 100000)), f'"{rng.choice(_WORDS)}"', "true", "null"]
        )
        lines.append(f'{{"{key}": {value}, "{other}": [{i}, {rng.random():.3f}], "ok": false}}')
    lines.append("0123456789 {}[]():;,.'\"`~!@#$%^&*-_+=<>/?\\| \t\n")
    return lines


def _build_tokenizer() -> Tokenizer:
    rng = random.Random(0)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=768,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no UNK
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(rng), trainer)
    return tokenizer


def build_tiny_model(directory: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write a 2-layer Llama (hidden 64, tied embeddings) and its tokenizer to `directory`.

    Takes well under a second once transformers is imported. The global torch RNG is left
    untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    backend = _build_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=2048,
    )
    tokenizer.chat_template = chat_template

    bos_id, eos_id = backend.token_to_id(BOS), backend.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id

    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_gguf(model_dir: Path, path: Path, quant: str | None = None) -> Path:
    """The tiny Llama as a float32 GGUF file, laid out as llama.cpp's converter writes it;
    with `quant` ("Q4_0", "Q4_1"), its linear layers in that type and the (tied) embedding
    in Q8_0, as in the default model's file."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    special = {t["content"] for t in tok["added_tokens"]}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # llama.cpp interleaves q/k rows for its rotary embedding; the loader undoes it.
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)

    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, weight in load_file(model_dir / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"  # the output layer is tied to it
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, part = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gguf_name = f"blk.{layer}.{parts[part]}.weight"
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                weight = permute(weight, heads if part == "self_attn.q_proj" else kv_heads)
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        kind = None if quant is None or weight.ndim != 2 else (
            "Q8_0" if gguf_name == "token_embd.weight" else quant)
        if kind is None:
            writer.add_tensor(gguf_name, weight)
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
