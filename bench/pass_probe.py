"""Where a row's numbers first depend on its neighbours: one line's tokens fed through the
engine's eager passes (`engine/forward/passes.py: ModelPass`, the compiled step off)
twice, once alone in row 0 and once beside other rows, and every module's output at the
row's own tokens compared, pass by pass and layer by layer.

The pass sequences mirror a run's: the prompt in one pass (beside: packed with the
neighbours' prompts), then the line's tokens one at a time (beside: each pass with the
neighbours' next tokens too, `--neighbour-chunk` tokens each, so one-token passes and
wider ones can be told apart). The first module whose output at the row's tokens differs
names the path (a linear layer's kernel, attention, a norm).

    python bench/pass_probe.py --dtype bfloat16 --steps 8 --neighbours 7
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def _outputs(model: Any, keep: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """Forward hooks recording every module's output at the packed tokens [0, keep) (row
    0's tokens come first in a pass), where the output is [1, T, ...]."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(module: Any, args: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == 1:
                seen[name] = t[0, :keep].detach().clone()
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    return seen, handles


def _passes(lm: Any, prompt: list[int], tokens: list[int], others: list[list[int]],
            chunk: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Row 0 feeds `prompt`, then `tokens` one a pass; rows 1.. (`others`) feed their
    prompts beside it, then `chunk` tokens of their own a pass. Each pass's recorded
    module outputs at row 0's tokens and row 0's next-token logits."""
    from aici_cli.engine.forward.attention import install
    from aici_cli.engine.forward.cache import row_cache
    from aici_cli.engine.forward.passes import ModelPass

    install(lm.model)
    rows = 1 + len(others)
    cache = row_cache(lm.model, lm.model.config.num_hidden_layers, rows, 256)
    model_pass = ModelPass(lm, cache, compile="off")
    lengths = [0] * rows
    chunks = [prompt, *others]
    out = []
    for step in range(len(tokens) + 1):
        seen, handles = _outputs(lm.model, len(chunks[0]))
        try:
            with torch.inference_mode():
                result = model_pass.run(0, lengths, chunks, [[] for _ in chunks])
        finally:
            for h in handles:
                h.remove()
        out.append((seen, result.next_token_logits(rows)[0].float().clone()))
        lengths = [a + len(c) for a, c in zip(lengths, chunks)]
        if step == len(tokens):
            break
        # The neighbours feed on from their own prompt's last token (any token will do).
        chunks = [[tokens[step]], *([o[-1]] * chunk for o in others)]
    return out


def prompt_ids(lm: Any, job: Any) -> list[int]:
    """`job`'s prompt as the engine tokenizes it (a chat request rendered)."""
    from aici_cli.models.tokenizer.chat import render_prompt

    if job.messages is not None:
        text = render_prompt(lm.tokenizer, job.messages, job.tools)
        return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(lm.tokenizer(job.prompt, add_special_tokens=True)["input_ids"])


def where_rows_part(lm: Any, job: Any, tokens: list[int], neighbours: list[Any],
                    chunk: int = 1) -> str:
    """Where `job`'s logits, over its greedy `tokens`, first differ between a pass alone
    and the same passes beside `neighbours`' prompts (one line of text per finding)."""
    prompt = prompt_ids(lm, job)
    others = [prompt_ids(lm, j) for j in neighbours]
    alone = _passes(lm, prompt, tokens, [], chunk)
    beside = _passes(lm, prompt, tokens, others, chunk)
    for step, ((a_seen, a_logits), (b_seen, b_logits)) in enumerate(zip(alone, beside)):
        if torch.equal(a_logits, b_logits):
            continue
        first = next((n for n in a_seen if n in b_seen
                      and not torch.equal(a_seen[n], b_seen[n])), None)
        diff = (a_logits - b_logits).abs().max().item()
        kind = "the prompt's pass" if step == 0 else f"one-token pass {step}"
        top = (a_logits.argmax().item(), b_logits.argmax().item())
        return (f"{job.id}: logits part at {kind} (max |diff| {diff:.3g}, argmax "
                f"{top[0]} / {top[1]}); first module that differs: {first}")
    return f"{job.id}: the same logits alone and beside {len(neighbours)} rows"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--neighbours", type=int, default=7)
    ap.add_argument("--neighbour-chunk", type=int, default=1)
    args = ap.parse_args()

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from batch_invariance import workload

    from aici_cli.models.load import load_model

    lm = load_model(args.model, "cpu", args.dtype, args.quantize)
    jobs = workload(4, args.steps)
    print(f"model {lm.name}: dtype {lm.dtype}, quantize {lm.quantize}")
    for job in jobs:
        # Any tokens do to compare two compositions: the prompt's own, repeated.
        tokens = prompt_ids(lm, job)[-args.steps:]
        others = [j for j in jobs if j is not job][: args.neighbours]
        print(where_rows_part(lm, job, tokens, others, args.neighbour_chunk), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
