"""The tiny architecture models (tests/support/arch_models.py) written as GGUF files, laid
out as llama.cpp's converter writes them (Gemma's with a sentencepiece vocabulary, the
others byte-level BPE), and the weights a conversion of such a file must hold.

Tensor names come from the `gguf` package's own name map (through transformers'
`get_gguf_hf_weights_map`, which reads it); what llama.cpp changes on the way is done
here as it does it: Llama's and Mistral's q/k rows interleaved for its RoPE, Gemma's norm
weights stored as 1 + w. Only the metadata transformers' GGUF reader uses is written; what
it does not read (Gemma's caps and query scale, Qwen 3's head size) takes its config
class's default on the way back, so the reference is built from the config transformers
reads back from the file, not from the directory's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The `gguf` architecture each model type is written as (Mistral as llama.cpp writes it:
# a "llama" file whose general.name says mistral). OLMo 2 has no GGUF reader in
# transformers, so it has no GGUF here.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
QUANTS = ("F16", "Q8_0")


def write_arch_gguf(model_dir: Path, path: Path, quant: str) -> Path:
    """The model at `model_dir` as a GGUF: matrices in `quant` (F16, Q8_0, a K-quant, or
    Q4_K_M: `k_mix_type`), vectors in F32 (as llama.cpp keeps norms and biases), the
    tokenizer as byte-level BPE."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type.removesuffix("_text")]
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-mistral" if cfg.model_type == "mistral" else f"tiny-{arch}")
    _write_metadata(writer, cfg)
    _write_tokenizer(writer, model_dir, arch, cfg.vocab_size)
    for gguf_name, weight in gguf_tensors(model).items():
        kind = k_mix_type(gguf_name) if quant == "Q4_K_M" else quant
        if weight.ndim == 1:
            writer.add_tensor(gguf_name, weight.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(gguf_name, weight.astype(np.float16))
        elif kind in K_QUANTS:
            writer.add_tensor(gguf_name, quantize_k(weight, kind),
                              raw_dtype=GGMLQuantizationType[kind])
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: Any, cfg: Any) -> None:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    # Gemma 3 keeps one RoPE per layer type: the file's base is the full layers' one.
    writer.add_rope_freq_base(float(rope.get("rope_theta") or
                                    rope["full_attention"]["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    # Without it Phi-3's config keeps its default pad id (32000), outside this vocabulary.
    writer.add_pad_token_id(cfg.pad_token_id)


def _write_tokenizer(writer: Any, model_dir: Path, arch: str, vocab_size: int) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    special = {t["content"] for t in tok["added_tokens"]}
    if arch.startswith("gemma"):
        _write_sentencepiece(writer, tokens, special, vocab_size)
    else:
        writer.add_tokenizer_model("gpt2")  # byte-level BPE
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                                 for m in tok["model"]["merges"]])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def _write_sentencepiece(writer: Any, tokens: list[str], special: set[str],
                         vocab_size: int) -> None:
    """A Gemma file's tokenizer as Gemma's files carry one: sentencepiece pieces (a space
    spelled U+2581), the 256 byte pieces for what no piece covers, and no merges
    (transformers rebuilds them from the order of the pieces). The pieces are the byte-
    level vocabulary's that spell text, as many as fit in the model's vocabulary beside
    the few transformers' GemmaTokenizer adds of its own (<pad>, <mask>, ...)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    # Specials at the ids the config names (bos 0, eos 1: the byte-level vocabulary's).
    pieces = [t for t in tokens if t in special] + ["<unk>"]
    types = [3] * (len(pieces) - 1) + [2]  # 3: control, 2: unknown
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # 6: byte
    seen = set(pieces)
    for token in tokens:
        try:
            text = bytes(to_byte[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        piece = text.replace(" ", "\u2581")
        if token in special or piece in seen or not text.isprintable():
            continue
        if len(pieces) >= vocab_size - 8:
            break
        seen.add(piece)
        pieces.append(piece)
        types.append(1)
    writer.add_tokenizer_model("llama")  # sentencepiece
    writer.add_token_list(pieces)
    writer.add_token_types(types)
    writer.add_token_scores([-float(i) for i in range(len(pieces))])
    writer.add_unk_token_id(pieces.index("<unk>"))


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names, as llama.cpp stores them (a tied output
    layer is not stored)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type.removesuffix("_text")]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg.to_dict())
    names = get_gguf_hf_weights_map(model, processor, model_type=arch)
    to_gguf = {hf: g for g, hf in names.items()}
    tied = getattr(cfg, "tie_word_embeddings", False)
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            weight = _permute(weight, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            weight = weight + 1
        out[to_gguf[name]] = np.ascontiguousarray(weight)
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaving of q/k rows for its RoPE (its loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def stored_weights(model: Any, quant: str) -> dict[str, torch.Tensor]:
    """The model's weights as a conversion of its `quant` GGUF stores them: each matrix
    through the file's type and back (gguf's own quantize and dequantize), then, like
    every tensor, rounded to the conversion's bfloat16; returned in float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[quant]
    out = {}
    for name, tensor in model.state_dict().items():
        weight = tensor.float()
        if weight.ndim == 2 and quant == "F16":
            weight = weight.half().float()
        elif weight.ndim == 2:
            raw = quantize(weight.numpy(), qtype)
            weight = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype)))
            weight = weight.reshape(tensor.shape)
        out[name] = weight.to(torch.bfloat16).float()
    return out


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def k_mix_type(gguf_name: str) -> str:
    """A matrix's type in a Q4_K_M file, as llama.cpp's mix gives it more bits where 4
    cost most: the output projection and the down projections Q6_K, the rest Q4_K."""
    return "Q6_K" if gguf_name == "output.weight" or "ffn_down" in gguf_name else "Q4_K"


