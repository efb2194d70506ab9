// The JavaScript guest SDK in plain node: the examples under the stub host, the step
// protocol, checks, and the component glue (`wit/bindings.js`) over fake imports.
// Run: `node --test controllers/js/test/` (tests/sdk/test_js_sdk.py runs it from pytest).

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  ALL,
  Allow,
  Bitmask,
  Deny,
  Fork,
  Generate,
  Matching,
  Sample,
  Splice,
  Stop,
  TokenController,
  allow,
  backtrack,
  checkController,
  deny,
  findController,
  fixed,
  fork,
  gen,
  genJson,
  log,
  notMatching,
  sample,
  setLineOutput,
  setOutput,
  spliceTokens,
  stop,
  storage,
  tokensMatching,
} from "aici-controller";
import { StubHost, StubHostError } from "aici-controller/testing";

import * as noLowercaseModule from "../examples/no_lowercase.js";
import profile from "../examples/profile.js";
import rewrite from "../examples/rewrite.js";
import yesNo from "../examples/yes_no.js";
import { controllerExport, toWit } from "../sdk/wit/bindings.js";

const noLowercase = noLowercaseModule.default;
const hasLowercase = (text) => /[a-z]/.test(text);

// --- the examples -------------------------------------------------------------------

test("yes_no runs two segments and sets outputs", () => {
  const host = new StubHost({ respond: ["no", "Grass is green, not blue.\n"] });
  const run = host.run(yesNo, { arg: '{"question": "Is grass blue?"}', prompt: "Q: " });
  assert.equal(run.error, null);
  assert.deepEqual(run.trace, [
    'fixed(" Answer: ")',
    'gen({choices: ["yes","no"], maxTokens: 256})',
    'fixed("\\nReason: ")',
    'gen({regex: "[^\\\\n]{1,120}\\\\n", maxTokens: 60})',
    "stop()",
  ]);
  assert.deepEqual(run.outputs, { answer: "no", reason: "Grass is green, not blue." });
  assert.deepEqual(run.logs, ["question: Is grass blue?"]);
  assert.equal(run.text, " Answer: no\nReason: Grass is green, not blue.\n");
});

test("yes_no: the default answer is the first choice and the arg is optional", () => {
  const respond = (segment) => (segment.grammar.kind === "choice" ? "yes" : "Because.\n");
  const run = new StubHost({ respond }).run(yesNo);
  assert.deepEqual(run.outputs, { answer: "yes", reason: "Because." });
  assert.deepEqual(run.logs, []);
});

test("no_lowercase samples only tokens without lowercase", () => {
  const host = new StubHost({ sampler: (allowed) => allowed[allowed.length >> 1] });
  const run = host.run(noLowercase, { arg: '{"max_tokens": 5}' });
  assert.equal(run.error, null);
  assert.deepEqual(run.trace, [...Array(5).fill('sample(notMatching("(?s).*[a-z].*"))'), "stop()"]);
  assert.equal(run.tokens.length, 5);
  assert.ok(!hasLowercase(run.text));
  assert.deepEqual(run.outputs, { tokens: 5 });
});

test("no_lowercase's set excludes every lowercase token", () => {
  const host = new StubHost();
  const session = host.start(noLowercase);
  const action = session.step(0, []);
  assert.ok(action instanceof Sample && action.tokens instanceof Matching);
  const texts = host.allowed(action.tokens).map((t) => host.decode([t]));
  assert.ok(!texts.some(hasLowercase));
  assert.ok(texts.includes("A") && texts.includes("\n") && texts.includes("")); // EOS is ""
  assert.equal(texts.length, host.vocabSize() - 26);
});

