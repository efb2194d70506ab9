"""Random-weight Llama models at real shapes, built where they run: for a machine that
has no copy of the default model's GGUF and cannot fetch one (a lent GPU machine takes at
most 64 MiB with the working tree; the GGUF is 98 MB).

Shapes: `default` is SmolLM2-135M's (hidden 576, 30 layers, intermediate 1536, 9 heads,
3 key/value heads, vocabulary 49,152, tied embeddings), `1b` TinyLlama-1.1B's (hidden
2048, 22 layers, intermediate 5632, 32 heads, 4 key/value heads, vocabulary 32,000).
Weights are normal * 0.02 from a fixed seed, stored in bfloat16; the tokenizer is the
test suite's small byte-level BPE (trained in under a second, ids below the vocabulary),
with its chat template. Speed depends on the shapes, not on the weights or the text.

    python bench/random_llama.py out/models default 1b   # prints each model's folder
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

SHAPES = {
    "default": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "1b": dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632,
               num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
               tie_word_embeddings=False, rope_theta=10000.0),
}


def build(folder: Path, shape: str) -> Path:
    """The model of `shape` in `folder/shape` (built once: an existing one is kept)."""
    import torch
    from tiny_model import BOS, CHAT_TEMPLATE, EOS, _build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = folder / shape
    if (out / "config.json").is_file():
        return out
    backend = _build_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS,
                                        eos_token=EOS, model_max_length=8192)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=backend.token_to_id(BOS),
                         eos_token_id=backend.token_to_id(EOS), torch_dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        for name, tensor in model.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    tensor.fill_(1.0)
                else:
                    tensor.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> int:
    if len(sys.argv) < 3 or any(s not in SHAPES for s in sys.argv[2:]):
        print(f"usage: random_llama.py FOLDER {{{','.join(SHAPES)}}}...", file=sys.stderr)
        return 2
    for shape in sys.argv[2:]:
        print(build(Path(sys.argv[1]), shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
