"""The host side of controllers: the per-step contract, the built-in grammars, the wasm
host, and building and publishing the guests it runs.

    base.py            the per-step contract between the engine and a controller
    actions.py         Python mirrors of the WIT contract's types
    line_scope.py      what the sequences of one line share: storage, outputs
    stop_strings.py    the stop-string scan of lines and wasm segments
    tool_calls.py      tool calls by constraint: their text form and grammar
    guest_tools.py     the tools a guest may call (`aici:tools`), as a protocol
    call_trace.py      what a controller reports of its guest calls to a tracer
    schema_check.py    whether a JSON Schema can be a constraint (no tokenizer)
    schema_envelope.py a schema unwrapped from OpenAI's envelope
    grammar_check.py   whether a grammar or whitespace pattern can be used
    grammar/ *         built-in controllers on llguidance: JSON schema, regex, choice
    wasm/              the wasmtime host: engine, limits, instances, host functions
    componentize/      Python and JavaScript controllers built into components
    registry/          controllers as OCI artifacts: publish, pull, `oci://` references

(* imports llguidance and torch.) `componentize/` is not named build: pytest's default
`norecursedirs` and many tools skip folders of that name.
"""