test("no_lowercase defaults to 16 tokens, stops at EOS, rejects max_tokens < 1", () => {
  let run = new StubHost({ sampler: (allowed) => allowed[allowed.length - 1] }).run(noLowercase);
  assert.equal(run.tokens.length, 16);
  assert.ok(run.actions.at(-1) instanceof Stop);
  run = new StubHost({ sampler: (allowed) => allowed[0] }).run(noLowercaseModule); // id 0: EOS
  assert.deepEqual(run.tokens, [0]);
  assert.deepEqual(run.outputs, { tokens: 1 });
  run = new StubHost().run(noLowercase, { arg: '{"max_tokens": 0}' });
  assert.equal(run.error, "Error: max_tokens must be at least 1, got 0");
});

test("profile chains fixed text, a JSON segment and free text", () => {
  const person = { name: "Ada", age: 36, languages: ["en", "fr"] };
  const host = new StubHost({ respond: [JSON.stringify(person), "Wrote the first program.\nIgnored."] });
  const run = host.run(profile);
  assert.equal(run.error, null);
  assert.deepEqual(
    run.actions.map((a) => a.constructor.name),
    ["Splice", "Generate", "Splice", "Generate", "Stop"],
  );
  const [schemaSegment, bioSegment] = [run.actions[1], run.actions[3]];
  assert.equal(schemaSegment.grammar.kind, "json-schema");
  assert.deepEqual(JSON.parse(schemaSegment.grammar.value).required, ["name", "age", "languages"]);
  assert.equal(schemaSegment.maxTokens, 120);
  assert.equal(String(bioSegment), 'gen({maxTokens: 40, stop: ["\\n"]})');
  assert.deepEqual(run.outputs, { profile: person, name: "Ada", bio: "Wrote the first program." });
  assert.ok(run.text.endsWith("\nBio: Wrote the first program.\n"));
});

