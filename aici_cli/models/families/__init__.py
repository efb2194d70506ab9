"""The model families the project builds as its own PyTorch modules, and what it borrows
from transformers for the rest.

Llama, Mistral, Qwen 2, Qwen 3 and Gemma 3 (text) are one module parameterised by the
config (`llama.py`): transformers' logits bit for bit, without importing transformers'
model classes (~1.8 s and ~130 MB at start-up). Other architectures load through
transformers, with what its loader decides computed by its own code. A new family with the
same block structure is a new set of config defaults in `decoder_shape.py`, not a module.

Modules (all import torch):

    llama.py               the causal LM: embedding, decoder layers, norm, output projection
    decoder_shape.py       which config.json files llama.py builds, and their fields
    transformers_build.py  attention implementation and init-computed buffers, as transformers
    softcap.py             soft-capped attention logits (Gemma 2) for the engine's passes
"""
