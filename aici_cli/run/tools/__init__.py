"""Tools the host serves: a line's calls to tools of MCP servers run inside the run, round
after round, and its result is the transcript; a controller's calls (`aici:tools`) reach
the tools `--allow-tool` names (docs/tools.md).

    host          `open_tool_host`: the servers (or a replay), before the model loads;
                  `guest_tool_host`: those the controllers may call (`--allow-tool`);
                  `served`: their tools, as the run's start lists them;
                  `run_lines`: a backend's run with the tool rounds around it;
                  `with_restarts`: the servers' restarts in the run summary
    servers       `ToolServers`: MCP client sessions on a thread of their own (imports mcp)
    restarts      `ServerGuard`: a server's calls across its crashes: restarts within a
                  budget, with back-off; the calls a crash caught retried alone; the blame
    loop          `ToolLoop`: results with calls held back, next rounds handed in
    conversation  `Conversation`: one line's rounds, its next job, its transcript
    calls         `CallOutcome`, `ToolHost`, answers as untrusted text
    guest         `GuestToolHost`: the controllers' calls (`aici:tools`), allowed, answered
                  as their `result<string, string>`
    record        `--tool-record` and `--tool-replay`

Torch-free; only `servers` imports the `mcp` package, when a run has servers.
"""
