"""Per-peer runners for `bench/peers.py`, one small module per contender.

Each module exposes `REQUIRES` (top-level packages it imports, checked without importing
them, so a missing peer is reported as "not installed" instead of crashing) and
`run(model, tokenizer, prompts, schemas, batch_size, max_tokens) -> PeerRun`. Heavy
imports happen inside `run`, so the orchestrator can list peers without loading torch.
"""
