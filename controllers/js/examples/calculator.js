// Ask a tool, then write its answer: a controller that calls a tool the run serves
// (calculator.py in JavaScript).
//
//   aici-batch run prompts.jsonl --controller calculator_js.wasm \
//       --mcp calc="python examples/tools/calc_server.py" --allow-tool multiply
//
// It lists the tools it may call (logged, and the "tools" output), calls one, and forces
// " Answer: <the tool's answer>" into the text; the model writes nothing: the tool decides.
// A call the host refuses or cannot answer (a tool not on --allow-tool, a server that hangs
// past --tool-timeout) is handled: " Answer: unknown (<error type>)".
//
// Arg (JSON, optional): {"tool": "multiply", "arguments": {"a": 17, "b": 23}} (the default).
// Outputs: "tools" (the names it may call), then "answer" (the tool's text) or "error" (the
// host's error type, e.g. "tool_not_allowed") and "message".

import { ToolError, fixed, log, setOutput, tools } from "aici-controller";

export default function* calculator(ctx) {
  const arg = ctx.argJson();
  const name = arg.tool ?? "multiply";
  const args = arg.arguments ?? { a: 17, b: 23 };
  const listed = tools.listTools();
  setOutput("tools", listed.map((tool) => tool.name));
  for (const tool of listed) log(`tool ${tool.name}: ${tool.description}`);
  let answer;
  try {
    answer = tools.callTool(name, args); // waits for the answer
  } catch (e) {
    if (!(e instanceof ToolError)) throw e;
    setOutput("error", e.type);
    setOutput("message", e.detail);
    yield fixed(` Answer: unknown (${e.type})\n`);
    return;
  }
  setOutput("answer", answer);
  yield fixed(` Answer: ${answer}\n`); // the tool's text, forced: no token is sampled
}
