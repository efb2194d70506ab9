// The tools a controller may call (aici:tools@0.1.0) in plain node: the calculator
// example and `tools` under the stub host's fake tools, and the component glue over fake
// `tools` imports. Run: `node --test controllers/js/test/`.

import assert from "node:assert/strict";
import { test } from "node:test";

import { ToolError, fixed, tools } from "aici-controller";
import { StubHost } from "aici-controller/testing";

import calculator from "../examples/calculator.js";
import { controllerExport } from "../sdk/wit/bindings.js";

const multiply = { call: (a) => a.a * a.b, description: "Multiply two numbers.", inputSchema: { type: "object" } };

test("the calculator lists its tools, calls one and forces the answer", () => {
  const host = new StubHost({ tools: { multiply, add: (a) => a.a + a.b }, allowTools: ["multiply"] });
  const run = host.run(calculator);
  assert.equal(run.error, null);
  assert.equal(run.text, " Answer: 391\n");
  assert.deepEqual(run.outputs, { tools: ["multiply"], answer: "391" });
  assert.deepEqual(run.logs, ["tool multiply: Multiply two numbers."]);
  assert.deepEqual(run.toolCalls, [{ name: "multiply", arguments: '{"a":17,"b":23}', ok: true, text: "391" }]);
});

test("a tool not on allowTools is refused, and the calculator handles it", () => {
  const host = new StubHost({ tools: { multiply, add: (a) => a.a + a.b }, allowTools: ["multiply"] });
  const run = host.run(calculator, { arg: '{"tool": "add", "arguments": {"a": 1, "b": 2}}' });
  assert.equal(run.error, null);
  assert.equal(run.text, " Answer: unknown (tool_not_allowed)\n");
  assert.equal(run.outputs.message, "tool 'add' is not on --allow-tool");
});

test("host errors, tool errors, bad arguments and answers as untrusted text", () => {
  const hung = () => {
    throw new ToolError("tool_timeout", "tool slow did not answer within 1 s (--tool-timeout)");
  };
  const raises = () => {
    throw new Error("division by zero");
  };
  const host = new StubHost({ tools: { hung, raises, noisy: () => "a\u0007b\r\nc", json: () => ({ x: 1 }) } });
  const seen = [];
  function* probe() {
    for (const [name, args] of [["hung", {}], ["raises", {}], ["noisy", {}], ["json", {}], ["json", "[1]"], ["none", {}]]) {
      try {
        seen.push(["ok", tools.callTool(name, args)]);
      } catch (e) {
        assert.ok(e instanceof ToolError);
        seen.push([e.type, e.detail]);
      }
    }
    yield fixed("done");
  }
  const run = host.run(probe);
  assert.equal(run.error, null);
  assert.deepEqual(seen, [
    ["tool_timeout", "tool slow did not answer within 1 s (--tool-timeout)"],
    ["tool_error", "division by zero"],
    ["ok", "ab\nc"],
    ["ok", '{"x":1}'],
    ["tool_bad_arguments", "the arguments of json are not a JSON object"],
    ["tool_not_allowed", "tool 'none' is not on --allow-tool"],
  ]);
  assert.deepEqual(run.toolCalls.map((c) => c.ok), [false, false, true, true, false, false]);
});

test("an uncaught ToolError ends the sequence with its type", () => {
  function* careless() {
    tools.callTool("missing");
    yield fixed("never");
  }
  const run = new StubHost().run(careless);
  assert.equal(run.error, "ToolError: tool_not_allowed: tool 'missing' is not on --allow-tool");
});

test("the component glue maps call-tool's result onto [ok, text], and needs aici:tools", () => {
  const saved = { ...console };
  try {
    const calls = [];
    const host = new StubHost();
    const wit = {
      contract: "aici:controller@0.2.0",
      canFork: true,
      tokenizer: {
        vocabSize: () => host.vocabSize(),
        eosToken: () => host.eosToken(),
        tokenize: (text) => Uint32Array.from(host.tokenize(text)),
        decode: (tokens) => host.decode(tokens),
        tokenBytes: (token) => host.tokenBytes(token),
        tokensMatching: () => 1,
      },
      host: { log: (m) => calls.push(["log", m]), setOutput: (k, v) => calls.push(["set", k, v]) },
      storage: null,
      tools: {
        listTools: () => [{ name: "multiply", description: "Multiply.", inputSchema: '{"type": "object"}' }],
        callTool: (name, args) => {
          calls.push(["call", name, args]);
          if (name !== "multiply") throw Object.assign(new Error("err"), { payload: `tool_not_allowed: tool '${name}' is not on --allow-tool` });
          return "391.0";
        },
      },
    };
    const { Runner } = controllerExport({ default: calculator }, "calculator.js", wit);
    const action = new Runner("", []).midProcess({ backtrack: 0, tokens: new Uint32Array() });
    assert.deepEqual(action, { tag: "splice", val: { backtrack: 0, ffTokens: host.tokenize(" Answer: 391.0\n") } });
    assert.deepEqual(calls, [
      ["set", "tools", '["multiply"]'],
      ["log", "tool multiply: Multiply."],
      ["call", "multiply", '{"a":17,"b":23}'],
      ["set", "answer", '"391.0"'],
    ]);
    const refused = new Runner('{"tool": "add"}', []).midProcess({ backtrack: 0, tokens: [] });
    assert.deepEqual(refused.val.ffTokens, host.tokenize(" Answer: unknown (tool_not_allowed)\n"));

    const { Runner: Old } = controllerExport({ default: calculator }, "calculator.js", { ...wit, tools: null });
    assert.throws(() => new Old("", []).midProcess({ backtrack: 0, tokens: [] }),
      (e) => e === "Error: tools.listTools() needs the aici:tools@0.1.0 import; this controller was built against aici:controller@0.2.0");
  } finally {
    Object.assign(console, saved);
  }
});