test("profile: the bio is cut at max_bio_tokens, truncated JSON is the error", () => {
  let host = new StubHost({ respond: ['{"name": "A", "age": 1, "languages": []}', "abcdefgh\n"] });
  assert.equal(host.run(profile, { arg: '{"max_bio_tokens": 3}' }).outputs.bio, "abc");
  host = new StubHost({ respond: [JSON.stringify({ name: "x".repeat(200), age: 1, languages: [] })] });
  const run = host.run(profile);
  assert.match(run.error, /^SyntaxError: genJson: the segment is not complete JSON/);
  assert.match(run.error, /maxTokens=120/);
  assert.match(run.trace.at(-1), /^gen\(\{jsonSchema: /); // no action after the failure
});

test("rewrite backtracks a lowercase word and keeps a capitalized one", () => {
  let run = new StubHost({ respond: ["paris"] }).run(rewrite);
  assert.deepEqual(run.trace, [
    'fixed("Name: ")',
    'gen({regex: "[A-Za-z]{1,12}", maxTokens: 8})',
    'backtrack(5, "Paris")',
    'fixed(".\\n")',
    "stop()",
  ]);
  assert.deepEqual(run.outputs, { word: "paris", final: "Paris", rewrote: true });
  assert.equal(run.text, "Name: Paris.\n");
  run = new StubHost({ respond: ["Rome"] }).run(rewrite);
  assert.ok(!run.trace.join(" ").includes("backtrack"));
  assert.deepEqual(run.outputs, { word: "Rome", final: "Rome", rewrote: false });
});

test("every example's default export is a controller", () => {
  assert.equal(checkController(yesNo).kind, "generator");
  assert.equal(checkController(profile).name, "profile");
  assert.equal(findController(noLowercaseModule).kind, "token");
});

// --- the step protocol --------------------------------------------------------------

test("the first step has no tokens and each yield receives the right value", () => {
  const received = [];
  function* probe(ctx) {
    received.push(yield sample(ALL));
    received.push(yield gen({ maxTokens: 4 }));
    received.push(yield gen({ maxTokens: 4 }));
    received.push(yield fixed("ab"));
    received.push([[...ctx.tokens], ctx.lastBacktrack, [...ctx.lastTokens]]);
    received.push(yield fork(3));
    received.push(ctx.branch);
  }
  const host = new StubHost();
  const [a, b] = host.tokenize("ab");
  const session = host.start(probe);
  assert.ok(session.step(0, []) instanceof Sample);
  assert.ok(session.step(0, [a]) instanceof Generate);
  assert.ok(session.step(0, [a, b], "seg-text") instanceof Generate);
  assert.deepEqual(session.step(0, [b]), new Splice(0, "ab", [a, b])); // no text: decoded
  assert.deepEqual(session.step(0, [a, b]), new Fork(3)); // the splice's echo, then fork
  assert.ok(session.step(0, [], null, 2) instanceof Stop);
  assert.deepEqual(received, [a, "seg-text", "b", undefined, [[a, a, b, b, a, b], 0, [a, b]], 2, 2]);
});

test("a splice's echo and a backtrack update ctx.tokens", () => {
  const seen = [];
  class Recorder extends TokenController {
    step(ctx) {
      seen.push([[...ctx.tokens], ctx.lastBacktrack]);
      if (ctx.tokens.length === 3 && !ctx.lastBacktrack) return backtrack(1, "z");
      return sample(ALL);
    }
  }
  const session = new StubHost().start(Recorder);
  session.step(0, []);
  session.step(0, [1, 2, 3]);
  assert.deepEqual(session.step(1, [9]), sample(ALL));
  assert.deepEqual(seen, [[[], 0], [[1, 2, 3], 0], [[1, 2, 9], 1]]);
});

test("returning from the generator and stop() end the sequence; finally blocks run", () => {
  const events = [];
  function* short() {
    yield fixed("x");
  }
  function* explicit() {
    try {
      yield stop();
      throw new Error("not resumed after stop()");
    } finally {
      events.push("finally");
    }
  }
  const host = new StubHost();
  assert.deepEqual(host.run(short).trace, ['fixed("x")', "stop()"]);
  const session = host.start(explicit);
  assert.ok(session.step(0, []) instanceof Stop);
  assert.ok(session.finished && session.step(0, []) instanceof Stop);
  assert.deepEqual(events, ["finally"]);
});

test("a JS exception becomes 'Name: message' and is logged with the user's frames", () => {
  function* failing() {
    yield fixed("a");
    helper();
  }
  function helper() {
    throw new RangeError("missing");
  }
  const run = new StubHost().run(failing);
  assert.equal(run.error, "RangeError: missing");
  assert.deepEqual(run.trace, ['fixed("a")']);
  assert.equal(run.logs.length, 1);
  assert.match(run.logs[0], /^controller error: RangeError: missing \(at sdk\.test\.js:\d+ in helper <- sdk\.test\.js:\d+ in failing/);
  assert.ok(!run.logs[0].includes("session.js")); // SDK frames are left out

  function* plainError() {
    yield* [];
    throw new Error("plain");
  }
  assert.equal(new StubHost().run(plainError).error, "Error: plain");
  function* thrownString() {
    yield* [];
    throw "just a string"; // eslint-disable-line no-throw-literal
  }
  assert.equal(new StubHost().run(thrownString).error, 'Uncaught "just a string"');
});

test("a failed session keeps failing", () => {
  class Broken extends TokenController {
    start() {
      throw new Error("bad start");
    }
    step() {
      return stop();
    }
  }
  const session = new StubHost().start(Broken);
  assert.throws(() => session.step(0, []), { name: "ControllerFailed", message: "Error: bad start" });
  assert.throws(() => session.step(0, []), { message: "the controller already failed: Error: bad start" });
});

test("a bad arg is an error, not a crash", () => {
  const run = new StubHost().run(yesNo, { arg: "{oops" });
  assert.match(run.error, /^SyntaxError: the controller arg is not JSON \(.*\): "\{oops"$/);
});

test("yielding a non-action is a clear error", () => {
  for (const [value, message] of [
    ["text", 'controller wrong yielded string "text": expected an action'],
    [undefined, "controller wrong yielded undefined: expected an action"],
    [genJson({ type: "object" }), "use `x = yield* genJson(...)`, not `yield genJson(...)`"],
  ]) {
    const wrong = function* wrong() {
      yield value;
    };
    const run = new StubHost().run(wrong);
    assert.ok(run.error.includes(message), run.error);
  }
  class Forgetful extends TokenController {
    step() {}
  }
  assert.equal(
    new StubHost().run(Forgetful).error,
    "TypeError: Forgetful.step() returned undefined: expected an action " +
      "(fixed(...), gen(...), sample(...), backtrack(...) or stop())",
  );
});

test("backtracking past the generated tokens is an error", () => {
  function* greedy() {
    yield fixed("ab");
    yield backtrack(3);
  }
  assert.equal(
    new StubHost().run(greedy).error,
    "RangeError: backtrack(3) removes more than the 2 tokens generated so far",
  );
});

test("TokenController: start runs once and steps see the new tokens", () => {
  const calls = [];
  class Counter extends TokenController {
    start(ctx) {
      this.n = ctx.argJson().n;
      calls.push(["start", ctx.arg, [...ctx.prompt]]);
    }
    step(ctx, newTokens) {
      calls.push([...newTokens]);
      return ctx.tokens.length >= this.n ? stop() : sample(allow([7]));
    }
  }
  const run = new StubHost().run(Counter, { arg: '{"n": 2}', prompt: [4, 5] });
  assert.deepEqual(calls, [["start", '{"n": 2}', [4, 5]], [], [7], [7]]);
  assert.deepEqual(run.tokens, [7, 7]);
  assert.deepEqual(run.trace, ["sample(allow([7]))", "sample(allow([7]))", "stop()"]);
});

test("token sets are resolved once per pattern", () => {
  const patterns = [];
  class CountingHost extends StubHost {
    tokensMatching(pattern) {
      patterns.push(pattern);
      return super.tokensMatching(pattern);
    }
  }
  class Digits extends TokenController {
    step(ctx) {
      if (ctx.tokens.length === 4) return stop();
      return sample(ctx.tokens.length % 2 ? tokensMatching("[0-9]") : notMatching("."));
    }
  }
  const host = new CountingHost();
  const run = host.run(Digits);
  assert.deepEqual(patterns, [".", "[0-9]"]);
  assert.ok(run.tokens.filter((_, i) => i % 2).every((t) => /^[0-9]$/.test(host.decode([t]))));
  assert.ok(run.tokens.filter((_, i) => i % 2 === 0).every((t) => ["", "\n"].includes(host.decode([t]))));
});

test("a pattern the host rejects fails the step that samples with it", () => {
  class Bad extends TokenController {
    step() {
      return sample(tokensMatching("[unclosed"));
    }
  }
  const run = new StubHost().run(Bad);
  assert.match(run.error, /^SyntaxError: tokensMatching\("\[unclosed"\): /);
});

test("module-level helpers need a running controller", () => {
  assert.throws(() => log("x"), /no running controller/);
  assert.throws(() => setOutput("k", 1), /no running controller/);
  assert.throws(() => storage.get("k"), /no running controller/);
});

test("outputs are JSON; values JSON cannot hold are errors", () => {
  function* outputs(ctx) {
    setOutput("n", 3);
    setOutput("obj", { a: [1, null] });
    ctx.setOutput("viaCtx", "s");
    log("two", { lines: 2 }, "\nhere");
    setOutput("bad", undefined);
    yield stop();
  }
  const run = new StubHost().run(outputs);
  assert.deepEqual(run.outputs, { n: 3, obj: { a: [1, null] }, viaCtx: "s" });
  assert.deepEqual(run.logs.slice(0, 2), ['two {"lines":2} ', "here"]);
  assert.match(run.error, /^TypeError: setOutput\("bad", \.\.\.\): the value must be JSON-serializable/);
  function* big() {
    yield* [];
    setOutput("big", 10n);
  }
  assert.match(new StubHost().run(big).error, /must be JSON-serializable: /);
});

test("the context exposes the host tokenizer", () => {
  function* inspect(ctx) {
    yield fixed("hi");
    setOutput("text", ctx.text());
    setOutput("decoded", ctx.decode(ctx.tokenize("ok")));
    setOutput("bytes", Array.from(ctx.tokenBytes(ctx.tokens[0])));
    setOutput("eos", ctx.eosToken);
    setOutput("vocab", ctx.vocabSize);
    setOutput("atEos", ctx.atEos);
  }
  const host = new StubHost();
  assert.deepEqual(host.run(inspect).outputs, {
    text: "hi",
    decoded: "ok",
    bytes: ["h".charCodeAt(0)],
    eos: 0,
    vocab: host.vocabSize(),
    atEos: false,
  });
});

test("fork gives each branch its index; storage and line outputs are shared", () => {
  function* vote(ctx) {
    yield fixed("Q");
    const branch = yield fork(3);
    const answer = yield gen({ choices: ["yes", "no"] });
    const length = storage.append("votes", `${branch}:${answer};`);
    setOutput("branch", branch);
    setLineOutput("votes", storage.getText("votes"));
    setLineOutput("length", length);
    setOutput("ctxBranch", ctx.branch);
  }
  const shared = new Map();
  const runs = [0, 1, 2].map((forkBranch) =>
    new StubHost({ forkBranch, storage: shared, respond: [forkBranch === 1 ? "no" : "yes"] }).run(vote),
  );
  assert.deepEqual(runs.map((r) => r.error), [null, null, null]);
  assert.deepEqual(runs.map((r) => r.outputs), [0, 1, 2].map((b) => ({ branch: b, ctxBranch: b })));
  assert.deepEqual(runs[2].lineOutputs, { votes: "0:yes;1:no;2:yes;", length: 17 });
  assert.deepEqual(runs[0].trace.slice(0, 3), ['fixed("Q")', "fork(3)", 'gen({choices: ["yes","no"], maxTokens: 256})']);
  function* bytes() {
    yield* [];
    storage.set("b", new Uint8Array([1, 2]));
    setOutput("b", Array.from(storage.get("b")));
    setOutput("none", storage.get("missing") ?? null);
    storage.set("n", 5);
  }
  const run = new StubHost().run(bytes);
  assert.deepEqual(run.outputs, { b: [1, 2], none: null });
  assert.equal(run.error, "TypeError: storage.set() takes a Uint8Array or a string value, got number");
  assert.throws(() => new StubHost({ forkBranch: 3 }).run(vote), StubHostError);
});

// --- checks on controllers, actions and token sets ----------------------------------

test("controllers are checked with clear messages", () => {
  const cases = [
    [function plain() {}, "controller plain is not a generator function: declare it `function*`"],
    [async function* asyncGen() {}, "controller asyncGen is async"],
    [async function asyncFn() {}, "controller asyncFn is async"],
    [class NotToken { step() {} }, "controller class NotToken must extend TokenController"],
    [class NoStep extends TokenController {}, "controller class NoStep does not define step(ctx, newTokens)"],
    [
      class NeedsArgs extends TokenController {
        constructor(limit) {
          super();
          this.limit = limit;
        }
        step() {}
      },
      "NeedsArgs must be constructible without arguments",
    ],
    [42, "the default export is number 42"],
  ];
  for (const [target, message] of cases) {
    assert.throws(() => checkController(target, "x.js"), (e) => e instanceof TypeError && e.message.includes(message), message);
  }
  assert.throws(() => findController({}, "x.js"), /^TypeError: x\.js has no default export: write `export default function\*/);
});

test("token set helpers and complements", () => {
  assert.deepEqual(allow([1, 2]), new Allow([1, 2]));
  assert.deepEqual(allow([1, 2]).invert(), new Deny([1, 2]));
  assert.deepEqual(deny([3]).invert(), allow([3]));
  assert.deepEqual(tokensMatching("[a-z]+").invert(), notMatching("[a-z]+"));
  assert.deepEqual(notMatching("x").invert().invert(), notMatching("x"));
  assert.equal(String(notMatching("x")), 'notMatching("x")');
  assert.equal(String(ALL), "ALL");
  assert.throws(() => ALL.invert(), /complement of ALL is empty/);
  assert.throws(() => allow([]), /at least one token/);
  assert.throws(() => deny([-1]), /is not a token id/);
  assert.throws(() => allow("12"), /takes an array of token ids/);
  assert.throws(() => sample([1, 2]), /takes a token set/);
  assert.throws(() => fork(1), /the branch count must be an integer >= 2/);
});

test("Bitmask sets one bit per token", () => {
  const mask = Bitmask.fromTokens([0, 33, 63], 70);
  assert.deepEqual(mask.words, [1, (2 | (1 << 31)) >>> 0, 0]);
  assert.equal(String(mask), "bitmask(3 tokens)");
  const host = new StubHost({ vocab: Array.from({ length: 70 }, (_, i) => String(i)), eos: "0" });
  assert.deepEqual(host.allowed(mask), [0, 33, 63]);
  assert.throws(() => Bitmask.fromTokens([70], 70), /outside the vocabulary/);
});

test("gen builds segments and checks its options", () => {
  const segment = gen({ jsonSchema: { type: "integer" }, maxTokens: 5, stop: "\n" });
  assert.equal(segment.grammar.value, '{"type":"integer"}');
  assert.deepEqual([...segment.stop], ["\n"]);
  assert.equal(segment.maxTokens, 5);
  assert.equal(gen().grammar, null);
  assert.deepEqual([...gen({ choices: ["a"] }).grammar.value], ["a"]);
  assert.equal(gen({ lark: "start: /a/" }).grammar.kind, "lark");
  assert.throws(() => gen({ regex: "a", choices: ["a"] }), /at most one grammar, got regex, choices/);
  assert.throws(() => gen({ choices: "ab" }), /array of strings/);
  assert.throws(() => gen({ choices: [] }), /nothing to choose from/);
  assert.throws(() => gen({ maxTokens: 0 }), /must be at least 1/);
  assert.throws(() => gen({ maxTokens: 1.5 }), /takes an integer/);
  assert.throws(() => gen({ jsonSchema: "{nope" }), /the schema is not JSON/);
  assert.throws(() => gen({ stop: [""] }), /non-empty string/);
  assert.throws(() => gen({ max_tokens: 5 }), /unknown option "max_tokens" \(it takes jsonSchema/);
  assert.throws(() => gen("a"), /takes an options object/);
});

test("splice builders", () => {
  assert.deepEqual(fixed("x"), new Splice(0, "x"));
  assert.equal(String(fixed("x")), 'fixed("x")');
  assert.deepEqual(backtrack(2), new Splice(2, ""));
  assert.equal(String(backtrack(2, "y")), 'backtrack(2, "y")');
  assert.deepEqual(spliceTokens(1, [5]), new Splice(1, "", [5]));
  assert.equal(String(spliceTokens(1, [5])), "spliceTokens(1, [5])");
  assert.throws(() => backtrack(-1), /token count must be an integer >= 0/);
  assert.throws(() => fixed(3), /fixed takes a string, got number 3/);
});

// --- the component glue over fake imports -------------------------------------------

function fakeWit(overrides = {}) {
  const calls = [];
  const host = new StubHost();
  const wit = {
    contract: "aici:controller@0.1.0",
    canFork: false,
    tokenizer: {
      vocabSize: () => host.vocabSize(),
      eosToken: () => host.eosToken(),
      tokenize: (text) => Uint32Array.from(host.tokenize(text)),
      decode: (tokens) => host.decode(tokens),
      tokenBytes: (token) => host.tokenBytes(token),
      tokensMatching: (pattern) => {
        if (pattern.startsWith("[")) throw Object.assign(new Error("err"), { payload: "bad pattern" });
        return 7;
      },
    },
    host: { log: (m) => calls.push(["log", m]), setOutput: (k, v) => calls.push(["set", k, v]) },
    storage: null,
    ...overrides,
  };
  return { wit, calls, host };
}

test("the runner export maps actions onto WIT values and errors onto err strings", () => {
  const saved = { ...console };
  try {
    const { wit, calls, host } = fakeWit();
    const { Runner } = controllerExport({ default: yesNo }, "yes_no.js", wit);
    const runner = new Runner('{"question": "q"}', Uint32Array.from([1, 2]));
    const first = runner.midProcess({ backtrack: 0, tokens: new Uint32Array(), segmentText: undefined });
    assert.deepEqual(first, { tag: "splice", val: { backtrack: 0, ffTokens: host.tokenize(" Answer: ") } });
    const second = runner.midProcess({ backtrack: 0, tokens: Uint32Array.from(first.val.ffTokens) });
    assert.deepEqual(second, {
      tag: "generate",
      val: { grammar: { tag: "choice", val: ["yes", "no"] }, maxTokens: 256, stop: [] },
    });
    runner.midProcess({ backtrack: 0, tokens: Uint32Array.from(host.tokenize("yes")), segmentText: "yes" });
    console.log("via console", 1);
    console.error("oops");
    assert.deepEqual(calls, [
      ["log", "question: q"],
      ["set", "answer", '"yes"'],
      ["log", "via console 1"],
      ["log", "stderr: oops"],
    ]);

    const bad = new Runner("{oops", []);
    assert.throws(() => bad.midProcess({ backtrack: 0, tokens: [] }), (e) => typeof e === "string" && e.startsWith("SyntaxError: the controller arg is not JSON"));
    assert.throws(() => bad.midProcess({ backtrack: 0, tokens: [] }), (e) => e.startsWith("the controller already failed: SyntaxError"));
  } finally {
    Object.assign(console, saved);
  }
});

test("WIT values: token sets, grammars, fork; 0.2.0 features fail clearly on 0.1.0", () => {
  assert.deepEqual(toWit(sample(notMatching("x"))), { tag: "sample", val: { tag: "not-host-set", val: null } });
  assert.deepEqual(toWit(new Sample(new Matching("x", false, 3))), { tag: "sample", val: { tag: "host-set", val: 3 } });
  assert.deepEqual(toWit(sample(deny([1]))), { tag: "sample", val: { tag: "deny", val: [1] } });
  assert.deepEqual(toWit(sample()), { tag: "sample", val: { tag: "all" } });
  assert.deepEqual(toWit(sample(new Bitmask([5]))), { tag: "sample", val: { tag: "bitmask", val: [5] } });
  assert.deepEqual(toWit(gen({ jsonSchema: "{}" })).val.grammar, { tag: "json-schema", val: "{}" });
  assert.equal(toWit(gen()).val.grammar, undefined);
  assert.deepEqual(toWit(fork(2)), { tag: "fork", val: 2 });
  assert.deepEqual(toWit(stop()), { tag: "stop" });

  const saved = { ...console };
  try {
    function* forks() {
      yield fork(2);
    }
    function* stores() {
      yield* [];
      storage.set("k", "v");
    }
    function* matches() {
      yield sample(tokensMatching("[x"));
    }
    const { wit } = fakeWit();
    const run = (fn) => {
      const { Runner } = controllerExport({ default: fn }, "x.js", wit);
      try {
        return new Runner("", []).midProcess({ backtrack: 0, tokens: [] });
      } catch (e) {
        return e;
      }
    };
    assert.equal(run(forks), "Error: fork(2) needs the aici:controller@0.2.0 contract; this controller was built against aici:controller@0.1.0");
    assert.equal(run(stores), "Error: storage.set() needs the aici:controller@0.2.0 contract; this controller was built against aici:controller@0.1.0");
    assert.equal(run(matches), 'SyntaxError: tokensMatching("[x"): bad pattern');
    const v2 = fakeWit({ canFork: true, contract: "aici:controller@0.2.0" }).wit;
    const { Runner } = controllerExport({ default: forks }, "x.js", v2);
    assert.deepEqual(new Runner("", []).midProcess({ backtrack: 0, tokens: [] }), { tag: "fork", val: 2 });
  } finally {
    Object.assign(console, saved);
  }
});
