"""A controller written against the raw `aici:controller@0.1.0` bindings, without the SDK:
what a component built before contract 0.2.0 looks like to the host.

Built by the tests with componentize-py against tests/data/wit-0.1.0 (export renamed to
this module). Forces " v1:", samples `arg` tokens (default 3), logs the prompt's length,
sets `outputs.calls` and stops.
"""

from wit_world.exports import raw_v010 as bindings  # type: ignore[import-not-found]
from wit_world.imports import host, tokenizer, types  # type: ignore[import-not-found]


class Runner(bindings.Runner):  # type: ignore[misc]
    def __init__(self, arg: str, prompt: list[int]) -> None:
        self.calls = 0
        self.samples = int(arg) if arg else 3
        self.prompt_len = len(prompt)

    def mid_process(self, input: types.StepInput) -> types.Action:
        self.calls += 1
        if self.calls == 1:
            host.log(f"prompt tokens: {self.prompt_len}")
            return types.Action_Splice(types.Splice(0, tokenizer.tokenize(" v1:")))
        if self.calls <= 1 + self.samples:
            return types.Action_Sample(types.TokenSet_All())
        host.set_output("calls", str(self.calls))
        return types.Action_Stop()