def quantize_k(weight: np.ndarray, kind: str) -> np.ndarray:
    """[N, K] float (K a multiple of 256) as `kind` (Q4_K, Q5_K or Q6_K) blocks: [N,
    K/256 * block bytes] uint8, laid out as `gguf.quants` dequantises them (gguf has no
    K-quant quantiser). Each sub-block min/max (Q4_K/Q5_K) or absmax (Q6_K), its scale
    in 6 or 8 bits of the super-block's f16 one: not llama.cpp's search for the best
    scales, but valid blocks of realistic codes."""
    n, k = weight.shape
    w = weight.astype(np.float32).reshape(-1, 256)
    f16 = np.float16
    if kind == "Q6_K":
        step = np.abs(w.reshape(-1, 16, 16)).max(-1) / 31  # [B, 16]
        d = (step.max(-1, keepdims=True) / 127).astype(f16)  # [B, 1]
        d32 = np.where(d == 0, 1, d.astype(np.float32))
        sc = np.clip(np.round(step / d32), 1, 127).astype(np.int8)
        unit = np.repeat(d32 * sc, 16, axis=1)
        q = (np.clip(np.round(w / unit), -32, 31) + 32).astype(np.uint8)  # [B, 256]
        halves = q.reshape(-1, 2, 4, 32)  # [B, half of 128, quarter, 32]
        ql = (halves[:, :, 0:2] & 0x0F) | ((halves[:, :, 2:4] & 0x0F) << 4)  # [B, 2, 2, 32]
        hi = halves >> 4
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                               sc.view(np.uint8), d.view(np.uint8)], axis=1).reshape(n, -1)
    top = 15 if kind == "Q4_K" else 31
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [B, 8]: w = q step - offset, offset = -lo >= 0
    step = (sub.max(-1) - lo) / top
    d = (step.max(-1, keepdims=True) / 63).astype(f16)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(f16)
    d32 = np.where(d == 0, 1, d.astype(np.float32))
    m32 = np.where(dmin == 0, 1, dmin.astype(np.float32))
    sc = np.clip(np.round(step / d32), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / m32), 0, 63).astype(np.uint8)
    unit = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.round((sub + (dmin.astype(np.float32) * mn)[..., None])
                         / np.where(unit == 0, 1, unit)), 0, top).astype(np.uint8)
    # The inverse of gguf's Q4_K.get_scale_min: 6-bit scales and mins in 12 bytes.
    scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2c (low nibble) and 2c + 1 (high)
    qs = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), scales]
    if kind == "Q5_K":  # bit j of byte i: sub-block j's code i's fifth bit
        bits = (q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(bits, axis=1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1).reshape(n, -1)
